"""Facts about processes of this host, read from /proc (Linux)."""

from __future__ import annotations

from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name, from the state on (field 3: fields[0] is
    the state, fields[2] the process group, fields[19] the start time); None when no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses


def proc_start_ticks(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot (/proc/PID/stat field 22); None
    when no such process runs (a zombie runs nothing). With the pid, it names one process for the
    lifetime of the boot: a pid reused later has another start time."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])
