"""What the ONNX export changes in a copy of the model before tracing it: the same function, in fewer or cheaper
operations per decoder step. The model files (which ship in every Hub repository) stay as they are; `for_export`
returns a rewritten deep copy, and `export_onnx` traces that.

* DeepNorm: a post-norm block `LN(alpha * x + F(x); eps)` is `LN(x + F(x) / alpha; eps / alpha^2)` (a LayerNorm
  ignores a positive factor of its input once its epsilon is scaled by the factor's square), so the block's output
  map (attention `out_proj`, `fc2`: weight and bias) is divided by alpha and its LayerNorm's epsilon by alpha^2, and
  the graph has no multiplication of the residual stream left. The CTranslate2 export folds the same factor
  (`hf_deep_nmt.serving.ctranslate2.deepnorm_scales`), there with one epsilon for the whole model; here each
  LayerNorm keeps its own. Blocks whose sublayer ends in no matrix (the AAN) or adds MSC's context keep the factor.
* Hyper-Connections: the dynamic weights' two maps of the normalised streams (`dynamic_alpha`, `dynamic_beta`) are
  one product with their concatenation, scaled and offset by concatenated constants; the copies are mixed by a
  broadcast product summed over the copies instead of a batched product of (n+1) x n by n x d matrices (one tiny
  matrix product per position, which ONNX Runtime runs one by one).
* Attention Residuals: the key gain and the pseudo-query of a layer are one vector, so a value's scores are one
  product of it with the layers' vectors, times its inverse RMS, instead of the normalised keys written out; each
  stored value is scored once, for every layer above it, not again at each layer that reads it.
* The decoder's cross-attention (and MSC's context attention, MAtt's merged one) reads each sentence's keys and values
  once for all its beams: a sentence's beams come in consecutive rows (the decoder's layout) and the states they
  attend in one row per sentence, so the beams' queries are one block of queries over the sentence's states. The
  step graph then takes the encoder states, the source mask and the cross-attention slots one row per sentence: ONNX
  Runtime ran one 1-query product per row and head over a copy of the states for every beam, a quarter of an int8
  beam-4 step. Exact: each query's scores and weights are those of its own row.

Every rewrite is exact in real arithmetic; in float32 the graphs' logits agree with the model's to rounding
(`tests/test_onnx_decoding.py` compares them for every family).
"""

from __future__ import annotations

import copy
import sys
import types

import torch


def for_export(model, group_cross_attention: bool = True):
    """A deep copy of `model` (in eval mode) with the rewrites above applied; `model` itself is untouched.
    `group_cross_attention=False`: the decoder's cross-attention reads one row of states per query row (the graphs
    written before the grouping)."""
    rewritten = copy.deepcopy(model).eval()
    with torch.no_grad():
        for module in rewritten.modules():
            kind = type(module).__name__
            if hasattr(module, "final_layer_norm") and hasattr(module, "fc2"):
                fold_deepnorm(module)
            elif kind == "DeepNMTHyperConnection":
                fuse_hyper_connection(module)
            elif kind in ("DeepNMTAttentionResidualHistory", "DeepNMTBlockAttentionResidualHistory"):
                score_once(module)
        if group_cross_attention:
            for module in rewritten.get_decoder().modules():
                if getattr(module, "is_cross_attention", False) and hasattr(module, "_context"):
                    module._context = types.MethodType(_grouped_context, module)
    return rewritten


def _blocks(layer):
    """(residual block, the linear map its sublayer ends with, or None) of every block of a layer."""
    blocks = [(layer.final_layer_norm, layer.fc2)]
    for norm_name, attention_name in (
        ("self_attn_layer_norm", "self_attn"),
        ("encoder_attn_layer_norm", "encoder_attn"),
    ):
        norm, attention = getattr(layer, norm_name, None), getattr(layer, attention_name, None)
        if norm is None or attention is None:
            continue
        # MSC's context is added to the attention's output after its out_proj: that sum is the sublayer's output
        plain = getattr(attention, "out_proj", None) is not None and getattr(layer, "context_attn", None) is None
        blocks.append((norm, attention.out_proj if plain else None))
    return blocks


def fold_deepnorm(layer) -> None:
    """DeepNorm's skip weight of each post-norm block of `layer` folded into its output map and LayerNorm epsilon."""
    for norm, output in _blocks(layer):
        alpha = getattr(norm, "residual_scale", 1.0)
        if alpha == 1.0 or output is None or norm.pre_norm or getattr(norm, "hyper", None) is not None:
            continue
        output.weight.div_(alpha)
        if output.bias is not None:
            output.bias.div_(alpha)
        norm.eps = norm.eps / alpha**2
        norm.residual_scale = 1.0


def fuse_hyper_connection(module) -> None:
    """`module` (a `DeepNMTHyperConnection`) computing its weights with one product and mixing without a batched
    matrix product (module docstring)."""
    n = module.streams
    module.fused_static = torch.cat([module.static_alpha, module.static_beta[:, None]], dim=1).detach().clone()
    if module.dynamic:
        module.fused_dynamic = torch.cat([module.dynamic_alpha, module.dynamic_beta[:, None]], dim=1).detach().clone()
        scales = [module.alpha_scale.expand(n + 1), module.beta_scale]
        module.fused_scales = torch.cat(scales).detach().clone()
    module.weights = types.MethodType(_hyper_weights, module)
    module.around = types.MethodType(_hyper_around, module)


