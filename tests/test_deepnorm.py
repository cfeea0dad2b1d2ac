"""DeepNorm (Wang et al. 2022, DeepNet): the constants against a hand computation, the residual of one layer
recomputed by hand from its parts, the initialisation of every weight matrix, and what the setting combines with or
refuses. The families in tests/conftest.py (`DeepNormConfig`, with DLCL + MAtt, with the AAN + relative keys) run it
through cached == uncached decoding, padding invariance and save -> load; doctor's "deepnorm" family through remote
code, the static cache and compiled decoding."""

import math

import pytest
import torch
from torch.nn import functional as F

from hf_deep_nmt import MODEL_CLASSES, DeepNMTConfig, DeepNormConfig, DeepNormForConditionalGeneration
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTLinear
from hf_deep_nmt.serving.ctranslate2 import ctranslate2_blockers
from hf_deep_nmt.training.growing import grow_encoder

# (N, M) -> encoder (alpha, beta), decoder (alpha, beta), worked out by hand from the paper's formulas:
#   N^4 M = 7776 (6, 6), 1889568 (18, 18), 10^10 (100, 100); encoder alpha = 0.81 (N^4 M)^(1/16),
#   beta = 0.87 (N^4 M)^(-1/16); decoder alpha = (3M)^(1/4) = 18^(1/4), 54^(1/4), 300^(1/4),
#   beta = (12M)^(-1/4) = 72^(-1/4), 216^(-1/4), 1200^(-1/4).
HAND_CONSTANTS = {
    (6, 6): ((1.41794, 0.49699), (2.05977, 0.34329)),
    (18, 18): ((1.99875, 0.35257), (2.71081, 0.26085)),
    (100, 100): ((3.41574, 0.20631), (4.16179, 0.16990)),
}


@pytest.mark.parametrize(("layers", "expected"), HAND_CONSTANTS.items(), ids=lambda value: str(value))
def test_the_constants_match_a_hand_computation(layers, expected):
    config = DeepNormConfig(encoder_layers=layers[0], decoder_layers=layers[1])
    for side, (alpha, beta) in zip(("encoder", "decoder"), expected):
        assert config.deepnorm_constants(side) == pytest.approx((alpha, beta), abs=1e-5), side


def test_the_preset_is_the_papers_deepest_wmt17_system():
    config = DeepNormConfig()
    assert (config.encoder_layers, config.decoder_layers, config.d_model, config.encoder_ffn_dim) == (
        100,
        100,
        512,
        2048,
    )
    assert config.deepnorm and not config.pre_norm and config.init_scheme == "default"
    assert DeepNMTConfig().deepnorm_constants("encoder") == (1.0, 1.0)  # off: plain residuals
    assert "deepnorm" not in DeepNMTConfig().to_dict()  # written only when set, as the earlier versions' configs
    assert DeepNormConfig.from_dict(config.to_dict()).deepnorm is True


def tiny_deepnorm(**overrides) -> DeepNormForConditionalGeneration:
    sizes = dict(vocab_size=37, d_model=16, encoder_layers=3, decoder_layers=2, encoder_attention_heads=4)
    sizes.update(decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=20, dropout=0.0)
    config = DeepNormConfig(**{**sizes, **overrides})
    model = MODEL_CLASSES[type(config)](config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # LayerNorms and biases away from 1/0, so a skipped LayerNorm or bias shows
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


def layer_norm(norm, x):
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def attention_by_hand(attention, query_states, key_states, heads):
    batch, length, width = query_states.shape
    head = width // heads

    def split(x):
        return x.view(batch, -1, heads, head).transpose(1, 2)

    q = split(F.linear(query_states, attention.q_proj.weight, attention.q_proj.bias))
    k = split(F.linear(key_states, attention.k_proj.weight, attention.k_proj.bias))
    v = split(F.linear(key_states, attention.v_proj.weight, attention.v_proj.bias))
    scores = q @ k.transpose(-1, -2) / math.sqrt(head)
    context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, width)
    return F.linear(context, attention.out_proj.weight, attention.out_proj.bias)


def feed_forward_by_hand(layer, x):
    return F.linear(F.relu(F.linear(x, layer.fc1.weight, layer.fc1.bias)), layer.fc2.weight, layer.fc2.bias)


def test_an_encoder_layer_computes_ln_of_alpha_x_plus_the_sublayer():
    model = tiny_deepnorm()
    alpha, _ = model.config.deepnorm_constants("encoder")
    assert alpha == pytest.approx(0.81 * (3**4 * 2) ** (1 / 16))
    layer = model.model.encoder.layers[1]
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))
    h = layer_norm(layer.self_attn_layer_norm, alpha * x + attention_by_hand(layer.self_attn, x, x, 4))
    expected = layer_norm(layer.final_layer_norm, alpha * h + feed_forward_by_hand(layer, h))
    with torch.no_grad():
        assert torch.allclose(layer(x), expected, atol=1e-5)


