"""Export to ONNX Runtime: any family's model as two graphs with the decoder's state as explicit tensors.

`export_onnx(model, folder)` writes `start.onnx` (the encoder and the first decoder step: logits, the encoder states
and every filled cache slot) and `step.onnx` (one decoder step: the previous token, the encoder states and mask,
every cache slot in; logits and the self-attention half's slots out). The cross-attention half (encoder memory
keys/values, MSC context keys/values) is projected once by `start.onnx` and fed back unchanged, one row per sentence
with the encoder states and mask, whatever the beams (the rows of the tokens and the self-attention slots). The slots
are whatever the family's cache layers fill (`keys`/`values`, MAtt/AAN `running_sum`, MSC `context_*`), read from an
eager run, so every family exports through the same code. What is traced is a copy of the model with some families'
extra work a step folded or fused (`hf_deep_nmt.serving.onnx_rewrites`). `quantize=True` adds the int8 graphs of
`quantize_dynamic` (the matrix products, but for narrow ones).
`export_for_serving` and `export_into_model` put the graphs where `hf-deep-nmt translate --backend onnxruntime` looks.
The decoder that runs them is `hf_deep_nmt.serving.onnx.OnnxDecoder`.

The layout file ties the graphs to what they were made from, because they are found by where they sit: it records the
size and SHA-256 of every graph written (`graphs`), the fingerprint of the tokenizer and, when the model was read from
a saved folder, the SHA-256 of that folder's weight files and config (`source`), and the model's config (what the
decoder's memory estimate reads). `OnnxDecoder` refuses graphs whose folder holds anything else.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from hf_deep_nmt.fingerprints import tokenizer_fingerprint
from hf_deep_nmt.folders import check_apart, written_file_record
from hf_deep_nmt.serving.onnx_layout import (  # noqa: F401  (the layout's names, importable from here as before)
    CONFIG_BOOKKEEPING,
    ENCODER_FIELDS,
    LAYOUT_FILE,
    ONNX_SUBFOLDER,
    SLOTS,
    config_digest,
    weight_files,
)
from hf_deep_nmt.serving.onnx_layout import slot_name as _slot_name
from hf_deep_nmt.serving.onnx_rewrites import for_export

PREPROCESSING_HINT = "Please consider to run pre-processing before quantization"
# a weight matrix with fewer rows or columns than this stays float32 in the int8 graphs (`_narrow_products`)
NARROW = 16
LAYOUT_FORMAT = 2  # 2: the layout records the graphs' and the source's digests (1: the slots and special ids only)
# The step graph's cross-attention reads each sentence's states once for all its beams (`onnx_rewrites`): the layout
# says so (`cross_rows: "sentence"`), and `OnnxDecoder` then binds those states one row per sentence. Graphs written
# before, without the key, read a row of them per beam, and are bound so. A test writes such graphs with False.
GROUP_CROSS_ATTENTION = True


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
        out = self.model.model(
            encoder_outputs=self.encoder_output(**dict(zip(self.encoder_fields, encoder))),
            attention_mask=attention_mask,
            decoder_input_ids=tokens,
            cache=cache,
            use_cache=True,
        )
        new = [getattr(self_layers[i], s) for _, i, s in self.self_entries]
        # the output layer (what the model's forward applies to its last hidden state) on the one position's
        # states, so that its product writes the logits where the decoder bound them: squeezed after it, the 16 MB
        # of a beam-4 batch-32 step's logits were copied once more (ONNX Runtime cannot alias a bound output)
        logits = self.model.lm_head(out.last_hidden_state.squeeze(1))
        return (logits.float(), *new)


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


def _read_inputs_only(path: Path, bound: tuple[str, ...] = ("tokens", "attention_mask", "steps")) -> None:
    """Drop the step graph's inputs that no node reads (MSC's step reads its context states, not the encoder's last
    states nor its block outputs), but for `bound`, which the decoder always binds: `OnnxDecoder` repeats for the
    beams and binds only the inputs the graph has, so an unread input would cost a copy of its states for every beam
    of every batch (graphs written before still have them, and are bound as they were)."""
    import onnx

    model = onnx.load(path)
    graph = model.graph
    read = {name for node in graph.node for name in node.input}
    unread = [value for value in graph.input if value.name not in read and value.name not in bound]
    for value in unread:
        graph.input.remove(value)
    if unread:
        onnx.save(model, path)


def _fuse_normalisations(path: Path) -> None:
    """Rewrite each Div(x, ReduceSum(x, axis, keepdims)) of a non-negative x (an Exp's output, or one such division's)
    as one LpNormalization(x, axis, p=1), whose norm is that sum: mHC's Sinkhorn-Knopp iteration is two such
    divisions per iteration in every sublayer (720 Div and 720 ReduceSum nodes a step at 20 iterations, 6 layers),
    where ONNX Runtime's cost is each node's own, not its few numbers; half the nodes, the same values to within a
    rounding of the sum."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(path)
    graph = model.graph
    constants = {weight.name: numpy_helper.to_array(weight) for weight in graph.initializer}
    nodes = list(graph.node)
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(index)
    positive = {node.output[0] for node in nodes if node.op_type == "Exp"}
    dropped, added = set(), {}
    for index, node in enumerate(nodes):  # in graph order: a division's output is known before its readers
        axes = constants.get(node.input[1]) if node.op_type == "ReduceSum" and len(node.input) == 2 else None
        keep = [a.i for a in node.attribute if a.name == "keepdims"]
        if axes is None or axes.size != 1 or keep == [0] or node.input[0] not in positive:
            continue
        found = readers.get(node.output[0], [])
        division = nodes[found[0]] if len(found) == 1 else None
        if division is None or division.op_type != "Div" or list(division.input) != [node.input[0], node.output[0]]:
            continue
        dropped.add(index)
        added[found[0]] = helper.make_node(
            "LpNormalization", [node.input[0]], [division.output[0]], axis=int(axes.reshape(-1)[0]), p=1,
            name=f"{division.output[0]}_l1",
        )  # fmt: skip
        positive.add(division.output[0])
    if not added:
        return
    kept = [added.get(index, node) for index, node in enumerate(nodes) if index not in dropped]
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


