"""A streamed run's batches are collated from the loader worker's arrays (`StreamCollator`, `collate_rows`), not by
`DataCollatorForSeq2Seq`'s per-pair lists; pinned down here: they are the collator's batches tensor for tensor (keys
and their order, dtypes, values) on the sample corpus's batches and on the edge cases (one pair, equal lengths, a
pair longer on one side only, an empty target, padding on the left, `pad_to_multiple_of`, another label padding, no
model), and any collator or setting the arrays cannot reproduce gets the features as lists, as without streaming."""

import copy
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, DataCollatorForSeq2Seq

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.data.streaming import (
    BatchRows,
    FileSource,
    PackedBatch,
    StreamCollator,
    StreamedPairs,
    StreamLoader,
)


@pytest.fixture(scope="module")
def sample(sample_slice):
    """The sample's first 48 pairs, their tokenizer and a one-layer model whose decoder starts with `<s>`."""
    folder = sample_slice(48, 300)
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    config = DeepNMTConfig(
        vocab_size=len(tokenizer),
        d_model=8,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=8,
        decoder_ffn_dim=8,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
    )
    return folder, tokenizer, DeepNMTForConditionalGeneration(config)


def rows_of(sources: list[list[int]], targets: list[list[int]]) -> BatchRows:
    def side(rows):
        return np.array([i for row in rows for i in row], dtype=np.int32), np.array(list(map(len, rows)), np.int64)

    return BatchRows(*side(sources), *side(targets))


def assert_same_batch(fast, slow) -> None:
    assert type(fast) is type(slow) and list(fast.keys()) == list(slow.keys())
    for key in slow:
        assert fast[key].dtype == slow[key].dtype and torch.equal(fast[key], slow[key]), key


def collated(collator, rows: BatchRows):
    """What a stream's loader hands the Trainer for `rows`, and what the collator makes of their features."""
    fast, position = StreamCollator(collator)((rows, {"batches": 1}))
    assert position == {"batches": 1}
    return fast, collator(rows.features())


def test_the_batches_of_a_pass_are_the_collators_tensor_for_tensor(sample):
    folder, tokenizer, model = sample
    stream = StreamedPairs(FileSource(folder / "train.tsv", "es", "en"), tokenizer, 16, 256, 256, max_tokens=500)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    assert StreamCollator(collator).settings is not None  # the collator `train` passes takes the array path
    batches = []
    for batch in stream.batches():
        if batch.position["pass"]:
            break
        batches.append(batch.rows)
    assert len(batches) > 5
    for rows in batches:
        fast, slow = collated(collator, rows)
        assert_same_batch(fast, slow)
        assert set(fast) == {"input_ids", "attention_mask", "labels", "decoder_input_ids"}
        # as a loader worker hands it over: one tensor, unpacked into views of it
        packed = StreamCollator(collator, pack=True)((rows, None))[0]
        assert isinstance(packed, PackedBatch) and packed.ids.dtype == torch.int64
        assert_same_batch(packed.unpacked(), slow)
        # handed over by value (the ids' bytes in the pickle, no shared memory of its own), writable on arrival
        handed = ForkingPickler.dumps(packed)
        assert len(handed) > packed.ids.numel() * 8 and b"torch" not in handed
        arrived = pickle.loads(handed)
        assert arrived.ids.numpy().flags.writeable
        assert_same_batch(arrived.unpacked(), slow)
    # through the loader too (the Trainer's road), in order
    loader = StreamLoader(stream, collator)
    for rows, batch in zip(batches, loader):
        assert_same_batch(batch, collator(rows.features()))


def test_two_loader_workers_hand_over_the_collators_batches(sample):
    folder, tokenizer, model = sample
    source = FileSource(folder / "train.tsv", "es", "en")
    stream = StreamedPairs(source, tokenizer, 8, 256, 256, max_tokens=500, workers=2)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    readers = [stream.reader_share(reader).batches() for reader in (0, 1)]
    expected = [collator(next(readers[index % 2]).features) for index in range(6)]
    loader = iter(StreamLoader(stream, collator, num_workers=2))
    for want in expected:
        assert_same_batch(next(loader), want)


SHAPES = {
    "one pair": ([[5, 6, 2]], [[7, 2]]),
    "equal lengths": ([[5, 6, 2], [8, 9, 2]], [[7, 8, 2], [9, 10, 2]]),
    "longer source, longer target": ([[5, 6, 7, 8, 2], [9, 2]], [[7, 2], [9, 10, 11, 12, 13, 2]]),
    "a one-token target": ([[5, 2], [6, 7, 2]], [[2], [8, 9, 2]]),
    "an empty target": ([[5, 2], [6, 7, 2]], [[], [8, 9, 2]]),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize(
    "setting",
    [{}, {"pad_to_multiple_of": 8}, {"pad_to_multiple_of": 3}, {"label_pad_token_id": 1}, {"model": None}, "left"],
    ids=["default", "multiple-8", "multiple-3", "label-pad-1", "no-model", "left"],
)
def test_edge_cases_are_the_collators_too(sample, shape, setting):
    _, tokenizer, model = sample
    if setting == "left":
        tokenizer = AutoTokenizer.from_pretrained(sample[0] / "tokenizer", padding_side="left")
        setting = {}
    collator = DataCollatorForSeq2Seq(tokenizer, **{"model": model, "label_pad_token_id": -100, **setting})
    assert StreamCollator(collator).settings is not None
    fast, slow = collated(collator, rows_of(*SHAPES[shape]))
    assert_same_batch(fast, slow)


def test_a_side_without_any_id_is_left_to_the_collator(sample):
    """Targets all empty: the collator's own outcome (torch makes float32 of empty lists), never another batch."""
    _, tokenizer, model = sample
    collator = DataCollatorForSeq2Seq(tokenizer, model=None, label_pad_token_id=-100)
    fast, slow = collated(collator, rows_of([[5, 2], [6, 2]], [[], []]))
    assert_same_batch(fast, slow)


@dataclass
class OwnCollator(DataCollatorForSeq2Seq):
    """A collator of the user's: its own `__call__` must run."""

    def __call__(self, features, return_tensors=None):
        return {"count": len(features), **super().__call__(features, return_tensors)}


def test_other_collators_and_settings_get_the_features_as_lists(sample):
    _, tokenizer, model = sample
    rows = rows_of(*SHAPES["longer source, longer target"])
    seen = []

    def plain(features):
        seen.append(features)
        return "mine"

    assert StreamCollator(plain)((rows, None)) == ("mine", None) and seen == [rows.features()]
    others = [
        OwnCollator(tokenizer, model=model),
        DataCollatorForSeq2Seq(tokenizer, model=model, padding="max_length", max_length=12),
        DataCollatorForSeq2Seq(tokenizer, model=model, max_length=12),
        DataCollatorForSeq2Seq(tokenizer, model=None, return_tensors="np"),
    ]
    own_padding = copy.copy(tokenizer)
    # a tokenizer whose `pad` is its own (here: one that calls transformers' own)
    own_padding.__class__ = type(
        "OwnPadding", (type(tokenizer),), {"pad": lambda *args, **kwargs: tokenizer.pad(*args[1:], **kwargs)}
    )
    others.append(DataCollatorForSeq2Seq(own_padding, model=model))
    for collator in others:
        assert StreamCollator(collator).settings is None, collator
        fast, slow = collated(collator, rows)
        assert list(fast) == list(slow) and all(np.array_equal(fast[key], slow[key]) for key in slow)
    assert collated(others[0], rows)[0]["count"] == 2
