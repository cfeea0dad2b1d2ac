"""The thread policy of decoding on the CPU: how many threads `translate` runs torch (and ONNX Runtime) on.

Its own room because it is a policy about the machine, not about decoding: on a busy machine more threads than free
cores make torch's threads wait on each other (a 2-thread run on a loaded 2-core machine was measured burning 6x the
CPU time of a 1-thread one), so the default leaves out the cores other work holds.
"""

from __future__ import annotations

import contextlib
import os


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads() -> int:
    """The thread count `translate` uses unless told (`--threads`): `OMP_NUM_THREADS` when set; else the cores this
    process may use less the load average of the last minute (the runnable work already there), at least 1. On an
    idle machine that is every usable core; on a busy one it keeps torch's threads from waiting for cores the other
    work holds."""
    configured = os.environ.get("OMP_NUM_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    cores = usable_cores()
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        busy = 0.0
    return max(1, min(cores, cores - round(busy)))


def thread_limit() -> int:
    """The most threads `check_threads` admits: 4 per usable core (at least 16). More only wait on each other, and
    each reserves a stack: a million, asked of torch or ONNX Runtime, runs out of memory while the pool is made."""
    return max(16, 4 * usable_cores())


def check_threads(threads) -> int:
    """`threads` itself when it is a positive integer up to `thread_limit()`, `default_threads()` when None;
    `ValueError` otherwise, before any pool is made."""
    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"`threads` must be a positive integer, got {threads!r}.")
    if threads > thread_limit():
        raise ValueError(
            f"`threads` (--threads) is {threads}, but this machine has {usable_cores()} usable core(s): more than "
            f"{thread_limit()} threads only wait on each other; give at most {thread_limit()}, or leave it unset "
            "(the cores other work leaves free)."
        )
    return threads


def set_threads(threads: int | None = None) -> int:
    """Run torch's CPU operations on `threads` threads (`default_threads()` when None), intra-op and inter-op alike,
    and return the count. The inter-op pool can only be sized before its first use in the process; after that it is
    left as it is (`generate()` does not use it). Torch is imported here, not with the module: the other backends
    check their thread count (`check_threads`) without it."""
    import torch

    threads = check_threads(threads)
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != threads:
        # "cannot set number of interop threads after parallel work has started"
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
    return threads
