"""The arguments of `hf-deep-nmt train` / `train-staged` and every check that needs nothing but them.

A recipe is a JSON or YAML file of argument values, overridden by `--field value` flags (`parse_arguments`); an
unknown key or a value of the wrong type is an error naming it. `check_arguments` refuses, before any work, the
settings that would otherwise fail or give nonsense only after training.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sacrebleu.metrics.bleu import BLEU
from transformers import HfArgumentParser, Seq2SeqTrainingArguments

from hf_deep_nmt import MODEL_CLASSES
from hf_deep_nmt.data.corpus import sample_corpus_dir
from hf_deep_nmt.data.streaming import DEFAULT_STREAM_BUFFER_PAIRS
from hf_deep_nmt.data.tokenizer import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, SUBWORD_MODELS
from hf_deep_nmt.modeling.configuration_deep_nmt import describe_unknown_keys, unknown_config_keys
from hf_deep_nmt.serving.options import LENGTH_PENALTY_FORMS, MAX_EVALUATION_OUTPUT_TOKENS, DecodingOptions
from hf_deep_nmt.training.callbacks import DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS, NonFiniteGuard
from hf_deep_nmt.training.growing import GROWTH_STRATEGIES
from hf_deep_nmt.training.recipes import CONFIG_SUFFIXES, read_recipe, recipe_path

PRESETS = {config_class.model_type: config_class for config_class in MODEL_CLASSES}


DEFAULT_PRESET = "deep_nmt_dlcl"
# What a newly trained joint tokenizer is when the recipe does not say.
DEFAULT_TOKENIZER_SETTINGS = {"tokenizer_vocab_size": 8000, "tokenizer_model": "bpe"}


@dataclass
class ModelArguments:
    """The model and tokenizer: a fresh preset (`model_type` + `model_overrides`) with a joint tokenizer trained on the
    training data, or a saved model (`model_name_or_path`: a folder, e.g. a converted and grown OPUS-MT model, or a Hub
    id) whose config and weights are loaded as saved and whose tokenizer is used as it is.

    `model_type`, `tokenizer_vocab_size` and `tokenizer_model` stay None when the recipe does not set them and the
    run starts from a saved model (so that a recipe value can be told from a default and checked against the saved
    model); for a fresh preset they take their defaults (`DEFAULT_PRESET`, `DEFAULT_TOKENIZER_SETTINGS`)."""

    model_type: str | None = field(
        default=None,
        metadata={
            "help": f"Named preset to start from, one of {tuple(PRESETS)} (default {DEFAULT_PRESET}); with "
            "`model_name_or_path`, if given, it must be the saved model's."
        },
    )
    model_overrides: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "Config fields that replace the preset's defaults (JSON object); with `model_name_or_path`, each "
            "must equal the saved model's value."
        },
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Start from this saved model folder or Hub id (config, weights and tokenizer) instead of a fresh "
            "preset, e.g. a folder written by `convert-marian` and grown with `grow_encoder`."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Saved tokenizer; default: the saved model's, or a joint one trained on the training data."},
    )
    tokenizer_vocab_size: int | None = field(
        default=None, metadata={"help": "Size of a newly trained joint vocabulary (default 8000)."}
    )
    tokenizer_model: str | None = field(
        default=None, metadata={"help": "Subword model of a new tokenizer: bpe (default) or unigram."}
    )
    tokenizer_train_pairs: int | None = field(
        default=None,
        metadata={
            "help": "A new tokenizer is trained on at most this many training pairs, drawn for the seed (default "
            "1000000; a smaller corpus is used whole)."
        },
    )

    def __post_init__(self):
        if self.model_type is None and not self.model_name_or_path:
            self.model_type = DEFAULT_PRESET
        if not self.saved_tokenizer():
            for name, default in DEFAULT_TOKENIZER_SETTINGS.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)

    def saved_tokenizer(self) -> str | None:
        """The folder or Hub id the tokenizer is loaded from (None: a new one is trained)."""
        return self.tokenizer_name_or_path or self.model_name_or_path


@dataclass
class DataArguments:
    train_file: str | None = field(
        default=None,
        metadata={"help": "Training corpus (.tsv, .jsonl or a two-file prefix); default: bundled sample."},
    )
    validation_file: str | None = field(default=None, metadata={"help": "Validation corpus; default: sample."})
    dataset_name: str | None = field(default=None, metadata={"help": "A `datasets.load_dataset` name instead."})
    dataset_config: str | None = field(default=None, metadata={"help": "Its configuration, e.g. de-en."})
    dataset_validation_split: str = field(
        default="validation", metadata={"help": "Split of `dataset_name` to evaluate on (e.g. test)."}
    )
    source_lang: str = field(default="es", metadata={"help": "Source language code."})
    target_lang: str = field(default="en", metadata={"help": "Target language code."})
    max_source_length: int = field(default=128, metadata={"help": "Longer source sentences are dropped (counted)."})
    max_target_length: int = field(default=128, metadata={"help": "Longer target sentences are dropped (counted)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first N pairs only."})
    prepared_data_dir: str | None = field(
        default=None,
        metadata={
            "help": "Folder of the prepared data (tokenizer + tokenized splits), built when missing; default: "
            "$HF_DEEP_NMT_PREPARED_DATA/<fingerprint> or <HF_HOME>/hf_deep_nmt/prepared/<fingerprint>."
        },
    )
    preprocessing_num_workers: int | None = field(
        default=None, metadata={"help": "Processes that tokenize the corpus (default: the cores available)."}
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read the training corpus while training (larger than memory or disk cache): token-budget batches "
            "from a shuffling, length-bucketing buffer; needs max_steps. See docs/training.md, Streaming."
        },
    )
    stream_buffer_pairs: int = field(
        default=DEFAULT_STREAM_BUFFER_PAIRS,
        metadata={"help": "With streaming: pairs per process read, sorted by length and cut into batches at a time."},
    )

    def corpus_paths(self) -> tuple[str | None, str | None]:
        """The training and validation files that are read: the bundled sample corpus when neither a file nor a
        dataset is named (the arguments keep what the recipe said)."""
        if self.train_file or self.dataset_name:
            return self.train_file, self.validation_file
        return str(sample_corpus_dir() / "train.tsv"), self.validation_file or str(sample_corpus_dir() / "valid.tsv")

    def corpus_files(self) -> list[str]:
        """The files of `corpus_paths` that are named (none for a `dataset_name` without files)."""
        return [path for path in self.corpus_paths() if path]


@dataclass
class EvalExportArguments:
    num_beams: int = field(default=4, metadata={"help": "Beam size for evaluation and export."})
    length_penalty: float = field(default=1.0, metadata={"help": "Length penalty alpha (see length_penalty_form)."})
    length_penalty_form: str = field(
        default="fairseq",
        metadata={"help": "fairseq: score / |Y|**alpha (generate()'s own); gnmt: score / ((5 + |Y|) / 6)**alpha."},
    )
    max_length_a: float = field(default=1.5, metadata={"help": "Output may be a * source_length + b tokens long."})
    max_length_b: int = field(default=10, metadata={"help": "See max_length_a."})
    eval_max_tokens: int | None = field(
        default=None, metadata={"help": "Token budget of a translation batch in the final evaluation."}
    )
    tokenized_bleu: bool = field(default=False, metadata={"help": "Also report tokenized BLEU (multi-bleu style)."})
    bleu_tokenize: str = field(default="13a", metadata={"help": "sacreBLEU tokenizer for the tokenized BLEU."})
    compound_split: bool = field(default=False, metadata={"help": "Split a-b as a ##AT##-##AT## b (En-De papers)."})
    bleu_lowercase: bool = field(default=False, metadata={"help": "Case-insensitive tokenized BLEU (IWSLT)."})
    average_checkpoints: int = field(
        default=0, metadata={"help": "Evaluate and export the mean of the last N checkpoints (0: the final weights)."}
    )
    plot_curves: bool = field(
        default=True, metadata={"help": "Write training_curves.png (loss, validation BLEU); needs matplotlib."}
    )
    translate_examples: int = field(default=5, metadata={"help": "Validation sentences to translate and show."})
    export_dir: str | None = field(default=None, metadata={"help": "Write a Hub-ready folder here after training."})
    overwrite_export: bool = field(default=False, metadata={"help": "Replace a non-empty export_dir."})
    repo_id: str | None = field(default=None, metadata={"help": "Hub repository id named in the model card."})

    def __post_init__(self):
        if self.length_penalty_form not in LENGTH_PENALTY_FORMS:
            raise ValueError(
                f"`length_penalty_form` must be one of {LENGTH_PENALTY_FORMS}, got {self.length_penalty_form!r}."
            )
        if self.average_checkpoints < 0:
            raise ValueError(f"`average_checkpoints` must be >= 0, got {self.average_checkpoints}.")

    def tokenized_bleu_options(self) -> dict | None:
        if not self.tokenized_bleu:
            return None
        return dict(tokenize=self.bleu_tokenize, compound_split=self.compound_split, lowercase=self.bleu_lowercase)


LR_SCHEDULES = ("trainer", "inverse_sqrt", "noam")
# The longest runs a recipe may ask for: past them the step count overflows the Trainer's integers.
MAX_EPOCHS = 1_000_000
MAX_STEPS = 2**31 - 1


@dataclass
class DeepNMTTrainingArguments(Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` plus token-budget batches and the papers' learning-rate schedules."""

    max_tokens: int | None = field(
        default=None,
        metadata={"help": "Token budget per training batch and process (padded size); replaces the sentence count."},
    )
    lr_schedule: str = field(
        default="trainer",
        metadata={
            "help": "trainer: `lr_scheduler_type`; inverse_sqrt: fairseq (warm-up from warmup_init_lr to "
            "learning_rate); noam: learning_rate * d^-0.5 * min(n^-0.5, n * warmup^-1.5)."
        },
    )
    warmup_init_lr: float = field(default=1e-7, metadata={"help": "Start of the fairseq inverse_sqrt warm-up."})
    max_consecutive_nonfinite_steps: int = field(
        default=DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS,
        metadata={
            "help": "Optimizer steps with a NaN/inf loss or gradient are skipped (no update, schedule held); more "
            "than this many in a row stop the run with NonFiniteTrainingError (0: stop at the first)."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh in an output_dir holding another run: remove what runs of this package wrote there "
            "(checkpoints, results, curves, its record); other files are kept."
        },
    )

    def __post_init__(self):
        # Before transformers' own checks: it replaces an `eval_steps` of 0 by `logging_steps` without a word.
        problems = training_value_problems(self)
        if problems:
            raise ValueError("; ".join(problems) + ".")
        super().__post_init__()
        NonFiniteGuard(self.max_consecutive_nonfinite_steps)  # validates the value
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"`lr_schedule` must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"`max_tokens` must be >= 1 or unset, got {self.max_tokens}.")


