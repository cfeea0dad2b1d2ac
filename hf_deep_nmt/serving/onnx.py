"""Decoding through ONNX Runtime with the decoder's state as explicit tensors, for every family.

`export_onnx(model, folder)` writes two graphs: `start.onnx` (the encoder and the first decoder step: logits, the
encoder states and every filled cache slot) and `step.onnx` (one decoder step: the previous token, the encoder
states and mask, every cache slot in; logits and the self-attention half's slots out). The cross-attention half
(encoder memory keys/values, MSC context keys/values) is projected once by `start.onnx` and fed back unchanged. The
slots are whatever the family's cache layers fill (`keys`/`values`, MAtt/AAN `running_sum`, MSC `context_*`), read
from an eager run, so every family exports through the same code. `OnnxDecoder` loads such a folder and runs greedy
search (`greedy`), optionally on the int8 graphs `quantize_dynamic` writes (`quantize=True` at export).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

LAYOUT_FILE = "onnx_layout.json"
ENCODER_FIELDS = ("last_hidden_state", "block_outputs", "context_states")  # the tensors of a DeepNMTEncoderOutput
SLOTS = ("keys", "values", "running_sum", "context_keys", "context_values")


def _empty_cache(config) -> EncoderDecoderCache:
    return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))


def _layers(cache: EncoderDecoderCache, half: str, count: int):
    layers = getattr(cache, f"{half}_attention_cache").layers
    return layers[:count]


def _filled(cache: EncoderDecoderCache, count: int) -> list[tuple[str, int, str]]:
    """(half, layer, slot) of every tensor the cache holds, in a fixed order."""
    names = []
    for half in ("self", "cross"):
        for index, layer in enumerate(_layers(cache, half, count)):
            for slot in SLOTS:
                if getattr(layer, slot, None) is not None:
                    names.append((half, index, slot))
    return names


def _slot_name(entry) -> str:
    half, index, slot = entry
    return f"{half}.{index}.{slot}"


class _Start(torch.nn.Module):
    """Encoder and first decoder step: logits, encoder states, every cache slot."""

    def __init__(self, model, layout):
        super().__init__()
        self.model, self.layout = model, layout

    def forward(self, input_ids, attention_mask):
        encoder = self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        start = self.model.config.decoder_start_token_id
        tokens = torch.full((input_ids.shape[0], 1), start, dtype=torch.long, device=input_ids.device)
        cache = _empty_cache(self.model.config)
        out = self.model(
            encoder_outputs=encoder,
            attention_mask=attention_mask,
            decoder_input_ids=tokens,
            past_key_values=cache,
            use_cache=True,
        )
        count = self.model.config.decoder_layers
        slots = [getattr(_layers(cache, h, count)[i], s) for h, i, s in self.layout]
        fields = [getattr(encoder, name) for name in ENCODER_FIELDS if getattr(encoder, name, None) is not None]
        return (out.logits[:, -1].float(), *fields, *slots)


class _Step(torch.nn.Module):
    """One decoder step from explicit state; `steps` is a tensor whose length is the number of tokens decoded."""

    def __init__(self, model, layout, encoder_fields, encoder_output):
        super().__init__()
        self.model, self.layout = model, layout
        self.self_entries = [entry for entry in layout if entry[0] == "self"]
        self.encoder_fields = encoder_fields
        self.encoder_output = encoder_output

    def forward(self, tokens, attention_mask, steps, encoder, slots):
        count = self.model.config.decoder_layers
        cache = _empty_cache(self.model.config)
        self_layers, cross_layers = _layers(cache, "self", count), _layers(cache, "cross", count)
        past = steps.shape[0]
        for layer in self_layers:
            layer.steps = past
        for (half, index, slot), tensor in zip(self.layout, slots):
            layer = (self_layers if half == "self" else cross_layers)[index]
            setattr(layer, slot, tensor)
            if slot == "keys":
                layer.is_initialized = True
                layer.dtype, layer.device = tensor.dtype, tensor.device
                if half == "cross":
                    layer.memory_filled = True
        out = self.model(
            encoder_outputs=self.encoder_output(**dict(zip(self.encoder_fields, encoder))),
            attention_mask=attention_mask,
            decoder_input_ids=tokens,
            past_key_values=cache,
            use_cache=True,
        )
        new = [getattr(self_layers[i], s) for _, i, s in self.self_entries]
        # one position: a reshape, not a Gather of the last position (which copied the logits, 5% of a step)
        return (out.logits.squeeze(1).float(), *new)


def _layout(model) -> list[tuple[str, int, str]]:
    source = torch.tensor([[5, 6, 7, 2]])
    wrapped = _Start(model, [])
    cache_holder = {}

    # one eager start, to see which slots the family's layers fill
    original = _empty_cache

    def recording(config):
        cache_holder["cache"] = original(config)
        return cache_holder["cache"]

    globals()["_empty_cache"] = recording
    try:
        with torch.no_grad():
            wrapped(source, torch.ones_like(source))
            encoder = model.get_encoder()(input_ids=source, attention_mask=torch.ones_like(source))
    finally:
        globals()["_empty_cache"] = original
    fields = [name for name in ENCODER_FIELDS if getattr(encoder, name, None) is not None]
    return _filled(cache_holder["cache"], model.config.decoder_layers), fields, encoder


def _fold_key_transposes(path: Path) -> None:
    """Rewrite the exporter's attention lowering of the keys, Reshape(k, (-1, length, head)) -> Transpose(0, 2, 1)
    -> Reshape(k's two leading dimensions, head, length), on a 4-D k (the cache slots, the step's concatenated keys),
    as one Transpose(0, 1, 3, 2): the same values, and ONNX Runtime then folds the transpose into the MatMul that reads
    it (no copy of every key of the cache each step: +6% beam-4 batch-32 tokens per CPU second, plain, reduced)."""
    import onnx
    from onnx import helper

    model = onnx.load(path)
    graph = model.graph
    typed = {value.name: value for value in (*graph.input, *graph.output, *graph.value_info)}

    def rank(name):
        value = typed.get(name)
        return len(value.type.tensor_type.shape.dim) if value is not None else None

    nodes = list(graph.node)
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(index)

    def only_reader(index, op_type):
        found = readers.get(nodes[index].output[0], [])
        return found[0] if len(found) == 1 and nodes[found[0]].op_type == op_type else None

    dropped, added = set(), {}
    for first, node in enumerate(nodes):
        if node.op_type != "Reshape" or rank(node.input[0]) != 4:
            continue
        transpose = only_reader(first, "Transpose")
        if transpose is None or [list(a.ints) for a in nodes[transpose].attribute if a.name == "perm"] != [[0, 2, 1]]:
            continue
        second = only_reader(transpose, "Reshape")
        if second is None or rank(nodes[second].output[0]) not in (None, 4):
            continue
        dropped |= {first, transpose, second}
        added[second] = helper.make_node(
            "Transpose",
            [node.input[0]],
            [nodes[second].output[0]],
            perm=[0, 1, 3, 2],
            name=f"{nodes[transpose].name}_k",
        )
    if not added:
        return
    kept = [added.get(index, node) for index, node in enumerate(nodes) if index not in dropped or index in added]
    del graph.node[:]
    graph.node.extend(kept)
    onnx.save(model, path)


def _transposed_weights(source: Path, target: Path) -> None:
    """`source` with every Transpose of a weight replaced by the transposed weight, written to `target`: the tied
    output projection reads the embedding matrix through a Transpose, which ONNX Runtime folds when it loads the
    graph, but which hides the weight from `quantize_dynamic` (the output projection, a fifth of a step's work,
    stayed fp32 in the int8 graphs)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(source)
    graph = model.graph
    weights = {weight.name: weight for weight in graph.initializer}
    kept, renamed = [], {}
    for node in graph.node:
        if node.op_type == "Transpose" and node.input[0] in weights:
            perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
            array = numpy_helper.to_array(weights[node.input[0]])
            array = array.transpose(perm[0]) if perm else array.T
            name = f"{node.input[0]}.transposed"
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
            weights[name] = graph.initializer[-1]
            renamed[node.output[0]] = name
        else:
            kept.append(node)
    for node in kept:
        for position, name in enumerate(node.input):
            if name in renamed:
                node.input[position] = renamed[name]
    del graph.node[:]
    graph.node.extend(kept)
    onnx.save(model, target)


