"""The copy of a model the ONNX export traces (`hf_deep_nmt.serving.onnx_rewrites.for_export`: DeepNorm's skip weight
folded into the weights, Hyper-Connections' weights in one product, Attention Residuals' key gain folded into the
query) computes the model's logits, and leaves the model as it was. Torch only: the export of the families whose
decoding state differs is tests/test_onnx_decoding.py's."""

import pytest
import torch

from hf_deep_nmt.serving.onnx_rewrites import for_export
from hf_deep_nmt.tools import doctor

# (doctor family, overrides): DeepNorm over DLCL and over the AAN (whose block keeps its factor: no output map),
# static and dynamic Hyper-Connections and mHC, full and block Attention Residuals
CASES = {
    "deepnorm-dlcl": ("deepnorm", {"layer_aggregation": "dlcl"}),
    "deepnorm-aan": ("deepnorm", {"decoder_self_attention": "average", "aan_ffn": True}),
    "hc-static": ("mhc-2-dynamic", {"hyper_connections_sinkhorn_iterations": 0, "hyper_connections_dynamic": False}),
    "hc-dynamic": ("mhc-2-dynamic", {"hyper_connections_sinkhorn_iterations": 0, "hyper_connections": 3}),
    "mhc-dynamic": ("mhc-2-dynamic", {}),
    "attnres": ("attnres-block", {"encoder_layer_aggregation": "attnres", "sparse_block_size": 1}),
    "attnres-block": ("attnres-block", {}),
}


@pytest.mark.parametrize("case", CASES)
def test_the_rewritten_copy_computes_the_models_logits(case):
    family, overrides = CASES[case]
    model = doctor.family_model(family, "cpu", **overrides)
    batch = doctor.padded_batch("cpu", [6, 4, 2], model.config.vocab_size)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    rewritten = for_export(model)
    with torch.no_grad():
        expected = model(**batch).logits
        logits = rewritten(**batch).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed"
    if family == "deepnorm":  # the factor is gone from every block with an output map (all but the AAN's)
        scales = [m.residual_scale for m in rewritten.modules() if hasattr(m, "residual_scale")]
        kept = model.config.decoder_layers if "aan" in case else 0
        assert len(scales) - scales.count(1.0) == kept
