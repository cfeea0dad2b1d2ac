"""`DeepNMTTrainer`: `Seq2SeqTrainer` with the token-budget batches and learning-rate schedules of the papers, and the
guard that skips non-finite steps, and the record of checkpoint checksums."""

from __future__ import annotations

import inspect
from functools import cache, partial

import datasets
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer
from transformers.trainer_utils import seed_worker

from hf_deep_nmt.data.batching import TokenBudgetBatchSampler, pair_lengths
from hf_deep_nmt.data.streaming import StreamedPairs, streaming_dataloader
from hf_deep_nmt.training.callbacks import DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS, NonFiniteGuard
from hf_deep_nmt.training.checkpoints import ChecksumRecorder
from hf_deep_nmt.training.preemption import PreemptionCallback
from hf_deep_nmt.training.run_folder import RunOutputsCallback
from hf_deep_nmt.training.schedules import inverse_sqrt_scheduler, noam_scheduler


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

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # a streamed corpus continues from the position recorded in this checkpoint (`hf_deep_nmt.data.streaming`)
        self.resuming_from = resume_from_checkpoint
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        if isinstance(self.train_dataset, StreamedPairs):  # `streaming: true`: batches made while reading
            return streaming_dataloader(self)
        max_tokens = getattr(self.args, "max_tokens", None)
        if max_tokens is None:
            return super().get_train_dataloader()
        if not isinstance(self.train_dataset, datasets.Dataset):
            raise TypeError(f"`max_tokens` needs a tokenized `datasets.Dataset`, got {type(self.train_dataset)}.")
        sampler = TokenBudgetBatchSampler(
            pair_lengths(self.train_dataset),
            max_tokens,
            num_replicas=max(1, self.args.world_size),
            rank=self.args.process_index,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
        )
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        workers = self.args.dataloader_num_workers
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers if workers else False,
            worker_init_fn=partial(seed_worker, num_workers=workers, rank=self.args.process_index),
        )
        loader = self.accelerator.prepare(loader)
        # The sampler already gives this process its own share; `accelerate` wraps it in a `BatchSamplerShard` that
        # would share it out again (dropping or repeating batches): make that wrapper pass everything through.
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader

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
