"""Merged attention (MAtt) and the gated AAN: hand computations of the sublayers, the running-sum cache layer, the
parameter counts of the DS-Init paper's MAtt rows, and config validation. (DS-Init itself: test_ds_init.py.)

Cached == full decoding, padding, save/load, beam search and remote code for these settings are covered by the
shared `ARCHITECTURES` parametrisation in conftest.py.
"""

import math

import pytest
import torch
from torch.nn import functional as F
from transformers import DynamicCache, EncoderDecoderCache

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.modeling.modeling_deep_nmt import (
    DeepNMTAverageAttention,
    DeepNMTDynamicCacheLayer,
    DeepNMTMergedAttention,
    causal_average,
)

# ---- MAtt and AAN against hand computations -------------------------------------------------------------------------


def tiny(decoder: str, **overrides) -> DeepNMTConfig:
    settings = dict(
        vocab_size=37,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=20,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_self_attention=decoder,
    )
    settings.update(overrides)
    return DeepNMTConfig(**settings)


def perturbed(module: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    return module.eval()


def hand_cross_context(attention, states, memory, memory_mask, heads):
    """Concatenated heads of softmax(q k^T / sqrt(d_h)) v, written out."""
    batch, length, width = states.shape
    head_dim = width // heads
    q = (states @ attention.q_proj.weight.T + attention.q_proj.bias).view(batch, length, heads, head_dim)
    k = (memory @ attention.k_proj.weight.T + attention.k_proj.bias).view(batch, -1, heads, head_dim)
    v = (memory @ attention.v_proj.weight.T + attention.v_proj.bias).view(batch, -1, heads, head_dim)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~memory_mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(batch, length, width)


def test_merged_attention_is_shared_projections_of_context_plus_causal_mean():
    config = tiny("merged_average")
    attention = perturbed(DeepNMTMergedAttention(config, num_heads=2, layer_idx=0))
    states, memory = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    memory_mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    additive = torch.zeros(2, 1, 1, 4).masked_fill(~memory_mask[:, None, None, :], torch.finfo(torch.float32).min)
    with torch.no_grad():
        actual = attention(states, key_value_states=memory, attention_mask=additive)
        values = states @ attention.v_proj.weight.T + attention.v_proj.bias  # the cross-attention's own W_v, b_v
        mean = torch.stack([values[:, : t + 1].mean(dim=1) for t in range(5)], dim=1)  # current token included
        context = hand_cross_context(attention, states, memory, memory_mask, heads=2)
        expected = (context + mean) @ attention.out_proj.weight.T + attention.out_proj.bias
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aan_ffn", [False, True])
def test_gated_average_attention_matches_its_equations(aan_ffn):
    config = tiny("average", aan_ffn=aan_ffn)
    attention = perturbed(DeepNMTAverageAttention(config, layer_idx=0))
    states = torch.randn(2, 6, 16)
    with torch.no_grad():
        actual = attention(states)
        average = torch.stack([states[:, : t + 1].mean(dim=1) for t in range(6)], dim=1)
        if aan_ffn:
            average = F.relu(average @ attention.fc1.weight.T + attention.fc1.bias) @ attention.fc2.weight.T
            average = average + attention.fc2.bias
        gates = torch.sigmoid(torch.cat([states, average], -1) @ attention.gate.weight.T + attention.gate.bias)
        expected = gates[..., :16] * states + gates[..., 16:] * average
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_merged_attention_decoder_layer_has_two_sublayers_in_the_right_order(pre_norm):
    model = perturbed(DeepNMTForConditionalGeneration(tiny("merged_average", pre_norm=pre_norm)))
    layer = model.model.decoder.layers[0]
    assert layer.self_attn is None and layer.self_attn_layer_norm is None
    assert isinstance(layer.encoder_attn, DeepNMTMergedAttention)
    states, memory = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    with torch.no_grad():
        actual = layer(states, memory)

        def sublayer(x, norm, function):
            return x + function(norm(x)) if pre_norm else norm(x + function(x))

        hidden = sublayer(states, layer.encoder_attn_layer_norm, lambda x: layer.encoder_attn(x, memory))
        expected = sublayer(hidden, layer.final_layer_norm, lambda x: layer.fc2(F.relu(layer.fc1(x))))
    torch.testing.assert_close(actual, expected)


# ---- the running-sum cache layer ------------------------------------------------------------------------------------


def test_running_average_in_chunks_equals_a_cumulative_mean_of_everything():
    layer = DeepNMTDynamicCacheLayer()
    states = torch.randn(3, 7, 5)
    pieces = [
        layer.update_average(states[:, :1]),
        layer.update_average(states[:, 1:4]),
        layer.update_average(states[:, 4:]),
    ]
    expected = torch.cumsum(states, 1) / torch.arange(1, 8)[None, :, None]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected)
    assert layer.get_seq_length() == 7 and layer.running_sum.shape == (3, 1, 5)
    assert layer.keys is None  # no per-token storage: the state stays (batch, 1, d) however long the output


