"""Growing a trained model (SDT stacking): copied layers equal their sources tensor by tensor, everything else is
unchanged, the combination weights grow by a uniform row, and the grown model saves, loads and decodes."""

import copy
import json
import os
import sys
import textwrap

import pytest
import torch

from hf_deep_nmt import (
    DeepNMTConfig,
    DeepNMTForConditionalGeneration,
    DeepNormConfig,
    DeepNormForConditionalGeneration,
    MscConfig,
    MscForConditionalGeneration,
    SdtConfig,
    SdtForConditionalGeneration,
)
from hf_deep_nmt.training.growing import deepnorm_output_scale, grow_encoder, source_layers, with_layer_aggregation

SIZES = dict(
    vocab_size=37,
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=2,
    encoder_ffn_dim=24,
    decoder_ffn_dim=20,
)
SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])


def trained_like(model: torch.nn.Module) -> torch.nn.Module:
    """Distinct values in every tensor, as a trained model would have, so a wrong copy cannot match by chance."""
    torch.manual_seed(7)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(torch.randn_like(tensor) * 0.3)
    return model.eval()


@pytest.fixture
def sdt():
    return trained_like(
        SdtForConditionalGeneration(SdtConfig(**SIZES, sparse_block_size=2, relative_position_window=2))
    )


def layer_tensors(model, index):
    prefix = f"model.encoder.layers.{index}."
    return {key[len(prefix) :]: value for key, value in model.state_dict().items() if key.startswith(prefix)}


@pytest.mark.parametrize(
    ("strategy", "new", "expected"),
    [
        ("top", 1, [0, 1, 2, 2]),
        ("top", 2, [0, 1, 2, 1, 2]),
        ("top_only", 2, [0, 1, 2, 2, 2]),
        ("double", 3, [0, 1, 2, 0, 1, 2]),
        ("interleave", 3, [0, 0, 1, 1, 2, 2]),
    ],
)
def test_source_layer_maps_of_the_strategies(strategy, new, expected):
    assert source_layers(3, new, strategy) == expected


def test_grown_sdt_model_copies_the_top_block_and_keeps_everything_else(sdt):
    grown = grow_encoder(sdt)  # g defaults to the block size (2): layers 0, 1 copied as layers 2, 3
    assert grown.config.encoder_layers == 4 and grown.config.encoder_block_boundaries == [0, 2, 4]
    assert type(grown) is SdtForConditionalGeneration
    for new_index, source_index in enumerate([0, 1, 0, 1]):
        copied, source = layer_tensors(grown, new_index), layer_tensors(sdt, source_index)
        assert copied.keys() == source.keys()
        assert all(torch.equal(copied[name], source[name]) for name in source)
    old_state, new_state = sdt.state_dict(), grown.state_dict()
    untouched = [k for k in old_state if not k.startswith(("model.encoder.layers.", "model.encoder.history."))]
    assert untouched and all(torch.equal(old_state[k], new_state[k]) for k in untouched)
    weight, old = grown.model.encoder.history.weight.detach(), sdt.model.encoder.history.weight.detach()
    assert torch.equal(weight[:2, :2], old)
    torch.testing.assert_close(weight[2], torch.full((3,), 1 / 3))  # the new output row: uniform
    norms = grown.model.encoder.history.layer_norms
    assert torch.equal(norms[1].weight, sdt.model.encoder.history.layer_norms[0].weight)  # copied from the old top
    assert sdt.config.encoder_layers == 2  # the source model is untouched
    assert not grown.training and grow_encoder(sdt.train()).training  # the source's train/eval mode is kept


def test_reset_option_reproduces_the_reference_codes_layer_norm_reset(sdt):
    grown = grow_encoder(sdt, reset_previous_block_norm=True)
    old_top = grown.model.encoder.history.layer_norms[0]
    assert torch.equal(old_top.weight, torch.ones(16)) and torch.equal(old_top.bias, torch.zeros(16))
    assert torch.equal(
        grown.model.encoder.history.layer_norms[1].weight, sdt.model.encoder.history.layer_norms[0].weight
    )


def test_the_reset_option_is_a_no_op_without_history_layer_norms():
    model = trained_like(SdtForConditionalGeneration(SdtConfig(**SIZES, sparse_block_size=2, dlcl_history_norm=False)))
    reset, kept = grow_encoder(model, reset_previous_block_norm=True), grow_encoder(model)
    assert reset.state_dict().keys() == kept.state_dict().keys()
    assert all(torch.equal(tensor, kept.state_dict()[name]) for name, tensor in reset.state_dict().items())


