"""`hf-deep-nmt train`: check everything first, then train, evaluate, translate a few sentences and export.

`run` reads top to bottom: the recipe is parsed and checked (`hf_deep_nmt.arguments`), the run folder locked and
recorded (`hf_deep_nmt.run_folder`), then `_run` does the work: `check_before_work` (settings and folders, nothing
loaded) -> `prepare` (corpus, tokenizer, tokenized splits) -> `build_model` -> `configure_generation` ->
`make_trainer` -> train, resuming where a killed run stopped -> `average_last_checkpoints` -> `evaluate_and_export`
(sacreBLEU/chrF, examples, curves, the Hub-ready folder, `results.json`). `hf-deep-nmt train-staged`
(`hf_deep_nmt.staged`) runs the same steps around its stages.

What the libraries do is left to them: argument parsing (`HfArgumentParser`), the training loop, mixed precision and
multi-process training (`Seq2SeqTrainer` / `accelerate`), padding (`DataCollatorForSeq2Seq`), label smoothing
(`label_smoothing_factor`), scoring (`sacrebleu`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerBase,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)
from transformers.utils import logging

from hf_deep_nmt import MODEL_CLASSES
from hf_deep_nmt.arguments import (
    PRESETS,
    DataArguments,
    DeepNMTTrainingArguments,
    EvalExportArguments,
    ModelArguments,
    check_arguments,
    check_explicit_run,
    check_model_arguments,
    evaluation_options,
    parse_arguments,
)
from hf_deep_nmt.averaging import average_checkpoints, last_checkpoints
from hf_deep_nmt.callbacks import nonfinite_steps_skipped
from hf_deep_nmt.checkpoints import resolve_resume_checkpoint
from hf_deep_nmt.curves import CURVES_FILE, plot_training_curves
from hf_deep_nmt.data import SOURCE, TARGET, parallel_files, sample_corpus_dir
from hf_deep_nmt.decoding import DecodingOptions
from hf_deep_nmt.evaluation import check_source_lengths, corpus_scores, make_compute_metrics
from hf_deep_nmt.hub import check_export_folder, export_hub_folder
from hf_deep_nmt.input_checks import (
    check_local_path,
    check_run_folders,
    check_saved_json_files,
    check_saved_model_folder,
    check_tokenizer_matches,
    check_training_size,
)
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTForConditionalGeneration
from hf_deep_nmt.preemption import raise_if_preempted
from hf_deep_nmt.prepared_data import ID_COLUMNS, PreparedData, prepare_data, tokenizer_digest
from hf_deep_nmt.run_folder import RunFolder, claim_outputs, run_recipe, run_shape
from hf_deep_nmt.tokenizer import train_joint_tokenizer
from hf_deep_nmt.trainer import DeepNMTTrainer
from hf_deep_nmt.translate import MAX_SOURCE_TOKENS, translate

logger = logging.get_logger(__name__)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, evaluate (sacreBLEU), translate a few sentences and export a Hub-ready folder. Returns the summary."""
    arguments = parse_arguments(argv)
    check_explicit_run(argv, "train")
    shape = run_shape(arguments[3])
    with RunFolder(arguments[3].output_dir, "train", run_recipe(*arguments), shape) as folder:
        summary = _run(*arguments, folder)
        folder.finish()
    return summary


def _run(
    model_args: ModelArguments,
    data_args: DataArguments,
    export_args: EvalExportArguments,
    training_args: DeepNMTTrainingArguments,
    folder: RunFolder,
) -> dict[str, Any]:
    check_before_work(model_args, data_args, export_args, training_args)
    resume = folder.start(
        training_args.resume_from_checkpoint, training_args.overwrite_output_dir, recipe_inputs(model_args, data_args)
    )
    prepared = prepare(model_args, data_args, training_args)
    model = build_model(model_args, prepared.tokenizer)
    configure_generation(model, prepared.tokenizer, data_args, export_args)
    trainer = make_trainer(model, training_args, prepared)
    started = time.perf_counter()
    checkpoint = resolve_resume_checkpoint(resume, training_args.output_dir)
    if checkpoint:
        logger.warning(f"Resuming from {checkpoint}.")
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    raise_if_preempted(trainer)  # stopped by SIGTERM / SIGUSR1 after a checkpoint: nothing to evaluate yet
    summary: dict[str, Any] = {
        "train_loss": round(train_result.training_loss, 4),
        "train_seconds": round(time.perf_counter() - started, 1),
        "train_steps": train_result.global_step,
        "nonfinite_steps_skipped": nonfinite_steps_skipped(trainer),
    }
    average_last_checkpoints(trainer, training_args.output_dir, export_args.average_checkpoints, summary)
    return evaluate_and_export(trainer, prepared, data_args, export_args, training_args, summary)


