"""Checkpoint integrity and listing: which `checkpoint-<step>` folders of a Trainer output folder are complete, and
whether what is in them is what the run wrote.

`Trainer` writes a checkpoint straight into its final folder (`checkpoint-N/`: weights, optimizer, scheduler, RNG
state, and `trainer_state.json` last), so a run killed while writing leaves a folder that looks like the newest
checkpoint but is not one; resuming from it would load half of a state, or restart the step count at 0 with the new
weights. A copied or damaged folder can also hold a truncated file. `last_complete_checkpoint` skips such folders
(checking file sizes and headers, never loading the weights), and `resolve_resume_checkpoint` refuses an incomplete
one that was asked for by name.

A file can also be whole and still not be the one the run wrote: weights copied over from an older checkpoint, one
flipped byte, a `trainer_state.json` whose step was edited. safetensors files carry no checksum, so
`ChecksumRecorder` (a callback `DeepNMTTrainer` adds) records the SHA-256 of every file of a checkpoint in
`<output_dir>/checkpoint_checksums.json` once the Trainer has written it, and `verify_checkpoint` compares them
before a resume or an average reads the folder. In an output folder with such a record, a checkpoint missing from it
was not finished (the run stopped between writing it and recording it) and counts as incomplete.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import zipfile
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from hf_deep_nmt.folders import write_json_atomically

logger = logging.get_logger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# what `Trainer._save_checkpoint` writes besides weights and state unless `save_only_model` (scaler.pt only with fp16)
TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt")
RNG_STATE_PATTERN = "rng_state*.pth"
# The record of checkpoint checksums, in the Trainer output folder beside the checkpoints.
CHECKSUMS_FILE = "checkpoint_checksums.json"
CHECKSUMS_FORMAT = 1
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_HASH_CHUNK = 1 << 22


class CheckpointChecksumError(ValueError):
    """A checkpoint file differs from the one its run recorded, or a recorded file is gone."""


def safetensors_problem(path: str | Path) -> str | None:
    """Why the safetensors file `path` is damaged (None when it looks whole): its JSON header must parse and the file
    must be exactly as long as the header's last data offset says (a truncated copy is shorter)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                return f"{str(path)!r} is truncated ({size} bytes, no safetensors header)"
            header_size = struct.unpack("<Q", prefix)[0]
            if header_size > size - 8:
                return f"{str(path)!r} is truncated (its header alone needs {header_size + 8} bytes, it has {size})"
            header = json.loads(handle.read(header_size))
    except OSError as error:
        return f"{str(path)!r} cannot be read ({error})"
    except ValueError:
        return f"{str(path)!r} has an unreadable safetensors header"
    if not isinstance(header, dict):
        return f"{str(path)!r} has an unreadable safetensors header"
    offsets = [entry.get("data_offsets", [0, 0]) for name, entry in header.items() if name != "__metadata__"]
    end = max((int(stop) for _, stop in offsets), default=0)
    if 8 + header_size + end != size:
        return f"{str(path)!r} is damaged ({size} bytes where its header describes {8 + header_size + end})"
    return None


def torch_file_problem(path: str | Path) -> str | None:
    """Why the `torch.save` file `path` is damaged (None when it looks whole): such files are zip archives, and a
    truncated one has lost the directory at its end."""
    try:
        with zipfile.ZipFile(path) as archive:
            archive.namelist()
    except (OSError, zipfile.BadZipFile) as error:
        return f"{str(path)!r} is damaged or truncated ({error})"
    return None