def test_dense_dlcl_grows_one_uniform_row_per_new_layer():
    model = trained_like(DeepNMTForConditionalGeneration(DeepNMTConfig(**SIZES, layer_aggregation="dlcl")))
    grown = grow_encoder(model, 2, "top")
    weight = grown.model.encoder.history.weight.detach()
    assert weight.shape == (5, 5) and torch.equal(weight[:3, :3], model.model.encoder.history.weight.detach())
    torch.testing.assert_close(weight[3, :4], torch.full((4,), 0.25))
    torch.testing.assert_close(weight[4], torch.full((5,), 0.2))
    with torch.no_grad():
        grown.eval()(input_ids=SOURCE, decoder_input_ids=torch.tensor([[0, 5], [0, 6]]))


@pytest.mark.parametrize(("strategy", "new", "aggregation"), [("top", 2, None), ("double", 3, "dlcl")])
def test_a_grown_deepnorm_encoder_layer_computes_what_its_source_did(strategy, new, aggregation):
    """DeepNorm's encoder alpha grows with the depth: each copied layer, given the same input, returns what its source
    returned with the LayerNorm epsilon divided by c^2 = (alpha_new / alpha_old)^2 (`deepnorm_output_scale`); a copy
    left unscaled does not."""
    model = trained_like(DeepNormForConditionalGeneration(DeepNormConfig(**{**SIZES, "encoder_layers": 3})))
    grown = grow_encoder(model, new, strategy, aggregation=aggregation)
    old_alpha, new_alpha = (m.config.deepnorm_constants("encoder")[0] for m in (model, grown))
    scale = deepnorm_output_scale(model.config, grown.config)
    assert new_alpha > old_alpha and scale == pytest.approx(new_alpha / old_alpha)
    assert scale**2 == pytest.approx((grown.config.encoder_layers / 3) ** 0.5)
    hidden = torch.randn(2, 5, SIZES["d_model"], generator=torch.Generator().manual_seed(3))
    old_layers, layers = model.get_encoder().layers, grown.get_encoder().layers
    for layer, source in zip(layers, source_layers(3, new, strategy)):
        assert layer.final_layer_norm.residual_scale == pytest.approx(new_alpha)
        reference = copy.deepcopy(old_layers[source])
        for norm in (reference.self_attn_layer_norm, reference.final_layer_norm):
            norm.eps = model.config.layer_norm_eps / scale**2
        with torch.no_grad():
            torch.testing.assert_close(layer(hidden), reference(hidden), rtol=0, atol=2e-6)
            assert (layer(hidden) - old_layers[source](hidden)).abs().max() < 1e-4  # epsilon alone: a small change
            unscaled = copy.deepcopy(old_layers[source])
            for norm in (unscaled.self_attn_layer_norm, unscaled.final_layer_norm):
                norm.residual_scale = new_alpha  # copied without the rescaling
            assert (unscaled(hidden) - reference(hidden)).abs().max() > 0.05
    assert (
        grown.model.decoder.layers[0].final_layer_norm.residual_scale == model.config.deepnorm_constants("decoder")[0]
    )
    for name, tensor in model.model.decoder.state_dict().items():
        assert torch.equal(grown.model.decoder.state_dict()[name], tensor), name


def test_a_grown_deepnorm_model_with_the_output_row_set_by_hand_keeps_its_function():
    """As for the other methods (docs/serving.md, "Which growth keeps the function"): a DLCL encoder grown with its
    output row set by hand to the old top layer computes the old model's function (4.8e-6 nats here), only because
    each copied layer is rescaled to the new alpha (up to the epsilon change); without the rescaling it moves by
    0.96 nats."""
    model = trained_like(DeepNormForConditionalGeneration(DeepNormConfig(**{**SIZES, "encoder_layers": 3})))
    batch = dict(input_ids=SOURCE, attention_mask=SOURCE.ne(1), decoder_input_ids=torch.tensor([[0, 5, 9], [0, 6, 4]]))

    def log_probs(network):
        with torch.no_grad():
            return torch.log_softmax(network(**batch).logits, dim=-1)

    grown = grow_encoder(model, 2, "top", aggregation="dlcl")
    with torch.no_grad():
        weight = grown.model.encoder.history.weight
        weight[-1].zero_()
        weight[-1, 3] = 1.0  # the old top layer's output (index 0 is the embedding)
    assert (log_probs(grown) - log_probs(model)).abs().max() < 1e-4
    scale = deepnorm_output_scale(model.config, grown.config)
    with torch.no_grad():
        for layer in grown.model.encoder.layers:
            for output_map in (layer.self_attn.out_proj, layer.fc2):
                output_map.weight.div_(scale)
                output_map.bias.div_(scale)
    assert (log_probs(grown) - log_probs(model)).abs().max() > 0.05


