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

import hashlib
import json
from functools import partial
from pathlib import Path
from typing import Protocol

import datasets
from torch.utils.data import DataLoader
from transformers.trainer_utils import seed_worker

from hf_deep_nmt.data.batching import (
    BatchPlan,
    TokenBudgetBatchSampler,
    length_array,
    plan_batches,
    read_plan,
    write_plan,
)

PLANS = "batch-plans"  # the folder of stored batch plans, beside a prepared-data folder or in the run folder


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
        seed = args.data_seed if args.data_seed is not None else args.seed
        world_size = max(1, args.world_size)
        plan = self.batch_plan(args, max_tokens, seed, world_size)
        sampler = TokenBudgetBatchSampler(None, num_replicas=world_size, rank=args.process_index, seed=seed, plan=plan)
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

    def batch_plan(self, args, max_tokens: int, seed: int, world_size: int) -> BatchPlan:
        """The run's token-budget batches, computed once and stored (`plan_folders`): the main process of each
        machine reads the stored plan or computes and stores it, then the others memory-map it; a resumed run reads
        it. Without a folder that can be written, each process computes the plan in memory."""
        settings = {"max_tokens": max_tokens, "seed": seed, "processes": world_size, "pairs": len(self.dataset)}
        with args.main_process_first(local=True, desc="token-budget batch plan"):
            lengths = None if self.dataset.cache_files else length_array(self.dataset)
            about = {**settings, "dataset": self._identity(lengths)}
            key = hashlib.sha256(json.dumps(about, sort_keys=True).encode()).hexdigest()[:16]
            for folder in plan_folders(self.dataset, args.output_dir):
                plan = read_plan(folder / key, len(self.dataset))
                if plan is not None:
                    return plan
            lengths = length_array(self.dataset) if lengths is None else lengths
            plan = plan_batches(lengths, max_tokens, seed, multiple_of=world_size)
            del lengths
            for folder in plan_folders(self.dataset, args.output_dir):
                try:
                    write_plan(folder / key, plan, about)
                except OSError:
                    continue  # a read-only prepared-data root: the run folder, or the plan in memory
                return read_plan(folder / key, len(self.dataset)) or plan
            return plan

    def _identity(self, lengths) -> dict:
        """What tells this dataset's rows apart from another's: a memory-mapped one's `datasets` fingerprint (it
        changes with every `select`, `map`, `filter`) and files; an in-memory one's lengths themselves (all the
        batches depend on, and its fingerprint may differ between processes)."""
        if lengths is not None:
            return {"lengths_sha256": hashlib.sha256(lengths.tobytes()).hexdigest()}
        files = [Path(entry["filename"]) for entry in self.dataset.cache_files]
        return {
            "fingerprint": self.dataset._fingerprint,
            "files": [{"name": file.name, "bytes": file.stat().st_size} for file in files],
        }


def plan_folders(dataset, output_dir: str) -> list[Path]:
    """Where the batch plans of `dataset` are stored, in order of preference: beside the prepared-data folder it is
    memory-mapped from (`<folder>.batch-plans`, outside the folder, whose files are checked against its record), so
    that every run on that data shares them; then the run folder."""
    folders = []
    if dataset.cache_files:
        split = Path(dataset.cache_files[0]["filename"]).parent
        if (split.parent / "prepared.json").is_file():
            folders.append(split.parent.parent / f"{split.parent.name}.{PLANS}")
    return [*folders, Path(output_dir) / PLANS]


def as_training_data(dataset) -> TrainingData:
    """The training-data source of a Trainer's `train_dataset`: the dataset itself when it makes its own loader (a
    stream), else the dataset read as tokenized pairs."""
    return dataset if callable(getattr(dataset, "train_dataloader", None)) else TokenizedPairs(dataset)
