"""Decoding through ONNX Runtime, for every family: `OnnxDecoder` runs the two graphs of an `export_onnx` folder
(`hf_deep_nmt.serving.onnx_export`) with the decoder's state as explicit tensors, greedy (`greedy`) or with beam
search (`beam`, `generate()`'s rules, so that the tokens are `generate()`'s), optionally on the int8 graphs. It is a
`Decoder`: `translate` runs it in a model's place (`load_onnx_model`, `hf-deep-nmt translate --backend onnxruntime`).
The exporter's names stay importable from here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hf_deep_nmt.serving import onnx_checks
from hf_deep_nmt.serving.decoder import Decoder
from hf_deep_nmt.serving.onnx_layout import ENCODER_FIELDS, LAYOUT_FILE, ONNX_SUBFOLDER, SLOTS  # noqa: F401
from hf_deep_nmt.serving.onnx_layout import slot_name as _slot_name
from hf_deep_nmt.serving.options import DecodingOptions, SavedGenerationConfig
from hf_deep_nmt.serving.plain_tokenizer import load_tokenizer
from hf_deep_nmt.serving.threads import check_threads

# The exporter's names, importable from here too, imported at their first use: the exporter imports torch and
# transformers, which decoding with ONNX Runtime never needs.
_EXPORTER_NAMES = frozenset(
    {"PREPROCESSING_HINT", "export_for_serving", "export_into_model", "export_onnx", "quiet_preprocessing_hint"}
)


def __getattr__(name: str):
    if name in _EXPORTER_NAMES:
        return getattr(importlib.import_module("hf_deep_nmt.serving.onnx_export"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class MissingOnnxRuntimeError(RuntimeError):
    """The optional `onnxruntime` package is not installed."""


def require_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise MissingOnnxRuntimeError(
            "decoding with ONNX Runtime needs the onnxruntime package; install it with "
            "`pip install 'hf-deep-nmt[onnx]'` (or `pip install onnxruntime`)."
        ) from None
    return onnxruntime


def _top(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The `k` largest of each row of `scores` (rows, n), best first and the lower index first among equal scores
    (ONNX TopK's rule; torch.topk leaves that order unspecified): (values, indices)."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return scores[np.arange(len(scores))[:, None], order], order


# LogSoftmax, then TopK over the last axis, of a (rows, vocabulary) float input `logits`, k from the int64 input `k`
# (opset 13): the vocabulary-wide part of a beam step, run by ONNX Runtime (its TopK puts the lower index first among
# equal scores). A TopK over a whole row reads it one score at a time, which cost twice the log-softmax; so the row is
# cut into parts of `part` scores (int64 input, a divisor of the vocabulary: `_part_size`), each part's maximum taken
# (a vectorized reduction), and the TopK runs over the maxima and then over the k parts with the best maxima only,
# taken in the row's order. The k best scores of a row lie in those parts: a part left out has k chosen parts whose
# maxima rank before any of its scores (greater, or equal in a part earlier in the row), so the values, tokens and
# their order are those of one TopK over the row. tests/test_onnx_beam_search.py builds the graph again with
# onnx.helper; it is kept serialized so that decoding needs onnxruntime alone and imports no onnx.
_TOP_GRAPH = (
    b'\x08\x07\x12\x00:\xbb\x07\n5\n\x06logits\x12\tlog_probs"\nLogSoftmax*\x14\n\x04axis\x18\xff\xff\xff\xff'
    b'\xff\xff\xff\xff\xff\x01\xa0\x01\x02\n4\n\nrows_parts\n\x04part\x12\x0bparts_shape"\x06Concat*\x0b\n\x04'
    b'axis\x18\x00\xa0\x01\x02\n(\n\tlog_probs\n\x0bparts_shape\x12\x05parts"\x07Reshape\n8\n\x05parts\x12\x06'
    b'maxima"\tReduceMax*\x0b\n\x04axes@\x02\xa0\x01\x07*\x0f\n\x08keepdims\x18\x00\xa0\x01\x02\n@\n\x06maxima'
    b'\n\x01k\x12\x0bbest_maxima\x12\nbest_parts"\x04TopK*\x14\n\x04axis\x18\xff\xff\xff\xff\xff\xff\xff\xff'
    b'\xff\x01\xa0\x01\x02\nJ\n\nbest_parts\n\x01k\x12\x06chosen\x12\x05order"\x04TopK*\x14\n\x04axis\x18\xff'
    b"\xff\xff\xff\xff\xff\xff\xff\xff\x01\xa0\x01\x02*\x0e\n\x07largest\x18\x00\xa0\x01\x02\n'\n\x06chosen\n"
    b'\x04last\x12\x0cchosen_index"\tUnsqueeze\n<\n\x05parts\n\x0cchosen_index\x12\x08gathered"\x08GatherND*'
    b'\x11\n\nbatch_dims\x18\x01\xa0\x01\x02\n*\n\x08gathered\n\trows_flat\x12\ncandidates"\x07Reshape\n>\n\nc'
    b'andidates\n\x01k\x12\x06values\x12\tpositions"\x04TopK*\x14\n\x04axis\x18\xff\xff\xff\xff\xff\xff\xff'
    b'\xff\xff\x01\xa0\x01\x02\n\x1c\n\tpositions\n\x04part\x12\x04slot"\x03Div\n\x1e\n\tpositions\n\x04part'
    b'\x12\x06offset"\x03Mod\n4\n\x06chosen\n\x04slot\x12\x07part_id"\x0eGatherElements*\x0b\n\x04axis\x18\x01'
    b'\xa0\x01\x02\n\x1b\n\x07part_id\n\x04part\x12\x05first"\x03Mul\n\x19\n\x05first\n\x06offset\x12\x03ids"'
    b"\x03Add\x12\x03top*\x1d\x08\x02\x10\x07:\x0b\x00\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01B\nrows_parts*"
    b"\x16\x08\x01\x10\x07:\n\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01B\x04last*\x1c\x08\x02\x10\x07:\x0b\x00"
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01B\trows_flatZ!\n\x06logits\x12\x17\n\x15\x08\x01\x12\x11\n\x06"
    b"\x12\x04rows\n\x07\x12\x05vocabZ\x0f\n\x01k\x12\n\n\x08\x08\x07\x12\x04\n\x02\x08\x01Z\x12\n\x04part\x12"
    b"\n\n\x08\x08\x07\x12\x04\n\x02\x08\x01b\x1d\n\x06values\x12\x13\n\x11\x08\x01\x12\r\n\x06\x12\x04rows\n"
    b"\x03\x12\x01kb\x1a\n\x03ids\x12\x13\n\x11\x08\x07\x12\r\n\x06\x12\x04rows\n\x03\x12\x01kB\x04\n\x00\x10"
    b"\r"
)
_TOP_SESSIONS: dict = {}  # by thread count: one small session per process


@functools.lru_cache(maxsize=64)
def _part_size(vocab: int, k: int) -> int:
    """The length of the parts `_TOP_GRAPH` cuts a row of `vocab` scores into for its top `k`: the divisor of `vocab`
    nearest sqrt(vocab / k) (about as many scores in the k parts kept as there are parts) that leaves at least `k`
    parts; 1 (each score a part of its own: one plain TopK) where `vocab` has no other."""
    sizes = [size for size in range(1, math.isqrt(vocab) + 1) if vocab % size == 0 and vocab // size >= k]
    return min(sizes, key=lambda size: abs(math.log(size * size * k / vocab)))


def _session_options(onnxruntime, threads: int):
    """Options of a session on `threads` threads. Its worker threads sleep when a run ends instead of spinning: the
    decoding loop runs numpy between the graphs, and three sessions each keep their own pool, so spinning workers
    took the cores that loop and the next graph needed (at 2 threads, a whole `translate` cost twice the CPU time of
    1 thread and took longer)."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    if threads > 1:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _top_log_probs(logits: np.ndarray, k: int, threads: int, barred: int | None = None):
    """The `k` best log-probabilities of each row of `logits` (log-softmax over the row, as torch.log_softmax) and
    their tokens, best first and the lower token first among equal ones, on `threads` threads. `barred`: a token given
    -inf after the softmax (`min_new_tokens`), so that the others keep their probabilities: one more is taken and the
    barred one, if among them, goes last."""
    if threads not in _TOP_SESSIONS:
        import onnxruntime

        options = _session_options(onnxruntime, threads)
        _TOP_SESSIONS[threads] = onnxruntime.InferenceSession(_TOP_GRAPH, options, providers=["CPUExecutionProvider"])
    wanted = k if barred is None else min(k + 1, logits.shape[-1])
    sizes = np.array([wanted, _part_size(logits.shape[-1], wanted)], dtype=np.int64)
    values, ids = _TOP_SESSIONS[threads].run(None, {"logits": logits, "k": sizes[:1], "part": sizes[1:]})
    if barred is not None:
        values[ids == barred] = -np.inf
        values, order = _top(values, k)
        ids = np.take_along_axis(ids, order, 1)
    return values, ids


