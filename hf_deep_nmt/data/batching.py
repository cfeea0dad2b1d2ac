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

The batches of a run are a `BatchPlan`: two numpy arrays, the pair indices in batch order and where each batch
starts. It is computed with array operations over the lengths (no Python object per pair), and can be stored as two
`.npy` files (`write_plan`) that every process then memory-maps (`read_plan`): a process holds only the batch order
of an epoch (one integer per batch) and reads the pages of its own batches, so its memory does not grow with the
corpus, and a resumed run reads the stored plan instead of computing it again.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PLAN_FORMAT = 1
PLAN_RECORD = "plan.json"
# The seeded shuffle of a plan is torch's `randperm` (the order every plan was made in), worked out without torch for
# up to this many pairs (a translated file, a stream's buffer: `translate` imports no torch), with torch above it.
SMALL_PERMUTATION = 100_000


def __getattr__(name: str):
    # the batch sampler subclasses torch's `Sampler`: imported with torch only by the training that uses it
    if name == "TokenBudgetBatchSampler":
        from hf_deep_nmt.data.batch_sampler import TokenBudgetBatchSampler

        return TokenBudgetBatchSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def seeded_permutation(count: int, seed: int) -> np.ndarray:
    """`torch.randperm(count, generator=torch.Generator().manual_seed(seed))` as an int64 array: for a small `count`
    and a 32-bit `seed` by its own algorithm (one Fisher-Yates pass drawing torch's 32-bit Mersenne Twister outputs,
    which numpy's legacy generator draws alike from the same seed), else by torch itself."""
    if count > SMALL_PERMUTATION or not 0 <= seed < 2**32:
        import torch

        return torch.randperm(count, generator=torch.Generator().manual_seed(seed)).numpy()
    order = list(range(count))
    draws = np.random.RandomState(seed).randint(0, 2**32, size=max(count - 1, 0), dtype=np.uint64).tolist()
    for position, draw in enumerate(draws):
        other = position + draw % (count - position)
        order[position], order[other] = order[other], order[position]
    return np.array(order, dtype=np.int64)


def pair_lengths(dataset, source_column: str = "input_ids", target_column: str = "labels") -> list[int]:
    """`max(len(source), len(target))` per row of a tokenized `datasets.Dataset`, as a list (`length_array`)."""
    return length_array(dataset, source_column, target_column).tolist()


def length_array(dataset, source_column: str = "input_ids", target_column: str = "labels") -> np.ndarray:
    """`max(len(source), len(target))` per row of a tokenized `datasets.Dataset`, computed in Arrow (no Python lists
    of token ids) into an int32 array (4 bytes per pair); a `labels`-less dataset uses the source length alone."""
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")
    lengths = pc.list_value_length(table[source_column])
    if target_column in dataset.column_names:
        lengths = pc.max_element_wise(lengths, pc.list_value_length(table[target_column]))
    return np.asarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int32)


@dataclass
class BatchPlan:
    """The batches of a run: batch `b` is `indices[offsets[b]:offsets[b + 1]]` (arrays in memory, or memory-mapped
    from a stored plan)."""

    indices: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def batch(self, number: int) -> list[int]:
        return self.indices[self.offsets[number] : self.offsets[number + 1]].tolist()

    def batches(self) -> list[list[int]]:
        return [self.batch(number) for number in range(len(self))]


def _check_settings(lengths: np.ndarray, max_tokens: int, max_sentences: int | None, multiple_of: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"`max_tokens` must be >= 1, got {max_tokens}.")
    if max_sentences is not None and max_sentences < 1:
        raise ValueError(f"`max_sentences` must be >= 1 or None, got {max_sentences}.")
    if multiple_of < 1:
        raise ValueError(f"`multiple_of` must be >= 1, got {multiple_of}.")
    too_long = np.flatnonzero(lengths > max_tokens)
    if len(too_long):
        raise ValueError(
            f"{len(too_long)} pair(s) are longer than `max_tokens`={max_tokens} on their own (row {too_long[0]} has "
            f"{lengths[too_long[0]]} tokens); raise `max_tokens` or lower the length limits."
        )
    if len(lengths) < multiple_of:
        raise ValueError(f"{len(lengths)} pairs cannot give every one of {multiple_of} processes a batch.")


