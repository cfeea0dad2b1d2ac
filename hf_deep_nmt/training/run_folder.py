"""One run per output folder: a lock against two runs writing into one `output_dir` at once, and a record of the recipe
that decides, before any work, whether a folder holding earlier checkpoints is resumed, cleared or refused.

The rule (`RunFolder.start`):

* a folder with nothing of ours in it is used as it is (files we do not know are never touched);
* a folder holding the checkpoints or results of an interrupted run with the same recipe continues it from its last
  complete checkpoint (the same command re-run after a kill picks up where it stopped, and says so);
* a folder holding a run that finished with the same recipe is refused: there is nothing to train;
* a folder holding another run (another recipe, or no record) is refused unless `resume_from_checkpoint` is given
  (continue it anyway, e.g. with more steps) or `overwrite_output_dir` (remove what earlier runs of ours wrote there:
  checkpoints, stage folders, results, curves, the record; nothing else).

What a run wrote is decided by who wrote it, never by name: the record lists every top-level entry a run of ours
creates (`written`), claimed before it is written (`claim_outputs`: the Trainer's checkpoints by `RunOutputsCallback`,
results, curves, the tokenizer of `train-staged`). `overwrite_output_dir` removes only listed entries, keeps any the
recipe reads (a tokenizer, a saved model, a corpus file), and refuses, removing nothing, when the folder holds
outputs under our names that no record lists (a folder of an older version, or the user's own files).

A checksum record the run wrote (`checkpoint_checksums.json`, listed in `written`, or under `checksum_records` inside a
stage folder) that is gone while its folder holds checkpoints stops a continued run, naming it: without it a swapped
or edited checkpoint would be resumed unchecked.

The record also holds the run's shape (`run_shape`: the process count and the batch per optimizer update); a run
continued with another shape is refused, naming both, since it would not continue the same training.

The lock (`LOCK_FILE`) names its holder and carries a lease that a heartbeat thread renews (`heartbeat` time,
`lease_seconds`). A lock whose process has ended (on this host: a missing pid, a zombie) or, from another host, whose
lease has run out, is taken over atomically (renamed away, and put back if it changed meanwhile); a live lease never
is. So a job that a cluster preempted and requeued on another node takes over the folder of its dead predecessor.
A lock's numbers never decide how long a command waits (at most the lease this process writes), and a lock holding
values no run writes (`lock_problem`: a process id out of range, a lease that is not a number of seconds up to a day,
a heartbeat in the future beyond a clock skew) is refused, naming the file and the field, and never taken over.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from hf_deep_nmt.training.callbacks import numbered_checkpoints
from hf_deep_nmt.training.checkpoints import CHECKSUMS_FILE, checkpoint_problem
from hf_deep_nmt.training.preemption import PreemptionSignals

logger = logging.get_logger(__name__)

LOCK_FILE = ".hf-deep-nmt.lock"
RUN_RECORD = "hf-deep-nmt-run.json"
# the run record's list of checksum records inside written folders (`stage-N-L-layers/checkpoint_checksums.json`)
CHECKSUM_RECORDS = "checksum_records"
# files and folders a run of ours writes into its output folder, besides `checkpoint-N/` (stage-N-L-layers/ for
# train-staged); `overwrite_output_dir` removes those of them the record lists and nothing else
RUN_OUTPUTS = ("results.json", "training_curves.png", "tokenizer", RUN_RECORD)
STAGE_PREFIX = "stage-"
# a folder a run only reads when it is there (the recipe may point `tokenizer_name_or_path` at it): an earlier output
# only when a record lists it
READ_ONLY_OUTPUTS = ("tokenizer",)
# seconds a lock stays valid without a heartbeat (`HF_DEEP_NMT_LOCK_LEASE`, read when a folder is locked); the holder
# renews it every quarter of that
LEASE_VARIABLE = "HF_DEEP_NMT_LOCK_LEASE"
DEFAULT_LEASE_SECONDS = 120.0
LEASE_LIMITS = (1.0, 86400.0)  # what the variable admits, and so the longest lease a lock of this version carries
LEASE_SECONDS: float | None = None  # None: from `LEASE_VARIABLE` (tests set a number)
# how far in the future another host's heartbeat may lie (its clock ahead of ours) and still be believed
CLOCK_SKEW_SECONDS = 60.0
MAX_PID = 1 << 22  # no system's process ids go beyond this (Linux's largest pid_max)
LOCK_SIZE = 1024  # the lock is rewritten in place at this fixed size, so that a reader never sees a shorter file
# settings that say where results go or how progress is shown, not what is trained: they may change between the
# runs of one recipe
NOT_RECIPE = {
    "output_dir",
    "overwrite_output_dir",
    "resume_from_checkpoint",
    "max_consecutive_nonfinite_steps",
    "logging_dir",
    "run_name",
    "report_to",
    "disable_tqdm",
    "logging_steps",
    "logging_first_step",
    "logging_strategy",
    "export_dir",
    "overwrite_export",
    "repo_id",
    "plot_curves",
    "translate_examples",
    "dataloader_num_workers",
    "preprocessing_num_workers",  # how the data is prepared, not what it is
    "prepared_data_dir",
    "use_cpu",
    "push_to_hub",
    "hub_model_id",
    "hub_token",
    "local_rank",  # set by the launcher for each process (-1 without one): the run's shape is recorded instead
}


class RunFolderError(FileExistsError):
    """The output folder is in use or holds a run this command must not write over."""


def _plain(value: Any) -> Any:
    """`value` as JSON data that is the same for the same settings in any process."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__  # an object without a stable text form (e.g. a config object): its kind only


