"""One plan per run: every check of `hf-deep-nmt train` / `train-staged` / `prepare` runs once, here, before any work,
and leaves its result in a `RunPlan` that preparation, training, evaluation and export then read.

`plan_run` checks the recipe in the order a user meets its errors: the preset and its overrides
(`check_model_arguments`) or the saved model to start from and the recipe's agreement with it (`check_saved_model`,
which reads its config), the settings (`check_arguments`, which builds the final evaluation's decoding options), the
checkpoints to average, the corpus files, the Hub repository id, the run and export folders, and that the model and a
training step fit the memory (`check_training_size`). It loads no weights and no data, and changes nothing. The
later steps never check again: they take the resolved values (the saved model's config, the corpus files, the
protected folders, the decoding options, the device) from the plan.

Every step takes a plan. A Python caller that hands a step some of a recipe's argument dataclasses instead gets one
built for it (`as_plan`), by the same checks, so that no step has a second, unchecked way in.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from hf_deep_nmt import MODEL_CLASSES
from hf_deep_nmt.data.corpus import parallel_files
from hf_deep_nmt.data.prepared import check_prepared_location
from hf_deep_nmt.folders import check_export_folder, check_run_folders
from hf_deep_nmt.memory import check_training_size
from hf_deep_nmt.model_folders import check_saved_json_files, check_saved_model_folder, check_saved_weights_finite
from hf_deep_nmt.serving.options import DecodingOptions
from hf_deep_nmt.training.arguments import (
    ARGUMENT_CLASSES,
    PRESETS,
    DataArguments,
    DeepNMTTrainingArguments,
    EvalExportArguments,
    ModelArguments,
    check_arguments,
    check_model_arguments,
    check_model_paths,
)

# the commands that write a run folder: their plans check its folders, the export, the averaging and the memory
RUN_COMMANDS = ("train", "train-staged")


@dataclass(frozen=True)
class RunPlan:
    """A checked recipe and what it resolves to. `arguments` are the parsed argument dataclasses, as the Trainer and
    the later steps read them; the other fields are what the checks found or built, so that no step checks again:

    - `saved_config`: the config of the saved model the run starts from (`model_name_or_path`), else None;
    - `sizes`: the config the memory check sized (the saved model's, or the preset's with the overrides), None when
      none could be built (the run's own config then names the problem);
    - `corpus`: each corpus file of the recipe with the files it resolves to (a `.tsv`/`.jsonl` file, or the two
      files `PREFIX.SRC` / `PREFIX.TGT`), checked there and readable;
    - `protected`: the folders an export must never replace (the output folder, the corpus folders);
    - `decoding`: the final evaluation's decoding options; `generation`: the settings the model's generation config
      takes (beam size, length penalty, the output cap at the longest allowed source);
    - `device` and `batch_tokens`: where a training step runs and how many tokens it holds (the memory check's);
    - `inputs`: the local paths the recipe reads, which `overwrite_output_dir` never removes;
    - `writes`: the folders the run writes (the output folder, the export folder where given)."""

    command: str
    model_args: ModelArguments
    data_args: DataArguments
    export_args: EvalExportArguments
    training_args: DeepNMTTrainingArguments
    stages: Any
    saved_config: Any
    sizes: Any
    corpus: dict[str, tuple[Path, ...]]
    protected: dict[str, Path]
    decoding: DecodingOptions
    generation: dict[str, Any]
    device: str
    batch_tokens: int
    inputs: tuple[str, ...]
    writes: tuple[Path, ...]

    @property
    def arguments(self) -> tuple[Any, ...]:
        return (self.model_args, self.data_args, self.export_args, self.training_args)


def plan_run(
    model_args: ModelArguments,
    data_args: DataArguments,
    export_args: EvalExportArguments,
    training_args: DeepNMTTrainingArguments,
    stages: Any = None,
    command: str = "train",
) -> RunPlan:
    """Check the recipe of `command` ("train", "train-staged", "prepare", or "steps" for the steps called one by one
    from Python, see `as_plan`) once, in the order of the module's description, and return its `RunPlan`. Only
    `train` and `train-staged` write a run folder: for the others the folders, export, averaging and memory are not
    checked."""
    if command == "train-staged":
        check_staged(model_args, data_args)
    # The saved model first: a folder that is not there is the problem to name, not the settings beside it.
    saved = check_saved_model(model_args) if model_args.model_name_or_path else None
    check_model_arguments(model_args)
    runs = command in RUN_COMMANDS
    config = saved if saved is not None else (_sizes_of_preset(model_args) if runs else None)
    decoding = check_arguments(data_args, export_args, training_args)
    if runs:
        check_checkpoints_to_average(export_args, training_args)
    corpus_files = data_args.corpus_files()
    corpus = {  # each file there and readable; its text is checked when it is read
        path: tuple(parallel_files(path, data_args.source_lang, data_args.target_lang)) for path in corpus_files
    }
    # a prepared-data folder of its own: a run's, an export's or the current folder is refused before training
    check_prepared_location(data_args, *((training_args.output_dir, export_args.export_dir) if runs else ()))
    generation = DecodingOptions.from_recipe(export_args).generation_settings(data_args.max_source_length)
    lengths = max(data_args.max_source_length, data_args.max_target_length)
    tokens = training_args.max_tokens or training_args.per_device_train_batch_size * lengths
    protected, device, writes = {}, "cpu", ()
    if runs:
        if export_args.repo_id is not None:
            check_repo_id(export_args.repo_id)
        protected = check_run_folders(training_args.output_dir, export_args.export_dir, corpus_files)
        if export_args.export_dir:
            check_export_folder(export_args.export_dir, export_args.overwrite_export, protected=protected)
        from torch.cuda import is_available as cuda_available

        device = "cpu" if training_args.use_cpu or not cuda_available() else "cuda"
        if hasattr(config, "encoder_ffn_dim"):  # the model and a training step must fit the machine
            check_training_size(config, tokens, device)
        writes = tuple(Path(path) for path in (training_args.output_dir, export_args.export_dir) if path)
    return RunPlan(
        command=command,
        model_args=model_args,
        data_args=data_args,
        export_args=export_args,
        training_args=training_args,
        stages=stages,
        saved_config=saved,
        sizes=config,
        corpus=corpus,
        protected=protected,
        decoding=decoding,
        generation=generation,
        device=device,
        batch_tokens=tokens,
        inputs=tuple(recipe_inputs(model_args, data_args)),
        writes=writes,
    )


def as_plan(*given: Any) -> RunPlan:
    """The plan a step runs on: `given` itself when it is a `RunPlan`; else the plan of the recipe made of the argument
    dataclasses given (`ModelArguments`, `DataArguments`, `EvalExportArguments`, `DeepNMTTrainingArguments`, in any
    order; the others take their defaults), checked by `plan_run` as `train` checks its recipe, but for the folders,
    averaging and memory of a run (command "steps": a step called alone writes no run folder). So
    `build_model(model_args, tokenizer)` refuses what `train` refuses, with the same message."""
    if len(given) == 1 and isinstance(given[0], RunPlan):
        return given[0]
    groups: dict[type, Any] = {}
    for value in given:
        kind = next((kind for kind in ARGUMENT_CLASSES if isinstance(value, kind)), None)
        if kind is None or kind in groups:
            raise TypeError(
                f"A step takes the run's `RunPlan` (`plan_run`), or some of the recipe's argument dataclasses "
                f"{tuple(kind.__name__ for kind in ARGUMENT_CLASSES)}, each at most once; got {type(value).__name__}."
            )
        groups[kind] = value
    model_args, data_args, export_args, training_args = (
        groups[kind] if kind in groups else kind() for kind in ARGUMENT_CLASSES
    )
    return plan_run(model_args, data_args, export_args, training_args, command="steps")


def check_staged(model_args: ModelArguments, data_args: DataArguments) -> None:
    """What `train-staged` cannot do: start from a saved model, or stream its corpus."""
    if model_args.model_name_or_path:
        raise ValueError(
            f"`hf-deep-nmt train-staged` trains its first stage from a fresh `model_type` preset; it cannot start "
            f"from the saved model `model_name_or_path` {model_args.model_name_or_path!r}. Grow a saved model with "
            "`grow_encoder` and train it with `hf-deep-nmt train` and `model_name_or_path` instead."
        )
    if data_args.streaming:
        raise ValueError(
            "`hf-deep-nmt train-staged` does not stream its corpus (`streaming: true`): its stages would each start "
            "the stream again. Train the stages without `streaming`, or grow a model with `grow_encoder` and train it "
            "with `hf-deep-nmt train`."
        )


def recipe_inputs(model_args: ModelArguments, data_args: DataArguments) -> list[str]:
    """The local paths a recipe reads (tokenizer, saved model, corpus files): `overwrite_output_dir` never removes
    them, even where a run of ours wrote them."""
    named = [model_args.saved_tokenizer(), model_args.model_name_or_path, *data_args.corpus_files()]
    return [path for path in named if path]


def check_checkpoints_to_average(export_args: EvalExportArguments, training_args: DeepNMTTrainingArguments) -> None:
    """`ValueError` when a run of `max_steps` steps saving every `save_steps` writes fewer checkpoints than
    `average_checkpoints` averages at its end (the Trainer saves at each multiple of `save_steps` and at the last
    step). Runs counted in epochs are left to the end, where `last_checkpoints` names what exists."""
    count, steps, every = export_args.average_checkpoints, training_args.max_steps, training_args.save_steps
    if not count or steps is None or steps < 1 or training_args.save_strategy != "steps" or not every or every <= 0:
        return
    every = math.ceil(steps * every) if every < 1 else int(every)
    saved = [*range(every, steps + 1, every)]
    saved += [steps] if steps not in saved else []
    if len(saved) < count:
        raise ValueError(
            f"`average_checkpoints={count}` averages the last {count} checkpoints, but `max_steps={steps}` with "
            f"`save_steps={training_args.save_steps}` writes {len(saved)} (at steps {saved}); lower `save_steps` "
            "or `average_checkpoints`, or raise `max_steps`."
        )


def check_repo_id(repo_id: str) -> None:
    """`ValueError` naming `repo_id` when it is not a Hub repository id: the export's model card names it, and
    `hf-deep-nmt push` would refuse it after the run."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        reason = " ".join(str(error).split())
        raise ValueError(
            f"`repo_id` {repo_id!r} is not a Hub repository id ({reason}); write it as 'your-name/model-name'."
        ) from None


def _sizes_of_preset(model_args: ModelArguments):
    """The preset's config with the overrides (already checked by `check_model_arguments`), built without its
    warnings (the run's own config says them once), for the size check: the vocabulary is the tokenizer's, known
    only once it is prepared, so the smaller of the config's and `tokenizer_vocab_size` stands in for it."""
    config_class = PRESETS[model_args.model_type]
    overrides = model_args.model_overrides
    vocab = overrides.get("vocab_size") or getattr(config_class, "vocab_size", None)
    if vocab and model_args.tokenizer_vocab_size:
        overrides = {**overrides, "vocab_size": min(vocab, model_args.tokenizer_vocab_size)}
    config_logger = sys.modules[config_class.__module__].logger
    quiet, config_logger.disabled = config_logger.disabled, True
    try:
        return config_class(**overrides)
    except ValueError:
        return None  # a vocabulary the overrides' token ids do not fit: the run's own config names the problem
    finally:
        config_logger.disabled = quiet


def check_saved_model(model_args: ModelArguments):
    """The config of the saved model a run starts from (`model_name_or_path`), after checking that the folder holds a
    config and, unless `tokenizer_name_or_path` names another, a tokenizer; that it is a model of this package; and
    that the recipe's `model_type` and `model_overrides`, where given, are the saved model's (the model is loaded as
    saved: a recipe value that differs would be ignored). Each failure names the value. A Hub id's config is
    downloaded."""
    path = model_args.model_name_or_path
    what = "`model_name_or_path`"
    check_model_paths(model_args)  # a path that is not there is said to be missing, before any Hub lookup
    check_saved_model_folder(path, what, need_tokenizer=not model_args.tokenizer_name_or_path)
    check_saved_json_files(path, what)
    if model_args.tokenizer_name_or_path:
        check_saved_json_files(model_args.tokenizer_name_or_path, "`tokenizer_name_or_path`")
    config = AutoConfig.from_pretrained(path)
    if type(config) not in MODEL_CLASSES:
        hint = " (convert it first with `hf-deep-nmt convert-marian`)" if config.model_type == "marian" else ""
        raise ValueError(
            f"{what} {path!r} is a {type(config).__name__} (model_type {config.model_type!r}), not a model of this "
            f"package (one of {tuple(PRESETS)}){hint}."
        )
    check_recipe_agrees_with_saved_model(model_args, config)
    check_saved_weights_finite(path, what)
    return config


def check_recipe_agrees_with_saved_model(model_args: ModelArguments, config) -> None:
    """`ValueError` naming both values for a `model_type` or a `model_overrides` entry of the recipe that is not the
    saved model's."""
    path, what = model_args.model_name_or_path, "`model_name_or_path`"
    problems = []
    if model_args.model_type is not None and model_args.model_type != config.model_type:
        problems.append(f"`model_type` is {model_args.model_type!r} but the saved model's is {config.model_type!r}")
    missing = object()
    for key, value in model_args.model_overrides.items():
        saved = getattr(config, key, missing)
        if saved is missing or saved != value:
            shown = "no such setting" if saved is missing else repr(saved)
            problems.append(f"`model_overrides.{key}` is {value!r} but the saved model has {shown}")
    if problems:
        raise ValueError(
            f"The recipe contradicts the saved model {what} {path!r}: {'; '.join(problems)}. A saved model is "
            "loaded as it was saved: remove these settings from the recipe or make them the saved model's."
        )