# ---- the steps, in the order a run takes them -----------------------------------------------------------------------


def recipe_inputs(model_args: ModelArguments, data_args: DataArguments) -> list[str]:
    """The local paths a recipe reads (tokenizer, saved model, corpus files): `overwrite_output_dir` never removes
    them, even where a run of ours wrote them."""
    named = [model_args.saved_tokenizer(), model_args.model_name_or_path, *data_args.corpus_files()]
    return [path for path in named if path]


def check_before_work(
    model_args: ModelArguments,
    data_args: DataArguments,
    export_args: EvalExportArguments,
    training_args: DeepNMTTrainingArguments,
) -> None:
    """Everything that would otherwise fail only after data and tokenizer are prepared or after training: the preset
    and its overrides (`check_model_arguments`), or the saved model to start from and the recipe's agreement with it
    (`check_saved_model`, which reads its config), the settings (`check_arguments`), then the folders
    (`check_run_folders`, the export folder), and that the model and a training step fit the memory
    (`check_training_size`). Loads no weights and no data, and changes nothing."""
    check_model_arguments(model_args)
    config = check_saved_model(model_args) if model_args.model_name_or_path else _sizes_of_preset(model_args)
    check_arguments(data_args, export_args, training_args)
    check_checkpoints_to_average(export_args, training_args)
    for corpus in data_args.corpus_files():  # each file there and readable; its text is checked when it is read
        parallel_files(corpus, data_args.source_lang, data_args.target_lang)
    if export_args.repo_id is not None:
        check_repo_id(export_args.repo_id)
    protected = check_run_folders(training_args.output_dir, export_args.export_dir, data_args.corpus_files())
    if export_args.export_dir:
        check_export_folder(export_args.export_dir, export_args.overwrite_export, protected=protected)
    if hasattr(config, "encoder_ffn_dim"):  # the model and a training step must fit the machine
        from torch.cuda import is_available as cuda_available

        lengths = max(data_args.max_source_length, data_args.max_target_length)
        tokens = training_args.max_tokens or training_args.per_device_train_batch_size * lengths
        device = "cpu" if training_args.use_cpu or not cuda_available() else "cuda"
        check_training_size(config, tokens, device)


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


@dataclass
class Prepared:
    """Everything a training run needs besides the model: the validation text (`raw["validation"]`), tokenizer,
    tokenized splits (memory-mapped from the prepared-data folder), references, and that folder (`data`)."""

    raw: Any
    tokenizer: PreTrainedTokenizerBase
    train_dataset: Any
    eval_dataset: Any
    references: list[str]
    data: PreparedData | None = None

    @property
    def train_pairs(self) -> int:
        """Training pairs read (before the length filter)."""
        return self.data.record["counts"]["train"]["pairs_read"] if self.data else len(self.raw["train"])


