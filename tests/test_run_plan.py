"""One plan per run: `plan_run` resolves a recipe into a `RunPlan` (hand-checked here for a small recipe), and a whole
`train` / `train-staged` run, from a preset or from a saved model, runs each check exactly once (counted with spies
on every module that binds the check)."""

import collections
import dataclasses
import importlib
import json
import sys
from pathlib import Path

import pytest

from hf_deep_nmt.data.corpus import sample_corpus_dir
from hf_deep_nmt.serving.options import MAX_EVALUATION_OUTPUT_TOKENS, DecodingOptions
from hf_deep_nmt.training import pipeline as training
from hf_deep_nmt.training import plan as plan_module
from hf_deep_nmt.training import staged  # noqa: F401  (imported so that their bindings of the checks are spied on)
from hf_deep_nmt.training.arguments import ARGUMENT_CLASSES, StageArguments, parse_arguments
from hf_deep_nmt.training.plan import RunPlan, plan_run

TINY_OVERRIDES = {
    "d_model": 16,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 32,
    "decoder_ffn_dim": 32,
}


def corpus(tmp_path: Path) -> tuple[Path, Path]:
    """A training `.tsv` and a validation prefix with `.es` / `.en` beside it, from the sample corpus."""
    folder = tmp_path / "corpus"
    folder.mkdir(parents=True)
    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:60]
    (folder / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    pairs = [line.split("\t") for line in lines[:3]]
    (folder / "valid.es").write_text("".join(source + "\n" for source, _ in pairs), encoding="utf-8")
    (folder / "valid.en").write_text("".join(target + "\n" for _, target in pairs), encoding="utf-8")
    return folder / "train.tsv", folder / "valid"


def recipe(tmp_path: Path, **values) -> Path:
    train, valid = corpus(tmp_path)
    settings = {
        "model_type": "deep_nmt_dlcl",
        "model_overrides": TINY_OVERRIDES,
        "tokenizer_vocab_size": 300,
        "train_file": str(train),
        "validation_file": str(valid),
        "source_lang": "es",
        "target_lang": "en",
        "max_source_length": 64,
        "max_target_length": 80,
        "num_beams": 3,
        "length_penalty": 0.6,
        "max_length_a": 1.2,
        "max_length_b": 5,
        "eval_max_tokens": 700,
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 5,
        "output_dir": str(tmp_path / "run"),
        "export_dir": str(tmp_path / "export"),
        "use_cpu": True,
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
        **values,
    }
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(settings))
    return path


def test_the_plan_holds_the_recipe_resolved(tmp_path):
    path = recipe(tmp_path)
    arguments = parse_arguments([str(path)])
    plan = plan_run(*arguments)
    folder = tmp_path / "corpus"
    assert plan.command == "train" and plan.arguments == tuple(arguments) and plan.stages is None
    # the corpus files each path resolves to: the .tsv itself, the prefix's two language files
    assert plan.corpus == {
        str(folder / "train.tsv"): (folder / "train.tsv",),
        str(folder / "valid"): (folder / "valid.es", folder / "valid.en"),
    }
    assert plan.inputs == (str(folder / "train.tsv"), str(folder / "valid"))
    assert plan.protected == {
        f"the training output_dir ({str(tmp_path / 'run')!r}), which holds the checkpoints": (
            tmp_path / "run"
        ).resolve(),
        f"the folder of the corpus file {str(folder / 'train.tsv')!r}": folder.resolve(),
        f"the folder of the corpus file {str(folder / 'valid')!r}": folder.resolve(),
    }
    assert plan.writes == (tmp_path / "run", tmp_path / "export")
    # the final evaluation decodes every line, in batches of per_device_eval_batch_size / eval_max_tokens
    assert plan.decoding == DecodingOptions(
        batch_size=5,
        num_beams=3,
        length_penalty=0.6,
        max_length_a=1.2,
        max_length_b=5,
        max_tokens=700,
        max_source_tokens=None,
        max_output_tokens=MAX_EVALUATION_OUTPUT_TOKENS,
    )
    # the output cap at the longest source: int(1.2 * 64 + 5) = 81 tokens, plus the start token and </s>
    assert plan.generation == {"num_beams": 3, "length_penalty": 0.6, "max_length": 83, "max_new_tokens": None}
    # no max_tokens: a step holds per_device_train_batch_size sentences of the longer length limit, 8 * 80
    assert plan.device == "cpu" and plan.batch_tokens == 640
    assert plan.saved_config is None
    assert plan.sizes.d_model == 16 and plan.sizes.encoder_layers == 1
    assert plan.sizes.vocab_size == 300  # the tokenizer's size stands in for the preset's larger vocabulary
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.device = "cuda"


def test_a_recipe_with_max_tokens_and_no_export_plans_that_budget_and_writes_only_its_output(tmp_path):
    path = recipe(tmp_path, max_tokens=512, export_dir=None, max_eval_samples=2)
    plan = plan_run(*parse_arguments([str(path)]))
    assert plan.batch_tokens == 512
    assert plan.writes == (tmp_path / "run",)
    assert len(plan.protected) == 3


