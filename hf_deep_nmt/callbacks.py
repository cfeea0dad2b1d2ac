"""Training safety: stop on a non-finite loss or gradient before it reaches the weights, and resume only from
complete checkpoints.

`Trainer` writes a checkpoint straight into its final folder (`checkpoint-N/`: weights, optimizer, scheduler, RNG
state, and `trainer_state.json` last), so a run killed while writing leaves a folder that looks like the newest
checkpoint but is not one; resuming from it would load half of a state, or restart the step count at 0 with the new
weights. `last_complete_checkpoint` skips such folders, and `resolve_resume_checkpoint` refuses an incomplete one that
was asked for by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

logger = logging.get_logger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
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


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why `folder` is not a complete Trainer checkpoint (None when it is): the weights and a readable
    `trainer_state.json` (written last) must be there."""
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
    """The newest complete `checkpoint-N` folder under `output_dir` (a warning names every newer incomplete one
    skipped), or None when there is none."""
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
