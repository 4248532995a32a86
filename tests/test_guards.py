"""Guards: an option is carried through every layer, or a test here says which layer it stopped at.

A capture option goes config -> intent -> netfilter plan (``redirect/plan/sidecar.py``) and eBPF
lowering (``redirect/plan/lower_ebpf.py``) -> the programs' reader (``redirect/bpf/policy.h``) and
their model (``redirect.plan.evaluate``). These tests fail for an option that stops half-way
(docs/development.md, "Adding an option"). No root, no kernel.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import typing

import pytest

from redirect.plan import lower_ebpf

pytestmark = pytest.mark.noroot

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _native_kinds() -> typing.Any:
    spec = importlib.util.spec_from_file_location("rdr_kinds", ROOT / "native" / "kinds.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_kinds_header_is_generated_from_the_one_kind_table() -> None:
    """redirect/bpf/kinds.h is what native/kinds.py makes of lower_ebpf's table (run ``make bootstrap``
    after changing the table), the build reads the same table the package does, and the kinds'
    names, numbers and types are each written once."""
    kinds = _native_kinds()
    table = kinds.kind_table()
    assert table == {"PORT_KINDS": lower_ebpf.PORT_KINDS, "CIDR_KINDS": lower_ebpf.CIDR_KINDS}
    assert kinds.KINDS_H.read_text() == kinds.kinds_header(table), \
        "redirect/bpf/kinds.h is not current with redirect/plan/lower_ebpf.py's kind table: run make bootstrap"
    assert set(typing.get_args(lower_ebpf.PortKind)) == set(lower_ebpf.PORT_KIND)
    assert set(typing.get_args(lower_ebpf.CidrKind)) == set(lower_ebpf.CIDR_KIND)
    for rows in (lower_ebpf.PORT_KINDS, lower_ebpf.CIDR_KINDS):
        numbers = [r[1] for r in rows]
        assert len(set(numbers)) == len(numbers) and 0 not in numbers, rows
    assert set(lower_ebpf.CIDR_SHAPE.values()) <= set(typing.get_args(lower_ebpf.Shape))


# --- config -> intent, and the property test draws it ------------------------------------------

#: Config fields the property test's strategies (tests/test_lowerings.py) do not draw, and why;
#: each with a config in which it matters (the field set, the others as needed), to show it still
#: reaches the intent.
NOT_DRAWN: dict[str, tuple[str, dict[str, typing.Any]]] = {
    "sockmap": ("it pairs the sockets of connections already captured: it changes no landing, which is what the"
                " property test compares (tests/test_sockmap.py tests it on real sockets)", {"sockmap": True}),
    "drop_invalid": ("the eBPF backend refuses it (redirect.plan.intent.refusals): there is no eBPF lowering"
                     " to compare", {"drop_invalid": True}),
    "tproxy_mark": ("drawn connections carry the drawn config's tproxy_mark; its value changes no landing",
                    {"inbound_interception": "TPROXY", "tproxy_mark": 4242}),
    "tproxy_route_table": ("a routing table number: no landing depends on which",
                           {"inbound_interception": "TPROXY", "tproxy_route_table": 200}),
    "route_table": ("a routing table number: no landing depends on which", {"mode": "ambient", "route_table": 150}),
    "ipv6": ("the property test draws the families a backend derives from it (4, or 4 and 6)", {"ipv6": False}),
}


def _strategies() -> typing.Any:
    from hypothesis import strategies as st

    from tests.test_lowerings import ambient_configs, configs

    return st.one_of(configs(), ambient_configs())


def _reset(cfg: typing.Any, name: str) -> typing.Any:
    """``cfg`` with field ``name`` at its default (None when that is not a valid config)."""
    from redirect import ConfigError, RedirectConfig

    try:
        return cfg.replace(**{name: getattr(RedirectConfig(), name)})
    except ConfigError:
        return None


def _changes_intent(cfg: typing.Any, name: str) -> bool:
    from redirect.plan.intent import intent_for

    other = _reset(cfg, name)
    return other is not None and intent_for(cfg) != intent_for(other)


def test_every_config_field_reaches_the_intent_and_is_drawn_by_the_property_test() -> None:
    """For every ``RedirectConfig`` field the property test's strategies draw a config in which
    that field (against its default) changes the intent: so the field is drawn, and the intent
    reads it. A field the strategies do not draw is listed in ``NOT_DRAWN`` with the reason and a
    config in which it changes the intent."""
    from hypothesis import HealthCheck, given, settings

    from redirect import RedirectConfig
    from redirect.config import field_names

    fields = field_names()
    assert set(NOT_DRAWN) <= set(fields), set(NOT_DRAWN) - set(fields)
    unreached = [n for n, (_why, kw) in NOT_DRAWN.items() if not _changes_intent(RedirectConfig(**kw), n)]
    assert not unreached, f"config fields that do not reach the intent (redirect/plan/intent.py): {unreached}"
    missing = set(fields) - set(NOT_DRAWN)

    @settings(max_examples=1500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cfg=_strategies())
    def draw(cfg: typing.Any) -> None:
        missing.difference_update([n for n in list(missing) if _changes_intent(cfg, n)])

    draw()
    assert not missing, (
        f"config fields the property test (tests/test_lowerings.py configs/ambient_configs) never draws so that"
        f" they change the intent: {sorted(missing)}. Draw them there and read them in redirect/plan/intent.py,"
        " or list them in NOT_DRAWN with the reason")


# --- intent -> both lowerings ------------------------------------------------------------------

#: Intent fields one lowering does not read, and why (``LOWERED_BY``: which it is).
NETFILTER_ONLY: dict[str, str] = {
    "drop_invalid": "the eBPF backend refuses it (redirect.plan.intent.refusals)",
}
#: Intent fields neither lowering reads, and who does.
NOT_LOWERED: dict[str, str] = {
    "local_addresses": "every backend adds them itself (redirect.kernel.routes; the eBPF backend's native writer)",
    "ipv6": "every backend decides the families from it (detect_families); the lowerings are given those",
}
#: Intent fields only the eBPF lowering reads, and why.
EBPF_ONLY: dict[str, str] = {
    "sockmap": "the netfilter backends refuse it (redirect.plan.intent.refusals): it pairs sockets in a BPF sockmap",
}


def _recording(it: typing.Any, seen: set[str]) -> typing.Any:
    """A copy of intent ``it`` that adds the name of every field read from it to ``seen`` (methods
    such as ``loopback_of`` read through it too)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(it)}
    cls = type(it)

    def getattribute(self: typing.Any, name: str) -> typing.Any:
        if name in names:
            seen.add(name)
        return object.__getattribute__(self, name)

    rec_cls = type(f"Recording{cls.__name__}", (cls,), {
        "__getattribute__": getattribute, "__hash__": lambda self: id(self),
        "__eq__": lambda self, other: self is other})
    rec = object.__new__(rec_cls)
    for f in dataclasses.fields(it):
        object.__setattr__(rec, f.name, getattr(it, f.name))
    return rec


