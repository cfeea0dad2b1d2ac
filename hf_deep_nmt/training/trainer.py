"""`DeepNMTTrainer`: `Seq2SeqTrainer` with the token-budget batches and learning-rate schedules of the papers, and the
guard that skips non-finite steps, and the record of checkpoint checksums."""

from __future__ import annotations

import inspect
from functools import cache

from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer, TrainerCallback

from hf_deep_nmt.data.training_data import as_training_data
from hf_deep_nmt.training.callbacks import DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS, NonFiniteGuard
from hf_deep_nmt.training.checkpoints import ChecksumRecorder
from hf_deep_nmt.training.preemption import PreemptionCallback
from hf_deep_nmt.training.run_folder import RunOutputsCallback
from hf_deep_nmt.training.schedules import inverse_sqrt_scheduler, noam_scheduler
from hf_deep_nmt.training.sharded import root_unsharded


class DeepNMTTrainer(Seq2SeqTrainer):
    """`Seq2SeqTrainer` with token-budget training batches (`args.max_tokens`, one share per process), the fairseq
    inverse-sqrt / Noam schedules (`args.lr_schedule`) and a `NonFiniteGuard` (skips non-finite steps, stops after
    `args.max_consecutive_nonfinite_steps` in a row; one passed in `callbacks` is used instead), a
    `PreemptionCallback` (SIGTERM / SIGUSR1: save a checkpoint and stop), a `RunOutputsCallback` (each checkpoint
    listed in the run record before it is written) and a `ChecksumRecorder` (the SHA-256 of each checkpoint's files,
    checked on resume and averaging). Everything else is the library's."""

    def __init__(self, *args, callbacks=None, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        smoothing = getattr(training_args, "label_smoothing_factor", 0.0)
        if not 0.0 <= smoothing < 1.0:  # as the arguments check it: 1 would train towards the uniform distribution
            raise ValueError(
                f"`label_smoothing_factor` must be in [0, 1) (0 for none, 0.1 in the recipes), got {smoothing!r}."
            )
        callbacks = list(callbacks or [])
        if not any(isinstance(callback, NonFiniteGuard) for callback in callbacks):
            limit = getattr(training_args, "max_consecutive_nonfinite_steps", DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS)
            callbacks.insert(0, NonFiniteGuard(limit))
        # in this order: a preemption asks for a save at a step end, the checkpoint is listed before it is written,
        # and its files are hashed once the Trainer wrote them
        for kind in (PreemptionCallback, RunOutputsCallback, ChecksumRecorder):
            if not any(isinstance(callback, kind) for callback in callbacks):
                callbacks.append(kind())
        super().__init__(*args, callbacks=callbacks, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """With `label_smoothing_factor`, a model of this package smooths its loss itself (`label_smoothing=`, the
        same loss as the library's `LabelSmoother`), so that a training step keeps its chunked output-layer loss
        instead of handing the whole logits to the smoother. Other models, a `compute_loss_func` or a loss
        normalised over several batches (`num_items_in_batch`) go the library's way."""
        if (
            self.label_smoother is not None
            and self.compute_loss_func is None
            and num_items_in_batch is None
            and "labels" in inputs
            and smooths_its_own_loss(self.accelerator.unwrap_model(model))
        ):
            outputs = model(**inputs, label_smoothing=self.label_smoother.epsilon)
            return (outputs["loss"], outputs) if return_outputs else outputs["loss"]
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        """The library's, with the root unit of an FSDP2 model whole while it generates and every rank generating in
        step (`hf_deep_nmt.training.sharded`: `generate` calls the encoder outside the root's forward)."""
        with root_unsharded(model) as sharded:
            if sharded:
                gen_kwargs = {**(gen_kwargs or getattr(self, "_gen_kwargs", None) or {}), "synced_gpus": True}
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # the training data may continue from what it recorded in this checkpoint (a stream: its position)
        self.resuming_from = resume_from_checkpoint
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        # the training data makes its own loader: token-budget batches of a tokenized dataset, or a stream's
        return as_training_data(self.train_dataset).train_dataloader(self)

    def library_train_dataloader(self) -> DataLoader:
        """`Seq2SeqTrainer`'s own training loader (sentence-count batches), for the training data that uses it."""
        return super().get_train_dataloader()

    def add_checkpoint_writer(self, writer: TrainerCallback) -> None:
        """Place `writer`, a callback that writes a file into each checkpoint (a stream's position), before the
        `ChecksumRecorder`, so that its file is among the checkpoint's recorded files; one of its kind placed by an
        earlier loader is replaced."""
        callbacks = self.callback_handler.callbacks
        callbacks[:] = [callback for callback in callbacks if not isinstance(callback, type(writer))]
        checksums = [i for i, callback in enumerate(callbacks) if isinstance(callback, ChecksumRecorder)]
        callbacks.insert(checksums[0] if checksums else len(callbacks), writer)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = self._create_scheduler(num_training_steps, optimizer)
        # Callbacks get the optimizer and scheduler the handler was built with (None unless passed to the Trainer):
        # hand over the ones in use, so that `NonFiniteGuard` can hold the schedule on a skipped step.
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, scheduler
        return scheduler

    def _create_scheduler(self, num_training_steps: int, optimizer=None):
        schedule = getattr(self.args, "lr_schedule", "trainer")
        if schedule == "trainer" or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        optimizer = optimizer or self.optimizer
        warmup_steps = max(1, self.args.get_warmup_steps(num_training_steps))
        if schedule == "inverse_sqrt":
            self.lr_scheduler = inverse_sqrt_scheduler(optimizer, warmup_steps, self.args.warmup_init_lr)
        else:
            self.lr_scheduler = noam_scheduler(optimizer, self.model.config.d_model, warmup_steps)
        return self.lr_scheduler


def smooths_its_own_loss(model) -> bool:
    """Whether `model` is one of this package's translation models (installed or loaded as remote code: compared by
    the forward's `label_smoothing` parameter, not by class), and not wrapped by an adapter whose forward may not pass
    the argument on."""
    return model_class_smooths_its_own_loss(type(model))


@cache
def model_class_smooths_its_own_loss(model_class: type) -> bool:
    """`smooths_its_own_loss` by class, read once per class (the Trainer asks at every step)."""
    forward = getattr(model_class, "forward", None)
    return (
        getattr(model_class, "chunks_training_loss", None) is not None
        and forward is not None
        and "label_smoothing" in inspect.signature(forward).parameters
    )
