"""Initialisation: Glorot bounds of the reference packing (Q/K/V stored as one packed matrix), the same whether the
classes come from the installed package or from remote code, and never applied over loaded weights."""

import json
import math
import os
import sys
import textwrap

import pytest
import torch

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration, DlclConfig, DlclForConditionalGeneration

D_MODEL, FFN = 64, 96


def small_config(**overrides):
    settings = dict(
        vocab_size=300,
        d_model=D_MODEL,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
    )
    settings.update(overrides)
    return DlclConfig(**settings)


def expected_bounds() -> dict[str, float]:
    # Q/K/V as one d x 3d matrix: sqrt(6 / (d + 3d)); W_o: sqrt(6 / 2d); FFN: sqrt(6 / (d + d_ff)).
    return {
        "q_proj": math.sqrt(6 / (4 * D_MODEL)),
        "k_proj": math.sqrt(6 / (4 * D_MODEL)),
        "v_proj": math.sqrt(6 / (4 * D_MODEL)),
        "out_proj": math.sqrt(6 / (2 * D_MODEL)),
        "fc1": math.sqrt(6 / (D_MODEL + FFN)),
        "fc2": math.sqrt(6 / (D_MODEL + FFN)),
    }


def observed_bounds(named_parameters) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {}
    for name, parameter in named_parameters:
        parts = name.split(".")
        if parts[-1] == "weight" and parts[-2] in expected_bounds() and ".layers." in name:
            found.setdefault(parts[-2], []).append(parameter.abs().max().item())
    return found


def test_matrices_use_the_glorot_bound_of_packed_projections():
    torch.manual_seed(0)
    model = DlclForConditionalGeneration(small_config())
    found = observed_bounds(model.named_parameters())
    for kind, bound in expected_bounds().items():
        # a uniform draw of thousands of values reaches within 2% of its bound and never beyond it
        assert all(0.98 * bound <= value <= bound for value in found[kind]), (kind, bound, found[kind])
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and "layer_norm" not in n]
    assert all(torch.count_nonzero(bias) == 0 for bias in biases)


def test_embeddings_are_normal_with_std_inverse_sqrt_d_and_a_zero_padding_row():
    torch.manual_seed(0)
    model = DlclForConditionalGeneration(small_config())
    weight = model.model.shared.weight
    assert torch.count_nonzero(weight[model.config.pad_token_id]) == 0
    assert weight.std().item() == pytest.approx(D_MODEL**-0.5, rel=0.05)


def test_untied_output_layer_is_initialised_like_the_embeddings():
    torch.manual_seed(0)
    model = DlclForConditionalGeneration(small_config(tie_word_embeddings=False))
    assert model.lm_head.weight is not model.model.shared.weight
    assert model.lm_head.weight.std().item() == pytest.approx(D_MODEL**-0.5, rel=0.05)


def test_from_pretrained_does_not_reinitialise_loaded_weights(tmp_path):
    torch.manual_seed(0)
    model = DlclForConditionalGeneration(small_config())
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(3.0).add_(0.5)  # far outside anything the initialiser produces
    model.save_pretrained(tmp_path)
    loaded = DlclForConditionalGeneration.from_pretrained(tmp_path)
    for (name, expected), (_, actual) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(expected, actual), name


def test_remote_code_initialises_a_fresh_model_with_the_same_bounds(tmp_path, clean_python):
    """transformers skips `_init_weights` on remote-code modules that own no parameters: the bounds must hold
    there too."""
    DlclForConditionalGeneration(small_config()).save_pretrained(tmp_path)  # config with auto_map + code files
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["hf_deep_nmt"] = None
        import torch
        from transformers import AutoConfig, AutoModelForSeq2SeqLM
        config = AutoConfig.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)
        torch.manual_seed(0)
        model = AutoModelForSeq2SeqLM.from_config(config, trust_remote_code=True)
        assert "hf_deep_nmt" not in type(model).__module__, type(model).__module__
        rows = [[name, parameter.abs().max().item()] for name, parameter in model.named_parameters()]
        history = model.model.encoder.history.weight.tolist()
        print(json.dumps({{"rows": rows, "history": history}}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    # forked from the session's clean server: the script's process has no hf_deep_nmt, as a user's would not
    result = clean_python.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    output = json.loads(result.stdout.strip().splitlines()[-1])
    found = observed_bounds((name, torch.tensor(value)) for name, value in output["rows"])
    for kind, bound in expected_bounds().items():
        assert all(0.98 * bound <= value <= bound for value in found[kind]), (kind, bound, found[kind])
    expected_history = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(torch.tensor(output["history"]), expected_history)


def test_plain_config_model_has_no_history_weights():
    model = DeepNMTForConditionalGeneration(
        DeepNMTConfig(
            vocab_size=50,
            d_model=16,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=8,
            decoder_ffn_dim=8,
            encoder_layers=2,
            decoder_layers=1,
        )
    )
    assert not [name for name, _ in model.named_parameters() if "history" in name]


def test_a_model_class_refuses_the_config_of_another_preset():
    with pytest.raises(ValueError, match=r"DeepNMTForConditionalGeneration takes a DeepNMTConfig .*got a DlclConfig"):
        DeepNMTForConditionalGeneration(small_config())
