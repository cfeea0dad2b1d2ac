"""Attention masks against hand-written patterns, on the device and in the dtype of the hidden states."""

import torch

from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTDecoder, padding_mask_to_additive

NEG = torch.finfo(torch.float32).min


def allowed(mask: torch.Tensor) -> torch.Tensor:
    return mask == 0


def test_causal_mask_continues_after_cached_positions():
    like = torch.zeros(1, 3, 8)
    mask = DeepNMTDecoder._self_attention_mask(None, length=3, past_length=2, like=like)
    # queries at positions 2, 3, 4 over keys 0..4
    expected = torch.tensor(
        [
            [True, True, True, False, False],
            [True, True, True, True, False],
            [True, True, True, True, True],
        ]
    )
    assert mask.shape == (1, 1, 3, 5)
    assert torch.equal(allowed(mask)[0, 0], expected)
    assert mask.min().item() == NEG


def test_one_new_token_without_padding_needs_no_mask():
    assert DeepNMTDecoder._self_attention_mask(None, length=1, past_length=7, like=torch.zeros(2, 1, 8)) is None


def test_target_padding_is_combined_with_causality():
    padding = torch.tensor([[1, 1, 1], [1, 1, 0]])
    mask = DeepNMTDecoder._self_attention_mask(padding, length=3, past_length=0, like=torch.zeros(2, 3, 8))
    assert mask.shape == (2, 1, 3, 3)
    assert torch.equal(allowed(mask)[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(allowed(mask)[1, 0], torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 0]], dtype=torch.bool))


def test_masks_follow_the_device_and_dtype_of_the_hidden_states():
    like = torch.empty(2, 4, 8, device="meta", dtype=torch.bfloat16)
    mask = DeepNMTDecoder._self_attention_mask(None, length=4, past_length=0, like=like)
    assert mask.device.type == "meta" and mask.dtype == torch.bfloat16


def test_source_padding_mask_is_additive_and_kept_even_without_padding():
    assert padding_mask_to_additive(None, torch.float32) is None
    # a given mask is never dropped after looking at its values (traced graphs keep it): all zeros here
    assert torch.equal(
        padding_mask_to_additive(torch.ones(2, 5, dtype=torch.long), torch.float32), torch.zeros(2, 1, 1, 5)
    )
    mask = padding_mask_to_additive(torch.tensor([[1, 1, 0]]), torch.float16)
    assert mask.shape == (1, 1, 1, 3) and mask.dtype == torch.float16
    assert mask[0, 0, 0].tolist() == [0.0, 0.0, torch.finfo(torch.float16).min]
