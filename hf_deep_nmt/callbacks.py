"""Training safety: stop on a non-finite loss or gradient before it reaches the weights, and resume only from
complete checkpoints.

`Trainer` writes a checkpoint straight into its final folder (`checkpoint-N/`: weights, optimizer, scheduler, RNG
state, and `trainer_state.json` last), so a run killed while writing leaves a folder that looks like the newest
checkpoint but is not one; resuming from it would load half of a state, or restart the step count at 0 with the new
weights. A copied or damaged folder can also hold a truncated file. `last_complete_checkpoint` skips such folders
(checking file sizes and headers, never loading the weights), and `resolve_resume_checkpoint` refuses an incomplete
one that was asked for by name.
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

logger = logging.get_logger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# what `Trainer._save_checkpoint` writes besides weights and state unless `save_only_model` (scaler.pt only with fp16)
TRAINING_STATE_FILES = ("optimizer.pt", "scheduler.pt")
RNG_STATE_PATTERN = "rng_state*.pth"
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class NonFiniteTrainingError(RuntimeError):
    """Training met a NaN or infinite loss or gradient; the optimizer step that would have written it was not taken."""


class NonFiniteGuard(TrainerCallback):
    """Stop training at the first non-finite loss (checked after each forward pass in training mode) or gradient
    (checked before each optimizer step), raising `NonFiniteTrainingError` that names the optimizer step, the value,
    and the last checkpoint written. The weights are never updated with it, so no checkpoint after that step exists.

    The transformers default `logging_nan_inf_filter=True` would instead drop a NaN loss from the logs and train on.
    Under fp16 mixed precision the gradient scaler already skips steps with overflowing gradients, so gradients are
    only checked without it; the loss is checked either way. In a multi-process run a non-finite loss is only recorded
    and reported by the gradient check, which sees the same all-reduced gradients on every process, so that all stop
    together instead of one process leaving the others waiting. Each check costs one device synchronisation per
    micro-batch / optimizer step.
    """

    def __init__(self):
        self._hook = None
        self._step = 0
        self._last_checkpoint: str | None = None
        self._distributed = False
        self._bad_loss: float | None = None

    def _where(self) -> str:
        last = self._last_checkpoint or "none in this run"
        return f"optimizer step {self._step + 1}; last checkpoint written: {last}"

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._step = state.global_step
        self._distributed = args.world_size > 1
        if model is not None and self._hook is None:
            self._hook = model.register_forward_hook(self._check_loss)

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step

    def on_save(self, args, state, control, **kwargs):
        self._last_checkpoint = str(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hook()

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _check_loss(self, module, inputs, outputs) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
        if not module.training or loss is None or bool(torch.isfinite(loss.detach()).all()):
            return
        value = loss.detach().float().mean().item()
        if self._distributed:
            self._bad_loss = value
            return
        self._remove_hook()
        raise NonFiniteTrainingError(
            f"The training loss is {value} at {self._where()}. Training stopped before "
            "the optimizer step, so no checkpoint holds weights updated with it. Lower the learning rate, check the "
            "data of this step, or use bf16 instead of fp16."
        )

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if args.fp16 or model is None:
            return
        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        if not gradients:
            return
        device = gradients[0].device
        norm = torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in torch._foreach_norm(gradients)]))
        if bool(torch.isfinite(norm)):
            return
        self._remove_hook()
        loss = f" after a training loss of {self._bad_loss}" if self._bad_loss is not None else ""
        raise NonFiniteTrainingError(
            f"Non-finite gradients (total norm {norm.item()}){loss} at {self._where()}. Training stopped before the "
            "optimizer step, so no checkpoint holds weights updated with them. Lower the learning rate or set "
            "`max_grad_norm`, and check the data of this step."
        )


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
        return None
    missing = [path.name for path in training_state[: len(TRAINING_STATE_FILES)] if not path.is_file()]
    if not list(folder.glob(RNG_STATE_PATTERN)):
        missing.append(RNG_STATE_PATTERN)
    if missing:
        return f"{str(folder)!r} has no {', '.join(missing)} (a resumed run would not continue the same training)"
    for path in present:
        problem = torch_file_problem(path)
        if problem is not None:
            return problem
    return None


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
    missing and which complete checkpoint could be used instead.
    """
    if value is None or value is False or value == "":
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "last")):
        found = last_complete_checkpoint(output_dir)
        if found is None:
            logger.warning(f"No complete checkpoint in {str(output_dir)!r} to resume from; training starts afresh.")
        return found
    problem = checkpoint_problem(value)
    if problem is not None:
        alternative = last_complete_checkpoint(Path(value).parent) if Path(value).parent.is_dir() else None
        hint = f"; the newest complete one is {alternative!r}" if alternative else ""
        raise ValueError(f"Cannot resume from checkpoint: {problem}{hint}.")
    return str(value)
