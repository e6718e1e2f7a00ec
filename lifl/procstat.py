"""CPU time and memory of a node's processes, read from /proc (for `lifl demo` and `lifl bench`)."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            fields = _stat_fields(int(p.name))
            if fields and int(fields[1]) == pid:
                out.append(int(p.name))
    return out


def cpu_seconds(pids: list[int], *, reaped_children: bool = False) -> float:
    """User + system CPU time of ``pids``; with ``reaped_children`` also that of the children
    they have waited for (an agent's aggregators that have exited)."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            ticks += int(fields[11]) + int(fields[12])
            if reaped_children:
                ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def pss_mb(pids: list[int]) -> float:
    """Proportional set size: shared pages (shared memory) are counted once across processes."""
    kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    kb += int(line.split()[1])
        except OSError:
            pass
    return kb / 1024


def meminfo_bytes(key: str) -> int:
    """A field of /proc/meminfo ("MemAvailable", ...) in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(f"/proc/meminfo has no {key}")