def _fp16_device_available() -> bool:
    """Whether a device that trains in fp16 mixed precision is there (CUDA, or Apple's MPS)."""
    mps = getattr(torch.backends, "mps", None)
    return torch.cuda.is_available() or bool(mps and mps.is_available())


def training_value_problems(args) -> list[str]:
    """The training settings that transformers accepts but that make no sense, each naming the value and what is
    valid: a negative or non-finite learning rate, warm-up start, weight decay or clipping norm; `max_steps: 0` (it
    trains one step); zero or negative step intervals and checkpoint limits; fp16 without a GPU."""
    problems = []

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def require(name: str, ok: bool, valid: str) -> None:
        if not ok:
            problems.append(f"`{name}` must be {valid}, got {getattr(args, name)!r}")

    for name in ("learning_rate", "warmup_init_lr", "weight_decay", "adam_epsilon"):
        value = getattr(args, name)
        strictly = name == "learning_rate"
        require(
            name,
            number(value) and math.isfinite(value) and (value > 0 if strictly else value >= 0),
            "a finite number > 0" if strictly else "a finite number >= 0",
        )
    for name in ("adam_beta1", "adam_beta2", "label_smoothing_factor"):
        value = getattr(args, name)
        require(name, number(value) and 0 <= value < 1, "in [0, 1)")
    norm = args.max_grad_norm
    require(
        "max_grad_norm", norm is None or (number(norm) and norm >= 0 and not math.isnan(norm)), ">= 0 (0: no clipping)"
    )
    require("max_steps", args.max_steps == -1 or args.max_steps >= 1, ">= 1, or -1 to train `num_train_epochs`")
    if args.max_steps == -1:
        epochs = args.num_train_epochs
        require("num_train_epochs", number(epochs) and math.isfinite(epochs) and epochs > 0, "a finite number > 0")
        if number(epochs) and math.isfinite(epochs) and epochs > MAX_EPOCHS:
            require("num_train_epochs", False, f"at most {MAX_EPOCHS:,} (or set `max_steps` to count steps)")
    require("max_steps", args.max_steps <= MAX_STEPS, f"at most {MAX_STEPS:,}")
    output_dir = args.output_dir
    require("output_dir", not isinstance(output_dir, str) or output_dir.strip() != "", "a folder name, not empty")
    for name in ("eval_steps", "save_steps", "logging_steps"):
        value = getattr(args, name)
        require(
            name,
            value is None or (number(value) and math.isfinite(value) and value > 0),
            "> 0 (a step count, or below 1 a fraction of the training steps) or unset",
        )
    for name in ("seed", "data_seed"):  # numpy's and torch's generators take seeds in [0, 2**32)
        value = getattr(args, name, None)
        require(name, value is None or 0 <= value < 2**32, f"an integer from 0 to {2**32 - 1:,}")
    require("dataloader_num_workers", args.dataloader_num_workers >= 0, ">= 0 (0: load in the main process)")
    limit = args.save_total_limit
    require("save_total_limit", limit is None or limit >= 1, ">= 1, or unset to keep every checkpoint")
    if args.fp16 and (args.use_cpu or not _fp16_device_available()):
        where = "`use_cpu` is set" if args.use_cpu else "this machine has no CUDA (or MPS) device"
        problems.append(
            f"`fp16: true` needs a GPU and {where}: remove `fp16` (on a CPU, `bf16: true` with `use_cpu: true` "
            "trains in bfloat16)"
        )
    return problems


