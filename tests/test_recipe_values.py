"""Recipe values that transformers or our dataclasses would take and then train nonsense with (a negative warm-up
start, `max_steps: 0`, `save_total_limit: 0`, fp16 on a CPU, ...), and recipe files that name a key twice: each is
refused when the arguments are parsed, before any data is read, naming the value and what is valid."""

import json
import math

import pytest
import torch

from hf_deep_nmt.training.arguments import ARGUMENT_CLASSES, StageArguments, parse_arguments
from hf_deep_nmt.training.pipeline import run as train_run


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
    monkeypatch.setattr("hf_deep_nmt.training.arguments._fp16_device_available", lambda: False)
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


# ---- values that used to train silently or fail only after work (issue 40, class 7) --------------------------------


def check(tmp_path, **values):
    """Parse a recipe of `BASE` and `values` and run every check of the run plan; the output folder is never made."""
    from hf_deep_nmt.training.pipeline import check_before_work

    path = recipe(tmp_path, json.dumps({**BASE, "output_dir": str(tmp_path / "run"), **values}))
    try:
        return check_before_work(*parse_arguments([str(path)]))
    finally:
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "values, message",
    [
        ({"output_dir": ""}, "`output_dir` must be a folder name, not empty, got ''"),
        ({"export_dir": " "}, "`export_dir` is an empty string; name a path, or leave `export_dir` out"),
        ({"train_file": ""}, "`train_file` is an empty string; name a path, or leave `train_file` out"),
        ({"model_name_or_path": ""}, "`model_name_or_path` is an empty string; name a path"),
        ({"source_lang": ""}, "`source_lang` must be a language code such as 'es' or 'en' (no spaces or path"),
        ({"target_lang": "en/x"}, "`target_lang` must be a language code such as 'es' or 'en' (no spaces or path"),
        ({"source_lang": "en"}, "`source_lang` and `target_lang` are both 'en': the two sides of a pair need two"),
        ({"translate_examples": -3}, "`translate_examples` must be >= 0 (0: show none), got -3"),
        ({"num_train_epochs": 1e308}, "`num_train_epochs` must be at most 1,000,000 (or set `max_steps` to count"),
        ({"max_steps": 2**40}, "`max_steps` must be at most 2,147,483,647, got 1099511627776"),
        (
            {"tokenizer_vocab_size": 10**8},
            "`tokenizer_vocab_size` must be between 16 and 1,000,000 (the sizes a joint",
        ),
        ({"tokenizer_vocab_size": 8}, "`tokenizer_vocab_size` must be between 16 and 1,000,000"),
        ({"tokenizer_model": "wordpiece"}, "`tokenizer_model` must be one of ('bpe', 'unigram'), got 'wordpiece'"),
        ({"seed": -1}, "`seed` must be an integer from 0 to 4,294,967,295, got -1"),
        ({"data_seed": 2**40}, "`data_seed` must be an integer from 0 to 4,294,967,295, got 1099511627776"),
        (
            {"dataloader_num_workers": -1},
            "`dataloader_num_workers` must be >= 0 (0: load in the main process), got -1",
        ),
    ],
    ids=lambda item: json.dumps(item)[:40] if isinstance(item, dict) else None,
)
def test_an_empty_path_a_bad_language_code_or_an_out_of_range_count_is_refused_naming_it(tmp_path, values, message):
    with pytest.raises(ValueError) as error:
        check(tmp_path, **values)
    assert message in str(error.value)


def test_the_largest_accepted_values_still_plan(tmp_path):
    plan = check(tmp_path, num_train_epochs=1e6, translate_examples=0, tokenizer_vocab_size=10**6)
    assert plan.training_args.num_train_epochs == 1e6 and plan.model_args.tokenizer_vocab_size == 10**6


def test_a_missing_saved_model_is_named_not_the_tokenizer_settings_beside_it(tmp_path):
    absent = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as error:
        check(tmp_path, model_type=None, model_name_or_path=str(absent), tokenizer_vocab_size=300)
    assert f"`model_name_or_path` '{absent}' does not exist" in str(error.value)
    assert "check the path" in str(error.value)
    assert "tokenizer" not in str(error.value)


def test_a_recipe_with_a_utf8_byte_order_mark_is_read_and_a_utf16_one_is_named(tmp_path):
    path = tmp_path / "recipe.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({**BASE, "max_steps": 7}).encode())
    assert parse_arguments([str(path)])[3].max_steps == 7
    path.write_bytes(json.dumps(BASE).encode("utf-16"))
    with pytest.raises(ValueError, match=rf"{path}: the recipe is UTF-16 text .* save it as UTF-8 \(e\.g\. `iconv"):
        parse_arguments([str(path)])
    path.write_bytes(b'{"model_type": "deep_nmt", "output_dir": "caf\xe9"}')
    with pytest.raises(ValueError, match=rf"{path}: not UTF-8 text \(byte 0xe9 at byte 45, line 1\)"):
        parse_arguments([str(path)])
