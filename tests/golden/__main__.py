"""``python -m tests.golden [--update]``: compare (default) or rewrite the golden renderings."""

from __future__ import annotations

import argparse
import glob
import os
import sys

from tests.golden import DIR, cases, path, rendered


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.golden", description=__doc__)
    ap.add_argument("--update", action="store_true", help="rewrite the golden files from the current code")
    args = ap.parse_args(argv)
    wanted: set[str] = set()
    differ: list[str] = []
    for name, backend in cases():
        text = rendered(name, backend)
        p = path(name, backend)
        if text is None:
            continue
        wanted.add(p)
        try:
            with open(p, encoding="utf-8") as f:
                old: str | None = f.read()
        except FileNotFoundError:
            old = None
        if old == text:
            continue
        differ.append(os.path.basename(p))
        if args.update:
            with open(p, "w", encoding="utf-8") as f:
                f.write(text)
    stale = sorted(set(glob.glob(os.path.join(DIR, "*.golden"))) - wanted)
    for p in stale:
        differ.append(f"{os.path.basename(p)} (no such case)")
        if args.update:
            os.unlink(p)
    verb = "updated" if args.update else "differ"
    for d in differ:
        print(f"{verb}: {d}")
    print(f"{len(wanted)} golden renderings, {len(differ)} {verb}")
    return 0 if args.update or not differ else 1


if __name__ == "__main__":
    sys.exit(main())
