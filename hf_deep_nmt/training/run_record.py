"""The record of a run folder: the recipe of the run that writes there, which decides, before any work, whether a
folder holding earlier checkpoints is resumed, cleared or refused.

The rule (`RunRecord.start`, which `RunFolder.start` applies):

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

The lock that keeps a second run out while one writes is `hf_deep_nmt.training.lock`;
`hf_deep_nmt.training.run_folder.RunFolder` holds both for a run.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from hf_deep_nmt.training.checkpoints import CHECKSUMS_FILE, checkpoint_problem, numbered_checkpoints
from hf_deep_nmt.training.lock import RunFolderError

logger = logging.get_logger(__name__)

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


class RunRecord:
    """The record (`RUN_RECORD`) of the run `command` of `recipe` with `shape` in `folder`: `start` applies the
    module's rule and writes it, `finish` marks the run finished. Only the main process (`main_process`) writes or
    removes; the others read the same decision."""

    def __init__(
        self,
        folder: str | Path,
        command: str,
        recipe: dict[str, Any],
        shape: dict[str, Any] | None = None,
        main_process: bool = True,
    ):
        self.folder = Path(folder)
        self.command = command
        self.recipe = recipe
        self.shape = shape
        self.main_process = main_process

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
            ways.append("accept the new data order with `--resume-from-checkpoint last`")
        elif recorded.get("unit") == self.shape["unit"]:
            per_update, world_size = int(recorded.get("per_update") or 0), self.shape["world_size"]
            accumulation, rest = divmod(per_update, self.shape["per_process"] * world_size)
            keep = []
            if accumulation and not rest:
                keep.append(f"`--gradient-accumulation-steps {accumulation}`")
            per_process, rest = divmod(per_update, self.shape["gradient_accumulation_steps"] * world_size)
            if per_process and not rest:
                flag = "--max-tokens" if self.shape["unit"] == "tokens" else "--per-device-train-batch-size"
                keep.append(f"`{flag} {per_process}`")
            if keep:
                ways.append(
                    f"keep {per_update} {self.shape['unit']} per update with {' or '.join(keep)} and "
                    "`--resume-from-checkpoint last` (the data order differs from then on)"
                )
        ways.append("start afresh with `--overwrite-output-dir true` or another output_dir")
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
            "Restore it; or start afresh with `--overwrite-output-dir true` or another output_dir; or, to continue "
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
        earlier = self._earlier_worth_keeping(record)
        if overwrite_output_dir:
            self._start_afresh(earlier, record, inputs)
            return None
        if not earlier:
            self._write_record(finished=False, written=[])
            return resume_from_checkpoint
        if record is not None and record.get("command") not in (None, self.command):
            raise RunFolderError(
                f"output_dir {str(self.folder)!r} holds a `{record.get('command')}` run, not a `{self.command}` one; "
                "choose another output_dir, or clear it with `--overwrite-output-dir true`."
            )
        differences = recipe_differences(record["recipe"], self.recipe) if record is not None else None
        if resume_asked:
            self._resume_as_asked(record, differences)
            return resume_from_checkpoint
        if differences == []:
            self._continue_interrupted(record)
            return "last"
        raise RunFolderError(self._another_run(record, differences, earlier))

    def _earlier_worth_keeping(self, record: dict[str, Any] | None) -> list[Path]:
        """`earlier_outputs`, but none when the folder holds only the record of an unfinished run of this command:
        a run that stopped before it saved anything (a refused setting, a failure while preparing) left nothing to
        keep, so any recipe may start afresh."""
        earlier = self.earlier_outputs(record)
        only_record = [path.name for path in earlier] == [RUN_RECORD]
        if only_record and record and record.get("command") == self.command and not record.get("finished"):
            logger.warning(f"{self.folder} holds only the record of a run that saved nothing: starting afresh.")
            return []
        return earlier

    def _start_afresh(
        self, earlier: list[Path], record: dict[str, Any] | None, inputs: Iterable[str | Path | None]
    ) -> None:
        """`overwrite_output_dir`: remove what runs of ours wrote (`_overwrite`), then record a new run."""
        kept: list[str] = []
        if earlier and self.main_process:
            read = [Path(item).resolve() for item in inputs if item]
            kept = self._overwrite(earlier, record, read)
        self._write_record(finished=False, written=kept)

    def _resume_as_asked(self, record: dict[str, Any] | None, differences: list[str] | None) -> None:
        """`resume_from_checkpoint` given: continue whatever run the folder holds (a changed recipe is named), with
        the same shape and checksum records."""
        if differences:
            logger.warning(f"Resuming in {self.folder} with a changed recipe: {'; '.join(differences)}.")
        if record is not None:
            self._check_shape(record, resume_asked=True)
            self._check_checksum_records(record)
        self._write_record(finished=False)

    def _continue_interrupted(self, record: dict[str, Any]) -> None:
        """A run of this same recipe: continued when interrupted, refused when finished (nothing to train)."""
        if record.get("finished"):
            raise RunFolderError(
                f"output_dir {str(self.folder)!r} holds a finished run of this same recipe (results in "
                f"{str(self.folder / 'results.json')!r}); there is nothing to train. To train it again from scratch "
                "add `--overwrite-output-dir true` (and `--overwrite-export true` for its export), or choose another "
                "output_dir."
            )
        self._check_shape(record, resume_asked=False)
        self._check_checksum_records(record)
        logger.warning(f"{self.folder} holds an interrupted run of this recipe: continuing it.")
        self._write_record(finished=False)

    def _another_run(self, record: dict[str, Any] | None, differences: list[str] | None, earlier: list[Path]) -> str:
        """Why a folder holding another run (another recipe, or no record) is refused, with the ways out."""
        ways_out = (
            "continue it with `--resume-from-checkpoint last`, remove what runs of hf-deep-nmt wrote there with "
            "`--overwrite-output-dir true` (other files are kept), or choose another output_dir"
        )
        what = (
            f"a run of another recipe ({'; '.join(differences[:6])}{' ...' if len(differences) > 6 else ''})"
            if record is not None
            else f"outputs of an earlier run without a recipe record ({[path.name for path in earlier[:5]]})"
        )
        recorded = record.get("shape") if record is not None else None
        if isinstance(recorded, dict) and self.shape is not None and recorded != self.shape:
            # the launch changed too (e.g. torchrun with another process count): say so, or it goes unnoticed
            what += f", trained with {_describe_shape(recorded)} where this one has {_describe_shape(self.shape)}"
        return f"output_dir {str(self.folder)!r} holds {what}; {ways_out}."

    def finish(self) -> None:
        """Mark the run finished (re-running the same command is then refused as having nothing to train)."""
        self._write_record(finished=True)
