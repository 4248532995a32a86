"""The eBPF maps' keys and values, as ``bpf/abi.h`` lays them out.

``bpf/abi.h`` is the one description of the layouts: the BPF programs and ``native/`` include it,
and ``native/build_native.py`` gives it to cffi's cdef, so the compiled ``redirect._native`` knows
every struct with the C compiler's own sizes and offsets. The ``struct.Struct`` formats the eBPF
backend packs and unpacks with are derived here from those declarations (field by field, in
offset order, any gap the compiler left as pad bytes), and checked against ``ffi.sizeof``: a
layout is changed in the header, once.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from .._native import ffi, lib

_FORMATS = {"uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q"}


@dataclass(frozen=True)
class Layout:
    """A C struct of ``bpf/abi.h`` as a ``struct.Struct`` (native byte order), and where each of its
    top-level fields starts among the packed values (an array of structs is flattened: its
    elements' fields one after the other)."""

    struct: struct.Struct
    index: dict[str, int]
    offset: dict[str, int]


def _fields(ctype: Any, base: int, raw: frozenset[str]) -> list[tuple[str, int, str]]:
    """(top-level name, offset, format) of every value of ``ctype``, in offset order."""
    out: list[tuple[str, int, str]] = []
    for name, f in ctype.fields:
        t, off = f.type, base + f.offset
        if t.kind == "struct":
            out += [(name, o, fm) for _n, o, fm in _fields(t, off, frozenset())]
        elif t.kind == "primitive":
            out.append((name, off, f"{ffi.sizeof(t)}s" if name in raw else _FORMATS[t.cname]))
        elif t.kind == "array" and t.item.kind == "struct":
            n = ffi.sizeof(t.item)
            for i in range(t.length):
                out += [(name, o, fm) for _n, o, fm in _fields(t.item, off + i * n, frozenset())]
        elif t.kind == "array" and t.item.kind == "primitive" and t.item.cname != "uint8_t":
            out += [(name, off + i * ffi.sizeof(t.item), _FORMATS[t.item.cname]) for i in range(t.length)]
        elif t.kind == "array":  # bytes (an address, keys): one value
            out.append((name, off, f"{ffi.sizeof(t)}s"))
        else:
            raise TypeError(f"bpf/abi.h: field {name} of {ctype.cname} has a type this reader does not know")
    return out


def layout(name: str, raw: tuple[str, ...] = ()) -> Layout:
    """``struct <name>`` of ``bpf/abi.h``; ``raw``: fields packed as bytes as they are (in network byte
    order: addresses, ``_be`` ports) rather than as numbers."""
    ctype = ffi.typeof(f"struct {name}")
    fmt, pos = "=", 0
    index: dict[str, int] = {}
    offset: dict[str, int] = {}
    for i, (field, off, f) in enumerate(_fields(ctype, 0, frozenset(raw))):
        if off < pos:
            raise TypeError(f"bpf/abi.h: struct {name} field {field} overlaps the one before")
        fmt += f"{off - pos}x" if off > pos else ""
        fmt += f
        pos = off + struct.calcsize("=" + f)
        index.setdefault(field, i)
        offset.setdefault(field, off)
    size = ffi.sizeof(ctype)
    if size > pos:
        fmt += f"{size - pos}x"
    s = struct.Struct(fmt)
    if s.size != size:
        raise TypeError(f"bpf/abi.h: struct {name} is {size} bytes, its derived format {fmt!r} {s.size}")
    return Layout(s, index, offset)


def const(name: str) -> int:
    """An integer ``#define`` of ``bpf/abi.h`` (``RDR_<name>``), or a kernel program/attach type."""
    return int(getattr(lib, name))