@dataclass
class StageArguments:
    """The stages of `hf-deep-nmt train-staged` (SDT): depths, steps, growth and the restarted schedule."""

    stage_depths: list[int] = field(
        default_factory=lambda: [6, 12, 18, 24, 30, 36, 42, 48],
        metadata={"help": "Encoder depth of each stage, increasing; the first is trained from scratch."},
    )
    stage_max_steps: int = field(default=5000, metadata={"help": "Optimizer steps per stage."})
    growth_strategy: str = field(default="top", metadata={"help": f"How to grow: one of {GROWTH_STRATEGIES}."})
    reset_previous_block_norm: bool = field(
        default=False, metadata={"help": "Reset the old top block's LayerNorm after growing (the reference code)."}
    )
    schedule_warmup_steps: int = field(default=8000, metadata={"help": "Warm-up of the inverse-sqrt schedule."})
    schedule_init_lr: float = field(default=1e-7, metadata={"help": "Learning rate at step 0 of the warm-up."})

    def __post_init__(self):
        depths = self.stage_depths
        if not depths or any(not isinstance(d, int) or d < 1 for d in depths) or depths != sorted(set(depths)):
            raise ValueError(f"`stage_depths` must be strictly increasing positive integers, got {depths!r}.")
        if self.stage_max_steps < 1 or self.schedule_warmup_steps < 1:
            raise ValueError(
                f"`stage_max_steps` and `schedule_warmup_steps` must be >= 1, got {self.stage_max_steps} and "
                f"{self.schedule_warmup_steps}."
            )
        if not math.isfinite(self.schedule_init_lr) or self.schedule_init_lr < 0:
            raise ValueError(f"`schedule_init_lr` must be a finite number >= 0, got {self.schedule_init_lr!r}.")
        if self.growth_strategy not in GROWTH_STRATEGIES:
            raise ValueError(f"`growth_strategy` must be one of {GROWTH_STRATEGIES}, got {self.growth_strategy!r}.")