def test_prepare_plans_no_folders(tmp_path):
    path = recipe(tmp_path, output_dir=str(tmp_path / "never-made"))
    model_args, data_args, export_args, training_args, _ = parse_arguments(
        [str(path)], (*ARGUMENT_CLASSES, StageArguments)
    )
    plan = plan_run(model_args, data_args, export_args, training_args, command="prepare")
    assert plan.protected == {} and plan.writes == () and plan.sizes is None
    assert len(plan.corpus) == 2
    assert not (tmp_path / "never-made").exists()


# The checks of a run and the functions that build what the plan holds; each must run once per run.
CHECKS = [
    ("hf_deep_nmt.training.recipes", "read_recipe"),
    ("hf_deep_nmt.training.arguments", "check_recipe_values"),
    ("hf_deep_nmt.training.arguments", "check_explicit_run"),
    ("hf_deep_nmt.training.arguments", "check_model_arguments"),
    ("hf_deep_nmt.training.arguments", "check_config_overrides"),
    ("hf_deep_nmt.training.arguments", "check_arguments"),
    ("hf_deep_nmt.training.arguments", "evaluation_options"),
    ("hf_deep_nmt.training.plan", "plan_run"),
    ("hf_deep_nmt.training.plan", "check_staged"),
    ("hf_deep_nmt.training.plan", "check_saved_model"),
    ("hf_deep_nmt.training.plan", "check_recipe_agrees_with_saved_model"),
    ("hf_deep_nmt.training.plan", "check_checkpoints_to_average"),
    ("hf_deep_nmt.training.plan", "check_repo_id"),
    ("hf_deep_nmt.training.plan", "_sizes_of_preset"),
    ("hf_deep_nmt.training.plan", "recipe_inputs"),
    ("hf_deep_nmt.data.corpus", "parallel_files"),
    ("hf_deep_nmt.data.corpus", "check_corpus_file"),
    ("hf_deep_nmt.folders", "check_run_folders"),
    ("hf_deep_nmt.memory", "check_training_size"),
    ("hf_deep_nmt.model_folders", "check_saved_model_folder"),
    ("hf_deep_nmt.model_folders", "check_saved_json_files"),
    ("hf_deep_nmt.model_folders", "check_local_path"),
]


def spy_on_checks(monkeypatch) -> dict[str, list[tuple]]:
    """Wrap each of `CHECKS` wherever a module of the package binds it (`from ... import` copies the name), and
    `DecodingOptions.generation_settings`; returns the calls' positional arguments by name."""
    calls: dict[str, list[tuple]] = collections.defaultdict(list)

    def wrapped(name, original):
        def spy(*args, **kwargs):
            calls[name].append(args)
            return original(*args, **kwargs)

        return spy

    modules = [module for name, module in list(sys.modules.items()) if name.startswith("hf_deep_nmt") and module]
    for module_name, name in CHECKS:
        original = getattr(importlib.import_module(module_name), name)
        spy = wrapped(name, original)
        for module in modules:
            for attribute, value in list(vars(module).items()):
                if value is original:
                    monkeypatch.setattr(module, attribute, spy)
    original = DecodingOptions.generation_settings
    monkeypatch.setattr(DecodingOptions, "generation_settings", wrapped("generation_settings", original))
    return calls


def assert_each_once(calls: dict[str, list[tuple]], expected: set[str]) -> None:
    """Each of `expected` called once, no other spied check called, `parallel_files` once per corpus path and
    `check_corpus_file` once per file (when the plan checks them, not again when they are read)."""
    uncounted = ("parallel_files", "check_corpus_file", "check_saved_json_files")
    counts = {name: len(made) for name, made in calls.items() if name not in uncounted}
    assert counts == dict.fromkeys(expected, 1)
    corpus_files = calls["plan_run"][0][1].corpus_files()
    assert len(corpus_files) == 2
    assert sorted(str(args[0]) for args in calls["parallel_files"]) == sorted(corpus_files)
    data_args = calls["plan_run"][0][1]
    train, prefix = corpus_files  # the .tsv, and the prefix of valid.es / valid.en
    files = [train, f"{prefix}.{data_args.source_lang}", f"{prefix}.{data_args.target_lang}"]
    assert sorted(str(args[0]) for args in calls["check_corpus_file"]) == sorted(files)  # checked once, not when read
    folders = [str(args[0]) for args in calls["check_saved_json_files"]]  # a saved model's, the checkpoints averaged
    assert len(folders) == len(set(folders)), folders


TRAIN_CHECKS = {
    "read_recipe",
    "check_recipe_values",
    "check_explicit_run",
    "check_model_arguments",
    "check_arguments",
    "evaluation_options",
    "plan_run",
    "check_checkpoints_to_average",
    "check_repo_id",
    "recipe_inputs",
    "check_run_folders",
    "check_training_size",
    "generation_settings",
}


