"""Who a rung process is, as its run-start records it, so that any later verb can tell whether it still runs.

A pid alone is not an identity: pids are reused. On Linux the identity is the pid with its start time in clock
ticks since boot and the boot's id, read from /proc; elsewhere the pid is checked for existence only.
"""

from __future__ import annotations

import os
import socket
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from its third field (state) on: the command name before it may hold spaces and ')'."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def _boot_id() -> str | None:
    try:
        return (PROC / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        return None


def _started_at(start_ticks: int) -> str | None:
    """The process's start as UTC time, from the boot time and its start in clock ticks."""
    try:
        boot = next(
            int(line.split()[1]) for line in (PROC / "stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, StopIteration):
        return None
    seconds = boot + start_ticks / os.sysconf("SC_CLK_TCK")
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


def current() -> dict[str, Any]:
    """This process's identity: pid, host, start time (and on Linux its start ticks and the boot's id)."""
    pid = os.getpid()
    identity: dict[str, Any] = {"pid": pid, "host": socket.gethostname()}
    fields = _stat_fields(pid)
    if fields is not None:
        ticks = int(fields[19])  # field 22, starttime
        identity.update(start_ticks=ticks, boot_id=_boot_id(), started=_started_at(ticks))
    else:
        identity["started"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return identity


def gone(identity: dict[str, Any] | None) -> bool | None:
    """True when the process named is gone (a zombie counts as gone), False when it runs, None when this machine
    cannot tell (no identity recorded, or another host)."""
    if not identity or identity.get("host") != socket.gethostname():
        return None
    pid = int(identity["pid"])
    if "start_ticks" in identity and PROC.is_dir():
        if identity.get("boot_id") != _boot_id():
            return True  # the machine rebooted since
        fields = _stat_fields(pid)
        if fields is None or fields[0] in ("Z", "X"):
            return True
        return int(fields[19]) != identity["start_ticks"]  # another process under a reused pid
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def describe(identity: dict[str, Any]) -> str:
    return f"process {identity.get('pid')} on {identity.get('host')}, started {identity.get('started')}"