def test_grown_model_saves_reloads_through_remote_code_and_decodes(sdt, tmp_path, clean_python):
    grown = grow_encoder(sdt)
    with torch.no_grad():
        expected = grown.generate(SOURCE, attention_mask=SOURCE.ne(1), num_beams=2, max_new_tokens=5)
    grown.save_pretrained(tmp_path / "grown")
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["hf_deep_nmt"] = None
        import torch
        from transformers import AutoModelForSeq2SeqLM
        model = AutoModelForSeq2SeqLM.from_pretrained({str(tmp_path / "grown")!r}, trust_remote_code=True)
        source = torch.tensor({SOURCE.tolist()})
        out = model.generate(source, attention_mask=source.ne(1), num_beams=2, max_new_tokens=5)
        print(json.dumps({{"layers": model.config.encoder_layers, "out": out.tolist()}}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    # forked from the session's clean server: the script's process has no hf_deep_nmt, as a user's would not
    result = clean_python.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert loaded["layers"] == 4 and loaded["out"] == expected.tolist()


def test_a_saved_folder_can_be_grown(sdt, tmp_path):
    sdt.save_pretrained(tmp_path)
    grown = grow_encoder(tmp_path, 2, "top_only")
    assert grown.config.encoder_layers == 4
    assert all(torch.equal(v, layer_tensors(sdt, 1)[k]) for k, v in layer_tensors(grown, 3).items())


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((3, "top"), ValueError, r"Cannot copy the top 3 layers of a 2-layer encoder"),
        ((1, "double"), ValueError, r"`double` adds as many layers as the encoder has \(2\), got 1"),
        ((0, "top"), ValueError, r"`num_new_layers` must be a positive integer, got 0"),
        ((1, "sideways"), ValueError, r"`strategy` must be one of .*got 'sideways'"),
    ],
)
def test_impossible_growth_is_refused_clearly(sdt, args, error, message):
    with pytest.raises(error, match=message):
        grow_encoder(sdt, *args)


def test_growth_needs_a_model_of_this_package_and_a_size_without_blocks():
    with pytest.raises(TypeError, match="needs a model of this package, got Linear"):
        grow_encoder(torch.nn.Linear(2, 2), 1)
    residual = DeepNMTForConditionalGeneration(DeepNMTConfig(**SIZES))
    with pytest.raises(ValueError, match="Give `num_new_layers`"):
        grow_encoder(residual)
    dlcl = DeepNMTForConditionalGeneration(DeepNMTConfig(**SIZES, layer_aggregation="dlcl"))
    with pytest.raises(ValueError, match="`interleave` moves every layer"):
        grow_encoder(dlcl, 2, "interleave")


def test_a_model_in_a_hub_cache_can_be_grown_by_repo_id(sdt, tmp_path, hub_cache):
    """A model laid out in `$HF_HUB_CACHE` as the Hub cache does it, loaded offline by repo id."""
    from huggingface_hub import constants

    folder = tmp_path / "saved"
    sdt.save_pretrained(folder)
    hub_cache(folder, constants.HF_HUB_CACHE, "org/sdt-grow-test")
    grown = grow_encoder("org/sdt-grow-test")
    assert grown.config.encoder_layers == 4 and grown.config.encoder_block_boundaries == [0, 2, 4]
    assert all(torch.equal(v, layer_tensors(sdt, 0)[k]) for k, v in layer_tensors(grown, 2).items())


# ---- a residual model rewired exactly (`with_layer_aggregation`), then grown ----------------------------------------


def model_inputs():
    return dict(input_ids=SOURCE, attention_mask=SOURCE.ne(1), decoder_input_ids=torch.tensor([[0, 5, 9], [0, 6, 3]]))