def test_running_sum_follows_beam_reordering_selection_and_expansion():
    layer = DeepNMTDynamicCacheLayer()
    rows = torch.arange(4.0)[:, None, None].expand(4, 2, 3)
    layer.update_average(rows)  # running sum of row i is 2 * i
    layer.reorder_cache(torch.tensor([3, 3, 0, 1]))
    assert layer.running_sum[:, 0, 0].tolist() == [6.0, 6.0, 0.0, 2.0]
    layer.batch_select_indices(torch.tensor([2, 3]))
    assert layer.running_sum[:, 0, 0].tolist() == [0.0, 2.0]
    layer.batch_repeat_interleave(2)
    assert layer.running_sum[:, 0, 0].tolist() == [0.0, 0.0, 2.0, 2.0]
    assert layer.get_seq_length() == 2
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        layer.crop(-1)
    layer.reset()
    assert layer.running_sum is None and layer.get_seq_length() == 0


def test_cache_layer_also_stores_cross_attention_keys_and_values():
    layer = DeepNMTDynamicCacheLayer()
    keys, values = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    layer.update(keys, values)
    assert layer.get_seq_length() == 5
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(layer.keys, keys[[2, 0, 1]]) and torch.equal(layer.values, values[[2, 0, 1]])


@pytest.mark.parametrize("decoder", ["merged_average", "average", "multi_head"])
def test_cache_built_from_the_config_has_one_state_layer_per_decoder_layer(decoder):
    config = tiny(decoder, encoder_layers=3, decoder_layers=2)
    assert config.decoder_layer_types == ["deep_nmt", "deep_nmt"]
    cache = DynamicCache(config=config)
    assert len(cache.layers) == 2 and all(isinstance(layer, DeepNMTDynamicCacheLayer) for layer in cache.layers)


def test_a_cache_built_without_the_config_gets_state_layers_and_decodes_the_same():
    model = perturbed(DeepNMTForConditionalGeneration(tiny("merged_average")))
    source, start = torch.tensor([[5, 6, 2]]), torch.tensor([[0]])
    plain = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        first = model(input_ids=source, decoder_input_ids=start, past_key_values=plain).logits
        second = model(input_ids=source, decoder_input_ids=start, use_cache=True).logits
    assert torch.equal(first, second)
    assert all(isinstance(layer, DeepNMTDynamicCacheLayer) for layer in plain.self_attention_cache.layers)
    assert plain.self_attention_cache.layers[0].running_sum.shape == (1, 1, 16)


def test_a_filled_cache_of_another_kind_is_refused_with_how_to_build_one():
    model = perturbed(DeepNMTForConditionalGeneration(tiny("merged_average")))
    foreign = DynamicCache()
    for index in range(model.config.decoder_layers):
        foreign.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), index)
    cache = EncoderDecoderCache(foreign, DynamicCache())
    with pytest.raises(TypeError, match=r"Cache layer 0 is a DynamicLayer .*DynamicCache\(config=model.config\)"):
        model(input_ids=torch.tensor([[5, 6, 2]]), decoder_input_ids=torch.tensor([[0]]), past_key_values=cache)


