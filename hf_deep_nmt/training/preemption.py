"""Preemption: a cluster that stops a run (SIGTERM, or SIGUSR1 sent ahead of the kill) gets a checkpoint and a free
output folder, and the same command, requeued on any node, continues from that checkpoint.

The signal handler only sets a flag (`PreemptionSignals`, installed while a run holds its output folder); nothing is
saved from inside it. During training, `PreemptionCallback` turns the flag into the Trainer's own controls at the
end of the current optimizer step: `should_save` (the usual complete `checkpoint-N/`) and `should_training_stop`.
The command then raises `TrainingPreempted` instead of evaluating and exporting, and leaving the run folder releases
its lock. A signal before training starts (data, tokenizer) stops the command at once: there is nothing to save.
In a multi-process run the flag is all-reduced every step, so that every process saves and stops at the same step.

A checkpoint saved for a preemption at a step the save schedule would not have saved is marked so in its Trainer
state, and removed when the continued run makes its next scheduled save (before the Trainer's `save_total_limit`
rotation counts it): the checkpoints left at the end, which `average_checkpoints` averages, are those of an
uninterrupted run. The end of a run (the export, the results and the record marked finished) runs with the signals
held back (`signals_held`): a signal then takes effect once the run is finished, so a folder is never left with an
export in place and a run record that says it is unfinished.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.utils import logging

from hf_deep_nmt.training.checkpoints import numbered_checkpoints, unscheduled_checkpoint

logger = logging.get_logger(__name__)

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class TrainingPreempted(KeyboardInterrupt):
    """The run was asked to stop by a signal; its last checkpoint (if training had started) holds the progress, and
    the same command continues from it. A `KeyboardInterrupt`, so that no `except Exception` swallows it."""

    def __init__(self, signum: int, checkpoint: str | None = None, trained: bool = False):
        name = signal.Signals(signum).name
        if checkpoint:
            where = f"checkpoint {checkpoint!r} saved; run the same command to continue from it"
        elif trained:
            where = (
                "stopped after the last checkpoint of a training (while evaluating, exporting or between stages); run "
                "the same command to continue from it"
            )
        else:
            where = "stopped before training started; nothing to save, run the same command to start again"
        super().__init__(f"{name} received: {where}")
        self.add_note(str(self))  # what the command line reports for an interruption
        self.signum, self.checkpoint = signum, checkpoint


class OutputFolderTakenOver(RuntimeError):
    """Another run took over this run's output folder (its lease was not renewed in time): this run stops without
    writing anything more there."""


class PreemptionSignals:
    """`with PreemptionSignals():` turns SIGTERM and SIGUSR1 into a request to stop (`received`), restoring the
    previous handlers at the end. Outside training (`training` false) the request stops the command at once; during
    training `PreemptionCallback` acts on it. Only the main thread can install handlers; elsewhere it does nothing."""

    current: PreemptionSignals | None = None

    def __init__(self) -> None:
        self.received: int | None = None
        self.training = False
        self.trained = False  # training has ended: a signal now interrupts evaluation or export
        self.taken_over: str | None = None  # set (from the lock's heartbeat) when another run took the folder
        self.held = False  # `signals_held`: a signal is noted (`held_signal`) and acted on at the end of the block
        self.held_signal: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> PreemptionSignals:
        if threading.current_thread() is threading.main_thread():
            for number in PREEMPTION_SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
            self._outer, PreemptionSignals.current = PreemptionSignals.current, self
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        if self._previous:
            PreemptionSignals.current = self._outer
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        first = self.received is None
        self.received = signum
        if self.held:
            self.held_signal = signum
            logger.warning(
                f"{signal.Signals(signum).name} received: stopping once the export, the results and the run record "
                "are written."
            )
            return
        if not self.training:
            raise TrainingPreempted(signum, trained=self.trained)
        if first:
            logger.warning(
                f"{signal.Signals(signum).name} received: saving a checkpoint at the end of this optimizer step, then "
                "stopping."
            )


class PreemptionCallback(TrainerCallback, ExportableState):
    """Save a checkpoint and stop at the end of the optimizer step during which a preemption signal arrived (see the
    module). `stopped_at` is the checkpoint written for it (None when training was not preempted). Its state, saved
    in each checkpoint's `trainer_state.json`, says whether the save schedule would have saved that checkpoint."""

    def __init__(self) -> None:
        self.signals: PreemptionSignals | None = None
        self.signum: int | None = None
        self.stopped_at: str | None = None
        self.unscheduled = False  # the checkpoint now saved is a preemption's, at a step the schedule does not save

    def state(self) -> dict:
        return {"args": {}, "attributes": {"unscheduled_save": self.unscheduled}}

    def on_train_begin(self, args, state, control, **kwargs):
        self.signals = PreemptionSignals.current
        self.stopped_at = self.signum = None
        self.unscheduled = False
        if self.signals is not None:
            self.signals.training, self.signals.trained = True, False

    def on_step_end(self, args, state, control, **kwargs):
        if self.signals is not None and self.signals.taken_over:
            raise OutputFolderTakenOver(self.signals.taken_over)
        if control.should_save:  # the schedule's save (the Trainer's flow callback runs first)
            drop_unscheduled_checkpoints(args, state)
        signum = self.signals.received if self.signals is not None else None
        if args.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor(float(signum or 0), device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            signum = int(flag.item()) or None
        if signum is None:
            return
        self.signum = signum
        self.unscheduled = not control.should_save
        control.should_save = True
        control.should_training_stop = True
        self.stopped_at = f"{args.output_dir}/checkpoint-{state.global_step}"

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_save:  # an epoch-end save of the schedule
            self.unscheduled = False
            drop_unscheduled_checkpoints(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        if self.signals is None:
            return
        self.signals.training, self.signals.trained = False, True
        last = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.signals.received is not None and self.stopped_at is None and last.is_dir():
            # the signal came after the last step end: its checkpoint is the one to continue from
            self.signum, self.stopped_at = self.signals.received, str(last)


def raise_if_preempted(trainer) -> None:
    """After `trainer.train()`: `TrainingPreempted` naming the checkpoint when a signal stopped the training."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, PreemptionCallback) and callback.stopped_at is not None:
            raise TrainingPreempted(callback.signum, callback.stopped_at)


def drop_unscheduled_checkpoints(args, state) -> None:
    """Before a save of the schedule at `state.global_step`: remove the earlier checkpoints saved only for a
    preemption (`unscheduled_checkpoint`). The run continued from them and the save about to be made holds its
    progress; left in place, they would take a scheduled checkpoint's place in the Trainer's `save_total_limit`
    rotation and in the checkpoints averaged at the end. Main process only."""
    if not state.is_world_process_zero:
        return
    for folder in numbered_checkpoints(args.output_dir):
        step = int(folder.name.rpartition("-")[2])
        if step < state.global_step and unscheduled_checkpoint(folder):
            logger.warning(
                f"Removing {str(folder)!r}, saved for a preemption at a step the save schedule does not save: the "
                f"run has continued from it, and its step-{state.global_step} checkpoint takes its place."
            )
            shutil.rmtree(folder)


@contextlib.contextmanager
def signals_held(finished=lambda: False) -> Iterator[None]:
    """Hold SIGTERM and SIGUSR1 back for the block (under a `RunFolder`; elsewhere nothing changes): a signal arriving
    meanwhile is noted and takes effect at the end of the block, as `TrainingPreempted`; or, when `finished()` then
    says the run is done (its record marked finished), it is reported and dropped: there is nothing left to stop or to
    continue. (The handler decides, not a signal mask: any thread of the process may receive the signal.)"""
    signals = PreemptionSignals.current
    if signals is None or signals.held:
        yield
        return
    signals.held, signals.held_signal = True, None
    try:
        yield
    finally:
        signals.held = False
    signum = signals.held_signal
    if signum is None:
        return
    if finished():
        logger.warning(f"{signal.Signals(signum).name} received while the run was being finished: it is complete.")
        return
    raise TrainingPreempted(signum, trained=signals.trained)