def export_onnx(
    model, folder: str | Path, quantize: bool = False, tokenizer=None, source: str | Path | None = None
) -> Path:
    """Write `start.onnx`, `step.onnx` and the layout to a new `folder` (an existing one is refused); with
    `quantize`, also `start.int8.onnx` and `step.int8.onnx` (dynamic int8 quantization of the matrix products); with
    `tokenizer`, the tokenizer too (what `translate_lines` reads). `source`: the saved model folder `model` was loaded
    from, whose weights and config the layout records (`source_digests`), so that the graphs are refused beside
    others."""
    folder = Path(folder)
    if folder.exists():
        raise FileExistsError(f"{folder} exists; give a new folder for the ONNX export (nothing is overwritten).")
    grouped = GROUP_CROSS_ATTENTION
    model = for_export(model, grouped)  # a copy with fewer operations a step (`onnx_rewrites`); the model is as it was
    origin = source_digests(source, tokenizer)  # what the graphs are made from, read as the export starts
    layout, fields, encoder_output = _layout(model)
    folder.mkdir(parents=True)
    sample = torch.tensor([[5, 9, 14, 3, 22, 2], [7, 11, 2, 1, 1, 1]]) % model.config.vocab_size
    mask = sample.ne(model.config.pad_token_id).long()
    with torch.no_grad():
        outputs = _export_start(_Start(model, layout).eval(), sample, mask, fields, folder / "start.onnx")
        encoder, slots = list(outputs[1 : 1 + len(fields)]), list(outputs[1 + len(fields) :])
        step = _Step(model, layout, fields, type(encoder_output)).eval()
        _export_step(step, mask, encoder, slots, folder / "step.onnx", beams=2 if grouped else 1)
    info = {
        "format": LAYOUT_FORMAT,
        "layout": [list(entry) for entry in layout],
        "encoder_fields": fields,
        "decoder_start_token_id": model.config.decoder_start_token_id,
        "eos_token_id": model.config.eos_token_id,
        "pad_token_id": model.config.pad_token_id,
        "length_penalty": model.generation_config.length_penalty,
        "early_stopping": model.generation_config.early_stopping,
        "model_config": model.config.to_dict(),
    }
    if grouped:
        info["cross_rows"] = "sentence"
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    if quantize:
        for name in ("start", "step"):
            _quantize(folder, name)
    # last, once every graph is there: the layout is what makes the folder one that `OnnxDecoder` reads
    graphs = sorted(path.name for path in folder.iterdir() if path.name.endswith((".onnx", ".onnx.data")))
    info["graphs"] = written_file_record(folder, graphs)
    info["source"] = origin
    (folder / LAYOUT_FILE).write_text(json.dumps(info, indent=1))
    return folder