def _intents() -> list[typing.Any]:
    """Intents of every golden config (they cover every option of the plan), sidecar and ambient."""
    from redirect.plan.intent import intent_for
    from tests.golden import CONFIGS, config

    return [intent_for(config(n)) for n in CONFIGS]


def test_every_intent_field_is_read_by_both_lowerings() -> None:
    """Each field of ``Intent`` and ``AmbientIntent`` is read by the netfilter lowering
    (``sidecar_plan``, ``ambient_plan``) and by the eBPF lowering (``lower_ebpf``), or is listed
    here with the reason one (or neither) does not."""
    import dataclasses

    from redirect.plan.ambient import ambient_plan
    from redirect.plan.intent import AmbientIntent, Intent
    from redirect.plan.sidecar import sidecar_plan

    read: dict[str, dict[type, set[str]]] = {"netfilter": {}, "ebpf": {}}
    for it in _intents():
        for lowering, fn in (("netfilter", ambient_plan if isinstance(it, AmbientIntent) else sidecar_plan),
                             ("ebpf", lambda x: lower_ebpf.lower_ebpf(x, (4, 6)))):
            seen = read[lowering].setdefault(type(it), set())
            fn(_recording(it, seen))
    problems = []
    for cls in (Intent, AmbientIntent):
        assert cls in read["netfilter"] and cls in read["ebpf"], f"no golden config has a {cls.__name__}"
        for f in dataclasses.fields(cls):
            nf, bpf = f.name in read["netfilter"][cls], f.name in read["ebpf"][cls]
            if f.name in NOT_LOWERED:
                continue
            if not nf and f.name not in EBPF_ONLY:
                problems.append(f"{cls.__name__}.{f.name} is not read by the netfilter lowering"
                                f" (redirect/plan/{'ambient' if cls is AmbientIntent else 'sidecar'}.py)")
            if not bpf and f.name not in NETFILTER_ONLY:
                problems.append(f"{cls.__name__}.{f.name} is not read by the eBPF lowering"
                                " (redirect/plan/lower_ebpf.py); lower it, or list it in NETFILTER_ONLY with the"
                                " reason (and refuse it for eBPF in redirect.plan.intent.refusals)")
    assert not problems, "\n".join(problems)


# --- eBPF lowering -> the programs and their model --------------------------------------------

BPF = ROOT / "redirect" / "bpf"
#: ``EbpfPolicy`` fields the model of the programs does not read, and why.
NOT_MODELLED = {
    "sockmap": "it decides no landing, only whether a captured connection's sends then bypass TCP",
}
#: ``struct pod_policy`` fields no program reads, and why.
USERSPACE_ONLY = {
    "n_inv": "the inventory's length: setup and teardown read it, the programs never",
    "_pad": "padding",
}