ARGUMENT_CLASSES = (ModelArguments, DataArguments, EvalExportArguments, DeepNMTTrainingArguments)


def multi_process_launch_without_gpu() -> bool:
    """True under `torchrun`/`accelerate launch` with several processes on a machine with no CUDA device.

    There `Seq2SeqTrainingArguments` must get `use_cpu=True`, or transformers runs every process as an independent,
    non-distributed rank 0 (each training its own copy and each writing the output).
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def json_object(text: str) -> dict[str, Any]:
    """A mapping flag's value: a JSON object (argparse would call `dict` on the text, refusing any value)."""
    import argparse
    import json

    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'a JSON object ({{"key": value, ...}}) is needed, got {text!r}')
    return value


def parse_arguments(
    argv: list[str] | None = None, classes: tuple = ARGUMENT_CLASSES, given: set[str] | None = None
) -> tuple[Any, ...]:
    """`CONFIG.json|yaml [--field value ...]`: the file gives values, the command line overrides them.

    Unknown keys in the file are an error naming them (a misspelt field must not be ignored). `use_cpu` defaults to
    true for a multi-process launch on a machine without a GPU (see `multi_process_launch_without_gpu`). `given`, if
    passed, receives the names the recipe and the flags set (for `check_explicit_run`, so the file is read once).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if given is not None:
        given |= _flag_names(argv)
    parser = HfArgumentParser(classes)
    for action in parser._actions:  # a mapping flag (`--model-overrides`) takes a JSON object, as its help says
        if action.type is dict or typing.get_origin(action.type) is dict:
            action.type = json_object
    cpu_default = {"use_cpu": True} if multi_process_launch_without_gpu() else {}
    parser.set_defaults(**cpu_default)
    path = recipe_path(argv)
    if path is not None:
        argv.pop(0)
        values = read_recipe(path)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of argument names to values, got {type(values).__name__}.")
        known = {f.name for cls in classes for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; see `hf-deep-nmt train --help` for valid ones.")
        check_recipe_values(values, classes, str(path))
        if given is not None:
            given |= set(values)
        if not argv:
            return parser.parse_dict({**cpu_default, **values})
        # Values from the file become defaults of the command line parser, so flags given after it win.
        parser.set_defaults(**{key: value for key, value in values.items() if key != "model_overrides"})
        outputs = parser.parse_args_into_dataclasses(args=argv)
        if "model_overrides" in values:
            outputs[0].model_overrides = {**values["model_overrides"], **outputs[0].model_overrides}
        return outputs
    return parser.parse_args_into_dataclasses(args=argv)


def _flag_names(argv: list[str]) -> set[str]:
    """The settings named by flags, as recipe keys: `--output-dir` and `--output_dir` both name `output_dir`."""
    return {item[2:].split("=")[0].replace("-", "_") for item in argv if item.startswith("--")}


def check_explicit_run(argv: list[str] | None, command: str = "train", given: set[str] | None = None) -> None:
    """`ValueError` unless the command line names a model (`model_type` or `model_name_or_path`) and an `output_dir`,
    in a config file or as flags: without them the defaults would start a full-size job into ./trainer_output.
    `given`: the names set, as `parse_arguments` collected them; else the recipe file is read here."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if given is None:
        given = _flag_names(argv)
        if argv and argv[0].endswith(CONFIG_SUFFIXES):
            given |= set(read_recipe(Path(argv[0])) or {})
    missing = []
    if not given & {"model_type", "model_name_or_path"}:
        missing.append(f"a model (`model_type`, one of {tuple(PRESETS)}, or `model_name_or_path`)")
    if "output_dir" not in given:
        missing.append("an `output_dir`")
    if missing:
        raise ValueError(
            f"`hf-deep-nmt {command}` needs a recipe naming {' and '.join(missing)}: give a config file such as "
            f"recipes/configs/sample.json (flags after it override it), or the flags. Without them the defaults "
            f"would train a full-size model for thousands of steps into ./trainer_output."
        )


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether `value` (as read from JSON / YAML) fits `annotation`; unknown annotations accept anything."""
    if annotation is Any or annotation is typing.Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(argument, value) for argument in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin is not None:  # list[int], dict[str, Any], ...: the container type only
        return isinstance(origin, type) and isinstance(value, origin)
    if not isinstance(annotation, type):
        return True
    if issubclass(annotation, enum.Enum):
        return isinstance(value, annotation) or value in {member.value for member in annotation}
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation in (list, dict):
        return isinstance(value, annotation)
    return True


def check_recipe_values(values: dict[str, Any], classes: tuple, source: str) -> None:
    """Raise `ValueError` naming `source`, the key, the value and the expected type for the first recipe value whose
    type does not fit its argument (e.g. `"max_steps": "ten"`), which the argument dataclasses would otherwise take
    as is and fail on much later."""
    hints: dict[str, Any] = {}
    for cls in classes:
        try:
            resolved = typing.get_type_hints(cls)
        except Exception:  # an annotation that cannot be resolved is left unchecked
            resolved = {}
        for item in dataclasses.fields(cls):
            hints.setdefault(item.name, resolved.get(item.name, Any))
    for key, value in values.items():
        if key in hints and not _accepts(hints[key], value):
            expected = getattr(hints[key], "__name__", None) or str(hints[key]).replace("typing.", "")
            raise ValueError(f"{source}: `{key}` must be of type {expected}, got {value!r} ({type(value).__name__}).")


def check_config_overrides(config_class: type, overrides: dict[str, Any]) -> None:
    """Raise `ValueError` naming every key of `overrides` that is not a field of `config_class`: in a recipe a misspelt
    field is an error (the config itself only warns, since saved folders may hold such keys)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"`model_overrides` must be a mapping of config fields to values, got {overrides!r}.")
    unknown = unknown_config_keys(config_class, overrides)
    if unknown:
        raise ValueError(
            f"`model_overrides` has keys that are not {config_class.__name__} fields: "
            f"{describe_unknown_keys(unknown)}; see the {config_class.__name__} documentation for the valid ones."
        )