def checkpoint_problem(folder: str | Path, model_only_allowed: bool = False) -> str | None:
    """Why `folder` is not a complete Trainer checkpoint (None when it is).

    Complete means: whole weights (safetensors header and size agree), a readable `trainer_state.json` (written
    last), and whole `optimizer.pt`, `scheduler.pt` and `rng_state*.pth` files, the rest of the state a resumed run
    needs. With `model_only_allowed` (averaging, which reads only weights) a checkpoint holding none of those three
    (`save_only_model`) is complete too; one holding some of them but not all never is.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return f"{str(folder)!r} is not a folder"
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        return f"{str(folder)!r} has no model weights ({' or '.join(WEIGHT_FILES)})"
    state_file = folder / TRAINER_STATE_FILE
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{str(folder)!r} has no {TRAINER_STATE_FILE} (the run stopped while writing this checkpoint)"
    except (OSError, ValueError) as error:
        return f"{str(state_file)!r} cannot be read ({error}; the run stopped while writing it)"
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"{str(state_file)!r} has no global_step"
    for weights in sorted(folder.glob("model*.safetensors")):
        problem = safetensors_problem(weights)
        if problem is not None:
            return problem
    training_state = [folder / name for name in TRAINING_STATE_FILES] + sorted(folder.glob(RNG_STATE_PATTERN))
    present = [path for path in training_state if path.is_file()]
    if not present and model_only_allowed:
        return _unrecorded_problem(folder)
    missing = [path.name for path in training_state[: len(TRAINING_STATE_FILES)] if not path.is_file()]
    if not list(folder.glob(RNG_STATE_PATTERN)):
        missing.append(RNG_STATE_PATTERN)
    if missing:
        return f"{str(folder)!r} has no {', '.join(missing)} (a resumed run would not continue the same training)"
    for path in present:
        problem = torch_file_problem(path)
        if problem is not None:
            return problem
    return _unrecorded_problem(folder)


def numbered_checkpoints(output_dir: str | Path) -> list[Path]:
    """The `checkpoint-<step>` folders of a Trainer output folder, oldest step first (by number, not by name); none
    when the folder does not exist."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    numbered = [
        (int(match.group(1)), path)
        for path in output_dir.iterdir()
        if (match := _CHECKPOINT_NAME.match(path.name)) and path.is_dir()
    ]
    return [path for _, path in sorted(numbered)]


