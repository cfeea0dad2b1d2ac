"""Training safety: skip an optimizer step whose loss or gradients are not finite, and stop when such steps persist
(before they reach the weights).

Checkpoint integrity and listing (complete checkpoints, checksums, what to resume from) live in
`hf_deep_nmt.training.checkpoints`; their names are re-exported here for the code that imports them from this module.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from hf_deep_nmt.training.checkpoints import (  # noqa: F401  (re-exported: imported from here before they moved)
    RNG_STATE_PATTERN,
    TRAINER_STATE_FILE,
    TRAINING_STATE_FILES,
    WEIGHT_FILES,
    checkpoint_problem,
    last_complete_checkpoint,
    numbered_checkpoints,
    resolve_resume_checkpoint,
    safetensors_problem,
    torch_file_problem,
)

logger = logging.get_logger(__name__)


class NonFiniteTrainingError(RuntimeError):
    """Training met NaN or infinite losses or gradients on more consecutive optimizer steps than allowed; the optimizer
    step that would have written them was not taken."""


# Consecutive optimizer steps with a non-finite loss or gradient that are skipped before the run stops.
DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS = 5


class NonFiniteGuard(TrainerCallback, ExportableState):
    """Skip an optimizer step whose loss or gradients are NaN or infinite; stop the run when such steps persist.

    The rule is fairseq's for an overflowing step: the batch is consumed and its update dropped. Before the optimizer
    step every gradient is set to None, so no PyTorch optimizer touches a weight or its state (moments, step count),
    and the learning-rate scheduler is held for that step, so the schedule counts only the updates taken. The weights,
    the optimizer state and the learning rate of every later step are then exactly those of a run whose data lacked
    the skipped batch. What still moves: the Trainer's `global_step` (`max_steps` counts batches drawn) and the random
    state (dropout of the skipped forward pass).

    Each skip is logged with the optimizer step and a running count, and recorded in `log_history` as
    `{"nonfinite_steps_skipped": count, "step": step}` (the training curves mark it). More than `max_consecutive`
    skipped steps in a row raise `NonFiniteTrainingError`, naming the step, the value and the last checkpoint written;
    `max_consecutive=0` stops at the first one. The count survives a resume (it is saved with the Trainer state).

    The scheduler is reached through the Trainer's callback handler: `DeepNMTTrainer` hands it over; with a Trainer
    that does not, the schedule also advances on skipped steps (a warning says so once). Under fp16 mixed precision the
    gradient scaler skips steps with overflowing gradients itself; the guard then counts non-finite losses only. In a
    multi-process run the decision is all-reduced, so every process skips, or stops at, the same step.
    """

    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS):
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 0:
            raise ValueError(
                "`max_consecutive_nonfinite_steps` must be an integer >= 0 (0: stop at the first non-finite step), "
                f"got {max_consecutive!r}."
            )
        self.max_consecutive = max_consecutive
        self.skipped = 0
        self.consecutive = 0
        self._hook = None
        self._step = 0
        self._last_checkpoint: str | None = None
        self._distributed = False
        self._bad_loss: float | None = None
        self._held_scheduler = None
        self._skipped_now = False
        self._warned_schedule = False

    def state(self) -> dict:
        return {
            "args": {"max_consecutive": self.max_consecutive},
            "attributes": {"skipped": self.skipped, "consecutive": self.consecutive},
        }

    def _where(self) -> str:
        last = self._last_checkpoint or "none in this run"
        return f"optimizer step {self._step + 1}; last checkpoint written: {last}"

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._step = state.global_step
        self._distributed = args.world_size > 1
        stored = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__)
        if isinstance(stored, dict) and state.global_step > 0:  # resumed: continue the count of the run
            self.skipped = int(stored.get("attributes", {}).get("skipped", self.skipped))
            self.consecutive = int(stored.get("attributes", {}).get("consecutive", self.consecutive))
        if model is not None and self._hook is None:
            # run eagerly after the forward even when the Trainer compiles the model (`torch_compile=True`): the
            # check reads the loss on the host, which would break the compiled graph with a warning on every compile
            self._hook = model.register_forward_hook(torch.compiler.disable(self._check_loss))

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step
        self._bad_loss = None

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
        if self._bad_loss is None:
            self._bad_loss = loss.detach().float().mean().item()
        if self.max_consecutive == 0 and not self._distributed:
            # nothing may be skipped: stop now rather than after a backward pass through a NaN
            self._remove_hook()
            raise NonFiniteTrainingError(
                f"The training loss is {self._bad_loss} at {self._where()}. {self._stopped_because()} Lower the "
                "learning rate, check the data of this step, or use bf16 instead of fp16."
            )

    def _stopped_because(self) -> str:
        if self.max_consecutive == 0:
            limit = "`max_consecutive_nonfinite_steps=0` skips none"
        else:
            limit = (
                f"{self.consecutive} optimizer steps in a row were non-finite, more than "
                f"`max_consecutive_nonfinite_steps={self.max_consecutive}` allows ({self.skipped} skipped in this run)"
            )
        return f"Training stopped before the optimizer step, so no checkpoint holds weights updated with it: {limit}."

    def on_pre_optimizer_step(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        if model is None:
            return
        gradients = [p.grad for p in model.parameters() if p.grad is not None]
        device = gradients[0].device if gradients else next(model.parameters()).device
        norm = None
        if gradients and not args.fp16:  # under fp16 the gradient scaler checks gradients itself
            norm = torch.linalg.vector_norm(
                torch.stack([n.float().to(device) for n in torch._foreach_norm(gradients)])
            )
        flags = torch.stack(
            [
                torch.tensor(float(self._bad_loss is not None), device=device),
                (~torch.isfinite(norm)).float() if norm is not None else torch.zeros((), device=device),
            ]
        )
        if self._distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        bad_loss, bad_gradients = (bool(flag) for flag in flags.tolist())  # one host synchronisation per step
        if not (bad_loss or bad_gradients):
            self.consecutive = 0
            return
        self.consecutive += 1
        what = f"non-finite gradients (total norm {norm.item()})" if bad_gradients else "a non-finite loss"
        if bad_loss:
            loss = self._bad_loss if self._bad_loss is not None else "non-finite on another process"
            what += f" after a training loss of {loss}" if bad_gradients else f" ({loss})"
        if self.consecutive > self.max_consecutive:
            self._remove_hook()
            raise NonFiniteTrainingError(
                f"{what[0].upper()}{what[1:]} at {self._where()}. {self._stopped_because()} Lower the learning rate "
                "or set `max_grad_norm`, check the data of these steps, or use bf16 instead of fp16."
            )
        self.skipped += 1
        if not args.fp16:
            for parameter in model.parameters():
                parameter.grad = None  # no optimizer updates a weight, or its state, without a gradient
            self._hold_scheduler(lr_scheduler)
        self._skipped_now = True
        logger.warning(
            f"Skipped optimizer step {self._step + 1}: {what}. {self.skipped} step(s) skipped in this run, "
            f"{self.consecutive} in a row (the run stops after {self.max_consecutive} in a row)."
        )

    def _hold_scheduler(self, scheduler) -> None:
        """Make the scheduler's next `step()` a no-op; `on_step_end` restores it."""
        if scheduler is None:
            if not self._warned_schedule:
                logger.warning(
                    "This Trainer does not give its learning-rate scheduler to callbacks: the schedule advances on "
                    "skipped steps too. `hf_deep_nmt.training.trainer.DeepNMTTrainer` holds it."
                )
                self._warned_schedule = True
            return
        own = vars(scheduler)
        self._held_scheduler = (scheduler, "step" in own, own.get("step"))
        scheduler.step = lambda *args, **kwargs: None

    def on_step_end(self, args, state, control, **kwargs):
        if self._held_scheduler is not None:
            scheduler, had_own, previous = self._held_scheduler
            if had_own:
                scheduler.step = previous
            else:
                del scheduler.step
            self._held_scheduler = None
        if self._skipped_now:
            state.log_history.append({"nonfinite_steps_skipped": self.skipped, "step": state.global_step})
            self._skipped_now = False


def nonfinite_steps_skipped(trainer) -> int:
    """How many optimizer steps the trainer's `NonFiniteGuard` skipped (0 without a guard)."""
    return sum(
        callback.skipped for callback in trainer.callback_handler.callbacks if isinstance(callback, NonFiniteGuard)
    )
