"""The lock that lets one preparer at a time build a prepared-data folder, across the hosts that share its root.

The lock is an owner record, `<folder>.owner` beside the folder: created exclusively (`O_CREAT | O_EXCL`, atomic on
a local disk, NFS v3+, Lustre, GPFS, CephFS), naming the holder's host, process id and start time, with a heartbeat
that a thread renews every quarter of the lease (`HF_DEEP_NMT_LOCK_LEASE`, 120 s by default; `hf_deep_nmt.leases`).
No `flock` is needed, so a filesystem whose `flock` is node-local (Lustre without `-o flock`, some FUSE mounts) or
missing keeps two nodes apart all the same. Another preparer waits while the owner lives; an owner whose process has
ended (same host) or whose heartbeat is older than its lease (any host: a node that died, a process frozen) is named
and taken over.

Each preparer builds into a folder named by its host and process id (`building_folder`), so nobody deletes another
node's work: a preparer removes only building folders of processes of its own host that have ended, and that of an
owner it took over. A SIGTERM while building (`cleaned_on_sigterm`) removes the preparer's own building folder and its
owner record before the process ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers.utils import logging

from hf_deep_nmt.leases import lease_from_environment, lock_problem, process_alive, take_over

logger = logging.get_logger(__name__)

OWNER_SUFFIX = ".owner"
OWNER_SIZE = 512  # rewritten in place at this fixed size, so that a reader never sees a shorter record
LEASE_SECONDS: float | None = None  # None: from `HF_DEEP_NMT_LOCK_LEASE` (tests set a number)
POLL_SECONDS = 0.5  # how often a waiting preparer looks at the owner record again


def _host() -> str:
    """This host's name as it may stand in a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"


def owner_path(folder: Path) -> Path:
    return folder.parent / f"{folder.name}{OWNER_SUFFIX}"


def building_folder(folder: Path, host: str | None = None, pid: int | None = None) -> Path:
    """Where process `pid` of `host` (default: this process) builds `folder`."""
    return folder.parent / f".{folder.name}.building-{host or _host()}-{pid or os.getpid()}"


def _building_owner(path: Path, folder: Path) -> tuple[str | None, int] | None:
    """(host, pid) of a building folder of `folder` (host None: a folder of a version that named only the pid)."""
    match = re.fullmatch(rf"\.{re.escape(folder.name)}\.building-(?:(.+)-)?(\d+)", path.name)
    return (match.group(1), int(match.group(2))) if match else None


def remove_abandoned_building_folders(folder: Path, taken_over: dict[str, Any] | None = None) -> None:
    """Remove the building folders of `folder` that no process will finish: those of ended processes of this host
    (and, from a version that named only the pid, of an ended pid here), and that of the owner `taken_over`. Another
    host's folders are never touched: its process may live."""
    for path in folder.parent.glob(f".{folder.name}.building-*"):
        owner = _building_owner(path, folder)
        if owner is None:
            continue
        host, pid = owner
        mine = host in (None, _host()) and not process_alive(pid)
        theirs = taken_over is not None and (host, pid) == (taken_over.get("host"), taken_over.get("pid"))
        if mine or theirs:
            shutil.rmtree(path, ignore_errors=True)


