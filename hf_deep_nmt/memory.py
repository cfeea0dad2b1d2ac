"""Sizes against memory, checked before anything is allocated: a lower bound of a model's parameters from its config
alone, the memory a training step holds at least, the bytes this process can still allocate on a device, and a saved
model whose config claims more than its weights hold. Each refusal states the estimate and what to change."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig

from hf_deep_nmt import registration  # noqa: F401  (AutoConfig reads this package's model types)
from hf_deep_nmt.weights import saved_parameters, saved_weight_files

GIB = 1 << 30


def describe_bytes(size: float) -> str:
    """`1.5 GiB`, `12.0 MiB`: a size for a message."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 1024:.1f} KiB"


def estimate_parameters(config) -> int:
    """A lower bound of the parameters of a model of this package with `config`, from its sizes alone (nothing is
    built): embeddings, output layer, attention and feed-forward matrices with their biases, LayerNorms. What it
    leaves out (DLCL weights, MSC contexts, relative keys, the AAN's gates) only adds to the real count."""
    d = int(config.d_model)
    vocab = int(config.vocab_size)
    decoder_vocab = int(getattr(config, "decoder_vocab_size", None) or vocab)
    total = vocab * d + (4 * d if getattr(config, "pre_norm", True) else 0)  # pre-norm: each stack's last LayerNorm
    if not getattr(config, "share_embeddings", True):
        total += decoder_vocab * d
    if not getattr(config, "tie_word_embeddings", True):
        total += decoder_vocab * d
    attention = 4 * d * d + 4 * d
    encoder_ffn, decoder_ffn = int(config.encoder_ffn_dim), int(config.decoder_ffn_dim)
    encoder_layer = attention + 2 * d * encoder_ffn + encoder_ffn + d + 4 * d
    # MAtt merges the self-attention into the cross-attention's matrices, the AAN replaces it: counted for multi-head
    multi_head = getattr(config, "decoder_self_attention", "multi_head") == "multi_head"
    self_attention = attention + 2 * d if multi_head else 0  # with its LayerNorm
    decoder_layer = self_attention + attention + 2 * d * decoder_ffn + decoder_ffn + d + 4 * d
    return total + int(config.encoder_layers) * encoder_layer + int(config.decoder_layers) * decoder_layer


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes this process can still allocate on `device`: on a GPU what the driver reports free (plus what torch's
    cache holds unused); on the CPU the kernel's MemAvailable, lowered to what the address-space limit of this process
    (`ulimit -v`, RLIMIT_AS) leaves. None when it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
            limits.append(max(soft - used, 0))
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else None


class InsufficientMemoryError(ValueError):
    """What was asked needs more memory than the machine has: refused, with the estimate, before any allocation."""


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
    `d_model` and 2 of the FFN width in an encoder layer, 12 and 2 in a decoder layer). A lower bound, for refusing a
    run that cannot fit before anything is built."""
    d = int(config.d_model)
    encoder = int(config.encoder_layers) * (8 * d + 2 * int(config.encoder_ffn_dim))
    decoder = int(config.decoder_layers) * (12 * d + 2 * int(config.decoder_ffn_dim))
    return 4 * (4 * estimate_parameters(config) + batch_tokens * (encoder + decoder))


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
