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


def _saved_graph(path, nodes, inputs, outputs, constants):
    """A one-graph ONNX model of float tensors at `path` (`inputs`/`outputs`: name -> shape)."""
    from onnx import TensorProto, helper, numpy_helper, save

    values = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs.items()]
    results = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs.items()]
    weights = [numpy_helper.from_array(array, name) for name, array in constants.items()]
    graph = helper.make_graph(nodes, "g", values, results, weights)
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)


def test_the_sinkhorn_normalisations_become_one_node_each_with_the_models_values(tmp_path):
    """mHC's iteration in the exported graphs: each row or column division by its sum of an Exp's output becomes one
    LpNormalization (p=1), with the torch model's values; a division of a tensor that may be negative is kept."""
    np = pytest.importorskip("numpy")
    ort = pytest.importorskip("onnxruntime")
    from onnx import helper, load

    from hf_deep_nmt.modeling.modeling_deep_nmt import sinkhorn_knopp
    from hf_deep_nmt.serving.onnx_export import _fuse_normalisations

    nodes, last = [helper.make_node("Exp", ["x"], ["m0"])], "m0"
    for index in range(6):  # three iterations: rows, then columns
        axis = "rows" if index % 2 == 0 else "columns"
        nodes += [
            helper.make_node("ReduceSum", [last, axis], [f"s{index}"], keepdims=1),
            helper.make_node("Div", [last, f"s{index}"], [f"m{index + 1}"]),
        ]
        last = f"m{index + 1}"
    nodes += [helper.make_node("ReduceSum", ["x", "rows"], ["t"]), helper.make_node("Div", ["x", "t"], ["y"])]
    constants = {"rows": np.array([-1]), "columns": np.array([-2])}
    path = tmp_path / "g.onnx"
    _saved_graph(path, nodes, {"x": [5, 3, 3]}, {last: [5, 3, 3], "y": [5, 3, 3]}, constants)
    _fuse_normalisations(path)
    ops = [node.op_type for node in load(path).graph.node]
    assert ops == ["Exp", *["LpNormalization"] * 6, "ReduceSum", "Div"]
    logits = torch.randn(5, 3, 3) * 3
    matrix, plain = ort.InferenceSession(str(path)).run(None, {"x": logits.numpy()})
    torch.testing.assert_close(torch.from_numpy(matrix), sinkhorn_knopp(logits, 3), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.from_numpy(plain), logits / logits.sum(-1, keepdim=True))


def test_the_step_graph_keeps_only_the_inputs_it_reads(tmp_path):
    """An encoder state no node of the step graph reads (MSC's block outputs) is no input of it, so the decoder
    neither repeats it for the beams nor binds it; the inputs the decoder always binds stay."""
    pytest.importorskip("onnx")
    from onnx import helper, load

    from hf_deep_nmt.serving.onnx_export import _read_inputs_only

    path = tmp_path / "g.onnx"
    shapes = {name: [2] for name in ("tokens", "steps", "last_hidden_state", "block_outputs", "context_states")}
    _saved_graph(path, [helper.make_node("Identity", ["context_states"], ["logits"])], shapes, {"logits": [2]}, {})
    _read_inputs_only(path)
    assert [value.name for value in load(path).graph.input] == ["tokens", "steps", "context_states"]