def export_onnx(model, folder: str | Path, quantize: bool = False, tokenizer=None) -> Path:
    """Write `start.onnx`, `step.onnx` and the layout to a new `folder` (an existing one is refused); with
    `quantize`, also `start.int8.onnx` and `step.int8.onnx` (dynamic int8 quantization of the matrix products); with
    `tokenizer`, the tokenizer too (what `translate_lines` reads)."""
    folder = Path(folder)
    if folder.exists():
        raise FileExistsError(f"{folder} exists; give a new folder for the ONNX export (nothing is overwritten).")
    model = model.eval()
    layout, fields, encoder_output = _layout(model)
    folder.mkdir(parents=True)
    source = torch.tensor([[5, 9, 14, 3, 22, 2], [7, 11, 2, 1, 1, 1]]) % model.config.vocab_size
    mask = source.ne(model.config.pad_token_id).long()
    start = _Start(model, layout).eval()
    names = [_slot_name(entry) for entry in layout]
    batch, length, past = torch.export.Dim("batch"), torch.export.Dim("source"), torch.export.Dim("past")
    with torch.no_grad():
        program = torch.onnx.export(
            start,
            (source, mask),
            dynamo=True,
            input_names=["input_ids", "attention_mask"],
            output_names=["logits", *fields, *names],
            dynamic_shapes={"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}},
            verbose=False,
        )
        program.save(folder / "start.onnx")
        _fold_key_transposes(folder / "start.onnx")
        outputs = start(source, mask)
        encoder = list(outputs[1 : 1 + len(fields)])
        slots = list(outputs[1 + len(fields) :])
        # a few steps in, so that no length is specialised to 0 or 1
        step = _Step(model, layout, fields, type(encoder_output)).eval()
        tokens = torch.tensor([[4], [5]])
        for done in range(1, 3):
            result = step(tokens, mask, torch.zeros(done), tuple(encoder), tuple(slots))
            new = iter(result[1:])
            slots = [next(new) if entry[0] == "self" else tensor for entry, tensor in zip(layout, slots)]
        slot_shapes = []
        for half, _, slot in layout:
            shape = {0: batch}
            if slot in ("keys", "values"):
                shape[2] = past if half == "self" else length
            elif slot.startswith("context"):
                shape[2] = length
            slot_shapes.append(shape)
        encoder_shapes = tuple(
            {0: batch, 1: length} if f == "last_hidden_state" else {0: batch, 2: length} for f in fields
        )
        program = torch.onnx.export(
            step,
            (tokens, mask, torch.zeros(3), tuple(encoder), tuple(slots)),
            dynamo=True,
            input_names=["tokens", "attention_mask", "steps", *fields, *names],
            output_names=["logits", *["new." + name for name, e in zip(names, layout) if e[0] == "self"]],
            dynamic_shapes=({0: batch}, {0: batch, 1: length}, {0: past}, encoder_shapes, tuple(slot_shapes)),
            verbose=False,
        )
        program.save(folder / "step.onnx")
        _fold_key_transposes(folder / "step.onnx")
    info = {
        "layout": [list(entry) for entry in layout],
        "encoder_fields": fields,
        "decoder_start_token_id": model.config.decoder_start_token_id,
        "eos_token_id": model.config.eos_token_id,
        "pad_token_id": model.config.pad_token_id,
        "length_penalty": model.generation_config.length_penalty,
        "early_stopping": model.generation_config.early_stopping,
    }
    (folder / LAYOUT_FILE).write_text(json.dumps(info, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if quantize:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        for name in ("start", "step"):
            # MatMul only: quantizing the embedding's Gather too makes every step dequantize the whole (tied) embedding
            # matrix (measured at the reduced benchmark size, plain, greedy b32: 4,438 tokens/CPU s with every op
            # type, 6,204 with MatMul only, fp32 3,943); per-tensor scales: per-channel ones (per_channel=True) kept
            # the int8 test's chrF closer to fp32 (+0.25 against -0.58) but cost 7% at greedy b32, 27% at greedy b1
            weights_first = folder / f"{name}.transposed.onnx"
            _transposed_weights(folder / f"{name}.onnx", weights_first)
            try:
                with quiet_preprocessing_hint():
                    quantize_dynamic(
                        weights_first,
                        folder / f"{name}.int8.onnx",
                        weight_type=QuantType.QInt8,
                        op_types_to_quantize=["MatMul"],
                    )
            finally:
                weights_first.unlink()
    return folder


class OnnxDecoder:
    """Greedy decoding over an `export_onnx` folder with ONNX Runtime (`int8=True`: the quantized graphs)."""

    def __init__(self, folder: str | Path, int8: bool = False, threads: int = 1):
        import onnxruntime

        folder = Path(folder)
        info = json.loads((folder / LAYOUT_FILE).read_text())
        self.layout = [tuple(entry) for entry in info["layout"]]
        self.fields = info["encoder_fields"]
        self.eos, self.pad = info["eos_token_id"], info["pad_token_id"]
        self.start_token = info["decoder_start_token_id"]
        # unset in the generation config: generate()'s defaults
        self.length_penalty = 1.0 if info.get("length_penalty") is None else info["length_penalty"]
        self.early_stopping = False if info.get("early_stopping") is None else info["early_stopping"]
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = threads
        suffix = ".int8.onnx" if int8 else ".onnx"
        if not (folder / f"start{suffix}").exists():
            raise FileNotFoundError(f"{folder / f'start{suffix}'} is missing; export with quantize=True for int8.")
        self.start = onnxruntime.InferenceSession(str(folder / f"start{suffix}"), options)
        self.step = onnxruntime.InferenceSession(str(folder / f"step{suffix}"), options)
        self.names = [_slot_name(entry) for entry in self.layout]
        self.self_index = [i for i, entry in enumerate(self.layout) if entry[0] == "self"]

    def greedy(
        self, input_ids, attention_mask, max_new_tokens: int, min_new_tokens: int = 0, forced=None, max_lengths=None
    ):
        """Tokens as `generate()` gives them for greedy search (without the decoder start token; finished rows
        padded), and the logits of each step (batch, steps, vocab). `forced` (batch, steps): feed these tokens
        instead of the chosen ones (to compare the logits along a given path). `max_lengths` (batch,): each row's own
        cap on its tokens, `</s>` forced once it has that many (`translate`'s source-relative cap)."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        mask = np.asarray(attention_mask, dtype=np.int64)
        logits, *rest = self.start.run(None, {"input_ids": input_ids, "attention_mask": mask})
        encoder, slots = dict(zip(self.fields, rest)), rest[len(self.fields) :]
        batch = input_ids.shape[0]
        out, scores = [], []
        finished = np.zeros(batch, dtype=bool)
        for step in range(max_new_tokens):
            if step < min_new_tokens:
                logits[:, self.eos] = -np.inf
            scores.append(logits)
            token = logits.argmax(-1) if forced is None else np.asarray(forced)[:, step]
            token = np.where(finished, self.pad, token)
            out.append(token)
            finished |= token == self.eos
            if (forced is None and finished.all()) or step + 1 == max_new_tokens:
                break
            logits = self._step(token, encoder, slots, mask, step + 1, max_lengths)
        return np.stack(out, axis=1), np.stack(scores, axis=1)

    def _step(self, tokens, encoder, slots, mask, done, max_lengths=None):
        """The next logits after `done` tokens (the self-attention slots updated in place); rows whose
        `max_lengths` (one per row) are reached get `</s>` only (log-probability 0, every other token -inf)."""
        feeds = {"tokens": tokens[:, None].astype(np.int64), "attention_mask": mask, **encoder}
        feeds["steps"] = np.zeros(done, dtype=np.float32)
        feeds.update(zip(self.names, slots))
        logits, *new = self.step.run(None, feeds)
        for index, tensor in zip(self.self_index, new):
            slots[index] = tensor
        if max_lengths is not None:
            capped = np.asarray(max_lengths) <= done
            if capped.any():
                logits[capped] = -np.inf
                logits[capped, self.eos] = 0.0
        return logits

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
        """The best hypothesis of beam search, with the rules of `generate()`'s beam search (2 * num_beams
        candidates a step, a hypothesis finishes only from the top num_beams, length penalty on the generated length,
        its early-stopping heuristic), so that the tokens are `generate()`'s; decoder start token excluded.
        `max_lengths` (batch,): each sentence's own cap, as in `greedy`; `length_penalty`: instead of the export's."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        mask = np.asarray(attention_mask, dtype=np.int64)
        logits, *rest = self.start.run(None, {"input_ids": input_ids, "attention_mask": mask})
        batch, beams, keep = input_ids.shape[0], num_beams, 2 * num_beams
        encoder = {name: np.repeat(tensor, beams, axis=0) for name, tensor in zip(self.fields, rest)}
        slots = [np.repeat(tensor, beams, axis=0) for tensor in rest[len(self.fields) :]]
        mask = np.repeat(mask, beams, axis=0)
        logits = torch.from_numpy(np.repeat(logits, beams, axis=0))
        vocab, max_length, cur_len = logits.shape[-1], 1 + max_new_tokens, 1
        running = torch.full((batch, beams, max_length), self.pad, dtype=torch.long)
        running[:, :, 0] = self.start_token
        sequences = running.clone()
        running_scores = torch.zeros(batch, beams)
        running_scores[:, 1:] = -1e9
        scores = torch.full((batch, beams), -1e9)
        lengths = torch.zeros(batch, beams, dtype=torch.long)
        finished = torch.zeros(batch, beams, dtype=torch.bool)
        unsatisfied = torch.ones(batch, 1, dtype=torch.bool)
        top = torch.arange(keep) < beams
        offset = torch.arange(batch)[:, None] * beams
        penalty = self.length_penalty if length_penalty is None else length_penalty
        early = self.early_stopping
        if max_lengths is not None:
            max_lengths = np.repeat(np.asarray(max_lengths), beams)  # rows grouped by sentence
        while True:
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            if cur_len - 1 < min_new_tokens:
                log_probs[:, self.eos] = -math.inf
            # the best 2k of beams x vocabulary are among each beam's best 2k (a beam adds one score to all its
            # tokens): the same candidates and sums as over the whole (batch, beams * vocab), without that sum
            best, best_ids = torch.topk(log_probs, k=min(keep, vocab), dim=-1)
            candidates = (best.view(batch, beams, -1) + running_scores[:, :, None]).view(batch, -1)
            top_scores, top_index = torch.topk(candidates, k=keep)
            source_beam, ids = top_index // best.shape[-1], torch.gather(best_ids.view(batch, -1), 1, top_index)
            top_sequences = torch.gather(running, 1, source_beam[:, :, None].expand(-1, -1, max_length)).clone()
            top_sequences[:, :, cur_len] = ids
            hits = (ids == self.eos) | (cur_len + 1 >= max_length)
            still = top_scores + hits.float() * -1e9
            chosen = torch.topk(still, k=beams)[1]
            running = torch.gather(top_sequences, 1, chosen[:, :, None].expand(-1, -1, max_length))
            running_scores = torch.gather(still, 1, chosen)
            reorder = (torch.gather(source_beam, 1, chosen) + offset).view(-1).numpy()
            ended = hits & top[None, :]
            ended_scores = top_scores / ((cur_len + 1 - 1) ** penalty)
            full = finished.all(-1, keepdim=True) & (early is True)
            ended_scores = ended_scores + full.float() * -1e9 + (~unsatisfied).float() * -1e9 + (~ended) * -1e9
            merged = torch.cat((scores, ended_scores), 1)
            best = torch.topk(merged, k=beams)[1]
            sequences = torch.gather(
                torch.cat((sequences, top_sequences), 1), 1, best[:, :, None].expand(-1, -1, max_length)
            )
            lengths = torch.gather(torch.cat((lengths, torch.full_like(ended_scores, cur_len).long()), 1), 1, best)
            finished = torch.gather(torch.cat((finished, ended), 1), 1, best)
            scores = torch.gather(merged, 1, best)
            cur_len += 1
            hypothetical = max_length - 1 if early == "never" and penalty > 0.0 else cur_len - 1
            possible = running_scores[:, :1] / (hypothetical**penalty)
            worst = torch.where(finished, scores.min(dim=1, keepdim=True)[0], -1.0e9)
            unsatisfied = unsatisfied & (possible > worst).any(-1, keepdim=True)
            go_on = unsatisfied.any() & ~(finished.all() & (early is True)) & ~hits.all()
            if not go_on:
                break
            slots = [
                np.take(tensor, reorder, axis=0) if entry[0] == "self" else tensor
                for entry, tensor in zip(self.layout, slots)
            ]
            tokens = running[:, :, cur_len - 1].reshape(-1).numpy()
            logits = torch.from_numpy(self._step(tokens, encoder, slots, mask, cur_len - 1, max_lengths))
        length = int(lengths[:, 0].max())
        return sequences[:, 0, 1 : 1 + length].numpy()


def translate_lines(
    folder: str | Path, lines: list[str], int8: bool = False, batch_size: int = 32, max_new_tokens: int = 256
) -> list[str]:
    """Greedy translations of `lines` with an `export_onnx` folder written with its tokenizer."""
    from transformers import AutoTokenizer

    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an integer >= 1, got {batch_size!r}.")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    decoder = OnnxDecoder(folder, int8=int8)
    out = []
    for begin in range(0, len(lines), batch_size):
        encoded = tokenizer(lines[begin : begin + batch_size], padding=True, return_tensors="np")
        tokens, _ = decoder.greedy(encoded["input_ids"], encoded["attention_mask"], max_new_tokens)
        out.extend(tokenizer.batch_decode(tokens, skip_special_tokens=True))
    return out


# ---- serving: the graphs inside a model folder, and `hf-deep-nmt translate --backend onnxruntime` -----------------

ONNX_SUBFOLDER = "onnx"  # a model folder (and its Hub repository) carries its graphs here
PREPROCESSING_HINT = "Please consider to run pre-processing before quantization"


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


class _DropPreprocessingHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(PREPROCESSING_HINT)


@contextlib.contextmanager
def quiet_preprocessing_hint():
    """Inside: onnxruntime's quantizer does not log its advice to run its shape pre-processing first (it logs it on
    the root logger for every graph; the int8 graphs are measured without it). Nothing else is filtered."""
    hint = _DropPreprocessingHint()
    root = logging.getLogger()
    root.addFilter(hint)
    try:
        yield
    finally:
        root.removeFilter(hint)


def export_for_serving(model, tokenizer, folder: str | Path, quantize: bool = False) -> Path:
    """`export_onnx` with the tokenizer and the model's generation config (the default beams and length penalty of
    `translate --backend onnxruntime`) into the new `folder`, written beside it and renamed into place when
    complete, so that a failed export leaves nothing behind. An existing `folder` is refused."""
    folder = Path(folder)
    if os.path.lexists(folder):
        raise FileExistsError(f"{folder} exists; give a new folder for the ONNX export (nothing is overwritten).")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-partial-", dir=folder.parent))
    try:
        export_onnx(model, staging / "graphs", quantize=quantize, tokenizer=tokenizer)
        model.generation_config.save_pretrained(staging / "graphs")
        if os.path.lexists(folder):
            raise FileExistsError(f"{folder} appeared during the export; the new graphs are not put in its place.")
        os.rename(staging / "graphs", folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def export_into_model(model, tokenizer, model_folder: str | Path, quantize: bool = False) -> Path:
    """`export_for_serving` into `model_folder/onnx`, the place `onnx_folder` (and so `translate --backend
    onnxruntime --model MODEL_FOLDER`) looks, and which `push` uploads with the model. An existing one is refused."""
    model_folder = Path(model_folder)
    target = model_folder / ONNX_SUBFOLDER
    if os.path.lexists(target):
        raise FileExistsError(f"{target} exists; nothing is overwritten: remove it first to export the graphs again.")
    return export_for_serving(model, tokenizer, target, quantize)


def onnx_folder(model: str | Path, int8: bool = False) -> Path:
    """The folder of graphs that `model` names: an `export-onnx` folder itself, or a model folder's `onnx/`
    subfolder; a name that is no local path is taken as a Hub repository id, and its `onnx/` folder downloaded.
    `FileNotFoundError` naming the folder and the command that writes the graphs when there are none (or no int8
    graphs where `int8`)."""
    path = Path(str(model)).expanduser()
    if not path.exists():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(model), allow_patterns=[f"{ONNX_SUBFOLDER}/*"]))
    make = f"`hf-deep-nmt export-onnx --model {model} --into-model{' --int8' if int8 else ''}`"
    found = next((folder for folder in (path, path / ONNX_SUBFOLDER) if (folder / LAYOUT_FILE).is_file()), None)
    if found is None:
        raise FileNotFoundError(
            f"{model} holds no ONNX graphs (no {LAYOUT_FILE} in it or in its {ONNX_SUBFOLDER}/ folder); write them "
            f"with {make}."
        )
    if int8 and not (found / "start.int8.onnx").is_file():
        raise FileNotFoundError(
            f"{found} has no int8 graphs (start.int8.onnx); export again with --int8 (remove {found} first, then "
            f"{make}), or translate without --int8."
        )
    return found


def load_onnx_model(model: str | Path, int8: bool = False, threads: int | None = None):
    """(`OnnxDecoder`, tokenizer) of `onnx_folder(model, int8)`, on `threads` ONNX Runtime threads (intra- and
    inter-op; None: `translate.default_threads()`). The decoder takes the place of the model in
    `hf_deep_nmt.serving.translate`'s `translate`, `write_translations` and `translate_file`."""
    from transformers import AutoTokenizer

    from hf_deep_nmt.serving.translate import default_threads

    require_onnxruntime()
    if threads is None:
        threads = default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"`threads` must be a positive integer, got {threads!r}.")
    folder = onnx_folder(model, int8)
    decoder = OnnxDecoder(folder, int8=int8, threads=threads)
    decoder.folder = folder
    return decoder, AutoTokenizer.from_pretrained(folder)


