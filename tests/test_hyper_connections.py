"""Hyper-Connections (Zhu et al., ICLR 2025) and mHC (Xie et al., DeepSeek 2025) as the residual streams of the
backbone (`hyper_connections`, `hyper_connections_dynamic`, `hyper_connections_sinkhorn_iterations`): one block
computed by hand from the papers' formulas, the initialisation that reproduces the pre-norm residual model, padding,
the static cache and compiled decoding, remote code, LoRA, the sizes the weights must have, and the refused settings.

Cached == uncached decoding, beams, padding and save/load also run on the shared `ARCHITECTURES` matrix (id `hyper`).
"""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.modeling.modeling_deep_nmt import sinkhorn_knopp
from hf_deep_nmt.modeling.sizes_deep_nmt import _shape_findings, count_parameters
from hf_deep_nmt.serving.ctranslate2 import ctranslate2_blockers
from hf_deep_nmt.tools.diagnostics import layer_outputs
from hf_deep_nmt.training.growing import grow_encoder

SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
TARGET = torch.tensor([[0, 6, 8, 12], [0, 13, 4, 4]])
MHC = dict(hyper_connections=2, hyper_connections_dynamic=True, hyper_connections_sinkhorn_iterations=3)


def logits(model, **inputs):
    with torch.no_grad():
        return model(input_ids=SOURCE, attention_mask=SOURCE.ne(1).long(), decoder_input_ids=TARGET, **inputs).logits


def perturb(module: nn.Module, generator: torch.Generator, scale: float = 0.5) -> None:
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


# ---- one residual block by hand -------------------------------------------------------------------------------------


def hand_block(block, streams, sublayer, *, dynamic: bool, iterations: int) -> torch.Tensor:
    """The paper's formulas with explicit sums over the copies: H' = A_r^T H + beta^T F(LN(A_m^T H)), the weights
    static, or plus s * tanh(LN(H) W) (dynamic), mapped by mHC's sigmoid / 2 sigmoid / Sinkhorn-Knopp when
    `iterations` > 0."""
    hyper, n = block.hyper, streams.shape[-2]
    copies = [streams[..., i, :] for i in range(n)]
    alpha = hyper.static_alpha.expand(*streams.shape[:-2], n, n + 1).clone()
    beta = hyper.static_beta.expand(*streams.shape[:-2], n).clone()
    if dynamic:
        norm = hyper.norm
        for i in range(n):
            normed = F.layer_norm(copies[i], (copies[i].shape[-1],), norm.weight, norm.bias, norm.eps)
            for j in range(n + 1):
                alpha[..., i, j] += hyper.alpha_scale * torch.tanh((normed * hyper.dynamic_alpha[:, j]).sum(-1))
            beta[..., i] += hyper.beta_scale * torch.tanh((normed * hyper.dynamic_beta).sum(-1))
    if iterations:
        width = torch.sigmoid(alpha[..., :1])
        matrix = torch.exp(alpha[..., 1:])
        for _ in range(iterations):
            matrix = matrix / matrix.sum(-1, keepdim=True)
            matrix = matrix / matrix.sum(-2, keepdim=True)
        alpha = torch.cat([width, matrix], dim=-1)
        beta = 2 * torch.sigmoid(beta)
    h_in = sum(alpha[..., i, 0, None] * copies[i] for i in range(n))
    out = sublayer(F.layer_norm(h_in, (h_in.shape[-1],), block.weight, block.bias, block.eps))
    new = [sum(alpha[..., i, 1 + j, None] * copies[i] for i in range(n)) + beta[..., j, None] * out for j in range(n)]
    return torch.stack(new, dim=-2)


@pytest.mark.parametrize(
    ("settings", "iterations"),
    [(dict(hyper_connections=3), 0), (dict(hyper_connections=3, hyper_connections_dynamic=True), 0), (MHC, 3)],
    ids=["static", "dynamic", "dynamic-mhc"],
)
def test_one_block_computes_the_papers_formula(settings, iterations, tiny_config):
    model = DeepNMTForConditionalGeneration(tiny_config(**settings))
    block = model.model.decoder.layers[1].encoder_attn_layer_norm
    generator = torch.Generator().manual_seed(3)
    perturb(block, generator)
    n = settings["hyper_connections"]
    streams = torch.randn(2, 4, n, 16, generator=generator)
    weight = torch.randn(16, 16, generator=generator)

    def sublayer(x):
        return torch.relu(x @ weight)

    expected = hand_block(
        block, streams, sublayer, dynamic=settings.get("hyper_connections_dynamic", False), iterations=iterations
    )
    with torch.no_grad():
        torch.testing.assert_close(block.around(streams, sublayer), expected, rtol=1e-5, atol=1e-5)