def test_a_decoder_layer_scales_all_three_skips_by_the_decoder_alpha():
    model = tiny_deepnorm()
    alpha, _ = model.config.deepnorm_constants("decoder")
    assert alpha == pytest.approx((3 * 2) ** 0.25)
    layer = model.model.decoder.layers[0]
    generator = torch.Generator().manual_seed(4)
    y, memory = torch.randn(2, 4, 16, generator=generator), torch.randn(2, 5, 16, generator=generator)
    causal = torch.full((4, 4), float("-inf")).triu(1)
    heads, head = 2, 8

    def split(t):
        return t.view(2, -1, heads, head).transpose(1, 2)

    attention = layer.self_attn
    q, k, v = (split(F.linear(y, p.weight, p.bias)) for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    context = ((q @ k.transpose(-1, -2) / math.sqrt(head) + causal).softmax(-1) @ v).transpose(1, 2).reshape(2, 4, 16)
    h1 = layer_norm(
        layer.self_attn_layer_norm, alpha * y + F.linear(context, attention.out_proj.weight, attention.out_proj.bias)
    )
    h2 = layer_norm(
        layer.encoder_attn_layer_norm, alpha * h1 + attention_by_hand(layer.encoder_attn, h1, memory, heads)
    )
    expected = layer_norm(layer.final_layer_norm, alpha * h2 + feed_forward_by_hand(layer, h2))
    with torch.no_grad():
        got = layer(y, memory, self_attention_mask=causal[None, None].expand(2, 1, 4, 4))
    assert torch.allclose(got, expected, atol=1e-5)


def test_deepnorm_changes_the_function_of_the_same_weights():
    model = tiny_deepnorm()
    settings = {key: value for key, value in model.config.to_dict().items() if key not in ("model_type", "deepnorm")}
    plain = MODEL_CLASSES[DeepNMTConfig](DeepNMTConfig(**settings))
    assert not plain.config.deepnorm and not plain.config.pre_norm
    plain.load_state_dict(model.state_dict())
    batch = dict(input_ids=torch.tensor([[5, 6, 7, 2]]), decoder_input_ids=torch.tensor([[0, 8, 9]]))
    with torch.no_grad():
        assert not torch.allclose(model(**batch).logits, plain.eval()(**batch).logits, atol=1e-3)


def test_every_weight_matrix_is_drawn_as_the_paper_says():
    """Xavier-normal over each matrix's own fans: gain 1 for query and key maps, beta (of the matrix's stack) for the
    value and output maps and the FFN; nothing else in the layers has a weight matrix. Checked on the drawn values:
    mean 0, standard deviation within 4 %, and normal rather than uniform (kurtosis near 3, uniform's is 1.8)."""
    torch.manual_seed(0)
    config = DeepNormConfig(
        vocab_size=64, d_model=256, encoder_layers=4, decoder_layers=3, encoder_ffn_dim=512, decoder_ffn_dim=512
    )
    model = DeepNormForConditionalGeneration(config)
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, DeepNMTLinear):
            assert not (isinstance(module, torch.nn.Linear) and ".layers." in name), name
            continue
        side = "encoder" if ".encoder." in name else "decoder"
        beta = config.deepnorm_constants(side)[1]
        gain = 1.0 if name.endswith(("q_proj", "k_proj")) else beta
        assert name.endswith(("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")), name
        weight = module.weight.detach().double()
        fan_in, fan_out = weight.shape[1], weight.shape[0]
        std = gain * math.sqrt(2.0 / (fan_in + fan_out))
        assert abs(weight.mean().item()) < 0.05 * std, name
        assert weight.std().item() == pytest.approx(std, rel=0.04), name
        kurtosis = (((weight - weight.mean()) / weight.std()) ** 4).mean().item()
        assert 2.7 < kurtosis < 3.3, (name, kurtosis)
        assert torch.count_nonzero(module.bias) == 0, name
        checked += 1
    layers = config.encoder_layers * 6 + config.decoder_layers * 10  # self-attn 4 + FFN 2; + cross-attn 4
    assert checked == layers


def test_the_embeddings_and_layer_norms_keep_the_default_initialisation():
    torch.manual_seed(0)
    model = DeepNormForConditionalGeneration(
        DeepNormConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2)
    )
    embedding = model.model.shared.weight.detach()
    assert embedding[2:].std().item() == pytest.approx(64**-0.5, rel=0.05)
    norm = model.model.encoder.layers[0].final_layer_norm
    assert torch.equal(norm.weight, torch.ones(64)) and torch.equal(norm.bias, torch.zeros(64))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(pre_norm=True), "`deepnorm=True` needs `pre_norm=False`, got `pre_norm=True`"),
        (dict(init_scheme="ds_init"), "`deepnorm=True` needs `init_scheme='default'`, got 'ds_init'"),
        (dict(msc_block_layers=[1, 1], encoder_layers=None), "`deepnorm=True` needs `msc_block_layers=None`"),
        (dict(deepnorm="yes"), "`deepnorm` must be True or False, got 'yes'"),
    ],
    ids=["pre-norm", "ds-init", "msc", "not-a-bool"],
)
def test_what_deepnorm_does_not_combine_with_is_refused_by_name(overrides, message):
    settings = dict(decoder_layers=2, **overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        DeepNormConfig(**settings)


def test_the_exporter_and_growing_take_deepnorm():
    # both fold alpha into the output maps (tests/test_ctranslate2.py, tests/test_growing.py check the function)
    assert ctranslate2_blockers(tiny_deepnorm().config) == []
    assert grow_encoder(tiny_deepnorm(), 1).config.encoder_layers == 4
