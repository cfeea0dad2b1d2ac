"""Relative position keys (Shaw et al. 2018, as SDT uses them): scores against a hand computation, scope, validation.

Cached == full decoding past the clipping distance, padding, save/load and beams run through the shared
`ARCHITECTURES` parametrisation (window 2, shorter than the test sequences)."""

import math

import pytest
import torch

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTAttention


def config(**overrides) -> DeepNMTConfig:
    settings = dict(
        vocab_size=37,
        d_model=8,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=12,
        decoder_ffn_dim=10,
        dropout=0.0,
        attention_dropout=0.0,
        relative_position_window=2,
    )
    settings.update(overrides)
    return DeepNMTConfig(**settings)


def test_attention_scores_add_clipped_relative_keys_to_the_keys():
    torch.manual_seed(0)
    attention = DeepNMTAttention(config(), num_heads=2, is_cross_attention=False, layer_idx=0).eval()
    with torch.no_grad():
        for parameter in attention.parameters():
            parameter.copy_(torch.randn_like(parameter))
        states = torch.randn(1, 5, 8)
        actual = attention(states)
        q = (states @ attention.q_proj.weight.T + attention.q_proj.bias).view(1, 5, 2, 4)
        k = (states @ attention.k_proj.weight.T + attention.k_proj.bias).view(1, 5, 2, 4)
        v = (states @ attention.v_proj.weight.T + attention.v_proj.bias).view(1, 5, 2, 4)
        scores = torch.empty(2, 5, 5)
        for head in range(2):
            for i in range(5):
                for j in range(5):
                    relative = attention.relative_keys[min(max(j - i, -2), 2) + 2]  # a_clip(j-i), shared by heads
                    scores[head, i, j] = q[0, i, head] @ (k[0, j, head] + relative) / math.sqrt(4)
        context = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v[0]).reshape(1, 5, 8)
        expected = context @ attention.out_proj.weight.T + attention.out_proj.bias
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_relative_keys_sit_in_self_attention_only_one_table_per_layer():
    model = DeepNMTForConditionalGeneration(config(relative_position_window=8))
    tables = {name: p.shape for name, p in model.named_parameters() if name.endswith("relative_keys")}
    assert set(tables) == {
        f"model.{stack}.layers.{i}.self_attn.relative_keys" for stack in ("encoder", "decoder") for i in range(2)
    }
    assert set(tables.values()) == {torch.Size([17, 4])}  # 2k+1 vectors of the head width
    assert not any(
        name.endswith("relative_keys")
        for name, _ in DeepNMTForConditionalGeneration(config(relative_position_window=0)).named_parameters()
    )


def test_relative_key_tables_are_glorot_uniform():
    torch.manual_seed(0)
    model = DeepNMTForConditionalGeneration(
        config(
            d_model=64,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=8,
            decoder_ffn_dim=8,
            relative_position_window=8,
        )
    )
    table = model.model.encoder.layers[0].self_attn.relative_keys
    bound = math.sqrt(6 / (17 + 32))
    assert table.abs().max().item() <= bound and table.abs().max().item() > 0.9 * bound


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_invalid_relative_window_names_field_and_value(value):
    with pytest.raises(
        ValueError, match=rf"`relative_position_window` must be a non-negative integer .*got {value!r}"
    ):
        DeepNMTConfig(relative_position_window=value)