def test_the_sinkhorn_knopp_iteration_makes_rows_and_columns_sum_to_one():
    logits = torch.randn(5, 3, 3) * 2
    matrix = sinkhorn_knopp(logits, 1)
    torch.testing.assert_close(matrix.sum(-2), torch.ones(5, 3))  # each new copy's weights: exact after each round
    assert (matrix.sum(-1) - 1).abs().max() > 1e-3  # the rows only converge
    matrix = sinkhorn_knopp(logits, 80)
    torch.testing.assert_close(matrix.sum(-1), torch.ones(5, 3), rtol=0, atol=1e-5)
    torch.testing.assert_close(matrix.sum(-2), torch.ones(5, 3), rtol=0, atol=1e-6)
    assert (matrix > 0).all()
    # the iteration ignores a common factor of exp(logits): shifted logits give the same matrix
    torch.testing.assert_close(sinkhorn_knopp(logits + 7.0, 80), matrix)


def test_initial_weights_pick_the_stream_by_the_blocks_place_in_the_stack(tiny_config):
    """Sublayer k of a stack reads copy k mod n: the decoder has 3 blocks per layer (2 under MAtt), the encoder 2."""
    model = DeepNMTForConditionalGeneration(tiny_config(hyper_connections=3))
    cross = model.model.decoder.layers[1].encoder_attn_layer_norm.hyper  # k = 1 * 3 + 1 = 4 -> copy 1
    assert torch.equal(cross.static_alpha, torch.cat([torch.tensor([[0.0], [1.0], [0.0]]), torch.eye(3)], dim=1))
    assert torch.equal(cross.static_beta, torch.ones(3))
    ffn = model.model.encoder.layers[2].final_layer_norm.hyper  # k = 2 * 2 + 1 = 5 -> copy 2
    assert torch.equal(ffn.static_alpha[:, 0], torch.tensor([0.0, 0.0, 1.0]))
    merged = DeepNMTForConditionalGeneration(tiny_config(hyper_connections=3, decoder_self_attention="merged_average"))
    assert merged.model.decoder.layers[1].final_layer_norm.hyper.static_alpha[:, 0].tolist() == [1.0, 0.0, 0.0]

    mhc = DeepNMTForConditionalGeneration(tiny_config(**{**MHC, "hyper_connections": 3})).model.decoder.layers[1]
    hyper = mhc.encoder_attn_layer_norm.hyper
    torch.testing.assert_close(torch.sigmoid(hyper.static_alpha[:, 0]), torch.tensor([1 / 6, 2 / 3, 1 / 6]))
    torch.testing.assert_close(sinkhorn_knopp(hyper.static_alpha[:, 1:], 3), (torch.eye(3) + 1 / 3) / 2)
    assert torch.equal(hyper.static_beta, torch.zeros(3)) and torch.equal(hyper.dynamic_alpha, torch.zeros(16, 4))
    assert hyper.alpha_scale.item() == hyper.beta_scale.item() == pytest.approx(0.01)


# ---- at initialisation: the pre-norm residual model -----------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        dict(hyper_connections=2),
        dict(hyper_connections=3, hyper_connections_dynamic=True, decoder_self_attention="average"),
        dict(encoder_hyper_connections=4, decoder_hyper_connections=2, hyper_connections_sinkhorn_iterations=5),
        MHC,
    ],
    ids=["static-2", "dynamic-3-aan", "mhc-4-2", "dynamic-mhc-2"],
)
def test_at_initialisation_the_model_is_the_pre_norm_residual_model(settings, tiny_config, random_model):
    """The residual model's (perturbed) weights loaded into a freshly initialised Hyper-Connections model: every copy
    of the stream stays x + F(LN(x)), and the stacks end in the sum of the n copies, n times the residual output. The
    final LayerNorm removes the factor up to its epsilon, LN(n y; eps) = LN(y; eps / n^2): with the final
    LayerNorms' epsilon multiplied by n^2 the logits agree to float rounding (1e-5); with the same epsilon they differ
    by about eps (1 - 1/n^2) / (2 var) relative, far below 1e-4 here."""
    plain_settings = {key: value for key, value in settings.items() if "hyper" not in key}
    plain = random_model(tiny_config(**plain_settings))
    model = DeepNMTForConditionalGeneration(tiny_config(**settings)).eval()
    loaded = model.load_state_dict(plain.state_dict(), strict=False)
    assert not loaded.unexpected_keys
    assert loaded.missing_keys and all(".hyper." in key for key in loaded.missing_keys)
    torch.testing.assert_close(logits(model), logits(plain), rtol=0, atol=1e-4)
    for stack in (model.model.encoder, model.model.decoder):
        stack.layer_norm.eps *= stack.history.streams**2
    torch.testing.assert_close(logits(model), logits(plain), rtol=0, atol=1e-5)