def _bpf_text() -> str:
    return "\n".join(p.read_text() for p in sorted(BPF.glob("*.[ch]")) if p.name != "kinds.h")


def _policy_fields() -> list[str]:
    from redirect.backends.ebpf.abi import POLICY_LAYOUT

    return list(POLICY_LAYOUT.index)


def test_every_ebpf_policy_field_is_packed_and_read_by_the_programs_and_their_model() -> None:
    """Each ``EbpfPolicy`` field has its place in ``struct pod_policy`` (a boolean: the flag
    ``RDR_F_<NAME>``), which redirect/bpf/ reads (``p->name``, the flag by name), and the model of
    the programs (redirect/plan/evaluate.py) reads it too; every field of the struct is read by a
    program or listed in ``USERSPACE_ONLY``."""
    import dataclasses
    import re

    from redirect.backends.ebpf.abi import POLICY_LAYOUT
    from redirect.backends.ebpf.pod.entries import pack_policy

    bpf, model = _bpf_text(), (ROOT / "redirect" / "plan" / "evaluate.py").read_text()
    policy = lower_ebpf.lower_ebpf(_intents()[0], (4, 6)).policy
    pack_policy(policy)  # (a field without a place in the struct is a KeyError naming it)
    problems = []
    struct_fields = set(POLICY_LAYOUT.index)
    for f in dataclasses.fields(policy):
        if isinstance(getattr(policy, f.name), bool):
            if not re.search(rf"\bRDR_F_{f.name.upper()}\b", bpf):
                problems.append(f"flag RDR_F_{f.name.upper()} (EbpfPolicy.{f.name}) is read by no program"
                                " in redirect/bpf/")
        else:
            places = {"loopback4": ("lo4_addr", "lo4_mask")}.get(f.name, (f.name,))
            for c in places:
                if c not in struct_fields:
                    problems.append(f"EbpfPolicy.{f.name} has no field {c} in struct pod_policy (redirect/bpf/abi.h)")
        if f.name not in NOT_MODELLED and not re.search(rf"\.{f.name}\b", model):
            problems.append(f"EbpfPolicy.{f.name} is not read by the model of the programs (redirect/plan/evaluate.py)")
    for name in struct_fields:
        if name not in USERSPACE_ONLY and not re.search(rf"->\s*{name}\b", bpf):
            problems.append(f"struct pod_policy field {name} is read by no program in redirect/bpf/ (p->{name})")
    assert not problems, "\n".join(problems)


def test_every_entry_kind_is_read_by_the_programs_and_their_model() -> None:
    """Each kind of the kind table is looked up by a program (``RDR_PORT_<NAME>``,
    ``RDR_CIDR_<NAME>`` in redirect/bpf/, kinds.h aside) and by the model (its name in
    redirect/plan/evaluate.py, or in the lowering's per-pod entries it calls)."""
    import re

    bpf = _bpf_text()
    model = (ROOT / "redirect" / "plan" / "evaluate.py").read_text()
    problems = []
    for prefix, rows in (("RDR_PORT_", lower_ebpf.PORT_KINDS), ("RDR_CIDR_", lower_ebpf.CIDR_KINDS)):
        for row in rows:
            name = str(row[0])
            if not re.search(rf"\b{prefix}{name.upper()}\b", bpf):
                problems.append(f"kind {name!r} ({prefix}{name.upper()}) is looked up by no program in redirect/bpf/")
            if f'"{name}"' not in model and f'"{name[:-1]}6" if' not in model:
                problems.append(f"kind {name!r} is not looked up by the model (redirect/plan/evaluate.py)")
    assert not problems, "\n".join(problems)


def test_the_plan_layer_touches_no_kernel_and_no_native_code() -> None:
    """``redirect.plan`` (and what it imports, transitively) imports neither the native module nor
    a backend nor the kernel layer, lazily or not: it decides, the backends do."""
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    ic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ic)
    known = ic.modules()
    graph = {m: ic.imports(m, p, known) for m, p in known.items()}
    reach: set[str] = set()
    todo = [m for m in known if m.startswith("redirect.plan")]
    while todo:
        m = todo.pop()
        if m not in reach:
            reach.add(m)
            todo += graph[m]
    bad = sorted(m for m in reach if m.startswith(("redirect.backends", "redirect.kernel", "redirect.api")))
    assert not bad, f"the plan layer imports {bad}"
    imports_native = re.compile(r"^\s*(from|import)\s+[.\w]*\b_native\b", re.MULTILINE)
    native = sorted(m for m in reach if imports_native.search((ROOT / known[m]).read_text()))
    assert not native, f"the plan layer reaches the native module in {native}"