def decodes(model):
    source = dict(input_ids=SOURCE, attention_mask=SOURCE.ne(1), max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        return [model.generate(**source, num_beams=beams).tolist() for beams in (1, 4)]


@pytest.mark.parametrize("aggregation", ["dlcl", "sparse"])
@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_a_residual_encoder_rewired_computes_the_same_function(pre_norm, aggregation, tmp_path):
    residual = trained_like(DeepNMTForConditionalGeneration(DeepNMTConfig(**SIZES, pre_norm=pre_norm)))
    changed = with_layer_aggregation(residual, aggregation)
    config = changed.config
    assert (config.encoder_layer_aggregation, config.decoder_layer_aggregation) == (aggregation, "residual")
    assert config.dlcl_history_norm is False and not changed.training
    assert config.growth == [{"layer_aggregation": ["residual", aggregation], "stack": "encoder"}]
    assert torch.equal(changed.model.encoder.history.weight.detach(), torch.eye(3 if aggregation == "dlcl" else 2))
    with torch.no_grad():
        expected, got = residual(**model_inputs()), changed(**model_inputs())
    torch.testing.assert_close(got.encoder_last_hidden_state, expected.encoder_last_hidden_state, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-6)
    assert decodes(changed) == decodes(residual)
    changed.save_pretrained(tmp_path)
    again = DeepNMTForConditionalGeneration.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(again(**model_inputs()).logits, got.logits)
    assert again.config.growth == config.growth and residual.config.encoder_layer_aggregation == "residual"


def test_the_decoder_can_be_rewired_too_and_one_block_is_not_required():
    residual = trained_like(DeepNMTForConditionalGeneration(DeepNMTConfig(**{**SIZES, "encoder_layers": 4})))
    both = with_layer_aggregation(
        with_layer_aggregation(residual, "sparse", block_boundaries=[0, 1, 4]), "dlcl", stack="decoder"
    )
    assert both.config.encoder_block_boundaries == [0, 1, 4] and both.config.decoder_layer_aggregation == "dlcl"
    with torch.no_grad():
        torch.testing.assert_close(both(**model_inputs()).logits, residual(**model_inputs()).logits, rtol=0, atol=1e-6)


def test_what_cannot_be_rewired_exactly_is_refused_by_name():
    dlcl = DeepNMTForConditionalGeneration(DeepNMTConfig(**SIZES, layer_aggregation="dlcl"))
    with pytest.raises(ValueError, match="changes a residual stack; the encoder already uses 'dlcl' aggregation"):
        with_layer_aggregation(dlcl, "dlcl")
    # the decoder's DLCL keeps its history LayerNorms, a setting the exact encoder would have to turn off for both
    mixed = DeepNMTForConditionalGeneration(
        DeepNMTConfig(**SIZES, encoder_layer_aggregation="residual", layer_aggregation="dlcl")
    )
    with pytest.raises(ValueError, match="The decoder uses 'dlcl' aggregation with dlcl_history_norm=True"):
        with_layer_aggregation(mixed, "sparse")
    residual = DeepNMTForConditionalGeneration(DeepNMTConfig(**SIZES))
    with pytest.raises(ValueError, match=r"`aggregation` must be one of \('dlcl', 'sparse'\), got 'residual'"):
        with_layer_aggregation(residual, "residual")
    with pytest.raises(ValueError, match="`block_boundaries` only apply to `aggregation='sparse'`"):
        with_layer_aggregation(residual, "dlcl", block_boundaries=[0, 2])
    with pytest.raises(ValueError, match="`stack` must be 'encoder' or 'decoder', got 'both'"):
        with_layer_aggregation(residual, "dlcl", stack="both")
    msc = MscForConditionalGeneration(MscConfig(**{**SIZES, "encoder_layers": 2}, msc_block_layers=1))
    with pytest.raises(ValueError, match="with_layer_aggregation does not apply to MSC models"):
        with_layer_aggregation(msc, "dlcl")
    with pytest.raises(ValueError, match="`interleave` moves every layer"):
        grow_encoder(residual, 2, "interleave", aggregation="dlcl")


def test_grow_with_aggregation_rewires_then_grows():
    residual = trained_like(DeepNMTForConditionalGeneration(DeepNMTConfig(**SIZES)))
    grown = grow_encoder(residual, 2, "top", aggregation="dlcl")
    expected = grow_encoder(with_layer_aggregation(residual, "dlcl"), 2, "top")
    assert grown.config.growth == [
        {"layer_aggregation": ["residual", "dlcl"], "stack": "encoder"},
        {"encoder_layers": [2, 4], "strategy": "top"},
    ]
    assert all(torch.equal(tensor, expected.state_dict()[name]) for name, tensor in grown.state_dict().items())
    sparse = grow_encoder(residual, 2, "top", aggregation="sparse")
    assert sparse.config.encoder_block_boundaries == [0, 2, 4]


def test_the_growth_function_benchmark_backs_the_readme_table(tmp_path):
    """benchmarks/growth_function.py: rewiring is exact; no offered strategy keeps the function; choosing the output
    row by hand would (the README's table)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "growth_function.py"
    spec = importlib.util.spec_from_file_location("growth_function", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        rows = module.main(["--json", str(tmp_path / "rows.json")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    assert all(row.get("rewiring", 0.0) <= 1e-6 for row in rows)
    offered = [row for row in rows if "by hand" not in row["strategy"] and row["difference"] is not None]
    assert len(offered) == 22 and all(row["difference"] > 0.1 for row in offered)
    assert all(row["difference"] <= 1e-6 for row in rows if "by hand" in row["strategy"])
    assert [row["aggregation"] for row in rows if row["difference"] is None] == ["dlcl", "dlcl"]  # interleave
