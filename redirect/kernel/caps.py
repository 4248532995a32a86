"""The calling thread's effective capabilities, by name, for errors that say which one is missing.

A container runs with the capabilities its security context grants (``redirect init`` in Istio's
init-container shape has ``NET_ADMIN`` and ``NET_RAW`` only); what needs more than that says so
by name instead of failing later with a bare ``EPERM``.
"""

from __future__ import annotations

#: The kernel's capability numbers (``linux/capability.h``), by name without ``CAP_``.
NAMES: tuple[str, ...] = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE",
)


def effective() -> frozenset[str]:
    """The names of the calling thread's effective capabilities (all of them when unreadable:
    then nothing is refused on their account, and the kernel's own answer stands)."""
    try:
        with open("/proc/thread-self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    bits = int(line.split()[1], 16)
                    return frozenset(n for i, n in enumerate(NAMES) if bits >> i & 1)
    except (OSError, ValueError, IndexError):
        pass
    return frozenset(NAMES)


def has(*names: str) -> bool:
    """Whether the calling thread has every capability of ``names`` (``"NET_ADMIN"``, ...)."""
    return set(names) <= effective()


def missing(*names: str) -> tuple[str, ...]:
    """The capabilities of ``names`` the calling thread lacks, as ``CAP_X`` for messages."""
    eff = effective()
    return tuple(f"CAP_{n}" for n in names if n not in eff)
