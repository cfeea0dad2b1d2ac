"""Deep Transformer encoder-decoder for translation: one configurable backbone for the deep-NMT methods.

Pre-norm / post-norm sublayers and the dynamic linear combination of layers (DLCL, Wang et al. 2019) are settings of
[`DeepNMTConfig`]; the named classes at the bottom only pick defaults. This file holds the architecture; how it is
computed fast (attention backends, compiled CPU training, the chunked loss, the layer history's autograd) lives in
`kernels_deep_nmt.py` beside it, its contract with transformers (the tested releases, the decoding state's name,
the checks of forward arguments and loaded weights) in `contract_deep_nmt.py`, and its sizes known before it is built
(the parameter count, the memory of a decoding, a config held against the shapes of its weights) in
`sizes_deep_nmt.py`. All of them ship verbatim inside every Hub repository of the package, with
`configuration_deep_nmt.py`: they import only the standard library, torch, transformers and each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache, StaticLayer
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPast, Seq2SeqLMOutput, Seq2SeqModelOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .configuration_deep_nmt import (
    CACHE_LAYER_TYPE,
    DEFAULT_MAX_OUTPUT_TOKENS,
    MAX_GENERATE_TOKENS,
    AttnResConfig,
    DeepNMTConfig,
    DeepNMTGenerationConfig,
    DeepNormConfig,
    DenseFormerConfig,
    DlclConfig,
    DsInitConfig,
    HyperConnectionsConfig,
    MixLnConfig,
    MscConfig,
    SdtConfig,
    hyper_connection_sublayers,
    layer_is_pre_norm,
    msc_attends_context,
    stack_has_final_norm,
)
from .contract_deep_nmt import (
    LOADING,
    TESTED_TRANSFORMERS,
    LoadingRequest,
    check_extra_arguments,
    check_fits,
    check_loaded_weights,
    check_step_has_state,
    check_transformers_window,
    decoding_state,
    take_decoding_state,
    warn_nonfinite_weights,
    with_decoding_state,
)
from .kernels_deep_nmt import (
    DeepNMTHistoryState,
    DeepNMTTracedHistoryState,
    activation_function,
    chunked_linear_cross_entropy,
    combine_history_row,
    dropout,
    is_tracing,
    sdpa_avoiding_cudnn,
    start_history,
)
from .sizes_deep_nmt import check_before_building, decoding_memory

logger = logging.get_logger(__name__)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher-forcing decoder inputs: `[start, y_1, ..., y_{n-1}]`, with label padding (-100) turned into `pad`."""
    shifted = labels.new_zeros(labels.shape)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


def padding_mask_to_additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """`(batch, key_len)` 1/0 mask -> `(batch, 1, 1, key_len)` additive mask; None without a mask. A given mask always
    goes into the computation (never dropped after looking at its values), so traced graphs keep it."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask.bool(), torch.finfo(dtype).min)[
        :, None, None, :
    ]


def check_token_ids(ids: object, name: str) -> None:
    """`ids` must be a tensor of integer token ids (torch.long, or torch.int): `ValueError` naming `name` and what it
    got otherwise (float ids would reach the embedding and fail there, in torch's words). Reads the dtype only."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(
            f"`{name}` must be a tensor of token ids (torch.long), got {type(ids).__name__}; tokenize with "
            "`tokenizer(..., return_tensors='pt')`."
        )
    if ids.dtype not in (torch.long, torch.int32):
        raise ValueError(
            f"`{name}` must hold integer token ids (torch.long or torch.int32), got {ids.dtype}; tokenize with "
            f"`tokenizer(..., return_tensors='pt')`, or convert with `{name}.long()` if the values are ids."
        )


