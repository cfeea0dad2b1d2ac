"""Configuration of the deep Transformer translation backbone and its named paper presets.

This file ships verbatim inside every Hub repository of the package: it imports only the standard library and
transformers.

A config is built in two steps. `_resolve` fills the derived values (the target vocabulary, per-stack aggregations,
MSC's encoder depth, sparse block boundaries, the decoder cache-layer types); `_validate` then checks, without
changing anything, the kind of every field (`FIELD_KINDS`), the settings that only mean something with another one
(`DEPENDS_ON`) and the relations between fields (`STRUCTURAL_RULES`), each failure a `ValueError` naming the field,
its value and what would be valid. Settings that have no effect but cannot be errors, because folders saved by
earlier versions may hold them, are warned about: unknown keys, a `layer_aggregation` that neither stack uses, a
hand-set `decoder_layer_types`. The MSC keys of version 0.1.0 are read, silently, into the fields that replaced them
(`EARLIER_MSC_KEYS`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable

from transformers import GenerationConfig, PreTrainedConfig
from transformers.activations import ACT2CLS
from transformers.utils import logging

logger = logging.get_logger(__name__)

LAYER_AGGREGATIONS = ("residual", "dlcl", "sparse", "attnres", "block_attnres")
# Aggregations cut into blocks by `{side}_block_boundaries` (SDT's sparse connections, Block Attention Residuals).
BLOCK_AGGREGATIONS = ("sparse", "block_attnres")
DLCL_WEIGHTS = ("learned", "average", "one")
# Initial DLCL weights (learned ones): the uniform average of the stored outputs, or DenseFormer's identity (weight 1
# on the newest stored output, 0 elsewhere), under which the stack starts as the plain residual one.
DLCL_INITS = ("uniform", "identity")
INIT_SCHEMES = ("default", "ds_init")
DS_INIT_MODES = ("paper", "code")
DECODER_SELF_ATTENTIONS = ("multi_head", "merged_average", "average")
# Cache-layer type of every decoder layer: one design whose slots hold keys/values, MAtt/AAN running sums and MSC
# context keys/values (dynamic and static classes in the modeling file).
CACHE_LAYER_TYPE = "deep_nmt"
# What version 0.1.0 saved in `decoder_layer_types` (running-sum and MSC decoders), replaced silently on loading.
EARLIER_CACHE_LAYER_TYPES = ("deep_nmt_average", "deep_nmt_msc")
# MSC's context: a GRU cell shared by the blocks or one per block, the feed-forward ablation cell likewise, the
# normalised block output itself (no cell), or no context at all (and so no context attention).
MSC_CONTEXTS = ("gru", "gru_per_block", "ffn", "ffn_per_block", "block_output", "none")
MSC_CONTEXT_SIDES = ("encoder_and_decoder", "encoder")
MSC_FUSIONS = ("gate", "add")
# Frequencies of the sinusoidal positions (sin in the first half of the vector, cos in the second, both layouts):
# fairseq's 10000^(-i / (d/2 - 1)) for pair i, or 10000^(-2i / d) as Marian and transformers' MarianMTModel compute it.
SINUSOID_FREQUENCIES = ("fairseq", "marian")
# Settings new in 0.2.0 (not yet released) that 0.1.0 did not have: `to_dict` (and so `config.json`) holds them only
# when they differ from their defaults, so a model that does not use them gets no key for them: as far as these
# settings go, its config is what 0.1.0 wrote, and the 0.1.0 model code published on the Hub still loads it.
LATER_SETTINGS = (
    "sinusoid_frequencies",
    "output_bias",
    "converted_from",
    "growth",
    "deepnorm",
    "tokenizer_fingerprint",
    "encoder_post_norm_layers",
    "decoder_post_norm_layers",
    "dlcl_init",
    "hyper_connections",
    "encoder_hyper_connections",
    "decoder_hyper_connections",
    "hyper_connections_dynamic",
    "hyper_connections_sinkhorn_iterations",
    "dlcl_dilation",
    "dlcl_period",
)
# Hyper-Connections' per-stack expansions, which `_resolve` derives from `hyper_connections`: `to_dict` leaves them out
# where they and `hyper_connections` are all 0 (loading derives 0 again).
_HYPER_CONNECTION_SIDES = ("encoder_hyper_connections", "decoder_hyper_connections")
ACTIVATIONS = tuple(sorted(ACT2CLS))
# Keys that transformers passes to a config besides its fields (from `config.json` or `from_pretrained`), read by
# `PreTrainedConfig` itself: not unknown keys.
TRANSFORMERS_CONFIG_KEYS = frozenset(
    {
        "auto_map",
        "model_type",
        "name_or_path",
        "_name_or_path",
        "_commit_hash",
        "torch_dtype",
        "num_labels",
        "output_attentions",
        "attn_implementation",
        "experts_implementation",
        "per_layer_config",
        "_attn_implementation_internal",
        "_experts_implementation_internal",
    }
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Upper bounds of the newer methods' settings, far above what their papers use (Hyper-Connections: 2 to 8 streams;
# mHC: 4 streams, 20 Sinkhorn-Knopp iterations), below what makes a model that cannot train: each stream is a copy of
# the stack's activations, and each iteration runs in every sublayer at every step (the iteration converges
# geometrically, so more than a hundred change nothing a float32 shows).
MAX_HYPER_CONNECTION_STREAMS = 64
MAX_SINKHORN_ITERATIONS = 100


def _model_types(config_class: type) -> set[str]:
    """The model types of `config_class` and of every config class derived from it (the named configs)."""
    types = {config_class.model_type}
    for derived in config_class.__subclasses__():
        types |= _model_types(derived)
    return types


def _is_dtype_name(value: object) -> bool:
    import torch

    return isinstance(value, str) and isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype)


def _shown_list(value: object, most: int = 6) -> str:
    """`value` for a message, a long list as its first entries and its length (a million layers' list would make a
    line of megabytes)."""
    if isinstance(value, list) and len(value) > most:
        return f"[{', '.join(repr(item) for item in value[:3])}, ...] ({len(value):,} entries)"
    return repr(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class FieldKind:
    """What a field accepts: `accepts(value)`, and `description` for the error (`must be <description>`)."""

    description: str
    accepts: Callable[[object], bool]


def _choice(choices: tuple) -> FieldKind:
    return FieldKind(f"one of {choices}", lambda value: value in choices)


POSITIVE_INT = FieldKind("a positive integer", lambda value: _is_int(value) and value >= 1)
PROBABILITY = FieldKind("a number in [0, 1)", lambda value: _is_number(value) and 0.0 <= value < 1.0)
BOOL = FieldKind("True or False", lambda value: isinstance(value, bool))
MSC_BLOCKS = FieldKind(
    "a positive integer (layers per encoder block) or a non-empty list of positive integers (one per block)",
    lambda value: (
        value is None
        or POSITIVE_INT.accepts(value)
        or (isinstance(value, list) and bool(value) and all(POSITIVE_INT.accepts(size) for size in value))
    ),
)

# What each field accepts, in the order the fields are checked: `msc_block_layers` before the sizes, since
# `encoder_layers` is derived from it. The special ids are checked against the vocabularies (`STRUCTURAL_RULES`).
FIELD_KINDS: dict[str, FieldKind] = {
    "decoder_layers": POSITIVE_INT,
    "msc_block_layers": MSC_BLOCKS,
    **dict.fromkeys(
        (
            "vocab_size",
            "decoder_vocab_size",
            "d_model",
            "encoder_layers",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "sparse_block_size",
        ),
        POSITIVE_INT,
    ),
    **dict.fromkeys(("dropout", "attention_dropout", "activation_dropout"), PROBABILITY),
    "relative_position_window": FieldKind(
        "a non-negative integer (0 = off)", lambda value: _is_int(value) and value >= 0
    ),
    **dict.fromkeys(
        (
            "scale_embedding",
            "output_bias",
            "share_embeddings",
            "tie_word_embeddings",
            "pre_norm",
            "dlcl_history_norm",
            "aan_ffn",
            "sdpa_avoid_cudnn",
            "deepnorm",
        ),
        BOOL,
    ),
    "msc_context": _choice(MSC_CONTEXTS),
    "msc_context_sides": _choice(MSC_CONTEXT_SIDES),
    "msc_fusion": _choice(MSC_FUSIONS),
    "encoder_l2_lambda": FieldKind(
        "a finite number >= 0 (0 = off)", lambda value: _is_number(value) and 0.0 <= value < math.inf
    ),
    "activation_function": _choice(ACTIVATIONS),
    "sinusoid_frequencies": _choice(SINUSOID_FREQUENCIES),
    # the global aggregation before the per-stack ones, which default to it
    "layer_aggregation": _choice(LAYER_AGGREGATIONS),
    "encoder_layer_aggregation": _choice(LAYER_AGGREGATIONS),
    "decoder_layer_aggregation": _choice(LAYER_AGGREGATIONS),
    "dlcl_weights": _choice(DLCL_WEIGHTS),
    "dlcl_init": _choice(DLCL_INITS),
    # the global expansion before the per-stack ones, which default to it
    **dict.fromkeys(
        ("hyper_connections", *_HYPER_CONNECTION_SIDES),
        FieldKind(
            f"0 (off) or an integer >= 2 and <= {MAX_HYPER_CONNECTION_STREAMS} (the number of residual streams; one "
            "stream is the plain residual, and each stream holds a copy of the stack's activations)",
            lambda value: _is_int(value) and (value == 0 or 2 <= value <= MAX_HYPER_CONNECTION_STREAMS),
        ),
    ),
    "hyper_connections_dynamic": BOOL,
    "hyper_connections_sinkhorn_iterations": FieldKind(
        f"a non-negative integer <= {MAX_SINKHORN_ITERATIONS} (0 = plain Hyper-Connections, > 0 = mHC's "
        "Sinkhorn-Knopp iterations, each run in every sublayer at every step, and held for the backward pass)",
        lambda value: _is_int(value) and 0 <= value <= MAX_SINKHORN_ITERATIONS,
    ),
    **dict.fromkeys(("dlcl_dilation", "dlcl_period"), POSITIVE_INT),
    **dict.fromkeys(
        ("encoder_post_norm_layers", "decoder_post_norm_layers"),
        FieldKind("a non-negative integer (0 = off)", lambda value: _is_int(value) and value >= 0),
    ),
    "init_scheme": _choice(INIT_SCHEMES),
    "ds_init_mode": _choice(DS_INIT_MODES),
    "decoder_self_attention": _choice(DECODER_SELF_ATTENTIONS),
    "ds_init_alpha": FieldKind("a number in (0, 1]", lambda value: _is_number(value) and 0.0 < value <= 1.0),
    "layer_norm_eps": FieldKind("a positive number", lambda value: _is_number(value) and value > 0),
    "converted_from": FieldKind("a mapping or None", lambda value: value is None or isinstance(value, dict)),
    "tokenizer_fingerprint": FieldKind(
        "a string (hex SHA-256) or None", lambda value: value is None or isinstance(value, str)
    ),
    "growth": FieldKind(
        "a list of mappings or None",
        lambda value: value is None or (isinstance(value, list) and all(isinstance(step, dict) for step in value)),
    ),
}


@dataclasses.dataclass(frozen=True)
class DependsOn:
    """`fields` only mean something when `holds(config)`: set to anything but their defaults otherwise, they are an
    error reading "<fields with their values> <requirement>, got <the values of `shown`>"."""

    fields: tuple[str, ...]
    requirement: str
    holds: Callable[[DeepNMTConfig], bool]
    shown: tuple[str, ...]


MSC_SWITCHES = ("msc_context", "msc_context_sides", "msc_fusion")
DEPENDS_ON = (
    DependsOn(
        ("ds_init_alpha", "ds_init_mode"),
        "only apply with `init_scheme='ds_init'`",
        lambda config: config.init_scheme == "ds_init",
        ("init_scheme",),
    ),
    DependsOn(
        ("aan_ffn",),
        "needs `decoder_self_attention='average'` (the gated AAN)",
        lambda config: config.decoder_self_attention == "average",
        ("decoder_self_attention",),
    ),
    DependsOn(
        ("encoder_block_boundaries",),
        "only applies with `encoder_layer_aggregation='sparse'` or 'block_attnres'",
        lambda config: config.encoder_layer_aggregation in BLOCK_AGGREGATIONS,
        ("encoder_layer_aggregation",),
    ),
    DependsOn(
        ("decoder_block_boundaries",),
        "only applies with `decoder_layer_aggregation='sparse'` or 'block_attnres'",
        lambda config: config.decoder_layer_aggregation in BLOCK_AGGREGATIONS,
        ("decoder_layer_aggregation",),
    ),
    DependsOn(
        ("dlcl_weights", "dlcl_history_norm", "dlcl_init", "dlcl_dilation", "dlcl_period"),
        "only apply to DLCL: set `layer_aggregation` (or `encoder_layer_aggregation` / `decoder_layer_aggregation`) "
        "to 'dlcl' or 'sparse'",
        lambda config: bool({"dlcl", "sparse"} & {config.encoder_layer_aggregation, config.decoder_layer_aggregation}),
        ("encoder_layer_aggregation", "decoder_layer_aggregation"),
    ),
    DependsOn(
        ("dlcl_dilation", "dlcl_period"),
        "are DenseFormer's variants of its average without LayerNorms (a history LayerNorm whose output no row "
        "reads would get no gradient): they need `dlcl_history_norm=False`",
        lambda config: not config.dlcl_history_norm,
        ("dlcl_history_norm",),
    ),
    DependsOn(
        ("dlcl_init",),
        "needs learned DLCL weights (`dlcl_weights='learned'`): the constant ablations have their own values",
        lambda config: config.dlcl_weights == "learned",
        ("dlcl_weights",),
    ),
    DependsOn(
        ("encoder_post_norm_layers", "decoder_post_norm_layers"),
        "set Mix-LN's post-norm layers below the pre-norm ones of a pre-norm model: they need `pre_norm=True` "
        "(DeepNorm, post-norm throughout, needs `pre_norm=False` and so excludes them)",
        lambda config: config.pre_norm,
        ("pre_norm",),
    ),
    DependsOn(
        ("hyper_connections_dynamic", "hyper_connections_sinkhorn_iterations"),
        "only apply to Hyper-Connections: set `hyper_connections` (or `encoder_hyper_connections` / "
        "`decoder_hyper_connections`) to the number of residual streams, >= 2",
        lambda config: bool(config.encoder_hyper_connections or config.decoder_hyper_connections),
        _HYPER_CONNECTION_SIDES,
    ),
    DependsOn(
        MSC_SWITCHES,
        "only apply to MSC: set `msc_block_layers` (layers per encoder block)",
        lambda config: config.msc_block_layers is not None,
        ("msc_block_layers",),
    ),
    DependsOn(
        MSC_SWITCHES[1:],
        "configure the attention to the MSC context, which needs a context (`msc_context` other than 'none')",
        lambda config: config.msc_context != "none",
        ("msc_context",),
    ),
)


# ---- structural rules: each returns what is wrong, or None ----------------------------------------------------------


def _msc_blocks_pair_with_decoder_layers(config: DeepNMTConfig) -> str | None:
    blocks = config.msc_block_layers
    if isinstance(blocks, list) and len(blocks) != config.decoder_layers:
        return (
            f"MSC pairs decoder layer n with encoder block n: `decoder_layers` ({config.decoder_layers}) must "
            f"equal the number of encoder blocks in `msc_block_layers` ({len(blocks)}: {blocks!r})."
        )
    return None


def _encoder_layers_fill_the_msc_blocks(config: DeepNMTConfig) -> str | None:
    blocks = config.msc_blocks
    if blocks is not None and config.encoder_layers != sum(blocks):
        return (
            f"`encoder_layers` ({config.encoder_layers!r}) must equal the total of the MSC encoder blocks, "
            f"{blocks} = {sum(blocks)}; leave `encoder_layers` unset to derive it."
        )
    return None


def _msc_encoder_is_residual(config: DeepNMTConfig) -> str | None:
    if config.msc_block_layers is not None and config.encoder_layer_aggregation != "residual":
        return (
            "MSC encoder blocks are residual stacks read block by block; `encoder_layer_aggregation` must be "
            f"'residual' with `msc_block_layers`, got {config.encoder_layer_aggregation!r}."
        )
    return None


def _msc_decoder_is_not_merged(config: DeepNMTConfig) -> str | None:
    if config.msc_block_layers is not None and config.decoder_self_attention == "merged_average":
        return (
            "MSC decoder layers fuse two cross-attentions (encoder block n and context n), which merged "
            "attention cannot take: `decoder_self_attention` must be 'multi_head' or 'average' with "
            "`msc_block_layers`, got 'merged_average'."
        )
    return None


def _heads_divide_the_width(config: DeepNMTConfig) -> str | None:
    for side in ("encoder", "decoder"):
        heads = getattr(config, f"{side}_attention_heads")
        if config.d_model % heads:
            return f"`d_model` ({config.d_model}) must be divisible by `{side}_attention_heads`, got {heads}."
    return None


def _shared_embeddings_have_one_vocabulary(config: DeepNMTConfig) -> str | None:
    if config.share_embeddings and config.decoder_vocab_size != config.vocab_size:
        return (
            f"`decoder_vocab_size` ({config.decoder_vocab_size}) must equal `vocab_size` ({config.vocab_size}) when "
            "`share_embeddings=True`; set `share_embeddings=False` for separate vocabularies."
        )
    return None


def _block_boundaries_cut_their_stack(config: DeepNMTConfig) -> str | None:
    for side in ("encoder", "decoder"):
        if getattr(config, f"{side}_layer_aggregation") not in BLOCK_AGGREGATIONS:
            continue
        field, layers = f"{side}_block_boundaries", getattr(config, f"{side}_layers")
        boundaries = getattr(config, field)
        valid = (
            isinstance(boundaries, list)
            and all(_is_int(b) for b in boundaries)
            and len(boundaries) >= 2
            and boundaries[0] == 0
            and boundaries[-1] == layers
            and all(a < b for a, b in zip(boundaries, boundaries[1:]))
        )
        if not valid:
            return (
                f"`{field}` must be strictly increasing integers from 0 to `{side}_layers` ({layers}), e.g. "
                f"[0, 6, 12, ..., {layers}], got {boundaries!r}."
            )
    return None


def _marian_sinusoids_have_an_even_width(config: DeepNMTConfig) -> str | None:
    if config.sinusoid_frequencies == "marian" and config.d_model % 2:
        return (
            f"`sinusoid_frequencies='marian'` needs an even `d_model` (sin and cos halves of equal width), got "
            f"{config.d_model}."
        )
    return None


def _token_ids_are_in_their_vocabulary(config: DeepNMTConfig) -> str | None:
    # pad/bos/eos are used on both sides; decoding starts in the target vocabulary.
    shared_ids = min(config.vocab_size, config.decoder_vocab_size)
    for field, limit in (
        ("pad_token_id", shared_ids),
        ("bos_token_id", shared_ids),
        ("eos_token_id", shared_ids),
        ("decoder_start_token_id", config.decoder_vocab_size),
    ):
        value = getattr(config, field)
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and not (_is_int(token_id) and 0 <= token_id < limit):
                return f"`{field}` must be an id in [0, {limit}), got {value!r}."
    return None


def _deepnorm_is_post_norm_with_its_own_init(config: DeepNMTConfig) -> str | None:
    if not config.deepnorm:
        return None
    if config.pre_norm:
        return (
            "DeepNorm up-weights the skip of a post-norm residual, x <- LN(alpha * x + F(x)); `deepnorm=True` needs "
            "`pre_norm=False`, got `pre_norm=True`."
        )
    if config.init_scheme != "default":
        return (
            "DeepNorm brings its own initialisation (Xavier-normal with gain beta); `deepnorm=True` needs "
            f"`init_scheme='default'`, got {config.init_scheme!r}."
        )
    if config.msc_block_layers is not None:
        return (
            "DeepNorm's constants are derived for plain stacks of N encoder and M decoder layers; MSC's block-wise "
            f"cross-attention and context are outside that analysis: `deepnorm=True` needs `msc_block_layers=None`, "
            f"got {config.msc_block_layers!r}."
        )
    return None


def _attention_residuals_have_pre_norm_layers(config: DeepNMTConfig) -> str | None:
    # Attention Residuals attend each layer's contribution `layer(x) - x`: the residual branch of a pre-norm layer.
    for side in ("encoder", "decoder"):
        aggregation = getattr(config, f"{side}_layer_aggregation")
        if aggregation not in ("attnres", "block_attnres"):
            continue
        field = f"{side}_layer_aggregation={aggregation!r}"
        if config.deepnorm:
            return (
                f"Attention Residuals attend the residual branches of pre-norm layers, and DeepNorm is post-norm: "
                f"`{field}` needs `deepnorm=False`, or a stack aggregation of 'residual', 'dlcl' or 'sparse'."
            )
        if not config.pre_norm:
            return (
                f"Attention Residuals attend the residual branches of pre-norm layers: `{field}` needs "
                "`pre_norm=True`, got `pre_norm=False` (post-norm stacks take 'residual', 'dlcl' or 'sparse')."
            )
        if getattr(config, f"{side}_post_norm_layers"):
            return (
                f"Attention Residuals attend the residual branches of pre-norm layers, and Mix-LN's first layers are "
                f"post-norm: `{field}` needs `{side}_post_norm_layers=0`, got "
                f"{getattr(config, f'{side}_post_norm_layers')!r}."
            )
        if side == "encoder" and config.msc_block_layers is not None:
            return (
                f"MSC encoder blocks are residual stacks read block by block: `{field}` needs "
                f"`msc_block_layers=None`, got {config.msc_block_layers!r} (MSC encoders take 'residual')."
            )
    return None


def _mix_ln_fits_its_stacks(config: DeepNMTConfig) -> str | None:
    for side in ("encoder", "decoder"):
        field = f"{side}_post_norm_layers"
        count, layers = getattr(config, field), getattr(config, f"{side}_layers")
        if count == 0:
            continue
        if count > layers:
            return f"`{field}` must be at most `{side}_layers` ({layers}), got {count}."
        aggregation = getattr(config, f"{side}_layer_aggregation")
        if aggregation != "residual":
            return (
                f"Mix-LN places the LayerNorm per layer of a plain residual stack; DLCL's history norms follow one "
                f"placement for the whole stack: `{field}` needs `{side}_layer_aggregation='residual'`, got "
                f"{aggregation!r}."
            )
        if side == "encoder" and config.msc_block_layers is not None:
            return (
                f"MSC's encoder blocks end in their own LayerNorms, outside Mix-LN's per-layer rule: `{field}` needs "
                f"`msc_block_layers=None`, got {config.msc_block_layers!r}."
            )
    return None


def _denseformer_variants_fit_their_stacks(config: DeepNMTConfig) -> str | None:
    # a dilation or period beyond the stored outputs of every DLCL/sparse stack holds out every weight but the first
    # row's: the stack is then a plain residual one with extra weights, which is never what was meant
    rows = [
        len(getattr(config, f"{side}_block_boundaries"))
        if getattr(config, f"{side}_layer_aggregation") == "sparse"
        else getattr(config, f"{side}_layers") + 1
        for side in ("encoder", "decoder")
        if getattr(config, f"{side}_layer_aggregation") in ("dlcl", "sparse")
    ]
    for field in ("dlcl_dilation", "dlcl_period"):
        value = getattr(config, field)
        if rows and value > 1 and value >= max(rows):
            return (
                f"`{field}` must be smaller than the number of stored outputs of its stacks ({max(rows)}: the "
                f"embedding and one per layer or block), got {value}."
            )
    return None


def _hyper_connections_fit_their_stacks(config: DeepNMTConfig) -> str | None:
    for side in ("encoder", "decoder"):
        field = f"{side}_hyper_connections"
        streams = getattr(config, field)
        if not streams:
            continue
        setting = f"`{field}={streams}`"
        if config.deepnorm or not config.pre_norm:
            what = "DeepNorm's post-norm layers" if config.deepnorm else "post-norm layers (`pre_norm=False`)"
            return (
                f"Hyper-Connections replace the residual of pre-norm sublayers, x + F(LN(x)); {setting} needs "
                f"`pre_norm=True`, got {what}."
            )
        mixed = getattr(config, f"{side}_post_norm_layers")
        if mixed:
            return (
                f"Hyper-Connections replace the residual of pre-norm sublayers, and Mix-LN's first layers are "
                f"post-norm: {setting} needs `{side}_post_norm_layers=0`, got {mixed}."
            )
        aggregation = getattr(config, f"{side}_layer_aggregation")
        if aggregation != "residual":
            return (
                f"Hyper-Connections carry {streams} residual streams through the stack, DLCL and sparse connections "
                f"combine single layer outputs: {setting} needs `{side}_layer_aggregation='residual'`, got "
                f"{aggregation!r}."
            )
        if config.msc_block_layers is not None:
            return (
                f"MSC hands each encoder block's single output to its decoder layer, which the {streams} residual "
                f"streams of Hyper-Connections do not make: {setting} needs `msc_block_layers=None`, got "
                f"{config.msc_block_layers!r}."
            )
    return None


STRUCTURAL_RULES = (
    _attention_residuals_have_pre_norm_layers,
    _mix_ln_fits_its_stacks,
    _deepnorm_is_post_norm_with_its_own_init,
    _msc_blocks_pair_with_decoder_layers,
    _encoder_layers_fill_the_msc_blocks,
    _msc_encoder_is_residual,
    _msc_decoder_is_not_merged,
    _heads_divide_the_width,
    _shared_embeddings_have_one_vocabulary,
    _marian_sinusoids_have_an_even_width,
    _block_boundaries_cut_their_stack,
    _token_ids_are_in_their_vocabulary,
    _hyper_connections_fit_their_stacks,
    _denseformer_variants_fit_their_stacks,
)


def unknown_config_keys(config_class: type, keys) -> dict[str, str | None]:
    """The keys that are neither fields nor aliases (`attribute_map`) of `config_class` nor the version 0.1.0 keys it
    reads (`EARLIER_MSC_KEYS`), each with the closest field name (None when nothing is close), in sorted order."""
    known = {item.name for item in dataclasses.fields(config_class)} | set(config_class.attribute_map)
    return {
        key: next(iter(difflib.get_close_matches(key, sorted(known), n=1)), None)
        for key in sorted(set(keys) - known - set(EARLIER_MSC_KEYS))
    }


def describe_unknown_keys(unknown: dict[str, str | None]) -> str:
    """`'dropuot' (did you mean 'dropout'?), 'foo'`"""
    return ", ".join(f"{key!r}" + (f" (did you mean {hint!r}?)" if hint else "") for key, hint in unknown.items())


def _settings(config: DeepNMTConfig, fields) -> str:
    return " / ".join(f"`{field}={getattr(config, field)!r}`" for field in fields)


# ---- the MSC switches of version 0.1.0 ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EarlierKey:
    """A key that version 0.1.0 saved and that is no field any more: its default and kind then, and the field that
    holds what it said now."""

    default: object
    kind: FieldKind
    field: str


# Version 0.1.0 set the MSC context with these keys, and wrote them into every config.json (MSC or not). They are read
# once, on construction, into `msc_context` and `msc_context_sides`, silently, and never written again.
EARLIER_MSC_KEYS = {
    "msc_context_attention": EarlierKey(True, BOOL, "msc_context"),
    "msc_contextual_collaboration": EarlierKey(True, BOOL, "msc_context"),
    "msc_context_cell": EarlierKey("gru", _choice(("gru", "ffn")), "msc_context"),
    "msc_share_gru": EarlierKey(True, BOOL, "msc_context"),
    "msc_decoder_context": EarlierKey(True, BOOL, "msc_context_sides"),
}
# `msc_context` for each (msc_context_attention, msc_contextual_collaboration, msc_context_cell, msc_share_gru) that
# version 0.1.0 accepted, and `msc_context_sides` for each `msc_decoder_context`.
EARLIER_MSC_CONTEXTS = {
    (True, True, "gru", True): "gru",
    (True, True, "gru", False): "gru_per_block",
    (True, True, "ffn", True): "ffn",
    (True, True, "ffn", False): "ffn_per_block",
    (True, False, "gru", True): "block_output",
    (False, True, "gru", True): "none",
}
EARLIER_MSC_CONTEXT_SIDES = {True: "encoder_and_decoder", False: "encoder"}
# What version 0.1.0 refused besides bad values and the keys without `msc_block_layers`: (a key, the value of it that
# removes what the listed settings configure, those settings, which had to keep their defaults, and what to set now).
EARLIER_MSC_REFUSALS = (
    (
        "msc_context_attention",
        False,
        ("msc_contextual_collaboration", "msc_context_cell", "msc_share_gru", "msc_decoder_context", "msc_fusion"),
        "`msc_context='none'` (no context), with `msc_context_sides` and `msc_fusion` at their defaults",
    ),
    (
        "msc_contextual_collaboration",
        False,
        ("msc_context_cell", "msc_share_gru"),
        "`msc_context='block_output'` (the block output is the context: there is no cell to choose or share)",
    ),
)


def _listed(settings: dict) -> str:
    return " / ".join(f"`{key}={value!r}`" for key, value in settings.items())


def earlier_msc_settings(given: dict, msc_fusion: object, msc_block_layers: object) -> dict[str, str]:
    """The fields that the version 0.1.0 keys in `given` stand for (`msc_context` when one of the context's four keys
    is given, `msc_context_sides` when `msc_decoder_context` is), keys left out at their 0.1.0 defaults. Raises
    `ValueError` for what version 0.1.0 refused, naming the keys with their values and what to set now."""
    for key, value in given.items():
        earlier = EARLIER_MSC_KEYS[key]
        if not earlier.kind.accepts(value):
            raise ValueError(
                f"`{key}` must be {earlier.kind.description}, got {value!r} (a key of version 0.1.0, now "
                f"`{earlier.field}`, which must be {FIELD_KINDS[earlier.field].description})."
            )
    defaults = {key: earlier.default for key, earlier in EARLIER_MSC_KEYS.items()}
    defaults["msc_fusion"] = DeepNMTConfig.__dataclass_fields__["msc_fusion"].default
    settings = {**defaults, **given, "msc_fusion": msc_fusion}
    for key, value, removed, instead in EARLIER_MSC_REFUSALS:
        unused = {other: settings[other] for other in removed if settings[other] != defaults[other]}
        if settings[key] == value and unused:
            raise ValueError(
                f"{_listed({key: value, **unused})}: `{key}={value!r}` removes what the others configure (version "
                f"0.1.0 refused these together). The context is now set with `msc_context`: use {instead}."
            )
    context_keys = [key for key, earlier in EARLIER_MSC_KEYS.items() if earlier.field == "msc_context"]
    mapped = {}
    if given.keys() & set(context_keys):
        mapped["msc_context"] = EARLIER_MSC_CONTEXTS[tuple(settings[key] for key in context_keys)]
    if "msc_decoder_context" in given:
        mapped["msc_context_sides"] = EARLIER_MSC_CONTEXT_SIDES[settings["msc_decoder_context"]]
    changed = {key: value for key, value in given.items() if value != defaults[key]}
    if changed and msc_block_layers is None:
        now = {EARLIER_MSC_KEYS[key].field for key in changed}
        one = len(changed) == 1
        raise ValueError(
            f"{_listed(changed)} only appl{'ies' if one else 'y'} to MSC: set `msc_block_layers` (layers per encoder "
            f"block), got None; otherwise leave {'it' if one else 'them'} out (version 0.1.0 key{'' if one else 's'}, "
            f"now {_listed({field: value for field, value in mapped.items() if field in now})})."
        )
    return mapped


class DeepNMTConfig(PreTrainedConfig):
    r"""
    Configuration of a deep Transformer encoder-decoder for translation. Every method of the package is a setting of
    these fields; the named configs ([`DlclConfig`], ...) only change defaults.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000):
            Source vocabulary size (also the target vocabulary when `share_embeddings=True`).
        decoder_vocab_size (`int`, *optional*):
            Target vocabulary size. Defaults to `vocab_size`; must equal it when `share_embeddings=True`.
        d_model (`int`, *optional*, defaults to 512):
            Width of every layer.
        encoder_layers / decoder_layers (`int`, *optional*, defaults to 6):
            Number of layers in each stack. With MSC (`msc_block_layers`) `encoder_layers` is the sum of the block
            sizes: leave it unset, or it must equal that sum.
        encoder_attention_heads / decoder_attention_heads (`int`, *optional*, defaults to 8):
            Attention heads; must divide `d_model`.
        encoder_ffn_dim / decoder_ffn_dim (`int`, *optional*, defaults to 2048):
            Inner width of the feed-forward sublayers.
        activation_function (`str`, *optional*, defaults to `"relu"`):
            Activation of the feed-forward sublayers (a key of `transformers.activations.ACT2CLS`).
        dropout (`float`, *optional*, defaults to 0.1):
            Residual dropout (on the embeddings and on every sublayer output before the residual sum).
        attention_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on attention probabilities.
        activation_dropout (`float`, *optional*, defaults to 0.0):
            Dropout after the feed-forward activation.
        scale_embedding (`bool`, *optional*, defaults to `True`):
            Multiply token embeddings by sqrt(d_model) before adding the sinusoidal positions.
        sinusoid_frequencies (`str`, *optional*, defaults to `"fairseq"`):
            Frequencies of the sinusoidal positions, which put the sines in the first half of the vector and the
            cosines in the second, counting positions from 0: `"fairseq"`, 10000^(-i / (d_model/2 - 1)) for the i-th
            pair (fairseq, tensor2tensor), or `"marian"`, 10000^(-2i / d_model) (Marian and transformers'
            `MarianMTModel`; computed in float64 as it is, on devices that have float64; even `d_model` only). Written
            into `config.json` only when not the default.
        output_bias (`bool`, *optional*, defaults to `False`):
            Add a bias to the output logits (Marian's `final_logits_bias`; trained like every other parameter).
            Written into `config.json` only when set.
        share_embeddings (`bool`, *optional*, defaults to `True`):
            One embedding matrix for source and target (joint vocabulary).
        tie_word_embeddings (`bool`, *optional*, defaults to `True`):
            Use the target embedding matrix as the output projection.
        pre_norm (`bool`, *optional*, defaults to `True`):
            LayerNorm before each sublayer (DLCL paper Eq. 4, with a final LayerNorm on each stack) instead of after
            the residual sum (Eq. 3).
        layer_aggregation (`str`, *optional*, defaults to `"residual"`):
            How a layer's input is built from the outputs below it, for both stacks: `"residual"` (the previous
            layer's output) or `"dlcl"` (a learned linear combination of the embedding and all earlier layer
            outputs, DLCL paper Eq. 7-9), `"sparse"` (DLCL over blocks, SDT), `"attnres"` (Attention Residuals, Kimi
            2026: each layer's input a per-position softmax over the embedding and the contribution of every layer
            below it, scored by a learned zero-initialised pseudo-query per layer against RMS-normalised keys) or
            `"block_attnres"` (the same over block sums, blocks as `"sparse"` sets them). The Attention Residuals
            need pre-norm layers. `encoder_layer_aggregation` / `decoder_layer_aggregation` override it per stack.
        dlcl_weights (`str`, *optional*, defaults to `"learned"`):
            DLCL combination weights: `"learned"` (scalars initialised to the uniform average 1/(r+1)), or the
            constant ablations of the paper, `"average"` (fixed 1/(r+1)) and `"one"` (fixed 1).
        dlcl_init (`str`, *optional*, defaults to `"uniform"`):
            Initial value of learned DLCL weights: `"uniform"` (1/(r+1), DLCL) or `"identity"` (DenseFormer,
            Pagliardini et al. 2024: weight 1 on the newest stored output, 0 on the others), under which the stack
            starts as the plain residual stack with the same layers. Written into `config.json` only when set.
        hyper_connections (`int`, *optional*, defaults to 0):
            Hyper-Connections (Zhu et al., ICLR 2025) with this many residual streams n (2 to 64) on both stacks; 0 is
            the plain residual. `encoder_hyper_connections` / `decoder_hyper_connections` override it per stack. The
            stack carries n copies of its stream; each sublayer reads a learned mix of them and writes its output
            back into each with a learned weight, while an n x n matrix mixes the copies (the modeling file's
            `DeepNMTHyperConnection`); the stack starts from n copies of the embedding and ends with their sum. At
            initialisation the stack computes the pre-norm residual one (up to the final LayerNorm's epsilon). Needs
            pre-norm sublayers on that stack (not post-norm, DeepNorm or Mix-LN's post-norm layers), a residual
            stack (not DLCL or sparse) and no MSC. Written into `config.json` only when set.
        hyper_connections_dynamic (`bool`, *optional*, defaults to `False`):
            Dynamic Hyper-Connections: the mixing weights also depend on the stream, through tanh of a projection
            of the LayerNorm-ed copies scaled by learned factors (initialised 0.01, the projections 0).
        hyper_connections_sinkhorn_iterations (`int`, *optional*, defaults to 0):
            0: the Hyper-Connections' weights are used as they are. > 0: mHC (Xie et al., DeepSeek 2025): they are
            logits, the input mix goes through a sigmoid, the output weights through 2 x sigmoid, and the stream
            mixing matrix is made doubly stochastic by this many Sinkhorn-Knopp iterations of its exponential (at
            most 100; mHC uses 20).
        dlcl_dilation (`int`, *optional*, defaults to 1):
            DenseFormer's dilation k: row r of the combination (stored outputs `y_0..y_r`) weighs only `y_j` with
            `r - j` a multiple of k (the newest, `y_r`, always); the other weights are held at exactly 0. 1 is DLCL.
            Written into `config.json` only when set.
        dlcl_period (`int`, *optional*, defaults to 1):
            DenseFormer's period p: only every p-th stored output (rows r with `r % p == 0`, and so the first
            layer's input) is followed by the weighted combination; the layers in between take the previous layer's
            output (plain residual chaining), although every output is still stored for the later combinations. The
            stack output is the combination when p divides the number of stored outputs after the embedding, else
            the last layer's output. 1 is DLCL. Both need `dlcl_history_norm=False` (DenseFormer's average has no
            LayerNorms). Written into `config.json` only when set.
        encoder_post_norm_layers / decoder_post_norm_layers (`int`, *optional*, defaults to 0):
            Mix-LN (Li et al. 2024): the first k layers of the stack are post-norm, the layers above pre-norm; needs
            `pre_norm=True` and a residual stack. The stack keeps its final LayerNorm while it has a pre-norm layer
            (k below the stack's depth), as the pre-norm part of Mix-LN does; so k = 0 is the pre-norm stack and k =
            the depth is exactly the post-norm one (`pre_norm=False`). Written into `config.json` only when set.
        sparse_block_size (`int`, *optional*, defaults to 6):
            Block size p of `"sparse"` and `"block_attnres"` aggregation (SDT sparse connections, Li et al. 2020; Block
            Attention Residuals) when a stack's boundaries are not given: blocks `[0, p, 2p, ..., L]` (the last one
            shorter when p does not divide L).
        encoder_block_boundaries / decoder_block_boundaries (`list[int]`, *optional*):
            Block boundaries of a `"sparse"` or `"block_attnres"` stack, `[0, b_1, ..., L]` strictly increasing. In a
            `"sparse"` stack only block outputs are stored and only the first layer of a block reads the learned
            combination; one block per layer is dense DLCL, `[0, L]` a single block. A `"block_attnres"` stack
            attends the block sums (and the current block's partial sum) at every layer.
        dlcl_history_norm (`bool`, *optional*, defaults to `True`):
            Keep the DLCL LayerNorms (one per stored layer output in pre-norm, one per combination row in post-norm);
            `False` is the paper's "- layer norm" ablation.
        init_scheme (`str`, *optional*, defaults to `"default"`):
            `"default"` or `"ds_init"`. Every weight matrix is drawn uniformly in +-sqrt(6 / fan), fan = fan-in +
            fan-out of the matrix as the reference implementations store it: in+out for every matrix except the
            attention Q/K/V maps, which fairseq packs into one d x 3d matrix (fan 4d). `"ds_init"`: depth-scaled
            initialisation (Zhang, Titov, Sennrich 2019): every matrix of layer l (from 1, per stack; attention, FFN,
            AAN, MSC context attention and fusion gate) has its bound multiplied by `ds_init_alpha / sqrt(l)` (see
            `ds_init_mode`); and as in the authors' code, which packs self-attention Q/K/V but keeps separate d x d
            cross-attention maps, cross-attention Q/K/V use fan 2d. Embeddings are N(0, 1/d), biases 0, LayerNorms
            1/0, the GRU cells torch's own uniform +-1/sqrt(d). Each matrix's fan and scale show in the model's
            `repr` (`DeepNMTLinear`).
        ds_init_alpha (`float`, *optional*, defaults to 1.0):
            The alpha of DS-Init, in (0, 1].
        ds_init_mode (`str`, *optional*, defaults to `"paper"`):
            `"paper"`: bound factor alpha / sqrt(l) (the published formula); `"code"`: sqrt(alpha) * l^(-1/4), what the
            reference implementation's variance scaling actually draws (alpha in the role of its initializer gain).
        decoder_self_attention (`str`, *optional*, defaults to `"multi_head"`):
            `"multi_head"` (causal self-attention), `"merged_average"` (MAtt: one sublayer adding a causal average of
            the values to the cross-attention context before a shared output projection, which replaces both
            self- and cross-attention) or `"average"` (the gated average attention network, AAN, of Zhang, Xiong,
            Su 2018, replacing self-attention only).
        aan_ffn (`bool`, *optional*, defaults to `False`):
            Give the AAN its feed-forward network on the average (only with `decoder_self_attention="average"`).
        deepnorm (`bool`, *optional*, defaults to `False`):
            DeepNorm (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers"): every post-norm residual
            block computes `LN(alpha * x + F(x))`, and the FFN matrices and the attention value and output
            projections are drawn Xavier-normal with gain beta (query and key projections gain 1). The constants
            (`deepnorm_constants`) are the paper's encoder-decoder ones for N encoder and M decoder layers, since
            every model here has both stacks: encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16);
            decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4). Needs `pre_norm=False` and `init_scheme="default"`;
            not with MSC. Combines with DLCL and sparse connections (each layer's residual blocks are scaled), MAtt,
            the AAN and relative position keys. Written into `config.json` only when set.
        relative_position_window (`int`, *optional*, defaults to 0):
            Relative position keys (Shaw et al. 2018, as used by SDT, Li et al. 2020) in encoder and decoder
            self-attention with clipping distance k: score_ij = q_i . (k_j + a_clip(j-i, -k, k)) / sqrt(d_h), one
            table of 2k+1 vectors per layer shared across heads, keys only. 0 turns them off. Absolute sinusoidal
            positions are kept either way.
        msc_block_layers (`int` or `list[int]`, *optional*):
            Multiscale collaboration (MSC, Wei et al. 2020) when set: the encoder is N blocks, N = `decoder_layers`,
            of M layers each (an int M) or of the listed sizes (a list of N ints). Decoder layer n cross-attends to
            the LayerNorm-ed output of encoder block n (block-scale collaboration). `None` turns MSC off.
        msc_context (`str`, *optional*, defaults to `"gru"`):
            MSC's contextual collaboration: a context state `C^n` per source position carried across the blocks,
            which encoder layers of block n attend (`C^{n-1}`) next to their self-attention, and decoder layer n
            (`C^n`) next to its cross-attention, the two results fused (`msc_fusion`). `C^0` is the encoder input and
            `C^n = Q(C^{n-1}, B^n)`, Q the context cell, run position-wise across the blocks:
            `"gru"`: Q a `torch.nn.GRUCell` (hidden state `C^{n-1}`, input `B^n`) shared by all blocks, what the
            paper's parameter counts imply; `"gru_per_block"`: one GRU cell per block; `"ffn"` / `"ffn_per_block"`:
            the feed-forward ablation `Q(c, x) = W_2 relu(W_1 [c; x] + b_1) + b_2` (inner width d), shared or one per
            block; `"block_output"`: the ablation without a cell, layers still attend a context but `C^n` is the
            normalised output of block n; `"none"`: no context and no context attention at all.
        msc_context_sides (`str`, *optional*, defaults to `"encoder_and_decoder"`):
            Which layers attend the context: `"encoder_and_decoder"`, or `"encoder"` (decoder layers attend their
            encoder block only). Not with `msc_context="none"`.
        msc_fusion (`str`, *optional*, defaults to `"gate"`):
            How a layer fuses its own attention `A_h` with its context attention `A_c`: `"gate"`,
            `g * A_h + (1 - g) * A_c` with `g = sigmoid(W [A_h; A_c] + b)`, or `"add"`, `A_h + A_c`. Not with
            `msc_context="none"`.

            Version 0.1.0 set the context with five keys instead, `msc_context_attention`,
            `msc_contextual_collaboration`, `msc_context_cell`, `msc_share_gru` and `msc_decoder_context`: a config
            given them (a folder saved by 0.1.0 holds them all) reads them into `msc_context` and `msc_context_sides`
            and saves only those; what 0.1.0 refused is still an error.
        encoder_l2_lambda (`float`, *optional*, defaults to 0.0):
            Coupled L2 regularisation of the encoder, added to the training loss: lambda times the sum of squares of
            every encoder weight matrix (`nn.Linear` and GRU weights; not biases, LayerNorms, embeddings, DLCL
            weights or relative-position tables). MSC's 72-layer IWSLT system uses 1e-5.
        layer_norm_eps (`float`, *optional*, defaults to 1e-5):
            Epsilon of every LayerNorm.
        converted_from (`dict`, *optional*):
            Where a converted model came from (`hf-deep-nmt convert-marian` sets it: the source's Hub id or folder
            name, revision, class and licence as its card states it). A record for the model card; computes nothing,
            and is kept by growing, training and exporting. Written into `config.json` only when set.
        tokenizer_fingerprint (`str`, *optional*):
            The SHA-256 of the tokenizer the model was trained with (its vocabulary, merges, normalizer,
            pre-tokenizer and added tokens), recorded at export by the package; its commands refuse a tokenizer whose
            fingerprint differs. Computes nothing. Written into `config.json` only when set.
        growth (`list[dict]`, *optional*):
            One record per `grow_encoder` call (encoder layers before and after, strategy) and per
            `with_layer_aggregation` call (the stack, its aggregation before and after): a record for the model card,
            computes nothing. Written into `config.json` only when set.
        sdpa_avoid_cudnn (`bool`, *optional*, defaults to `True`):
            Keep attention calls that pass a mask on CUDA off PyTorch's cuDNN SDPA backend (flash, memory-efficient
            and math kernels stay allowed): its backward returns NaN gradients at padded lengths of 64 mod 128
            (pytorch/pytorch#196678). Set `False` on a torch release with the fix. No effect on CPU.
        pad_token_id / bos_token_id / eos_token_id / decoder_start_token_id (`int`):
            Special token ids, defaults 1 / 0 / 2 / 0 (the tokenizer of the package puts `<s>`, `<pad>`, `</s>`,
            `<unk>` at ids 0-3).
        decoder_layer_types (`list[str]`, derived):
            The cache-layer type of each decoder layer, which `generate()` builds its cache from: derived from
            `decoder_self_attention` and the MSC settings (None for a plain multi-head decoder). A given value is
            replaced, with a warning.
    """

    model_type = "deep_nmt"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "encoder_attention_heads",
        "num_hidden_layers": "encoder_layers",
    }

    vocab_size: int = 32000
    decoder_vocab_size: int | None = None
    d_model: int = 512
    encoder_layers: int | None = None
    decoder_layers: int = 6
    encoder_attention_heads: int = 8
    decoder_attention_heads: int = 8
    encoder_ffn_dim: int = 2048
    decoder_ffn_dim: int = 2048
    activation_function: str = "relu"
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    scale_embedding: bool = True
    sinusoid_frequencies: str = "fairseq"
    output_bias: bool = False
    share_embeddings: bool = True
    tie_word_embeddings: bool = True
    pre_norm: bool = True
    layer_aggregation: str = "residual"
    encoder_layer_aggregation: str | None = None
    decoder_layer_aggregation: str | None = None
    dlcl_weights: str = "learned"
    dlcl_history_norm: bool = True
    dlcl_init: str = "uniform"
    dlcl_dilation: int = 1
    dlcl_period: int = 1
    encoder_post_norm_layers: int = 0
    decoder_post_norm_layers: int = 0
    hyper_connections: int = 0
    encoder_hyper_connections: int | None = None
    decoder_hyper_connections: int | None = None
    hyper_connections_dynamic: bool = False
    hyper_connections_sinkhorn_iterations: int = 0
    sparse_block_size: int = 6
    encoder_block_boundaries: list[int] | None = None
    decoder_block_boundaries: list[int] | None = None
    init_scheme: str = "default"
    ds_init_alpha: float = 1.0
    ds_init_mode: str = "paper"
    decoder_self_attention: str = "multi_head"
    aan_ffn: bool = False
    decoder_layer_types: list[str] | None = None
    relative_position_window: int = 0
    msc_block_layers: int | list[int] | None = None
    msc_context: str = "gru"
    msc_context_sides: str = "encoder_and_decoder"
    msc_fusion: str = "gate"
    encoder_l2_lambda: float = 0.0
    layer_norm_eps: float = 1e-5
    sdpa_avoid_cudnn: bool = True
    deepnorm: bool = False
    converted_from: dict | None = None
    growth: list[dict] | None = None
    tokenizer_fingerprint: str | None = None
    use_cache: bool = True
    is_encoder_decoder: bool = True
    pad_token_id: int | None = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        for alias, field in self.attribute_map.items():  # `hidden_size=...` is `d_model=...`, checked like it
            if alias in kwargs:
                setattr(self, field, kwargs.pop(alias))
        self._read_earlier_msc_keys(kwargs)
        self._warn_unknown_keys(kwargs)
        self._resolve()
        self._validate()
        super().__post_init__(**kwargs)

    @property
    def msc_blocks(self) -> list[int] | None:
        """Layers per encoder block under MSC (`msc_block_layers` resolved to a list), else None."""
        layers = self.msc_block_layers
        if layers is None:
            return None
        return [layers] * self.decoder_layers if isinstance(layers, int) else list(layers)

    def msc_block_boundaries(self) -> list[int] | None:
        """`[0, b_1, ..., encoder_layers]`: where each MSC encoder block starts and ends, else None."""
        blocks = self.msc_blocks
        if blocks is None:
            return None
        boundaries = [0]
        for size in blocks:
            boundaries.append(boundaries[-1] + size)
        return boundaries

    def deepnorm_constants(self, side: str) -> tuple[float, float]:
        """DeepNorm's `(alpha, beta)` for the layers of `side` ("encoder" or "decoder"): the skip weight of every
        residual block and the gain of the value, output and FFN matrices; `(1.0, 1.0)` without `deepnorm`. The
        encoder-decoder form of the paper (N encoder, M decoder layers)."""
        if side not in ("encoder", "decoder"):
            raise ValueError(f"`side` must be 'encoder' or 'decoder', got {side!r}.")
        if not self.deepnorm:
            return 1.0, 1.0
        n, m = self.encoder_layers, self.decoder_layers
        if side == "encoder":
            return 0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)
        return (3 * m) ** (1 / 4), (12 * m) ** (-1 / 4)

    @classmethod
    def _dict_from_json_file(cls, json_file) -> dict:
        """The values of a `config.json` this class loads, or `ValueError` in one line naming the file and the field:
        text that is not JSON, or nested too deeply to parse (the parser's own words name no file), a value that is
        not an object of fields, a `model_type` of no model of this package, a `dtype` torch does not know."""
        try:
            values = super()._dict_from_json_file(json_file)
        except RecursionError:
            raise ValueError(f"{json_file} is nested too deeply to be a config; restore the saved one.") from None
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{json_file} is not valid JSON ({error}); restore the saved config.json.") from None
        if not isinstance(values, dict):
            raise ValueError(
                f"{json_file} holds a JSON {type(values).__name__}, not an object of config fields; restore the "
                "saved config.json."
            )
        known = sorted(_model_types(DeepNMTConfig))
        if "model_type" in values and values["model_type"] not in known:
            raise ValueError(
                f"{json_file}: {cls.__name__} takes a {cls.__name__} (model_type {cls.model_type!r}) or another "
                f"config of this package ({', '.join(known)}), not one of model_type {values['model_type']!r}; load "
                "it with the class of its own package, or restore the saved config.json."
            )
        for field in ("dtype", "torch_dtype"):
            value = values.get(field)
            if value is not None and value != "auto" and not _is_dtype_name(value):
                raise ValueError(
                    f"{json_file}: `{field}` {value!r} is not a torch dtype (e.g. 'float32', 'bfloat16'); restore "
                    "the saved config.json."
                )
        return values

    def to_dict(self) -> dict:
        output = super().to_dict()
        # Left out only at the default of the base config and of this class alike: a named config that switches a
        # later setting on by default (DeepNorm) writes it either way, or a switched-off one loads with the class
        # default, and readers of `to_dict` (the exporters' allow-lists) see it on.
        defaults, own = DeepNMTConfig.__dataclass_fields__, type(self).__dataclass_fields__
        for field in LATER_SETTINGS:
            if field in output and output[field] == defaults[field].default == own[field].default:
                del output[field]
        if not self.hyper_connections and not any(getattr(self, field) for field in _HYPER_CONNECTION_SIDES):
            for field in _HYPER_CONNECTION_SIDES:
                output.pop(field, None)
        return output

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        # Beside the translation model (named in `auto_map` by the model's `save_pretrained`, which also writes the
        # modeling file), `auto_map` names the encoder-decoder without the output layer: `AutoModel` loads the folder
        # as remote code too.
        # Each method's encoder-decoder is named after its translation model (`XForConditionalGeneration` ->
        # `XModel`, as `METHODS` in the modeling file pairs them; a test holds every method to it).
        auto_map = getattr(self, "auto_map", None) or {}
        translation_model = auto_map.get("AutoModelForSeq2SeqLM")
        if isinstance(translation_model, str) and translation_model.endswith("ForConditionalGeneration"):
            base_model = translation_model.removesuffix("ForConditionalGeneration") + "Model"
            self.auto_map = {**auto_map, "AutoModel": base_model}
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def _read_earlier_msc_keys(self, kwargs: dict) -> None:
        """Take the MSC keys of version 0.1.0 out of `kwargs` and set the fields they stand for; a field given a
        value of its own (not its default) that says something else is an error naming both."""
        given = {key: kwargs.pop(key) for key in EARLIER_MSC_KEYS if key in kwargs}
        if not given:
            return
        for field, value in earlier_msc_settings(given, self.msc_fusion, self.msc_block_layers).items():
            own = getattr(self, field)
            if own != value and own != type(self).__dataclass_fields__[field].default:
                keys = {key: given[key] for key in given if EARLIER_MSC_KEYS[key].field == field}
                raise ValueError(
                    f"{_listed(keys)} (version 0.1.0) stand{'s' if len(keys) == 1 else ''} for `{field}={value!r}`, "
                    f"which disagrees with the given `{field}={own!r}`; give only `{field}`."
                )
            setattr(self, field, value)

    def _resolve(self) -> None:
        """Fill the derived values from the given ones. A value derived from a malformed one is left as it is, for
        `_validate` to name the malformed one."""
        if self.decoder_vocab_size is None:
            self.decoder_vocab_size = self.vocab_size
        if self.encoder_layer_aggregation is None:
            self.encoder_layer_aggregation = self.layer_aggregation
        if self.decoder_layer_aggregation is None:
            self.decoder_layer_aggregation = self.layer_aggregation
        for field in _HYPER_CONNECTION_SIDES:
            if getattr(self, field) is None:
                setattr(self, field, self.hyper_connections)
        if isinstance(self.msc_block_layers, tuple):
            self.msc_block_layers = list(self.msc_block_layers)
        if self.msc_block_layers is None:
            if self.encoder_layers is None:
                self.encoder_layers = 6
        elif (
            self.encoder_layers is None
            and MSC_BLOCKS.accepts(self.msc_block_layers)
            and POSITIVE_INT.accepts(self.decoder_layers)
        ):
            self.encoder_layers = sum(self.msc_blocks)  # MSC: the blocks make the encoder
        for side in ("encoder", "decoder"):
            field, layers = f"{side}_block_boundaries", getattr(self, f"{side}_layers")
            boundaries = getattr(self, field)
            if isinstance(boundaries, tuple):
                setattr(self, field, list(boundaries))
            elif (
                boundaries is None
                and getattr(self, f"{side}_layer_aggregation") in BLOCK_AGGREGATIONS
                and POSITIVE_INT.accepts(layers)
                and POSITIVE_INT.accepts(self.sparse_block_size)
            ):
                setattr(self, field, list(range(0, layers, self.sparse_block_size)) + [layers])
        self._resolve_decoder_layer_types()

    def _resolve_decoder_layer_types(self) -> None:
        # `generate()` builds its cache from this field (read as `layer_types` of the decoder view of the config):
        # every decoder layer gets the cache layer that holds all of its decoding state. Always derived; a saved value
        # is replaced, silently when an earlier version of the package derived it.
        derived = None
        if POSITIVE_INT.accepts(self.decoder_layers):
            derived = [CACHE_LAYER_TYPE] * self.decoder_layers
        given = self.decoder_layer_types
        earlier = given is None or (isinstance(given, list) and set(given) <= set(EARLIER_CACHE_LAYER_TYPES))
        if given != derived and not earlier:
            logger.warning(
                f"`decoder_layer_types` is derived (a {CACHE_LAYER_TYPE!r} cache layer per decoder layer): the given "
                f"{_shown_list(given)} is replaced by {_shown_list(derived)}."
            )
        self.decoder_layer_types = derived

    def _validate(self) -> None:
        """Raise `ValueError` naming the field and the value for the first bad setting or combination; changes
        nothing."""
        for field, kind in FIELD_KINDS.items():
            value = getattr(self, field)
            if not kind.accepts(value):
                raise ValueError(f"`{field}` must be {kind.description}, got {value!r}.")
        defaults = {item.name: item.default for item in dataclasses.fields(DeepNMTConfig)}
        for rule in DEPENDS_ON:
            changed = any(getattr(self, field) != defaults[field] for field in rule.fields)
            if changed and not rule.holds(self):
                shown = [getattr(self, field) for field in rule.shown]
                got = repr(shown[0]) if len(shown) == 1 else _settings(self, rule.shown)
                default = ", ".join(repr(defaults[field]) for field in rule.fields)
                leave = "it at its default" if len(rule.fields) == 1 else "them at their defaults"
                raise ValueError(
                    f"{_settings(self, rule.fields)} {rule.requirement}, got {got}; otherwise leave {leave} "
                    f"({default})."
                )
        for rule in STRUCTURAL_RULES:
            problem = rule(self)
            if problem:
                raise ValueError(problem)
        self._warn_unused_layer_aggregation()

    def _warn_unused_layer_aggregation(self) -> None:
        class_default = type(self).__dataclass_fields__["layer_aggregation"].default
        stacks = (self.encoder_layer_aggregation, self.decoder_layer_aggregation)
        if self.layer_aggregation != class_default and self.layer_aggregation not in stacks:
            logger.warning(
                f"`layer_aggregation={self.layer_aggregation!r}` has no effect: both stacks have their own "
                f"(`encoder_layer_aggregation={stacks[0]!r}`, `decoder_layer_aggregation={stacks[1]!r}`); set those "
                "instead."
            )

    def _warn_unknown_keys(self, kwargs: dict) -> None:
        unknown = unknown_config_keys(type(self), set(kwargs) - TRANSFORMERS_CONFIG_KEYS)
        if unknown:
            generation = sorted(set(unknown) & set(GenerationConfig().to_dict()))
            logger.warning(
                f"{type(self).__name__} ignores {describe_unknown_keys(unknown)}: not one of its fields"
                + (f"; {generation} belong in the model's `generation_config`." if generation else ".")
            )


# ---- the architecture's shape, read from a config ------------------------------------------------------------------
# The model builds its modules by these, and the size arithmetic (`sizes_deep_nmt.py`) counts them by the same.

# The aggregations whose history is Attention Residuals (per-layer pseudo-queries and key gains, no weight matrix).
ATTENTION_RESIDUAL_AGGREGATIONS = ("attnres", "block_attnres")


def layer_is_pre_norm(config: DeepNMTConfig, side: str, layer_idx: int) -> bool:
    """Whether layer `layer_idx` (0-based) of stack `side` is pre-norm: `pre_norm`, except for Mix-LN's first
    `{side}_post_norm_layers` layers, which are post-norm."""
    return config.pre_norm and layer_idx >= getattr(config, f"{side}_post_norm_layers")


def stack_has_final_norm(config: DeepNMTConfig, side: str) -> bool:
    """Whether the layers of stack `side` leave a final LayerNorm to the stack: a pre-norm stack's top layer is
    pre-norm (under Mix-LN, while the post-norm layers do not fill the stack: the pre-norm part keeps its final
    LayerNorm; a stack of post-norm layers only is the post-norm stack, without one)."""
    return layer_is_pre_norm(config, side, getattr(config, f"{side}_layers") - 1)


def hyper_connection_sublayers(config: DeepNMTConfig, side: str) -> int:
    """Residual blocks per layer of stack `side`: attention and FFN in the encoder; self-attention (none where MAtt,
    `"merged_average"`, merges it away), cross-attention and FFN in the decoder."""
    if side == "encoder":
        return 2
    return 2 if config.decoder_self_attention == "merged_average" else 3


def msc_attends_context(config: DeepNMTConfig, side: str) -> bool:
    """Whether the layers of `side` ("encoder" or "decoder") attend MSC's context states."""
    if config.msc_block_layers is None or config.msc_context == "none":
        return False
    return side == "encoder" or config.msc_context_sides == "encoder_and_decoder"


class DlclConfig(DeepNMTConfig):
    r"""
    DLCL, "Learning Deep Transformer Models for Machine Translation" (Wang et al., ACL 2019): the paper's main
    system as defaults — pre-norm, 30-layer encoder, 6-layer decoder, base width, dynamic linear combination of
    layers in both stacks, attention and ReLU dropout 0.1.
    """

    model_type = "deep_nmt_dlcl"

    encoder_layers: int = 30
    decoder_layers: int = 6
    pre_norm: bool = True
    layer_aggregation: str = "dlcl"
    attention_dropout: float = 0.1
    activation_dropout: float = 0.1


class DsInitConfig(DeepNMTConfig):
    r"""
    DS-Init + MAtt, "Improving Deep Transformer with Depth-Scaled Initialization and Merged Attention" (Zhang,
    Titov, Sennrich, EMNLP 2019): the paper's system as defaults — post-norm, depth-scaled initialisation with
    alpha = 1 on both stacks, merged-attention decoder, 12 encoder and 12 decoder layers, base width, separate source
    and target embeddings with the target one tied to the output layer, dropout 0.1 everywhere.
    """

    model_type = "deep_nmt_dsinit"

    encoder_layers: int = 12
    decoder_layers: int = 12
    pre_norm: bool = False
    init_scheme: str = "ds_init"
    decoder_self_attention: str = "merged_average"
    share_embeddings: bool = False
    attention_dropout: float = 0.1
    activation_dropout: float = 0.1


class SdtConfig(DeepNMTConfig):
    r"""
    SDT, "Shallow-to-Deep Training for Neural Machine Translation" (Li et al., EMNLP 2020): the paper's
    SDT-RPR-48L system as defaults — pre-norm, relative position keys with k = 8 in encoder and decoder
    self-attention, sparse connections with block size 6 in the 48-layer encoder, a 6-layer decoder without layer
    aggregation, base width, shared vocabulary, dropout 0.1 everywhere.
    """

    model_type = "deep_nmt_sdt"

    encoder_layers: int = 48
    decoder_layers: int = 6
    pre_norm: bool = True
    encoder_layer_aggregation: str | None = "sparse"
    decoder_layer_aggregation: str | None = "residual"
    sparse_block_size: int = 6
    relative_position_window: int = 8
    attention_dropout: float = 0.1
    activation_dropout: float = 0.1


class MscConfig(DeepNMTConfig):
    r"""
    MSC, "Multiscale Collaborative Deep Models for Neural Machine Translation" (Wei et al., ACL 2020): the paper's
    WMT base system as defaults — pre-norm, 6 encoder blocks of 6 layers (a 36-layer encoder), 6-layer decoder whose
    layer n attends to encoder block n, a GRU context shared by the blocks, gated fusion on both sides, base width,
    shared vocabulary. The IWSLT systems: `d_model=256, encoder_ffn_dim=512, decoder_ffn_dim=512, 4 heads`, with
    `msc_block_layers` 1, 6, 9 or 12 (and `encoder_l2_lambda=1e-5` at 12).
    """

    model_type = "deep_nmt_msc"

    decoder_layers: int = 6
    pre_norm: bool = True
    msc_block_layers: int | list[int] | None = 6


class DeepNormConfig(DeepNMTConfig):
    r"""
    DeepNorm, "DeepNet: Scaling Transformers to 1,000 Layers" (Wang, Ma, Dong, Huang, Zhang, Wei, 2022): the
    paper's deepest bilingual WMT-17 En-De system as defaults — post-norm with DeepNorm residuals and initialisation
    (`deepnorm`), 100 encoder and 100 decoder layers, base width (512, FFN 2048, 8 heads), shared vocabulary.
    """

    model_type = "deep_nmt_deepnorm"

    encoder_layers: int = 100
    decoder_layers: int = 100
    pre_norm: bool = False
    deepnorm: bool = True


class DenseFormerConfig(DeepNMTConfig):
    r"""
    DenseFormer, "DenseFormer: Enhancing Information Flow in Transformers via Depth Weighted Averaging" (Pagliardini
    et al., ICML 2024), on this package's backbone: pre-norm, a 24-layer encoder and 6-layer decoder at base width,
    DLCL's depth-weighted average in both stacks with DenseFormer's identity initialisation and no history
    LayerNorms, dilation and period 1 (the paper's k x p variants: `dlcl_dilation`, `dlcl_period`). The paper
    trains language models only; the depths here are those of `benchmarks/fidelity/depth_family.py`.
    """

    model_type = "deep_nmt_denseformer"

    encoder_layers: int = 24
    decoder_layers: int = 6
    pre_norm: bool = True
    layer_aggregation: str = "dlcl"
    dlcl_init: str = "identity"
    dlcl_history_norm: bool = False


class MixLnConfig(DeepNMTConfig):
    r"""
    Mix-LN, "Mix-LN: Unleashing the Power of Deeper Layers by Combining Pre-LN and Post-LN" (Li et al., 2024), on
    this package's backbone: a 24-layer encoder and 6-layer decoder at base width, the first quarter of each stack's
    layers post-norm (the paper's ratio 0.25: 6 encoder layers, 1 decoder layer) and pre-norm above. The paper trains
    language models only; the depths here are those of `benchmarks/fidelity/depth_family.py`.
    """

    model_type = "deep_nmt_mixln"

    encoder_layers: int = 24
    decoder_layers: int = 6
    pre_norm: bool = True
    encoder_post_norm_layers: int = 6
    decoder_post_norm_layers: int = 1


class AttnResConfig(DeepNMTConfig):
    r"""
    Attention Residuals (Kimi Team, 2026) on this package's backbone: pre-norm, a 24-layer encoder and 6-layer decoder
    at base width, each layer's input a softmax-weighted, input-dependent mixture of the embedding and every earlier
    layer's contribution (`layer_aggregation="attnres"`; `"block_attnres"` mixes block summaries instead). The
    method was published for language models only; the depths here are those of
    `benchmarks/fidelity/depth_family.py`.
    """

    model_type = "deep_nmt_attnres"

    encoder_layers: int = 24
    decoder_layers: int = 6
    pre_norm: bool = True
    layer_aggregation: str = "attnres"


class HyperConnectionsConfig(DeepNMTConfig):
    r"""
    Hyper-Connections (Zhu et al., ICLR 2025) on this package's backbone: pre-norm, a 24-layer encoder and 6-layer
    decoder at base width, each stack's residual stream widened to 2 copies mixed by dynamic (input-dependent)
    connections; `hyper_connections_sinkhorn_iterations` > 0 makes it mHC (Xie et al., DeepSeek 2025). Published for
    language models only; the depths here are those of `benchmarks/fidelity/depth_family.py`.
    """

    model_type = "deep_nmt_hyper_connections"

    encoder_layers: int = 24
    decoder_layers: int = 6
    pre_norm: bool = True
    hyper_connections: int = 2
    hyper_connections_dynamic: bool = True


# Output cap of a new model's generation config: `generate()` stops after this many tokens plus `</s>`. Positions are
# sinusoidal, so the model sets no maximum length of its own, and transformers' default (20) cuts translations short.
DEFAULT_MAX_OUTPUT_TOKENS = 1024
# The most output tokens one `generate()` call may allow (`max_new_tokens`, or `max_length` less the start token):
# every step attends all earlier outputs, so a cap of a million runs for days before it fails or ends; sixteen times
# the default cap leaves room for documents decoded whole.
MAX_GENERATE_TOKENS = 16 * DEFAULT_MAX_OUTPUT_TOKENS


class DeepNMTGenerationConfig(GenerationConfig):
    """The generation config a new model starts with (`generation_config_class` of the models): transformers' defaults
    and the model's special ids, plus the output cap `max_length = DEFAULT_MAX_OUTPUT_TOKENS + 2` (for an
    encoder-decoder `max_length` counts the decoder start token; `</s>` is the other one). A recipe's export replaces
    it with the recipe's cap; `generate(max_new_tokens=...)` or `generate(max_length=...)` override it per call."""

    @classmethod
    def from_model_config(cls, model_config) -> GenerationConfig:
        generation_config = super().from_model_config(model_config)
        if generation_config.max_length is None and generation_config.max_new_tokens is None:
            generation_config.max_length = DEFAULT_MAX_OUTPUT_TOKENS + 2
            generation_config._original_object_hash = hash(generation_config)
        return generation_config


# the base config and every named preset, by being one (a new method adds no line here)
__all__ = [
    "DECODER_SELF_ATTENTIONS",
    "DLCL_WEIGHTS",
    "DEFAULT_MAX_OUTPUT_TOKENS",
    "DS_INIT_MODES",
    "MAX_GENERATE_TOKENS",
    "INIT_SCHEMES",
    "LAYER_AGGREGATIONS",
    "SINUSOID_FREQUENCIES",
    "DeepNMTGenerationConfig",
    *(name for name, value in list(globals().items()) if isinstance(value, type) and issubclass(value, DeepNMTConfig)),
]
