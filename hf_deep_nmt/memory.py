"""Sizes against memory, checked before anything is allocated: a model's parameters from its config alone (the model
code's own count, with which a model checks its size before it is built), the memory a training step holds at least,
the bytes this process can still allocate on a device, and a saved model whose config claims more than its weights
hold. Each refusal states the estimate and what to change."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig

from hf_deep_nmt import registration  # noqa: F401  (AutoConfig reads this package's model types)
from hf_deep_nmt.modeling.configuration_deep_nmt import ATTENTION_RESIDUAL_AGGREGATIONS, hyper_connection_sublayers
from hf_deep_nmt.modeling.contract_deep_nmt import (  # noqa: F401  (the model code's own, re-exported)
    GIB,
    InsufficientMemoryError,
    available_memory,
    describe_bytes,
)
from hf_deep_nmt.modeling.sizes_deep_nmt import count_parameters
from hf_deep_nmt.weights import saved_parameters, saved_weight_files


def estimate_parameters(config) -> int:
    """The parameters of a model of this package with `config`, from its sizes alone (nothing is built): every
    parameter and saved buffer, the relative-position tables and the layer-history weights ((L+1)^2 per DLCL stack)
    included. The model code's own count (`count_parameters`), which checks a model's size before it is built."""
    return count_parameters(config)


def check_memory(needed: int, what: str, way_out: str, device: str | torch.device = "cpu") -> None:
    """`InsufficientMemoryError` stating `what` needs about `needed` bytes when `device` has less available (see
    `available_memory`), before anything is allocated; `way_out` says what to change."""
    available = available_memory(device)
    if available is not None and needed > available:
        raise InsufficientMemoryError(
            f"{what} needs about {describe_bytes(needed)} ({needed:,} bytes), but only {describe_bytes(available)} "
            f"is available on {device}; {way_out}."
        )


def training_memory(config, batch_tokens: int) -> int:
    """Bytes a training step of a model with `config` holds at least, in float32, for batches of `batch_tokens`
    (padded) source and as many target tokens: weights, gradients and the two Adam moments (4 copies of
    `estimate_parameters`), and the activations each layer keeps for the backward pass (per token, about 8 vectors of
    `d_model` and 2 of the FFN width in an encoder layer, 12 and 2 in a decoder layer), with what the layer history or
    the residual streams of each stack add (`method_activations`). A lower bound, for refusing a run that cannot fit
    before anything is built."""
    d = int(config.d_model)
    encoder = int(config.encoder_layers) * (8 * d + 2 * int(config.encoder_ffn_dim))
    decoder = int(config.decoder_layers) * (12 * d + 2 * int(config.decoder_ffn_dim))
    methods = sum(method_activations(config, side) for side in ("encoder", "decoder"))
    return 4 * (4 * estimate_parameters(config) + batch_tokens * (encoder + decoder + methods))


def _attention_residual_values(config, side: str) -> int:
    """How many stored values the Attention Residuals of stack `side` attend over all its layers and its output
    together: layer i of block n attends the embedding, the n completed blocks and (past the block's first layer)
    the running sum of the current one; the output attends the embedding and every block."""
    layers = int(getattr(config, f"{side}_layers"))
    if getattr(config, f"{side}_layer_aggregation") == "attnres":
        return (layers + 1) * (layers + 2) // 2  # every layer a block: 1 + 2 + ... + (L + 1)
    boundaries = getattr(config, f"{side}_block_boundaries")
    sizes = [end - start for start, end in zip(boundaries, boundaries[1:])]
    return sum(size * (block + 1) + size - 1 for block, size in enumerate(sizes)) + len(sizes) + 1


def method_activations(config, side: str) -> int:
    """Values per token the layer history or the residual streams of stack `side` keep for the backward pass, beyond
    a plain stack's: Attention Residuals stack their stored values for every layer and keep them with their
    normalised keys (2 vectors of `d_model` per value attended, `_attention_residual_values`, which grows with the
    square of the depth); DLCL's and DenseFormer's combination keeps nothing beyond the layer outputs (its history
    buffer is not held for the backward pass; its (L+1)^2 weights are parameters); Hyper-Connections keep, per
    residual block, the n streams and their mix (2n vectors), with dynamic weights the normalised streams (n vectors)
    and their n x (n+1) weights, and with mHC's Sinkhorn-Knopp iterations on dynamic weights two n x n matrices per
    iteration (static weights are mixed once per step, for every token together). Mix-LN's post-norm layers hold
    what pre-norm ones do. Held to the saved tensors of a training forward by the tests."""
    d, layers = int(config.d_model), int(getattr(config, f"{side}_layers"))
    aggregation = getattr(config, f"{side}_layer_aggregation")
    values = 0
    if aggregation in ATTENTION_RESIDUAL_AGGREGATIONS:
        values += 2 * d * _attention_residual_values(config, side)
    streams = int(getattr(config, f"{side}_hyper_connections", 0) or 0)
    if streams:
        block = 2 * streams * d
        if config.hyper_connections_dynamic:
            block += streams * d + streams * (streams + 1)
            block += 2 * streams * streams * int(config.hyper_connections_sinkhorn_iterations)
        values += layers * hyper_connection_sublayers(config, side) * block
    return values


def check_training_size(config, batch_tokens: int, device: str | torch.device = "cpu") -> None:
    """`InsufficientMemoryError` stating the estimate (`training_memory`) when a training step cannot fit `device`,
    or the model cannot even be built in the CPU's memory, before the model is built (10^6 layers would otherwise be
    built for minutes, and then fail)."""
    sizes = ", ".join(f"{name}={getattr(config, name)}" for name in ("d_model", "encoder_layers", "decoder_layers"))
    check_memory(
        4 * estimate_parameters(config),
        f"Building the model ({estimate_parameters(config):,} parameters or more: {sizes})",
        "make the model smaller (`model_overrides`)",
    )
    check_memory(
        training_memory(config, batch_tokens),
        f"Training the model ({sizes}) on batches of {batch_tokens} tokens (weights, gradients, Adam moments and "
        "activations)",
        "make the model or the batches smaller (`model_overrides`, `max_tokens` or `per_device_train_batch_size`)",
        device,
    )


def check_saved_model_size(folder: str | Path, device: str | torch.device = "cpu") -> None:
    """Before a saved model is built: its config's parameters (`estimate_parameters`) must be no more than the
    safetensors headers of the folder hold, give or take 10% (a config.json that does not belong to the weights, e.g.
    a wider `d_model`, would otherwise allocate its model before the shapes are compared), and the model must fit the
    memory of the CPU, where it is loaded, and of `device` (float32: 4 bytes a parameter). Reads `config.json` and the
    headers only."""
    folder = Path(folder)
    config_file = folder / "config.json"
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # `from_pretrained` reports an unreadable config itself
    try:
        config = AutoConfig.for_model(**values) if "model_type" in values else None
    except (ValueError, KeyError, TypeError):
        return  # an invalid config is refused by the config's own checks when loaded
    if config is None or not hasattr(config, "encoder_ffn_dim"):
        return
    estimate = estimate_parameters(config)
    saved = saved_parameters(folder)
    # a margin for weights left out of the file (those are named after loading, `check_missing_weights`)
    if saved is not None and estimate > 1.1 * saved[0]:
        sizes = ", ".join(
            f"{name}={getattr(config, name)}"
            for name in ("d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim", "vocab_size")
        )
        raise ValueError(
            f"{str(config_file)!r} describes a model of at least {estimate:,} parameters ({sizes}), but its weights "
            f"({', '.join(path.name for path in saved_weight_files(folder))}) hold {saved[0]:,}: the config does not "
            "belong to these weights. Restore the config.json saved with them."
        )
    # loaded into the CPU's memory first, then moved to `device`
    for place in dict.fromkeys(["cpu", str(device)]):
        check_memory(
            4 * max(estimate, saved[0] if saved else 0),
            f"The model of {str(folder)!r} ({estimate:,} parameters or more, float32)",
            "use a machine or device with more memory",
            place,
        )