class PreparationLock:
    """`with PreparationLock(folder) as lock:` holds `folder`'s owner record for the block (waiting for a live owner,
    taking over a silent one); `lock.taken_over` is the record of an owner it took over (None otherwise)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = owner_path(self.folder)
        self.lease = LEASE_SECONDS if LEASE_SECONDS is not None else lease_from_environment()
        self.taken_over: dict[str, Any] | None = None
        self._descriptor: int | None = None
        self._owner = {"host": _host(), "pid": os.getpid(), "started": time.time(), "lease_seconds": self.lease}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def _text(self) -> bytes:
        text = json.dumps({**self._owner, "heartbeat": time.time()}).encode()
        return text + b" " * (OWNER_SIZE - 1 - len(text)) + b"\n"

    def __enter__(self) -> PreparationLock:
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        announced = None
        while True:
            try:
                descriptor = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
            except FileExistsError:
                holder, text = self._read()
                if self._silent(holder, text):
                    continue
                who = self._describe(holder)
                if who != announced:
                    logger.warning(f"Another process is preparing {self.folder} ({who}); waiting for it.")
                    announced = who
                time.sleep(POLL_SECONDS)
                continue
            try:
                os.pwrite(descriptor, self._text(), 0)
            except BaseException:
                os.close(descriptor)
                self.path.unlink(missing_ok=True)
                raise
            self._descriptor = descriptor
            self._heartbeat = threading.Thread(target=self._renew, name="hf-deep-nmt-preparation-lease", daemon=True)
            self._heartbeat.start()
            return self

    def _read(self) -> tuple[dict[str, Any] | None, str]:
        """The owner record and its text; None for a record being written or holding values no run writes."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError:  # gone meanwhile: the exclusive create is tried again
            return None, ""
        try:
            holder = json.loads(text)
        except ValueError:
            return None, text
        return (holder if isinstance(holder, dict) and lock_problem(holder, time.time()) is None else None), text

    def _silent(self, holder: dict[str, Any] | None, text: str) -> bool:
        """Take the record of an owner that is gone over (True), naming it: a process of this host that has ended,
        or any owner whose heartbeat is older than its lease (or a record nobody could read, unchanged as long)."""
        if holder is None:
            try:
                unchanged = time.time() - self.path.stat().st_mtime
            except OSError:
                return False
            if unchanged <= self.lease or not take_over(self.path, text):
                return False
            logger.warning(
                f"Taking over the preparation of {self.folder}: {self.path} was unreadable for {unchanged:.0f} s."
            )
            return True
        pid, host = holder["pid"], holder["host"]
        heartbeat, lease = holder.get("heartbeat"), holder.get("lease_seconds")
        if host == _host() and not process_alive(pid):
            reason = "which has ended"
        elif isinstance(heartbeat, (int, float)) and isinstance(lease, (int, float)):
            silent = time.time() - heartbeat
            if silent <= lease:
                return False
            reason = f"silent for {silent:.0f} s, beyond its lease of {lease:g} s"
        else:
            return False
        if not take_over(self.path, text):
            return False
        logger.warning(
            f"Taking over the preparation of {self.folder} from process {pid} on {host} ({reason}); its building "
            "folder is removed."
        )
        self.taken_over = holder
        return True

    @staticmethod
    def _describe(holder: dict[str, Any] | None) -> str:
        if holder is None:
            return "its owner record is being written"
        started = holder.get("started")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, float) else "?"
        return f"process {holder['pid']} on {holder['host']}, started {since}"

    def _holds(self) -> bool:
        try:
            mine, there = os.fstat(self._descriptor), os.stat(self.path)
        except (OSError, TypeError):
            return False
        return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 4):
            if not self._holds():
                logger.error(f"The preparation of {self.folder} was taken over by another process.")
                return
            try:
                os.pwrite(self._descriptor, self._text(), 0)
            except OSError as error:
                logger.warning(f"Could not renew the lease of {str(self.path)!r}: {error}.")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        try:
            if self._holds():
                self.path.unlink()
        finally:
            os.close(self._descriptor)
            self._descriptor = None


class PreparationStopped(SystemExit):
    """SIGTERM arrived while building: the building folder is removed on the way out."""


@contextlib.contextmanager
def cleaned_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM ends the build by raising `PreparationStopped` (after calling the handler it replaces,
    e.g. a training run's request to stop), so that the `finally` clauses around it remove the building folder and
    the owner record; outside the main thread (where signals cannot be handled) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(number, frame):
        if callable(previous):
            previous(number, frame)
        raise PreparationStopped(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
