"""DS-Init (Zhang, Titov, Sennrich 2019): each matrix drawn within its depth-scaled bound in both modes, depth counted
per stack, everything else initialised as by default, saved weights reloaded as they are, the same bounds from remote
code; the DsInitConfig preset and the DS-Init settings' validation."""

import json
import math
import os
import sys
import textwrap

import pytest
import torch

from hf_deep_nmt import (
    DeepNMTConfig,
    DeepNMTForConditionalGeneration,
    DsInitConfig,
    DsInitForConditionalGeneration,
)

D, FFN, HEADS = 64, 128, 4


def ds_config(mode: str = "paper", alpha: float = 1.0, decoder: str = "multi_head", **overrides) -> DeepNMTConfig:
    settings = dict(
        vocab_size=50,
        d_model=D,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        init_scheme="ds_init",
        ds_init_alpha=alpha,
        ds_init_mode=mode,
        decoder_self_attention=decoder,
        aan_ffn=decoder == "average",
    )
    settings.update(overrides)
    return DeepNMTConfig(**settings)


def depth_factor(mode: str, alpha: float, depth: int) -> float:
    return alpha / math.sqrt(depth) if mode == "paper" else math.sqrt(alpha) * depth**-0.25


def hand_bounds(name: str, mode: str, alpha: float) -> float | None:
    """Expected DS-Init bound of a parameter from its name: Glorot bound of the reference packing x depth factor."""
    parts = name.split(".")
    if parts[-1] != "weight" or "layers" not in parts:
        return None
    depth = int(parts[parts.index("layers") + 1]) + 1
    module = parts[-2]
    if module in ("q_proj", "k_proj", "v_proj"):
        cross = "encoder_attn" in parts
        fan = 2 * D if cross else 4 * D  # DS-Init reference: packed self-attention Q/K/V, separate cross maps
    elif module == "out_proj":
        fan = 2 * D
    elif module in ("fc1", "fc2"):
        fan = D + FFN
    elif module == "gate":
        fan = 4 * D
    else:
        return None
    return math.sqrt(6 / fan) * depth_factor(mode, alpha, depth)


@pytest.mark.parametrize("decoder", ["multi_head", "merged_average", "average"])
@pytest.mark.parametrize(("mode", "alpha"), [("paper", 1.0), ("code", 1.0), ("paper", 0.5), ("code", 0.5)])
def test_ds_init_draws_each_matrix_within_its_depth_scaled_bound(mode, alpha, decoder):
    torch.manual_seed(0)
    model = DeepNMTForConditionalGeneration(ds_config(mode, alpha, decoder))
    checked = 0
    for name, parameter in model.named_parameters():
        bound = hand_bounds(name, mode, alpha)
        if bound is None:
            continue
        checked += 1
        assert parameter.abs().max().item() <= bound, name
        # uniform on [-b, b] has std b / sqrt(3)
        assert parameter.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.03), name
    expected = 3 * (4 + 2) + 3 * {"multi_head": 4 + 4 + 2, "merged_average": 4 + 2, "average": 1 + 2 + 4 + 2}[decoder]
    assert checked == expected


def test_ds_init_counts_depth_separately_per_stack():
    torch.manual_seed(0)
    model = DeepNMTForConditionalGeneration(ds_config(encoder_layers=4, decoder_layers=1))
    encoder_top = model.model.encoder.layers[3].fc1.weight
    decoder_bottom = model.model.decoder.layers[0].fc1.weight
    glorot = math.sqrt(6 / (D + FFN))
    assert encoder_top.abs().max().item() == pytest.approx(glorot / 2, rel=0.02)  # l = 4
    assert decoder_bottom.abs().max().item() == pytest.approx(glorot, rel=0.02)  # l = 1 again


def test_ds_init_leaves_embeddings_biases_and_layer_norms_as_the_default_scheme():
    torch.manual_seed(0)
    scaled = DeepNMTForConditionalGeneration(ds_config())
    torch.manual_seed(0)
    default = DeepNMTForConditionalGeneration(
        ds_config(init_scheme="default", ds_init_alpha=1.0, ds_init_mode="paper")
    )
    untouched = [name for name, _ in scaled.named_parameters() if hand_bounds(name, "paper", 1.0) is None]
    assert any("embed" in name or "shared" in name for name in untouched)
    for name in untouched:
        expected, actual = dict(default.named_parameters())[name], dict(scaled.named_parameters())[name]
        if "bias" in name or "layer_norm" in name:
            assert torch.equal(expected, actual), name
        else:  # embeddings: same distribution, N(0, 1/d)
            assert actual.std().item() == pytest.approx(D**-0.5, rel=0.05), name


