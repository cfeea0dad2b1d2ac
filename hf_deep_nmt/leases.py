"""Leases on lock files that several processes, perhaps on several hosts, write beside one folder: the run folder's
lock (`hf_deep_nmt.training.lock`) and the prepared-data lock (`hf_deep_nmt.data.prepared_lock`).

A lock names its holder (`host`, `pid`) and carries a `heartbeat` time that the holder renews every quarter of its
`lease_seconds`. A lock whose process has ended (on this host: a missing pid, a zombie) or, from another host, whose
lease has run out, may be taken over (`take_over`: atomically, and never one that changed meanwhile); a lock holding
values no run writes (`lock_problem`) is never trusted. What each lock does with a live holder (refuse, wait) is its
own business.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Any

# seconds a lock stays valid without a heartbeat (`HF_DEEP_NMT_LOCK_LEASE`, read when a lock is taken); the holder
# renews it every quarter of that
LEASE_VARIABLE = "HF_DEEP_NMT_LOCK_LEASE"
DEFAULT_LEASE_SECONDS = 120.0
LEASE_LIMITS = (1.0, 86400.0)  # what the variable admits, and so the longest lease a lock of this version carries
# how far in the future another host's heartbeat may lie (its clock ahead of ours) and still be believed
CLOCK_SKEW_SECONDS = 60.0
MAX_PID = 1 << 22  # no system's process ids go beyond this (Linux's largest pid_max)


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs: never for 0 or a negative number (`kill` would signal a process
    group), nor for a zombie (ended, not yet reaped by its parent)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        pass
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (macOS): kill() is all there is
        return True
    return status.rpartition(")")[2].split()[:1] != ["Z"]


def lease_from_environment() -> float:
    """`HF_DEEP_NMT_LOCK_LEASE` seconds (120 when unset), `ValueError` naming the variable and what it admits for
    anything but a number from 1 to 86400."""
    text = os.environ.get(LEASE_VARIABLE, "")
    if not text.strip():
        return DEFAULT_LEASE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    low, high = LEASE_LIMITS
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(
            f"{LEASE_VARIABLE}={text!r} is not a lock lease: give a number of seconds from {low:g} to {high:g} "
            f"(default {DEFAULT_LEASE_SECONDS:g}), or unset it."
        )
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def lock_problem(holder: dict[str, Any], now: float) -> str | None:
    """Why the parsed lock `holder` is not one a run of hf-deep-nmt wrote (None when it may be): the field that holds
    a value no run writes (a process id out of range, a lease that is not a number of seconds up to the longest one
    this version writes, a heartbeat in the future beyond `CLOCK_SKEW_SECONDS` or not finite). Such a lock is never
    trusted for a wait nor taken over."""
    pid, host = holder.get("pid"), holder.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= MAX_PID:
        return f"its `pid` is {pid!r}, not a process id (an integer from 1 to {MAX_PID})"
    if not isinstance(host, str) or not host:
        return f"its `host` is {host!r}, not a host name"
    heartbeat, lease = holder.get("heartbeat"), holder.get("lease_seconds")
    if heartbeat is None and lease is None:
        return None  # a lock of a version without leases
    high = LEASE_LIMITS[1]
    if not _is_number(lease) or not 0 < lease <= high:
        return f"its `lease_seconds` is {lease!r}, not a number of seconds above 0 and at most {high:g}"
    if not _is_number(heartbeat) or heartbeat <= 0:
        return f"its `heartbeat` is {heartbeat!r}, not a time"
    if heartbeat > now + CLOCK_SKEW_SECONDS:
        return (
            f"its `heartbeat` lies {heartbeat - now:.0f} s in the future (clocks of two hosts may differ by "
            f"{CLOCK_SKEW_SECONDS:g} s at most)"
        )
    return None


def take_over(lock: Path, seen: str) -> bool:
    """Move the stale lock whose text was `seen` out of the way, atomically: renamed to a name of this process, and
    put back when its text changed meanwhile (its holder renewed it: it lives). True when it is gone."""
    stale = lock.with_name(f"{lock.name}.stale-{socket.gethostname()}-{os.getpid()}")
    try:
        os.rename(lock, stale)
    except FileNotFoundError:
        return True  # another process took it first; the exclusive create decides who gets it
    try:
        if stale.read_text(encoding="utf-8") != seen:
            try:
                os.link(stale, lock)
            except FileExistsError:
                pass
            return False
        return True
    finally:
        stale.unlink(missing_ok=True)