def prepare(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: DeepNMTTrainingArguments,
    tokenizer_dir: Path | None = None,
) -> Prepared:
    """The prepared data of this recipe (`hf_deep_nmt.prepared_data.prepare_data`: built once, then reused by every
    run and rank): tokenizer, tokenized splits, validation text. Under `torchrun` / `accelerate launch` the main
    process prepares while the others wait, then every rank memory-maps the same folder. Callers check the settings
    first (`check_before_work`)."""
    set_seed(training_args.seed)
    given = given_tokenizer(model_args, tokenizer_dir)
    with training_args.main_process_first(desc="preparing the data"):
        data = None
        if given is not None and not model_args.saved_tokenizer():  # the tokenizer an earlier run of ours saved
            data = prepare_data(model_args, data_args, training_args.seed, build=False)
            if data is not None and tokenizer_digest(data.tokenizer) != tokenizer_digest(given):
                data = None  # not the tokenizer these settings train now: the data is prepared with it
        data = data or prepare_data(model_args, data_args, training_args.seed, given)
    tokenizer = given or data.tokenizer
    if given is None and tokenizer_dir is not None and training_args.process_index == 0:
        claim_outputs(tokenizer_dir.parent, tokenizer_dir)
        tokenizer.save_pretrained(tokenizer_dir)
    raw = datasets.DatasetDict()
    eval_dataset, references = None, []
    if data.validation is not None:  # the final evaluation translates each source in full: checked before step 1
        raw["validation"] = data.validation.select_columns([SOURCE, TARGET])
        validation_file = data_args.corpus_paths()[1]
        where = f"`validation_file` {validation_file!r}" if validation_file else f"{data_args.dataset_name!r}"
        if not validation_file:
            where += f" split {data_args.dataset_validation_split!r}, counting rows as lines from 1,"
        check_source_lengths(raw["validation"][SOURCE], tokenizer, MAX_SOURCE_TOKENS, where)
        references = raw["validation"][TARGET]
        # Evaluation keeps every pair (truncating, never dropping), so BLEU is computed on the whole set.
        eval_dataset = data.validation.select_columns(list(ID_COLUMNS))
    return Prepared(raw, tokenizer, data.train, eval_dataset, references, data)


def run_prepare(argv: list[str] | None = None) -> dict[str, Any]:
    """`hf-deep-nmt prepare RECIPE [--field value ...]`: build (or find) the recipe's prepared data ahead of training,
    e.g. on a CPU node before the GPUs are booked; `train` / `train-staged` of the same data and settings then reuse
    it. The recipe is read as `train` (or `train-staged`) reads it; only its data and tokenizer settings are used and
    no output folder is touched. Returns `PreparedData.summary()`."""
    from hf_deep_nmt.arguments import ARGUMENT_CLASSES, StageArguments

    model_args, data_args, export_args, training_args, _ = parse_arguments(argv, (*ARGUMENT_CLASSES, StageArguments))
    check_model_arguments(model_args)
    if model_args.model_name_or_path:
        check_saved_model(model_args)
    check_arguments(data_args, export_args, training_args)
    for corpus in data_args.corpus_files():
        parallel_files(corpus, data_args.source_lang, data_args.target_lang)
    given = given_tokenizer(model_args)
    with training_args.main_process_first(desc="preparing the data"):
        data = prepare_data(model_args, data_args, training_args.seed, given)
    return data.summary()


def given_tokenizer(model_args: ModelArguments, tokenizer_dir: Path | None = None) -> PreTrainedTokenizerBase | None:
    """The saved model's or the given tokenizer; else the one saved in `tokenizer_dir` by an earlier run; else None
    (a joint tokenizer is trained with the prepared data)."""
    saved_tokenizer = model_args.saved_tokenizer()
    if saved_tokenizer:
        check_local_path(saved_tokenizer, "Tokenizer folder")
        check_saved_json_files(saved_tokenizer, "Tokenizer folder")
        tokenizer = AutoTokenizer.from_pretrained(saved_tokenizer)
        check_tokenizer_vocabulary(model_args, tokenizer)
        return tokenizer
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        check_saved_json_files(tokenizer_dir, "The tokenizer an earlier run trained,")
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer_dir is not None and os.path.lexists(tokenizer_dir):
        if not tokenizer_dir.is_dir() or any(tokenizer_dir.iterdir()):
            raise FileExistsError(
                f"{str(tokenizer_dir)!r}, where this run saves the tokenizer it trains, already holds files but no "
                "tokenizer.json; move them away, or name a tokenizer with `tokenizer_name_or_path`."
            )
    return None