# ---- padding, the static cache, compiled decoding, remote code, LoRA ------------------------------------------------


def test_padding_changes_nothing(tiny_config, random_model):
    model = random_model(tiny_config(hyper_connections=3, hyper_connections_dynamic=True))
    with torch.no_grad():
        batch = model(input_ids=SOURCE, attention_mask=SOURCE.ne(1).long(), decoder_input_ids=TARGET).logits
        alone = model(input_ids=SOURCE[1:, :3], decoder_input_ids=TARGET[1:]).logits
    torch.testing.assert_close(batch[1:], alone, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mhc_model(tiny_config, random_model):
    return random_model(tiny_config(**MHC))


def test_static_cache_and_compiled_decoding_decode_as_the_dynamic_cache(mhc_model):
    options = dict(input_ids=SOURCE, attention_mask=SOURCE.ne(1).long(), max_new_tokens=6, min_new_tokens=6)
    with torch.no_grad():
        dynamic = mhc_model.generate(**options, num_beams=3, return_dict_in_generate=True, output_logits=True)
        static = mhc_model.generate(
            **options, num_beams=3, return_dict_in_generate=True, output_logits=True, cache_implementation="static"
        )
        assert torch.equal(static.sequences, dynamic.sequences)
        torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), rtol=1e-5, atol=1e-5)
        eager = mhc_model.generate(**options)
        torch._dynamo.reset()
        mhc_model.forward = torch.compile(mhc_model.forward, backend="eager", fullgraph=True)
        try:
            compiled = mhc_model.generate(**options, cache_implementation="static", disable_compile=True)
        finally:
            del mhc_model.forward
    assert torch.equal(compiled, eager)


def test_every_stream_weight_gets_a_gradient(mhc_model, padded_batch):
    inputs = {key: padded_batch[key] for key in ("input_ids", "attention_mask", "labels")}
    mhc_model.zero_grad()
    mhc_model(**inputs).loss.backward()
    grads = {name: parameter.grad for name, parameter in mhc_model.named_parameters() if ".hyper." in name}
    mhc_model.zero_grad(set_to_none=True)
    # 12 residual blocks (3 encoder layers x 2, 2 decoder layers x 3), each with 8 tensors: static alpha and beta, the
    # LayerNorm's weight and bias, W_alpha, W_beta, s_alpha, s_beta
    assert len(grads) == 12 * 8
    assert all(grad is not None and torch.isfinite(grad).all() and grad.abs().max() > 0 for grad in grads.values())


