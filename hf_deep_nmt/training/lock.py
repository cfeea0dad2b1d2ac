"""The lock of a run folder: one run writes into an `output_dir` at a time.

The lock (`LOCK_FILE`) names its holder and carries a lease that a heartbeat thread renews (`heartbeat` time,
`lease_seconds`). A lock whose process has ended (on this host: a missing pid, a zombie) or, from another host, whose
lease has run out, is taken over atomically (renamed away, and put back if it changed meanwhile); a live lease never
is. So a job that a cluster preempted and requeued on another node takes over the folder of its dead predecessor.
A lock's numbers never decide how long a command waits (at most the lease this process writes), and a lock holding
values no run writes (`lock_problem`: a process id out of range, a lease that is not a number of seconds up to a day,
a heartbeat in the future beyond a clock skew) is refused, naming the file and the field, and never taken over.

What the folder holds and whether it may be written is the run record's question (`hf_deep_nmt.training.run_record`);
`hf_deep_nmt.training.run_folder.RunFolder` holds both for a run.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers.utils import logging

from hf_deep_nmt.leases import (  # noqa: F401  (the names this module held before the prepared data had a lease)
    CLOCK_SKEW_SECONDS,
    DEFAULT_LEASE_SECONDS,
    LEASE_LIMITS,
    LEASE_VARIABLE,
    MAX_PID,
    lease_from_environment,
    lock_problem,
    take_over,
)
from hf_deep_nmt.leases import process_alive as _process_alive

logger = logging.get_logger(__name__)

LOCK_FILE = ".hf-deep-nmt.lock"
LEASE_SECONDS: float | None = None  # None: from `LEASE_VARIABLE` (tests set a number)
LOCK_SIZE = 1024  # the lock is rewritten in place at this fixed size, so that a reader never sees a shorter file


class RunFolderError(FileExistsError):
    """The output folder is in use or holds a run this command must not write over."""


def lease_seconds() -> float:
    """The lease this process writes into its locks: `HF_DEEP_NMT_LOCK_LEASE` seconds (120 when unset), `ValueError`
    naming the variable and what it admits for anything but a number from 1 to 86400."""
    if LEASE_SECONDS is not None:
        return LEASE_SECONDS
    return lease_from_environment()


class FolderLock:
    """The lock of one run folder: `acquire()` creates the folder when missing, takes the lock (over a holder that is
    gone, see the module) and starts the heartbeat; `release()` stops it, removes the lock while it is still this
    process's, and the folder when this lock created it and nothing was written there (a refused run leaves no empty
    folder behind). `on_lost(message)` is called from the heartbeat when another run took the lock over."""

    def __init__(self, folder: str | Path, command: str, on_lost: Callable[[str], None] = lambda message: None):
        self.folder = Path(folder)
        self.command = command
        self.on_lost = on_lost
        self.lost = threading.Event()
        self.locked = False
        self._created = False
        self._descriptor: int | None = None
        self._owner: dict[str, Any] = {}
        self._lease = DEFAULT_LEASE_SECONDS
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def _lock_text(self) -> bytes:
        self._owner["heartbeat"] = time.time()
        text = json.dumps(self._owner).encode()
        return text + b" " * (LOCK_SIZE - 1 - len(text)) + b"\n"

    def acquire(self) -> None:
        self._lease = lease_seconds()  # a bad HF_DEEP_NMT_LOCK_LEASE is refused before the folder is touched
        self._created = not self.folder.exists()
        if self.folder.exists() and not self.folder.is_dir():
            raise RunFolderError(f"output_dir {str(self.folder)!r} is a file; choose a folder.")
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = self.folder / LOCK_FILE
        self._owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.command,
            "since": time.ctime(),
            "lease_seconds": self._lease,
        }
        for _ in range(3):
            try:
                descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
            except FileExistsError:
                holder = self._lock_holder(lock)
                if holder is None:
                    continue  # a stale lock was removed: try again
                raise RunFolderError(
                    f"output_dir {str(self.folder)!r} is in use by another hf-deep-nmt run ({holder}); wait for it "
                    f"to finish or choose another output_dir. If that run is gone, delete {str(lock)!r}."
                ) from None
            try:
                os.pwrite(descriptor, self._lock_text(), 0)
            except BaseException:  # e.g. a full disk: leave no empty lock behind
                os.close(descriptor)
                lock.unlink(missing_ok=True)
                raise
            self._descriptor, self.locked = descriptor, True
            self._stop_heartbeat.clear()
            self._heartbeat = threading.Thread(target=self._renew, name="hf-deep-nmt-lock-lease", daemon=True)
            self._heartbeat.start()
            return
        raise RunFolderError(f"Could not lock output_dir {str(self.folder)!r}; delete {str(lock)!r} if no run is on.")

    def _holds_lock(self) -> bool:
        """Whether the lock file in the folder is still the one this run created (not taken over meanwhile)."""
        try:
            mine, there = os.fstat(self._descriptor), os.stat(self.folder / LOCK_FILE)
        except (OSError, TypeError):
            return False
        return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)

    def _renew(self) -> None:
        """The heartbeat: renew the lease in place (through the open descriptor, so that a lock taken over meanwhile
        is never written) every quarter lease, until released."""
        while not self._stop_heartbeat.wait(self._lease / 4):
            if not self._holds_lock():
                message = (
                    f"The lock of output_dir {str(self.folder)!r} was taken over by another run (this process renewed "
                    f"no lease for {self._lease:g} s); this run stops at the end of its step without saving, the "
                    "other one owns the folder now."
                )
                self.on_lost(message)
                self.lost.set()
                logger.error(message)
                return
            try:
                os.pwrite(self._descriptor, self._lock_text(), 0)
            except OSError as error:
                logger.warning(f"Could not renew the lease of {str(self.folder / LOCK_FILE)!r}: {error}.")

    def release(self) -> None:
        if not self.locked:
            return
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        try:
            if self._holds_lock():
                (self.folder / LOCK_FILE).unlink()
        finally:
            os.close(self._descriptor)
            self._descriptor, self.locked = None, False
        if self._created and self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()  # a refused run leaves no empty folder behind

    def _read_lock(self, lock: Path) -> tuple[str, dict[str, Any]] | None:
        """The lock's text and contents; None when it is gone; `ValueError` when it cannot be read (after a few
        tries: a holder may be writing it)."""
        for attempt in range(5):
            try:
                text = lock.read_text(encoding="utf-8")
                holder = json.loads(text)
                if isinstance(holder, dict) and "pid" in holder and "host" in holder:
                    return text, holder
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                pass
            time.sleep(0.05 * (attempt + 1))
        raise ValueError("unreadable lock")

    def _lock_holder(self, lock: Path, waited: bool = False) -> str | None:
        """Who holds `lock`, or None after taking it away from a holder that is gone: a process of this host that
        has ended, or a holder on another host whose lease has run out. A lease that its holder failed to renew for
        half of it (a job killed after its grace period, requeued at once) is waited for, once, then taken over if
        still not renewed."""
        try:
            found = self._read_lock(lock)
        except ValueError:
            return "its lock file cannot be read; it may be starting"
        if found is None:
            return None
        text, holder = found
        problem = lock_problem(holder, time.time())
        if problem is not None:
            raise RunFolderError(
                f"output_dir {str(self.folder)!r} is locked by {str(lock)!r}, which no run of hf-deep-nmt wrote: "
                f"{problem}. It is neither waited for nor taken over; if no run is using the folder, delete it."
            )
        pid, host = holder["pid"], holder["host"]
        command, since = str(holder.get("command", "a run"))[:40], str(holder.get("since", "?"))[:40]
        who = f"process {pid} on {host[:80]}, {command} started {since}"
        if host == socket.gethostname():
            if _process_alive(pid):
                return who
            reason = f"left by process {pid}, which has ended"
        else:
            heartbeat, lease = holder.get("heartbeat"), holder.get("lease_seconds")
            if not isinstance(heartbeat, (int, float)) or not isinstance(lease, (int, float)):
                return f"{who}; its lock has no lease (an older hf-deep-nmt wrote it), so it is never taken over"
            left = heartbeat + lease - time.time()
            if left > 0 and (waited or lease - left <= lease / 2):
                return f"{who}; its lease was renewed {max(0.0, lease - left):.0f} s ago and runs {left:.0f} s more"
            if left > 0:
                # never longer than the lease this process writes: a lock's own numbers do not decide how long
                wait = min(left, self._lease)
                logger.warning(
                    f"The lock of {str(self.folder)!r} ({who}) was last renewed {lease - left:.0f} s ago, though a "
                    f"running holder renews it every {lease / 4:g} s: waiting {wait:.0f} s for its lease to run out."
                )
                time.sleep(wait + 0.05)
                return self._lock_holder(lock, waited=True)
            reason = f"of {who}, whose lease ran out {-left:.0f} s ago (renewed every {lease / 4:g} s while it runs)"
        if not self._take_over(lock, text):
            return f"{who}; its lock changed while it was being taken over"
        logger.warning(f"Taking over the lock of {str(self.folder)!r} {reason}.")
        return None

    def _take_over(self, lock: Path, seen: str) -> bool:
        """`hf_deep_nmt.leases.take_over`: the stale lock moved away atomically, unless its holder renewed it."""
        return take_over(lock, seen)
