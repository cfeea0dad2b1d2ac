"""Recipe values that transformers or our dataclasses would take and then train nonsense with (a negative warm-up
start, `max_steps: 0`, `save_total_limit: 0`, fp16 on a CPU, ...), and recipe files that name a key twice: each is
refused when the arguments are parsed, before any data is read, naming the value and what is valid."""

import json
import math

import pytest
import torch

from hf_deep_nmt.arguments import ARGUMENT_CLASSES, StageArguments, parse_arguments
from hf_deep_nmt.training import run as train_run


def recipe(tmp_path, text: str, suffix: str = ".json"):
    path = tmp_path / f"recipe{suffix}"
    path.write_text(text, encoding="utf-8")
    return path


BASE = {"model_type": "deep_nmt_dlcl", "output_dir": "OUT", "use_cpu": True}


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("warmup_init_lr", -1.0, "`warmup_init_lr` must be a finite number >= 0, got -1.0"),
        ("learning_rate", 0.0, "`learning_rate` must be a finite number > 0, got 0.0"),
        ("weight_decay", -1.0, "`weight_decay` must be a finite number >= 0, got -1.0"),
        ("adam_epsilon", -1e-8, "`adam_epsilon` must be a finite number >= 0, got -1e-08"),
        ("adam_beta2", 1.0, "`adam_beta2` must be in [0, 1), got 1.0"),
        ("label_smoothing_factor", 1.5, "`label_smoothing_factor` must be in [0, 1), got 1.5"),
        ("max_grad_norm", -1.0, "`max_grad_norm` must be >= 0 (0: no clipping), got -1.0"),
        ("max_steps", 0, "`max_steps` must be >= 1, or -1 to train `num_train_epochs`, got 0"),
        ("max_steps", -5, "`max_steps` must be >= 1, or -1 to train `num_train_epochs`, got -5"),
        ("num_train_epochs", 0.0, "`num_train_epochs` must be a finite number > 0, got 0.0"),
        ("eval_steps", 0, "`eval_steps` must be > 0"),
        ("save_steps", -10, "`save_steps` must be > 0"),
        ("save_total_limit", 0, "`save_total_limit` must be >= 1, or unset to keep every checkpoint, got 0"),
    ],
)
def test_a_nonsense_training_value_is_refused_naming_it(tmp_path, key, value, message):
    path = recipe(tmp_path, json.dumps({**BASE, key: value}))
    with pytest.raises(ValueError) as error:
        parse_arguments([str(path)])
    assert message in str(error.value)


def test_non_finite_values_from_the_command_line_are_refused(tmp_path):
    path = recipe(tmp_path, json.dumps(BASE))
    for flag in ("--warmup_init_lr", "--max_grad_norm", "--learning_rate"):
        with pytest.raises(ValueError, match=rf"`{flag[2:]}` must be .*, got nan"):
            parse_arguments([str(path), flag, "nan"])


def test_eval_steps_zero_is_not_silently_replaced_by_logging_steps(tmp_path):
    path = recipe(tmp_path, json.dumps({**BASE, "eval_strategy": "steps", "eval_steps": 0, "logging_steps": 7}))
    with pytest.raises(ValueError, match=r"`eval_steps` must be > 0 .* got 0"):
        parse_arguments([str(path)])


def test_sensible_values_still_parse(tmp_path):
    values = {**BASE, "max_steps": 3, "save_total_limit": 1, "eval_steps": 0.5, "max_grad_norm": 0.0}
    values.update(weight_decay=0.0, warmup_init_lr=0.0, label_smoothing_factor=0.1)
    training_args = parse_arguments([str(recipe(tmp_path, json.dumps(values)))])[3]
    assert (training_args.max_steps, training_args.save_total_limit, training_args.eval_steps) == (3, 1, 0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused only without a GPU")
def test_fp16_without_a_gpu_is_refused_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr("hf_deep_nmt.arguments._fp16_device_available", lambda: False)
    path = recipe(tmp_path, json.dumps({**BASE, "fp16": True, "use_cpu": False}))
    with pytest.raises(ValueError, match=r"`fp16: true` needs a GPU and this machine has no CUDA"):
        parse_arguments([str(path)])
    path = recipe(tmp_path, json.dumps({**BASE, "fp16": True}))
    with pytest.raises(ValueError, match=r"`fp16: true` needs a GPU and `use_cpu` is set"):
        parse_arguments([str(path)])


def test_a_negative_stage_warm_up_start_is_refused():
    with pytest.raises(ValueError, match=r"`schedule_init_lr` must be a finite number >= 0, got -1.0"):
        StageArguments(schedule_init_lr=-1.0)
    with pytest.raises(ValueError, match=r"`schedule_init_lr` must be a finite number >= 0, got nan"):
        StageArguments(schedule_init_lr=math.nan)


def test_a_key_given_twice_in_a_json_recipe_is_refused_naming_it_and_the_file(tmp_path):
    text = '{"model_type": "deep_nmt_dlcl", "output_dir": "OUT", "model_overrides": {"encoder_layers": 2}, '
    text += '"model_overrides": {"decoder_layers": 2}}'
    path = recipe(tmp_path, text)
    with pytest.raises(ValueError, match=rf"{path}: key 'model_overrides' appears more than once"):
        parse_arguments([str(path)], ARGUMENT_CLASSES)


def test_a_key_given_twice_in_a_yaml_recipe_is_refused_at_any_depth(tmp_path):
    path = recipe(tmp_path, "model_type: deep_nmt_dlcl\nmax_steps: 5\noutput_dir: OUT\nmax_steps: 50\n", ".yaml")
    with pytest.raises(ValueError, match=rf"{path}: key 'max_steps' appears more than once \(again at line 4\)"):
        parse_arguments([str(path)])
    nested = "model_type: deep_nmt_dlcl\noutput_dir: OUT\nmodel_overrides:\n"
    nested += "  encoder_layers: 2\n  encoder_layers: 36\n"
    path = recipe(tmp_path, nested, ".yml")
    with pytest.raises(ValueError, match=r"key 'encoder_layers' appears more than once \(again at line 5\)"):
        parse_arguments([str(path)])


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    text = "model_type: deep_nmt_dlcl\noutput_dir: OUT\nuse_cpu: true\n"
    text += "model_overrides:\n  <<: {encoder_layers: 6, decoder_layers: 2}\n  encoder_layers: 2\n"
    model_args = parse_arguments([str(recipe(tmp_path, text, ".yaml"))])[0]
    assert model_args.model_overrides == {"encoder_layers": 2, "decoder_layers": 2}


def test_the_train_command_refuses_a_duplicated_key_before_reading_data(tmp_path):
    text = '{"model_type": "deep_nmt_dlcl", "output_dir": "%s", "train_file": "missing.tsv", "max_steps": 1, '
    text += '"max_steps": 0}'
    path = recipe(tmp_path, text % (tmp_path / "run"))
    with pytest.raises(ValueError, match=r"key 'max_steps' appears more than once"):
        train_run([str(path)])
    assert not (tmp_path / "run").exists()