def _spread(kept: np.ndarray, active: np.ndarray, rows: int) -> np.ndarray:
    """`kept` (the rows `active` of `rows`) in place, zeros in the rows between."""
    spread = np.zeros((rows, *kept.shape[1:]), kept.dtype)
    spread[active] = kept
    return spread


class _BeamSearch:
    """The bookkeeping of `generate()`'s beam search, on scores alone, for `batch` sentences of `beams` rows each
    (rows grouped by sentence): 2 * beams candidates a step, a hypothesis finishes only from the top `beams`, the
    length penalty on the generated length, the early-stopping rules (`early`: True, False or "never"). The graphs
    that produce the scores are `OnnxDecoder.beam`'s; this class only says which rows go on and which have ended.
    numpy in float32 with torch's order of operations; among equal scores the lower index goes first."""

    def __init__(self, batch: int, beams: int, max_length: int, start: int, pad: int, eos: int, penalty, early):
        self.beams, self.max_length, self.eos, self.penalty, self.early = beams, max_length, eos, penalty, early
        self.length = 1  # tokens in every hypothesis, the start token included
        self.running = np.full((batch, beams, max_length), pad, dtype=np.int64)
        self.running[:, :, 0] = start
        self.running_scores = np.zeros((batch, beams), np.float32)
        self.running_scores[:, 1:] = -1e9  # the beams start equal: one of them goes on
        # the `beams` best finished hypotheses of each sentence, and whether a slot holds one
        self.sequences, self.scores = self.running.copy(), np.full((batch, beams), -1e9, np.float32)
        self.lengths = np.zeros((batch, beams), dtype=np.int64)
        self.finished = np.zeros((batch, beams), dtype=bool)
        self.unsatisfied = np.ones((batch, 1), dtype=bool)  # a sentence that may still improve
        self.unfinished = True
        self.sentences = np.arange(batch)[:, None]

    def advance(self, best: np.ndarray, best_ids: np.ndarray, gone: np.ndarray | None = None) -> np.ndarray:
        """Extend the hypotheses by one token, given each row's best log-probabilities `best` (rows, width), best
        first, and their tokens `best_ids` (`_top_log_probs`, width min(2 * beams, vocabulary)); returns the row of
        the previous step each new row continues. The best 2 * beams of beams x vocabulary are among each row's
        best 2 * beams (a row adds one score to all its tokens). `gone` (batch, 1): sentences that could no longer
        improve and left the batch (their scores are stand-ins); their candidates count as ended for the stopping
        rule, which they can no longer change."""
        batch, beams, keep, sentences = self.running.shape[0], self.beams, 2 * self.beams, self.sentences
        candidates = (best.reshape(batch, beams, -1) + self.running_scores[:, :, None]).reshape(batch, -1)
        top_index = np.argsort(-candidates, axis=1, kind="stable")[:, :keep]  # `_top`, its row index made once
        top_scores, source_beam = candidates[sentences, top_index], top_index // best.shape[-1]
        ids = best_ids.reshape(batch, -1)[sentences, top_index]
        top_sequences = self.running[sentences, source_beam]
        top_sequences[:, :, self.length] = ids
        hits = (ids == self.eos) | (self.length + 1 >= self.max_length)
        still = top_scores + hits * np.float32(-1e9)
        chosen = np.argsort(-still, axis=1, kind="stable")[:, :beams]
        self.running, self.running_scores = top_sequences[sentences, chosen], still[sentences, chosen]
        ended = hits.copy()
        ended[:, beams:] = False  # a hypothesis finishes only from the top `beams`
        # nothing ended and no finished score below a stand-in's (-1e9; a score that did not end is below it): the
        # finished hypotheses stay as they are, which `_finish` would find at the cost of a dozen numpy calls
        if ended.any() or self.scores[:, -1].min() < np.float32(-1e9):
            self._finish(top_sequences, top_scores, ended)
        self.length += 1
        self._update_unfinished(hits if gone is None else hits | gone)
        return (source_beam[sentences, chosen] + sentences * beams).reshape(-1)

    def _finish(self, sequences: np.ndarray, scores: np.ndarray, ended: np.ndarray) -> None:
        """Keep the `beams` best of the finished hypotheses and those that just `ended`, scored with the length
        penalty; none is added to a sentence that has its `beams` under `early=True`, or that cannot improve. The
        finished ones stay sorted, best first."""
        minus, sentences = np.float32(-1e9), self.sentences
        ended_scores = scores / float(self.length**self.penalty)
        full = self.finished.all(-1, keepdims=True) & (self.early is True)
        ended_scores = ended_scores + full * minus + ~self.unsatisfied * minus + ~ended * minus
        merged = np.concatenate((self.scores, ended_scores), 1)
        best = np.argsort(-merged, axis=1, kind="stable")[:, : self.beams]
        self.sequences = np.concatenate((self.sequences, sequences), 1)[sentences, best]
        lengths = np.full(ended_scores.shape, self.length, dtype=np.int64)
        self.lengths = np.concatenate((self.lengths, lengths), 1)[sentences, best]
        self.finished = np.concatenate((self.finished, ended), 1)[sentences, best]
        self.scores = merged[sentences, best]

    def _update_unfinished(self, hits: np.ndarray) -> None:
        """`generate()`'s stopping rule: a sentence is done when its best running hypothesis, at the length the
        early-stopping rule supposes, cannot beat its worst finished one; the search when every sentence is done,
        when every sentence has its `beams` under `early=True`, or when every candidate just ended."""
        hypothetical = self.max_length - 1 if self.early == "never" and self.penalty > 0.0 else self.length - 1
        possible = self.running_scores[:, :1] / float(hypothetical**self.penalty)
        worst = np.where(self.finished, self.scores.min(1, keepdims=True), np.float32(-1.0e9))
        self.unsatisfied = self.unsatisfied & (possible > worst).any(-1, keepdims=True)
        done = (self.finished.all() & (self.early is True)) | hits.all()
        self.unfinished = bool(self.unsatisfied.any() & ~done)

    def best(self) -> np.ndarray:
        """The best finished hypothesis of each sentence without the start token, as wide as the longest."""
        return self.sequences[:, 0, 1 : 1 + int(self.lengths[:, 0].max())]


