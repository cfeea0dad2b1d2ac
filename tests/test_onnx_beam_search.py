"""The ONNX Runtime backend's beam search bookkeeping (`hf_deep_nmt.serving.onnx._BeamSearch`, numpy) keeps the rules
and the arithmetic of the torch implementation it replaced (`TorchBeamSearch` below, kept verbatim as the reference):
fed the same log-probabilities step after step, with sentences leaving the batch as `OnnxDecoder.beam` makes them
leave, both hold the same running and finished scores, hypotheses and stopping decisions. Among equal scores the numpy
search takes the lower index first (ONNX TopK's rule); torch.topk leaves that order unspecified, so where scores tie
the tests compare what no tie-break can change. No graph is run: each test is a few milliseconds."""

import math

import numpy as np
import pytest
import torch

from hf_deep_nmt.serving.onnx import _TOP_GRAPH, _BeamSearch, _part_size, _top, _top_log_probs

PAD, START, EOS = 1, 2, 3
REAL = -1e6  # scores below this belong to rows that only fill the batch (hypotheses ended or started as copies)


def _take(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.gather(tensor, 1, index[:, :, None].expand(-1, -1, tensor.shape[-1]))


class TorchBeamSearch:
    """The torch implementation the numpy one replaced, as it was."""

    def __init__(self, batch: int, beams: int, max_length: int, start: int, pad: int, eos: int, penalty, early):
        self.beams, self.max_length, self.eos, self.penalty, self.early = beams, max_length, eos, penalty, early
        self.length = 1
        self.running = torch.full((batch, beams, max_length), pad, dtype=torch.long)
        self.running[:, :, 0] = start
        self.running_scores = torch.zeros(batch, beams)
        self.running_scores[:, 1:] = -1e9
        self.sequences, self.scores = self.running.clone(), torch.full((batch, beams), -1e9)
        self.lengths = torch.zeros(batch, beams, dtype=torch.long)
        self.finished = torch.zeros(batch, beams, dtype=torch.bool)
        self.unsatisfied = torch.ones(batch, 1, dtype=torch.bool)
        self.unfinished = True

    def advance(self, log_probs: torch.Tensor, gone: torch.Tensor | None = None) -> np.ndarray:
        batch, beams, keep = self.running.shape[0], self.beams, 2 * self.beams
        best, best_ids = torch.topk(log_probs, k=min(keep, log_probs.shape[-1]), dim=-1)
        candidates = (best.view(batch, beams, -1) + self.running_scores[:, :, None]).view(batch, -1)
        top_scores, top_index = torch.topk(candidates, k=keep)
        source_beam, ids = top_index // best.shape[-1], torch.gather(best_ids.view(batch, -1), 1, top_index)
        top_sequences = _take(self.running, source_beam).clone()
        top_sequences[:, :, self.length] = ids
        hits = (ids == self.eos) | (self.length + 1 >= self.max_length)
        still = top_scores + hits.float() * -1e9
        chosen = torch.topk(still, k=beams)[1]
        self.running, self.running_scores = _take(top_sequences, chosen), torch.gather(still, 1, chosen)
        self._finish(top_sequences, top_scores, hits & (torch.arange(keep) < beams)[None, :])
        self.length += 1
        self._update_unfinished(hits if gone is None else hits | gone)
        return (torch.gather(source_beam, 1, chosen) + torch.arange(batch)[:, None] * beams).view(-1).numpy()

    def _finish(self, sequences: torch.Tensor, scores: torch.Tensor, ended: torch.Tensor) -> None:
        ended_scores = scores / (self.length**self.penalty)
        full = self.finished.all(-1, keepdim=True) & (self.early is True)
        ended_scores = ended_scores + full.float() * -1e9 + (~self.unsatisfied).float() * -1e9 + (~ended) * -1e9
        merged = torch.cat((self.scores, ended_scores), 1)
        best = torch.topk(merged, k=self.beams)[1]
        self.sequences = _take(torch.cat((self.sequences, sequences), 1), best)
        lengths = torch.full_like(ended_scores, self.length).long()
        self.lengths = torch.gather(torch.cat((self.lengths, lengths), 1), 1, best)
        self.finished = torch.gather(torch.cat((self.finished, ended), 1), 1, best)
        self.scores = torch.gather(merged, 1, best)

    def _update_unfinished(self, hits: torch.Tensor) -> None:
        hypothetical = self.max_length - 1 if self.early == "never" and self.penalty > 0.0 else self.length - 1
        possible = self.running_scores[:, :1] / (hypothetical**self.penalty)
        worst = torch.where(self.finished, self.scores.min(dim=1, keepdim=True)[0], -1.0e9)
        self.unsatisfied = self.unsatisfied & (possible > worst).any(-1, keepdim=True)
        done = (self.finished.all() & (self.early is True)) | hits.all()
        self.unfinished = bool(self.unsatisfied.any() & ~done)

    def best(self) -> np.ndarray:
        return self.sequences[:, 0, 1 : 1 + int(self.lengths[:, 0].max())].numpy()


def continuous(rng, rows, vocab, step):
    """Log-probabilities with no two equal; the end token likelier than the rest, more so as the steps go."""
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    logits[:, EOS] += step * 0.3 - 1.0
    return torch.log_softmax(torch.from_numpy(logits), -1).numpy()


def tied(rng, rows, vocab, step):
    """Scores on a grid of halves, so that many tie, but for the end token, which ties with none (it decides which
    hypotheses end, and so what each search holds)."""
    scores = -0.5 * rng.integers(0, 6, (rows, vocab)).astype(np.float32)
    scores[:, EOS] = -rng.uniform(0.0, 3.0 - min(step, 12) * 0.2, rows).astype(np.float32)
    return scores


def run_both(settings, make_scores, seed):
    """Both searches over the same scores, as `OnnxDecoder.beam` drives its search: min_new_tokens bars the end token,
    a sentence past its own cap may only end, and the rows of a sentence that left get stand-ins (torch: the
    log-softmax of zeros; numpy: zeros). Yields both after each step, and the rows each returned."""
    batch, beams, vocab, max_length, penalty, early, min_new, caps = settings
    rng = np.random.default_rng(seed)
    reference = TorchBeamSearch(batch, beams, max_length, START, PAD, EOS, penalty, early)
    search = _BeamSearch(batch, beams, max_length, START, PAD, EOS, penalty, early)
    gone = None
    caps = np.repeat(np.asarray(caps), beams)
    while True:
        scores = make_scores(rng, batch * beams, vocab, search.length)
        if search.length - 1 < min_new:
            scores[:, EOS] = -np.inf
        capped = caps <= search.length - 1
        scores[capped], scores[capped, EOS] = -np.inf, 0.0
        stand_ins = np.zeros_like(scores), np.full_like(scores, -math.log(vocab))
        if gone is not None:
            rows = np.repeat(gone[:, 0], beams)
            scores_np, scores_torch = np.where(rows[:, None], stand_ins[0], scores), scores.copy()
            scores_torch[rows] = stand_ins[1][rows]
        else:
            scores_np = scores_torch = scores
        sources = search.advance(*_top(scores_np, min(2 * beams, vocab)), gone)
        reference_sources = reference.advance(
            torch.from_numpy(scores_torch), None if gone is None else torch.from_numpy(gone)
        )
        yield search, reference, sources, reference_sources, gone
        if not search.unfinished:
            return
        gone = ~search.unsatisfied


def check_same_state(search, reference, left):
    """What no tie-break changes: every score, the finished slots, the stopping rule; `left`: the sentences that had
    left the batch before this step, whose running rows are stand-ins."""
    staying = ~left[:, 0] if left is not None else np.ones(len(search.scores), bool)
    np.testing.assert_array_equal(search.running_scores[staying], reference.running_scores.numpy()[staying])
    np.testing.assert_array_equal(search.scores, reference.scores.numpy())
    np.testing.assert_array_equal(search.finished, reference.finished.numpy())
    np.testing.assert_array_equal(search.unsatisfied, reference.unsatisfied.numpy())
    assert search.unfinished == reference.unfinished and search.length == reference.length


SETTINGS = [  # batch, beams, vocab, max_length, penalty, early, min_new_tokens, each sentence's cap
    (3, 4, 40, 12, 1.0, False, 0, [11, 11, 11]),
    (3, 4, 40, 12, 1.0, True, 2, [11, 4, 11]),
    (4, 2, 30, 10, 0.6, "never", 0, [9, 9, 3, 9]),
    (3, 3, 25, 9, 2.0, "never", 1, [8, 8, 8]),
    (2, 5, 60, 14, -0.5, False, 3, [13, 6]),
    (5, 1, 20, 8, 1.0, False, 0, [7] * 5),
    (1, 4, 16, 7, 1.0, True, 0, [6]),
    (2, 3, 30, 10, -1.0, "never", 0, [9, 5]),
    (2, 4, 5, 8, 1.0, False, 0, [7, 3]),  # fewer tokens than 2 x beams: stand-in beams' hypotheses finish too
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_numpy_search_keeps_the_torch_searchs_hypotheses(settings):
    """Scores with no ties: the same hypotheses, rows and results step by step, for the rows that carry a real
    hypothesis (the others only fill the batch: an ended copy, a start copy, a sentence that left)."""
    for seed in range(3):
        for search, reference, sources, reference_sources, left in run_both(settings, continuous, seed):
            check_same_state(search, reference, left)
            real = search.running_scores.reshape(-1) > REAL
            if left is not None:
                real &= ~np.repeat(left[:, 0], search.beams)
            np.testing.assert_array_equal(sources[real], reference_sources[real])
            running = search.running.reshape(len(real), -1)
            np.testing.assert_array_equal(running[real], reference.running.numpy().reshape(len(real), -1)[real])
            settled = search.finished & (search.scores > REAL)
            np.testing.assert_array_equal(search.sequences[settled], reference.sequences.numpy()[settled])
            np.testing.assert_array_equal(search.lengths[settled], reference.lengths.numpy()[settled])
        np.testing.assert_array_equal(search.best(), reference.best())


@pytest.mark.parametrize("settings", SETTINGS)
def test_tied_scores_leave_the_numpy_search_where_torch_leaves_its_own(settings):
    """Deliberately tied scores: torch.topk may keep either of two equal candidates, numpy keeps the lower index;
    the scores, finished slots and the steps each search takes stay the same."""
    for seed in range(3):
        for search, reference, *_, left in run_both(settings, tied, seed):
            check_same_state(search, reference, left)


def _top_graph(parts: bool = True) -> bytes:
    """`_TOP_GRAPH` as onnx.helper builds it (`parts=False`: one TopK over the whole row instead, to compare with)."""
    helper = pytest.importorskip("onnx.helper")
    from onnx import TensorProto

    nodes = [helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1)]
    if not parts:
        nodes.append(helper.make_node("TopK", ["log_probs", "k"], ["values", "ids"], axis=-1))
    else:
        nodes += [
            helper.make_node("Concat", ["rows_parts", "part"], ["parts_shape"], axis=0),
            helper.make_node("Reshape", ["log_probs", "parts_shape"], ["parts"]),
            helper.make_node("ReduceMax", ["parts"], ["maxima"], axes=[2], keepdims=0),
            helper.make_node("TopK", ["maxima", "k"], ["best_maxima", "best_parts"], axis=-1),
            helper.make_node("TopK", ["best_parts", "k"], ["chosen", "order"], axis=-1, largest=0),
            helper.make_node("Unsqueeze", ["chosen", "last"], ["chosen_index"]),
            helper.make_node("GatherND", ["parts", "chosen_index"], ["gathered"], batch_dims=1),
            helper.make_node("Reshape", ["gathered", "rows_flat"], ["candidates"]),
            helper.make_node("TopK", ["candidates", "k"], ["values", "positions"], axis=-1),
            helper.make_node("Div", ["positions", "part"], ["slot"]),
            helper.make_node("Mod", ["positions", "part"], ["offset"]),
            helper.make_node("GatherElements", ["chosen", "slot"], ["part_id"], axis=1),
            helper.make_node("Mul", ["part_id", "part"], ["first"]),
            helper.make_node("Add", ["first", "offset"], ["ids"]),
        ]
    constants = [
        helper.make_tensor("rows_parts", TensorProto.INT64, [2], [0, -1]),
        helper.make_tensor("last", TensorProto.INT64, [1], [-1]),
        helper.make_tensor("rows_flat", TensorProto.INT64, [2], [0, -1]),
    ]
    inputs = [
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", "vocab"]),
        helper.make_tensor_value_info("k", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("part", TensorProto.INT64, [1]),
    ]
    outputs = [
        helper.make_tensor_value_info("values", TensorProto.FLOAT, ["rows", "k"]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows", "k"]),
    ]
    graph = helper.make_graph(nodes, "top", inputs[: 3 if parts else 2], outputs, constants if parts else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7, producer_name="")
    return model.SerializeToString()


def test_the_top_graph_is_log_softmax_then_top_k_by_parts():
    """The serialized graph is the one onnx.helper builds (written out so that decoding imports no onnx)."""
    assert _top_graph() == _TOP_GRAPH


def test_the_top_k_by_parts_is_one_top_k_over_the_row():
    """Cut into parts, the top k of a row are those of one TopK over the whole row, values, tokens and their order,
    -inf included: heavy ties within and across parts (equal maxima in several parts), a row of -inf but one token,
    a row all equal, every part size that divides the vocabulary, k up to the number of parts."""
    onnxruntime = pytest.importorskip("onnxruntime")
    whole = onnxruntime.InferenceSession(_top_graph(parts=False), providers=["CPUExecutionProvider"])
    by_parts = onnxruntime.InferenceSession(_TOP_GRAPH, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for vocab in (24, 60, 120):
        logits = 0.5 * rng.integers(0, 6, (6, vocab)).astype(np.float32)
        logits[1], logits[1, EOS] = -np.inf, 0.0
        logits[2] = 1.0
        logits[3, -1] = 9.0  # the best score in the last part
        for part in (size for size in range(1, vocab + 1) if vocab % size == 0):
            for k in range(1, vocab // part + 1, 3):
                sizes = np.array([k, part], dtype=np.int64)
                expected = whole.run(None, {"logits": logits, "k": sizes[:1]})
                found = by_parts.run(None, {"logits": logits, "k": sizes[:1], "part": sizes[1:]})
                for one, other in zip(found, expected):
                    np.testing.assert_array_equal(one, other)


def test_the_part_size_divides_the_vocabulary_into_at_least_k_parts():
    """A divisor near sqrt(vocabulary / k) leaving k parts or more; 1 (a plain TopK) where no other does."""
    expected = {(8000, 8): 32, (8000, 9): 32, (4000, 8): 20, (40, 4): 4, (8, 8): 1, (9, 8): 1, (7, 3): 1}
    for (vocab, k), size in expected.items():
        assert _part_size(vocab, k) == size
    for vocab in range(1, 300, 7):
        for k in range(1, vocab + 1, 5):
            size = _part_size(vocab, k)
            assert vocab % size == 0 and vocab // size >= k


def test_the_top_log_probs_are_torchs_the_lower_token_first_among_equal_ones():
    """ONNX Runtime's log-softmax and top k: torch's values up to float32 rounding, in the order of a stable sort
    (heavy ties, a row of -inf but the end token as past a sentence's cap, rows as narrow as k), and a barred token
    scores -inf after the softmax, so that the others keep their probabilities."""
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(0)
    for rows, vocab, k in ((7, 3000, 8), (5, 40, 4), (3, 8, 8), (4, 9, 8)):
        logits = 0.25 * rng.integers(0, 40, (rows, vocab)).astype(np.float32)
        logits[1], logits[1, EOS] = -np.inf, 0.0
        log_probs = torch.log_softmax(torch.from_numpy(logits), -1)
        for barred in (None, EOS):
            expected = log_probs.clone()
            if barred is not None:
                expected[:, barred] = -math.inf
            expected = expected.numpy()
            values, ids = _top_log_probs(logits.copy(), k, 1, barred)
            order = np.argsort(-expected, axis=1, kind="stable")[:, :k]
            finite = np.isfinite(np.take_along_axis(expected, order, 1))  # among -inf, any order is torch's
            np.testing.assert_array_equal(ids[finite], order[finite])
            np.testing.assert_allclose(values, np.take_along_axis(expected, order, 1), rtol=0, atol=2e-6)


def test_sessions_on_several_threads_let_their_workers_sleep_between_runs():
    """At 2 threads, spinning ONNX Runtime workers (three sessions, a pool each) took the cores the numpy loop between
    the graphs needed: a whole translate cost twice its 1-thread CPU time. One thread has no workers to spin."""
    import onnxruntime

    from hf_deep_nmt.serving.onnx import _session_options

    entry = "session.intra_op.allow_spinning"
    several, one = _session_options(onnxruntime, 2), _session_options(onnxruntime, 1)
    assert (several.intra_op_num_threads, one.intra_op_num_threads) == (2, 1)
    assert several.get_session_config_entry(entry) == "0"
    with pytest.raises(RuntimeError, match=entry):  # not set: ONNX Runtime's default
        one.get_session_config_entry(entry)
