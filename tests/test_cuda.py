"""Checks that need a CUDA device (marked `cuda`, skipped without one, so CI stays on the CPU). Run them on a GPU
machine with `python -m pytest tests -m cuda`; `hf-deep-nmt doctor` runs the same functions and a training."""

import pytest
import torch

from hf_deep_nmt.tools import doctor

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FAMILIES = sorted(doctor.FAMILIES)


@pytest.fixture(autouse=True)
def _cuda_settings():
    # fp32 exactness on CUDA: no TF32 matmuls
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_equals_uncached_in_fp32(family):
    doctor.check_cached_equals_uncached(family, "cuda")


@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_is_the_same_with_and_without_the_cache(family):
    doctor.check_beam_cache(family, "cuda")


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_forward_and_backward_are_finite_at_padded_lengths_64_128_192(family):
    doctor.check_bf16_padded_lengths(family, "cuda")


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_attention_gives_the_math_path_gradients_within_bf16_tolerance(family):
    doctor.check_fused_matches_math(family, "cuda")


def test_masked_attention_never_takes_the_cudnn_backend():
    rows = doctor.attention_backends("cuda")
    masked = [row for row in rows if "(masked)" in row[0]]
    assert masked, rows
    for path, taken, _ in masked:
        assert taken in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"), (path, taken)


def test_a_seq2seq_trainer_bf16_run_with_attention_dropout_does_not_stop():
    doctor.check_trainer_bf16("cuda")
