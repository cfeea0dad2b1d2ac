"""Every paper recipe parses (with the same code as `hf-deep-nmt train`) and builds its model at the paper's size on
the meta device (no memory, no training); the parameter counts are printed. The accelerate configs load."""

from pathlib import Path

import pytest
import torch

from hf_deep_nmt import MODEL_CLASSES
from hf_deep_nmt.training.arguments import ARGUMENT_CLASSES, PRESETS, StageArguments, parse_arguments
from hf_deep_nmt.training.pipeline import build_config

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ROOT / "recipes" / "configs" / "papers"

# recipe -> (model_type, encoder layers, decoder layers, d_model, FFN, heads, pre-norm, expected paper setting)
EXPECTED = {
    "dlcl_prenorm_30l_wmt16_ende": ("deep_nmt_dlcl", 30, 6, 512, 2048, 8, True, {"layer_aggregation": "dlcl"}),
    "dlcl_postnorm_25l_wmt16_ende": ("deep_nmt_dlcl", 25, 6, 512, 2048, 8, False, {"layer_aggregation": "dlcl"}),
    "dsinit_matt_12l_wmt14_ende": (
        "deep_nmt_dsinit", 12, 12, 512, 2048, 8, False,
        {"init_scheme": "ds_init", "decoder_self_attention": "merged_average"},
    ),
    "dsinit_matt_20l_wmt14_ende": (
        "deep_nmt_dsinit", 20, 20, 512, 2048, 8, False,
        {"init_scheme": "ds_init", "decoder_self_attention": "merged_average"},
    ),
    "sdt_rpr_48l_staged_wmt14_ende": (
        "deep_nmt_sdt", 48, 6, 512, 2048, 8, True,
        {"encoder_layer_aggregation": "sparse", "relative_position_window": 8, "sparse_block_size": 6},
    ),
    "msc_6x6_base_wmt14_ende": ("deep_nmt_msc", 36, 6, 512, 2048, 8, True, {"msc_block_layers": 6}),
    "msc_6x8_base_wmt14_ende": ("deep_nmt_msc", 48, 6, 512, 2048, 8, True, {"msc_block_layers": 8}),
    "msc_6x6_iwslt14_ende": ("deep_nmt_msc", 36, 6, 256, 512, 4, True, {"msc_block_layers": 6}),
    "msc_6x12_iwslt14_ende": (
        "deep_nmt_msc", 72, 6, 256, 512, 4, True, {"msc_block_layers": 12, "encoder_l2_lambda": 1e-5},
    ),
    "deepnorm_100l_wmt17_ende": ("deep_nmt_deepnorm", 100, 100, 512, 2048, 8, False, {"deepnorm": True}),
}  # fmt: skip


def test_every_paper_recipe_is_listed():
    assert sorted(path.stem for path in PAPERS.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_paper_recipe_parses_and_builds_at_paper_size(name, tmp_path, capsys):
    model_type, encoder, decoder, width, ffn, heads, pre_norm, settings = EXPECTED[name]
    staged = "staged" in name
    classes = (*ARGUMENT_CLASSES, StageArguments) if staged else ARGUMENT_CLASSES
    parsed = parse_arguments([str(PAPERS / f"{name}.yaml"), "--output_dir", str(tmp_path)], classes)
    model_args, data_args, export_args, training_args = parsed[:4]
    assert model_args.model_type == model_type and model_type in PRESETS
    if staged:
        stages = parsed[4]
        assert stages.stage_depths == list(range(6, 49, 6)) and stages.schedule_warmup_steps == 8000
        model_args.model_overrides = {**model_args.model_overrides, "encoder_layers": stages.stage_depths[-1]}
    config = build_config(model_args)
    assert (config.encoder_layers, config.decoder_layers, config.d_model) == (encoder, decoder, width)
    assert (config.encoder_ffn_dim, config.encoder_attention_heads, config.pre_norm) == (ffn, heads, pre_norm)
    assert {key: getattr(config, key) for key in settings} == settings
    assert config.vocab_size == model_args.tokenizer_vocab_size
    # the training setup of the paper family
    assert training_args.label_smoothing_factor == 0.1 and training_args.max_tokens >= 1024
    schedule = "noam" if model_type in ("deep_nmt_dsinit", "deep_nmt_msc") else "inverse_sqrt"
    assert training_args.lr_schedule == schedule or staged  # staged training always restarts the inverse-sqrt one
    assert export_args.tokenized_bleu and export_args.num_beams in (4, 5)
    # train-staged averages the last stage's checkpoints, as train averages its run's
    assert export_args.average_checkpoints == 5 == training_args.save_total_limit
    with torch.device("meta"):
        model = MODEL_CLASSES[type(config)](config)
    count = model.num_parameters()
    with capsys.disabled():
        print(f"\n{name}: {count / 1e6:.1f}M parameters ({encoder}+{decoder} layers, d {width})")
    assert count > 0


def test_dlcl_30l_size_matches_the_paper():
    # 137M with the paper's shared ~33K vocabulary (DLCL paper: 30 x 3.15M + 6 x 4.20M + 33K x 512)
    model_args = parse_arguments(
        [str(PAPERS / "dlcl_prenorm_30l_wmt16_ende.yaml"), "--tokenizer_vocab_size", "33000"]
    )[0]
    with torch.device("meta"):
        model = MODEL_CLASSES[type(config := build_config(model_args))](config)
    assert 136.0e6 < model.num_parameters() < 137.5e6


@pytest.mark.parametrize("name", ["single_gpu", "multi_gpu", "multi_node"])
def test_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "recipes" / "accelerate" / f"{name}.yaml"))
    expected = {"single_gpu": ("NO", 1, 1), "multi_gpu": ("MULTI_GPU", 8, 1), "multi_node": ("MULTI_GPU", 16, 2)}
    assert (config.distributed_type.value, config.num_processes, config.num_machines) == expected[name]