def load_tokenizer(model_args: ModelArguments, raw, tokenizer_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """`given_tokenizer`, else a joint tokenizer trained on the training split of `raw` (and saved in
    `tokenizer_dir`)."""
    tokenizer = given_tokenizer(model_args, tokenizer_dir)
    if tokenizer is not None:
        return tokenizer
    tokenizer = train_joint_tokenizer(
        zip(raw["train"][SOURCE], raw["train"][TARGET]),
        vocab_size=model_args.tokenizer_vocab_size,
        model=model_args.tokenizer_model,
    )
    if tokenizer_dir is not None:
        claim_outputs(tokenizer_dir.parent, tokenizer_dir)
        tokenizer.save_pretrained(tokenizer_dir)
    return tokenizer


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


def check_saved_model(model_args: ModelArguments):
    """The config of the saved model a run starts from (`model_name_or_path`), after checking that the folder holds a
    config and, unless `tokenizer_name_or_path` names another, a tokenizer; that it is a model of this package; and
    that the recipe's `model_type` and `model_overrides`, where given, are the saved model's (the model is loaded as
    saved: a recipe value that differs would be ignored). Each failure names the value. A Hub id's config is
    downloaded."""
    path = model_args.model_name_or_path
    what = "`model_name_or_path`"
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


def build_model(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase) -> DeepNMTForConditionalGeneration:
    """A fresh model from a named preset plus overrides, sized to the tokenizer; or the saved model of
    `model_name_or_path` as saved (`check_saved_model`)."""
    if model_args.model_name_or_path:
        check_local_path(model_args.model_name_or_path, "`model_name_or_path`")
        config = AutoConfig.from_pretrained(model_args.model_name_or_path)
        if type(config) in MODEL_CLASSES:  # anything else: AutoModelForSeq2SeqLM names what it cannot load
            check_recipe_agrees_with_saved_model(model_args, config)
        return AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path)
    config = build_config(model_args, tokenizer)
    return MODEL_CLASSES[type(config)](config)


def build_config(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase | None = None):
    """The preset's config with the overrides, sized to `tokenizer`; without one, to a joint tokenizer of
    `tokenizer_vocab_size` as `train_joint_tokenizer` makes it (`<s>`=0, `<pad>`=1, `</s>`=2)."""
    check_model_arguments(model_args)
    config_class = PRESETS[model_args.model_type]
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


def configure_generation(model, tokenizer, data_args: DataArguments, export_args: EvalExportArguments) -> None:
    """Beam size, length penalty and the recipe's output cap at the longest allowed source; the tokenizer must fit the
    model (`check_tokenizer_matches`).

    The cap is `max_length`, the start token + `max_length_a * max_source_length + max_length_b` tokens + `</s>` (what
    `translate` allows the longest source): not `max_new_tokens`, beside which `Seq2SeqTrainer` evaluation would fill
    in transformers' default `max_length` of 20, and which would override a caller's `generate(max_length=...)`."""
    check_tokenizer_matches(model, tokenizer)
    settings = DecodingOptions.from_recipe(export_args).generation_settings(data_args.max_source_length)
    for name, value in settings.items():  # a GNMT-form alpha is kept as the recipe's value (the card says which)
        setattr(model.generation_config, name, value)
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


def average_last_checkpoints(trainer, checkpoint_dir: str | Path, count: int, summary: dict[str, Any]) -> None:
    """The recipe's `average_checkpoints`: with `count` > 0, the trainer's model takes the mean of the newest `count`
    checkpoints in `checkpoint_dir` (the run's output folder for `train`, the last stage's folder for `train-staged`),
    so the final evaluation and the export see the average; `summary["averaged_checkpoints"]` names them. With 0,
    nothing changes."""
    if not count:
        return
    trainer.accelerator.wait_for_everyone()  # every checkpoint written before it is read
    if trainer.is_world_process_zero():
        checkpoints = last_checkpoints(checkpoint_dir, count)
        averaged = average_checkpoints(checkpoints)
        trainer.model.load_state_dict(averaged.state_dict())
        summary["averaged_checkpoints"] = [path.name for path in checkpoints]


