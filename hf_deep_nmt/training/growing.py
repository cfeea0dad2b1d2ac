"""Growing a trained model deeper (SDT, Li et al. 2020, §4.1): the new encoder keeps the old layers and
puts copies on top. The result is an ordinary model of the same class with more encoder layers: it saves, loads
(remote code included) and generates like any other.

Strategies (the paper's Table 3 ablation):
    "top"        copy the top g layers, in order (the paper's default; g <= h)
    "top_only"   copy the top layer g times
    "double"     copy the whole stack once more on top (g = h)
    "interleave" put a copy right after each layer (g = h)

Layer aggregation: a `"sparse"` encoder grows by one block made of the new layers — the combination matrix grows by
one row and column, old entries kept, the new output row uniform (1/(B+2)), and the new block's LayerNorm copied from
the old top block's (optionally the old one is then reset, as the reference code does). A `"dlcl"` encoder grows one
row per new layer the same way, each new LayerNorm copied from the one of the layer it copies. `"interleave"` moves
every old layer, so it is only offered for residual and sparse encoders.

DeepNorm: the encoder's skip weight alpha = 0.81 (N^4 M)^(1/16) grows with its depth N, so a copied layer would
weigh its skip by another alpha than it was trained with. A LayerNorm ignores a positive factor of its input up to its
epsilon, LN(c * y; eps) = LN(y; eps / c^2), so every encoder layer of the grown model has its output maps
(self-attention `out_proj`, `fc2`, weights and biases) multiplied by c = alpha_new / alpha_old: it computes
LN(alpha_new * x + c * F(x)) = LN(alpha_old * x + F(x); eps / c^2), what it computed before but for an epsilon smaller
by c^2 = sqrt(N_new / N_old) (`deepnorm_output_scale`). The decoder's alpha depends on its own depth only and is
unchanged.

`with_layer_aggregation` turns a residual stack into a DLCL or sparse one that computes exactly the same function
(the combination weights the identity, no history LayerNorms), so a residual model, e.g. a converted Marian one, can
be grown and trained with layer connections: `grow_encoder(..., aggregation="dlcl")` does it before growing.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForSeq2SeqLM, PreTrainedModel

from hf_deep_nmt import MODEL_CLASSES
from hf_deep_nmt.modeling.configuration_deep_nmt import DeepNMTConfig
from hf_deep_nmt.settings import SettingCheck, refusals

GROWTH_STRATEGIES = ("top", "top_only", "double", "interleave")
EXACT_AGGREGATIONS = ("dlcl", "sparse")  # what `with_layer_aggregation` turns a residual stack into


def source_layers(num_layers: int, num_new: int, strategy: str) -> list[int]:
    """For each layer of the grown encoder, the index of the old layer it is copied from."""
    if strategy not in GROWTH_STRATEGIES:
        raise ValueError(f"`strategy` must be one of {GROWTH_STRATEGIES}, got {strategy!r}.")
    if isinstance(num_new, bool) or not isinstance(num_new, int) or num_new < 1:
        raise ValueError(f"`num_new_layers` must be a positive integer, got {num_new!r}.")
    if strategy == "top" and num_new > num_layers:
        raise ValueError(f"Cannot copy the top {num_new} layers of a {num_layers}-layer encoder (g must be <= h).")
    if strategy in ("double", "interleave") and num_new != num_layers:
        raise ValueError(f"`{strategy}` adds as many layers as the encoder has ({num_layers}), got {num_new}.")
    old = list(range(num_layers))
    if strategy == "top":
        return old + old[num_layers - num_new :]
    if strategy == "top_only":
        return old + [num_layers - 1] * num_new
    if strategy == "double":
        return old + old
    return [index for index in old for _ in range(2)]


def _msc_problem(value) -> str | None:
    if value is None:
        return None
    return "MSC: each encoder block is tied to a decoder layer, so a new block would need a new decoder layer too"


def _attention_residuals_problem(value) -> str | None:
    if value not in ("attnres", "block_attnres"):
        return None
    return (
        "Attention Residuals: a pseudo-query per layer, which growing does not copy or extend; grow a 'residual', "
        "'dlcl' or 'sparse' stack"
    )


# Every setting growing knows (an allow-list: a setting missing here, a new method's say, is refused by name): the
# encoder's layers are copied as they are, so every setting of a layer carries over; the layer histories grow as the
# module docstring says, DeepNorm's layers are rescaled to its new alpha; MSC is refused.
GROWABLE: dict[str, SettingCheck | None] = {
    **dict.fromkeys(
        (
            *("vocab_size", "decoder_vocab_size", "d_model", "encoder_layers", "decoder_layers", "layer_norm_eps"),
            *("encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim"),
            *("activation_function", "scale_embedding", "share_embeddings", "tie_word_embeddings", "output_bias"),
            *("pre_norm", "sinusoid_frequencies", "relative_position_window", "decoder_self_attention", "aan_ffn"),
            *("layer_aggregation", "sparse_block_size"),
            *("encoder_block_boundaries", "decoder_block_boundaries", "dlcl_weights", "dlcl_history_norm"),
            *("init_scheme", "ds_init_alpha", "ds_init_mode", "dropout", "attention_dropout", "activation_dropout"),
            *("encoder_l2_lambda", "msc_context", "msc_context_sides", "msc_fusion", "decoder_layer_types"),
            *("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "use_cache"),
            *("sdpa_avoid_cudnn", "converted_from", "growth", "tokenizer_fingerprint"),
            "deepnorm",  # its alpha follows the depth: the copied layers are rescaled (`deepnorm_output_scale`)
        ),
        None,
    ),
    "msc_block_layers": _msc_problem,
    **dict.fromkeys(
        ("hyper_connections", "encoder_hyper_connections", "decoder_hyper_connections"),
        lambda value: (
            None
            if not value
            else "Hyper-Connections: each residual block's stream weights belong to its place in the stack (the "
            "stream its input starts from), which a copied layer would not keep"
        ),
    ),
    **dict.fromkeys(("hyper_connections_dynamic", "hyper_connections_sinkhorn_iterations"), None),
    "encoder_layer_aggregation": _attention_residuals_problem,
    "decoder_layer_aggregation": _attention_residuals_problem,
}


def _package_model(model: PreTrainedModel | str | Path, caller: str) -> PreTrainedModel:
    """`model`, or the model saved at that folder / Hub id, checked to be a non-MSC model of this package."""
    if isinstance(model, (str, Path)):
        model = AutoModelForSeq2SeqLM.from_pretrained(model)
    config = getattr(model, "config", None)
    if not isinstance(config, DeepNMTConfig) or type(config) not in MODEL_CLASSES:
        raise TypeError(f"{caller} needs a model of this package, got {type(model).__name__}.")
    problems = refusals(config, GROWABLE, caller)
    if problems:
        msc = config.msc_block_layers
        what = f"MSC models (msc_block_layers={msc!r})" if msc is not None else f"this {config.model_type} model"
        raise ValueError(f"{caller} does not apply to {what}: {'; '.join(problems)}.")
    return model


def with_layer_aggregation(
    model: PreTrainedModel | str | Path,
    aggregation: str,
    stack: str = "encoder",
    block_boundaries: list[int] | None = None,
) -> PreTrainedModel:
    """A copy of `model` (or of the model saved at that folder / Hub id) whose residual `stack` ("encoder" or
    "decoder") combines its layers with `aggregation` ("dlcl" or "sparse") and computes exactly the same function;
    `model` is unchanged.

    A DLCL or sparse stack whose combination matrix is the identity (`W[r, r] = 1`, all else 0) without history
    LayerNorms (`dlcl_history_norm=False`) feeds every layer the output of the layer below and returns the top
    layer's output, in pre-norm and post-norm alike: the residual network. Training then learns the weights from there.
    A sparse stack is one block (`[0, L]`, what growing adds a block to) unless `block_boundaries` are given: any
    boundaries are exact, since the layers inside a block chain as a residual stack.

    Refused by name: a stack that is not residual (there is nothing to keep exact there), MSC models, and a model whose
    other stack already uses DLCL with history LayerNorms or constant weights (`dlcl_history_norm` and `dlcl_weights`
    are one setting for both stacks, and the exact combination needs them off and learned)."""
    model = _package_model(model, "with_layer_aggregation")
    config = model.config
    if stack not in ("encoder", "decoder"):
        raise ValueError(f"`stack` must be 'encoder' or 'decoder', got {stack!r}.")
    if aggregation not in EXACT_AGGREGATIONS:
        raise ValueError(f"`aggregation` must be one of {EXACT_AGGREGATIONS}, got {aggregation!r}.")
    current = getattr(config, f"{stack}_layer_aggregation")
    if current != "residual":
        raise ValueError(
            f"with_layer_aggregation changes a residual stack; the {stack} already uses {current!r} aggregation."
        )
    if block_boundaries is not None and aggregation != "sparse":
        raise ValueError("`block_boundaries` only apply to `aggregation='sparse'`.")
    other = "decoder" if stack == "encoder" else "encoder"
    if getattr(config, f"{other}_layer_aggregation") in EXACT_AGGREGATIONS and (
        config.dlcl_history_norm or config.dlcl_weights != "learned"
    ):
        raise ValueError(
            f"The {other} uses {getattr(config, f'{other}_layer_aggregation')!r} aggregation with "
            f"dlcl_history_norm={config.dlcl_history_norm!r}, dlcl_weights={config.dlcl_weights!r}: these settings "
            f"are shared by both stacks, and an exact {aggregation!r} {stack} needs dlcl_history_norm=False and "
            "learned weights, which would change the other stack."
        )
    layers = getattr(config, f"{stack}_layers")
    settings = {**config.to_dict(), f"{stack}_layer_aggregation": aggregation, "dlcl_history_norm": False}
    if aggregation == "sparse":
        settings[f"{stack}_block_boundaries"] = list(block_boundaries) if block_boundaries else [0, layers]
    if settings["layer_aggregation"] not in (
        settings["encoder_layer_aggregation"],
        settings["decoder_layer_aggregation"],
    ):
        settings["layer_aggregation"] = aggregation  # the shared default no stack uses any more
    # recorded for the model card (`DeepNMTConfig.growth`): how the model came to its wiring
    settings["growth"] = [*(config.growth or []), {"layer_aggregation": ["residual", aggregation], "stack": stack}]
    changed = MODEL_CLASSES[type(config)](type(config).from_dict(settings))
    changed.generation_config = copy.deepcopy(model.generation_config)
    history = getattr(changed.model, stack).history
    _copy_all_but(model, changed, (), (history,))
    with torch.no_grad():
        history.weight.copy_(torch.eye(history.weight.shape[0]))
    return changed.train(model.training)


def grow_encoder(
    model: PreTrainedModel | str | Path,
    num_new_layers: int | None = None,
    strategy: str = "top",
    reset_previous_block_norm: bool = False,
    aggregation: str | None = None,
) -> PreTrainedModel:
    """A copy of `model` (or of the model saved at that folder / Hub id) with a deeper encoder; `model` is unchanged.

    `num_new_layers` defaults to the block size of a sparse encoder. Everything outside the encoder layers and the
    encoder's combination weights is copied unchanged; the config records the growth (`growth`, for the model card).
    `aggregation` ("dlcl" or "sparse") first turns a residual encoder into one with that aggregation computing the
    same function (`with_layer_aggregation`), then grows it."""
    model = _package_model(model, "grow_encoder")
    if aggregation is not None:
        if strategy == "interleave" and aggregation == "dlcl":  # refused before the conversion's work
            raise ValueError(
                "`interleave` moves every layer, which a DLCL history cannot follow; use 'top' or 'double'."
            )
        model = with_layer_aggregation(model, aggregation, "encoder")
    config = model.config
    aggregation, old_layers = config.encoder_layer_aggregation, config.encoder_layers
    if num_new_layers is None:
        if aggregation != "sparse":
            raise ValueError("Give `num_new_layers`: only a sparse encoder has a block size to default to.")
        num_new_layers = config.sparse_block_size
    sources = source_layers(old_layers, num_new_layers, strategy)
    if strategy == "interleave" and aggregation == "dlcl":
        raise ValueError("`interleave` moves every layer, which a DLCL history cannot follow; use 'top' or 'double'.")

    settings = {**config.to_dict(), "encoder_layers": len(sources)}
    # recorded for the model card (`DeepNMTConfig.growth`): how the encoder came to its depth
    step = {"encoder_layers": [old_layers, len(sources)], "strategy": strategy}
    if reset_previous_block_norm and aggregation == "sparse":
        step["reset_previous_block_norm"] = True
    settings["growth"] = [*(config.growth or []), step]
    if aggregation == "sparse":
        old_boundaries = config.encoder_block_boundaries
        if strategy == "interleave":
            settings["encoder_block_boundaries"] = [2 * boundary for boundary in old_boundaries]
        else:
            settings["encoder_block_boundaries"] = old_boundaries + [len(sources)]
    grown = MODEL_CLASSES[type(config)](type(config).from_dict(settings))
    grown.generation_config = copy.deepcopy(model.generation_config)

    old_encoder, encoder = model.get_encoder(), grown.get_encoder()
    _copy_all_but(model, grown, (old_encoder.layers, old_encoder.history), (encoder.layers, encoder.history))
    for layer, source in zip(encoder.layers, sources):
        layer.load_state_dict(old_encoder.layers[source].state_dict())
    scale = deepnorm_output_scale(config, grown.config)
    if scale != 1.0:
        with torch.no_grad():
            for layer in encoder.layers:
                for output_map in (layer.self_attn.out_proj, layer.fc2):
                    output_map.weight.mul_(scale)
                    output_map.bias.mul_(scale)
    if strategy == "interleave":  # the same blocks, each twice as long: the combination is unchanged
        encoder.history.load_state_dict(old_encoder.history.state_dict())
    elif aggregation != "residual":
        _grow_history(old_encoder.history, encoder.history, sources, aggregation)
        if reset_previous_block_norm and aggregation == "sparse":
            previous = encoder.history.layer_norms[len(config.encoder_block_boundaries) - 2]  # the old top block's
            if isinstance(previous, torch.nn.LayerNorm):
                previous.reset_parameters()
    return grown.train(model.training)  # same mode as the source: a fresh module would come back with dropout on


def deepnorm_output_scale(old: DeepNMTConfig, grown: DeepNMTConfig) -> float:
    """The factor on the output maps of every encoder layer copied from `old` into `grown` (module docstring): the
    ratio of DeepNorm's encoder alphas, 1 without DeepNorm."""
    return grown.deepnorm_constants("encoder")[0] / old.deepnorm_constants("encoder")[0]