def run_recipe(*arguments: Any) -> dict[str, Any]:
    """The settings of the argument dataclasses that define what is trained (everything but `NOT_RECIPE`)."""
    recipe = {}
    for group in arguments:
        for item in dataclasses.fields(group):
            if item.init and item.name not in NOT_RECIPE and not item.name.startswith("_"):
                recipe[item.name] = _plain(getattr(group, item.name))
    return json.loads(json.dumps(recipe, sort_keys=True, default=str))


# Recipe settings added since runs were first recorded, with the value that reproduces what runs recorded without
# them did: a folder recorded before a setting existed resumes when the recipe leaves it at that value.
ADDED_SETTINGS = {"streaming": False, "stream_buffer_pairs": 100_000, "tokenizer_train_pairs": None}


def recipe_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: old -> new` for each recipe setting that changed; settings a record of an earlier version holds that are
    no longer part of a recipe (`NOT_RECIPE`) do not count, nor settings it predates (`ADDED_SETTINGS`) left at the
    value that trains what it trained."""
    keys = sorted((set(recorded) | set(current)) - NOT_RECIPE)
    predates = {key for key in ADDED_SETTINGS if key not in recorded and current.get(key) == ADDED_SETTINGS[key]}
    return [
        f"{key}: {recorded.get(key, '(unset)')!r} -> {current.get(key, '(unset)')!r}"
        for key in keys
        if recorded.get(key) != current.get(key) and key not in predates
    ]


def _process_alive(pid: int) -> bool:
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


def lease_seconds() -> float:
    """The lease this process writes into its locks: `HF_DEEP_NMT_LOCK_LEASE` seconds (120 when unset), `ValueError`
    naming the variable and what it admits for anything but a number from 1 to 86400."""
    if LEASE_SECONDS is not None:
        return LEASE_SECONDS
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


def run_shape(training_args) -> dict[str, Any]:
    """The process count and the batch of one optimizer update (per process x gradient accumulation x processes), in
    tokens with `max_tokens`, else in sentences: what a resumed run must keep to continue the same training."""
    world_size = max(1, int(getattr(training_args, "world_size", 1)))
    max_tokens = getattr(training_args, "max_tokens", None)
    per_process = max_tokens if max_tokens is not None else training_args.per_device_train_batch_size
    accumulation = training_args.gradient_accumulation_steps
    return {
        "world_size": world_size,
        "per_process": per_process,
        "gradient_accumulation_steps": accumulation,
        "unit": "tokens" if max_tokens is not None else "sentences",
        "per_update": per_process * accumulation * world_size,
    }


def _describe_shape(shape: dict[str, Any]) -> str:
    return (
        f"{shape.get('world_size')} process(es), {shape.get('per_update')} {shape.get('unit')} per update "
        f"({shape.get('per_process')} x {shape.get('gradient_accumulation_steps')} accumulation x "
        f"{shape.get('world_size')})"
    )


def _read_record(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((folder / RUN_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("recipe"), dict) else None


def _write_record_file(folder: Path, record: dict[str, Any]) -> None:
    partial = folder / f"{RUN_RECORD}.partial"
    partial.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    partial.replace(folder / RUN_RECORD)


def _main_process() -> bool:
    text = os.environ.get("RANK", "0")
    try:
        rank = int(text)
    except ValueError:
        rank = -1
    if rank < 0:
        raise ValueError(
            f"RANK={text!r} is not a process rank: the launcher (torchrun, accelerate) sets it to 0, 1, 2 ...; "
            "unset it for a single-process run."
        )
    return rank == 0


def claim_outputs(output_dir: str | Path, *paths: str | Path) -> None:
    """List `paths` (inside `output_dir`; their top-level entries) in the run record as written by this run, before
    they are written, so that `overwrite_output_dir` may later remove them. Nothing happens without a record (a
    folder no `RunFolder` holds), on processes other than the main one, or for paths outside `output_dir`."""
    root = Path(output_dir)
    record = _read_record(root) if _main_process() else None
    if record is None:
        return
    written = set(record.get("written") or [])
    checksums = set(_listed_checksum_records(record))
    for path in paths:
        try:
            parts = Path(path).absolute().relative_to(root.absolute()).parts
        except ValueError:
            continue
        if parts and parts[0] != RUN_RECORD:
            written.add(parts[0])
            if parts[-1] == CHECKSUMS_FILE:  # a record resume relies on: its absence is an error, not a shrug
                checksums.add("/".join(parts))
    if written != set(record.get("written") or []) or checksums != set(_listed_checksum_records(record)):
        updated = {**record, "written": sorted(written)}
        if checksums - {CHECKSUMS_FILE}:  # the top-level one is known from `written` (so records before this key)
            updated[CHECKSUM_RECORDS] = sorted(checksums - {CHECKSUMS_FILE})
        _write_record_file(root, updated)


def _listed_checksum_records(record: dict[str, Any]) -> list[str]:
    """The checksum records (paths relative to the run folder) that a run record says its run wrote."""
    value = record.get(CHECKSUM_RECORDS)
    listed = [item for item in value if isinstance(item, str)] if isinstance(value, list) else []
    if CHECKSUMS_FILE in (record.get("written") or []) and CHECKSUMS_FILE not in listed:
        listed.append(CHECKSUMS_FILE)
    return listed


def missing_checksum_records(folder: str | Path, record: dict[str, Any] | None) -> list[Path]:
    """The checksum records the run record lists that are gone while their folder holds two or more complete
    checkpoints: without them `verify_checkpoint` has nothing to compare with, and a swapped or edited checkpoint would
    be resumed unchecked. The record is written after each checkpoint is complete, so a folder with one complete
    checkpoint and no record is what a run killed between the two leaves (CI caught that kill): it resumes unchecked,
    as before the record existed."""
    found = []
    for relative in _listed_checksum_records(record or {}):
        path = Path(folder) / relative
        if ".." in Path(relative).parts or path.is_file():
            continue
        if sum(checkpoint_problem(checkpoint) is None for checkpoint in numbered_checkpoints(path.parent)) > 1:
            found.append(path)
    return found


class RunOutputsCallback(TrainerCallback):
    """List each Trainer checkpoint in the run record before it is written (`claim_outputs`): the checkpoint folder
    under the run's output folder, or the stage folder that holds it for `train-staged`."""

    def _claim(self, args, state) -> None:
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        for root in (Path(args.output_dir), Path(args.output_dir).parent):
            if (root / RUN_RECORD).is_file():
                # the checkpoint, and the checksum record `ChecksumRecorder` keeps beside it
                claim_outputs(root, checkpoint, Path(args.output_dir) / CHECKSUMS_FILE)
                return

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            self._claim(args, state)

    def on_save(self, args, state, control, **kwargs):
        self._claim(args, state)  # a save no step end announced (e.g. asked for by another callback later)


class RunFolder:
    """`with RunFolder(output_dir, command, recipe, shape):` holds the folder's lock for the block (released on error
    and on a preemption signal too; see the module for taking over a lock left behind), with SIGTERM / SIGUSR1
    handled as requests to save and stop (`hf_deep_nmt.training.preemption`). Only the main process of a multi-process
    launch (`RANK` 0) locks and writes; the others only read the same decision."""

    def __init__(
        self, output_dir: str | Path, command: str, recipe: dict[str, Any], shape: dict[str, Any] | None = None
    ):
        self.folder = Path(output_dir)
        self.command = command
        self.recipe = recipe
        self.shape = shape
        self.main_process = _main_process()
        self.lock_lost = threading.Event()
        self._locked = False
        self._created = False
        self._descriptor: int | None = None
        self._owner: dict[str, Any] = {}
        self._lease = DEFAULT_LEASE_SECONDS
        self._stop_heartbeat = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._signals = PreemptionSignals()

    # ---- the lock -----------------------------------------------------------------------------------------------

    def __enter__(self) -> RunFolder:
        self._signals.__enter__()
        try:
            if self.main_process:
                self._lock()
        except BaseException:
            self._signals.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._locked:
                self._release()
                if self._created and self.folder.is_dir() and not any(self.folder.iterdir()):
                    self.folder.rmdir()  # a refused run leaves no empty folder behind
        finally:
            self._signals.__exit__(*exc)

    def _lock_text(self) -> bytes:
        self._owner["heartbeat"] = time.time()
        text = json.dumps(self._owner).encode()
        return text + b" " * (LOCK_SIZE - 1 - len(text)) + b"\n"

    def _lock(self) -> None:
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
            self._descriptor, self._locked = descriptor, True
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
                self._signals.taken_over = message
                self.lock_lost.set()
                logger.error(message)
                return
            try:
                os.pwrite(self._descriptor, self._lock_text(), 0)
            except OSError as error:
                logger.warning(f"Could not renew the lease of {str(self.folder / LOCK_FILE)!r}: {error}.")

    def _release(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        try:
            if self._holds_lock():
                (self.folder / LOCK_FILE).unlink()
        finally:
            os.close(self._descriptor)
            self._descriptor, self._locked = None, False

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
        """Move the stale lock whose text was `seen` out of the way, atomically: renamed to a name of this process, and
        put back when its text changed meanwhile (its holder renewed it: it lives). True when it is gone."""
        stale = lock.with_name(f"{LOCK_FILE}.stale-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(lock, stale)
        except FileNotFoundError:
            return True  # another run took it first; the exclusive create decides who gets it
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

    # ---- what the folder holds ----------------------------------------------------------------------------------

    def earlier_outputs(self, record: dict[str, Any] | None = None) -> list[Path]:
        """What earlier runs of ours may have written here, by name: checkpoints, stage folders, results, curves,
        record, and the tokenizer folder when a record lists it (otherwise it may be the recipe's own)."""
        if not self.folder.is_dir():
            return []
        listed = set((record or {}).get("written") or [])
        found = list(numbered_checkpoints(self.folder))
        found += sorted(path for path in self.folder.glob(f"{STAGE_PREFIX}*-layers") if path.is_dir())
        found += [
            self.folder / name
            for name in RUN_OUTPUTS
            if os.path.lexists(self.folder / name) and (name not in READ_ONLY_OUTPUTS or name in listed)
        ]
        return found

    def record(self) -> dict[str, Any] | None:
        return _read_record(self.folder)

    def _write_record(self, finished: bool, written: Iterable[str] | None = None) -> None:
        """Write the record; `written` replaces the list of what runs of ours wrote, else the list on disk is kept."""
        if not self.main_process:
            return
        current = self.record() or {}
        if written is None:
            written = current.get("written") or []
        record = {"command": self.command, "finished": finished, "recipe": self.recipe}
        if written:  # none yet: the key is left out (a record without it lists nothing)
            record["written"] = sorted(written)
        listed = _listed_checksum_records(current)
        checksums = [item for item in listed if item != CHECKSUMS_FILE and item.split("/")[0] in written]
        if checksums:
            record[CHECKSUM_RECORDS] = checksums
        if self.shape is not None:
            record["shape"] = self.shape
        _write_record_file(self.folder, record)

    # ---- the rule -----------------------------------------------------------------------------------------------

    def _overwrite(self, earlier: list[Path], record: dict[str, Any] | None, inputs: list[Path]) -> list[str]:
        """Remove what the record lists of `earlier` (not the record, not what the recipe reads); refuse, removing
        nothing, when an output under our names is not listed. Returns the listed entries that stay."""
        listed = set(record.get("written") or []) if record is not None else set()
        unlisted = [path.name for path in earlier if path.name != RUN_RECORD and path.name not in listed]
        if unlisted:
            why = (
                "no record lists them as written by a run of hf-deep-nmt (a folder of an older version, which kept "
                "no such list, or files of your own)"
            )
            raise RunFolderError(
                f"overwrite_output_dir: output_dir {str(self.folder)!r} holds {unlisted[:8]}"
                f"{' ...' if len(unlisted) > 8 else ''}, which may not be removed: {why}. Nothing was removed. "
                "Delete or move them yourself if they are not needed (a folder of an older hf-deep-nmt: delete "
                "its checkpoint-*/ and results), or choose another output_dir."
            )
        kept = []
        for path in earlier:
            if path.name == RUN_RECORD:
                continue
            target = path.resolve()
            read = [item for item in inputs if item == target or target in item.parents]
            if read:
                logger.warning(f"overwrite_output_dir: keeping {str(path)!r}: the recipe reads {str(read[0])!r}.")
                kept.append(path.name)
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        removed = [path.name for path in earlier if path.name not in kept and path.name != RUN_RECORD]
        if removed:
            logger.warning(f"overwrite_output_dir: removed {removed} from {self.folder} (written by earlier runs).")
        return kept

    def _check_shape(self, record: dict[str, Any], resume_asked: bool) -> None:
        """Refuse to continue a run with another process count or batch per update (warn, with an explicit resume,
        for a process count changed while the batch per update is kept: only the data order differs)."""
        recorded = record.get("shape")
        if not isinstance(recorded, dict) or self.shape is None or recorded == self.shape:
            return
        both = f"the run in {str(self.folder)!r} was trained with {_describe_shape(recorded)}, this one has " + (
            _describe_shape(self.shape)
        )
        same_update = (recorded.get("per_update"), recorded.get("unit")) == (
            self.shape["per_update"],
            self.shape["unit"],
        )
        if same_update and resume_asked:
            logger.warning(f"Resuming with another process count: {both}; the data order differs from then on.")
            return
        ways = [f"launch it with {recorded.get('world_size')} process(es) and the recorded batch settings"]
        if same_update:
            ways.append("accept the new data order with `--resume_from_checkpoint last`")
        elif recorded.get("unit") == self.shape["unit"]:
            per_update, world_size = int(recorded.get("per_update") or 0), self.shape["world_size"]
            accumulation, rest = divmod(per_update, self.shape["per_process"] * world_size)
            keep = []
            if accumulation and not rest:
                keep.append(f"`--gradient_accumulation_steps {accumulation}`")
            per_process, rest = divmod(per_update, self.shape["gradient_accumulation_steps"] * world_size)
            if per_process and not rest:
                flag = "--max_tokens" if self.shape["unit"] == "tokens" else "--per_device_train_batch_size"
                keep.append(f"`{flag} {per_process}`")
            if keep:
                ways.append(
                    f"keep {per_update} {self.shape['unit']} per update with {' or '.join(keep)} and "
                    "`--resume_from_checkpoint last` (the data order differs from then on)"
                )
        ways.append("start afresh with `--overwrite_output_dir true` or another output_dir")
        raise RunFolderError(f"Cannot continue: {both}. To continue it, {'; or '.join(ways)}.")

    def _check_checksum_records(self, record: dict[str, Any]) -> None:
        """Refuse to continue a run whose record lists a checksum record that is gone (`missing_checksum_records`)."""
        missing = missing_checksum_records(self.folder, record)
        if not missing:
            return
        entry = missing[0].relative_to(self.folder).as_posix()
        where = "`written`" if entry == CHECKSUMS_FILE else f"`{CHECKSUM_RECORDS}`"
        raise RunFolderError(
            f"Cannot continue the run in {str(self.folder)!r}: {str(missing[0])!r} is missing, though the run "
            f"record {str(self.folder / RUN_RECORD)!r} lists it (deleted or moved, unless the run stopped between "
            "writing its first checkpoint and recording it). It holds the checksums of the checkpoints in "
            f"{str(missing[0].parent)!r}; without it a swapped or edited checkpoint would be resumed unchecked. "
            "Restore it; or start afresh with `--overwrite_output_dir true` or another output_dir; or, to continue "
            f"from these checkpoints unchecked, remove {entry!r} from the run record's {where}."
        )

    def start(
        self,
        resume_from_checkpoint: str | bool | None,
        overwrite_output_dir: bool,
        inputs: Iterable[str | Path | None] = (),
    ) -> str | bool | None:
        """Apply the module's rule; returns what to resume from (`"last"` when continuing an interrupted run of the
        same recipe), or raises `RunFolderError` naming the folder and the ways out. Writes the run record. `inputs`
        are the paths the recipe reads (tokenizer, saved model, corpus files): never removed."""
        resume_asked = resume_from_checkpoint not in (None, False, "")
        if overwrite_output_dir and resume_asked:
            raise ValueError(
                "`overwrite_output_dir` and `resume_from_checkpoint` contradict each other: clear the folder and "
                "start afresh, or continue the run in it; give only one."
            )
        record = self.record()
        earlier = self.earlier_outputs(record)
        only_record = [path.name for path in earlier] == [RUN_RECORD]
        if only_record and record and record.get("command") == self.command and not record.get("finished"):
            # a run that stopped before it saved anything (a refused setting, a failure while preparing): nothing
            # here to keep, so any recipe may start afresh
            logger.warning(f"{self.folder} holds only the record of a run that saved nothing: starting afresh.")
            earlier = []
        if overwrite_output_dir:
            kept: list[str] = []
            if earlier and self.main_process:
                read = [Path(item).resolve() for item in inputs if item]
                kept = self._overwrite(earlier, record, read)
            self._write_record(finished=False, written=kept)
            return None
        if not earlier:
            self._write_record(finished=False, written=[])
            return resume_from_checkpoint
        ways_out = (
            "continue it with `--resume_from_checkpoint last`, remove what runs of hf-deep-nmt wrote there with "
            "`--overwrite_output_dir true` (other files are kept), or choose another output_dir"
        )
        if record is not None and record.get("command") not in (None, self.command):
            raise RunFolderError(
                f"output_dir {str(self.folder)!r} holds a `{record.get('command')}` run, not a `{self.command}` one; "
                "choose another output_dir, or clear it with `--overwrite_output_dir true`."
            )
        differences = recipe_differences(record["recipe"], self.recipe) if record is not None else None
        if resume_asked:
            if differences:
                logger.warning(f"Resuming in {self.folder} with a changed recipe: {'; '.join(differences)}.")
            if record is not None:
                self._check_shape(record, resume_asked=True)
                self._check_checksum_records(record)
            self._write_record(finished=False)
            return resume_from_checkpoint
        if differences == [] and record.get("finished"):
            raise RunFolderError(
                f"output_dir {str(self.folder)!r} holds a finished run of this same recipe (results in "
                f"{str(self.folder / 'results.json')!r}); there is nothing to train. To train it again from scratch "
                "add `--overwrite_output_dir true` (and `--overwrite_export true` for its export), or choose another "
                "output_dir."
            )
        if differences == []:
            self._check_shape(record, resume_asked=False)
            self._check_checksum_records(record)
            logger.warning(f"{self.folder} holds an interrupted run of this recipe: continuing it.")
            self._write_record(finished=False)
            return "last"
        what = (
            f"a run of another recipe ({'; '.join(differences[:6])}{' ...' if len(differences) > 6 else ''})"
            if record is not None
            else f"outputs of an earlier run without a recipe record ({[path.name for path in earlier[:5]]})"
        )
        recorded = record.get("shape") if record is not None else None
        if isinstance(recorded, dict) and self.shape is not None and recorded != self.shape:
            # the launch changed too (e.g. torchrun with another process count): say so, or it goes unnoticed
            what += f", trained with {_describe_shape(recorded)} where this one has {_describe_shape(self.shape)}"
        raise RunFolderError(f"output_dir {str(self.folder)!r} holds {what}; {ways_out}.")

    def finish(self) -> None:
        """Mark the run finished (re-running the same command is then refused as having nothing to train)."""
        self._write_record(finished=True)
