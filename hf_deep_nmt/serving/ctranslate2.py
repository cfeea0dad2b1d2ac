"""Export to CTranslate2 (a C++ inference engine): the models its Transformer specification expresses exactly.

What it expresses: pre- or post-norm stacks of residual layers (DeepNorm's as well, rescaled into plain post-norm
ones, see below), multi-head decoder self-attention, this package's
sinusoidal positions in either frequency setting (written into the model as a table, see below), scaled or unscaled
token embeddings, shared or separate source/target embeddings, a tied or separate output layer with or without a bias
(`output_bias`), and the ReLU/GELU/SiLU/tanh/sigmoid activations.
What it does not, refused by name before any work (`ctranslate2_blockers`): DLCL and sparse (SDT) layer histories,
Hyper-Connections, MAtt and the AAN, MSC, and relative position keys (CTranslate2 applies relative keys *instead of*
absolute positions in a stack, while these models add both; its asymmetric variant keeps the absolute ones but counts
distances from the first query during incremental decoding, so decoder self-attention would not match either).

Details that make the outputs match (`tests/test_ctranslate2.py` compares them):

* positions: this package's layout (sin in the first half, cos in the second) from position 0, where CTranslate2's
  built-in sinusoids start at position 1; the table is written for positions `0 .. max_positions - 1`, so a source,
  or a decoding, longer than that is refused by CTranslate2 ("No position encodings are defined for positions >= N");
* embeddings are multiplied by sqrt(d) (or 1), then the position added, in both stacks;
* the pre-norm stacks end with their final LayerNorm; post-norm stacks have none (each sublayer ends in one);
* self-attention Q, K, V are fused into one matrix, cross-attention K, V into another, as CTranslate2 stores them;
* DeepNorm, x <- LN(alpha * x + F(x)) with alpha per stack, becomes plain post-norm, x <- LN(x + F(x)): a LayerNorm
  ignores a positive factor of its input up to its epsilon, LN(c * y; eps * c^2) = LN(y; eps), and CTranslate2 has one
  epsilon for the whole model. With `a` the decoder's alpha, every block's output maps (attention `out_proj`, `fc2`,
  weights and biases) are divided by `a` and the epsilon written is eps / a^2: a decoder block then normalises
  `(alpha * x + F(x)) / a` with eps / a^2, exactly the model's LN. An encoder whose alpha `e` differs runs its residual
  stream scaled by r = e / a (its embeddings, position table and LayerNorm weights and biases times r, the matrices
  that read the stream, Q/K/V, `fc1` and the decoder's cross-attention K/V, divided by r), so that its blocks too
  normalise `(e * x + F(x)) / a`. Exact in real arithmetic; in float32 the logits agree to rounding
  (`tests/test_ctranslate2.py`);
* decoding starts from `decoder_start_token_id` (`<s>`), the source is given as the tokenizer encodes it (with its
  `</s>`; CTranslate2 adds nothing), and the vocabulary is the tokenizer's, id for id.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_deep_nmt import registration  # noqa: F401  (configs and models of this package load through the Auto classes)
from hf_deep_nmt.fingerprints import check_tokenizer_matches, tokenizer_fingerprint
from hf_deep_nmt.folders import EXPORT_FLAG, write_marked_folder
from hf_deep_nmt.memory import check_memory
from hf_deep_nmt.modeling.configuration_deep_nmt import DEFAULT_MAX_OUTPUT_TOKENS
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTSinusoidalPositions
from hf_deep_nmt.serving.ctranslate2_layout import (  # noqa: F401  (importable from here, as before they moved)
    ACTIVATIONS,
    CTRANSLATE2_SUBFOLDER,
    IDENTITY_FILE,
    SETTINGS,
    MissingCTranslate2Error,
    ctranslate2_blockers,
    require_ctranslate2,
)

# Rows of the position table: a source of up to this many tokens, and decoding of up to this many steps (the start
# token included), as `translate` allows (`DEFAULT_MAX_OUTPUT_TOKENS` tokens and `</s>`).
DEFAULT_MAX_POSITIONS = DEFAULT_MAX_OUTPUT_TOKENS + 2
# The smallest table that translates anything: a source of one token and its `</s>`, and decoding the start token
# then one token (one row only holds the start token, so no step could be taken).
MIN_MAX_POSITIONS = 2
SERVABLE = (
    "pre- or post-norm (DeepNorm included), residual layers in both stacks, multi-head decoder self-attention, no "
    "relative position keys, no MSC"
)


def quantization_choices() -> tuple[str, ...]:
    """The weight types CTranslate2 can store (its converters' `--quantization` values)."""
    from ctranslate2.specs.model_spec import ACCEPTED_MODEL_TYPES

    return tuple(ACCEPTED_MODEL_TYPES)


def check_ctranslate2_support(config) -> None:
    """`ValueError` naming every feature of `config` that CTranslate2 cannot express (see `ctranslate2_blockers`)."""
    blockers = ctranslate2_blockers(config)
    if blockers:
        raise ValueError(
            f"CTranslate2's Transformer cannot express this {config.model_type} model: {'; '.join(blockers)}. It "
            f"serves models with {SERVABLE}."
        )


def check_max_positions(config, max_positions: int) -> None:
    """`ValueError` for a `max_positions` that is not a positive integer, `InsufficientMemoryError` stating the
    estimate when its position table cannot be built here: `max_positions x d_model` float32 values, held about four
    times over while it is computed, copied into the specification and written. Checked before the model is loaded."""
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < MIN_MAX_POSITIONS:
        raise ValueError(
            f"`max_positions` must be an integer >= {MIN_MAX_POSITIONS} (a one-token source with its </s>, and the "
            f"start token plus one decoding step), got {max_positions!r}."
        )
    check_memory(
        4 * 4 * max_positions * int(config.d_model),
        f"The position table of --max-positions {max_positions} (x d_model {config.d_model}, float32)",
        f"lower --max-positions (`max_positions`; {DEFAULT_MAX_POSITIONS} covers what `translate` allows)",
    )


def _vocabulary(tokenizer: PreTrainedTokenizerBase, size: int) -> list[str]:
    """Token `i` of the tokenizer for every id `i < size`; ids the tokenizer does not have (embedding rows it never
    produces) get placeholder names no tokenizer token has."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(size, len(tokenizer)))))
    taken = set(tokens)
    for index in range(len(tokens), size):
        name = f"<hf-deep-nmt-unused-{index}>"
        while name in taken:
            name += "_"
        tokens.append(name)
    if len(set(tokens)) != len(tokens):
        raise ValueError("The tokenizer maps two ids to the same token string; CTranslate2 needs one id per token.")
    return tokens


def _token(tokens: list[str], token_id: int | list[int] | None, name: str) -> str:
    token_id = token_id[0] if isinstance(token_id, list) else token_id
    if token_id is None or not 0 <= token_id < len(tokens):
        raise ValueError(f"The model's `{name}` ({token_id!r}) is not an id of its vocabulary; set it in the config.")
    return tokens[token_id]


def deepnorm_scales(config) -> tuple[dict[str, float], float, float]:
    """How the export folds DeepNorm's skip weights into a plain post-norm model (module docstring): `(stream scale
    r of each stack, the factor on every block's output maps, the LayerNorm epsilon to write)`; `({encoder: 1,
    decoder: 1}, 1, layer_norm_eps)` without DeepNorm."""
    alphas = {side: config.deepnorm_constants(side)[0] for side in ("encoder", "decoder")}
    top = alphas["decoder"]
    streams = {side: alpha / top for side, alpha in alphas.items()}
    return streams, 1.0 / top, float(config.layer_norm_eps) / top**2


def build_ctranslate2_spec(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_positions: int):
    """The CTranslate2 `TransformerSpec` holding `model`'s weights, with its vocabularies and config."""
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    check_ctranslate2_support(config)
    check_tokenizer_matches(model, tokenizer)
    check_max_positions(config, max_positions)
    activation = getattr(common_spec.Activation, ACTIVATIONS[config.activation_function])
    spec = transformer_spec.TransformerSpec.from_config(
        (config.encoder_layers, config.decoder_layers),
        config.encoder_attention_heads,
        pre_norm=config.pre_norm,
        activation=activation,
    )
    if config.decoder_attention_heads != config.encoder_attention_heads:
        spec.decoder.num_heads = spec.decoder.num_heads.dtype.type(config.decoder_attention_heads)
    network = model.model
    with torch.no_grad():
        sinusoids = DeepNMTSinusoidalPositions(config.d_model, config.sinusoid_frequencies)
        positions = sinusoids(torch.arange(max_positions))
    scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
    streams, output_scale, epsilon = deepnorm_scales(config)
    for side, stack_spec, stack in (
        ("encoder", spec.encoder, network.encoder),
        ("decoder", spec.decoder, network.decoder),
    ):
        embeddings = stack_spec.embeddings[0] if isinstance(stack_spec.embeddings, list) else stack_spec.embeddings
        embeddings.weight = stack.embed_tokens.weight
        stack_spec.scale_embeddings = scale * streams[side]
        stack_spec.position_encodings.encodings = positions * streams[side]
        if config.pre_norm:
            _set_layer_norm(stack_spec.layer_norm, stack.layer_norm)
    encoder = Scales(streams["encoder"], output_scale)
    decoder = Scales(streams["decoder"], output_scale, memory=streams["encoder"])
    for layer_spec, layer in zip(spec.encoder.layer, network.encoder.layers):
        _set_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_layer_norm, True, encoder)
        _set_feed_forward(layer_spec.ffn, layer, encoder)
    for layer_spec, layer in zip(spec.decoder.layer, network.decoder.layers):
        _set_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_layer_norm, True, decoder)
        _set_attention(layer_spec.attention, layer.encoder_attn, layer.encoder_attn_layer_norm, False, decoder)
        _set_feed_forward(layer_spec.ffn, layer, decoder)
    spec.decoder.projection.weight = model.get_output_embeddings().weight
    if model.get_output_embeddings().bias is not None:  # `output_bias` (a converted Marian model's logits bias)
        spec.decoder.projection.bias = model.get_output_embeddings().bias

    tokens = _vocabulary(tokenizer, max(config.vocab_size, config.decoder_vocab_size))
    spec.register_source_vocabulary(tokens[: config.vocab_size])
    spec.register_target_vocabulary(tokens[: config.decoder_vocab_size])
    target = tokens[: config.decoder_vocab_size]
    spec.config.bos_token = _token(target, config.bos_token_id, "bos_token_id")
    spec.config.eos_token = _token(target, config.eos_token_id, "eos_token_id")
    spec.config.decoder_start_token = _token(target, config.decoder_start_token_id, "decoder_start_token_id")
    unk = tokenizer.unk_token
    if unk is None or unk not in target:
        raise ValueError(
            f"The tokenizer's unknown token ({unk!r}) is not in the target vocabulary; CTranslate2 needs one."
        )
    spec.config.unk_token = unk
    spec.config.add_source_bos = spec.config.add_source_eos = False
    spec.config.layer_norm_epsilon = epsilon
    return spec


class Scales(NamedTuple):
    """The factors a stack's weights are written with (all 1 but for DeepNorm, see `deepnorm_scales`): `stream`, the
    scale of the stack's residual stream (its LayerNorms' outputs are multiplied by it, the matrices reading it
    divided), `output` on each block's output maps, and `memory`, the stream scale of the encoder output that
    cross-attention reads."""

    stream: float
    output: float
    memory: float = 1.0


def _set_layer_norm(spec, module: torch.nn.LayerNorm, scale: float = 1.0) -> None:
    spec.gamma = module.weight * scale if scale != 1.0 else module.weight
    spec.beta = module.bias * scale if scale != 1.0 else module.bias


def _set_linear(spec, *modules: torch.nn.Linear, reads: float = 1.0, output: float = 1.0) -> None:
    """One CTranslate2 linear layer from one or more of ours stacked along the output dimension (fused Q/K/V), for
    an input `reads` times ours (the weight divided by it) and an output `output` times ours (weight and bias times
    it)."""
    weight = torch.cat([module.weight for module in modules])
    spec.weight = weight * (output / reads) if (output, reads) != (1.0, 1.0) else weight
    if modules[0].bias is not None:
        bias = torch.cat([module.bias for module in modules])
        spec.bias = bias * output if output != 1.0 else bias


def _set_attention(spec, attention, layer_norm: torch.nn.LayerNorm, self_attention: bool, scales: Scales) -> None:
    _set_layer_norm(spec.layer_norm, layer_norm, scales.stream)
    if self_attention:
        _set_linear(spec.linear[0], attention.q_proj, attention.k_proj, attention.v_proj, reads=scales.stream)
    else:
        _set_linear(spec.linear[0], attention.q_proj, reads=scales.stream)
        _set_linear(spec.linear[1], attention.k_proj, attention.v_proj, reads=scales.memory)
    _set_linear(spec.linear[-1], attention.out_proj, output=scales.output)


def _set_feed_forward(spec, layer, scales: Scales) -> None:
    _set_layer_norm(spec.layer_norm, layer.final_layer_norm, scales.stream)
    _set_linear(spec.linear_0, layer.fc1, reads=scales.stream)
    _set_linear(spec.linear_1, layer.fc2, output=scales.output)


def model_identity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_positions: int) -> dict[str, Any]:
    """What `IDENTITY_FILE` records: the fingerprint of the tokenizer written with the export, and the model's
    vocabulary size and special ids (the config fields `check_tokenizer_matches` compares a tokenizer with), and the
    rows of the position table (which bound the source and output lengths the decoder accepts)."""
    config = model.config
    names = ("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id", "decoder_start_token_id", "model_type")
    fields = {name: getattr(config, name) for name in names}
    return {"tokenizer_fingerprint": tokenizer_fingerprint(tokenizer), **fields, "max_positions": max_positions}


def export_ctranslate2(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: str | Path,
    *,
    quantization: str | None = None,
    max_positions: int = DEFAULT_MAX_POSITIONS,
    overwrite: bool = False,
    flag: str = EXPORT_FLAG,
    protected: dict[str, Any] | None = None,
) -> Path:
    """Write `model` as a CTranslate2 model (`model.bin`, `config.json`, the vocabulary) and `tokenizer` into
    `folder`, for `ctranslate2.Translator(folder)`, with the model's generation config and `IDENTITY_FILE`, which
    `CTranslate2Decoder` (`hf-deep-nmt translate --backend ctranslate2`) decodes and checks tokenizers with.

    Refuses, before any work, a model CTranslate2 cannot express (`ValueError` naming each feature), a `quantization`
    CTranslate2 does not know, and a `folder` that is not empty unless `overwrite`, even then when it holds files
    that no export of this package wrote (see `hub.check_export_folder`). The folder is written beside its place and
    swapped in at the end. `max_positions` rows of the position table bound the source and decoding lengths; a table
    that cannot fit the memory here is refused with its estimate before anything is built (`check_max_positions`)."""
    check_max_positions(model.config, max_positions)
    ctranslate2 = require_ctranslate2()
    check_ctranslate2_support(model.config)
    if quantization is not None and quantization not in quantization_choices():
        raise ValueError(f"`quantization` must be one of {quantization_choices()}, got {quantization!r}.")
    spec = build_ctranslate2_spec(model, tokenizer, max_positions)

    class Converter(ctranslate2.converters.Converter):
        def _load(self):
            return spec

    def write(staging: Path) -> None:
        Converter().convert(str(staging), quantization=quantization, force=True)
        tokenizer.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)  # the decoding defaults `translate` starts from
        (staging / IDENTITY_FILE).write_text(
            json.dumps(model_identity(model, tokenizer, max_positions), indent=2) + "\n"
        )

    return write_marked_folder(folder, write, overwrite=overwrite, flag=flag, protected=protected)
