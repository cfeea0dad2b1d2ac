"""Speed and autograd machinery of the deep-NMT model: how it computes, never what it computes.

`modeling_deep_nmt.py` holds the architecture and imports what it runs on from here: the attention call kept off the
cuDNN backend, the dropout and ReLU traced into compiled CPU training graphs, the training loss through the output
layer in chunks, and the layer history's one-operation-per-row combination. Each computes what its plain counterpart
(`F.scaled_dot_product_attention`, `F.dropout`, `F.relu`, `F.cross_entropy` of the logits, a sum of scaled outputs)
computes. This file ships beside the model file inside every Hub repository (transformers copies the relative import
on `save_pretrained`): it imports only the standard library, torch and transformers, and nothing of the package.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.activations import ACT2FN


def is_tracing() -> bool:
    """True while `torch.compile`, `torch.export` (and the ONNX exporter built on it) or `torch.jit.trace` trace the
    forward: input checks that need the values of tensors (a host synchronisation, a data-dependent branch) are skipped
    there and run in eager calls only."""
    exporting = getattr(torch.compiler, "is_exporting", None)  # torch >= 2.5
    return torch.compiler.is_compiling() or (exporting is not None and exporting()) or torch.jit.is_tracing()


# --- Attention --------------------------------------------------------------------------------------------------
# SDPA backends allowed for masked attention on CUDA when `config.sdpa_avoid_cudnn` is on: every one but cuDNN, whose
# backward returns NaN gradients with an explicit mask at padded lengths of 64 mod 128 (pytorch/pytorch#196678).
SDPA_BACKENDS_WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Device types whose masked attention is restricted to those backends (the cuDNN backend only exists on CUDA).
SDPA_RESTRICTED_DEVICE_TYPES = ("cuda",)


def sdpa_avoiding_cudnn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    avoid_cudnn: bool,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, kept off the cuDNN backend when a mask is passed on CUDA and `avoid_cudnn`.

    The condition is on Python values and the device type only (no host synchronisation), so it costs nothing on
    CPU and `torch.compile` traces the backend restriction as a context manager without a graph break."""
    if avoid_cudnn and attention_mask is not None and query.device.type in SDPA_RESTRICTED_DEVICE_TYPES:
        with sdpa_kernel(SDPA_BACKENDS_WITHOUT_CUDNN):
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout)


# --- Compiled CPU training --------------------------------------------------------------------------------------
# Training graphs that `torch.compile` builds for the CPU avoid saving boolean tensors for backward: Inductor's CPU
# code writes a boolean tensor about 30x slower than a float one (AVX2, torch 2.13: 28 ms against 0.8 ms for 4M
# values), and a base-size training step saves one per dropout and per ReLU. Eager code and other devices keep
# `F.dropout` and `F.relu`; the functions below are traced in their place: ReLU's values and gradients, dropout's
# distribution and scaling (compiled dropout draws other numbers than eager dropout in any case).
def compiling_for_cpu_training(hidden_states: torch.Tensor) -> bool:
    """True while `torch.compile` traces a CPU forward that records gradients (Python values only: no graph break)."""
    return (
        torch.compiler.is_compiling()
        and hidden_states.device.type == "cpu"
        and torch.is_grad_enabled()
        and hidden_states.requires_grad
    )


class DeepNMTCompiledCpuDropout(torch.autograd.Function):
    """Inverted dropout whose kept positions are saved as a uint8 0/1 tensor (as small as `F.dropout`'s boolean
    mask): `y = x * keep / (1 - p)`, `dx = dy * keep / (1 - p)`, keep ~ Bernoulli(1 - p)."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor, p: float) -> torch.Tensor:
        random = torch.rand(hidden_states.shape, device=hidden_states.device, dtype=torch.float32)
        keep = torch.where(random >= p, 1, 0).to(torch.uint8)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(keep)
        return hidden_states * keep * ctx.scale

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return grad_output * keep * ctx.scale, None


class DeepNMTCompiledCpuReLU(torch.autograd.Function):
    """ReLU whose backward multiplies by the sign of the saved output (0 or 1), which the next linear layer saves
    anyway: written as `threshold_backward`, the compiled graph stores a boolean mask beside it. Gradients are ReLU's
    exactly where they are finite (an infinite one reaching a unit that is off gives NaN instead of 0)."""

    @staticmethod
    def forward(ctx, hidden_states: torch.Tensor) -> torch.Tensor:
        output = torch.relu(hidden_states)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        (output,) = ctx.saved_tensors
        return grad_output * torch.sign(output)


def dropout(hidden_states: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout`; `DeepNMTCompiledCpuDropout` in a compiled CPU training graph."""
    if training and 0.0 < p < 1.0 and compiling_for_cpu_training(hidden_states):
        return DeepNMTCompiledCpuDropout.apply(hidden_states, p)
    return F.dropout(hidden_states, p=p, training=training)


