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
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from transformers.utils import logging

from hf_deep_nmt.callbacks import numbered_checkpoints

logger = logging.get_logger(__name__)

LOCK_FILE = ".hf-deep-nmt.lock"
RUN_RECORD = "hf-deep-nmt-run.json"
# files and folders a run of ours writes into its output folder, besides `checkpoint-N/` (stage-N-L-layers/ for
# train-staged); `overwrite_output_dir` removes these and nothing else
RUN_OUTPUTS = ("results.json", "training_curves.png", "tokenizer", RUN_RECORD)
STAGE_PREFIX = "stage-"
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
    "use_cpu",
    "push_to_hub",
    "hub_model_id",
    "hub_token",
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


def recipe_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(recorded) | set(current))
    return [
        f"{key}: {recorded.get(key, '(unset)')!r} -> {current.get(key, '(unset)')!r}"
        for key in keys
        if recorded.get(key) != current.get(key)
    ]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class RunFolder:
    """`with RunFolder(output_dir, command, recipe):` holds the folder's lock for the block (released on error too;
    a lock left by a killed process of this host is taken over with a warning). Only the main process of a
    multi-process launch (`RANK` 0) locks and writes; the others only read the same decision."""

    def __init__(self, output_dir: str | Path, command: str, recipe: dict[str, Any]):
        self.folder = Path(output_dir)
        self.command = command
        self.recipe = recipe
        self.main_process = int(os.environ.get("RANK", "0")) == 0
        self._locked = False
        self._created = False

    # ---- the lock -----------------------------------------------------------------------------------------------

    def __enter__(self) -> RunFolder:
        if self.main_process:
            self._lock()
        return self

    def __exit__(self, *exc) -> None:
        if self._locked:
            lock = self.folder / LOCK_FILE
            try:
                if json.loads(lock.read_text(encoding="utf-8")).get("pid") == os.getpid():
                    lock.unlink()
            except (OSError, ValueError):
                pass
            self._locked = False
            if self._created and not any(self.folder.iterdir()):
                self.folder.rmdir()  # a refused run leaves no empty folder behind

    def _lock(self) -> None:
        self._created = not self.folder.exists()
        if self.folder.exists() and not self.folder.is_dir():
            raise RunFolderError(f"output_dir {str(self.folder)!r} is a file; choose a folder.")
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = self.folder / LOCK_FILE
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command, "since": time.ctime()}
        for _ in range(2):
            try:
                descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._lock_holder(lock)
                if holder is None:
                    continue  # a stale lock was removed: try again
                raise RunFolderError(
                    f"output_dir {str(self.folder)!r} is in use by another hf-deep-nmt run ({holder}); wait for it "
                    f"to finish or choose another output_dir. If that run is gone, delete {str(lock)!r}."
                ) from None
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(owner) + "\n")
            self._locked = True
            return
        raise RunFolderError(f"Could not lock output_dir {str(self.folder)!r}; delete {str(lock)!r} if no run is on.")

    def _lock_holder(self, lock: Path) -> str | None:
        """Who holds `lock`, or None after removing it when its process (on this host) is gone."""
        try:
            holder = json.loads(lock.read_text(encoding="utf-8"))
            pid, host = int(holder["pid"]), str(holder["host"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):
            return "its lock file cannot be read; it may be starting"
        if host == socket.gethostname() and not _process_alive(pid):
            logger.warning(f"Taking over the lock of {str(self.folder)!r} left by process {pid}, which has ended.")
            lock.unlink(missing_ok=True)
            return None
        return f"process {pid} on {host}, {holder.get('command', 'a run')} started {holder.get('since', '?')}"

    # ---- what the folder holds ----------------------------------------------------------------------------------

    def earlier_outputs(self) -> list[Path]:
        """What earlier runs of ours wrote here: checkpoints, stage folders, results, curves, tokenizer, record."""
        if not self.folder.is_dir():
            return []
        found = list(numbered_checkpoints(self.folder))
        found += sorted(path for path in self.folder.glob(f"{STAGE_PREFIX}*-layers") if path.is_dir())
        found += [self.folder / name for name in RUN_OUTPUTS if (self.folder / name).exists()]
        return found

    def record(self) -> dict[str, Any] | None:
        try:
            record = json.loads((self.folder / RUN_RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and isinstance(record.get("recipe"), dict) else None

    def _write_record(self, finished: bool) -> None:
        if not self.main_process:
            return
        record = {"command": self.command, "finished": finished, "recipe": self.recipe}
        partial = self.folder / f"{RUN_RECORD}.partial"
        partial.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        partial.replace(self.folder / RUN_RECORD)

    # ---- the rule -----------------------------------------------------------------------------------------------

    def start(self, resume_from_checkpoint: str | bool | None, overwrite_output_dir: bool) -> str | bool | None:
        """Apply the module's rule; returns what to resume from (`"last"` when continuing an interrupted run of the
        same recipe), or raises `RunFolderError` naming the folder and the ways out. Writes the run record."""
        resume_asked = resume_from_checkpoint not in (None, False, "")
        if overwrite_output_dir and resume_asked:
            raise ValueError(
                "`overwrite_output_dir` and `resume_from_checkpoint` contradict each other: clear the folder and "
                "start afresh, or continue the run in it; give only one."
            )
        earlier = self.earlier_outputs()
        record = self.record()
        only_record = [path.name for path in earlier] == [RUN_RECORD]
        if only_record and record and record.get("command") == self.command and not record.get("finished"):
            # a run that stopped before it saved anything (a refused setting, a failure while preparing): nothing
            # here to keep, so any recipe may start afresh
            logger.warning(f"{self.folder} holds only the record of a run that saved nothing: starting afresh.")
            earlier = []
        if overwrite_output_dir:
            if earlier and self.main_process:
                logger.warning(f"overwrite_output_dir: removing {[path.name for path in earlier]} from {self.folder}.")
                for path in earlier:
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
            self._write_record(finished=False)
            return None
        if not earlier:
            self._write_record(finished=False)
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
            logger.warning(f"{self.folder} holds an interrupted run of this recipe: continuing it.")
            return "last"
        what = (
            f"a run of another recipe ({'; '.join(differences[:6])}{' ...' if len(differences) > 6 else ''})"
            if record is not None
            else f"outputs of an earlier run without a recipe record ({[path.name for path in earlier[:5]]})"
        )
        raise RunFolderError(f"output_dir {str(self.folder)!r} holds {what}; {ways_out}.")

    def finish(self) -> None:
        """Mark the run finished (re-running the same command is then refused as having nothing to train)."""
        self._write_record(finished=True)