def test_saved_ds_init_model_reloads_exactly_the_saved_weights(tmp_path):
    torch.manual_seed(0)
    model = DeepNMTForConditionalGeneration(ds_config(decoder="merged_average"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(2.0).add_(0.25)
    model.save_pretrained(tmp_path)
    loaded = DeepNMTForConditionalGeneration.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_remote_code_draws_the_same_ds_init_bounds(tmp_path, clean_python):
    DsInitForConditionalGeneration(
        DsInitConfig(
            vocab_size=50,
            d_model=D,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS,
            encoder_ffn_dim=FFN,
            decoder_ffn_dim=FFN,
        )
    ).save_pretrained(tmp_path)
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["hf_deep_nmt"] = None
        import torch
        from transformers import AutoConfig, AutoModelForSeq2SeqLM
        config = AutoConfig.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)
        torch.manual_seed(0)
        model = AutoModelForSeq2SeqLM.from_config(config, trust_remote_code=True)
        assert "hf_deep_nmt" not in type(model).__module__
        print(json.dumps({{name: p.abs().max().item() for name, p in model.named_parameters()}}))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    # forked from the session's clean server: the script's process has no hf_deep_nmt, as a user's would not
    result = clean_python.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    maxima = json.loads(result.stdout.strip().splitlines()[-1])
    checked = 0
    for name, value in maxima.items():
        bound = hand_bounds(name, "paper", 1.0)
        if bound is not None:
            checked += 1
            assert 0.95 * bound <= value <= bound, (name, value, bound)
    assert checked == 2 * 6 + 2 * 6  # encoder: 4 attention + 2 FFN; MAtt decoder: 4 attention + 2 FFN


# ---- the preset and the settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"init_scheme": "fixup"}, r"`init_scheme` must be one of \('default', 'ds_init'\), got 'fixup'"),
        ({"init_scheme": "ds_init", "ds_init_mode": "zero"}, r"`ds_init_mode` must be one of .*got 'zero'"),
        ({"init_scheme": "ds_init", "ds_init_alpha": 0}, r"`ds_init_alpha` must be a number in \(0, 1\], got 0"),
        ({"init_scheme": "ds_init", "ds_init_alpha": 1.5}, r"`ds_init_alpha` .* got 1.5"),
        ({"init_scheme": "ds_init", "ds_init_alpha": -1}, r"`ds_init_alpha` .* got -1"),
        ({"init_scheme": "ds_init", "ds_init_alpha": True}, r"`ds_init_alpha` .* got True"),
        ({"init_scheme": "ds_init", "ds_init_alpha": "1"}, r"`ds_init_alpha` .* got '1'"),
        ({"ds_init_alpha": 0.5}, r"`ds_init_alpha=0.5`.* only apply with `init_scheme='ds_init'`"),
        ({"ds_init_mode": "code"}, r"`ds_init_mode='code'` only apply with `init_scheme='ds_init'`"),
    ],
)
def test_invalid_ds_init_settings_name_field_and_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        DeepNMTConfig(**overrides)


def test_ds_init_config_defaults_are_the_paper_system():
    config = DsInitConfig()
    assert config.model_type == "deep_nmt_dsinit"
    assert (config.encoder_layers, config.decoder_layers, config.d_model, config.encoder_ffn_dim) == (
        12,
        12,
        512,
        2048,
    )
    assert (config.encoder_attention_heads, config.pre_norm, config.init_scheme) == (8, False, "ds_init")
    assert (config.ds_init_alpha, config.ds_init_mode, config.decoder_self_attention) == (
        1.0,
        "paper",
        "merged_average",
    )
    assert (config.share_embeddings, config.tie_word_embeddings) == (False, True)
    assert (config.dropout, config.attention_dropout, config.activation_dropout) == (0.1, 0.1, 0.1)
