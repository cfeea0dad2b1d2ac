"""The training data as the Trainer sees it: one small interface for every source, so that `DeepNMTTrainer` never asks
which source it was given.

A source makes the Trainer's training loader (`train_dataloader(trainer)`) and keeps whatever its resume needs:

* a tokenized `datasets.Dataset`, in memory or memory-mapped from a prepared-data folder (`TokenizedPairs`):
  token-budget batches (`hf_deep_nmt.data.batching`) under `max_tokens`, else the Trainer's own sentence-count
  loader; its length is the Dataset's, and a resumed run skips the batches already trained as the Trainer does;
* a stream (`hf_deep_nmt.data.streaming.StreamedPairs`): batches made while reading, without a length; its resume
  continues from the position recorded in the checkpoint, and the Trainer skips nothing.

`as_training_data` gives the source of any `train_dataset`: one that brings its own loader is its own source, any other
dataset is read as a tokenized one.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import datasets
from torch.utils.data import DataLoader
from transformers.trainer_utils import seed_worker

from hf_deep_nmt.data.batching import TokenBudgetBatchSampler, pair_lengths


class TrainingData(Protocol):
    """What the Trainer asks of its training data: the loader of this run's batches, for this process, continued
    from the checkpoint the Trainer resumes from."""

    def train_dataloader(self, trainer): ...


class TokenizedPairs:
    """A tokenized dataset (`input_ids`, `labels`) as training data: with `max_tokens`, batches of similar-length
    pairs under the token budget (one share per process, reshuffled every epoch); without, the Trainer's own loader."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def train_dataloader(self, trainer) -> DataLoader:
        max_tokens = getattr(trainer.args, "max_tokens", None)
        if max_tokens is None:
            return trainer.library_train_dataloader()
        if not isinstance(self.dataset, datasets.Dataset):
            raise TypeError(f"`max_tokens` needs a tokenized `datasets.Dataset`, got {type(self.dataset)}.")
        args = trainer.args
        sampler = TokenBudgetBatchSampler(
            pair_lengths(self.dataset),
            max_tokens,
            num_replicas=max(1, args.world_size),
            rank=args.process_index,
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        dataset = trainer._remove_unused_columns(self.dataset, description="Training")
        workers = args.dataloader_num_workers
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=trainer.data_collator,
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers if workers else False,
            worker_init_fn=partial(seed_worker, num_workers=workers, rank=args.process_index),
        )
        loader = trainer.accelerator.prepare(loader)
        # The sampler already gives this process its own share; `accelerate` wraps it in a `BatchSamplerShard` that
        # would share it out again (dropping or repeating batches): make that wrapper pass everything through.
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader


def as_training_data(dataset) -> TrainingData:
    """The training-data source of a Trainer's `train_dataset`: the dataset itself when it makes its own loader (a
    stream), else the dataset read as tokenized pairs."""
    return dataset if callable(getattr(dataset, "train_dataloader", None)) else TokenizedPairs(dataset)
