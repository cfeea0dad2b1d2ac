"""Training wiring over `Seq2SeqTrainer`: arguments, model construction from named presets, the main job.

What the libraries do is left to them: argument parsing (`HfArgumentParser`), the training loop, mixed precision and
multi-process training (`Seq2SeqTrainer` / `accelerate`), padding (`DataCollatorForSeq2Seq`), label smoothing
(`label_smoothing_factor`), scoring (`sacrebleu`). Written here: model presets, the config-file + overrides front end,
the token-budget batches and the papers' schedules plugged into the Trainer (`DeepNMTTrainer`), checkpoint
averaging before evaluation, the run summary, training curves and export.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import torch
import yaml
from torch.utils.data import DataLoader
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    PreTrainedTokenizerBase,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)
from transformers.trainer_utils import seed_worker
from transformers.utils import logging

from hf_deep_nmt import MODEL_CLASSES
from hf_deep_nmt.averaging import average_checkpoints, last_checkpoints
from hf_deep_nmt.batching import TokenBudgetBatchSampler, pair_lengths
from hf_deep_nmt.callbacks import (
    DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS,
    NonFiniteGuard,
    nonfinite_steps_skipped,
    resolve_resume_checkpoint,
)
from hf_deep_nmt.curves import plot_training_curves
from hf_deep_nmt.data import SOURCE, TARGET, load_parallel_dataset, sample_corpus_dir, tokenize_parallel
from hf_deep_nmt.evaluation import LENGTH_PENALTY_FORMS, corpus_scores, make_compute_metrics
from hf_deep_nmt.hub import check_export_folder, export_hub_folder
from hf_deep_nmt.input_checks import (
    check_config_overrides,
    check_local_path,
    check_recipe_values,
    check_run_folders,
    check_run_settings,
    check_tokenizer_matches,
    evaluation_options,
)
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTForConditionalGeneration
from hf_deep_nmt.run_folder import RunFolder, run_recipe
from hf_deep_nmt.schedules import inverse_sqrt_scheduler, noam_scheduler
from hf_deep_nmt.tokenizer import train_joint_tokenizer
from hf_deep_nmt.translate import translate

logger = logging.get_logger(__name__)

PRESETS = {config_class.model_type: config_class for config_class in MODEL_CLASSES}


@dataclass
class ModelArguments:
    model_type: str = field(
        default="deep_nmt_dlcl", metadata={"help": f"Named preset to start from, one of {tuple(PRESETS)}."}
    )
    model_overrides: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Config fields that replace the preset's defaults (JSON object)."}
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Start from a saved model folder or Hub id instead of a fresh preset."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Saved tokenizer; default: train a joint one on the training data."}
    )
    tokenizer_vocab_size: int = field(default=8000, metadata={"help": "Size of a newly trained joint vocabulary."})
    tokenizer_model: str = field(default="bpe", metadata={"help": "Subword model of a new tokenizer: bpe or unigram."})


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
        super().__post_init__()
        NonFiniteGuard(self.max_consecutive_nonfinite_steps)  # validates the value
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"`lr_schedule` must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"`max_tokens` must be >= 1 or unset, got {self.max_tokens}.")


class DeepNMTTrainer(Seq2SeqTrainer):
    """`Seq2SeqTrainer` with token-budget training batches (`args.max_tokens`, one share per process), the fairseq
    inverse-sqrt / Noam schedules (`args.lr_schedule`) and a `NonFiniteGuard` (skips non-finite steps, stops after
    `args.max_consecutive_nonfinite_steps` in a row; one passed in `callbacks` is used instead). Everything else is
    the library's."""

    def __init__(self, *args, callbacks=None, **kwargs):
        callbacks = list(callbacks or [])
        if not any(isinstance(callback, NonFiniteGuard) for callback in callbacks):
            training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
            limit = getattr(training_args, "max_consecutive_nonfinite_steps", DEFAULT_MAX_CONSECUTIVE_NONFINITE_STEPS)
            callbacks.insert(0, NonFiniteGuard(limit))
        super().__init__(*args, callbacks=callbacks, **kwargs)

    def get_train_dataloader(self) -> DataLoader:
        max_tokens = getattr(self.args, "max_tokens", None)
        if max_tokens is None:
            return super().get_train_dataloader()
        if not isinstance(self.train_dataset, datasets.Dataset):
            raise TypeError(f"`max_tokens` needs a tokenized `datasets.Dataset`, got {type(self.train_dataset)}.")
        sampler = TokenBudgetBatchSampler(
            pair_lengths(self.train_dataset),
            max_tokens,
            num_replicas=max(1, self.args.world_size),
            rank=self.args.process_index,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
        )
        dataset = self._remove_unused_columns(self.train_dataset, description="Training")
        workers = self.args.dataloader_num_workers
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers if workers else False,
            worker_init_fn=partial(seed_worker, num_workers=workers, rank=self.args.process_index),
        )
        loader = self.accelerator.prepare(loader)
        # The sampler already gives this process its own share; `accelerate` wraps it in a `BatchSamplerShard` that
        # would share it out again (dropping or repeating batches): make that wrapper pass everything through.
        shard = getattr(loader, "batch_sampler", None)
        if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
            shard.num_processes, shard.process_index = 1, 0
        return loader

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = self._create_scheduler(num_training_steps, optimizer)
        # Callbacks get the optimizer and scheduler the handler was built with (None unless passed to the Trainer):
        # hand over the ones in use, so that `NonFiniteGuard` can hold the schedule on a skipped step.
        self.callback_handler.optimizer, self.callback_handler.lr_scheduler = self.optimizer, scheduler
        return scheduler

    def _create_scheduler(self, num_training_steps: int, optimizer=None):
        schedule = getattr(self.args, "lr_schedule", "trainer")
        if schedule == "trainer" or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        optimizer = optimizer or self.optimizer
        warmup_steps = max(1, self.args.get_warmup_steps(num_training_steps))
        if schedule == "inverse_sqrt":
            self.lr_scheduler = inverse_sqrt_scheduler(optimizer, warmup_steps, self.args.warmup_init_lr)
        else:
            self.lr_scheduler = noam_scheduler(optimizer, self.model.config.d_model, warmup_steps)
        return self.lr_scheduler