def check_model_paths(model_args: ModelArguments) -> None:
    """`FileNotFoundError` naming the setting for a `model_name_or_path` or `tokenizer_name_or_path` that is not a
    local file or folder and cannot be a Hub repository id: written as a path (`./`, `/`, `~`, more than one `/`, a
    first part that is a local folder), or, in offline mode, not in the local cache. Said before any Hub lookup, which
    would answer with its own words (a malformed repo id, the internet connection) or, for a tokenizer, after the
    recipe's other settings were compared with it."""
    from hf_deep_nmt.model_folders import _HUB_ID, _LOCAL_PREFIXES

    for setting in ("model_name_or_path", "tokenizer_name_or_path"):
        text = getattr(model_args, setting)
        if not text or not isinstance(text, str) or Path(text).expanduser().exists():
            continue
        where = f"no such file or folder: {Path(text).expanduser().absolute()}"
        first = text.split("/")[0]
        if text.startswith(_LOCAL_PREFIXES) or not _HUB_ID.fullmatch(text) or ("/" in text and Path(first).is_dir()):
            raise FileNotFoundError(
                f"`{setting}` {text!r} does not exist: it is not a local folder ({where}) nor a Hub repository id "
                "(ORG/NAME); check the path."
            )
        from huggingface_hub import constants, try_to_load_from_cache

        if constants.is_offline_mode() and not isinstance(try_to_load_from_cache(text, "config.json"), str):
            if not isinstance(try_to_load_from_cache(text, "tokenizer_config.json"), str):
                raise FileNotFoundError(
                    f"`{setting}` {text!r} does not exist: it is not a local folder ({where}), and in offline mode "
                    "(HF_HUB_OFFLINE is set) not a Hub repository in the local cache; check the path, or unset "
                    "HF_HUB_OFFLINE to download it."
                )


