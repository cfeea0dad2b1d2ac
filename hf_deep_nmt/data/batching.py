"""Token-budget batching: batches of similar-length pairs whose padded size stays under a token budget (the papers'
"4096 tokens per GPU"), dealt out to the processes of a distributed run so that each gets its own batches.

Neither `transformers` nor `accelerate` offers this: the Trainer's samplers count sentences, not tokens, and
`accelerate`'s batch-sampler sharding pads the last round with repeated batches. Written here, like fairseq's
`batch_by_size`:

* the cost of a batch is `sentences x longest side` (the padded size of the larger of the two tensors), never above
  `max_tokens`;
* pairs are sorted by length, ties broken by a seeded shuffle, and packed greedily, so a batch holds pairs of similar
  length (length bucketing); the batches are formed once per run and their order is reshuffled every epoch;
* with several processes, batch `i` of an epoch goes to rank `i mod world_size`; the batch count is made a multiple
  of the world size by halving the largest batches, so every rank takes the same number of steps, every pair is
  used exactly once per epoch and no rank repeats another's data.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler


def pair_lengths(dataset, source_column: str = "input_ids", target_column: str = "labels") -> list[int]:
    """`max(len(source), len(target))` per row of a tokenized `datasets.Dataset`, computed in Arrow (no Python lists
    of token ids); a `labels`-less dataset uses the source length alone."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    lengths = pc.list_value_length(table[source_column])
    if target_column in dataset.column_names:
        lengths = pc.max_element_wise(lengths, pc.list_value_length(table[target_column]))
    return lengths.to_pylist()


def token_batches(
    lengths: Sequence[int], max_tokens: int, seed: int = 0, max_sentences: int | None = None, multiple_of: int = 1
) -> list[list[int]]:
    """Indices grouped into batches with `len(batch) * max(lengths[batch]) <= max_tokens` (and at most
    `max_sentences` rows), similar lengths together; the number of batches is a multiple of `multiple_of`.

    Raises `ValueError` for a pair longer than the budget (naming it) and when the batches cannot be split into
    `multiple_of` equal shares.
    """
    if max_tokens < 1:
        raise ValueError(f"`max_tokens` must be >= 1, got {max_tokens}.")
    if max_sentences is not None and max_sentences < 1:
        raise ValueError(f"`max_sentences` must be >= 1 or None, got {max_sentences}.")
    if multiple_of < 1:
        raise ValueError(f"`multiple_of` must be >= 1, got {multiple_of}.")
    too_long = [index for index, length in enumerate(lengths) if length > max_tokens]
    if too_long:
        raise ValueError(
            f"{len(too_long)} pair(s) are longer than `max_tokens`={max_tokens} on their own (row {too_long[0]} has "
            f"{lengths[too_long[0]]} tokens); raise `max_tokens` or lower the length limits."
        )
    if len(lengths) < multiple_of:
        raise ValueError(f"{len(lengths)} pairs cannot give every one of {multiple_of} processes a batch.")
    generator = torch.Generator().manual_seed(seed)
    shuffled = torch.randperm(len(lengths), generator=generator).tolist()
    order = sorted(shuffled, key=lambda index: lengths[index])  # stable: the shuffle breaks ties
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for index in order:
        candidate = max(longest, lengths[index])
        full = max_sentences is not None and len(batch) >= max_sentences
        if batch and (full or (len(batch) + 1) * candidate > max_tokens):
            batches.append(batch)
            batch, candidate = [], lengths[index]
        batch.append(index)
        longest = candidate
    if batch:
        batches.append(batch)
    # Equal shares for every process: halve the batch with the most rows until the count divides evenly. A half
    # never costs more than the whole, so the budget still holds.
    while len(batches) % multiple_of:
        largest = max(range(len(batches)), key=lambda position: len(batches[position]))
        if len(batches[largest]) < 2:
            raise ValueError(
                f"Cannot split {len(batches)} single-pair batches into {multiple_of} equal shares; raise `max_tokens`."
            )
        whole = batches.pop(largest)
        middle = len(whole) // 2
        batches[largest:largest] = [whole[:middle], whole[middle:]]
    return batches


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batch sampler of `token_batches` for one rank of `num_replicas`; `set_epoch` reshuffles the batch order
    (the same way on every rank, so the ranks' shares stay disjoint)."""

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        max_sentences: int | None = None,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"`rank` must be in [0, {num_replicas}), got {rank}.")
        self.batches = token_batches(lengths, max_tokens, seed, max_sentences, multiple_of=num_replicas)
        self.num_replicas, self.rank, self.seed, self.shuffle = num_replicas, rank, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.batches) // self.num_replicas

    def __iter__(self) -> Iterator[list[int]]:
        order = range(len(self.batches))
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + 1_000_003 * (self.epoch + 1))
            order = torch.randperm(len(self.batches), generator=generator).tolist()
        for position in list(order)[self.rank :: self.num_replicas]:
            yield list(self.batches[position])
