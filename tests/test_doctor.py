"""`hf-deep-nmt doctor` on the CPU: the tables, what it skips without CUDA, and that its checks fail when the thing
they check is broken (here a simulation of the cuDNN attention bug: NaN gradients at padded lengths of 64 mod 128)."""

import pytest
import torch
import transformers
from torch.nn import functional as F

from hf_deep_nmt.cli import main
from hf_deep_nmt.modeling import kernels_deep_nmt, modeling_deep_nmt
from hf_deep_nmt.tools import doctor


def test_on_the_cpu_it_checks_one_family_and_says_what_it_skipped(capsys):
    assert main(["doctor", "--device", "cpu", "--families", "dlcl-prenorm", "--train-steps", "0"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:3] == ["torch", torch.__version__, "2.13"] for line in out.splitlines())
    assert any(
        line.split() == ["transformers", transformers.__version__, "5.23", "to", "5.24"] for line in out.splitlines()
    )
    for check in ("cached == uncached", "beam with == without cache", "bf16 fwd+bwd at padded 64/128/192"):
        assert f"PASS    dlcl-prenorm: {check}" in out
    assert "SKIP    Seq2SeqTrainer bf16, attention dropout 0.1" in out and "no CUDA device" in out
    assert "4 passed, 0 failed, 2 skipped (no CUDA device" in out
    # every attention path is listed, masked and unmasked
    for path in ("encoder self-attention", "decoder self-attention", "decoder cross-attention"):
        assert f"{path} (masked)" in out
    assert "encoder self-attention (no mask)" in out


def test_a_failing_check_is_a_fail_row_and_exit_code_1(monkeypatch, capsys):
    def broken(family, device):
        raise AssertionError("beam sequences differ: [[0, 5]] vs [[0, 6]]")

    monkeypatch.setattr(doctor, "check_beam_cache", broken)
    assert main(["doctor", "--device", "cpu", "--families", "prenorm", "--train-steps", "0"]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL    prenorm: beam with == without cache" in out and "beam sequences differ: [[0, 5]] vs [[0, 6]]" in out
    )
    assert "3 passed, 1 failed, 2 skipped" in out


def test_cached_decoding_that_ignores_its_state_fails_the_doctor(monkeypatch, capsys):
    """What 0.1.0's code did under transformers 5.24: every step decoded from its last token, silently."""
    monkeypatch.setattr(modeling_deep_nmt, "take_decoding_state", lambda cache, past_key_values: None)
    monkeypatch.setattr(modeling_deep_nmt, "check_step_has_state", lambda *args: None)
    assert main(["doctor", "--device", "cpu", "--families", "postnorm", "--train-steps", "0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL    postnorm: cached == uncached" in out and "FAIL    postnorm: beam with == without cache" in out


def test_a_release_outside_the_tested_window_is_marked(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.30.1")
    rows = {row[0]: row for row in doctor.environment()}
    assert rows["transformers"] == ("transformers", "5.30.1", "5.23 to 5.24 (OUTSIDE: untested here)")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "--device must be cpu or cuda[:N], got 'tpu'"),
        (["--families", "dlcl,nope"], "--families: unknown ['dlcl', 'nope']"),
        (["--train-steps", "-1"], "--train-steps must be >= 0, got -1"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert main(["doctor", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_asking_for_cuda_without_it_is_refused(capsys):
    assert main(["doctor", "--device", "cuda"]) == 2
    assert "CUDA is not available on this machine" in capsys.readouterr().err


@pytest.fixture
def simulated_cudnn_bug(monkeypatch):
    """SDPA whose backward returns NaN when the cuDNN backend is allowed, a mask is passed and the key length is 64
    mod 128 (the upstream bug's conditions); the model's restriction is pointed at the CPU device type."""
    original = F.scaled_dot_product_attention

    def buggy(query, key, value, attn_mask=None, **kwargs):
        output = original(query, key, value, attn_mask=attn_mask, **kwargs)
        bug = torch.backends.cuda.cudnn_sdp_enabled() and attn_mask is not None and key.shape[-2] % 128 == 64
        if bug and output.requires_grad:
            output.register_hook(lambda gradient: gradient * float("nan"))
        return output

    monkeypatch.setattr(F, "scaled_dot_product_attention", buggy)
    monkeypatch.setattr(kernels_deep_nmt, "SDPA_RESTRICTED_DEVICE_TYPES", ("cpu",))


def test_the_padded_length_check_passes_because_of_the_restriction(simulated_cudnn_bug):
    assert "finite" in doctor.check_bf16_padded_lengths("prenorm", "cpu")
    with pytest.raises(AssertionError, match=r"non-finite gradients at padded length 64"):
        doctor.check_bf16_padded_lengths("prenorm", "cpu", sdpa_avoid_cudnn=False)


def test_the_msc_fused_gradient_check_passes_on_a_healthy_cpu():
    """The false alarm of 0.2.0's development: the CPU flash kernel's bf16 gradients of the MSC family were 2.9e-2 from
    fp32 while the (fp32-upcasting) math path's were 8.4e-3; a correct bf16 attention is that far."""
    assert "relative L2 from fp32: fused" in doctor.check_fused_matches_math("msc", "cpu")


@pytest.fixture(params=["dropped mask", "missing scale"])
def wrong_fused_attention(request, monkeypatch):
    """SDPA that is wrong unless it is restricted to the math backend: the padding mask dropped, or the scores not
    scaled by 1/sqrt(head dim). The math-backend reference and tolerance stay correct."""
    original = F.scaled_dot_product_attention

    def wrong(query, key, value, attn_mask=None, **kwargs):
        fused_allowed = torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()
        if fused_allowed and request.param == "dropped mask":
            attn_mask = None
        elif fused_allowed:
            kwargs["scale"] = 1.0
        return original(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", wrong)


@pytest.mark.parametrize("family", ["msc", "dlcl-prenorm"])
def test_a_wrong_fused_attention_still_fails_the_gradient_check(wrong_fused_attention, family):
    with pytest.raises(AssertionError, match=r"bf16 gradients of the fused path are .* more than the tolerance"):
        doctor.check_fused_matches_math(family, "cpu")
