"""The papers' analyses as tools for any model of the package.

* `layer_gradient_norms`: L2 norm of the gradient of each encoder / decoder layer on a batch, at initialisation or
  from any checkpoint (DS-Init Fig. 1, Zhang et al. 2019; MSC Fig. 5, Wei et al. 2020). `kind="parameters"` (the
  default, what the papers plot: "gradient norm of each layer", the norm of the gradient of the loss with respect to
  all of that layer's parameters taken together) or `kind="outputs"`: the norm of the error signal at the layer's
  output (the quantity of DS-Init's Table 1 ratios), summed over the batch's positions.
* `GradientNormCallback`: a `TrainerCallback` that records the parameter-gradient norms during training, averaged
  over windows of steps (DS-Init Fig. 4 averages every 50 steps).
* `combination_weights`: the learned DLCL / sparse combination matrices (DLCL Fig. 5, Wang et al. 2019).
* `layer_similarity`: SDT §3 (Li et al. 2020), Fig. 2: sim(i, 0) (layer i against the embedding), sim(i, i-1) and the
  inter-similarity sim_in(i), from the layer outputs y_i of one forward pass.

Their figures (`plot_*`, `mask_small_weights`: DLCL Fig. 5's masking) are drawn by `hf_deep_nmt.plots` and can be
imported from here too; `hf_deep_nmt.tools.inspection.inspect_model` (`hf-deep-nmt inspect`) runs everything on a saved
model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from hf_deep_nmt.plots import (
    STACKS,
    load_pyplot,
    mask_small_weights,
    plot_combination_weights,
    plot_gradient_norms,
    plot_layer_similarity,
    save_figure,
)

GRADIENT_KINDS = ("parameters", "outputs")


def _stack(model: nn.Module, side: str) -> nn.Module:
    """The `side` ("encoder" or "decoder") stack of a model of this package (or of its `DeepNMTModel` backbone)."""
    if side not in STACKS:
        raise ValueError(f"`side` must be one of {STACKS}, got {side!r}.")
    if not (hasattr(model, "get_encoder") and hasattr(model, "get_decoder")):
        raise TypeError(f"Expected a model of this package (encoder and decoder stacks), got {type(model).__name__}.")
    return model.get_encoder() if side == "encoder" else model.get_decoder()


def stack_layers(model: nn.Module, side: str) -> nn.ModuleList:
    """The layers of the `side` ("encoder" or "decoder") stack, bottom first."""
    return _stack(model, side).layers


def _check_sides(sides) -> tuple[str, ...]:
    sides = (sides,) if isinstance(sides, str) else tuple(sides)
    for side in sides:
        if side not in STACKS:
            raise ValueError(f"`sides` must be taken from {STACKS}, got {side!r}.")
    return sides


def _batch_on(model: nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    if "labels" not in batch:
        raise ValueError(f"The batch needs `labels` to compute a loss; it has {sorted(batch)}.")
    device = next(model.parameters()).device
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def parameter_gradient_norms(model: nn.Module, sides=STACKS) -> dict[str, list[float]]:
    """Per layer, `sqrt(sum of squared entries of .grad over the layer's parameters)`, from the gradients the model
    holds now (after a `backward()`). Parameters without a gradient count as zero."""
    norms = {}
    for side in _check_sides(sides):
        values = []
        for layer in stack_layers(model, side):
            squares = [p.grad.detach().float().pow(2).sum() for p in layer.parameters() if p.grad is not None]
            values.append(math.sqrt(float(torch.stack(squares).sum())) if squares else 0.0)
        norms[side] = values
    return norms


def layer_gradient_norms(
    model: nn.Module, batch: Mapping[str, Any], kind: str = "parameters", sides=STACKS
) -> dict[str, list[float]]:
    """Gradient norm of every layer of each stack on `batch` (a dict with `input_ids`, `attention_mask`, `labels`, as
    a `DataCollatorForSeq2Seq` builds it): one forward and backward pass of the model's own loss, in the mode the
    model is in (call `model.eval()` first for a pass without dropout).

    `kind="parameters"`: the L2 norm of d loss / d theta over all parameters of the layer (DS-Init Fig. 1, MSC Fig. 5).
    `kind="outputs"`: the L2 norm of d loss / d y over the layer's output tensor y (the error signal).

    The gradients the model held before are put back afterwards, so this can be called in the middle of training.
    Returns `{"encoder": [layer 1, ..., layer L], "decoder": [...]}`.
    """
    if kind not in GRADIENT_KINDS:
        raise ValueError(f"`kind` must be one of {GRADIENT_KINDS}, got {kind!r}.")
    sides = _check_sides(sides)
    batch = _batch_on(model, batch)
    saved = {name: p.grad for name, p in model.named_parameters()}
    output_norms: dict[str, list[float | None]] = {}
    handles = []
    if kind == "outputs":
        for side in sides:
            layers = stack_layers(model, side)
            output_norms[side] = [None] * len(layers)
            for index, layer in enumerate(layers):
                handles.append(layer.register_forward_hook(_output_gradient_hook(output_norms[side], index)))
    try:
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            loss = model(**batch).loss
            loss.backward()
        if kind == "parameters":
            return parameter_gradient_norms(model, sides)
        return {side: [0.0 if value is None else value for value in values] for side, values in output_norms.items()}
    finally:
        for handle in handles:
            handle.remove()
        for name, p in model.named_parameters():
            p.grad = saved[name]


def _output_gradient_hook(store: list, index: int):
    def hook(module, args, output):
        tensor = output[0] if isinstance(output, tuple) else output
        if tensor.requires_grad:

            def record(grad):
                store[index] = float(grad.detach().float().norm())

            tensor.register_hook(record)

    return hook


class GradientNormCallback(TrainerCallback):
    """Records the per-layer parameter-gradient norms during `Trainer` training (DS-Init Fig. 4, MSC Fig. 5).

    At every optimizer step the norms of the accumulated gradients are taken; every `every` steps their mean over the
    window is appended to `history` as `{"step": ..., "encoder": [...], "decoder": [...]}` and, when `output_file` is
    given, written there as one JSON line. The Trainer clips gradients before this hook: train with
    `max_grad_norm=0` (as the papers do) to record the unclipped norms.
    """

    def __init__(self, every: int = 50, sides=STACKS, output_file: str | Path | None = None):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"`every` must be a positive integer, got {every!r}.")
        self.every = every
        self.sides = _check_sides(sides)
        self.output_file = Path(output_file) if output_file is not None else None
        self.history: list[dict[str, Any]] = []
        self._window: list[dict[str, list[float]]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        self._window.append(parameter_gradient_norms(model, self.sides))
        if len(self._window) == self.every:
            record = {"step": state.global_step + 1}
            for side in self.sides:
                columns = zip(*(norms[side] for norms in self._window))
                record[side] = [sum(column) / len(self._window) for column in columns]
            self.history.append(record)
            self._window = []
            if self.output_file is not None and state.is_world_process_zero:
                self.output_file.parent.mkdir(parents=True, exist_ok=True)
                with self.output_file.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record) + "\n")


def combination_weights(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The combination matrices of the stacks that have one (DLCL or sparse aggregation; the Attention Residuals'
    weights depend on the input, and have none).

    Returns, per such stack, `{"weight": (B+1) x (B+1) lower-triangular tensor, "boundaries": [0, b_1, ..., L]}`:
    row r weighs the stored outputs 0..r (0 = the embedding, j = the output of block j) in the input of block r+1;
    the last row builds the stack output. With DLCL every layer is a block.
    """
    config = model.config
    layouts = {
        "encoder": (config.encoder_layer_aggregation, config.encoder_layers, config.encoder_block_boundaries),
        "decoder": (config.decoder_layer_aggregation, config.decoder_layers, config.decoder_block_boundaries),
    }
    result = {}
    for side, (aggregation, layers, boundaries) in layouts.items():
        if aggregation not in ("dlcl", "sparse"):  # residual, or Attention Residuals (input-dependent: no matrix)
            continue
        weight = _stack(model, side).history.weight
        boundaries = list(boundaries) if aggregation == "sparse" else list(range(layers + 1))
        result[side] = {"weight": weight.detach().float().cpu().tril(), "boundaries": boundaries}
    return result


