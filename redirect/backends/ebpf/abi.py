"""The eBPF maps' keys and values, as ``redirect/bpf/abi.h`` lays them out, and its constants: what the
host side and the per-pod side both read.

``redirect/bpf/abi.h`` is the one description of the layouts: the BPF programs and ``native/`` include it,
and ``native/build_native.py`` gives it to cffi's cdef, so the compiled ``redirect._native`` knows
every struct with the C compiler's own sizes and offsets. The ``struct.Struct`` formats the eBPF
backend packs and unpacks with are derived here from those declarations (field by field, in
offset order, any gap the compiler left as pad bytes), and checked against ``ffi.sizeof``: a
layout is changed in the header, once.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any

from ...native import load

#: ``redirect._native``'s cffi declarations of ``redirect/bpf/abi.h`` (``NotBuilt``, naming what to do,
#: when the package was not built).
ffi, lib = load().ffi, load().lib

FORMATS = {"uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q"}


@dataclass(frozen=True)
class Layout:
    """A C struct of ``redirect/bpf/abi.h`` as a ``struct.Struct`` (native byte order), and where each of its
    top-level fields starts among the packed values (an array of structs is flattened: its
    elements' fields one after the other)."""

    struct: struct.Struct
    index: dict[str, int]
    offset: dict[str, int]
    #: How many packed values each top-level field is (a struct or an array of numbers: several).
    count: dict[str, int]
    #: The zero value of each packed value (0, or zero bytes).
    zeros: tuple[Any, ...]

    def pack(self, values: dict[str, Any]) -> bytes:
        """The struct with ``values`` (top-level field -> a value, or a sequence of them for a
        field of several) and every other field zero. ``KeyError`` names a field the struct lacks."""
        out = list(self.zeros)
        for name, v in values.items():
            if name not in self.index:
                raise KeyError(f"redirect/bpf/abi.h has no field {name!r} here: {', '.join(self.index)}")
            i, n = self.index[name], self.count[name]
            if n == 1:
                out[i] = v
            else:
                if len(v) != n:
                    raise ValueError(f"field {name!r} is {n} values, given {len(v)}")
                out[i : i + n] = v
        return self.struct.pack(*out)


def _fields(ctype: Any, base: int, raw: frozenset[str]) -> list[tuple[str, int, str]]:
    """(top-level name, offset, format) of every value of ``ctype``, in offset order."""
    out: list[tuple[str, int, str]] = []
    for name, f in ctype.fields:
        t, off = f.type, base + f.offset
        if t.kind == "struct":
            out += [(name, o, fm) for _n, o, fm in _fields(t, off, frozenset())]
        elif t.kind == "primitive":
            out.append((name, off, f"{ffi.sizeof(t)}s" if name in raw else FORMATS[t.cname]))
        elif t.kind == "array" and t.item.kind == "struct":
            n = ffi.sizeof(t.item)
            for i in range(t.length):
                out += [(name, o, fm) for _n, o, fm in _fields(t.item, off + i * n, frozenset())]
        elif t.kind == "array" and t.item.kind == "primitive" and t.item.cname != "uint8_t":
            out += [(name, off + i * ffi.sizeof(t.item), FORMATS[t.item.cname]) for i in range(t.length)]
        elif t.kind == "array":  # bytes (an address, keys): one value
            out.append((name, off, f"{ffi.sizeof(t)}s"))
        else:
            raise TypeError(f"redirect/bpf/abi.h: field {name} of {ctype.cname} has a type this reader does not know")
    return out


def layout(name: str, raw: tuple[str, ...] = ()) -> Layout:
    """``struct <name>`` of ``redirect/bpf/abi.h``; ``raw``: fields packed as bytes as they are (in network byte
    order: addresses, ``_be`` ports) rather than as numbers."""
    ctype = ffi.typeof(f"struct {name}")
    fmt, pos = "=", 0
    index: dict[str, int] = {}
    offset: dict[str, int] = {}
    count: dict[str, int] = {}
    zeros: list[Any] = []
    for i, (field, off, f) in enumerate(_fields(ctype, 0, frozenset(raw))):
        if off < pos:
            raise TypeError(f"redirect/bpf/abi.h: struct {name} field {field} overlaps the one before")
        fmt += f"{off - pos}x" if off > pos else ""
        fmt += f
        pos = off + struct.calcsize("=" + f)
        index.setdefault(field, i)
        offset.setdefault(field, off)
        count[field] = count.get(field, 0) + 1
        zeros.append(bytes(struct.calcsize("=" + f)) if f.endswith("s") else 0)
    size = ffi.sizeof(ctype)
    if size > pos:
        fmt += f"{size - pos}x"
    s = struct.Struct(fmt)
    if s.size != size:
        raise TypeError(f"redirect/bpf/abi.h: struct {name} is {size} bytes, its derived format {fmt!r} {s.size}")
    return Layout(s, index, offset, count, tuple(zeros))


def const(name: str) -> int:
    """An integer ``#define`` of ``redirect/bpf/abi.h`` (``RDR_<name>``), or a kernel program/attach type
    (``BPF_PROG_TYPE_<name>``, ``BPF_<attach type>``: ``native/build_native.py`` names those it knows).
    (The entry kinds are not here: ``redirect.plan.lower_ebpf`` numbers them, ``PORT_KIND``, ``CIDR_KIND``.)"""
    return int(getattr(lib, name))


# --------------------------------------------------------------------------- the layouts and names

# The maps' keys and values (``layout``): addresses and _be ports as raw bytes.
POLICY_LAYOUT = layout("pod_policy", raw=("lo4_addr", "lo4_mask"))
HAIRPIN_SKIP_MAX = const("RDR_HAIRPIN_SKIP_MAX")
POLICY = POLICY_LAYOUT.struct
P_FLAGS, P_INV_BASE, P_N_INV, P_SRC4, P_SRC6, P_LL6 = (POLICY_LAYOUT.index[f] for f in ("flags", "inv_base",
                                                                                          "n_inv", "src4", "src6",
                                                                                          "ll6"))
PORT_KEY = layout("port_key").struct
CIDR_KEY = layout("cidr_key").struct
ORIG = layout("orig_dst", raw=("port_be",)).struct
TUPLE_KEY = layout("tuple_key", raw=("port_be",)).struct
LISTENER_KEY = layout("listener_key").struct
PAIR_KEY = layout("pair_key", raw=("lport_be", "rport_be")).struct
PAIR_STATE = layout("pair_state").struct
INV_KEY = layout("inv_key").struct
POOL_SLOT = layout("pool_slot").struct  # a pool slot's claim: the pod's netns cookie and inode
POOL_MAX = const("RDR_POOL_MAX")
INV_VAL = layout("inv_val").struct
U32 = struct.Struct("=I")
INV_CHUNK = const("RDR_INV_CHUNK")  # keys per inventory entry
INV_KEY_MAX = const("RDR_INV_KEY_MAX")  # room for one key in an entry
INV_PORTS, INV_CIDRS = const("RDR_INV_PORTS"), const("RDR_INV_CIDRS")
INV_MAPS = {INV_PORTS: "ports", INV_CIDRS: "cidrs"}
INV_KEY_SIZE = {INV_PORTS: PORT_KEY.size, INV_CIDRS: CIDR_KEY.size}
U64 = struct.Struct("=Q")
GEN_BIT = 1 << 63  # set in the netns field of a pod's second generation of keys (redirect/bpf/policy.h, pod_keys)
U8 = struct.Struct("=B")
#: (key size, value size) of every map in ``MAPS``: a pinned map of another layout is another
#: build's (``HostPrograms.open_pinned`` checks them against ``/proc/self/fdinfo``).

F_AMBIENT, F_TPROXY, F_INBOUND, F_FWMARK_ACCEPT_OURS = (
    const(f"RDR_F_{n}") for n in ("AMBIENT", "TPROXY", "INBOUND", "FWMARK_ACCEPT_OURS"))


def flag(name: str) -> int:
    """``RDR_F_<NAME>``: the policy flag of ``EbpfPolicy``'s boolean ``name``."""
    return const(f"RDR_F_{name.upper()}")


LISTENER_INBOUND, LISTENER_OUTBOUND = const("RDR_LISTENER_INBOUND"), const("RDR_LISTENER_OUTBOUND")
CIDR_PREFIX_BASE = const("RDR_CIDR_PREFIX_BASE")  # cidr_key.prefixlen = this + the CIDR's own
GROUPS_ALL, GROUPS_ONLY, GROUPS_EXCLUDE = (const(f"RDR_GROUPS_{n}") for n in ("ALL", "ONLY", "EXCLUDE"))
AF = {4: socket.AF_INET, 6: socket.AF_INET6}