def _hyper_weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`DeepNMTHyperConnection.weights` with the two dynamic maps as one product."""
    both = self.fused_static
    if self.dynamic:
        both = both + self.fused_scales * torch.tanh(self.norm(streams) @ self.fused_dynamic)
    alpha, beta = both[..., :-1], both[..., -1]
    if self.sinkhorn_iterations:
        sinkhorn_knopp = sys.modules[type(self).__module__].sinkhorn_knopp  # the model file's own (a Hub copy's)
        width = torch.sigmoid(alpha[..., :1].float())
        mixing = sinkhorn_knopp(alpha[..., 1:].float(), self.sinkhorn_iterations)
        alpha = torch.cat([width, mixing], dim=-1).to(streams.dtype)
        beta = (2.0 * torch.sigmoid(beta.float())).to(streams.dtype)
    return alpha, beta


def _hyper_around(self, streams, norm, sublayer, dropout_p: float, training: bool) -> torch.Tensor:
    """`DeepNMTHyperConnection.around` (inference), the copies mixed by a broadcast product summed over them."""
    alpha, beta = self.weights(streams)
    mixed = (alpha.unsqueeze(-1) * streams.unsqueeze(-2)).sum(dim=-3)  # (..., n+1, d)
    outputs = sublayer(norm(mixed[..., 0, :]))
    return mixed[..., 1:, :] + beta.unsqueeze(-1) * outputs.unsqueeze(-2)


def score_once(module) -> None:
    """`module` (an Attention Residuals history) scoring each stored value once, for every row at a time: the key
    gain folded into the query, q . (g * v * r) = (v . (g * q)) * r with r the inverse RMS of v, so one product of a
    value with the rows' folded queries (d x (layers + 1)) gives its score in every later layer's softmax. A value
    is stored once and read by every layer above it: scored at each read, its RMS and scores were computed again in
    each of them (28 times for 7 values in a 6-layer decoder step)."""
    module.folded_queries = (module.key_gains * module.queries).t().detach().clone()  # (d_model, rows)
    module.layer_input = types.MethodType(_scored_layer_input, module)
    module.stack_output = types.MethodType(_scored_stack_output, module)


def _scores(self, value: torch.Tensor) -> torch.Tensor:
    """The scores of `value` (..., d_model) in every row's softmax, (..., rows)."""
    inverse_rms = torch.rsqrt(value.pow(2).mean(dim=-1, keepdim=True) + self.eps)
    return (value @ self.folded_queries) * inverse_rms


def _attend_scored(self, state, row: int, partial: torch.Tensor | None) -> torch.Tensor:
    """`attend` over the stored values of `state` (scored once, kept on the state) and `partial` (the running block
    sum of Block Attention Residuals, which changes with each layer: scored at each read)."""
    scored = state.__dict__.setdefault("scores", [])
    scored.extend(_scores(self, value) for value in state.values[len(scored) :])
    values, scores = list(state.values), list(scored)
    if partial is not None:
        values.append(partial)
        scores.append(_scores(self, partial))
    chosen = torch.stack([score[..., row] for score in scores])  # (n, batch, length)
    weights = torch.softmax(chosen.float(), dim=0).to(values[0].dtype)
    return (weights.unsqueeze(-1) * torch.stack(values)).sum(dim=0)


def _scored_layer_input(self, state, index: int) -> torch.Tensor:
    """`DeepNMTBlockAttentionResidualHistory.layer_input` with the values scored once (`score_once`)."""
    state.layer_in = _attend_scored(self, state, index, state.partial)
    return state.layer_in


def _scored_stack_output(self, state) -> torch.Tensor:
    """`DeepNMTBlockAttentionResidualHistory.stack_output` with the values scored once (`score_once`)."""
    return _attend_scored(self, state, len(self.queries) - 1, None)


def _grouped_context(self, hidden_states, key_value_states, attention_mask, cache_layer) -> torch.Tensor:
    """`DeepNMTAttention._context` of a cross-attention whose `hidden_states` rows are the beams of each sentence in a
    row (rows grouped by sentence) and whose memory (`key_value_states`, the cache layer's slots, `attention_mask`)
    has one row per sentence: every query of a sentence in one product with its keys, (sentences, heads, beams x
    length, head) against (sentences, heads, source, head)."""
    rows, length, _ = hidden_states.shape
    query = self._split_heads(self.q_proj(hidden_states))  # (rows, heads, length, head)

    def project() -> tuple[torch.Tensor, torch.Tensor]:
        return self._split_heads(self.k_proj(key_value_states)), self._split_heads(self.v_proj(key_value_states))

    if cache_layer is None:
        key, value = project()
    elif self.context_memory:
        key, value = cache_layer.remember_context(project)
    else:
        key, value = cache_layer.remember(project)
    sentences, heads, width = key.shape[0], self.num_heads, self.head_dim
    grouped = query.reshape(sentences, -1, heads, length, width).transpose(1, 2).reshape(sentences, heads, -1, width)
    sdpa = sys.modules[type(self).__module__].sdpa_avoiding_cudnn  # the model file's own (a Hub copy's)
    output = sdpa(grouped, key, value, attention_mask, 0.0, self.avoid_cudnn)  # the mask: (sentences, 1, 1, source)
    output = output.reshape(sentences, heads, -1, length, width).permute(0, 2, 3, 1, 4)
    return output.reshape(rows, length, self.embed_dim)