def check_model_arguments(model_args: ModelArguments) -> None:
    """`ValueError` for settings of a new tokenizer beside a saved one (they would be ignored); for a fresh preset (no
    `model_name_or_path`), for a preset that does not exist, an override that is not a field of its config, or one
    whose value the config refuses (its own message, naming the value). A saved model's folder and the recipe's
    agreement with it are checked by `hf_deep_nmt.training.plan.check_saved_model`."""
    blank = empty_settings((model_args, ("model_name_or_path", "tokenizer_name_or_path", "model_type")))
    if blank:
        raise ValueError("; ".join(blank) + ".")
    check_model_paths(model_args)
    saved_tokenizer = model_args.saved_tokenizer()
    if saved_tokenizer:
        given = {name: getattr(model_args, name) for name in DEFAULT_TOKENIZER_SETTINGS}
        given = {name: value for name, value in given.items() if value is not None}
        if given:
            source = "tokenizer_name_or_path" if model_args.tokenizer_name_or_path else "model_name_or_path"
            settings = ", ".join(f"`{name}={value!r}`" for name, value in given.items())
            raise ValueError(
                f"{settings} would train a new tokenizer, but the tokenizer is the one saved at `{source}` "
                f"{saved_tokenizer!r} and is used as it is; remove {'it' if len(given) == 1 else 'them'} from the "
                "recipe."
            )
    if model_args.tokenizer_model is not None and model_args.tokenizer_model not in SUBWORD_MODELS:
        raise ValueError(f"`tokenizer_model` must be one of {SUBWORD_MODELS}, got {model_args.tokenizer_model!r}.")
    size = model_args.tokenizer_vocab_size
    if size is not None and not MIN_VOCAB_SIZE <= size <= MAX_VOCAB_SIZE:
        raise ValueError(
            f"`tokenizer_vocab_size` must be between {MIN_VOCAB_SIZE} and {MAX_VOCAB_SIZE:,} (the sizes a joint "
            f"tokenizer is trained to), got {size:,}."
        )
    if model_args.tokenizer_train_pairs is not None and model_args.tokenizer_train_pairs < 1:
        raise ValueError(f"`tokenizer_train_pairs` must be >= 1 or unset, got {model_args.tokenizer_train_pairs}.")
    if model_args.model_name_or_path:
        return
    if model_args.model_type not in PRESETS:
        raise ValueError(f"`model_type` must be one of {tuple(PRESETS)}, got {model_args.model_type!r}.")
    config_class = PRESETS[model_args.model_type]
    check_config_overrides(config_class, model_args.model_overrides)
    # The values too, before any data is read: building the config validates them. Its warnings (settings without
    # effect) are left to the config the run builds, so that they are said once.
    config_logger = sys.modules[config_class.__module__].logger
    quiet, config_logger.disabled = config_logger.disabled, True
    try:
        config_class(**model_args.model_overrides)
    finally:
        config_logger.disabled = quiet