def source_digests(source: str | Path | None, tokenizer=None) -> dict:
    """What the graphs were made from, for `OnnxDecoder` to compare with the folder it finds them in: the
    `tokenizer`'s fingerprint, and, for a saved model folder `source`, the SHA-256 of each weight file (streamed) and
    the `config_digest` of its config.json."""
    record: dict = {}
    if tokenizer is not None:
        record["tokenizer_fingerprint"] = tokenizer_fingerprint(tokenizer)
    folder = Path(source).expanduser() if source is not None else None
    if folder is not None and (folder / "config.json").is_file():
        record["config"] = config_digest(json.loads((folder / "config.json").read_text(encoding="utf-8")))
        files = weight_files(folder)
        record["weights"] = {
            name: entry["sha256"] for name, entry in written_file_record(folder, [f.name for f in files]).items()
        }
    return record


def _export_start(start: _Start, source, mask, fields: list[str], path: Path) -> tuple:
    """Export the start graph (dynamic batch and source length) to `path`; returns its eager outputs on `source`."""
    names = [_slot_name(entry) for entry in start.layout]
    batch, length = torch.export.Dim("batch"), torch.export.Dim("source")
    program = torch.onnx.export(
        start,
        (source, mask),
        dynamo=True,
        input_names=["input_ids", "attention_mask"],
        output_names=["logits", *fields, *names],
        dynamic_shapes={"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}},
        verbose=False,
    )
    program.save(path)
    _fold_key_transposes(path)
    _fuse_normalisations(path)
    return start(source, mask)


def _export_step(step: _Step, mask, encoder: list, slots: list, path: Path, beams: int = 1) -> None:
    """Export the one-step graph to `path`, traced a few steps in so that no length is specialised to 0 or 1:
    dynamic rows (`batch`), source length and decoded length (`past`: the self-attention slots' length, the `steps`
    input's). `beams` > 1: the traced rows are that many per sentence, and what the step reads once per sentence
    (the source mask, encoder states and cross-attention slots: `_grouped_context`) has its own dynamic dimension,
    `sentences`."""
    layout, fields = step.layout, step.encoder_fields
    slots = [slot.repeat_interleave(beams, 0) if entry[0] == "self" else slot for entry, slot in zip(layout, slots)]
    tokens = torch.arange(4, 4 + len(mask) * beams)[:, None]
    for done in range(1, 3):
        result = step(tokens, mask, torch.zeros(done), tuple(encoder), tuple(slots))
        new = iter(result[1:])
        slots = [next(new) if entry[0] == "self" else tensor for entry, tensor in zip(layout, slots)]
    batch, length, past = torch.export.Dim("batch"), torch.export.Dim("source"), torch.export.Dim("past")
    sentences = torch.export.Dim("sentences") if beams > 1 else batch
    slot_shapes = tuple(
        _slot_shape(half, slot, batch if half == "self" else sentences, length, past) for half, _, slot in layout
    )
    encoder_shapes = tuple(
        {0: sentences, 1: length} if f == "last_hidden_state" else {0: sentences, 2: length} for f in fields
    )
    names = [_slot_name(entry) for entry in layout]
    program = torch.onnx.export(
        step,
        (tokens, mask, torch.zeros(3), tuple(encoder), tuple(slots)),
        dynamo=True,
        input_names=["tokens", "attention_mask", "steps", *fields, *names],
        output_names=["logits", *["new." + name for name, entry in zip(names, layout) if entry[0] == "self"]],
        dynamic_shapes=({0: batch}, {0: sentences, 1: length}, {0: past}, encoder_shapes, slot_shapes),
        verbose=False,
    )
    program.save(path)
    _fold_key_transposes(path)
    _fuse_normalisations(path)
    _read_inputs_only(path)


def _slot_shape(half: str, slot: str, batch, length, past) -> dict:
    """The dynamic dimensions of a cache slot: rows, and the length it spans (keys and values of the self half span
    the decoded tokens; those of the cross half and MSC's context keys, the source)."""
    if slot in ("keys", "values"):
        return {0: batch, 2: past if half == "self" else length}
    if slot.startswith("context"):
        return {0: batch, 2: length}
    return {0: batch}


def _quantize(folder: Path, name: str) -> None:
    """Write `name.int8.onnx` beside `name.onnx`: dynamic int8 quantization of the matrix products.

    MatMul only: quantizing the embedding's Gather too makes every step dequantize the whole (tied) embedding matrix
    (measured at the reduced benchmark size, plain, greedy b32: 4,438 tokens/CPU s with every op type, 6,204 with
    MatMul only, fp32 3,943); per-tensor scales: per-channel ones (per_channel=True) kept the int8 test's chrF closer
    to fp32 (+0.25 against -0.58) but cost 7% at greedy b32, 27% at greedy b1."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    weights_first = folder / f"{name}.transposed.onnx"
    _transposed_weights(folder / f"{name}.onnx", weights_first)
    try:
        with quiet_preprocessing_hint():
            quantize_dynamic(
                weights_first,
                folder / f"{name}.int8.onnx",
                weight_type=QuantType.QInt8,
                op_types_to_quantize=["MatMul"],
                nodes_to_exclude=_narrow_products(weights_first),
            )
    finally:
        weights_first.unlink()


def _narrow_products(path: Path) -> list[str]:
    """The MatMuls of the graph `path` whose weight is a vector or has fewer than `NARROW` rows or columns (the
    Hyper-Connections' dynamic weight maps, d x (n + 2)): int8 makes them slower, not faster, since quantizing their
    input (a DynamicQuantizeLinear over the whole input, each time) costs more than the product (measured on
    Hyper-Connections, reduced size: a tenth of a step)."""
    import onnx

    graph = onnx.load(path).graph
    shapes = {weight.name: list(weight.dims) for weight in graph.initializer}
    return [
        node.name
        for node in graph.node
        if node.op_type == "MatMul"
        and node.input[1] in shapes
        and (len(shapes[node.input[1]]) < 2 or min(shapes[node.input[1]][-2:]) < NARROW)
    ]


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


def check_onnx_output(folder: str | Path, source: str | Path | None) -> None:
    """`ValueError` when the new graph `folder` lies inside the model folder `source` (or holds it) anywhere but its
    `onnx/` subfolder (`export_into_model`'s place): the graphs would be uploaded with the model by `push`, where
    nothing reads them. The check `grow` and `export-ctranslate2` make of their output."""
    if source is None or not Path(source).expanduser().is_dir():
        return
    source = Path(source).expanduser()
    if Path(folder).expanduser().resolve() != (source / ONNX_SUBFOLDER).resolve():
        check_apart(Path(folder).expanduser(), {"the model folder": source})


def export_for_serving(
    model, tokenizer, folder: str | Path, quantize: bool = False, source: str | Path | None = None
) -> Path:
    """`export_onnx` with the tokenizer and the model's generation config (the default beams and length penalty of
    `translate --backend onnxruntime`) into the new `folder`, written beside it and renamed into place when
    complete, so that a failed export leaves nothing behind. An existing `folder` is refused, and so is one inside
    the model folder `source` (the saved folder `model` was loaded from, whose digests the layout records) other than
    its `onnx/` subfolder (`check_onnx_output`)."""
    folder = Path(folder)
    if os.path.lexists(folder):
        raise FileExistsError(f"{folder} exists; give a new folder for the ONNX export (nothing is overwritten).")
    # the folder the model was loaded from, when no source is named: the graphs go beside it all the same
    check_onnx_output(folder, source if source is not None else getattr(model, "name_or_path", None) or None)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-partial-", dir=folder.parent))
    try:
        export_onnx(model, staging / "graphs", quantize=quantize, tokenizer=tokenizer, source=source)
        model.generation_config.save_pretrained(staging / "graphs")
        if os.path.lexists(folder):
            raise FileExistsError(f"{folder} appeared during the export; the new graphs are not put in its place.")
        os.rename(staging / "graphs", folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def export_into_model(model, tokenizer, model_folder: str | Path, quantize: bool = False) -> Path:
    """`export_for_serving` into `model_folder/onnx`, the place `onnx_folder` (and so `translate --backend
    onnxruntime --model MODEL_FOLDER`) looks, and which `push` uploads with the model. An existing one is refused.
    `model` is the model saved in `model_folder`: the layout records that folder's weights and config as the graphs'
    source."""
    model_folder = Path(model_folder)
    target = model_folder / ONNX_SUBFOLDER
    if os.path.lexists(target):
        raise FileExistsError(f"{target} exists; nothing is overwritten: remove it first to export the graphs again.")
    return export_for_serving(model, tokenizer, target, quantize, source=model_folder)