def test_default_lora_leaves_the_stream_weights_frozen_as_the_dlcl_weights(tiny_config, random_model, padded_batch):
    peft = pytest.importorskip("peft")
    model = random_model(tiny_config(**MHC))
    hyper = {name: parameter.detach().clone() for name, parameter in model.named_parameters() if ".hyper." in name}
    peft_model = peft.get_peft_model(model, peft.LoraConfig(task_type="SEQ_2_SEQ_LM", r=2))
    trainable = [name for name, parameter in peft_model.named_parameters() if parameter.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    peft_model.train()
    inputs = {key: padded_batch[key] for key in ("input_ids", "attention_mask", "labels")}
    peft_model(**inputs).loss.backward()
    for name, parameter in model.named_parameters():
        if ".hyper." in name:
            assert parameter.grad is None and torch.equal(parameter, hyper[name])


# ---- sizes: the count, the weights a config expects -----------------------------------------------------------------


@pytest.mark.parametrize(
    "settings",
    [
        dict(encoder_hyper_connections=3),
        dict(decoder_hyper_connections=2, hyper_connections_dynamic=True, decoder_self_attention="merged_average"),
        dict(hyper_connections=4, hyper_connections_dynamic=True, decoder_self_attention="average", aan_ffn=True),
    ],
    ids=["encoder-only", "decoder-matt-dynamic", "aan-dynamic"],
)
def test_the_parameter_count_is_exact(settings, tiny_config):
    config = tiny_config(**settings)
    model = DeepNMTForConditionalGeneration(config)
    assert count_parameters(config) == sum(parameter.numel() for parameter in model.parameters())


def test_weights_of_another_expansion_or_variant_are_named(mhc_model, tiny_config):
    shapes = {name: tuple(tensor.shape) for name, tensor in mhc_model.state_dict().items()}
    findings = _shape_findings(tiny_config(hyper_connections=3, hyper_connections_dynamic=True), shapes)
    assert any("encoder_hyper_connections=3" in line and "(3, 4)" in line and "(2, 3)" in line for line in findings)
    findings = _shape_findings(tiny_config(hyper_connections=2), shapes)
    assert any("hyper_connections_dynamic=False give no" in line for line in findings)
    findings = _shape_findings(tiny_config(), shapes)
    assert any("decoder_hyper_connections=0 give no" in line for line in findings)
    plain = {
        name: tuple(tensor.shape)
        for name, tensor in DeepNMTForConditionalGeneration(tiny_config()).state_dict().items()
    }
    assert any("but the file has none" in line for line in _shape_findings(tiny_config(**MHC), plain))


# ---- settings -------------------------------------------------------------------------------------------------------


def test_config_json_holds_the_settings_only_when_used(tiny_config):
    assert not {key for key in tiny_config().to_dict() if "hyper" in key}
    written = tiny_config(decoder_hyper_connections=2, hyper_connections_dynamic=True).to_dict()
    assert {key: value for key, value in written.items() if "hyper" in key} == {
        "encoder_hyper_connections": 0,
        "decoder_hyper_connections": 2,
        "hyper_connections_dynamic": True,
    }
    again = DeepNMTConfig.from_dict(written)
    assert (again.encoder_hyper_connections, again.decoder_hyper_connections) == (0, 2)
    both = tiny_config(hyper_connections=3, encoder_hyper_connections=2)
    assert (both.encoder_hyper_connections, both.decoder_hyper_connections) == (2, 3)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(hyper_connections=1), r"`hyper_connections` must be 0 \(off\) or an integer >= 2 .*, got 1\."),
        (dict(decoder_hyper_connections=True), r"`decoder_hyper_connections` must be 0 \(off\) .*, got True\."),
        (dict(hyper_connections=2, hyper_connections_sinkhorn_iterations=-1), r"must be a non-negative .*, got -1\."),
        (dict(hyper_connections_dynamic=True), r"only apply to Hyper-Connections: .* got .*hyper_connections=0"),
        (dict(hyper_connections_sinkhorn_iterations=4), r"only apply to Hyper-Connections"),
        (dict(hyper_connections=2, pre_norm=False), r"needs `pre_norm=True`, got post-norm layers"),
        (dict(hyper_connections=2, pre_norm=False, deepnorm=True), r"needs `pre_norm=True`, got DeepNorm"),
        (dict(hyper_connections=2, decoder_post_norm_layers=1), r"needs `decoder_post_norm_layers=0`, got 1"),
        (
            dict(encoder_hyper_connections=2, encoder_layer_aggregation="dlcl"),
            r"`encoder_hyper_connections=2` needs `encoder_layer_aggregation='residual'`, got 'dlcl'",
        ),
        (
            dict(hyper_connections=2, layer_aggregation="sparse", sparse_block_size=1),
            r"needs `encoder_layer_aggregation='residual'`, got 'sparse'",
        ),
        (
            dict(decoder_hyper_connections=2, msc_block_layers=[2, 1], encoder_layers=None),
            r"needs `msc_block_layers=None`",
        ),
    ],
    ids=[
        "one-stream",
        "bool",
        "negative-iterations",
        "dynamic-alone",
        "iterations-alone",
        "post-norm",
        "deepnorm",
        "mix-ln",
        "dlcl",
        "sparse",
        "msc",
    ],
)
def test_bad_settings_are_refused_by_name(settings, message, tiny_config):
    with pytest.raises(ValueError, match=message):
        tiny_config(**settings)


def test_dlcl_on_the_other_stack_is_allowed(tiny_config, random_model):
    model = random_model(tiny_config(encoder_hyper_connections=2, decoder_layer_aggregation="dlcl"))
    assert torch.isfinite(logits(model)).all()


def test_ctranslate2_and_growing_refuse_them_by_name(mhc_model):
    blockers = ctranslate2_blockers(mhc_model.config)
    assert any(line.startswith("`hyper_connections=2` (Hyper-Connections:") for line in blockers)
    with pytest.raises(ValueError, match=r"`encoder_hyper_connections=2` \(Hyper-Connections: "):
        grow_encoder(mhc_model, 1)


def test_layer_diagnostics_read_the_sum_of_the_streams(tiny_config, random_model, padded_batch):
    """`layer_outputs` (SDT's similarities) reads each layer's streams summed: at initialisation, with the residual
    model's weights, n times the residual model's layer outputs."""
    plain = random_model(tiny_config())
    model = DeepNMTForConditionalGeneration(tiny_config(hyper_connections=3)).eval()
    model.load_state_dict(plain.state_dict(), strict=False)
    batch = {key: padded_batch[key] for key in ("input_ids", "attention_mask", "labels")}
    for side in ("encoder", "decoder"):
        ours, theirs = layer_outputs(model, batch, side), layer_outputs(plain, batch, side)
        torch.testing.assert_close(ours[0], theirs[0])
        torch.testing.assert_close(torch.stack(ours[1:]), 3 * torch.stack(theirs[1:]), rtol=1e-5, atol=1e-5)