def saved_generation_config(decoder: OnnxDecoder):
    """The generation config saved beside the graphs (`export_for_serving`), else transformers' defaults."""
    from transformers import GenerationConfig

    folder = getattr(decoder, "folder", None)
    if folder is not None and (Path(folder) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    return GenerationConfig()


def translate_batch(decoder: OnnxDecoder, tokenizer, sources: list[list[int]], options) -> list[str]:
    """One batch of token ids decoded as `translate._translate_batch` decodes it with `generate()`: greedy or beam
    search (`options.num_beams`), each sentence capped at `options.output_limits` of its length, the fairseq length
    penalty `options.length_penalty`."""
    batch = tokenizer.pad({"input_ids": sources}, return_tensors="np")
    limits = options.output_limits(torch.from_numpy(batch["attention_mask"]).sum(dim=1)).numpy()
    longest, ids, mask = int(limits.max()), batch["input_ids"], batch["attention_mask"]
    if options.num_beams == 1:
        tokens, _ = decoder.greedy(ids, mask, longest + 1, max_lengths=limits)
    else:
        tokens = decoder.beam(
            ids, mask, options.num_beams, longest + 1, max_lengths=limits, length_penalty=options.length_penalty
        )
    return [text.strip() for text in tokenizer.batch_decode(tokens, skip_special_tokens=True)]
