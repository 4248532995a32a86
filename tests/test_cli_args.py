"""Every executable's numeric options are read as config fields are: ASCII digits in a stated
range, a clear error naming the option and the value, exit 2, nothing done. ``int()`` and
``float()`` alone would take other scripts' digits, ``1_0``, ``nan``, ``inf`` and ``1e9``."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytestmark = pytest.mark.noroot


# (console script and subcommand, option, an accepted value)
OPTIONS = [
    (["redirect-agent"], "--workers", "4"),
    (["redirect-agent"], "--http-port", "0"),
    (["redirect-agent"], "--max-clients", "32"),
    (["redirect-agent"], "--proxy-timeout", "2.5"),
    (["redirect-agent"], "--resync-seconds", "0"),
    (["redirect-agent"], "--idle-timeout", "10"),
    (["redirect-nodeproxy"], "--max-conns", "64"),
    (["redirect-nodeproxy"], "--connect-timeout", "1"),
    (["redirect-nodeproxy"], "--idle-timeout", "30"),
    (["redirect-nodeproxy"], "--drain-timeout", "0"),
    (["redirect", "wait"], "--probe-port", "15002"),
    (["redirect", "wait"], "--timeout", "1.5"),
    (["redirect", "wait"], "--period-ms", "100"),
    (["redirect-cni", "install"], "--interval", "0.5"),
    (["redirect-cni", "install"], "--max-seconds", "60"),
]
BAD = ["\u0663", "1_0", "nan", "inf", "-1", "1e9", "99999999999", "", "0x"]


def _run(cmd: list[str], args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """The console script ``cmd[0]``'s entry point (as installed: wherever its module lives) on
    ``cmd[1:] + args``: (exit code, stdout, stderr)."""
    main = next(e for e in entry_points(group="console_scripts") if e.name == cmd[0]).load()
    try:
        rc = main([*cmd[1:], *args])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize(("cmd", "option", "good"), OPTIONS, ids=[f"{c[-1]}{o}" for c, o, _ in OPTIONS])
def test_a_bad_number_is_refused_naming_the_option_and_the_value(cmd: list[str], option: str, good: str,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CNI_COMMAND", raising=False)  # redirect-cni: the installer, not a plugin call
    for value in BAD:
        rc, out, err = _run(cmd, [f"{option}={value}", "--help"], capsys)  # --help after it: reached if accepted
        assert rc == 2, (option, value, out[-300:], err[-300:])
        assert f"argument {option}: {value!r}" in err, err
    rc, out, err = _run(cmd, [f"{option}={good}", "--help"], capsys)
    assert rc == 0 and "usage:" in out, err