class DeepNMTReLU(nn.Module):
    """`activation_function="relu"`: `F.relu`, and `DeepNMTCompiledCpuReLU` in a compiled CPU training graph
    (training mode: exported evaluation graphs keep `F.relu`)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.training and compiling_for_cpu_training(hidden_states):
            return DeepNMTCompiledCpuReLU.apply(hidden_states)
        return F.relu(hidden_states)


def activation_function(name: str) -> nn.Module:
    """The feed-forward activation called `name` (transformers' `ACT2FN` names)."""
    return DeepNMTReLU() if name == "relu" else ACT2FN[name]


# --- The training loss in chunks -------------------------------------------------------------------------------
# How many logits `DeepNMTChunkedLinearCrossEntropy` computes at a time (rows = this // vocabulary size): 32 MB of
# float32 on a CPU (for 2048 tokens x 32000 types, forward + backward took 1.79 s in chunks of 8M values, 2.03 s of
# 4M, 1.88 s whole, 2.02 s through `F.cross_entropy`: medians of 7 on 2 cores), 256 MB on a GPU (few chunks: few
# launches).
LOSS_CHUNK_VALUES = {"cpu": 1 << 23, "cuda": 1 << 26}


class DeepNMTChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `hidden @ weight.T` against `labels` (-100 ignored; label smoothing as
    `F.cross_entropy`'s: `(1 - eps) * nll + eps * mean over the vocabulary of -log p`), computed `chunk_rows` target
    tokens at a time so that the (tokens, vocabulary) logits never exist whole. The gradients are computed with the
    loss, chunk by chunk (softmax minus the smoothed one-hot, times 1 / tokens, multiplied into `d hidden` and
    accumulated into `d weight`): the backward only scales them by the incoming gradient. The same three matrix
    products as the unchunked output layer, and none of its (tokens, vocabulary) float32 tensors: logits, their
    log-softmax and their gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, label_smoothing: float, chunk_rows: int):
        valid = labels != -100
        targets = torch.where(valid, labels, 0)
        # logits, loss and the weight's gradient in float32 at least (half-precision products are upcast)
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        # 1 / tokens, as F.cross_entropy's mean: 0 tokens give inf, then NaN, as there.
        inverse_count = valid.sum().to(dtype).reciprocal()
        vocabulary = weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        same_dtype = hidden.dtype == dtype  # float32 or float64 products: no upcast of the logits
        grad_weight = None
        if ctx.needs_input_grad[1]:  # float32 products write the first chunk's product into it; others add to zeros
            written = same_dtype and hidden.shape[0] > 0
            grad_weight = (torch.empty if written else torch.zeros)(weight.shape, dtype=dtype, device=weight.device)
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        # one logits buffer for every chunk: a fresh allocation per chunk is mapped and page-faulted anew on a CPU
        buffer = torch.empty(min(chunk_rows, hidden.shape[0]), vocabulary, dtype=dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                chunk_hidden, chunk_targets, chunk_valid = hidden[rows], targets[rows], valid[rows]
                logits = buffer[: chunk_hidden.shape[0]]
                if same_dtype:
                    torch.mm(chunk_hidden, weight.t(), out=logits)
                else:
                    logits.copy_(torch.mm(chunk_hidden, weight.t()))
                target_logits = logits.gather(1, chunk_targets[:, None]).squeeze(1)
                token_losses = -(1.0 - label_smoothing) * target_logits
                if label_smoothing:
                    token_losses = token_losses - label_smoothing * logits.mean(dim=1)
                # log-sum-exp by hand, in place: `torch.logsumexp` and `log_softmax` take 2-2.5x as long on a CPU
                row_max = logits.amax(dim=1)
                exps = logits.sub_(row_max[:, None]).exp_()
                sums = exps.sum(dim=1)
                token_losses = token_losses + sums.log() + row_max
                total += torch.where(chunk_valid, token_losses, 0.0).sum()
                if grad_hidden is None and grad_weight is None:
                    continue
                # d loss / d logits = (softmax - (1 - eps) * one-hot - eps / V) / tokens on counted rows, 0 elsewhere
                row_weights = torch.where(chunk_valid, inverse_count, 0.0)
                grad_logits = exps.mul_((row_weights / sums)[:, None])
                if label_smoothing:
                    grad_logits.sub_((row_weights * (label_smoothing / vocabulary))[:, None])
                grad_logits.scatter_add_(1, chunk_targets[:, None], ((label_smoothing - 1.0) * row_weights)[:, None])
                grad_logits = grad_logits.to(hidden.dtype)
                if grad_hidden is not None:
                    torch.mm(grad_logits, weight, out=grad_hidden[rows])
                if grad_weight is not None and same_dtype and start == 0:
                    torch.mm(grad_logits.t(), chunk_hidden, out=grad_weight)
                elif grad_weight is not None and same_dtype:
                    grad_weight.addmm_(grad_logits.t(), chunk_hidden)
                elif grad_weight is not None:  # a half-precision product, accumulated in float32
                    grad_weight.add_(torch.mm(grad_logits.t(), chunk_hidden))
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total * inverse_count

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_output).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """`F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, label_smoothing=...)` in float32 (or float64) by
    `DeepNMTChunkedLinearCrossEntropy`; under autocast the matrix products run in autocast's type, as `nn.Linear`'s
    would."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    budget = LOSS_CHUNK_VALUES.get(device_type, LOSS_CHUNK_VALUES["cuda"])
    chunk_rows = max(1, budget // weight.shape[0])
    labels = labels.reshape(-1).to(hidden.device)
    return DeepNMTChunkedLinearCrossEntropy.apply(hidden, weight, labels, label_smoothing, chunk_rows)


# --- The layer history's combination -----------------------------------------------------------------------------
class DeepNMTHistoryBuffers:
    """What `DeepNMTHistoryRow`'s autograd nodes keep of a block history: `buffer` (size, *shape) receives each
    stored output when the row that first reads it is combined (`columns`: the same memory as one column per stored
    output), `weight` the weight matrix detached and cast to the buffer's dtype, and `grads` / `grad_columns` the
    backward pass's. None of these has an autograd history: a node that kept a tensor of the graph it belongs to
    (the row outputs, say) would be a reference cycle through autograd that Python's collector cannot free, and every
    training step would keep its whole history (on a GPU, memory grows until it runs out)."""

    __slots__ = ("buffer", "columns", "weight", "grads", "grad_columns")

    def __init__(self, embedding: torch.Tensor, weight: torch.Tensor, size: int):
        self.buffer = embedding.new_empty((size, *embedding.shape))
        self.columns = self.buffer.view(size, -1).t()  # (elements, size)
        self.weight = weight.detach().to(embedding.dtype)
        self.grads = self.grad_columns = None


class DeepNMTHistoryState:
    """Per-call state of a block history (kept in the caller's `forward`, never on the module or an autograd node).

    `buffers` are what the rows' autograd nodes share (`DeepNMTHistoryBuffers`); `count` is the number of stored
    outputs so far, `newest` the last of them (not yet in the buffer), `last` the newest layer output,
    `previous_row` the last combination."""

    __slots__ = ("buffers", "count", "newest", "last", "previous_row")

    def __init__(self, embedding: torch.Tensor, weight: torch.Tensor, size: int):
        self.buffers = DeepNMTHistoryBuffers(embedding, weight, size)
        self.count = 1
        self.newest = self.last = embedding
        self.previous_row = None

    @property
    def buffer(self) -> torch.Tensor:
        return self.buffers.buffer


class DeepNMTTracedHistoryState:
    """Per-call state of a block history while `torch.compile` / `torch.export` trace the forward: the stored outputs
    as a list, each row a sum of scaled outputs (the compiler fuses a row into one kernel; the custom autograd function
    of eager calls would break the graph)."""

    __slots__ = ("stored", "count", "newest", "last")

    def __init__(self, embedding: torch.Tensor):
        self.stored: list[torch.Tensor] = []
        self.count = 1
        self.newest = self.last = embedding


def without_autocast(device_type: str):
    """The combination keeps the stored outputs' precision, as the additions it replaces did: under autocast a
    matrix-vector product would otherwise run in half precision."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


class DeepNMTHistoryRow(torch.autograd.Function):
    r"""
    Row r of the history combination, `sum_{j<=r} W[r, j] y_j`, as one matrix-vector product over the buffer of
    stored outputs.

    Forward writes `y_r` (the newest stored output) into `buffer[r]` and reduces `buffer[:r+1]` by the weight row.
    The older outputs are read from the buffer, not passed in, so autograd records one node per row and nothing per
    (row, output) pair: O(L) nodes, saved tensors and kernels for L rows, where separate scaled additions record
    O(L^2).

    Row r also takes the output of row r - 1 as an input whose gradient is always zero: the edge makes every
    backward pass run the rows from the top down, whatever the layers between them. Row r writes its output gradient
    `g_r` into `grads[r]` and returns the gradient of `y_r`, `sum_{k>=r} W[k, r] g_k` (one product with column r,
    complete then since every row above has run). Row 0, the last to run, also returns the gradient of the whole
    weight matrix at once, the lower triangle of `grads @ buffer^T`, and releases `grads`.
    """

    @staticmethod
    def forward(ctx, weight, newest, previous_row, state: DeepNMTHistoryBuffers, row: int):
        state.buffer[row].copy_(newest)
        with without_autocast(newest.device.type):
            combined = torch.mv(state.columns[:, : row + 1], state.weight[row, : row + 1])
        ctx.state, ctx.row, ctx.newest_dtype = state, row, newest.dtype
        ctx.weight_dtype = weight.dtype if weight is not None else None
        return combined.view(newest.shape)

    @staticmethod
    def backward(ctx, grad):
        state, row = ctx.state, ctx.row
        if state.grads is None:
            state.grads = torch.zeros_like(state.buffer)
            state.grad_columns = state.grads.view(state.grads.shape[0], -1).t()
        state.grads[row].copy_(grad)
        grad_newest = grad_weight = None
        with without_autocast(grad.device.type):
            if ctx.needs_input_grad[1]:
                grad_newest = torch.mv(state.grad_columns[:, row:], state.weight[row:, row]).view(grad.shape)
                if grad_newest.dtype != ctx.newest_dtype:
                    grad_newest = grad_newest.to(ctx.newest_dtype)
            if row == 0:
                if ctx.needs_input_grad[0]:
                    grad_weight = torch.mm(state.grad_columns.t(), state.columns).tril_().to(ctx.weight_dtype)
                state.grads = state.grad_columns = None
        return grad_weight, grad_newest, None, None, None


def start_history(embedding: torch.Tensor, weight: torch.Tensor, size: int):
    """The per-call state of a block history of `size` stored outputs whose first is `embedding`: the traced state
    while the forward is traced, else the buffer that `DeepNMTHistoryRow` combines."""
    if is_tracing():
        return DeepNMTTracedHistoryState(embedding)
    return DeepNMTHistoryState(embedding, weight, size)


def combine_history_row(state: DeepNMTHistoryState | DeepNMTTracedHistoryState, weight: torch.Tensor) -> torch.Tensor:
    """Row r = `state.count - 1` of the combination, `sum_{j<=r} weight[r, j] y_j`, once the newest stored output
    `y_r` is pushed. Eager calls: one `DeepNMTHistoryRow` (row 0 carries the weight gradient); traced: a sum of
    scaled outputs."""
    row = state.count - 1
    if isinstance(state, DeepNMTTracedHistoryState):
        state.stored.append(state.newest)
        weight = weight.to(state.newest.dtype)
        combined = weight[row, 0] * state.stored[0]
        for column in range(1, row + 1):
            combined = combined + weight[row, column] * state.stored[column]
        return combined
    combined = DeepNMTHistoryRow.apply(
        weight if row == 0 else None, state.newest, state.previous_row, state.buffers, row
    )
    state.previous_row = combined
    return combined