def last_complete_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete `checkpoint-N` folder under `output_dir` (a warning names every newer incomplete or damaged
    one skipped), or None when there is none."""
    for path in reversed(numbered_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return str(path)
        logger.warning(f"Skipping incomplete checkpoint: {problem}.")
    return None


def resolve_resume_checkpoint(value: str | bool | None, output_dir: str | Path) -> str | None:
    """`resume_from_checkpoint` as given (None, True / "last", or a folder) -> a complete checkpoint folder or None.

    True or "last" means the newest complete checkpoint in `output_dir` (None, with a warning, when there is none yet:
    the run starts from scratch). A named folder must be a complete checkpoint, else `ValueError` says what is
    missing and which complete checkpoint could be used instead. Either way the checkpoint's files must be those its
    run recorded (`verify_checkpoint`), else `CheckpointChecksumError` names the checkpoint and the file.
    """
    if value is None or value is False or value == "":
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "last")):
        found = last_complete_checkpoint(output_dir)
        if found is None:
            logger.warning(f"No complete checkpoint in {str(output_dir)!r} to resume from; training starts afresh.")
        else:
            verify_checkpoint(found)
        return found
    problem = checkpoint_problem(value)
    if problem is not None:
        alternative = last_complete_checkpoint(Path(value).parent) if Path(value).parent.is_dir() else None
        hint = f"; the newest complete one is {alternative!r}" if alternative else ""
        raise ValueError(f"Cannot resume from checkpoint: {problem}{hint}.")
    verify_checkpoint(value)
    return str(value)


# ---- checksums ------------------------------------------------------------------------------------------------------


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of the file `path` (hex), read in chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_checksums(folder: str | Path) -> dict[str, str]:
    """SHA-256 of every file directly in the checkpoint `folder`, by file name."""
    folder = Path(folder)
    return {path.name: file_sha256(path) for path in sorted(folder.iterdir()) if path.is_file()}


def read_checksum_record(output_dir: str | Path) -> dict[str, dict[str, str]] | None:
    """The recorded checksums of `output_dir`'s checkpoints (`{"checkpoint-N": {file: sha256}}`), or None when the
    folder has no record (a run of an earlier version, or a folder of copied checkpoints). A record that cannot be read
    is an error naming it: without it nothing in the folder can be checked."""
    path = Path(output_dir) / CHECKSUMS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointChecksumError(
            f"The checksum record {str(path)!r} cannot be read ({error}); restore it, or move it aside to use the "
            "checkpoints unchecked."
        ) from None
    checkpoints = record.get("checkpoints") if isinstance(record, dict) else None
    if not isinstance(checkpoints, dict) or not all(
        isinstance(files, dict) and all(isinstance(value, str) for value in files.values())
        for files in checkpoints.values()
    ):
        raise CheckpointChecksumError(
            f"The checksum record {str(path)!r} is not a mapping of checkpoint folders to file checksums; restore "
            "it, or move it aside to use the checkpoints unchecked."
        )
    return checkpoints


def record_checkpoint(folder: str | Path) -> dict[str, str]:
    """Hash every file of the finished checkpoint `folder` and add them to the record of its output folder (entries of
    checkpoints that no longer exist, removed by the Trainer's rotation, are dropped). Returns the checksums."""
    folder = Path(folder)
    output_dir = folder.parent
    try:
        checkpoints = read_checksum_record(output_dir) or {}
    except CheckpointChecksumError as error:
        logger.warning(f"{error} A new record is started.")
        checkpoints = {}
    checkpoints = {name: files for name, files in checkpoints.items() if (output_dir / name).is_dir()}
    checkpoints[folder.name] = checkpoint_checksums(folder)
    write_json_atomically(output_dir / CHECKSUMS_FILE, {"format": CHECKSUMS_FORMAT, "checkpoints": checkpoints})
    return checkpoints[folder.name]


def _unrecorded_problem(folder: Path) -> str | None:
    """Why `folder` counts as unfinished: its output folder records checksums, but not this checkpoint's."""
    try:
        record = read_checksum_record(folder.parent)
    except CheckpointChecksumError:
        return None  # `verify_checkpoint` names the unreadable record
    if record is None or folder.name in record:
        return None
    return (
        f"{str(folder)!r} has no checksums in {str(folder.parent / CHECKSUMS_FILE)!r} (the run stopped after writing "
        "the checkpoint, before recording it)"
    )


def verify_checkpoint(folder: str | Path) -> None:
    """`CheckpointChecksumError` naming the checkpoint and the file when a file recorded for `folder` is missing or
    has another SHA-256 than when its run wrote it (weights copied from another checkpoint, an edited
    `trainer_state.json`, a flipped byte). Nothing is checked when the output folder has no record, or no entry for
    this checkpoint (`checkpoint_problem` calls such a checkpoint incomplete). Hashes each file once."""
    folder = Path(folder)
    record = read_checksum_record(folder.parent)
    files = (record or {}).get(folder.name)
    if files is None:
        return
    record_path = folder.parent / CHECKSUMS_FILE
    for name, expected in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointChecksumError(
                f"Checkpoint {str(folder)!r} has lost {name}, which its run wrote (recorded in {str(record_path)!r}); "
                "restore the file, or use another checkpoint."
            )
        actual = file_sha256(path)
        if actual != expected:
            raise CheckpointChecksumError(
                f"Checkpoint {str(folder)!r}: {name} is not the file its run wrote (SHA-256 {actual[:16]}..., "
                f"recorded {expected[:16]}... in {str(record_path)!r}): it was changed or replaced after the "
                "checkpoint was saved. Restore it, or use another checkpoint (move this one aside)."
            )


class ChecksumRecorder(TrainerCallback):
    """After the Trainer has written a checkpoint (`on_save`), record the SHA-256 of its files in
    `<output_dir>/checkpoint_checksums.json` (main process only), for `verify_checkpoint`."""

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if folder.is_dir():
            record_checkpoint(folder)


# ---- where a training stands ----------------------------------------------------------------------------------------

# the key under which `PreemptionCallback` (an `ExportableState`) keeps its state in a checkpoint's trainer_state.json
PREEMPTION_STATE = "PreemptionCallback"


def saved_trainer_state(folder: str | Path) -> dict:
    """The `trainer_state.json` of the checkpoint `folder` as a dict (`{}` when it cannot be read: callers decide on
    complete checkpoints, which `checkpoint_problem` checked)."""
    try:
        state = json.loads((Path(folder) / TRAINER_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def training_finished(folder: str | Path, args) -> bool:
    """Whether the checkpoint `folder` is the end of the training `args` describe: its step is `max_steps` (or more);
    for a run counted in epochs, the step count the Trainer derived from them (saved with the state), when the epoch
    count is still the one it was derived from. Resuming from such a checkpoint must not train: the Trainer would run
    one more step before it checks the step count (it skips the batches of a partly trained epoch first)."""
    state = saved_trainer_state(folder)
    step = state.get("global_step")
    if not isinstance(step, int):
        return False
    if args.max_steps is not None and args.max_steps > 0:
        return step >= args.max_steps
    planned, epochs = state.get("max_steps"), state.get("num_train_epochs")
    return isinstance(planned, int) and planned > 0 and step >= planned and epochs == math.ceil(args.num_train_epochs)


def unscheduled_checkpoint(folder: str | Path) -> bool:
    """Whether the checkpoint `folder` was saved for a preemption at a step the save schedule would not have saved
    (`PreemptionCallback` records it in the checkpoint's Trainer state)."""
    stored = (saved_trainer_state(folder).get("stateful_callbacks") or {}).get(PREEMPTION_STATE)
    return isinstance(stored, dict) and (stored.get("attributes") or {}).get("unscheduled_save") is True