def evaluate_and_export(
    trainer: Seq2SeqTrainer,
    prepared: Prepared,
    data_args: DataArguments,
    export_args: EvalExportArguments,
    training_args: DeepNMTTrainingArguments,
    summary: dict[str, Any],
) -> dict[str, Any]:
    """sacreBLEU/chrF on the validation split, a few translations, the curves, the Hub-ready folder and
    `results.json`, all on the main process."""
    if not trainer.is_world_process_zero():
        return summary
    if prepared.eval_dataset is not None:
        summary.update(score_validation(trainer.model, prepared, export_args, training_args))
    output_dir = Path(training_args.output_dir)
    if export_args.plot_curves:
        claim_outputs(output_dir, output_dir / CURVES_FILE)
        curves = plot_training_curves(trainer.state.log_history, Path(training_args.output_dir))
        if curves is not None:
            summary["training_curves"] = str(curves)
    if export_args.export_dir:
        train_file = data_args.corpus_paths()[0]
        export_hub_folder(
            trainer.model,
            prepared.tokenizer,
            export_args.export_dir,
            overwrite=export_args.overwrite_export,
            repo_id=export_args.repo_id,
            languages=(data_args.source_lang, data_args.target_lang),
            metrics=summary,
            dataset_name=data_args.dataset_name or _corpus_name(train_file),
            training_data=_describe_data(data_args, prepared.train_pairs, summary),
            examples=summary.get("examples"),
            length_penalty_form=export_args.length_penalty_form,
            length_rule=(export_args.max_length_a, export_args.max_length_b),
            protected=check_run_folders(training_args.output_dir, export_args.export_dir, data_args.corpus_files()),
        )
        summary["export_dir"] = export_args.export_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    claim_outputs(output_dir, output_dir / "results.json")
    # written beside and renamed into place: a run stopped meanwhile (a signal) leaves no half-written results
    partial = output_dir / "results.json.partial"
    partial.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    partial.replace(output_dir / "results.json")
    return summary


def score_validation(
    model, prepared: Prepared, export_args: EvalExportArguments, training_args: DeepNMTTrainingArguments
) -> dict[str, Any]:
    """Translate the validation split as the recipe decodes (`evaluation_options`) and score it; the first
    `translate_examples` translations are kept and logged."""
    sources, references = prepared.raw["validation"][SOURCE], prepared.references
    started = time.perf_counter()
    options = evaluation_options(export_args, training_args)
    hypotheses = translate(model, prepared.tokenizer, sources, options)
    scores = corpus_scores(hypotheses, references, export_args.tokenized_bleu_options())
    result = {**scores, "eval_seconds": round(time.perf_counter() - started, 1), "eval_pairs": len(references)}
    result["examples"] = [
        {"source": s, "translation": h, "reference": r}
        for s, h, r in list(zip(sources, hypotheses, references))[: export_args.translate_examples]
    ]
    logger.warning(f"sacreBLEU {scores['bleu']} chrF {scores['chrf']} ({scores['bleu_signature']})")
    for example in result["examples"]:
        logger.warning(f"SRC {example['source']}\nHYP {example['translation']}\nREF {example['reference']}")
    return result


def _corpus_name(train_file: str) -> str:
    path = Path(train_file)
    return "bible-es-en-sample" if path.parent == sample_corpus_dir() else path.parent.name or path.stem


def _describe_data(data_args: DataArguments, num_pairs: int, summary: dict[str, Any]) -> str:
    corpus = data_args.dataset_name or data_args.corpus_paths()[0]
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


# `benchmarks/` and earlier code import the trainer and its arguments from here.
__all__ = [
    "DeepNMTTrainer",
    "DeepNMTTrainingArguments",
    "Prepared",
    "build_config",
    "build_model",
    "check_before_work",
    "configure_generation",
    "evaluate_and_export",
    "given_tokenizer",
    "load_tokenizer",
    "make_trainer",
    "prepare",
    "run",
    "score_validation",
]