def _inspectable(tensor: torch.Tensor) -> bool:
    """Whether a value of `tensor` may be read here: on the CPU (no device to wait for) and not while tracing."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling() and not torch.jit.is_tracing()


def warn_of_an_empty_loss(loss: torch.Tensor, labels: torch.Tensor) -> None:
    """Warn once when the loss is NaN because every label is -100 (ignored): the mean over no token is 0 / 0, and
    the update it drives is NaN too. Read on the CPU only (elsewhere reading it would wait for the device at every
    step; the Trainer's guard against non-finite losses names the step there)."""
    if _inspectable(loss) and bool(torch.isnan(loss)) and not bool(labels.ne(-100).any()):
        logger.warning_once(
            "Every label of this batch is -100 (ignored by the loss), so the loss is NaN (a mean over no token): "
            "give labels of target ids, with -100 only on padding."
        )


def check_output_cap(cap: int, new_tokens: bool) -> None:
    """`ValueError` naming the setting and the bound when one `generate()` call may decode more than
    `MAX_GENERATE_TOKENS` output tokens (`new_tokens`: the cap is `max_new_tokens`, else `max_length`)."""
    if cap > MAX_GENERATE_TOKENS:
        raise ValueError(
            f"`{'max_new_tokens' if new_tokens else 'max_length'}` allows {cap:,} output tokens, over the "
            f"{MAX_GENERATE_TOKENS:,} one generate() call decodes at most (each step attends every earlier output, "
            f"so the time grows with the square of the length); lower it (a new model's cap is "
            f"{DEFAULT_MAX_OUTPUT_TOKENS:,} tokens)."
        )


def warn_of_padding_read_as_text(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad: int) -> None:
    """Warn once when `input_ids` hold the pad id where `attention_mask` is 1 (or where no mask is given, in a row of
    pad ids only): those positions are encoded as text and attended, and the translation of a row of padding is
    made up. Reads the ids once per `generate()` call, which reads the device at every step anyway."""
    if pad is None or input_ids.dim() != 2 or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return
    padding = input_ids.eq(pad)
    read = padding & attention_mask.bool() if attention_mask is not None else padding.all(dim=1, keepdim=True)
    if bool(read.any()):
        rows = int(read.any(dim=1).sum())
        logger.warning_once(
            f"`input_ids` hold the pad id ({pad}) where `attention_mask` is 1 (or a row of pad ids only) in {rows} "
            "row(s): padding is encoded and translated as text. Give `attention_mask` 0 on padding (the tokenizer's "
            "`return_tensors='pt'` output does), and leave out empty rows."
        )


@dataclass
class DeepNMTEncoderOutput(BaseModelOutput):
    r"""
    Encoder output. `last_hidden_state` is what a plain decoder attends to. Under MSC it is the normalised output of
    the top block, and two batch-first stacks are added (so that `generate()` expands them for beams like any other
    encoder tensor):

    block_outputs (`torch.FloatTensor` of shape `(batch, num_blocks, source_length, d_model)`, *optional*):
        `LN_n(B^n)`, the normalised output of encoder block n, attended by decoder layer n.
    context_states (`torch.FloatTensor` of shape `(batch, num_blocks, source_length, d_model)`, *optional*):
        The context states `C^1 .. C^N`, attended by decoder layer n (`C^n`); present when the decoder attends to
        the context.
    """

    block_outputs: torch.FloatTensor | None = None
    context_states: torch.FloatTensor | None = None

    def layer_memory(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What decoder layer `index` attends: `(states, context states or None)`. One entry for every layer of a
        plain model (the encoder output); under MSC, block `index` and context `index`."""
        if self.block_outputs is None:
            return self.last_hidden_state, None
        context = None if self.context_states is None else self.context_states[:, index]
        return self.block_outputs[:, index], context


class DeepNMTSinusoidalPositions(nn.Module):
    """Sinusoidal positions (sin in the first half, cos in the second), computed for any position on the fly.

    `frequencies` (`config.sinusoid_frequencies`): `"fairseq"`, 10000^(-i / (d/2 - 1)) for pair i, in float32; or
    `"marian"`, 10000^(-2i / d) as transformers' `MarianMTModel` builds its table: angles and sines in float64 (float32
    on MPS, which has no float64), the table then in float32."""

    def __init__(self, d_model: int, frequencies: str = "fairseq"):
        super().__init__()
        self.d_model = d_model
        self.frequencies = frequencies

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        half = self.d_model // 2
        if self.frequencies == "marian":
            dtype = torch.float32 if positions.device.type == "mps" else torch.float64
            exponents = torch.arange(half, device=positions.device, dtype=dtype) * (2.0 / self.d_model)
            angles = positions.to(dtype)[:, None] / torch.pow(10000.0, exponents)[None, :]  # (seq_len, half)
            return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1).float()
        scale = math.log(10000.0) / max(half - 1, 1)
        inv_freq = torch.exp(torch.arange(half, device=positions.device, dtype=torch.float32) * -scale)
        angles = positions.float()[:, None] * inv_freq[None, :]  # (seq_len, half)
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
        if self.d_model % 2:
            table = F.pad(table, (0, 1))
        return table  # (seq_len, d_model)


# Interface version of the cache layers below. Cache layers are found by `_layer_type` in one registry per process
# (the class imported last wins), so a model may be handed the layers of another copy of this file (another Hub
# repository loaded with remote code): those of the same version are used as they are, others are replaced by this
# file's own before they hold anything.
CACHE_LAYER_VERSION = 2
_CACHE_SLOTS = ("keys", "values", "running_sum", "context_keys", "context_values")


class DeepNMTCacheLayerMixin:
    r"""
    Decoding state of one decoder layer: one object per layer in each half of the `EncoderDecoderCache`. Named slots:

    - `keys`, `values`: self-attention keys/values appended step by step (self-attention half); the keys/values of
      the encoder memory the layer attends, projected once per decoding (cross-attention half);
    - `running_sum`: the running sum of the averaged states of MAtt / AAN decoders, `(batch, 1, d_model)` in float32
      whatever the model's dtype (so that long bf16/fp16 outputs do not drift), with the number of states added;
    - `context_keys`, `context_values`: under MSC, the keys/values of the context state `C^n` (cross-attention half).

    The attention modules use three public methods only: `update(keys, values)` (append), `remember(project)` and
    `remember_context(project)` (project an encoder-side memory on the first decoding call, read it afterwards), and
    `update_average(states)`. Beam reordering, batch selection/expansion and reset move every filled slot.
    [`DeepNMTDynamicCacheLayer`] grows by concatenation; [`DeepNMTStaticCacheLayer`] preallocates and writes in place,
    for `torch.compile` and CUDA graphs.
    """

    _layer_type = CACHE_LAYER_TYPE
    deep_nmt_cache_version = CACHE_LAYER_VERSION

    def _init_slots(self) -> None:
        self.running_sum: torch.Tensor | None = None
        self.context_keys: torch.Tensor | None = None
        self.context_values: torch.Tensor | None = None
        self.memory_filled = False

    def remember(self, project) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the encoder memory: `project()` (returning them) on the first decoding call, then read."""
        if not self.memory_filled:
            self.keys, self.values = self._keep(project())
            self.dtype, self.device = self.keys.dtype, self.keys.device
            self.memory_filled = self.is_initialized = True
        return self.keys, self.values

    def remember_context(self, project) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the MSC context state, like [`remember`] for the encoder memory."""
        if self.context_keys is None:
            self.context_keys, self.context_values = self._keep(project())
        return self.context_keys, self.context_values

    def _keep(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return tensors

    def _filled_slots(self) -> list[str]:
        return [name for name in _CACHE_SLOTS if getattr(self, name, None) is not None]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def crop(self, tokens_to_remove: int) -> None:
        if self.running_sum is not None and tokens_to_remove != 0:
            raise NotImplementedError(
                "A running-sum decoder state (MAtt / AAN) keeps no per-token history and cannot be cropped; "
                "assisted or speculative decoding is not available for these decoders."
            )
        super().crop(tokens_to_remove)


class DeepNMTDynamicCacheLayer(DeepNMTCacheLayerMixin, DynamicLayer):
    """The cache layer `generate()` builds by default: slots grow by concatenation (see [`DeepNMTCacheLayerMixin`])."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._init_slots()
        self.steps = 0

    def update_average(self, states: torch.Tensor) -> torch.Tensor:
        """Add `states` (batch, new_len, d) to the running sum; return their causal means over everything seen,
        current included."""
        sums = torch.cumsum(states.float(), dim=1)
        if self.running_sum is not None:
            sums = sums + self.running_sum
        counts = torch.arange(self.steps + 1, self.steps + 1 + states.shape[1], device=states.device)
        self.running_sum = sums[:, -1:]
        self.steps += states.shape[1]
        return (sums / counts[None, :, None]).to(states.dtype)

    def get_seq_length(self) -> int:
        return self.steps if self.running_sum is not None else super().get_seq_length()

    def _select(self, select) -> None:
        for name in self._filled_slots():
            setattr(self, name, select(getattr(self, name)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(lambda tensor: tensor[indices.to(tensor.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        super().reset()
        self._init_slots()
        self.steps = 0


class DeepNMTStaticCacheLayer(DeepNMTCacheLayerMixin, StaticLayer):
    """Preallocated counterpart of [`DeepNMTDynamicCacheLayer`], built for `cache_implementation="static"`: keys and
    values live in `max_cache_len` slots written in place (unfilled slots are masked by the decoder), the running sum
    and the step count (`cumulative_length`) are tensors updated in place, and every slot keeps its address, so a
    compiled decoding step replays as one CUDA graph. Slots are allocated on the first (eager) decoding call."""

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len=max_cache_len, **kwargs)
        self._init_slots()

    def _keep(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not is_tracing():
            for tensor in tensors:
                torch._dynamo.mark_static_address(tensor)
        return tensors

    def update_average(self, states: torch.Tensor) -> torch.Tensor:
        """As [`DeepNMTDynamicCacheLayer.update_average`], in place."""
        if self.running_sum is None:
            zeros = states.new_zeros((states.shape[0], 1, states.shape[-1]), dtype=torch.float32)
            self.running_sum, self.cumulative_length = self._keep((zeros, self.cumulative_length.to(states.device)))
        sums = torch.cumsum(states.float(), dim=1) + self.running_sum
        counts = self.cumulative_length + torch.arange(1, states.shape[1] + 1, device=states.device)
        self.running_sum.copy_(sums[:, -1:])
        self.cumulative_length.add_(states.shape[1])
        return (sums / counts[None, :, None]).to(states.dtype)

    def get_seq_length(self):
        """Tokens decoded so far: a tensor once anything is written (no host synchronisation), else 0."""
        if self.running_sum is not None or (self.is_initialized and not self.memory_filled):
            return self.cumulative_length
        return 0

    def _select(self, select) -> None:
        for name in self._filled_slots():
            tensor = getattr(self, name)
            tensor.copy_(select(tensor))

    def reset(self) -> None:
        if self.memory_filled:
            self.is_initialized = False  # the memory is replaced on the next call, not zeroed
        super().reset()
        self.cumulative_length.zero_()
        if self.running_sum is not None:
            self.running_sum.zero_()
        self.context_keys = self.context_values = None
        self.memory_filled = False


def cache_layers_of(half: Cache, num_layers: int) -> list:
    """The cache layers of one half of an `EncoderDecoderCache`, made this file's own where needed.

    Layers of this file's interface version are used as they are. Empty layers of another kind (a `DynamicCache()`
    built without the config, plain `DynamicLayer`/`StaticLayer`, or those of another version of this file registered
    under the same type) are replaced by the matching [`DeepNMTDynamicCacheLayer`] / [`DeepNMTStaticCacheLayer`];
    a filled foreign layer is refused."""
    layers = half.layers
    if len(layers) < num_layers and getattr(half, "layer_class_to_replicate", None) is not None:
        layers.extend(None for _ in range(num_layers - len(layers)))
    if len(layers) < num_layers:
        raise TypeError(
            f"The cache has {len(layers)} layers for a decoder of {num_layers}: build it from the model config, "
            "`EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))`, or let the "
            "model or `generate()` create it."
        )
    for index, layer in enumerate(layers[:num_layers]):
        if getattr(layer, "deep_nmt_cache_version", None) == CACHE_LAYER_VERSION:
            continue
        if layer is not None and layer.get_seq_length() != 0:
            raise TypeError(
                f"Cache layer {index} is a {type(layer).__name__} that already holds states this decoder cannot read "
                "(its state also has running sums or MSC context keys): build the cache from the model config, "
                "`EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))`, or let "
                "the model or `generate()` create it."
            )
        if layer is not None and getattr(layer, "is_compileable", False):
            layers[index] = DeepNMTStaticCacheLayer(max_cache_len=layer.max_cache_len)
        else:
            layers[index] = DeepNMTDynamicCacheLayer()
    return layers


def causal_average(states: torch.Tensor, cache_layer=None) -> torch.Tensor:
    """Mean of `states` (batch, len, d) over positions 0..t, current included, for every t (AAN / MAtt average).

    Without a cache: one cumulative sum, no T x T matrix. With one: continued from the running sum of the cache layer.
    """
    if cache_layer is None:
        counts = torch.arange(1, states.shape[1] + 1, device=states.device)
        return (torch.cumsum(states.float(), dim=1) / counts[None, :, None]).to(states.dtype)
    return cache_layer.update_average(states)


def depth_scale(config: DeepNMTConfig, layer_idx: int | None) -> float:
    """DS-Init's factor on the Glorot bound of every matrix of layer `layer_idx` (0-based, counted per stack; depth
    l = layer_idx + 1): alpha / sqrt(l) (paper) or sqrt(alpha) * l^(-1/4) (reference code). 1 without DS-Init and for
    matrices outside the layers (`layer_idx` None)."""
    if config.init_scheme != "ds_init" or layer_idx is None:
        return 1.0
    depth, alpha = layer_idx + 1, config.ds_init_alpha
    return alpha / math.sqrt(depth) if config.ds_init_mode == "paper" else math.sqrt(alpha) * depth**-0.25


def deepnorm_gains(config: DeepNMTConfig, side: str | None) -> tuple[float, float] | None:
    """DeepNorm's initialisation gains of a layer of `side`: `(gain of the query/key projections, gain beta of the
    value/output projections and the FFN matrices)`, `(1, beta)`; None without `deepnorm`."""
    if not config.deepnorm:
        return None
    if side is None:
        raise ValueError("A DeepNorm layer needs its stack (`side='encoder'` or `'decoder'`): its gains depend on it.")
    return 1.0, config.deepnorm_constants(side)[1]


class DeepNMTLinear(nn.Linear):
    """A weight matrix with its initialisation (`_init_weights`), zero bias, and the matrix drawn either
    Glorot-uniform in +-`init_scale * sqrt(6 / glorot_fan)` or (`init_normal`, DeepNorm's Xavier-normal) from
    N(0, (init_scale * sqrt(2 / glorot_fan))^2). `glorot_fan` is fan-in + fan-out of the matrix as the reference
    implementation stores it (see `init_scheme` in the config's docs), `init_scale` DS-Init's depth factor
    (`depth_scale`) or DeepNorm's gain (`deepnorm_gains`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        glorot_fan: int | None = None,
        init_scale: float = 1.0,
        init_normal: bool = False,
    ) -> None:
        super().__init__(in_features, out_features)
        self.glorot_fan = glorot_fan if glorot_fan is not None else in_features + out_features
        self.init_scale = init_scale
        self.init_normal = init_normal

    @classmethod
    def in_layer(
        cls,
        in_features: int,
        out_features: int,
        config: DeepNMTConfig,
        side: str | None,
        layer_idx: int | None,
        reads_positions: bool = False,
        glorot_fan: int | None = None,
    ) -> DeepNMTLinear:
        """A matrix of layer `layer_idx` of stack `side`, initialised as its place asks: with DeepNorm, Xavier-normal
        over its own fans with gain 1 where it `reads_positions` (query and key maps, the AAN gate) and gain beta
        elsewhere (value and output maps, FFNs); else Glorot-uniform over `glorot_fan` (default fan-in + fan-out)
        scaled by DS-Init's depth factor."""
        gains = deepnorm_gains(config, side)
        if gains is not None:
            gain = gains[0] if reads_positions else gains[1]
            return cls(in_features, out_features, in_features + out_features, gain, init_normal=True)
        return cls(in_features, out_features, glorot_fan, depth_scale(config, layer_idx))

    def extra_repr(self) -> str:
        drawn = ", normal" if self.init_normal else ""
        return f"{super().extra_repr()}, glorot_fan={self.glorot_fan}, init_scale={self.init_scale:.6g}{drawn}"


class DeepNMTAttention(nn.Module):
    """Multi-head scaled dot-product attention (SDPA). Decoding state goes to the `EncoderDecoderCache` only."""

    # As a decoder's self-attention it reads the decoder's causal (and target padding) mask; the averaging sublayers
    # are causal by construction and take none.
    takes_causal_mask = True

    def __init__(
        self,
        config: DeepNMTConfig,
        num_heads: int,
        is_cross_attention: bool,
        layer_idx: int | None,
        context_memory: bool = False,
        *,
        side: str | None = None,
    ):
        super().__init__()
        self.embed_dim = width = config.d_model
        self.num_heads = num_heads
        self.head_dim = config.d_model // num_heads
        self.dropout = config.attention_dropout
        self.avoid_cudnn = config.sdpa_avoid_cudnn
        self.is_cross_attention = is_cross_attention
        # MSC's context attention: a second cross-attention of the layer, whose keys/values are cached in the
        # `context_keys`/`context_values` slots of the layer's cache layer.
        self.context_memory = context_memory
        self.is_causal = False  # causality comes from the explicit mask built by the decoder
        self.layer_idx = layer_idx
        # Glorot fans of the reference packing: fairseq stores Q/K/V as one d x 3d matrix (fan 4d); the DS-Init code
        # packs self-attention Q/K/V the same way but keeps separate d x d cross-attention maps (fan 2d).
        packed = not (is_cross_attention and config.init_scheme == "ds_init")
        projection_fan = (4 if packed else 2) * width
        place = (config, side, layer_idx)
        self.q_proj = DeepNMTLinear.in_layer(width, width, *place, reads_positions=True, glorot_fan=projection_fan)
        self.k_proj = DeepNMTLinear.in_layer(width, width, *place, reads_positions=True, glorot_fan=projection_fan)
        self.v_proj = DeepNMTLinear.in_layer(width, width, *place, glorot_fan=projection_fan)
        self.out_proj = DeepNMTLinear.in_layer(width, width, *place)
        # Relative position keys (self-attention only): 2k+1 vectors a_{-k..k}, shared by the heads of this layer.
        self.relative_window = 0 if is_cross_attention else config.relative_position_window
        self.relative_keys = (
            nn.Parameter(torch.empty(2 * self.relative_window + 1, self.head_dim)) if self.relative_window else None
        )

    @classmethod
    def in_decoder(cls, config: DeepNMTConfig, layer_idx: int, is_cross_attention: bool) -> DeepNMTAttention:
        """The decoder's self- or cross-attention sublayer (`DECODER_ATTENTION_CLASSES`)."""
        return cls(config, config.decoder_attention_heads, is_cross_attention, layer_idx, side="decoder")

    def _split_heads(self, states: torch.Tensor) -> torch.Tensor:
        batch, length, _ = states.shape
        return states.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)  # (batch, heads, len, d_h)

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache_layer: DeepNMTCacheLayerMixin | None = None,
        average_cache_layer: DeepNMTCacheLayerMixin | None = None,
    ) -> torch.Tensor:
        """`cache_layer`: this sublayer's state in the decoding cache. `average_cache_layer`: the layer's state in the
        self-attention half, which a cross-attention that also averages the target keeps its running sum in (MAtt);
        plain attention keeps nothing there and leaves it alone."""
        return self.out_proj(self._context(hidden_states, key_value_states, attention_mask, cache_layer))

    def _context(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache_layer: DeepNMTCacheLayerMixin | None,
    ) -> torch.Tensor:
        """Concatenated heads before the output projection, (batch, len, d_model). `cache_layer`: this layer's state in
        the self-attention half of the cache (self-attention) or in the cross-attention half (cross/context)."""
        batch, length, _ = hidden_states.shape
        query = self._split_heads(self.q_proj(hidden_states))
        if self.is_cross_attention:

            def project() -> tuple[torch.Tensor, torch.Tensor]:
                memory = key_value_states
                return self._split_heads(self.k_proj(memory)), self._split_heads(self.v_proj(memory))

            if cache_layer is None:
                key, value = project()
            elif self.context_memory:
                key, value = cache_layer.remember_context(project)
            else:
                key, value = cache_layer.remember(project)
        else:
            key = self._split_heads(self.k_proj(hidden_states))
            value = self._split_heads(self.v_proj(hidden_states))
            # absolute positions of the queries, taken before the update moves the cache's step count (in place, with
            # the static cache)
            query_positions = torch.arange(length, device=query.device)
            if cache_layer is not None:
                query_positions = query_positions + cache_layer.get_seq_length()
                key, value = cache_layer.update(key, value)
            if self.relative_keys is not None:
                bias = self._relative_key_scores(query, query_positions, key.shape[2])
                attention_mask = bias if attention_mask is None else attention_mask + bias
        output = sdpa_avoiding_cudnn(
            query, key, value, attention_mask, self.dropout if self.training else 0.0, self.avoid_cudnn
        )
        output = output.transpose(1, 2)
        if is_tracing():
            # The fused kernels return (batch, len, heads, d_h) memory, the math decomposition an exporter substitutes
            # (batch, heads, len, d_h): a copy makes the reshape valid for both.
            output = output.clone(memory_format=torch.contiguous_format)
        return output.reshape(batch, length, self.embed_dim)

    def _relative_key_scores(
        self, query: torch.Tensor, query_positions: torch.Tensor, key_length: int
    ) -> torch.Tensor:
        """q_i . a_clip(j - i) / sqrt(d_h) for every query i and key j, (batch, heads, query_len, key_len).

        Queries sit at their absolute `query_positions`, so a cached step uses its own position and the distances
        match the full pass; keys beyond those written (static cache slots) get scores too, and the decoder's mask
        hides them."""
        key_positions = torch.arange(key_length, device=query.device)
        distance = key_positions[None, :] - query_positions[:, None]  # (query_len, key_len)
        index = distance.clamp(-self.relative_window, self.relative_window) + self.relative_window
        scores = torch.matmul(query, self.relative_keys.to(query.dtype).T)  # (batch, heads, query_len, 2k+1)
        index = index[None, None].expand(query.shape[0], query.shape[1], -1, -1)
        return torch.gather(scores, -1, index) * self.head_dim**-0.5


class DeepNMTMergedAttention(DeepNMTAttention):
    r"""
    Merged attention, MAtt (Zhang, Titov, Sennrich 2019): one decoder sublayer in place of self- and cross-attention,

        MAtt(S, H) = [ M_a (S W_v + b_v) + MultiHead_concat(S, H) ] W_o + b_o

    where `M_a` is the causal average (current position included) over the full width, and `W_v`, `b_v`, `W_o` are
    those of the cross-attention, as in the authors' code. No gate, no FFN inside.
    """

    def __init__(self, config: DeepNMTConfig, num_heads: int, layer_idx: int):
        super().__init__(config, num_heads, is_cross_attention=True, layer_idx=layer_idx, side="decoder")

    @classmethod
    def in_decoder(cls, config: DeepNMTConfig, layer_idx: int, is_cross_attention: bool) -> DeepNMTMergedAttention:
        return cls(config, config.decoder_attention_heads, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache_layer: DeepNMTCacheLayerMixin | None = None,
        average_cache_layer: DeepNMTCacheLayerMixin | None = None,
    ) -> torch.Tensor:
        """`cache_layer` holds the encoder memory's keys/values (cross-attention half), `average_cache_layer` the
        running sum (self-attention half)."""
        context = self._context(hidden_states, key_value_states, attention_mask, cache_layer)
        average = causal_average(self.v_proj(hidden_states), average_cache_layer)
        return self.out_proj(context + average)


class DeepNMTAverageAttention(nn.Module):
    r"""
    The gated average attention network, AAN (Zhang, Xiong, Su 2018), in place of decoder self-attention:

        g_j = FFN(mean_{k<=j} y_k)            (the plain mean without `aan_ffn`)
        [i_j; f_j] = sigmoid(W_z [y_j; g_j] + b_z)
        output_j = i_j * y_j + f_j * g_j
    """

    takes_causal_mask = False  # the average runs over positions 0..j by construction

    def __init__(self, config: DeepNMTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        width, ffn, place = config.d_model, config.decoder_ffn_dim, (config, "decoder", layer_idx)
        self.gate = DeepNMTLinear.in_layer(2 * width, 2 * width, *place, reads_positions=True)
        if config.aan_ffn:
            self.fc1 = DeepNMTLinear.in_layer(width, ffn, *place)
            self.fc2 = DeepNMTLinear.in_layer(ffn, width, *place)
            self.activation_fn = activation_function(config.activation_function)
            self.activation_dropout = config.activation_dropout
        else:
            self.fc1 = self.fc2 = None

    @classmethod
    def in_decoder(cls, config: DeepNMTConfig, layer_idx: int, is_cross_attention: bool) -> DeepNMTAverageAttention:
        return cls(config, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache_layer: DeepNMTCacheLayerMixin | None = None,
    ) -> torch.Tensor:
        average = causal_average(hidden_states, cache_layer)  # (batch, len, d_model)
        if self.fc1 is not None:
            average = dropout(self.activation_fn(self.fc1(average)), self.activation_dropout, self.training)
            average = self.fc2(average)
        input_gate, forget_gate = torch.sigmoid(self.gate(torch.cat([hidden_states, average], dim=-1))).chunk(2, -1)
        return input_gate * hidden_states + forget_gate * average


# `decoder_self_attention` -> (the self-attention sublayer, None where MAtt merges it away; the cross-attention
# sublayer). A test ties the keys to the config's choices.
DECODER_ATTENTION_CLASSES = {
    "multi_head": (DeepNMTAttention, DeepNMTAttention),
    "average": (DeepNMTAverageAttention, DeepNMTAttention),
    "merged_average": (None, DeepNMTMergedAttention),
}


def sinkhorn_knopp(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """mHC's projection of `logits` (..., n, n) onto the doubly stochastic matrices: M = exp(logits), then
    `iterations` times each row divided by its sum, then each column by its sum (the columns sum to 1 exactly, the
    rows to within the iteration's convergence). The largest logit is subtracted first, which leaves the result
    unchanged (the iteration is invariant to a factor of M) and keeps exp finite."""
    matrix = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iterations):
        matrix = matrix / matrix.sum(dim=-1, keepdim=True)
        matrix = matrix / matrix.sum(dim=-2, keepdim=True)
    return matrix


class DeepNMTHyperConnection(nn.Module):
    r"""
    Hyper-Connections around one pre-norm sublayer F (Zhu et al., "Hyper-Connections", ICLR 2025, §2 and
    Algorithm 2 of its appendix), optionally with mHC's constraints (Xie et al., "mHC: Manifold-Constrained
    Hyper-Connections", DeepSeek 2025, §4). The residual stream is n copies H = (h_1 .. h_n), shape (..., n, d).
    The weights are `alpha` (n x (n+1), column 0 A_m, columns 1..n A_r) and `beta` (n):

        h_in  = sum_i A_m[i] h_i                                   (width connection: the sublayer's input)
        h'_j  = sum_i A_r[i, j] h_i + beta[j] Drop(F(LN(h_in)))     (depth connection, and the copies mixed)

    i.e. H' = A_r^T H + beta^T F(LN(A_m^T H)). Static: alpha and beta are parameters (`static_alpha`,
    `static_beta`). Dynamic (`hyper_connections_dynamic`, the paper's Eq. 11-13), with H~ = LN(H) per copy (a
    LayerNorm of its own, `norm`):

        alpha(H) = s_alpha * tanh(H~ W_alpha) + static_alpha        W_alpha: d x (n+1)   (`dynamic_alpha`)
        beta(H)  = s_beta  * tanh(H~ W_beta)  + static_beta         W_beta:  d           (`dynamic_beta`)

    mHC (`hyper_connections_sinkhorn_iterations` = t > 0): the weights above are logits, mapped as mHC's Eq. 8 does,

        A_m = sigmoid(alpha[:, 0]),   beta = 2 sigmoid(beta),   A_r = SinkhornKnopp_t(alpha[:, 1:])

    (`sinkhorn_knopp`: exp, then t alternating row and column normalisations, ending with the one that makes each
    new copy's weights sum to 1), so the copies are mixed by a doubly stochastic matrix. The dynamic term is the one
    above (tanh of the per-copy normalised stream) rather than mHC's linear map of the flattened stream.

    Initialisation (the paper's, so that the stack starts as the pre-norm residual one): sublayer k of the stack
    (counted from 0 across its layers, `hyper_connection_sublayers` per layer) has A_m the one-hot e_{k mod n},
    A_r = I, beta = 1, W = 0, s = 0.01. With all copies equal to x (the stack starts from n copies of the
    embedding) every copy becomes x + F(LN(x)), and the stack's sum of the copies is n times the pre-norm stack's
    output, which its final LayerNorm maps to the same output up to its epsilon (LN(n y; eps) = LN(y; eps / n^2)).
    mHC cannot hold a one-hot behind a sigmoid or an identity behind Sinkhorn-Knopp; it starts halfway between those
    and the uniform average: sigmoid(A_m) = (e_{k mod n} + 1/n) / 2, A_r = (I + 1/n) / 2 (doubly stochastic, so the
    iteration keeps it), 2 sigmoid(beta) = 1; each of these still maps n equal copies x to x + F(LN(x)).
    """

    def __init__(self, config: DeepNMTConfig, side: str, layer_idx: int, sublayer: int):
        super().__init__()
        streams = getattr(config, f"{side}_hyper_connections")
        self.streams = streams
        self.index = layer_idx * hyper_connection_sublayers(config, side) + sublayer
        self.sinkhorn_iterations = config.hyper_connections_sinkhorn_iterations
        self.dynamic = config.hyper_connections_dynamic
        self.static_alpha = nn.Parameter(torch.empty(streams, streams + 1))
        self.static_beta = nn.Parameter(torch.empty(streams))
        if self.dynamic:
            self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
            self.dynamic_alpha = nn.Parameter(torch.empty(config.d_model, streams + 1))
            self.dynamic_beta = nn.Parameter(torch.empty(config.d_model))
            self.alpha_scale = nn.Parameter(torch.empty(1))
            self.beta_scale = nn.Parameter(torch.empty(1))

    def extra_repr(self) -> str:
        return (
            f"streams={self.streams}, reads_copy={self.index % self.streams}, dynamic={self.dynamic}, "
            f"sinkhorn_iterations={self.sinkhorn_iterations}"
        )

    def initial_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(`static_alpha`, `static_beta`) at initialisation (see the class docstring)."""
        n = self.streams
        width = torch.zeros(n)
        width[self.index % n] = 1.0
        mixing, depth = torch.eye(n), torch.ones(n)
        if self.sinkhorn_iterations:
            width = (width + 1.0 / n) / 2
            width = torch.log(width) - torch.log1p(-width)  # the logit: sigmoid gives the half-way weights back
            mixing = torch.log((mixing + 1.0 / n) / 2)  # exp gives the doubly stochastic matrix back
            depth = torch.zeros(n)  # 2 sigmoid(0) = 1
        return torch.cat([width[:, None], mixing], dim=1), depth

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`alpha` (n x (n+1), or (..., n, n+1) when dynamic) and `beta` (n, or (..., n)) for `streams`."""
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic:
            normed = self.norm(streams)
            alpha = alpha + self.alpha_scale * torch.tanh(normed @ self.dynamic_alpha)
            beta = beta + self.beta_scale * torch.tanh(normed @ self.dynamic_beta)
        if self.sinkhorn_iterations:
            # in float32 whatever the model's dtype (as mHC computes its maps): the sums of the iteration stay exact
            width = torch.sigmoid(alpha[..., :1].float())
            mixing = sinkhorn_knopp(alpha[..., 1:].float(), self.sinkhorn_iterations)
            alpha = torch.cat([width, mixing], dim=-1).to(streams.dtype)
            beta = (2.0 * torch.sigmoid(beta.float())).to(streams.dtype)
        return alpha, beta

    def around(
        self,
        streams: torch.Tensor,
        norm: nn.LayerNorm,
        sublayer: Callable[[torch.Tensor], torch.Tensor],
        dropout_p: float,
        training: bool,
    ) -> torch.Tensor:
        """H' = A_r^T H + beta^T Drop(F(norm(A_m^T H))) for the streams H (..., n, d): position-wise, so a decoder's
        caches see only the sublayer's input `norm(A_m^T H)`."""
        alpha, beta = self.weights(streams)
        mixed = alpha.transpose(-1, -2) @ streams  # (..., n+1, d): the sublayer input, then the n mixed copies
        outputs = dropout(sublayer(norm(mixed[..., 0, :])), dropout_p, training)
        return mixed[..., 1:, :] + beta.unsqueeze(-1) * outputs.unsqueeze(-2)


class DeepNMTResidualNorm(nn.LayerNorm):
    """One residual block: the LayerNorm of a sublayer with the residual dropout and the placement rule,

        post-norm (DLCL paper Eq. 3):  x <- LN(x + Drop(F(x)))
        pre-norm  (Eq. 4):             x <- x + Drop(F(LN(x)))
        DeepNorm (DeepNet Eq. 1):      x <- LN(alpha * x + Drop(F(x)))   (post-norm, alpha of the block's stack)

    Mix-LN (`{side}_post_norm_layers` = k): the blocks of the first k layers of a pre-norm stack are post-norm
    (`layer_is_pre_norm`).

    `around(x, F)` applies the block to the sublayer `F`; called as a module it is the plain LayerNorm. The layer
    holds it under the norm's name, as Marian names its norms (`self_attn_layer_norm`, `encoder_attn_layer_norm`,
    `final_layer_norm`), so the saved parameter names are the LayerNorm's.

    Hyper-Connections (`{side}_hyper_connections` = n): the block's residual is `hyper`, a
    `DeepNMTHyperConnection` (pre-norm only), and `x` is the n residual streams (..., n, d); `sublayer` is the
    block's place in its layer (from 0), which picks the stream its input starts from."""

    def __init__(self, config: DeepNMTConfig, side: str, layer_idx: int, sublayer: int = 0):
        super().__init__(config.d_model, eps=config.layer_norm_eps)
        self.pre_norm = layer_is_pre_norm(config, side, layer_idx)
        self.dropout = config.dropout
        self.residual_scale = config.deepnorm_constants(side)[0]  # DeepNorm's alpha; 1 otherwise
        self.hyper = None
        if getattr(config, f"{side}_hyper_connections"):
            self.hyper = DeepNMTHyperConnection(config, side, layer_idx, sublayer)

    def extra_repr(self) -> str:
        scale = f", residual_scale={self.residual_scale:.6g}" if self.residual_scale != 1.0 else ""
        return f"{super().extra_repr()}, pre_norm={self.pre_norm}, dropout={self.dropout}{scale}"

    def around(self, hidden_states: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        if self.hyper is not None:
            return self.hyper.around(hidden_states, self, sublayer, self.dropout, self.training)
        inputs = self(hidden_states) if self.pre_norm else hidden_states
        outputs = dropout(sublayer(inputs), self.dropout, self.training)
        skip = hidden_states if self.residual_scale == 1.0 else self.residual_scale * hidden_states
        outputs = skip + outputs
        return outputs if self.pre_norm else self(outputs)


def msc_context_modules(
    config: DeepNMTConfig, side: str, num_heads: int, layer_idx: int
) -> tuple[DeepNMTAttention | None, DeepNMTLinear | None]:
    """A layer's attention to the context states and its fusion gate (None, None where the layer attends no context;
    no gate with additive fusion). Built after the layer's own attention, as 0.1.0 did: the parameters keep their
    order, and so their seeded draws."""
    if not msc_attends_context(config, side):
        return None, None
    context_attention = DeepNMTAttention(config, num_heads, True, layer_idx, context_memory=True, side=side)
    if config.msc_fusion != "gate":
        return context_attention, None
    width = config.d_model
    return context_attention, DeepNMTLinear.in_layer(2 * width, width, config, side, layer_idx)


class DeepNMTLayer(GradientCheckpointingLayer):
    r"""
    What encoder and decoder layers share: the feed-forward sublayer `fc2(Drop(act(fc1(x))))` in its residual block
    (Marian/BART parameter names), and MSC's attention to the context states (Wei et al. 2020, Eq. 10-13), fused with
    the layer's own attention output `A_h`:

        A_c = Attention(x, C)          fused = g * A_h + (1 - g) * A_c,  g = sigmoid(W [A_h; A_c] + b)   ("gate")
                                       fused = A_h + A_c                                                 ("add")

    `context_attn` and `fusion_gate` start as None; each layer sets them after its own attention
    (`msc_context_modules`), so that their parameters come after it, as in every saved model.
    """

    def __init__(self, config: DeepNMTConfig, layer_idx: int, ffn_dim: int, side: str):
        super().__init__()
        width = config.d_model
        self.layer_idx = layer_idx
        self.activation_fn = activation_function(config.activation_function)
        self.activation_dropout = config.activation_dropout
        self.fc1 = DeepNMTLinear.in_layer(width, ffn_dim, config, side, layer_idx)
        self.fc2 = DeepNMTLinear.in_layer(ffn_dim, width, config, side, layer_idx)
        self.final_layer_norm = DeepNMTResidualNorm(
            config, side, layer_idx, hyper_connection_sublayers(config, side) - 1
        )
        # set by each layer after its own attention (`msc_context_modules`); None where it attends no context
        self.context_attn: DeepNMTAttention | None = None
        self.fusion_gate: DeepNMTLinear | None = None

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.activation_fn(self.fc1(hidden_states))
        hidden_states = dropout(hidden_states, self.activation_dropout, self.training)
        return self.fc2(hidden_states)

    def with_context(
        self,
        attended: torch.Tensor,
        normed: torch.Tensor,
        context_states: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        cache_layer: DeepNMTCacheLayerMixin | None = None,
    ) -> torch.Tensor:
        """`attended` fused with the attention of `normed` (the sublayer input) to `context_states`; `attended` itself
        where the layer attends no context. The context states are per source position: the source padding mask
        applies to them."""
        if self.context_attn is None:
            return attended
        context = self.context_attn(
            normed, key_value_states=context_states, attention_mask=attention_mask, cache_layer=cache_layer
        )
        if self.fusion_gate is None:
            return attended + context
        gate = torch.sigmoid(self.fusion_gate(torch.cat([attended, context], dim=-1)))
        return gate * attended + (1.0 - gate) * context


class DeepNMTEncoderLayer(DeepNMTLayer):
    def __init__(self, config: DeepNMTConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.encoder_ffn_dim, "encoder")
        heads = config.encoder_attention_heads
        self.self_attn = DeepNMTAttention(config, heads, False, layer_idx, side="encoder")
        self.self_attn_layer_norm = DeepNMTResidualNorm(config, "encoder", layer_idx)
        self.context_attn, self.fusion_gate = msc_context_modules(config, "encoder", heads, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        context_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        def attend(normed: torch.Tensor) -> torch.Tensor:
            attended = self.self_attn(normed, attention_mask=attention_mask)
            return self.with_context(attended, normed, context_states, attention_mask)

        hidden_states = self.self_attn_layer_norm.around(hidden_states, attend)
        return self.final_layer_norm.around(hidden_states, self.feed_forward)


class DeepNMTDecoderLayer(DeepNMTLayer):
    def __init__(self, config: DeepNMTConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.decoder_ffn_dim, "decoder")
        self_attention, cross_attention = DECODER_ATTENTION_CLASSES[config.decoder_self_attention]
        self.self_attn = self.self_attn_layer_norm = None  # MAtt: merged into the cross-attention sublayer
        if self_attention is not None:
            self.self_attn = self_attention.in_decoder(config, layer_idx, is_cross_attention=False)
            self.self_attn_layer_norm = DeepNMTResidualNorm(config, "decoder", layer_idx)
        self.encoder_attn = cross_attention.in_decoder(config, layer_idx, is_cross_attention=True)
        self.encoder_attn_layer_norm = DeepNMTResidualNorm(
            config, "decoder", layer_idx, 0 if self.self_attn is None else 1
        )
        self.context_attn, self.fusion_gate = msc_context_modules(
            config, "decoder", config.decoder_attention_heads, layer_idx
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        self_attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        self_cache: DeepNMTCacheLayerMixin | None = None,
        cross_cache: DeepNMTCacheLayerMixin | None = None,
        context_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`encoder_hidden_states` / `context_states`: what this layer attends (`DeepNMTEncoderOutput.layer_memory`).
        `self_cache` / `cross_cache`: this layer's cache layers in the self- and cross-attention halves of the decoding
        cache (None without a cache)."""

        def attend_source(normed: torch.Tensor) -> torch.Tensor:
            attended = self.encoder_attn(
                normed,
                key_value_states=encoder_hidden_states,
                attention_mask=encoder_attention_mask,
                cache_layer=cross_cache,
                average_cache_layer=self_cache,  # MAtt keeps its running sum in the self-attention half
            )
            return self.with_context(attended, normed, context_states, encoder_attention_mask, cross_cache)

        if self.self_attn is not None:
            hidden_states = self.self_attn_layer_norm.around(
                hidden_states,
                lambda normed: self.self_attn(normed, attention_mask=self_attention_mask, cache_layer=self_cache),
            )
        hidden_states = self.encoder_attn_layer_norm.around(hidden_states, attend_source)
        return self.final_layer_norm.around(hidden_states, self.feed_forward)


class DeepNMTLayerHistory(nn.Module):
    """How a stack's layers are wired: what each layer reads and what the stack returns. One interface, so every
    stack runs one loop:

    - `start(embedding, **modules)`: the per-call state (kept in the caller's `forward`, never on the module);
      `modules` are those of the stack the history runs on (`DeepNMTStack.history_modules`: MSC's block LayerNorms
      and context cell, none for the others);
    - `layer_input(state, i)`: the input of layer i (0-based); `layer_context(state, i)`: the context states layer i
      attends (MSC's encoder), else None;
    - `push(state, output, i)`: record the output of layer i;
    - `stack_output(state)`: what the stack returns before its final LayerNorm; `memory_outputs(state)`: what the
      encoder returns besides it for the decoder layers to attend (`DeepNMTEncoderOutput` fields; MSC only).

    A new wiring is a subclass, and a key of `LAYER_AGGREGATION_CLASSES` when the config selects it. A stack builds
    its history with `for_stack` of the class its aggregation names there."""

    # whether `stack_output` is normalised already, so that a pre-norm stack adds no final LayerNorm (MSC's top block)
    ends_normalised = False

    @classmethod
    def for_stack(cls, config: DeepNMTConfig, side: str) -> DeepNMTLayerHistory:
        """The history of stack `side` ("encoder" or "decoder"), whose `{side}_layer_aggregation` names this class."""
        return cls(config, getattr(config, f"{side}_layers"), getattr(config, f"{side}_block_boundaries"))

    def layer_context(self, state, index: int) -> torch.Tensor | None:
        return None

    def memory_outputs(self, state) -> dict[str, torch.Tensor | None]:
        return {}


class DeepNMTResidualHistory(DeepNMTLayerHistory):
    """Plain stack: a layer reads the output of the layer below; the stack output is the top layer's output."""

    def __init__(self, config: DeepNMTConfig, num_layers: int, boundaries: list[int] | None = None):
        super().__init__()

    @classmethod
    def for_stack(cls, config: DeepNMTConfig, side: str) -> DeepNMTLayerHistory:
        """A residual encoder cut into MSC blocks (`config.msc_block_layers`: MSC encoders are residual) runs MSC's
        history, `DeepNMTMultiscaleHistory`."""
        if side == "encoder" and config.msc_block_layers is not None:
            return DeepNMTMultiscaleHistory(config)
        return super().for_stack(config, side)

    def start(self, embedding: torch.Tensor) -> list[torch.Tensor]:
        return [embedding]

    def layer_input(self, state: list[torch.Tensor], index: int) -> torch.Tensor:
        return state[-1]

    def push(self, state: list[torch.Tensor], output: torch.Tensor, index: int) -> None:
        state[-1] = output

    def stack_output(self, state: list[torch.Tensor]) -> torch.Tensor:
        return state[-1]


class DeepNMTBlockHistory(DeepNMTLayerHistory):
    r"""
    Learned linear combination of block outputs: SDT's sparse connections (Li et al. 2020), with DLCL
    (Wang et al. 2019, Eq. 7-9) as the case where every layer is a block.

    `boundaries` `[0, b_1, ..., L]` cut the stack into B blocks. Stored: `y_0` (the embedding) and the output of the
    last layer of each block. `weight[r, j]` (lower triangle of `(B+1) x (B+1)`, raw scalars, uniform-average init)
    weighs stored output j in the input of the first layer of block r+1; row B builds the stack output. Layers inside
    a block chain as a plain residual stack. Pre-norm (Eq. 8): each stored block output passes its own LayerNorm
    `layer_norms[j-1]` once, `y_0` none. Post-norm (Eq. 9): row r >= 1 of the weighted sum passes `layer_norms[r-1]`.
    Each row is one operation whatever its length (`DeepNMTHistoryRow`, a product over a buffer of the stored outputs).

    DenseFormer's k x p variants (Pagliardini et al. 2024), `dlcl_dilation` k and `dlcl_period` p: row r weighs only
    `y_j` with `r - j` a multiple of k, and only rows with `r % p == 0` are layer inputs (the stack output too); a
    block starting after another row takes the previous layer's output. The combination reads `weight * mask`
    (`weight_mask`; plain `weight` when k = p = 1), so a held-out weight gets no gradient and stays at its initial 0.
    Every row is still combined once (the kernel writes each stored output into its buffer then).
    """

    def __init__(self, config: DeepNMTConfig, num_layers: int, boundaries: list[int] | None = None):
        super().__init__()
        boundaries = list(boundaries) if boundaries is not None else list(range(num_layers + 1))
        self.pre_norm = config.pre_norm
        self.block_starts = frozenset(boundaries[:-1])
        self.block_ends = frozenset(boundary - 1 for boundary in boundaries[1:])  # layers whose output is stored
        self.size = len(boundaries)  # stored outputs: the embedding and one per block
        if config.dlcl_weights == "learned":
            self.weight = nn.Parameter(torch.empty(self.size, self.size))
        else:
            # Constant ablation weights: a buffer, since loading re-creates parameters as trainable.
            self.register_buffer("weight", torch.empty(self.size, self.size))
        norms = self.size - 1
        if config.dlcl_history_norm:
            self.layer_norms = nn.ModuleList(
                nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) for _ in range(norms)
            )
        else:
            self.layer_norms = nn.ModuleList(nn.Identity() for _ in range(norms))
        self.dilation, self.period = config.dlcl_dilation, config.dlcl_period
        self.masked = self.dilation > 1 or self.period > 1

    def weight_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Which weights DenseFormer's dilation and period keep (bool, `size x size`): `W[r, j]` with `j <= r`,
        `r - j` a multiple of the dilation and `r` one of the period. Built when read (a few scalars), so loading
        on the meta device has nothing to restore."""
        rows = torch.arange(self.size, device=device).unsqueeze(1)
        lag = rows - torch.arange(self.size, device=device)
        return (lag >= 0) & (lag % self.dilation == 0) & (rows % self.period == 0)

    def initial_weight(self, mode: str, init: str = "uniform") -> torch.Tensor:
        """`"learned"`/`"average"`: W[r, k] = 1/(r+1) for k <= r; `"one"`: W[r, k] = 1 for k <= r. Learned weights
        with `init="identity"` (DenseFormer): W[r, r] = 1, 0 elsewhere, so each row is its newest stored output.
        With dilation or period, the weights the mask holds out are 0 and the average is over the others."""
        if mode == "learned" and init == "identity":
            weight = torch.eye(self.size)
            return weight * self.weight_mask() if self.masked else weight
        weight = self.weight_mask().float() if self.masked else torch.ones(self.size, self.size).tril()
        return weight if mode == "one" else weight / weight.sum(dim=1, keepdim=True).clamp(min=1)

    def mixing_weight(self) -> torch.Tensor:
        """The weights the combination reads: `weight`, or `weight * mask` with DenseFormer's dilation or period
        (so a held-out weight gets exactly no gradient)."""
        return self.weight * self.weight_mask(self.weight.device) if self.masked else self.weight

    def start(self, embedding: torch.Tensor) -> DeepNMTHistoryState | DeepNMTTracedHistoryState:
        return start_history(embedding, self.mixing_weight(), self.size)

    def layer_input(self, state: DeepNMTHistoryState, index: int) -> torch.Tensor:
        if index not in self.block_starts:
            return state.last
        combined = self._combine(state)
        return combined if (state.count - 1) % self.period == 0 else state.last

    def push(self, state: DeepNMTHistoryState, output: torch.Tensor, index: int) -> None:
        state.last = output
        if index in self.block_ends:
            state.newest = self.layer_norms[state.count - 1](output) if self.pre_norm else output
            state.count += 1

    def stack_output(self, state: DeepNMTHistoryState) -> torch.Tensor:
        combined = self._combine(state)
        return combined if (state.count - 1) % self.period == 0 else state.last

    def _combine(self, state: DeepNMTHistoryState) -> torch.Tensor:
        # Row r reads the stored outputs y_0..y_r: one product with the weight row, whatever r
        # (`combine_history_row`). Each row is combined once per call, after the push of y_r.
        row = state.count - 1
        combined = combine_history_row(state, self.mixing_weight())
        if not self.pre_norm and row >= 1:
            combined = self.layer_norms[row - 1](combined)
        return combined


class DeepNMTDenseHistory(DeepNMTBlockHistory):
    """DLCL: every layer is a block, so every output is stored and every layer reads the combination."""

    def __init__(self, config: DeepNMTConfig, num_layers: int, boundaries: list[int] | None = None):
        super().__init__(config, num_layers, list(range(num_layers + 1)))


class DeepNMTAttentionResidualState:
    """The per-call state of an Attention Residuals history: the stored values (the embedding, then one per completed
    block), the running sum of the current block's layer contributions (None while the block is empty), and the
    input handed to the layer running now (its contribution is its output minus that input)."""

    def __init__(self, embedding: torch.Tensor):
        self.values = [embedding]
        self.partial: torch.Tensor | None = None
        self.layer_in: torch.Tensor | None = None


class DeepNMTBlockAttentionResidualHistory(DeepNMTLayerHistory):
    r"""
    Block Attention Residuals (Kimi Team, "Attention Residuals", 2026; formula as in the public reproduction
    ilml/Attention-Residuals, `model.py`, `AttnResOp` and its block forward): SDT's blocks with input-dependent,
    per-position softmax weights in place of DLCL's learned scalars.

    A layer of this backbone returns `x + F(x)` (pre-norm), so its *contribution* is `v = layer(x) - x`.
    `boundaries` `[0, b_1, ..., L]` cut the stack into B blocks. The values are `b_0 = y_0` (the embedding) and, per
    completed block n, `b_n = sum of the contributions of its layers`; inside a block the running sum of the
    contributions so far, `p`, is a value too (once the block has one). Layer i (0-based) reads, at every position,

        k_j = g_i * v_j / sqrt(mean(v_j^2) + eps)          (RMSNorm of the keys only, gain g_i, eps = layer_norm_eps)
        a_ij = softmax_j(q_i . k_j)                          (over the values v_j = b_0, ..., b_n[, p])
        x_i = sum_j a_ij v_j                                 (the values themselves, not normalised)

    with one learned pseudo-query `q_i` (d_model, zero-initialised) and key gain `g_i` (ones) per layer, stored as the
    rows 0..L-1 of `queries` and `key_gains`; row L builds the stack output the same way over `b_0, ..., b_B` (then the
    stack's final LayerNorm). No temperature, no dropout. Every layer reads its own combination (an SDT block's
    inner layers read the previous layer's output; here only the stored values are block-wise). Row 0 sees `y_0`
    alone, so layer 0 reads the embedding whatever `q_0` is.

    Zero queries give uniform weights 1/n over the n values, and the values add up to the plain residual stream
    `h_i = y_0 + v_0 + ... + v_{i-1}`: each layer reads `h_i / n_i` and the stack returns `LN(h_L / (B + 1))`. A
    softmax that sums to one cannot give the residual sum itself; the start is the residual stream rescaled per layer
    by the number of values it is split into. Needs pre-norm layers (the contribution of a post-norm layer is no
    residual branch): the config refuses post-norm, Mix-LN, DeepNorm and MSC encoders with it. Position-wise over
    depth: the decoder cache is untouched.
    """

    def __init__(self, config: DeepNMTConfig, num_layers: int, boundaries: list[int] | None = None):
        super().__init__()
        boundaries = list(boundaries) if boundaries is not None else list(range(num_layers + 1))
        self.block_ends = frozenset(boundary - 1 for boundary in boundaries[1:])  # layers that complete a block
        self.eps = config.layer_norm_eps
        self.queries = nn.Parameter(torch.zeros(num_layers + 1, config.d_model))
        self.key_gains = nn.Parameter(torch.ones(num_layers + 1, config.d_model))

    def extra_repr(self) -> str:
        return f"points={self.queries.shape[0]}, blocks={len(self.block_ends)}, eps={self.eps}"

    def start(self, embedding: torch.Tensor) -> DeepNMTAttentionResidualState:
        return DeepNMTAttentionResidualState(embedding)

    def attend(self, values: list[torch.Tensor], row: int) -> torch.Tensor:
        """`sum_j softmax_j(q_row . RMSNorm_row(v_j)) v_j` at every position (the class docstring)."""
        stacked = torch.stack(values)  # (n, batch, length, d_model)
        keys = stacked * torch.rsqrt(stacked.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.key_gains[row]
        scores = (keys * self.queries[row]).sum(dim=-1)
        weights = torch.softmax(scores.float(), dim=0).to(stacked.dtype)
        return (weights.unsqueeze(-1) * stacked).sum(dim=0)

    def layer_input(self, state: DeepNMTAttentionResidualState, index: int) -> torch.Tensor:
        values = state.values if state.partial is None else [*state.values, state.partial]
        state.layer_in = self.attend(values, index)
        return state.layer_in

    def push(self, state: DeepNMTAttentionResidualState, output: torch.Tensor, index: int) -> None:
        contribution = output - state.layer_in
        state.partial = contribution if state.partial is None else state.partial + contribution
        if index in self.block_ends:
            state.values.append(state.partial)
            state.partial = None

    def stack_output(self, state: DeepNMTAttentionResidualState) -> torch.Tensor:
        return self.attend(state.values, len(self.queries) - 1)


class DeepNMTAttentionResidualHistory(DeepNMTBlockAttentionResidualHistory):
    """Full Attention Residuals: every layer is a block, so each layer attends the embedding and the contribution of
    every layer below it, `x_i = sum_j softmax_j(q_i . RMSNorm(v_j)) v_j` over `v = y_0, v_0, ..., v_{i-1}`."""

    def __init__(self, config: DeepNMTConfig, num_layers: int, boundaries: list[int] | None = None):
        super().__init__(config, num_layers, list(range(num_layers + 1)))


LAYER_AGGREGATION_CLASSES = {
    "residual": DeepNMTResidualHistory,
    "dlcl": DeepNMTDenseHistory,
    "sparse": DeepNMTBlockHistory,
    "attnres": DeepNMTAttentionResidualHistory,
    "block_attnres": DeepNMTBlockAttentionResidualHistory,
}


class DeepNMTContextFeedForward(nn.Module):
    """MSC ablation cell: `Q(c, x) = W_2 relu(W_1 [c; x] + b_1) + b_2` (inner width d) in place of the GRU."""

    def __init__(self, d_model: int):
        super().__init__()
        self.fc1 = DeepNMTLinear(2 * d_model, d_model)
        self.fc2 = DeepNMTLinear(d_model, d_model)

    def forward(self, inputs: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(torch.cat([hidden, inputs], dim=-1))))


class DeepNMTMscContext(nn.Module):
    r"""
    MSC contextual collaboration (Wei et al. 2020, Eq. 9): `C^n = Q(C^{n-1}, B^n)`, run position-wise
    across the blocks (each source position is its own recurrence of length N), `C^0` the encoder input. Q is a
    `GRUCell(d, d)` with hidden state `C^{n-1}` and input `B^n` (one shared by all blocks, or one per block), or the
    feed-forward ablation; without contextual collaboration `C^n` is `B^n` itself.
    """

    def __init__(self, config: DeepNMTConfig):
        super().__init__()
        self.cells = None
        if config.msc_context != "block_output":
            count = len(config.msc_blocks) if config.msc_context.endswith("_per_block") else 1
            if config.msc_context in ("gru", "gru_per_block"):
                self.cells = nn.ModuleList(nn.GRUCell(config.d_model, config.d_model) for _ in range(count))
            else:
                self.cells = nn.ModuleList(DeepNMTContextFeedForward(config.d_model) for _ in range(count))

    def forward(self, previous: torch.Tensor, block_output: torch.Tensor, block: int) -> torch.Tensor:
        if self.cells is None:
            return block_output
        cell = self.cells[block if len(self.cells) > 1 else 0]
        width = block_output.shape[-1]
        # GRUCell takes (rows, d): every (sentence, position) pair is one row.
        state = cell(block_output.reshape(-1, width), previous.reshape(-1, width))
        return state.view(block_output.shape)


class DeepNMTMultiscaleState:
    """Per-call state of the MSC encoder: the encoder's block LayerNorms and context cell (None without a context) for
    this call, the newest layer output, the context the current block attends, and the normalised block outputs and
    contexts so far."""

    __slots__ = ("block_layer_norms", "context_cell", "last", "context", "blocks", "contexts")

    def __init__(self, embedding: torch.Tensor, block_layer_norms: nn.ModuleList, context_cell: nn.Module | None):
        self.block_layer_norms, self.context_cell = block_layer_norms, context_cell
        self.last = embedding
        self.context = embedding if context_cell is not None else None
        self.blocks: list[torch.Tensor] = []
        self.contexts: list[torch.Tensor] = []


class DeepNMTMultiscaleHistory(DeepNMTLayerHistory):
    r"""
    MSC's encoder (Wei et al. 2020) as a layer history: N blocks of residual layers. Block n ends with its own
    LayerNorm, `LN_n(B^n)`, which decoder layer n attends (the last one is the encoder output), while the residual
    stream goes on from the un-normalised `B^n`. With a context, the layers of block n attend `C^{n-1}` and
    `C^n = Q(C^{n-1}, LN_n(B^n))`, `C^0` the encoder input (`DeepNMTMscContext`).

    The block LayerNorms and the context cell are the encoder's modules (`encoder.block_layer_norms`,
    `encoder.context`: the names every saved MSC model has), handed to `start` by the encoder at each call
    (`DeepNMTEncoder.history_modules`), so that a module replaced there (e.g. by PEFT's `modules_to_save`) is the one
    that runs. The history itself holds no module.
    """

    ends_normalised = True  # the top block's LayerNorm plays the final LayerNorm's part

    def __init__(self, config: DeepNMTConfig):
        super().__init__()
        boundaries = config.msc_block_boundaries()
        self.block_ends = {end - 1: block for block, end in enumerate(boundaries[1:])}  # last layer -> its block
        self.returns_context = msc_attends_context(config, "decoder")

    def start(
        self, embedding: torch.Tensor, block_layer_norms: nn.ModuleList, context_cell: nn.Module | None
    ) -> DeepNMTMultiscaleState:
        return DeepNMTMultiscaleState(embedding, block_layer_norms, context_cell)

    def layer_input(self, state: DeepNMTMultiscaleState, index: int) -> torch.Tensor:
        return state.last

    def layer_context(self, state: DeepNMTMultiscaleState, index: int) -> torch.Tensor | None:
        return state.context

    def push(self, state: DeepNMTMultiscaleState, output: torch.Tensor, index: int) -> None:
        state.last = output
        block = self.block_ends.get(index)
        if block is None:
            return
        normed = state.block_layer_norms[block](output)
        state.blocks.append(normed)
        if state.context_cell is not None:
            state.context = state.context_cell(state.context, normed, block)
            state.contexts.append(state.context)

    def stack_output(self, state: DeepNMTMultiscaleState) -> torch.Tensor:
        return state.blocks[-1]

    def memory_outputs(self, state: DeepNMTMultiscaleState) -> dict[str, torch.Tensor | None]:
        contexts = torch.stack(state.contexts, dim=1) if self.returns_context else None
        return {"block_outputs": torch.stack(state.blocks, dim=1), "context_states": contexts}


class DeepNMTHyperHistory(DeepNMTResidualHistory):
    """Hyper-Connections' stack (`{side}_hyper_connections` = n): a residual stack whose state is the n residual
    streams (..., n, d), n copies of the embedding at the start; each layer reads and returns the streams (its
    residual blocks are `DeepNMTHyperConnection`s), and the stack output is their sum (Zhu et al. 2025, §2)."""

    def __init__(self, config: DeepNMTConfig, side: str):
        super().__init__(config, getattr(config, f"{side}_layers"))
        self.streams = getattr(config, f"{side}_hyper_connections")

    @classmethod
    def for_stack(cls, config: DeepNMTConfig, side: str) -> DeepNMTLayerHistory:
        return cls(config, side)

    def start(self, embedding: torch.Tensor) -> list[torch.Tensor]:
        return [embedding.unsqueeze(-2).expand(*embedding.shape[:-1], self.streams, embedding.shape[-1])]

    def stack_output(self, state: list[torch.Tensor]) -> torch.Tensor:
        return state[-1].sum(dim=-2)


CODE_VERSION = "0.2.0"  # the hf-deep-nmt release this file belongs to (`hf-deep-nmt upgrade-code` reads it)


class DeepNMTPreTrainedModel(PreTrainedModel):
    config_class = DeepNMTConfig
    config: DeepNMTConfig
    generation_config_class = DeepNMTGenerationConfig  # a new model's output cap: not transformers' 20 tokens
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _no_split_modules = ["DeepNMTEncoderLayer", "DeepNMTDecoderLayer"]
    # The loss is a token mean; the Trainer must not rescale it by `num_items_in_batch`.
    accepts_loss_kwargs = False

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, with what it is given checked before anything is built (in `__init__`,
        `check_before_building`: the config against the weight files' headers, the memory the model needs), and
        what was loaded looked at once: weights the file lacks or holds beyond the model's are an error
        (`check_loaded_weights`), weights holding NaN or infinite values are named in a warning
        (`warn_nonfinite_weights`; such a model translates into NaN or nothing, and the commands refuse it)."""
        source = str(pretrained_model_name_or_path)
        wants_info = kwargs.pop("output_loading_info", False)
        token = LOADING.set(LoadingRequest.of_call(source, kwargs))
        try:
            loaded = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        finally:
            LOADING.reset(token)
        model, info = loaded if isinstance(loaded, tuple) else (loaded, {})
        check_loaded_weights(model, info, source)
        warn_nonfinite_weights(model, source)
        return (model, info) if wants_info else model

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Fairseq-style initialisation: Glorot-uniform matrices, zero biases, N(0, 1/d) embeddings.

        Decisions are taken on the leaf modules that own the parameters: with remote code, transformers skips
        modules without parameters of their own.
        """
        d_model = self.config.d_model
        if isinstance(module, DeepNMTLinear) and getattr(module, "init_normal", False):
            init.normal_(module.weight, mean=0.0, std=module.init_scale * math.sqrt(2.0 / module.glorot_fan))
            init.zeros_(module.bias)
        elif isinstance(module, DeepNMTLinear):
            bound = module.init_scale * math.sqrt(6.0 / module.glorot_fan)
            init.uniform_(module.weight, -bound, bound)
            init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):  # the output layer (tied to the target embeddings by default)
            init.normal_(module.weight, mean=0.0, std=d_model**-0.5)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=d_model**-0.5)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, DeepNMTBlockHistory):
            init.copy_(module.weight, module.initial_weight(self.config.dlcl_weights, self.config.dlcl_init))
        elif isinstance(module, DeepNMTHyperConnection):
            alpha, beta = module.initial_weights()
            init.copy_(module.static_alpha, alpha)
            init.copy_(module.static_beta, beta)
            if module.dynamic:
                init.zeros_(module.dynamic_alpha)
                init.zeros_(module.dynamic_beta)
                init.constant_(module.alpha_scale, 0.01)
                init.constant_(module.beta_scale, 0.01)
        elif isinstance(module, DeepNMTBlockAttentionResidualHistory):
            init.zeros_(module.queries)  # uniform weights over the values at the start
            init.ones_(module.key_gains)
        elif isinstance(module, DeepNMTAttention) and module.relative_keys is not None:
            init.xavier_uniform_(module.relative_keys)
        elif isinstance(module, nn.GRUCell):
            # torch's own GRU convention: every weight and bias uniform in +-1/sqrt(hidden size)
            bound = module.hidden_size**-0.5
            for tensor in (module.weight_ih, module.weight_hh, module.bias_ih, module.bias_hh):
                init.uniform_(tensor, -bound, bound)


class DeepNMTStack(DeepNMTPreTrainedModel):
    """What the encoder and the decoder share: token + position embedding, the layer history, the final LayerNorm."""

    def __init__(self, config: DeepNMTConfig, embed_tokens: nn.Embedding, side: str):
        super().__init__(config)
        aggregation = getattr(config, f"{side}_layer_aggregation")
        self.dropout = config.dropout
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = embed_tokens
        self.embed_positions = DeepNMTSinusoidalPositions(config.d_model, config.sinusoid_frequencies)
        history = LAYER_AGGREGATION_CLASSES[aggregation]
        if getattr(config, f"{side}_hyper_connections"):
            history = DeepNMTHyperHistory  # on a residual stack: the config refuses the others
        self.history = history.for_stack(config, side)
        # Pre-norm stacks end with a LayerNorm (Eq. 4). Post-norm layers already end in one, as does the DLCL
        # post-norm output row, and so does a history whose output is normalised (MSC's top block).
        self.layer_norm = None
        if stack_has_final_norm(config, side) and not self.history.ends_normalised:
            self.layer_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def history_modules(self) -> dict[str, nn.Module | None]:
        """Modules of this stack that its history runs on, handed to `history.start` at each call: none here."""
        return {}

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def check_input_ids(self, input_ids: torch.Tensor, name: str = "input_ids") -> None:
        """Refuse ids that are not integers (`check_token_ids`) or outside the vocabulary, naming the first. Needs the
        ids' values (a host synchronisation), so it runs on eager calls that start a sequence, never while tracing:
        ids chosen by decoding come from the model's own vocabulary."""
        check_token_ids(input_ids, name)
        vocab = self.embed_tokens.num_embeddings
        if not input_ids.numel():
            return
        lowest, highest = torch.stack([input_ids.min(), input_ids.max()]).tolist()  # one synchronisation, not two
        if lowest < 0 or highest >= vocab:
            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)][0].item()
            raise ValueError(
                f"Token id {bad} is out of range for a vocabulary of {vocab} ids (valid: 0..{vocab - 1})."
            )

    def embed(self, input_ids: torch.Tensor, past_length: int | torch.Tensor = 0) -> torch.Tensor:
        """`y_0 = Drop(sqrt(d) * E[x] + PE)`, positions counted from `past_length` (an int, or a 0-d tensor with the
        static cache: no host synchronisation)."""
        positions = past_length + torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden_states = self.embed_tokens(input_ids) * self.embed_scale
        hidden_states = hidden_states + self.embed_positions(positions).to(hidden_states.dtype)
        return dropout(hidden_states, self.dropout, self.training)

    def finish(self, state) -> torch.Tensor:
        output = self.history.stack_output(state)
        return self.layer_norm(output) if self.layer_norm is not None else output


class DeepNMTEncoder(DeepNMTStack):
    """Encoder stack. Under MSC (`config.msc_block_layers`) its history is `DeepNMTMultiscaleHistory`: the layers form
    N blocks, each ending in its own LayerNorm (`block_layer_norms`), and the context cell (`context`) carries the
    context states across them."""

    def __init__(self, config: DeepNMTConfig, embed_tokens: nn.Embedding):
        super().__init__(config, embed_tokens, "encoder")
        self.layers = nn.ModuleList(DeepNMTEncoderLayer(config, i) for i in range(config.encoder_layers))
        self.block_layer_norms = self.context = None
        if config.msc_block_layers is not None:
            self.block_layer_norms = nn.ModuleList(
                nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) for _ in config.msc_blocks
            )
            if msc_attends_context(config, "encoder"):
                self.context = DeepNMTMscContext(config)
        self.post_init()

    def history_modules(self) -> dict[str, nn.Module | None]:
        """MSC: the block LayerNorms and the context cell (`DeepNMTMultiscaleHistory.start`), read at each call."""
        if self.block_layer_norms is None:
            return {}
        return {"block_layer_norms": self.block_layer_norms, "context_cell": self.context}

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        head_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> DeepNMTEncoderOutput:
        """No `**kwargs`: `generate()` hands the encoder only the arguments its signature names (not a Trainer
        batch's `labels`), and any other argument is a `TypeError`. The named options transformers passes are
        refused or ignored (`check_source`)."""
        options = dict(
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            head_mask=head_mask,
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
        )
        self.check_source(input_ids, attention_mask, options)
        hidden_states = self.embed(input_ids)  # (batch, src_len, d_model)
        mask = padding_mask_to_additive(attention_mask, hidden_states.dtype)
        state = self.history.start(hidden_states, **self.history_modules())  # layer outputs of this call only
        for index, layer in enumerate(self.layers):
            output = layer(self.history.layer_input(state, index), mask, self.history.layer_context(state, index))
            self.history.push(state, output, index)
        return DeepNMTEncoderOutput(last_hidden_state=self.finish(state), **self.history.memory_outputs(state))

    def check_source(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, options: dict) -> None:
        """What the encoder refuses before it computes: `options` it cannot take (`check_extra_arguments`), a batch
        without a sentence or a mask of another shape (`check_source_shapes`), and on eager calls ids outside the
        vocabulary (`check_input_ids`) and a batch of padding only (`check_padding_rows`)."""
        check_extra_arguments(self, options)
        check_source_shapes(input_ids, attention_mask)
        if not is_tracing():
            self.check_input_ids(input_ids)
            if attention_mask is not None:
                check_padding_rows(attention_mask)


def check_source_shapes(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
    """A source batch holds at least one sentence of at least one token, `(batch, source_length)`, and its padding
    mask, when given, has the same shape. Reads shapes only, so it runs while tracing too."""
    if input_ids is None:
        raise ValueError("The encoder needs `input_ids` (batch, source_length).")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            f"`input_ids` must have shape (batch >= 1, source_length >= 1), got {tuple(input_ids.shape)}: "
            "there is no sentence to encode."
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape)}."
        )


def check_padding_rows(attention_mask: torch.Tensor) -> None:
    """A source batch that is padding only (`attention_mask` all 0) is refused: it has no token to attend to and would
    be decoded from padding as if it were a sentence. A padding-only row beside real ones is warned about and kept
    (fixed-shape batches may fill with such rows; the other rows are unaffected): its output means nothing. Needs the
    mask's values (a host synchronisation), so it runs on eager calls only."""
    empty = ~attention_mask.bool().any(dim=1)
    if not bool(empty.any()):
        return
    rows = empty.nonzero().flatten().tolist()
    if len(rows) == attention_mask.shape[0]:
        raise ValueError(
            f"`attention_mask` is 0 everywhere (all {len(rows)} row(s) of shape {tuple(attention_mask.shape)} are "
            "padding): there is no source token to translate; each row needs at least one position with mask 1."
        )
    logger.warning(
        f"Rows {rows[:8]}{' ...' if len(rows) > 8 else ''} of the {attention_mask.shape[0]} in this batch are padding "
        "only (attention_mask all 0): their outputs are computed from padding and mean nothing; the other rows are "
        "unaffected."
    )


class DeepNMTDecoder(DeepNMTStack):
    def __init__(self, config: DeepNMTConfig, embed_tokens: nn.Embedding):
        super().__init__(config, embed_tokens, "decoder")
        self.layers = nn.ModuleList(DeepNMTDecoderLayer(config, i) for i in range(config.decoder_layers))
        # the causal mask is built only for a self-attention sublayer that reads it (none where MAtt merges it away)
        self_attention = DECODER_ATTENTION_CLASSES[config.decoder_self_attention][0]
        self.self_attention_takes_mask = self_attention is not None and self_attention.takes_causal_mask
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor,
        encoder_outputs: DeepNMTEncoderOutput,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool = False,
        past_key_values: Cache | None = None,
    ) -> BaseModelOutputWithPast:
        """Decoder layer n attends `encoder_outputs.layer_memory(n)`: the encoder output, or under MSC encoder block n
        (and context n). The decoding state comes as `cache` (or `past_key_values`, its name before transformers
        5.24) and is returned under the name the installed transformers uses."""
        cache = self.decoding_cache(take_decoding_state(cache, past_key_values), use_cache)
        self_caches, cross_caches, past_length, static = self.cache_layers(cache)
        if not is_tracing() and isinstance(past_length, int) and past_length == 0:  # a sequence starts: eager checks
            self.check_input_ids(input_ids, "decoder_input_ids")
        hidden_states = self.embed(input_ids, past_length)  # (batch, tgt_len, d_model)
        self_mask = None
        if self.self_attention_takes_mask:
            self_mask = self._self_attention_mask(
                attention_mask,
                input_ids.shape[1],
                past_length,
                hidden_states,
                max_cache_len=self_caches[0].max_cache_len if static else None,
            )
        cross_mask = padding_mask_to_additive(encoder_attention_mask, hidden_states.dtype)
        state = self.history.start(hidden_states, **self.history_modules())  # layer outputs of this call only
        for index, layer in enumerate(self.layers):
            memory, context = encoder_outputs.layer_memory(index)
            output = layer(
                self.history.layer_input(state, index),
                memory,
                self_mask,
                cross_mask,
                self_cache=self_caches[index],
                cross_cache=cross_caches[index],
                context_states=context,
            )
            self.history.push(state, output, index)
        return with_decoding_state(BaseModelOutputWithPast, cache, last_hidden_state=self.finish(state))

    def decoding_cache(self, cache: Cache | None, use_cache: bool) -> EncoderDecoderCache | None:
        """The decoding state of a call: none without `use_cache`, else the one given (refused unless it is an
        EncoderDecoderCache) or a new, empty one."""
        if not use_cache:
            return None
        if cache is None:
            return EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        if not isinstance(cache, EncoderDecoderCache):
            raise TypeError(
                f"The decoding state (`cache`) must be an EncoderDecoderCache (self- and cross-attention), got "
                f"{type(cache).__name__}."
            )
        return cache

    def cache_layers(self, cache: EncoderDecoderCache | None) -> tuple[list, list, int | torch.Tensor, bool]:
        """Each layer's self- and cross-attention cache layers (None without a cache), the positions decoded before
        this call (an int, or a 0-d tensor with the static cache), and whether the cache is static."""
        num_layers = len(self.layers)
        if cache is None:
            return [None] * num_layers, [None] * num_layers, 0, False
        self_caches = cache_layers_of(cache.self_attention_cache, num_layers)
        cross_caches = cache_layers_of(cache.cross_attention_cache, num_layers)
        static = bool(getattr(self_caches[0], "is_compileable", False))
        return self_caches, cross_caches, self_caches[0].get_seq_length(), static

    @staticmethod
    def _self_attention_mask(
        padding_mask: torch.Tensor | None,
        length: int,
        past_length: int | torch.Tensor,
        like: torch.Tensor,
        max_cache_len: int | None = None,
    ) -> torch.Tensor | None:
        """Additive mask of `length` queries at positions `past_length ...` over the keys: the `past_length + length`
        seen so far, or the `max_cache_len` slots of a static cache (`past_length` then a tensor). Causal when more
        than one query is decoded or the keys are static slots (the unwritten ones lie beyond every query); plus
        target padding when given as (batch, keys so far). Dtype and device of `like`; None when nothing is masked."""
        device = like.device
        static = max_cache_len is not None
        key_length = max_cache_len if static else past_length + length
        allowed = None
        if length > 1 or static:
            query_positions = past_length + torch.arange(length, device=device)
            allowed = (torch.arange(key_length, device=device)[None, :] <= query_positions[:, None])[None, None]
        if padding_mask is not None and padding_mask.dim() == 2:
            keys = padding_mask.to(device=device, dtype=torch.bool)
            if static and keys.shape[-1] < key_length:  # slots not written yet are hidden by the causal rule
                keys = F.pad(keys, (0, key_length - keys.shape[-1]), value=True)
            if keys.shape[-1] == key_length:
                keys = keys[:, None, None, :]
                allowed = keys if allowed is None else allowed & keys
        if allowed is None:
            return None
        return torch.zeros(allowed.shape, dtype=like.dtype, device=device).masked_fill(
            ~allowed, torch.finfo(like.dtype).min
        )


class DeepNMTModel(DeepNMTPreTrainedModel):
    def __init__(self, config: DeepNMTConfig):
        check_before_building(config, output_layer=False, what=f"Building {type(self).__name__}")
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        if config.share_embeddings:
            decoder_embed = self.shared
            self._tied_weights_keys = {
                "encoder.embed_tokens.weight": "shared.weight",
                "decoder.embed_tokens.weight": "shared.weight",
            }
        else:
            decoder_embed = nn.Embedding(config.decoder_vocab_size, config.d_model, config.pad_token_id)
            self._tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight"}
        self.encoder = DeepNMTEncoder(config, self.shared)
        self.decoder = DeepNMTDecoder(config, decoder_embed)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = value
        self.encoder.embed_tokens = value
        if self.config.share_embeddings:
            self.decoder.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput:
        """The decoding state comes as `cache` (or `past_key_values`, its name before transformers 5.24); a later
        step without it is refused (`check_step_has_state`), and unknown keyword arguments raise `TypeError`."""
        check_extra_arguments(self, kwargs)
        cache = take_decoding_state(cache, past_key_values)
        check_step_has_state(self.config, decoder_input_ids, cache, use_cache, kwargs.get("cache_position"))
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        else:
            encoder_outputs = self._check_encoder_outputs(encoder_outputs)
        if decoder_input_ids is None:
            raise ValueError("`decoder_input_ids` (or `labels`) are required to run the decoder.")
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            encoder_outputs=encoder_outputs,
            attention_mask=decoder_attention_mask,
            encoder_attention_mask=attention_mask,
            cache=cache,
            use_cache=use_cache,
        )
        return with_decoding_state(
            Seq2SeqModelOutput,
            decoding_state(decoder_outputs),
            last_hidden_state=decoder_outputs.last_hidden_state,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
        )

    def _check_encoder_outputs(self, encoder_outputs) -> DeepNMTEncoderOutput:
        """`encoder_outputs` given by the caller: a `BaseModelOutput` or a tuple in the order of
        [`DeepNMTEncoderOutput`] (`last_hidden_state`, then under MSC `block_outputs` and `context_states`)."""
        names = ("last_hidden_state", "block_outputs", "context_states")
        if isinstance(encoder_outputs, BaseModelOutput) and not isinstance(encoder_outputs, DeepNMTEncoderOutput):
            encoder_outputs = DeepNMTEncoderOutput(**{name: getattr(encoder_outputs, name, None) for name in names})
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = DeepNMTEncoderOutput(**dict(zip(names, tuple(encoder_outputs)[:3])))
        blocks = self.config.msc_blocks
        if blocks is None:
            return encoder_outputs
        needs_context = msc_attends_context(self.config, "decoder")
        block_outputs = getattr(encoder_outputs, "block_outputs", None)
        context_states = getattr(encoder_outputs, "context_states", None)
        expected = f"(batch, {len(blocks)}, source_length, {self.config.d_model})"
        for name, tensor, needed in (
            ("block_outputs", block_outputs, True),
            ("context_states", context_states, needs_context),
        ):
            if needed and (tensor is None or tensor.dim() != 4 or tensor.shape[1] != len(blocks)):
                got = "nothing" if tensor is None else f"shape {tuple(tensor.shape)}"
                raise ValueError(
                    f"This MSC model's decoder layers read one encoder block each: `encoder_outputs` must carry "
                    f"`{name}` of shape {expected} (as its encoder returns them, a DeepNMTEncoderOutput), got {got}."
                )
        return encoder_outputs


class DeepNMTForConditionalGeneration(DeepNMTPreTrainedModel, GenerationMixin):
    r"""
    Deep Transformer translation model with a language-modelling head. Use with `generate()` (greedy, beam search,
    sampling; cached decoding) and `Seq2SeqTrainer`.

    Example:

    ```python
    >>> from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
    >>> model = DeepNMTForConditionalGeneration(DeepNMTConfig(encoder_layers=12, layer_aggregation="dlcl"))
    ```
    """

    def __init__(self, config: DeepNMTConfig):
        # A saved model's auto_map pairs its config class with its model class: a mismatch would save a folder that
        # AutoModelForSeq2SeqLM cannot load. Compared by model_type, as remote code loads classes in separate modules.
        if config.model_type != self.config_class.model_type:
            raise ValueError(
                f"{type(self).__name__} takes a {self.config_class.__name__} (model_type "
                f"{self.config_class.model_type!r}), got a {type(config).__name__} "
                f"(model_type {config.model_type!r}); "
                "use the model class of that config, e.g. through AutoModelForSeq2SeqLM.from_config(config)."
            )
        check_before_building(config, output_layer=True, what=f"Building {type(self).__name__}")
        super().__init__(config)
        self.model = DeepNMTModel(config)
        # `output_bias`: a bias on the logits (Marian's `final_logits_bias`)
        self.lm_head = nn.Linear(config.d_model, config.decoder_vocab_size, bias=config.output_bias)
        source = "model.shared.weight" if config.share_embeddings else "model.decoder.embed_tokens.weight"
        self._tied_weights_keys = {"lm_head.weight": source}
        if config.share_embeddings:
            self._tied_weights_keys.update(
                {
                    "model.encoder.embed_tokens.weight": "model.shared.weight",
                    "model.decoder.embed_tokens.weight": "model.shared.weight",
                }
            )
        else:
            self._tied_weights_keys["model.encoder.embed_tokens.weight"] = "model.shared.weight"
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def resize_token_embeddings(self, new_num_tokens: int | None = None, *args, **kwargs) -> nn.Embedding:
        """Resize the shared vocabulary (source, target and tied output layer together)."""
        if not self.config.share_embeddings:
            raise ValueError(
                "`resize_token_embeddings` resizes the shared vocabulary, but this model has separate source and "
                "target vocabularies (`share_embeddings=False`)."
            )
        embeddings = super().resize_token_embeddings(new_num_tokens, *args, **kwargs)
        self.config.decoder_vocab_size = self.config.vocab_size
        return embeddings

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        label_smoothing: float = 0.0,
        return_logits: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        r"""
        cache (`EncoderDecoderCache`, *optional*):
            The decoding state of the earlier steps (`generate()` passes it); `past_key_values` is its name before
            transformers 5.24 and is taken too. The output carries it under the name the installed transformers reads.
            A step past the first without it raises an error instead of decoding from the last token alone.
        labels (`torch.LongTensor` of shape `(batch, target_length)`, *optional*):
            Target ids; -100 marks positions ignored by the loss. When `decoder_input_ids` is not given it is
            `labels` shifted right behind `decoder_start_token_id`.
        label_smoothing (`float`, *optional*, defaults to 0.0):
            Label smoothing of the loss, as `F.cross_entropy`'s (and the Trainer's `label_smoothing_factor`):
            `(1 - eps) * nll + eps * (mean over the vocabulary of -log p)`, averaged over the counted tokens.
        return_logits (`bool`, *optional*):
            True keeps `logits` in a training step too. The output carries them always but in a training step
            (training mode, `labels` given, gradients recorded, not under `torch.compile`): there the loss goes
            through the output layer a chunk of tokens at a time (`DeepNMTChunkedLinearCrossEntropy`, the same loss and
            gradients), the (tokens, vocabulary) logits are never made and `logits` is None. False or None change
            nothing.
        """
        check_extra_arguments(self, kwargs)
        cache = take_decoding_state(cache, past_key_values)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"`label_smoothing` must be in [0, 1], got {label_smoothing!r}.")
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None:
                decoder_input_ids = shift_tokens_right(
                    labels, self.config.pad_token_id, self.config.decoder_start_token_id
                )
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=cache,
            use_cache=use_cache,
            cache_position=kwargs.get("cache_position"),
        )
        loss, logits = self._loss_and_logits(outputs.last_hidden_state, labels, label_smoothing, return_logits)
        return with_decoding_state(
            Seq2SeqLMOutput,
            decoding_state(outputs),
            loss=loss,
            logits=logits,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
        )

    def _loss_and_logits(self, hidden, labels, label_smoothing: float, return_logits: bool | None):
        """The loss (None without `labels`; with MSC's encoder L2 term in training) and the logits (None in a training
        step whose loss goes through the output layer a chunk at a time)."""
        loss = logits = None
        if labels is not None and return_logits is not True and self.chunks_training_loss():
            loss = chunked_linear_cross_entropy(hidden, self.lm_head.weight, labels, label_smoothing=label_smoothing)
        else:
            logits = self.lm_head(hidden)
            if labels is not None:
                loss = F.cross_entropy(
                    logits.view(-1, logits.shape[-1]).float(),
                    labels.reshape(-1).to(logits.device),
                    ignore_index=-100,
                    label_smoothing=label_smoothing,
                )
        if loss is not None:
            warn_of_an_empty_loss(loss, labels)
        if loss is not None and self.training and self.config.encoder_l2_lambda:
            loss = loss + self.config.encoder_l2_lambda * self.encoder_l2_penalty()
        return loss, logits

    def chunks_training_loss(self) -> bool:
        """Whether a forward with labels is a training step whose loss `DeepNMTChunkedLinearCrossEntropy` computes:
        training mode, gradients recorded, not traced by `torch.compile` (Inductor fuses the plain loss itself), and
        the output layer a plain bias-free `nn.Linear` without hooks (not one wrapped by an adapter: its forward is
        skipped)."""
        head = self.lm_head
        return (
            self.training
            and torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and type(head) is nn.Linear
            and head.bias is None
            and not head._forward_hooks
            and not head._forward_pre_hooks
        )

    def encoder_l2_penalty(self) -> torch.Tensor:
        """Sum of squares of the encoder's weight matrices (`nn.Linear` and GRU weights; no biases, LayerNorms,
        embeddings, DLCL weights or relative-position tables), in float32. Training adds
        `config.encoder_l2_lambda` times this to the loss; evaluation losses stay the plain cross-entropy."""
        total = torch.zeros((), device=self.lm_head.weight.device)
        for module in self.model.encoder.modules():
            if isinstance(module, nn.Linear):
                weights = (module.weight,)
            elif isinstance(module, nn.GRUCell):
                weights = (module.weight_ih, module.weight_hh)
            else:
                continue
            for weight in weights:
                total = total + weight.float().pow(2).sum()
        return total

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """transformers' `generate()`, once what it was given is checked (`check_generate_arguments`): token ids that
        are not integers, beam and sequence counts and output caps that are not positive integers, and a decoding
        whose hypotheses (and static cache) cannot fit the memory are refused before anything is encoded."""
        self.check_generate_arguments(inputs, generation_config, kwargs)
        return super().generate(inputs, generation_config, **kwargs)

    def check_generate_arguments(self, inputs: torch.Tensor | None, generation_config, kwargs: dict) -> None:
        """`ValueError` naming the value and what is valid for: `input_ids` / `decoder_input_ids` that are not integer
        ids; `num_beams`, `num_return_sequences`, `max_new_tokens`, `max_length` that are not positive integers;
        `InsufficientMemoryError` when what the decoding allocates up front (`decoding_memory`: the hypotheses'
        encoder output, cross-attention keys and values, scores, and with `cache_implementation="static"` the
        self-attention cache of every output position) exceeds what the model's device can allocate, saying how many
        hypotheses, or output tokens, would fit. Settings come from the call, else `generation_config`, else the
        model's. Reads shapes and settings only: no host synchronisation."""
        defaults = generation_config if generation_config is not None else self.generation_config

        def setting(name: str):
            return kwargs[name] if kwargs.get(name) is not None else getattr(defaults, name, None)

        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is not None:
            check_token_ids(ids, "input_ids")
            warn_of_padding_read_as_text(ids, kwargs.get("attention_mask"), self.config.pad_token_id)
        if kwargs.get("decoder_input_ids") is not None:
            check_token_ids(kwargs["decoder_input_ids"], "decoder_input_ids")
        for name, means in (
            ("num_beams", "1: greedy or sampling; 4 to 6 is usual for translation"),
            ("num_return_sequences", "1: one translation per sentence; at most `num_beams`"),
            ("max_new_tokens", "None: the saved cap"),
            ("max_length", "None: the saved cap"),
        ):
            value = setting(name)  # None: unset, transformers' default
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                continue
            raise ValueError(f"`{name}` must be a positive integer ({means}), got {value!r}.")
        new_tokens = setting("max_new_tokens")
        cap = new_tokens if new_tokens is not None else (setting("max_length") or DEFAULT_MAX_OUTPUT_TOKENS + 2) - 1
        if ids is None or ids.dim() != 2:
            check_output_cap(cap, new_tokens is not None)
            return  # the encoder names what is wrong with the source's shape
        beams, sequences = setting("num_beams") or 1, setting("num_return_sequences") or 1
        rows = ids.shape[0] * max(beams, sequences)
        static = setting("cache_implementation") == "static"
        cached = cap if static else 1
        source = ids.shape[1]
        per_row = decoding_memory(self.config, 1, source, cached, self.dtype)
        what = f"generate() over {ids.shape[0]} sentence(s) of {source} tokens x num_beams={beams}"
        what += f" = {rows:,} hypotheses" + (f", with a static cache of {cached:,} positions," if static else "")

        def what_fits(available: int) -> str:
            ways = [f"at most {available // per_row:,} hypotheses fit: lower num_beams (or the batch)"]
            if static:
                rest = decoding_memory(self.config, rows, source, 0, self.dtype)
                per_position = decoding_memory(self.config, rows, source, 1, self.dtype) - rest
                if per_position and available > rest:
                    fitting = (available - rest) // per_position
                    ways.insert(0, f"at most {fitting:,} output positions fit the static cache: lower max_new_tokens")
                ways.append("or decode with the dynamic cache (leave cache_implementation unset)")
            return "; ".join(ways)

        check_fits(rows * per_row, what, what_fits, self.device)
        check_output_cap(cap, new_tokens is not None)  # after the memory, which says how many positions fit

    def _prepare_generated_length(self, generation_config, has_default_max_length, *args, **kwargs):
        """One output cap per call: a `max_new_tokens` given to `generate()` replaces the saved `max_length` (the
        model's default cap), as transformers does, without its warning that both were set. A `max_length` given with
        it in the same call still gets the warning. Called by every `generate()` with the call's merged settings, it
        also refuses a non-finite `length_penalty`."""
        penalty = getattr(generation_config, "length_penalty", None)
        if isinstance(penalty, (int, float)) and not math.isfinite(penalty):
            # transformers divides the beam scores by length ** penalty: NaN makes every comparison False and the
            # hypotheses kept arbitrary, without an error
            raise ValueError(f"`length_penalty` must be a finite number (1.0: the default), got {penalty!r}.")
        saved = getattr(self.generation_config, "max_length", None)
        if generation_config.max_new_tokens is not None and generation_config.max_length == saved:
            has_default_max_length = True
        return super()._prepare_generated_length(generation_config, has_default_max_length, *args, **kwargs)

    def _reorder_cache(self, past_key_values: Cache, beam_idx: torch.LongTensor) -> Cache:
        """Beam search's reordering after each step (transformers calls this where a model defines it). Its indices
        move hypotheses among one sentence's beams only (`beam + sentence * num_beams`), and a sentence's beams hold
        identical copies of its encoder-side state (cross-attention keys/values, MSC context), so only the
        self-attention half moves: reordering the other half copied every cross-attention memory each step for
        nothing (4.8% of a beam-4 batch-32 decoding's CPU time, benchmarks/README.md). `cache.reorder_cache(...)`
        called directly still moves everything."""
        if isinstance(past_key_values, EncoderDecoderCache):
            past_key_values.self_attention_cache.reorder_cache(beam_idx)
        else:
            past_key_values.reorder_cache(beam_idx)
        return past_key_values

    def create_masks_for_generate(self, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
        """`generate()` with a static cache would turn the decoder's 2D padding mask into a 4D one; the decoder builds
        its masks itself (causal over the cache slots, padding, unwritten slots), so the 2D mask passes unchanged."""
        return attention_mask


class DeepNormForConditionalGeneration(DeepNMTForConditionalGeneration):
    """DeepNorm (Wang et al., 2022). Same network as [`DeepNMTForConditionalGeneration`] with [`DeepNormConfig`]
    defaults."""

    config_class = DeepNormConfig


class DeepNormModel(DeepNMTModel):
    config_class = DeepNormConfig


class DlclForConditionalGeneration(DeepNMTForConditionalGeneration):
    """DLCL (Wang et al., 2019). Same network as [`DeepNMTForConditionalGeneration`] with [`DlclConfig`] defaults."""

    config_class = DlclConfig


class DlclModel(DeepNMTModel):
    config_class = DlclConfig


class DsInitForConditionalGeneration(DeepNMTForConditionalGeneration):
    """DS-Init + MAtt (Zhang, Titov, Sennrich, 2019). Same network as [`DeepNMTForConditionalGeneration`] with
    [`DsInitConfig`] defaults."""

    config_class = DsInitConfig


class DsInitModel(DeepNMTModel):
    config_class = DsInitConfig


class SdtForConditionalGeneration(DeepNMTForConditionalGeneration):
    """SDT (Li et al., 2020). Same network as [`DeepNMTForConditionalGeneration`] with [`SdtConfig`] defaults.
    Growing a trained model and the staged schedule are training procedures, kept outside the model code."""

    config_class = SdtConfig


class SdtModel(DeepNMTModel):
    config_class = SdtConfig


class MscForConditionalGeneration(DeepNMTForConditionalGeneration):
    """MSC (Wei et al., 2020). Same network as [`DeepNMTForConditionalGeneration`] with [`MscConfig`] defaults."""

    config_class = MscConfig


class MscModel(DeepNMTModel):
    config_class = MscConfig


class DenseFormerForConditionalGeneration(DeepNMTForConditionalGeneration):
    """DenseFormer (Pagliardini et al., 2024). Same network as [`DeepNMTForConditionalGeneration`] with
    [`DenseFormerConfig`] defaults."""

    config_class = DenseFormerConfig


class DenseFormerModel(DeepNMTModel):
    config_class = DenseFormerConfig


class MixLnForConditionalGeneration(DeepNMTForConditionalGeneration):
    """Mix-LN (Li et al., 2024). Same network as [`DeepNMTForConditionalGeneration`] with [`MixLnConfig`] defaults."""

    config_class = MixLnConfig


class MixLnModel(DeepNMTModel):
    config_class = MixLnConfig


class AttnResForConditionalGeneration(DeepNMTForConditionalGeneration):
    """Attention Residuals (Kimi Team, 2026). Same network as [`DeepNMTForConditionalGeneration`] with
    [`AttnResConfig`] defaults."""

    config_class = AttnResConfig


class AttnResModel(DeepNMTModel):
    config_class = AttnResConfig


class HyperConnectionsForConditionalGeneration(DeepNMTForConditionalGeneration):
    """Hyper-Connections (Zhu et al., 2025). Same network as [`DeepNMTForConditionalGeneration`] with
    [`HyperConnectionsConfig`] defaults."""

    config_class = HyperConnectionsConfig


class HyperConnectionsModel(DeepNMTModel):
    config_class = HyperConnectionsConfig


# --- The methods -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeepNMTMethod:
    """One method of this package, named once: everything outside the model code that lists methods (the package's
    class maps and auto-class registration, the model card, `doctor` and the test families) reads this table.

    `checks` are the tiny variants `doctor` and the tests run for the method, by name: settings added to the tiny
    sizes they use (a variant with `msc_block_layers` takes its encoder depth from the blocks). `card` is the file
    under the package's `model_cards/methods/` that describes the method."""

    config_class: type
    model_class: type
    base_model_class: type
    card: str
    checks: dict[str, dict]

    @property
    def model_type(self) -> str:
        return self.config_class.model_type


METHODS: dict[str, DeepNMTMethod] = {}


def register_method(method: DeepNMTMethod) -> DeepNMTMethod:
    """Add `method` to `METHODS` (by model type); a second method under a model type already taken is an error."""
    known = METHODS.get(method.model_type)
    if known is not None and known != method:
        raise ValueError(f"model_type {method.model_type!r} is already the method of {known.config_class.__name__}.")
    for name in method.checks:
        owner = next((other for other in METHODS.values() if name in other.checks and other is not known), None)
        if owner is not None:
            raise ValueError(f"check name {name!r} is already taken by {owner.config_class.__name__}.")
    METHODS[method.model_type] = method
    return method


for _method in (
    DeepNMTMethod(
        DeepNMTConfig,
        DeepNMTForConditionalGeneration,
        DeepNMTModel,
        card="deep_nmt",
        checks={
            "prenorm": {},
            "postnorm": dict(pre_norm=False),
            "aan": dict(decoder_self_attention="average", aan_ffn=True),
        },
    ),
    DeepNMTMethod(
        DlclConfig,
        DlclForConditionalGeneration,
        DlclModel,
        card="dlcl",
        checks={"dlcl-prenorm": {}, "dlcl-postnorm": dict(pre_norm=False)},
    ),
    DeepNMTMethod(
        DsInitConfig, DsInitForConditionalGeneration, DsInitModel, card="dsinit", checks={"dsinit-matt": {}}
    ),
    DeepNMTMethod(
        SdtConfig,
        SdtForConditionalGeneration,
        SdtModel,
        card="sdt",
        checks={"sdt-sparse-rpr": dict(sparse_block_size=2, relative_position_window=4)},
    ),
    DeepNMTMethod(
        MscConfig, MscForConditionalGeneration, MscModel, card="msc", checks={"msc": dict(msc_block_layers=[2, 2])}
    ),
    DeepNMTMethod(
        DeepNormConfig, DeepNormForConditionalGeneration, DeepNormModel, card="deepnorm", checks={"deepnorm": {}}
    ),
    # the depth family of 2024 on: presets of the same backbone (settings it already has), so one cheap check each
    DeepNMTMethod(
        DenseFormerConfig,
        DenseFormerForConditionalGeneration,
        DenseFormerModel,
        card="denseformer",
        checks={"denseformer-2x2": dict(dlcl_dilation=2, dlcl_period=2)},
    ),
    DeepNMTMethod(
        MixLnConfig,
        MixLnForConditionalGeneration,
        MixLnModel,
        card="mixln",
        checks={"mixln-1-1": dict(encoder_post_norm_layers=1, decoder_post_norm_layers=1)},
    ),
    DeepNMTMethod(
        AttnResConfig,
        AttnResForConditionalGeneration,
        AttnResModel,
        card="attnres",
        checks={"attnres-block": dict(encoder_layer_aggregation="block_attnres", sparse_block_size=2)},
    ),
    DeepNMTMethod(
        HyperConnectionsConfig,
        HyperConnectionsForConditionalGeneration,
        HyperConnectionsModel,
        card="hyper_connections",
        checks={"mhc-2-dynamic": dict(hyper_connections_sinkhorn_iterations=3)},
    ),
):
    register_method(_method)

check_transformers_window()

# every method's two model classes, by their names in `METHODS` (a new method adds no line here)
__all__ = [
    "METHODS",
    "TESTED_TRANSFORMERS",
    "DeepNMTMethod",
    "register_method",
    "DeepNMTEncoderOutput",
    "DeepNMTPreTrainedModel",
    "LAYER_AGGREGATION_CLASSES",
    *(cls.__name__ for method in METHODS.values() for cls in (method.model_class, method.base_model_class)),
]