def _view(flat: np.ndarray, shape: tuple, dtype=None) -> np.ndarray:
    """The contiguous leading part of `flat` (as `dtype`, where given) as an array of `shape` (no copy)."""
    if dtype is None:
        return flat[: math.prod(shape)].reshape(shape)
    return flat[: math.prod(shape) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


class _Buffers:
    """The flat byte buffers of one decoder's batches (`_Batch`: cache slots, encoder states), handed from one batch
    to the next: a batch's buffers are allocated once and then reused, not mapped afresh and faulted in page by page
    for every batch (seconds of system time over a file). A buffer too small for a batch is replaced by one a quarter
    larger than asked, so that batches growing by little do not each allocate. Two batches alive at once (another
    thread's) get separate buffers: `take` hands a set to one batch only."""

    def __init__(self):
        self.sets: list[list[np.ndarray]] = []

    def take(self, sizes: list[int]) -> list[np.ndarray]:
        """Buffers of at least `sizes` bytes each (the first len(sizes) of the list returned)."""
        try:
            held = self.sets.pop()  # atomic: two batches never share one set
        except IndexError:
            held = []
        for index, size in enumerate(sizes):
            if index == len(held):
                held.append(np.empty(size, np.uint8))
            elif held[index].nbytes < size:
                held[index] = np.empty(max(size, held[index].nbytes * 5 // 4), np.uint8)
        return held

    def give(self, buffers: list[np.ndarray]) -> None:
        """`buffers` (of `take`) for the next batch; one set is kept, the largest."""
        if not self.sets or sum(b.nbytes for b in buffers) > sum(b.nbytes for b in self.sets[0]):
            self.sets[:] = [buffers]


def _repeated(flat: np.ndarray, tensor: np.ndarray, group: int) -> np.ndarray:
    """`tensor` with each row repeated `group` times in a row (the beams of a sentence), written into the front of the
    byte buffer `flat`."""
    out = _view(flat, (tensor.shape[0] * group, *tensor.shape[1:]), tensor.dtype)
    out.reshape(tensor.shape[0], group, *tensor.shape[1:])[...] = tensor[:, None]
    return out


def _compact(flat: np.ndarray, block: int, kept: np.ndarray) -> None:
    """Move the blocks `kept` (ascending indices, `block` bytes each) of the byte buffer `flat` to its front, in
    order, in place: each run of blocks that moves by the same distance is one memmove (which, unlike numpy's
    assignment between overlapping parts, copies once); a block only ever moves towards the front, after every block
    before it has moved, so none is overwritten before it is read."""
    shifts = kept - np.arange(len(kept))
    starts = np.flatnonzero(np.diff(shifts, prepend=-1)).tolist()
    base = flat.ctypes.data
    for start, end in zip(starts, [*starts[1:], len(kept)]):
        shift = int(shifts[start])
        if shift:
            ctypes.memmove(base + start * block, base + (start + shift) * block, (end - start) * block)


class _SelfCache:
    """The self-attention slots of one batch (keys and values gaining a position a step, MAtt/AAN's running sum of
    one size) in two flat buffers each, sized at the positions the caps allow (`capacity`): a step reads one and the
    graph writes its grown slots straight into the other (`outputs`); then the two swap, or the rows that go on are
    gathered back into the first (`keep`, before every step: beams reordered, finished sentences dropped; the start
    graph's slots, each row repeated `group` times, count as written). Nothing is allocated per step and no copy is
    made outside the graph but that gather; the buffers are `flats` (byte buffers of `_Buffers.take`, or new ones),
    whose untouched pages are never mapped. A step binds them by address (`inputs`, `outputs`: shape, type, address),
    without a numpy view."""

    def __init__(self, slots, grows: list[bool], capacity: int, flats: list[np.ndarray] = None, group: int = 1):
        self.grows, self.dtypes = grows, [slot.dtype.type for slot in slots]
        self.shapes = [(slot.shape[0] * group, *slot.shape[1:]) for slot in slots]
        flats = flats or [np.empty(size, np.uint8) for size in _SelfCache.sizes(slots, grows, capacity, group)]
        self.read, self.write = flats[: len(slots)], flats[len(slots) : 2 * len(slots)]
        self.address = {id(flat): flat.ctypes.data for flat in flats[: 2 * len(slots)]}
        for slot, second in zip(slots, self.write):
            _repeated(second, slot, group)  # as if a step had written them: `keep` comes first
        self.grown = self.shapes

    @staticmethod
    def sizes(slots, grows: list[bool], capacity: int, group: int = 1) -> list[int]:
        """The bytes of each buffer, read ones then written ones."""
        sizes = [
            slot.nbytes * group // slot.shape[2] * capacity if g else slot.nbytes * group
            for slot, g in zip(slots, grows)
        ]
        return sizes + sizes

    def inputs(self) -> list[tuple]:
        return [
            (dtype, shape, self.address[id(flat)]) for flat, shape, dtype in zip(self.read, self.shapes, self.dtypes)
        ]

    def outputs(self) -> list[tuple]:
        """Where the next step writes its slots, one position longer where a slot grows."""
        self.grown = [(*s[:2], s[2] + 1, *s[3:]) if g else s for s, g in zip(self.shapes, self.grows)]
        return [
            (dtype, shape, self.address[id(flat)]) for flat, shape, dtype in zip(self.write, self.grown, self.dtypes)
        ]

    def keep(self, rows: np.ndarray | None) -> None:
        """After a step: the written slots become the read ones, only `rows` of them (in that order) when given."""
        if rows is None:
            self.read, self.write, self.shapes = self.write, self.read, self.grown
            return
        self.shapes = [(len(rows), *shape[1:]) for shape in self.grown]
        for read, write, grown, shape, dtype in zip(self.read, self.write, self.grown, self.shapes, self.dtypes):
            np.take(_view(write, grown, dtype), rows, axis=0, out=_view(read, shape, dtype), mode="clip")


def _bind(binding, name: str, array: np.ndarray, output: bool = False) -> None:
    """Bind the memory of the C-contiguous `array` to the graph's input (or output) `name`, without wrapping it in an
    OrtValue: a decoding step binds about twenty tensors, and the wrapping cost more than a small batch's step."""
    bind = binding.bind_output if output else binding.bind_input
    bind(name, "cpu", 0, array.dtype.type, array.shape, array.ctypes.data)


class _Batch:
    """One batch's decoding state for the step graph, bound once (ONNX Runtime's I/O binding over numpy memory):
    the encoder states, cross-attention slots and mask (moved together in place and bound again only when sentences
    leave), the self-attention slots in a `_SelfCache`, the logits written into one buffer; `started`: the start
    graph's outputs (`OnnxDecoder._start`), one row per sentence, each repeated for `group` rows (the beams of a
    sentence), but for the states a grouped step graph reads once per sentence (`OnnxDecoder.grouped`: the encoder
    states, mask and cross-attention slots stay one row per sentence); `max_lengths`: each row's cap, as in `greedy`.
    The slots and the repeated states live in the decoder's `_Buffers` (`decoder.buffers`), given back when the batch
    is gone: the next batch finds them mapped."""

    def __init__(self, decoder: OnnxDecoder, started: tuple, capacity: int, max_lengths=None, group: int = 1):
        logits, encoder, slots, mask = started
        self.decoder, self.session, self.group = decoder, decoder.step, group
        self.each = 1 if decoder.grouped else group  # the rows of a sentence's encoder and cross-attention states
        rows = len(mask) * group
        own = set(decoder.self_index)
        cross = {name: slot for index, (name, slot) in enumerate(zip(decoder.names, slots)) if index not in own}
        # only the states the step graph reads are repeated for the beams (an export drops the inputs it never reads)
        fixed = {k: v for k, v in {**encoder, **cross}.items() if k in decoder.step_inputs}
        fixed = {"attention_mask": mask, **fixed}
        self.self_names = [decoder.names[index] for index in decoder.self_index]
        self.output_names = ["new." + name for name in self.self_names]
        grows = [decoder.layout[index][2] in ("keys", "values") for index in decoder.self_index]
        own_slots = [slots[index] for index in decoder.self_index]
        sizes = _SelfCache.sizes(own_slots, grows, capacity, group)
        self.pool = getattr(decoder, "buffers", None)
        fixed_sizes = [tensor.nbytes * self.each for tensor in fixed.values()]
        self.flats = self.pool.take(sizes + fixed_sizes) if self.pool is not None else None
        flats = self.flats or [np.empty(size, np.uint8) for size in sizes + fixed_sizes]
        self.cache = _SelfCache(own_slots, grows, capacity, flats[: len(sizes)], group)
        # the states every step reads, repeated into the buffers after the slots (moved to the front as sentences go)
        places = flats[len(sizes) : len(sizes) + len(fixed)]
        self.fixed = {name: _repeated(flat, tensor, self.each) for flat, (name, tensor) in zip(places, fixed.items())}
        self.places = dict(zip(self.fixed, places))
        self.max_lengths = None if max_lengths is None else np.asarray(max_lengths)
        self.steps = np.zeros(capacity, dtype=np.float32)  # only its length is read: the tokens decoded so far
        self.tokens = np.empty((rows, 1), dtype=np.int64)
        self.logits = np.empty((rows, logits.shape[-1]), dtype=np.float32)
        self.binding = self.session.io_binding()
        self._bind_fixed()

    def __del__(self):
        if getattr(self, "flats", None) is not None:
            self.pool.give(self.flats)

    def _bind_fixed(self) -> None:
        for name, tensor in self.fixed.items():
            _bind(self.binding, name, tensor)

    def keep(self, rows: np.ndarray | None, changed: bool = True) -> None:
        """Go on with `rows` of the last step's (None: all, in order); `changed`: some sentence left the batch (the
        rows of each sentence that stays are among its own, and the sentences keep their order)."""
        self.cache.keep(rows)
        if rows is not None and changed:
            kept = rows[:: self.group] // self.group  # the sentences that stay, by their place before
            for name, tensor in self.fixed.items():
                _compact(self.places[name], tensor[: self.each].nbytes, kept)
                self.fixed[name] = _view(self.places[name], (len(kept) * self.each, *tensor.shape[1:]), tensor.dtype)
            self._bind_fixed()
            if self.max_lengths is not None:
                self.max_lengths = self.max_lengths[rows]

    def step(self, tokens: np.ndarray, done: int, new_logits: bool = False) -> np.ndarray:
        """The next logits after `done` tokens for the rows kept; rows whose `max_lengths` are reached get `</s>`
        only (log-probability 0, every other token -inf). The logits are this batch's one buffer, which the next step
        overwrites, or a new array where `new_logits`."""
        binding, rows = self.binding, len(tokens)
        self.tokens[:rows, 0] = tokens
        _bind(binding, "tokens", self.tokens[:rows])
        _bind(binding, "steps", self.steps[:done])
        for name, (dtype, shape, address) in zip(self.self_names, self.cache.inputs()):
            binding.bind_input(name, "cpu", 0, dtype, shape, address)
        logits = np.empty_like(self.logits[:rows]) if new_logits else self.logits[:rows]
        _bind(binding, "logits", logits, output=True)
        for name, (dtype, shape, address) in zip(self.output_names, self.cache.outputs()):
            binding.bind_output(name, "cpu", 0, dtype, shape, address)
        self.session.run_with_iobinding(binding)
        if self.max_lengths is not None:
            capped = self.max_lengths <= done
            if capped.any():
                logits[capped] = -np.inf
                logits[capped, self.decoder.eos] = 0.0
        return logits


class OnnxDecoder(Decoder):
    """Greedy and beam search over an `export_onnx` folder with ONNX Runtime (`int8=True`: the quantized graphs), on
    `threads` threads (intra- and inter-op)."""

    def __init__(self, folder: str | Path, int8: bool = False, threads: int = 1):
        import onnxruntime

        threads = check_threads(threads)
        folder = Path(folder)
        info = onnx_checks.read_layout(folder)  # a missing or damaged layout named, with the way to write it again
        start, step = onnx_checks.checked_graphs(folder, info, int8)
        onnx_checks.check_source(folder, info)  # the graphs belong to the tokenizer and model folder around them
        self.config = onnx_checks.decoding_config(folder, info)
        self.layout = [tuple(entry) for entry in info["layout"]]
        self.fields = info["encoder_fields"]
        self.eos, self.pad = info["eos_token_id"], info["pad_token_id"]
        self.start_token = info["decoder_start_token_id"]
        # unset in the generation config: generate()'s defaults
        self.length_penalty = 1.0 if info.get("length_penalty") is None else info["length_penalty"]
        self.early_stopping = False if info.get("early_stopping") is None else info["early_stopping"]

        def options():
            return _session_options(onnxruntime, threads)

        # one copy of the weights for both graphs (`weights`: the arrays the sessions use in place); the step graph's
        # fp32 products on pre-packed weights (int8 decoding measured the same without them)
        packed = [] if int8 else [step]
        (self.start, self.step), self.weights = onnx_checks.open_sessions([start, step], options, folder, int8, packed)
        self.folder, self.names = folder, [_slot_name(entry) for entry in self.layout]
        self.buffers = _Buffers()  # the batches' buffers, reused from one batch to the next
        self.self_index = [i for i, entry in enumerate(self.layout) if entry[0] == "self"]
        self.step_inputs = {value.name for value in self.step.get_inputs()}
        # the step graph reads the encoder states, mask and cross-attention slots once per sentence, not per beam
        self.grouped = info.get("cross_rows") == "sentence"

    def _start(self, input_ids, attention_mask):
        """The start graph on a batch: (logits, encoder states by name, cache slots, mask), a row per sentence."""
        mask = np.asarray(attention_mask, dtype=np.int64)
        logits, *rest = self.start.run(
            None, {"input_ids": np.asarray(input_ids, dtype=np.int64), "attention_mask": mask}
        )
        return logits, dict(zip(self.fields, rest)), rest[len(self.fields) :], mask

    def greedy(
        self, input_ids, attention_mask, max_new_tokens: int, min_new_tokens: int = 0, forced=None, max_lengths=None
    ):
        """Tokens as `generate()` gives them for greedy search (without the decoder start token; finished rows
        padded), and the logits of each step (batch, steps, vocab). `forced` (batch, steps): feed these tokens
        instead of the chosen ones (to compare the logits along a given path). `max_lengths` (batch,): each row's own
        cap on its tokens, `</s>` forced once it has that many (`translate`'s source-relative cap). Without `forced`,
        a finished row leaves the batch: its later logits say only that padding follows (0 for the pad id)."""
        started = self._start(input_ids, attention_mask)
        logits, rows = started[0], started[0].shape[0]
        batch = _Batch(self, started, max_new_tokens + 1, max_lengths)
        out, scores = [], []
        finished, active = np.zeros(rows, dtype=bool), np.arange(rows)
        for step in range(max_new_tokens):
            if len(active) < rows:
                logits, padding = np.full((rows, logits.shape[-1]), -np.inf, np.float32), logits
                logits[:, self.pad], logits[active] = 0.0, padding
            if step < min_new_tokens:
                logits[:, self.eos] = -np.inf
            scores.append(logits)
            token = logits.argmax(-1) if forced is None else np.asarray(forced)[:, step]
            token = np.where(finished, self.pad, token)
            out.append(token)
            finished |= token == self.eos
            if (forced is None and finished.all()) or step + 1 == max_new_tokens:
                break
            going = active[~finished[active]] if forced is None else active
            changed = len(going) < len(active)
            batch.keep(np.searchsorted(active, going) if changed else None, changed)
            active = going
            logits = batch.step(token[active], step + 1, new_logits=True)  # each step's logits are kept
        return np.stack(out, axis=1), np.stack(scores, axis=1)

    def beam(
        self,
        input_ids,
        attention_mask,
        num_beams: int,
        max_new_tokens: int,
        min_new_tokens: int = 0,
        max_lengths=None,
        length_penalty: float | None = None,
    ):
        """The best hypothesis of beam search, with the rules of `generate()`'s beam search (`_BeamSearch`), so that
        the tokens are `generate()`'s; decoder start token excluded. `max_lengths` (batch,): each sentence's own cap,
        as in `greedy`; `length_penalty`: instead of the export's. A sentence whose best running hypothesis can no
        longer beat its finished ones leaves the batch (its result is settled)."""
        started = self._start(input_ids, attention_mask)
        logits = np.repeat(started[0], num_beams, axis=0)  # the beams of a sentence: rows grouped by sentence
        rows = logits.shape[0]
        penalty = self.length_penalty if length_penalty is None else length_penalty
        search = _BeamSearch(
            rows // num_beams, num_beams, 1 + max_new_tokens, self.start_token, self.pad, self.eos, penalty,
            self.early_stopping,
        )  # fmt: skip
        if max_lengths is not None:
            max_lengths = np.repeat(np.asarray(max_lengths), num_beams)  # rows grouped by sentence
        batch = _Batch(self, started, max_new_tokens + 2, max_lengths, num_beams)
        active, gone, width = np.arange(rows), None, min(2 * num_beams, logits.shape[-1])
        threads = self.step.get_session_options().intra_op_num_threads
        while True:
            barred = self.eos if search.length - 1 < min_new_tokens else None
            best, best_ids = _top_log_probs(logits, width, threads, barred)
            if len(active) < rows:  # stand-ins for the sentences that left: nothing reads them
                best, best_ids = _spread(best, active, rows), _spread(best_ids, active, rows)
            sources = search.advance(best, best_ids, gone)
            if not search.unfinished:
                return search.best()
            gone = ~search.unsatisfied
            going = np.flatnonzero(np.repeat(search.unsatisfied[:, 0], num_beams))
            position = np.empty(rows, dtype=np.int64)
            position[active] = np.arange(len(active))
            batch.keep(position[sources[going]], len(going) < len(active))
            active = going
            tokens = search.running[:, :, search.length - 1].reshape(-1)[active]
            logits = batch.step(tokens, search.length - 1)

    # ---- the serving seam (`Decoder`) ----------------------------------------------------------------------------

    @classmethod
    def check_settings(cls, *, device: str | None = None, compile: bool = False, int8: bool = False) -> None:
        super().check_settings(device=device, compile=compile, int8=int8)
        if compile:
            raise ValueError(
                "`compile=True` (`--compile`) compiles the torch model; the ONNX Runtime backend runs its exported "
                "graphs: drop it."
            )
        if device not in (None, "cpu"):
            raise ValueError(
                f"--device {device} is for --backend torch; --backend onnxruntime runs the exported graphs on the "
                "CPU: drop it."
            )

    @classmethod
    def unavailable_reason(cls, model: str, *, int8: bool = False) -> str | None:
        """No onnxruntime to import, no graphs in `model` (or its `onnx/` folder; `onnx_folder`), no int8 graphs
        where `int8`: the reason, in the words of the check that finds it."""
        try:
            require_onnxruntime()
            onnx_folder(model, int8)
        except MissingOnnxRuntimeError:
            return "onnxruntime is not installed (`pip install 'hf-deep-nmt[onnx]'`)"
        except Exception as error:  # a Hub id that cannot be reached has no graphs here either
            return " ".join(str(error).split()) or type(error).__name__
        return None

    @classmethod
    def load(cls, model: str, *, int8: bool = False, threads: int | None = None, device: str | None = None):
        """`load_onnx_model`: the graphs of `onnx_folder(model, int8)`, on the CPU."""
        cls.check_settings(device=device, int8=int8)
        return load_onnx_model(model, int8, threads)

    @property
    def generation_config(self):
        """The generation config saved beside the graphs (`export_for_serving`), else transformers' defaults; read as
        `SavedGenerationConfig` (what the decoding options read of it) where it is a JSON object, so that decoding
        imports no transformers; transformers reads (and names the fault of) any other file."""
        path = self.folder / "generation_config.json"
        if not path.is_file():
            return SavedGenerationConfig({})
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            values = None
        if isinstance(values, dict):
            return SavedGenerationConfig(values)
        from transformers import GenerationConfig

        return GenerationConfig.from_pretrained(self.folder)

    def check(self, tokenizer, options: DecodingOptions) -> None:
        """Refuse the GNMT penalty (it rescores every final beam; `beam` returns the best one only), and a
        tokenizer whose padding or end id is not the graphs'."""
        if options.gnmt:
            raise ValueError(
                '`length_penalty_form="gnmt"` (`--length-penalty-form gnmt`) rescores every final beam, and the ONNX '
                "Runtime backend's beam search returns the best one only: use the fairseq form, or the torch backend."
            )
        for name, tokenizer_id, graph_id in (
            ("pad", tokenizer.pad_token_id, self.pad),
            ("end", tokenizer.eos_token_id, self.eos),
        ):
            if tokenizer_id != graph_id:
                raise ValueError(
                    f"The tokenizer's {name} id is {tokenizer_id}, the ONNX graphs' is {graph_id}: use the tokenizer "
                    "saved with the graphs."
                )

    def check_fits(self, batches: Sequence[tuple[int, int]], options: DecodingOptions) -> None:
        """The largest batch by the torch backend's estimate (the model code's `decoding_memory`: the graphs hold the
        same encoder states, cache slots and scores, in float32), against the CPU's memory; nothing is refused
        where the graphs carry no config to estimate with."""
        if self.config is None or not batches:
            return
        estimate = onnx_checks.memory_estimate(self.config)
        if estimate is None:  # no config the estimate can read
            return

        def needed(batch):
            sentences, source = batch
            return estimate(sentences * options.num_beams, source, options.output_cap(source) + 2)

        sentences, source = max(batches, key=needed)
        if "hf_deep_nmt.memory" not in sys.modules and onnx_checks.clearly_available(needed((sentences, source))):
            return  # without importing the memory checks (torch and the model code) where nothing imported them yet
        from hf_deep_nmt.memory import check_memory

        check_memory(
            needed((sentences, source)),
            f"Beam search over a batch of {sentences} sentence(s) x {options.num_beams} beam(s) = "
            f"{sentences * options.num_beams} hypotheses, up to {source} source and {options.output_cap(source) + 2} "
            "output tokens (ONNX Runtime)",
            "lower --num-beams (`num_beams`), --batch-size or --max-tokens",
            "cpu",
        )

    def translate_batch(self, tokenizer, sources: list[list[int]], options: DecodingOptions) -> list[str]:
        """Decoded as `TorchDecoder` decodes it with `generate()`: greedy or beam search, each sentence capped at
        `options.output_limits` of its length, the fairseq length penalty `options.length_penalty`."""
        batch = tokenizer.pad({"input_ids": sources}, return_tensors="np")
        limits = options.output_limits(np.asarray(batch["attention_mask"]).sum(axis=1))
        longest, ids, mask = int(limits.max()), batch["input_ids"], batch["attention_mask"]
        if options.num_beams == 1:
            tokens, _ = self.greedy(ids, mask, longest + 1, max_lengths=limits)
        else:
            tokens = self.beam(
                ids, mask, options.num_beams, longest + 1, max_lengths=limits, length_penalty=options.length_penalty
            )
        return [text.strip() for text in tokenizer.batch_decode(tokens, skip_special_tokens=True)]


def translate_lines(
    folder: str | Path, lines: list[str], int8: bool = False, batch_size: int = 32, max_new_tokens: int = 256
) -> list[str]:
    """Greedy translations of `lines` with an `export_onnx` folder written with its tokenizer."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an integer >= 1, got {batch_size!r}.")
    decoder = OnnxDecoder(folder, int8=int8)  # first: its checks name a damaged file, transformers' error does not
    tokenizer = load_tokenizer(folder)
    out = []
    for begin in range(0, len(lines), batch_size):
        encoded = tokenizer(lines[begin : begin + batch_size], padding=True, return_tensors="np")
        tokens, _ = decoder.greedy(encoded["input_ids"], encoded["attention_mask"], max_new_tokens)
        out.extend(tokenizer.batch_decode(tokens, skip_special_tokens=True))
    return out


def onnx_folder(model: str | Path, int8: bool = False) -> Path:
    """The folder of graphs that `model` names: an `export-onnx` folder itself, or a model folder's `onnx/`
    subfolder; a name that is no local path is taken as a Hub repository id, and its `onnx/` folder downloaded (with
    the config and tokenizer the graphs are checked against). `FileNotFoundError` naming the model when it is written
    as a path that does not exist or is no Hub id either (before any Hub lookup), and naming the folder and the
    command that writes the graphs when there are none (or no int8 graphs where `int8`)."""
    from hf_deep_nmt.model_folders import check_model_name

    # a path that does not exist is named before any Hub lookup (a cached repository may hold the graphs alone)
    path = check_model_name(model, "Model", check_hub_id=False)
    local = path is not None
    if not local:
        from huggingface_hub import snapshot_download

        # the config and tokenizer beside the graphs too (small), for the check that the graphs are theirs
        patterns = [f"{ONNX_SUBFOLDER}/*", "config.json", "tokenizer.json"]
        path = Path(snapshot_download(str(model), allow_patterns=patterns))
    found = next((folder for folder in (path, path / ONNX_SUBFOLDER) if (folder / LAYOUT_FILE).is_file()), None)
    flags = " --int8" if int8 else ""
    if local and found != path:  # a model folder: its onnx/ subfolder
        make = f"`hf-deep-nmt export-onnx --model {model} --into-model{flags}`"
    else:  # a repo id or a folder of graphs is no model folder to export into: the graphs go to a new local folder
        name = model if not local else "MODEL"
        make = f"`hf-deep-nmt export-onnx --model {name} --output NEW{flags}`, then translate with --model NEW"
    if found is None:
        raise FileNotFoundError(
            f"{model} holds no ONNX graphs (no {LAYOUT_FILE} in it or in its {ONNX_SUBFOLDER}/ folder); write them "
            f"with {make}."
        )
    if int8 and not (found / "start.int8.onnx").is_file():
        again = f"remove {found} first, then {make}" if local and found != path else make
        raise FileNotFoundError(
            f"{found} has no int8 graphs (start.int8.onnx); export again with --int8 ({again}), or translate without "
            "--int8."
        )
    return found


def load_onnx_model(model: str | Path, int8: bool = False, threads: int | None = None):
    """(`OnnxDecoder`, tokenizer) of `onnx_folder(model, int8)`, on `threads` ONNX Runtime threads (intra- and
    inter-op; None: `threads.default_threads()`). The decoder takes the place of the model in
    `hf_deep_nmt.serving.translate`'s `translate`, `write_translations` and `translate_file`. The tokenizer is
    `plain_tokenizer.load_tokenizer`'s: without transformers where the folder's tokenizer allows."""
    require_onnxruntime()
    threads = check_threads(threads)
    folder = onnx_folder(model, int8)
    decoder = OnnxDecoder(folder, int8=int8, threads=threads)
    return decoder, load_tokenizer(folder)