def _copy_all_but(source: nn.Module, target: nn.Module, source_parts: tuple, target_parts: tuple) -> None:
    """Load every tensor of `source` into `target` (the same model but for `*_parts`) outside the given parts, and
    check that exactly the tensors of `target_parts` were left."""
    skipped = {id(tensor) for part in source_parts for tensor in part.state_dict(keep_vars=True).values()}
    rest = {key: tensor for key, tensor in source.state_dict(keep_vars=True).items() if id(tensor) not in skipped}
    missing, unexpected = target.load_state_dict(rest, strict=False)
    target_state = target.state_dict(keep_vars=True)
    left = {id(tensor) for part in target_parts for tensor in part.state_dict(keep_vars=True).values()}
    if unexpected or {id(target_state[key]) for key in missing} != left:
        raise RuntimeError(f"Growing mapped the model's tensors wrongly: missing {missing}, unexpected {unexpected}.")


def _grow_history(old: nn.Module, history: nn.Module, sources: list[int], aggregation: str) -> None:
    """The combination of the grown encoder: old entries kept, each new row the uniform average (as at
    initialisation); a new LayerNorm copies that of the layer it copies (DLCL) or of the old top block (sparse)."""
    with torch.no_grad():
        weight = torch.zeros_like(history.weight)
        rows = old.weight.shape[0]
        weight[:rows, :rows] = old.weight
        for row in range(rows, weight.shape[0]):
            weight[row, : row + 1] = 1.0 / (row + 1)
        history.weight.copy_(weight)
    old_norms = len(old.layer_norms)
    for index, norm in enumerate(history.layer_norms):
        if index < old_norms:
            source = index
        else:
            source = sources[index] if aggregation == "dlcl" else old_norms - 1
        norm.load_state_dict(old.layer_norms[source].state_dict())