def layer_outputs(model: nn.Module, batch: Mapping[str, Any], side: str = "encoder") -> list[torch.Tensor]:
    """`[y_0, y_1, ..., y_L]` of one stack on `batch`, without dropout: y_0 the embedding (token embedding scaled, plus
    positions), y_i the output of layer i as the layer returns it (before any combination or final LayerNorm; with
    Hyper-Connections the sum of its residual streams, what the stack's output is made of).
    The decoder side needs `labels` or `decoder_input_ids` in the batch."""
    stack = _stack(model, side)
    device = next(model.parameters()).device
    batch = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    if side == "decoder" and "decoder_input_ids" not in batch:
        if "labels" not in batch:
            raise ValueError("The decoder side needs `labels` or `decoder_input_ids` in the batch.")
        batch["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(batch["labels"])
    ids = batch["input_ids"] if side == "encoder" else batch["decoder_input_ids"]
    outputs: list[torch.Tensor | None] = [None] * len(stack.layers)

    streams = getattr(stack.history, "streams", 0)  # Hyper-Connections: layers return their residual streams

    def capture(index):
        def hook(module, args, output):
            tensor = (output[0] if isinstance(output, tuple) else output).detach()
            outputs[index] = tensor.sum(dim=-2) if streams else tensor  # the streams' sum, as the stack ends

        return hook

    handles = [layer.register_forward_hook(capture(i)) for i, layer in enumerate(stack.layers)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            embedding = stack.embed(ids)
            forward = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "decoder_input_ids")}
            if side == "encoder":
                stack(input_ids=forward["input_ids"], attention_mask=forward.get("attention_mask"))
            else:
                model.base_model(**forward, use_cache=False)  # the encoder-decoder without the output layer
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return [embedding] + outputs