ARGUMENT_CLASSES = (ModelArguments, DataArguments, EvalExportArguments, DeepNMTTrainingArguments)
CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


def multi_process_launch_without_gpu() -> bool:
    """True under `torchrun`/`accelerate launch` with several processes on a machine with no CUDA device.

    There `Seq2SeqTrainingArguments` must get `use_cpu=True`, or transformers runs every process as an independent,
    non-distributed rank 0 (each training its own copy and each writing the output).
    """
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def parse_arguments(argv: list[str] | None = None, classes: tuple = ARGUMENT_CLASSES) -> tuple[Any, ...]:
    """`CONFIG.json|yaml [--field value ...]`: the file gives values, the command line overrides them.

    Unknown keys in the file are an error naming them (a misspelt field must not be ignored). `use_cpu` defaults to
    true for a multi-process launch on a machine without a GPU (see `multi_process_launch_without_gpu`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(classes)
    cpu_default = {"use_cpu": True} if multi_process_launch_without_gpu() else {}
    parser.set_defaults(**cpu_default)
    if argv and argv[0].endswith(CONFIG_SUFFIXES):
        path = Path(argv.pop(0))
        if not path.is_file():
            raise FileNotFoundError(f"Config file not found: {path}")
        text = path.read_text(encoding="utf-8")
        try:
            values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as error:
            raise ValueError(f"{path}: not valid {path.suffix[1:].upper()}: {error}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of argument names to values, got {type(values).__name__}.")
        known = {f.name for cls in classes for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown}; see `hf-deep-nmt train --help` for valid ones.")
        check_recipe_values(values, classes, str(path))
        if not argv:
            return parser.parse_dict({**cpu_default, **values})
        # Values from the file become defaults of the command line parser, so flags given after it win.
        parser.set_defaults(**{key: value for key, value in values.items() if key != "model_overrides"})
        outputs = parser.parse_args_into_dataclasses(args=argv)
        if "model_overrides" in values:
            outputs[0].model_overrides = {**values["model_overrides"], **outputs[0].model_overrides}
        return outputs
    return parser.parse_args_into_dataclasses(args=argv)


def check_explicit_run(argv: list[str] | None, command: str = "train") -> None:
    """`ValueError` unless the command line names a model (`model_type` or `model_name_or_path`) and an `output_dir`,
    in a config file or as flags: without them the defaults would start a full-size job into ./trainer_output."""
    argv = list(sys.argv[1:] if argv is None else argv)
    given = {item[2:].split("=")[0] for item in argv if item.startswith("--")}
    if argv and argv[0].endswith(CONFIG_SUFFIXES):
        path = Path(argv[0])
        values = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        given |= set(values or {})
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


def corpus_files(data_args: DataArguments) -> list[str]:
    return [path for path in (data_args.train_file, data_args.validation_file) if path]


def check_tokenizer_vocabulary(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> None:
    """A saved model with a separately given tokenizer must have exactly its vocabulary: a smaller tokenizer (another
    run's) never produces the model's other ids, and its ids mean other pieces."""
    if not (model_args.model_name_or_path and model_args.tokenizer_name_or_path):
        return
    config = AutoConfig.from_pretrained(model_args.model_name_or_path)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) != vocab:
        raise ValueError(
            f"The tokenizer {model_args.tokenizer_name_or_path!r} has {len(tokenizer)} tokens but the model "
            f"{model_args.model_name_or_path!r} has a vocabulary of {vocab}: it is another model's tokenizer. Leave "
            "`tokenizer_name_or_path` unset to use the one saved with the model."
        )


def build_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> DeepNMTForConditionalGeneration:
    """A fresh model from a named preset plus overrides, sized to the tokenizer; or a saved model."""
    if model_args.model_name_or_path:
        check_local_path(model_args.model_name_or_path, "`model_name_or_path`")
        if model_args.model_overrides:
            raise ValueError(
                f"`model_overrides` ({sorted(model_args.model_overrides)}) apply to a fresh `model_type` preset, not "
                f"to the saved model {model_args.model_name_or_path!r}; remove one of the two."
            )
        return AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)
    config = build_config(model_args, tokenizer)
    return MODEL_CLASSES[type(config)](config)


def build_config(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase | None = None):
    """The preset's config with the overrides, sized to `tokenizer`; without one, to a joint tokenizer of
    `tokenizer_vocab_size` as `train_joint_tokenizer` makes it (`<s>`=0, `<pad>`=1, `</s>`=2)."""
    if model_args.model_type not in PRESETS:
        raise ValueError(f"`model_type` must be one of {tuple(PRESETS)}, got {model_args.model_type!r}.")
    config_class = PRESETS[model_args.model_type]
    check_config_overrides(config_class, model_args.model_overrides)
    if tokenizer is None:
        settings = {"vocab_size": model_args.tokenizer_vocab_size, "pad_token_id": 1, "bos_token_id": 0}
        settings.update(eos_token_id=2, decoder_start_token_id=0)
    else:
        settings = {
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "decoder_start_token_id": tokenizer.bos_token_id,
        }
    for key, value in model_args.model_overrides.items():
        if key in settings and settings[key] != value:
            raise ValueError(f"`model_overrides.{key}={value!r}` disagrees with the tokenizer ({settings[key]!r}).")
    return config_class(**{**model_args.model_overrides, **settings})


@dataclass
class Prepared:
    """Everything a training run needs besides the model: raw text, tokenizer, tokenized splits, references."""

    raw: Any
    tokenizer: PreTrainedTokenizerBase
    train_dataset: Any
    eval_dataset: Any
    references: list[str]


def check_before_work(
    data_args: DataArguments, export_args: EvalExportArguments, training_args: Seq2SeqTrainingArguments
) -> None:
    """Everything that would otherwise fail only after training: settings (`check_run_settings`), folders
    (`check_run_folders`, the export folder), checkpoint averaging without checkpoints. Fills in the bundled sample
    corpus when no data is named."""
    check_run_settings(data_args, export_args, training_args)
    if not data_args.train_file and not data_args.dataset_name:
        data_args.train_file = str(sample_corpus_dir() / "train.tsv")
        data_args.validation_file = data_args.validation_file or str(sample_corpus_dir() / "valid.tsv")
    protected = check_run_folders(training_args.output_dir, export_args.export_dir, corpus_files(data_args))
    if export_args.export_dir:
        check_export_folder(export_args.export_dir, export_args.overwrite_export, protected=protected)
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


def prepare(
    model_args: ModelArguments,
    data_args: DataArguments,
    export_args: EvalExportArguments,
    training_args: Seq2SeqTrainingArguments,
    tokenizer_dir: Path | None = None,
) -> Prepared:
    """Check the settings and folders (`check_before_work`), load the corpus, get a tokenizer (saved model's, given,
    reloaded from `tokenizer_dir`, or newly trained and saved there), tokenize both splits."""
    check_before_work(data_args, export_args, training_args)
    set_seed(training_args.seed)
    raw = load_parallel_dataset(
        train_file=data_args.train_file,
        validation_file=data_args.validation_file,
        dataset_name=data_args.dataset_name,
        dataset_config=data_args.dataset_config,
        source_lang=data_args.source_lang,
        target_lang=data_args.target_lang,
        validation_split=data_args.dataset_validation_split,
    )
    if "validation" in raw and data_args.max_eval_samples:
        raw["validation"] = raw["validation"].select(range(min(data_args.max_eval_samples, len(raw["validation"]))))

    saved_tokenizer = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if saved_tokenizer:
        check_local_path(saved_tokenizer, "Tokenizer folder")
        tokenizer = AutoTokenizer.from_pretrained(saved_tokenizer)
        check_tokenizer_vocabulary(model_args, tokenizer)
    elif tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = train_joint_tokenizer(
            zip(raw["train"][SOURCE], raw["train"][TARGET]),
            vocab_size=model_args.tokenizer_vocab_size,
            model=model_args.tokenizer_model,
        )
        if tokenizer_dir is not None:
            tokenizer.save_pretrained(tokenizer_dir)

    train_dataset = tokenize_parallel(
        raw["train"], tokenizer, data_args.max_source_length, data_args.max_target_length
    )
    if len(raw["train"]) == 0:
        raise ValueError("The training data holds no sentence pairs; give a corpus with at least one.")
    if len(train_dataset) == 0:
        raise ValueError(
            f"No training pair is within `max_source_length={data_args.max_source_length}` / "
            f"`max_target_length={data_args.max_target_length}` tokens ({len(raw['train'])} pairs read); raise them."
        )
    references = raw["validation"][TARGET] if "validation" in raw else []
    eval_dataset = None
    if "validation" in raw:
        # Evaluation keeps every pair (truncating, never dropping), so BLEU is computed on the whole set.
        eval_dataset = tokenize_parallel(
            raw["validation"], tokenizer, data_args.max_source_length, data_args.max_target_length, drop_long=False
        )
    return Prepared(raw, tokenizer, train_dataset, eval_dataset, references)


def configure_generation(model, tokenizer, data_args: DataArguments, export_args: EvalExportArguments) -> None:
    """Beam size, length penalty and the recipe's output cap at the longest allowed source; the tokenizer must fit the
    model (`check_tokenizer_matches`).

    The cap is `max_length`, the start token + `max_length_a * max_source_length + max_length_b` tokens + `</s>` (what
    `translate` allows the longest source): not `max_new_tokens`, beside which `Seq2SeqTrainer` evaluation would fill
    in transformers' default `max_length` of 20, and which would override a caller's `generate(max_length=...)`."""
    check_tokenizer_matches(model, tokenizer)
    model.generation_config.num_beams = export_args.num_beams
    # generate() applies the fairseq form; a GNMT-form alpha is kept as the recipe's value (the model card says which)
    model.generation_config.length_penalty = export_args.length_penalty
    cap = int(export_args.max_length_a * data_args.max_source_length + export_args.max_length_b)
    model.generation_config.max_length = cap + 2
    model.generation_config.max_new_tokens = None
    logger.warning(
        f"Model {type(model).__name__}: {model.num_parameters() / 1e6:.2f}M parameters, "
        f"{model.config.encoder_layers} encoder / {model.config.decoder_layers} decoder layers."
    )


def make_trainer(
    model, training_args: Seq2SeqTrainingArguments, prepared: Prepared, trainer_class=DeepNMTTrainer, **kwargs
) -> Seq2SeqTrainer:
    tokenizer = prepared.tokenizer
    return trainer_class(
        model=model,
        args=training_args,
        train_dataset=prepared.train_dataset,
        eval_dataset=prepared.eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        compute_metrics=make_compute_metrics(tokenizer, prepared.references) if prepared.eval_dataset else None,
        callbacks=kwargs.pop("callbacks", None),
        **kwargs,
    )


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, evaluate (sacreBLEU), translate a few sentences and export a Hub-ready folder. Returns the summary."""
    arguments = parse_arguments(argv)
    check_explicit_run(argv, "train")
    with RunFolder(arguments[3].output_dir, "train", run_recipe(*arguments)) as folder:
        summary = _run(*arguments, folder)
        folder.finish()
    return summary


def _run(model_args, data_args, export_args, training_args, folder: RunFolder) -> dict[str, Any]:
    check_before_work(data_args, export_args, training_args)
    resume = folder.start(training_args.resume_from_checkpoint, training_args.overwrite_output_dir)
    prepared = prepare(model_args, data_args, export_args, training_args)
    model = build_model(model_args, prepared.tokenizer)
    configure_generation(model, prepared.tokenizer, data_args, export_args)
    trainer = make_trainer(model, training_args, prepared)
    started = time.perf_counter()
    checkpoint = resolve_resume_checkpoint(resume, training_args.output_dir)
    if checkpoint:
        logger.warning(f"Resuming from {checkpoint}.")
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    summary: dict[str, Any] = {
        "train_loss": round(train_result.training_loss, 4),
        "train_seconds": round(time.perf_counter() - started, 1),
        "train_steps": train_result.global_step,
        "nonfinite_steps_skipped": nonfinite_steps_skipped(trainer),
    }
    if export_args.average_checkpoints:
        trainer.accelerator.wait_for_everyone()  # every checkpoint written before it is read
        if trainer.is_world_process_zero():
            checkpoints = last_checkpoints(training_args.output_dir, export_args.average_checkpoints)
            averaged = average_checkpoints(checkpoints)
            trainer.model.load_state_dict(averaged.state_dict())
            summary["averaged_checkpoints"] = [path.name for path in checkpoints]
    return evaluate_and_export(trainer, prepared, data_args, export_args, training_args, summary)


def evaluate_and_export(
    trainer: Seq2SeqTrainer,
    prepared: Prepared,
    data_args: DataArguments,
    export_args: EvalExportArguments,
    training_args: Seq2SeqTrainingArguments,
    summary: dict[str, Any],
) -> dict[str, Any]:
    """sacreBLEU/chrF on the validation split, a few translations, the Hub-ready folder and `results.json`."""
    raw, tokenizer, references, eval_dataset = (
        prepared.raw,
        prepared.tokenizer,
        prepared.references,
        prepared.eval_dataset,
    )
    # Final evaluation, translations and export happen once, on the main process.
    is_main_process = trainer.is_world_process_zero()
    if eval_dataset is not None and is_main_process:
        sources = raw["validation"][SOURCE]
        evaluation_started = time.perf_counter()
        hypotheses = translate(trainer.model, tokenizer, sources, **evaluation_options(export_args, training_args))
        scores = corpus_scores(hypotheses, references, export_args.tokenized_bleu_options())
        summary.update(scores)
        summary["eval_seconds"] = round(time.perf_counter() - evaluation_started, 1)
        summary["eval_pairs"] = len(references)
        summary["examples"] = [
            {"source": s, "translation": h, "reference": r}
            for s, h, r in list(zip(sources, hypotheses, references))[: export_args.translate_examples]
        ]
        logger.warning(f"sacreBLEU {scores['bleu']} chrF {scores['chrf']} ({scores['bleu_signature']})")
        for example in summary["examples"]:
            logger.warning(f"SRC {example['source']}\nHYP {example['translation']}\nREF {example['reference']}")

    if is_main_process:
        if export_args.plot_curves:
            curves = plot_training_curves(trainer.state.log_history, Path(training_args.output_dir))
            if curves is not None:
                summary["training_curves"] = str(curves)
        if export_args.export_dir:
            export_hub_folder(
                trainer.model,
                tokenizer,
                export_args.export_dir,
                overwrite=export_args.overwrite_export,
                repo_id=export_args.repo_id,
                languages=(data_args.source_lang, data_args.target_lang),
                metrics=summary,
                dataset_name=data_args.dataset_name or _corpus_name(data_args.train_file),
                training_data=_describe_data(data_args, len(raw["train"]), summary),
                examples=summary.get("examples"),
                length_penalty_form=export_args.length_penalty_form,
                length_rule=(export_args.max_length_a, export_args.max_length_b),
                protected=check_run_folders(training_args.output_dir, export_args.export_dir, corpus_files(data_args)),
            )
            summary["export_dir"] = export_args.export_dir
        output_dir = Path(training_args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "results.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return summary


def _corpus_name(train_file: str) -> str:
    path = Path(train_file)
    return "bible-es-en-sample" if path.parent == sample_corpus_dir() else path.parent.name or path.stem


def _describe_data(data_args: DataArguments, num_pairs: int, summary: dict[str, Any]) -> str:
    corpus = data_args.dataset_name or data_args.train_file
    steps = summary.get("train_steps")
    return (
        f"{num_pairs} sentence pairs ({data_args.source_lang}-{data_args.target_lang}) from `{corpus}`, "
        f"{steps} optimizer steps in {summary.get('train_seconds')} s."
        + (
            " The bundled sample is public-domain Bible text."
            if _corpus_name(str(corpus)) == "bible-es-en-sample"
            else ""
        )
    )
