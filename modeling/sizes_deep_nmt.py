"""The sizes of a deep-NMT model, known from its config before anything is built: the parameters it holds and the
memory it and its decoding take, with the checks that refuse, before allocating, a model or a decoding that cannot
fit and a config that does not belong to the weights it is loaded with.

The parameters are counted by arithmetic on the config (`parameter_parts`), not by building the modules on the meta
device: a layer history holds one module per layer (DLCL's LayerNorms), and a stack of 50,000 layers takes seconds
and hundreds of MiB to build even there, while the count exists to refuse such a model before its modules fill the
memory. The count follows the architecture by hand, so a test holds it to the built model of every architecture.

`modeling_deep_nmt.py` imports this file; it ships beside it inside every Hub repository (transformers copies the
relative import on `save_pretrained`), and imports only the standard library, torch, transformers,
`configuration_deep_nmt.py` and `contract_deep_nmt.py`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .configuration_deep_nmt import (
    ATTENTION_RESIDUAL_AGGREGATIONS,
    DeepNMTConfig,
    hyper_connection_sublayers,
    msc_attends_context,
    stack_has_final_norm,
)
from .contract_deep_nmt import LOADING, check_fits, saved_tensor_shapes

# Memory each layer takes beyond its tensors (the Python objects of its modules), about 9-37 KiB per layer measured on
# the meta device: a lower bound, so that a config of a million layers is refused before its modules fill the memory.
MODULE_BYTES_PER_LAYER = 8 << 10


# ---- parameters -----------------------------------------------------------------------------------------------------


def _linear(inputs: int, outputs: int) -> int:
    """Parameters of an `nn.Linear(inputs, outputs)`: its matrix and its bias."""
    return inputs * outputs + outputs


def _layer_parameters(config: DeepNMTConfig, side: str) -> tuple[int, bool]:
    """Parameters of one layer of stack `side` besides its relative-position keys and hyper-connection weights, and
    whether its self-attention has relative-position keys (the decoder's, with multi-head self-attention only)."""
    d, ffn = config.d_model, getattr(config, f"{side}_ffn_dim")
    norm, attention = 2 * d, 4 * _linear(d, d)
    layer = 2 * norm + _linear(d, ffn) + _linear(ffn, d)  # the FFN and its LayerNorm, one attention's LayerNorm
    layer += attention  # the encoder's self-attention; the decoder's cross-attention (MAtt's merged sublayer)
    relative = True
    if side == "decoder":
        self_attention = config.decoder_self_attention
        if self_attention == "multi_head":
            layer += attention + norm
        elif self_attention == "average":
            layer += _linear(2 * d, 2 * d) + norm + (_linear(d, ffn) + _linear(ffn, d) if config.aan_ffn else 0)
        relative = self_attention == "multi_head"
    if msc_attends_context(config, side):
        layer += attention + (_linear(2 * d, d) if config.msc_fusion == "gate" else 0)
    return layer, relative


def _history_parameters(config: DeepNMTConfig, side: str) -> int:
    """Parameters (and saved buffers) of the layer history of stack `side`: none for a residual stack."""
    layers, aggregation = getattr(config, f"{side}_layers"), getattr(config, f"{side}_layer_aggregation")
    if aggregation in ATTENTION_RESIDUAL_AGGREGATIONS:
        return 2 * (layers + 1) * config.d_model  # a query and a key gain per layer and for the output
    if aggregation == "residual":
        return 0
    size = layers + 1 if aggregation == "dlcl" else len(getattr(config, f"{side}_block_boundaries"))
    return size * size + ((size - 1) * 2 * config.d_model if config.dlcl_history_norm else 0)


def _hyper_connection_parameters(config: DeepNMTConfig, side: str) -> int:
    """Weights of the hyper-connections of stack `side` (0 without them): per residual block, static alpha and beta,
    and with `hyper_connections_dynamic` the LayerNorm, W_alpha, W_beta, s_alpha and s_beta."""
    streams, d = getattr(config, f"{side}_hyper_connections"), config.d_model
    if not streams:
        return 0
    block = streams * (streams + 1) + streams
    if config.hyper_connections_dynamic:
        block += 2 * d + d * (streams + 1) + d + 2
    return getattr(config, f"{side}_layers") * hyper_connection_sublayers(config, side) * block


def _stack_parts(config: DeepNMTConfig, side: str) -> dict[str, int]:
    """The parts of stack `side` (its layers with the final LayerNorm, and those of its weights that grow with
    other settings), each present only where the stack has it."""
    layers, d = getattr(config, f"{side}_layers"), config.d_model
    layer, relative = _layer_parameters(config, side)
    msc_encoder = side == "encoder" and config.msc_block_layers is not None  # its top block's LayerNorm ends it
    final_norm = 2 * d if stack_has_final_norm(config, side) and not msc_encoder else 0
    parts = {f"{side} layers": layers * layer + final_norm}
    window, heads = config.relative_position_window, getattr(config, f"{side}_attention_heads")
    if window and relative:
        parts[f"{side} relative position keys"] = layers * (2 * window + 1) * (d // heads)
    if getattr(config, f"{side}_layer_aggregation") != "residual":
        parts[f"{side} layer-history weights"] = _history_parameters(config, side)
    hyper = _hyper_connection_parameters(config, side)
    if hyper:
        parts[f"{side} hyper-connection weights"] = hyper
    return parts


def _msc_parameters(config: DeepNMTConfig) -> int:
    """MSC's block LayerNorms and the context cells carrying the context across the blocks (GRU or feed-forward,
    one shared or one per block; none where the context is the block output)."""
    d, blocks = config.d_model, len(config.msc_blocks)
    cells = 0
    if msc_attends_context(config, "encoder") and config.msc_context != "block_output":
        count = blocks if config.msc_context.endswith("_per_block") else 1
        cell = 2 * (3 * d * d + 3 * d) if config.msc_context.startswith("gru") else _linear(2 * d, d) + _linear(d, d)
        cells = count * cell
    return blocks * 2 * d + cells


def parameter_parts(config: DeepNMTConfig, output_layer: bool = True) -> dict[str, int]:
    """The parameters of the model of `config` by part, from its sizes alone (nothing is built): every parameter and
    saved buffer once (tied weights once). `count_parameters` adds them up. `output_layer`: the translation model
    (`DeepNMTForConditionalGeneration`, whose output layer adds an untied matrix and `output_bias`), else the
    encoder-decoder without it (`DeepNMTModel`)."""
    d = config.d_model
    separate = 0 if config.share_embeddings else config.decoder_vocab_size * d  # the target side's own embeddings
    parts = {"token embeddings": config.vocab_size * d + separate}
    for side in ("encoder", "decoder"):
        parts.update(_stack_parts(config, side))
    if config.msc_block_layers is not None:
        parts["MSC block LayerNorms and context cells"] = _msc_parameters(config)
    if output_layer:
        head = (0 if config.tie_word_embeddings else config.decoder_vocab_size * d) + (
            config.decoder_vocab_size if config.output_bias else 0
        )
        if head:
            parts["output layer"] = head
    return parts


def count_parameters(config: DeepNMTConfig, output_layer: bool = True) -> int:
    """Every parameter (and saved buffer) of the model of `config`, from its sizes alone: what its weights file
    holds, and what building it allocates (`parameter_parts`)."""
    return sum(parameter_parts(config, output_layer).values())


# ---- memory ---------------------------------------------------------------------------------------------------------


def _part_settings(config: DeepNMTConfig, part: str) -> str:
    """The settings of `config` a part of `parameter_parts` grows with, for a message."""
    side = part.split()[0]
    if part == "token embeddings":
        names = ["vocab_size", "d_model"] + ([] if config.share_embeddings else ["decoder_vocab_size"])
    elif part == "output layer":
        names = ["decoder_vocab_size", "d_model"]
    elif part.endswith("relative position keys"):
        names = ["relative_position_window", f"{side}_layers", "d_model"]
    elif part.endswith("layer-history weights"):
        names = [f"{side}_layer_aggregation", f"{side}_layers"]
        names += [f"{side}_block_boundaries"] if getattr(config, f"{side}_layer_aggregation") == "sparse" else []
        if getattr(config, f"{side}_layer_aggregation") in ATTENTION_RESIDUAL_AGGREGATIONS:
            names.append("d_model")
    elif part.endswith("hyper-connection weights"):
        names = [f"{side}_hyper_connections", "hyper_connections_dynamic", f"{side}_layers", "d_model"]
    elif part.startswith("MSC"):
        names = ["msc_block_layers", "msc_context", "d_model"]
    else:
        names = [f"{side}_layers", "d_model", f"{side}_ffn_dim"]
    shown = []
    for name in names:
        value = getattr(config, name)
        if isinstance(value, list) and len(value) > 6:
            value = f"[{', '.join(map(str, value[:3]))}, ..., {value[-1]}]"
        else:
            value = repr(value)
        shown.append(f"{name}={value}")
    return ", ".join(shown)


def check_model_fits(config: DeepNMTConfig, output_layer: bool, device: torch.device | None, what: str) -> None:
    """`InsufficientMemoryError` before a model of `config` is built when its tensors (`parameter_parts`, in the
    default dtype, on `device`; None or the meta device: nothing allocated) or its modules (`MODULE_BYTES_PER_LAYER`,
    on the CPU) cannot fit what this process can allocate, naming the largest part and the settings it grows with."""
    parts = parameter_parts(config, output_layer)
    count = sum(parts.values())
    dtype = torch.get_default_dtype()
    places = {"cpu": MODULE_BYTES_PER_LAYER * (config.encoder_layers + config.decoder_layers)}
    if device is not None and device.type != "meta":
        place = "cpu" if device.type == "cpu" else str(device)
        places[place] = places.get(place, 0) + count * dtype.itemsize
    largest = max(parts, key=parts.get)
    for place, needed in places.items():
        check_fits(
            needed,
            f"{what} ({count:,} parameters in {str(dtype).removeprefix('torch.')}, and its modules for "
            f"{config.encoder_layers + config.decoder_layers:,} layers)",
            f"make the model smaller: its largest part is the {largest} ({parts[largest]:,} parameters: "
            f"{_part_settings(config, largest)})",
            place,
        )


def decoding_memory(
    config: DeepNMTConfig, rows: int, source_tokens: int, cached_tokens: int, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes `generate()` allocates at least for `rows` hypotheses (sentences x beams) of `source_tokens` source
    tokens with `cached_tokens` target positions in the self-attention cache: the expanded encoder output, the
    cross-attention keys and values of every decoder layer (and MSC's context keys and values where the decoder
    attends them), the self-attention keys and values (multi-head self-attention only: the averaging sublayers keep
    one running sum), all in `dtype`; and the scores over the target vocabulary, in float32 (logits, log-probabilities
    and processed scores); plus what one decoding step of the newer methods holds at once (`_step_states`). A lower
    bound, for refusing a decoding that cannot fit before it starts."""
    d, layers = config.d_model, config.decoder_layers
    cross = 2 * d * (2 if msc_attends_context(config, "decoder") else 1)
    own = 2 * d if config.decoder_self_attention == "multi_head" else 0
    states = rows * (source_tokens * d + layers * (cross * source_tokens + own * cached_tokens) + _step_states(config))
    return states * dtype.itemsize + 4 * 3 * rows * config.decoder_vocab_size


def _step_states(config: DeepNMTConfig) -> int:
    """Values per hypothesis that one decoding step of the decoder holds at once beyond a plain stack's: Attention
    Residuals' stored values (the embedding and one per completed block, all kept until the stack output attends
    them), and the n residual streams of Hyper-Connections with their mix (2n vectors)."""
    d, layers = config.d_model, config.decoder_layers
    values = 0
    if config.decoder_layer_aggregation in ATTENTION_RESIDUAL_AGGREGATIONS:
        blocks = layers if config.decoder_layer_aggregation == "attnres" else len(config.decoder_block_boundaries) - 1
        values += (blocks + 1) * d
    if config.decoder_hyper_connections:
        values += 2 * config.decoder_hyper_connections * d
    return values


# ---- a config against the shapes of its weights ---------------------------------------------------------------------


class _ShapeFindings:
    """Where the tensors of a weights file (`shapes`, by name; those of a translation model read without their
    `model.` prefix) show sizes other than a config's, one line each, in the order they are looked for."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        body = {name.removeprefix("model."): shape for name, shape in shapes.items() if name.startswith("model.")}
        self.body = body or dict(shapes)
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)

    def compare(self, name: str, expected: tuple[int, ...], settings: str) -> None:
        """A line when the file holds `name` with another shape than the `expected` one `settings` make."""
        held = self.body.get(name)
        if held is not None and tuple(held) != expected:
            self.add(f"{settings} make {name} {expected}, but the file's is {tuple(held)}")


def _embedding_findings(config: DeepNMTConfig, found: _ShapeFindings) -> None:
    d = config.d_model
    found.compare("shared.weight", (config.vocab_size, d), f"vocab_size={config.vocab_size}, d_model={d}")
    if not config.share_embeddings:
        vocab = config.decoder_vocab_size
        found.compare("decoder.embed_tokens.weight", (vocab, d), f"decoder_vocab_size={vocab}, d_model={d}")


def _layer_findings(config: DeepNMTConfig, side: str, found: _ShapeFindings) -> bool:
    """The layer count and FFN width of stack `side`; whether the file holds any of its layers."""
    layers, prefix = getattr(config, f"{side}_layers"), f"{side}.layers."
    indices = {name[len(prefix) :].split(".", 1)[0] for name in found.body if name.startswith(prefix)}
    held = max((int(index) + 1 for index in indices if index.isdigit()), default=0)
    if held != layers:
        found.add(f"{side}_layers={layers}, but the file holds {held:,} {side} layers")
    ffn = getattr(config, f"{side}_ffn_dim")
    found.compare(f"{prefix}0.fc1.weight", (ffn, config.d_model), f"{side}_ffn_dim={ffn}, d_model={config.d_model}")
    return bool(indices)


def _relative_key_findings(config: DeepNMTConfig, side: str, found: _ShapeFindings, has_layers: bool) -> None:
    window = config.relative_position_window
    name = f"{side}.layers.0.self_attn.relative_keys"
    takes = side == "encoder" or config.decoder_self_attention == "multi_head"
    held = found.body.get(name)
    if window and takes:
        expected = (2 * window + 1, config.d_model // getattr(config, f"{side}_attention_heads"))
        if held is None and has_layers:
            found.add(f"relative_position_window={window} gives {name} {expected}, but the file has none")
        else:
            found.compare(name, expected, f"relative_position_window={window}")
    elif held is not None:
        found.add(f"relative_position_window={window}, but the file holds {name} {tuple(held)}")


def _history_findings(config: DeepNMTConfig, side: str, found: _ShapeFindings) -> None:
    """The layer history of stack `side`: Attention Residuals' pseudo-queries, or the (B+1) x (B+1) weights."""
    layers, aggregation = getattr(config, f"{side}_layers"), getattr(config, f"{side}_layer_aggregation")
    name, held = f"{side}.history.weight", found.body.get(f"{side}.history.weight")
    setting = f"{side}_layer_aggregation={aggregation!r}"
    queries = found.body.get(f"{side}.history.queries")
    if aggregation in ATTENTION_RESIDUAL_AGGREGATIONS:
        expected = (layers + 1, config.d_model)
        if queries is None:
            found.add(
                f"{setting} has pseudo-queries {side}.history.queries {expected}, but the file has none (its "
                "model has no Attention Residuals)"
            )
        else:
            found.compare(
                f"{side}.history.queries", expected, f"{setting}, {side}_layers={layers}, d_model={config.d_model}"
            )
    elif queries is not None:
        found.add(f"{setting} has no Attention Residuals, but the file holds {side}.history.queries {tuple(queries)}")
    elif aggregation != "residual":
        size = layers + 1 if aggregation == "dlcl" else len(getattr(config, f"{side}_block_boundaries"))
        if held is None:
            found.add(
                f"{setting} has layer-history weights {name} {(size, size)}, but the file has none (its model "
                "has no layer history: a residual stack)"
            )
        else:
            found.compare(name, (size, size), setting)
    elif held is not None:
        found.add(f"{setting} has no layer-history weights, but the file holds {name} {tuple(held)}")


def _hyper_connection_findings(config: DeepNMTConfig, side: str, found: _ShapeFindings, has_layers: bool) -> None:
    """The static and dynamic alpha of the first layer's FFN block: the stream count and the variant."""
    streams, dynamic = getattr(config, f"{side}_hyper_connections"), config.hyper_connections_dynamic
    hyper = f"{side}.layers.0.final_layer_norm.hyper."
    for name, expected, setting in (
        (hyper + "static_alpha", (streams, streams + 1), f"{side}_hyper_connections={streams}"),
        (
            hyper + "dynamic_alpha",
            (config.d_model, streams + 1),
            f"{side}_hyper_connections={streams}, hyper_connections_dynamic={dynamic}",
        ),
    ):
        held = found.body.get(name)
        wanted = bool(streams) and (name.endswith("static_alpha") or dynamic)
        if wanted and held is None and has_layers:
            found.add(f"{setting} give {name} {expected}, but the file has none")
        elif wanted:
            found.compare(name, expected, setting)
        elif held is not None:
            found.add(f"{setting} give no {name}, but the file holds one {tuple(held)}")


def _shape_findings(config: DeepNMTConfig, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Where the tensors of a weights file (`shapes`, by name) show sizes other than `config`'s: the embeddings'
    width and vocabulary, then per stack the layer count, the FFN width, the relative-position tables, the layer
    history and the hyper-connections."""
    found = _ShapeFindings(shapes)
    _embedding_findings(config, found)
    for side in ("encoder", "decoder"):
        has_layers = _layer_findings(config, side, found)
        _relative_key_findings(config, side, found, has_layers)
        _history_findings(config, side, found)
        _hyper_connection_findings(config, side, found, has_layers)
    return found.lines


def check_config_matches_weights(config: DeepNMTConfig, files: list[str], source: str) -> None:
    """Before a model of `config` is built from `files` (safetensors, read from their headers alone): when the files
    hold another number of values than the config describes (`count_parameters`), `ValueError` naming each size the
    tensors' shapes show to differ from the config's (`_shape_findings`): a wider `d_model` or more layers would
    otherwise allocate the config's model before transformers compares shapes. The same sizes with a tensor more or
    fewer are left to `check_loaded_weights`, which names them after loading."""
    shapes, _ = saved_tensor_shapes(files)
    held = sum(math.prod(shape) for shape in shapes.values())
    expected = count_parameters(config, output_layer=any(name.startswith("model.") for name in shapes))
    if held == expected:
        return
    findings = _shape_findings(config, shapes)
    if not findings:
        return  # the same sizes, some tensors more or fewer: named after loading (`check_loaded_weights`)
    raise ValueError(
        f"The config of {source!r} does not belong to its weights ({', '.join(Path(file).name for file in files)}): "
        + "; ".join(findings)
        + f". The config describes a model of {expected:,} parameters, the weights hold {held:,}; restore the "
        "config.json saved with these weights."
    )


def check_before_building(config: DeepNMTConfig, output_layer: bool, what: str) -> None:
    """What a model of `config` is given, checked before it builds anything. Inside `from_pretrained` (`LOADING`):
    the config against the weight files' headers (`check_config_matches_weights`, skipped when the caller passed
    `ignore_mismatched_sizes=True`), then the memory where the weights go; else the memory of the default device
    (`check_model_fits`). Once per `from_pretrained` call: the encoder-decoder a translation model builds inside it is
    not checked again."""
    request = LOADING.get()
    if request is None:
        check_model_fits(config, output_layer, torch.get_default_device(), what)
        return
    if request.checked:
        return
    request.checked = True
    files = request.weight_files()
    if files and not request.ignore_mismatched_sizes:
        check_config_matches_weights(config, files, request.source)
    check_model_fits(config, output_layer, request.device, f"{what} from {request.source!r}")