def test_train_runs_each_check_once_from_a_preset_and_from_a_saved_model(tmp_path, monkeypatch):
    calls = spy_on_checks(monkeypatch)
    steps = {"max_steps": 2, "save_steps": 1, "average_checkpoints": 2, "repo_id": "me/tiny-dlcl"}
    summary = training.run([str(recipe(tmp_path / "preset", **steps))])
    assert summary["train_steps"] == 2 and summary["averaged_checkpoints"] == ["checkpoint-1", "checkpoint-2"]
    assert_each_once(calls, TRAIN_CHECKS | {"check_config_overrides", "_sizes_of_preset"})

    calls.clear()  # a run that starts from the model the first one exported
    saved = str(tmp_path / "preset" / "export")
    path = recipe(tmp_path / "saved", model_name_or_path=saved, **steps)
    values = json.loads(path.read_text())
    for key in ("model_type", "model_overrides", "tokenizer_vocab_size"):
        del values[key]
    path.write_text(json.dumps(values))
    summary = training.run([str(path)])
    assert summary["train_steps"] == 2
    saved_checks = {"check_saved_model", "check_saved_model_folder", "check_recipe_agrees_with_saved_model"}
    assert_each_once(calls, TRAIN_CHECKS | saved_checks)
    assert [str(args[0]) for args in calls["check_saved_json_files"]].count(saved) == 1  # its JSON files, once
    assert "check_local_path" not in calls  # `check_saved_model_folder` checked that path


def test_a_streamed_train_run_reads_the_corpus_files_the_plan_checked(tmp_path, monkeypatch):
    calls = spy_on_checks(monkeypatch)
    path = recipe(tmp_path, streaming=True, max_steps=2, max_tokens=400, stream_buffer_pairs=16, save_strategy="no")
    summary = training.run([str(path)])
    assert summary["train_steps"] == 2
    assert_each_once(calls, TRAIN_CHECKS - {"check_repo_id"} | {"check_config_overrides", "_sizes_of_preset"})


def test_train_staged_runs_each_check_once(tmp_path, monkeypatch):
    calls = spy_on_checks(monkeypatch)
    path = recipe(tmp_path, stage_depths=[1, 2], stage_max_steps=2, schedule_warmup_steps=2, save_steps=1)
    summary = staged.run_staged([str(path)])
    assert [stage["encoder_layers"] for stage in summary["stages"]] == [1, 2]
    expected = TRAIN_CHECKS - {"check_repo_id"} | {"check_staged", "check_config_overrides", "_sizes_of_preset"}
    assert_each_once(calls, expected)
    stages, command = calls["plan_run"][0][4:]
    assert command == "train-staged" and stages.stage_depths == [1, 2]


def test_the_plan_module_reads_nothing_of_the_later_steps():
    """The walk goes down: the plan imports none of the rooms that prepare, train, evaluate or export."""
    source = Path(plan_module.__file__).read_text()
    for later in ("training", "staged", "prepared_data", "streaming", "trainer", "translate", "hub", "evaluation"):
        assert f"hf_deep_nmt.{later} import" not in source and f"hf_deep_nmt import {later}" not in source
    assert RunPlan.__dataclass_params__.frozen


def test_a_step_given_the_recipes_arguments_instead_of_a_plan_checks_them_into_one(monkeypatch):
    """No step has an unchecked way in: the Python API's `build_config(model_args)` / `configure_generation(model,
    tokenizer, data_args, export_args)` build the plan first, by the checks `train` runs (none of a run folder's), and
    refuse what `train` refuses with its message; a step given its plan checks nothing again."""
    from hf_deep_nmt.training.arguments import DataArguments, EvalExportArguments, ModelArguments

    calls = spy_on_checks(monkeypatch)
    config = training.build_config(ModelArguments(model_type="deep_nmt", model_overrides=TINY_OVERRIDES))
    assert config.d_model == 16 and config.vocab_size == 8000
    assert len(calls["plan_run"]) == len(calls["check_model_arguments"]) == len(calls["check_arguments"]) == 1
    assert not {"check_run_folders", "check_training_size", "check_checkpoints_to_average"} & set(calls)
    with pytest.raises(ValueError, match=r"`model_type` must be one of .*got 'dlcl'"):
        training.build_config(ModelArguments(model_type="dlcl"))
    model = training.MODEL_CLASSES[type(config)](config)

    class Tokenizer:  # what `check_tokenizer_matches` reads
        pad_token_id, bos_token_id, eos_token_id = 1, 0, 2

        def __len__(self):
            return 8000

    recipe = EvalExportArguments(num_beams=2, max_length_a=1.0, max_length_b=3)
    training.configure_generation(model, Tokenizer(), DataArguments(max_source_length=8), recipe)
    assert (model.generation_config.num_beams, model.generation_config.max_length) == (2, 13)
    with pytest.raises(ValueError, match=r"`num_beams` must be >= 1, got 0"):
        training.configure_generation(model, Tokenizer(), EvalExportArguments(num_beams=0))
    with pytest.raises(TypeError, match=r"takes the run's `RunPlan`.*got str"):
        training.build_model("deep_nmt", Tokenizer())

    plan = plan_module.as_plan(ModelArguments(model_type="deep_nmt", model_overrides=TINY_OVERRIDES))
    calls.clear()
    assert plan_module.as_plan(plan) is plan and training.build_config(plan).d_model == 16
    assert not calls  # given its plan, the step checks nothing again
