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
* Attention Residuals: the key gain and the pseudo-query of a layer are one vector, so a layer's scores are one
  product of the stacked values with it, times each value's inverse RMS, instead of the normalised keys written out.

Every rewrite is exact in real arithmetic; in float32 the graphs' logits agree with the model's to rounding
(`tests/test_onnx_decoding.py` compares them for every family).
"""

from __future__ import annotations

import copy
import sys
import types

import torch


def for_export(model):
    """A deep copy of `model` (in eval mode) with the rewrites above applied; `model` itself is untouched."""
    rewritten = copy.deepcopy(model).eval()
    with torch.no_grad():
        for module in rewritten.modules():
            kind = type(module).__name__
            if hasattr(module, "final_layer_norm") and hasattr(module, "fc2"):
                fold_deepnorm(module)
            elif kind == "DeepNMTHyperConnection":
                fuse_hyper_connection(module)
            elif kind in ("DeepNMTAttentionResidualHistory", "DeepNMTBlockAttentionResidualHistory"):
                module.attend = types.MethodType(_attend_folded, module)
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


def _attend_folded(self, values: list[torch.Tensor], row: int) -> torch.Tensor:
    """`DeepNMTBlockAttentionResidualHistory.attend` with the key gain folded into the query:
    q . (g * v * r) = (v . (g * q)) * r, r the inverse RMS of v."""
    stacked = torch.stack(values)  # (n, batch, length, d_model)
    inverse_rms = torch.rsqrt(stacked.pow(2).mean(dim=-1) + self.eps)
    scores = (stacked @ (self.key_gains[row] * self.queries[row])) * inverse_rms
    weights = torch.softmax(scores.float(), dim=0).to(stacked.dtype)
    return (weights.unsqueeze(-1) * stacked).sum(dim=0)