@pytest.mark.parametrize("decoder", ["merged_average", "average"])
def test_sampling_with_several_returned_sequences_expands_the_running_sums(decoder):
    model = perturbed(DeepNMTForConditionalGeneration(tiny(decoder)))
    source = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
    with torch.no_grad():
        torch.manual_seed(0)
        cached = model.generate(
            source,
            attention_mask=source.ne(1),
            do_sample=True,
            num_return_sequences=3,
            max_new_tokens=6,
            return_dict_in_generate=True,
        )
        torch.manual_seed(0)
        uncached = model.generate(
            source,
            attention_mask=source.ne(1),
            do_sample=True,
            num_return_sequences=3,
            max_new_tokens=6,
            use_cache=False,
        )
    assert cached.sequences.shape[0] == 6 and torch.equal(cached.sequences, uncached)
    running_sums = [layer.running_sum for layer in cached.past_key_values.self_attention_cache.layers]
    assert all(state.shape == (6, 1, 16) for state in running_sums)


# ---- parameter counts (DS-Init paper, Table 3) ----------------------------------------------------------------------


def parameters(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def base(layers: int, decoder: str, source_vocab: int, target_vocab: int) -> DeepNMTForConditionalGeneration:
    config = DeepNMTConfig(
        vocab_size=source_vocab,
        decoder_vocab_size=target_vocab,
        share_embeddings=False,
        tie_word_embeddings=True,
        pre_norm=False,
        encoder_layers=layers,
        decoder_layers=layers,
        decoder_self_attention=decoder,
    )
    return DeepNMTForConditionalGeneration(config)


@pytest.mark.parametrize(("layers", "paper_baseline", "paper_matt"), [(6, 72.3, 66.0), (12, 116.4, 103.8)])
def test_matt_removes_one_attention_block_per_decoder_layer_as_in_the_paper(layers, paper_baseline, paper_matt):
    d = 512
    # Table 3 uses separate source and target vocabularies whose sizes are not given; 27,480 each reproduces the
    # 6-layer baseline's 72.3M, and the same vocabularies must then give every other figure of the table.
    multi_head, matt = base(layers, "multi_head", 27480, 27480), base(layers, "merged_average", 27480, 27480)
    removed = parameters(multi_head) - parameters(matt)
    # One attention block (W_q, W_k, W_v, W_o with biases) and the LayerNorm of the removed sublayer, per layer.
    # The paper's deltas (6.3M, 12.6M) are n * (4d^2 + 4d) at its 0.1M rounding; the LayerNorms add n * 2d.
    assert removed == layers * (4 * d * d + 4 * d) + layers * 2 * d
    assert round(parameters(multi_head) / 1e6, 1) == paper_baseline
    assert round(parameters(matt) / 1e6, 1) == paper_matt


# ---- configuration --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"decoder_self_attention": "aan"}, r"`decoder_self_attention` must be one of .*got 'aan'"),
        ({"aan_ffn": True}, r"`aan_ffn=True` needs `decoder_self_attention='average'`.*got 'multi_head'"),
        ({"decoder_self_attention": "average", "aan_ffn": 1}, r"`aan_ffn` must be True or False, got 1"),
    ],
)
def test_invalid_decoder_settings_name_field_and_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        DeepNMTConfig(**overrides)


def test_decoder_layer_types_are_derived_and_survive_a_round_trip():
    assert DeepNMTConfig(decoder_layers=2).decoder_layer_types == ["deep_nmt"] * 2
    config = DeepNMTConfig(decoder_layers=3, decoder_self_attention="average")
    assert config.decoder_layer_types == ["deep_nmt"] * 3
    reloaded = DeepNMTConfig.from_dict({**config.to_dict(), "decoder_layers": 4})
    assert reloaded.decoder_layer_types == ["deep_nmt"] * 4
    old = DeepNMTConfig.from_dict({**config.to_dict(), "decoder_layer_types": ["deep_nmt_average"] * 3})
    assert old.decoder_layer_types == ["deep_nmt"] * 3  # folders saved by 0.1.0 name the old layer types


def test_running_average_accumulates_in_float32_for_half_precision_models():
    states = torch.full((1, 600, 4), 1.01, dtype=torch.bfloat16)  # bf16 counts and sums are inexact past 256
    layer = DeepNMTDynamicCacheLayer()
    stepwise = torch.cat([layer.update_average(states[:, t : t + 1]) for t in range(600)], dim=1)
    assert stepwise.dtype == torch.bfloat16 and layer.running_sum.dtype == torch.float32
    expected = states[0, 0, 0].float().item()
    assert stepwise.float().sub(expected).abs().max().item() < 1e-2
    assert torch.equal(causal_average(states), stepwise)  # the training route agrees