RECIPES = sorted([*PAPERS.glob("*.yaml"), *(ROOT / "recipes" / "configs").glob("*.json")])


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_recipes_that_tell_ddp_no_parameter_is_unused_are_right(path, tmp_path):
    """`ddp_find_unused_parameters: false` saves DDP a graph walk per step but hangs or errors when a parameter gets no
    gradient: every recipe says it, and one training step of its architecture (narrowed to d 16, every layer and
    switch kept) gives every parameter a gradient."""
    staged = "staged" in path.stem
    classes = (*ARGUMENT_CLASSES, StageArguments) if staged else ARGUMENT_CLASSES
    parsed = parse_arguments([str(path), "--output_dir", str(tmp_path)], classes)
    model_args, training_args = parsed[0], parsed[3]
    assert training_args.ddp_find_unused_parameters is False
    depths = parsed[4].stage_depths[:1] + parsed[4].stage_depths[-1:] if staged else [None]
    for depth in depths:
        narrow = dict(d_model=16, encoder_ffn_dim=24, decoder_ffn_dim=24, encoder_attention_heads=2)
        narrow.update(decoder_attention_heads=2, **({"encoder_layers": depth} if depth else {}))
        model_args.model_overrides = {**model_args.model_overrides, **narrow}
        model_args.tokenizer_vocab_size = 40
        config = build_config(model_args)
        model = MODEL_CLASSES[type(config)](config).train()
        source = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, 1, 1]])
        labels = torch.tensor([[11, 12, 2], [13, 2, -100]])
        model(input_ids=source, attention_mask=source.ne(1).long(), labels=labels).loss.backward()
        missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f"{path.name} (encoder depth {config.encoder_layers}): no gradient for {missing[:5]}"


@pytest.mark.parametrize(
    ("name", "config_class", "settings"),
    [
        ("denseformer_sample", "DenseFormerConfig", {"dlcl_init": "identity", "dlcl_history_norm": False}),
        ("mixln_sample", "MixLnConfig", {"encoder_post_norm_layers": 2, "decoder_post_norm_layers": 1}),
        ("attnres_sample", "AttnResConfig", {"encoder_layer_aggregation": "attnres"}),
        ("hyper_connections_sample", "HyperConnectionsConfig", {"encoder_hyper_connections": 2}),
    ],
)
def test_preset_sample_recipes_build_their_preset(name, config_class, settings, tmp_path):
    """The small recipes of the presets without a translation paper (DenseFormer, Mix-LN) parse as `train` reads them
    and build the preset's class with its settings."""
    model_args = parse_arguments([str(ROOT / "recipes" / "configs" / f"{name}.json"), "--output_dir", str(tmp_path)])[
        0
    ]
    config = build_config(model_args)
    assert type(config).__name__ == config_class and (config.encoder_layers, config.d_model) == (8, 128)
    assert {key: getattr(config, key) for key in settings} == settings