def _batch_starts(sorted_lengths: np.ndarray, max_tokens: int, max_sentences: int | None) -> np.ndarray:
    """Where the greedy packing of the length-sorted pairs starts a new batch (position 0 included).

    The packing adds a pair to the open batch while `(rows + 1) x its length <= max_tokens` (and `rows <
    max_sentences`); the lengths only grow, so the pair's own length is the batch's longest and a pair of length `L`
    joins a batch of fewer than `capacity(L) = min(max_tokens // L, max_sentences)` rows. Pairs of one length form a
    run: it tops up the open batch, then fills whole batches of `capacity(L)`. One step per distinct length."""
    values, firsts, counts = np.unique(sorted_lengths, return_index=True, return_counts=True)
    starts, rows = [np.zeros(1, dtype=np.int64)], 0
    for value, first, count in zip(values.tolist(), firsts.tolist(), counts.tolist()):
        capacity = max_tokens // value if value else len(sorted_lengths)  # empty pairs cost nothing
        if max_sentences is not None:
            capacity = min(capacity, max_sentences)
        top_up = min(count, max(0, capacity - rows))
        rest = count - top_up
        if rest:
            starts.append(np.arange(first + top_up, first + count, capacity, dtype=np.int64))
            rows = rest - capacity * ((rest - 1) // capacity)
        else:
            rows += top_up
    return np.concatenate(starts)


def plan_batches(
    lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    seed: int = 0,
    max_sentences: int | None = None,
    multiple_of: int = 1,
) -> BatchPlan:
    """The batches of `lengths` with `len(batch) * max(lengths[batch]) <= max_tokens` (and at most `max_sentences`
    rows), similar lengths together; the number of batches is a multiple of `multiple_of`.

    Raises `ValueError` for a pair longer than the budget (naming it) and when the batches cannot be split into
    `multiple_of` equal shares.
    """
    lengths = np.asarray(lengths)
    if lengths.dtype.kind not in "iu":  # a list of ints gives int64; `length_array`'s int32 is used as it is
        lengths = lengths.astype(np.int64)
    _check_settings(lengths, max_tokens, max_sentences, multiple_of)
    shuffled = seeded_permutation(len(lengths), seed)
    order = shuffled[np.argsort(lengths[shuffled], kind="stable")]  # stable: the shuffle breaks ties
    del shuffled
    offsets = np.append(_batch_starts(lengths[order], max_tokens, max_sentences), len(lengths))
    # Equal shares for every process: halve the batch with the most rows (the first of them) until the count divides
    # evenly. A half never costs more than the whole, so the budget still holds.
    while (len(offsets) - 1) % multiple_of:
        sizes = np.diff(offsets)
        largest = int(np.argmax(sizes))
        if sizes[largest] < 2:
            raise ValueError(
                f"Cannot split {len(sizes)} single-pair batches into {multiple_of} equal shares; raise `max_tokens`."
            )
        offsets = np.insert(offsets, largest + 1, offsets[largest] + sizes[largest] // 2)
    index_type = np.int32 if len(lengths) < 2**31 else np.int64
    return BatchPlan(order.astype(index_type), offsets)


def token_batches(
    lengths: Sequence[int], max_tokens: int, seed: int = 0, max_sentences: int | None = None, multiple_of: int = 1
) -> list[list[int]]:
    """`plan_batches` as lists of indices (for the few thousand pairs of a stream's buffer or a translated file)."""
    return plan_batches(lengths, max_tokens, seed, max_sentences, multiple_of).batches()


# ---- a stored plan ------------------------------------------------------------------------------------------------


def read_plan(folder: str | Path, pairs: int) -> BatchPlan | None:
    """The plan stored in `folder`, memory-mapped; None when there is none, or when it does not hold `pairs` pairs
    in whole batches (a damaged or foreign one, which is then computed again)."""
    folder = Path(folder)
    try:
        record = json.loads((folder / PLAN_RECORD).read_text())
        indices = np.load(folder / "indices.npy", mmap_mode="r")
        offsets = np.load(folder / "offsets.npy", mmap_mode="r")
    except (OSError, ValueError):
        return None
    whole = (
        record.get("format") == PLAN_FORMAT
        and indices.ndim == offsets.ndim == 1
        and len(indices) == pairs == record.get("pairs")
        and len(offsets) == record.get("batches", -1) + 1 >= 2
        and offsets[0] == 0
        and offsets[-1] == pairs
    )
    return BatchPlan(indices, offsets) if whole else None


def write_plan(folder: str | Path, plan: BatchPlan, about: dict | None = None) -> None:
    """Store `plan` in `folder` whole or not at all: written into a folder of its own beside it (named by host and
    process), then renamed. Processes that write the same plan at once leave one of their identical copies."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = folder.with_name(f".{folder.name}.building-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(building, ignore_errors=True)
    building.mkdir()
    try:
        np.save(building / "indices.npy", np.ascontiguousarray(plan.indices))
        np.save(building / "offsets.npy", np.ascontiguousarray(plan.offsets))
        record = {"format": PLAN_FORMAT, "pairs": len(plan.indices), "batches": len(plan), **(about or {})}
        (building / PLAN_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True))
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a damaged one (`read_plan` gave None)
        try:
            os.rename(building, folder)
        except OSError:
            if not folder.is_dir():  # not another process's copy of the same plan: a real failure
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