def _sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid positions of each sequence, then over sequences. values, mask: (batch, length)."""
    mask = mask.to(values.dtype)
    return ((values * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def layer_similarity(model: nn.Module, batch: Mapping[str, Any], side: str = "encoder") -> dict[str, list[float]]:
    """SDT §3 (Li et al. 2020): for the layer outputs y_0 (embedding), y_1, ..., y_L of one stack,

        sim(i, j)   = 1/n sum_l cos(y_i(l), y_j(l))
        sim_in(i)   = 1/n sum_l cos(y_i(l), mean_l' y_i(l'))

    over the n non-padding positions l of each sequence, then averaged over the sequences of the batch. Returns
    `{"to_embedding": [sim(i, 0) for i = 1..L], "adjacent": [sim(i, i-1) for i = 1..L],
    "inter": [sim_in(i) for i = 0..L]}`.
    """
    states = layer_outputs(model, batch, side)
    if side == "encoder":
        mask = batch.get("attention_mask")
        reference = batch["input_ids"]
    else:
        mask = batch.get("decoder_attention_mask")
        reference = batch["labels"] if "labels" in batch else batch["decoder_input_ids"]
        if mask is None and "labels" in batch:
            mask = batch["labels"] != -100  # target positions, including the one that predicts </s>
    mask = torch.ones(reference.shape, dtype=torch.bool) if mask is None else mask.bool()
    return similarity_from_states(states, mask)


def similarity_from_states(states: list[torch.Tensor], mask: torch.Tensor) -> dict[str, list[float]]:
    """The SDT similarities of `layer_similarity` from layer outputs `states` = [y_0, ..., y_L], each
    (batch, length, d), and a (batch, length) mask of the positions that count (1) and padding (0)."""
    if len(states) < 2:
        raise ValueError(f"Need the embedding and at least one layer output, got {len(states)} tensor(s).")
    mask = mask.bool().to(states[0].device)
    if mask.shape != states[0].shape[:2]:
        raise ValueError(f"`mask` must have shape {tuple(states[0].shape[:2])}, got {tuple(mask.shape)}.")
    states = [state.float() for state in states]

    def sim(a, b):
        return float(_sequence_mean(torch.nn.functional.cosine_similarity(a, b, dim=-1), mask))

    def inter(state):
        weights = mask.to(state.dtype)[..., None]
        centre = (state * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True).clamp(min=1)
        return sim(state, centre.expand_as(state))

    return {
        "to_embedding": [sim(states[i], states[0]) for i in range(1, len(states))],
        "adjacent": [sim(states[i], states[i - 1]) for i in range(1, len(states))],
        "inter": [inter(state) for state in states],
    }


__all__ = [
    "GRADIENT_KINDS",
    "GradientNormCallback",
    "combination_weights",
    "layer_gradient_norms",
    "layer_outputs",
    "layer_similarity",
    "load_pyplot",
    "mask_small_weights",
    "parameter_gradient_norms",
    "plot_combination_weights",
    "plot_gradient_norms",
    "plot_layer_similarity",
    "save_figure",
    "similarity_from_states",
    "stack_layers",
]