def check_arguments(
    data_args: DataArguments, export_args: EvalExportArguments, training_args: Seq2SeqTrainingArguments
) -> DecodingOptions:
    """`ValueError` for a setting that would fail or give nonsense only after training (or at its end): naming the
    setting, its value and what is valid. Cheap: nothing is loaded or built, no file is looked at. Returns the final
    evaluation's decoding options (`evaluation_options`), built while checking them."""
    options = None
    problems = empty_settings(
        (data_args, ("train_file", "validation_file", "dataset_name", "prepared_data_dir")),
        (export_args, ("export_dir",)),
    )
    problems += language_code_problems(data_args.source_lang, data_args.target_lang)
    problems += _count_problems(data_args, export_args, training_args)
    problems += _output_length_problems(data_args, export_args)
    if not problems:  # the final evaluation's decoding options, as `translate` will check them after training
        try:
            options = evaluation_options(export_args, training_args)
        except ValueError as error:
            problems.append(str(error).rstrip("."))
    tokenizers = sacrebleu_tokenizers()
    if export_args.bleu_tokenize not in tokenizers:
        hint = difflib.get_close_matches(export_args.bleu_tokenize, tokenizers, n=1)
        problems.append(
            f"`bleu_tokenize` must be one of sacreBLEU's tokenizers {tokenizers}, got {export_args.bleu_tokenize!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    problems += streaming_problems(data_args, training_args)
    if problems:
        raise ValueError("; ".join(problems) + ".")
    if export_args.average_checkpoints:
        if training_args.save_strategy == "no":
            raise ValueError(
                f"`average_checkpoints={export_args.average_checkpoints}` needs checkpoints: set `save_strategy` "
                "(steps or epoch), not 'no'."
            )
        limit = training_args.save_total_limit
        if limit is not None and limit < export_args.average_checkpoints:
            raise ValueError(
                f"`save_total_limit={limit}` keeps fewer checkpoints than `average_checkpoints="
                f"{export_args.average_checkpoints}` averages; raise it or unset it."
            )
    return options


def _count_problems(data_args, export_args, training_args) -> list[str]:
    """The counts and sizes that must be at least 1 (`translate_examples`: at least 0), each naming its value."""
    problems = []

    def at_least_one(name: str, value) -> None:
        if value is not None and value < 1:
            problems.append(f"`{name}` must be >= 1, got {value}")

    if export_args.translate_examples < 0:
        problems.append(f"`translate_examples` must be >= 0 (0: show none), got {export_args.translate_examples}")
    at_least_one("num_beams", export_args.num_beams)
    at_least_one("max_eval_samples", data_args.max_eval_samples)
    at_least_one("per_device_eval_batch_size", training_args.per_device_eval_batch_size)
    at_least_one("per_device_train_batch_size", training_args.per_device_train_batch_size)
    at_least_one("gradient_accumulation_steps", training_args.gradient_accumulation_steps)
    at_least_one("eval_max_tokens", export_args.eval_max_tokens)
    at_least_one("max_source_length", data_args.max_source_length)
    at_least_one("max_target_length", data_args.max_target_length)
    at_least_one("preprocessing_num_workers", getattr(data_args, "preprocessing_num_workers", None))
    return problems


def _output_length_problems(data_args, export_args) -> list[str]:
    """A length penalty or output-length factor that is not a finite number, and an output cap
    `max_length_a * max_source_length + max_length_b` outside [1, MAX_EVALUATION_OUTPUT_TOKENS]."""
    problems = []
    for name in ("length_penalty", "max_length_a"):
        value = getattr(export_args, name)
        if not math.isfinite(value):
            problems.append(f"`{name}` must be a finite number, got {value}")
    if math.isfinite(export_args.max_length_a):
        if export_args.max_length_a < 0:
            problems.append(f"`max_length_a` must be >= 0, got {export_args.max_length_a}")
        cap = export_args.max_length_a * data_args.max_source_length + export_args.max_length_b
        if not 1 <= cap <= MAX_EVALUATION_OUTPUT_TOKENS:
            problems.append(
                f"the output cap `max_length_a * max_source_length + max_length_b` = {export_args.max_length_a} * "
                f"{data_args.max_source_length} + {export_args.max_length_b} = {cap:g} tokens must be between 1 and "
                f"{MAX_EVALUATION_OUTPUT_TOKENS}"
            )
    return problems


def streaming_problems(data_args, training_args) -> list[str]:
    """What is wrong with the streaming settings, each naming the value and what is valid (empty when nothing is):
    `stream_buffer_pairs` below 1 (`tokenizer_train_pairs` is checked with the model settings); with
    `streaming: true`, no `max_steps`, no corpus to
    stream (`train_file` or `dataset_name`), a `max_tokens` below the longest pair the length limits admit, or more
    than one data-loader worker."""
    problems = []
    value = data_args.stream_buffer_pairs
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(
            "`stream_buffer_pairs` (pairs held in the shuffling, length-bucketing buffer of each process) must be an "
            f"integer >= 1, got {value!r}"
        )
    if not getattr(data_args, "streaming", False):
        return problems
    if training_args.max_steps is None or training_args.max_steps < 1:
        problems.append(
            f"`streaming: true` needs `max_steps` (a streamed corpus has no length to count epochs in), got "
            f"max_steps={training_args.max_steps}; set it to the number of optimizer steps to train"
        )
    if not data_args.train_file and not data_args.dataset_name:
        named = (
            f" (`validation_file` {data_args.validation_file!r} names only the evaluation data)"
            if data_args.validation_file
            else ""
        )
        problems.append(
            f"`streaming: true` needs the corpus to stream, `train_file` or `dataset_name`{named}; without either the "
            "bundled sample is used, which fits in memory: remove `streaming`"
        )
    max_tokens = getattr(training_args, "max_tokens", None)
    longest = max(data_args.max_source_length, data_args.max_target_length)
    if max_tokens is not None and max_tokens < longest:
        problems.append(
            f"with `streaming: true`, `max_tokens` ({max_tokens}) must hold the longest pair the length limits admit "
            f"(max(`max_source_length`, `max_target_length`) = {longest} tokens): a streamed corpus cannot be checked "
            "for longer pairs before training; raise `max_tokens` or lower the limits"
        )
    return problems


def empty_settings(*groups: tuple[Any, tuple[str, ...]]) -> list[str]:
    """A problem for each named setting given as an empty (or blank) string: read as unset, it would silently train
    without the file or folder it was meant to name."""
    return [
        f"`{name}` is an empty string; name a path, or leave `{name}` out of the recipe to use its default"
        for arguments, names in groups
        for name in names
        if isinstance(getattr(arguments, name), str) and not getattr(arguments, name).strip()
    ]


def language_code_problems(source_lang: str, target_lang: str) -> list[str]:
    """The language codes name the two sides of a pair (the columns of a `.jsonl` corpus, the files `PREFIX.SRC` and
    `PREFIX.TGT`): each must be a non-empty word without spaces or path separators, and the two must differ."""
    problems = []
    for name, code in (("source_lang", source_lang), ("target_lang", target_lang)):
        if not isinstance(code, str) or not code or any(c.isspace() or c in "/\\" for c in code):
            problems.append(
                f"`{name}` must be a language code such as 'es' or 'en' (no spaces or path separators), got {code!r}"
            )
    if not problems and source_lang == target_lang:
        problems.append(
            f"`source_lang` and `target_lang` are both {source_lang!r}: the two sides of a pair need two codes "
            "(e.g. 'es' and 'en')"
        )
    return problems


def evaluation_options(export_args, training_args) -> DecodingOptions:
    """The decoding options of the final evaluation (`DecodingOptions.from_recipe`): every validation line is
    translated (no source length limit), outputs capped at `MAX_EVALUATION_OUTPUT_TOKENS`."""
    return DecodingOptions.from_recipe(export_args, training_args)


def sacrebleu_tokenizers() -> list[str]:
    return list(BLEU.TOKENIZERS)
