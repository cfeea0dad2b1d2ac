"""The batch sampler of a run's token-budget batches (`hf_deep_nmt.data.batching`), apart from them because it is a
torch `Sampler`: the batches are planned without torch (`translate` forms its batches the same way), the sampler is
only made by the training that feeds them to a data loader. `hf_deep_nmt.data.batching.TokenBudgetBatchSampler` names
it too."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from hf_deep_nmt.data.batching import BatchPlan, plan_batches


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batch sampler of a `BatchPlan` (`plan_batches(lengths, ...)`, or a stored plan given as `plan`) for one rank of
    `num_replicas`; `set_epoch` reshuffles the batch order (the same way on every rank, so the ranks' shares stay
    disjoint)."""

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | None,
        max_tokens: int | None = None,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        max_sentences: int | None = None,
        plan: BatchPlan | None = None,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"`rank` must be in [0, {num_replicas}), got {rank}.")
        if plan is None:
            plan = plan_batches(lengths, max_tokens, seed, max_sentences, multiple_of=num_replicas)
        elif len(plan) % num_replicas:
            raise ValueError(f"A plan of {len(plan)} batches cannot give {num_replicas} processes equal shares.")
        self.plan = plan
        self.num_replicas, self.rank, self.seed, self.shuffle = num_replicas, rank, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.plan) // self.num_replicas

    def __iter__(self) -> Iterator[list[int]]:
        order = np.arange(len(self.plan))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + 1_000_003 * (self.epoch + 1))
            order = torch.randperm(len(self.plan), generator=generator).numpy()
        for position in order[self.rank :: self.num_replicas].tolist():
            yield self.plan.batch(position)
