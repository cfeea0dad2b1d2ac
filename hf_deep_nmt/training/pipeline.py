"""`hf-deep-nmt train`: check everything first, then train, evaluate, translate a few sentences and export.

`run` reads top to bottom: the recipe is parsed (`hf_deep_nmt.training.arguments`), the run folder locked, the recipe
checked once into a `RunPlan` (`hf_deep_nmt.training.plan.plan_run`: settings, saved model, corpus files, folders,
memory; nothing loaded), then `_run(plan, folder)` does the work with the plan's resolved values, checking nothing
again: the run folder recorded (`hf_deep_nmt.training.run_folder`) -> `prepare` (corpus, tokenizer, tokenized splits)
-> `build_model`
-> `configure_generation` -> `make_trainer` -> train, resuming where a killed run stopped (one stopped after its last
step is not trained again: `continue_finished_training`) -> `average_last_checkpoints` -> `evaluate_and_export`
(sacreBLEU/chrF, examples, curves, the Hub-ready folder, `results.json`, the run marked finished). `hf-deep-nmt
train-staged` (`hf_deep_nmt.training.staged`) runs the same steps around its stages.

What the libraries do is left to them: argument parsing (`HfArgumentParser`), the training loop, mixed precision and
multi-process training (`Seq2SeqTrainer` / `accelerate`), padding (`DataCollatorForSeq2Seq`), label smoothing
(`label_smoothing_factor`), scoring (`sacrebleu`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from transformers import (
    AutoModelForSeq2SeqLM,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerBase,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerState,
)
from transformers.utils import logging

from hf_deep_nmt import MODEL_CLASSES
from hf_deep_nmt.data import preparation
from hf_deep_nmt.data.corpus import SOURCE, sample_corpus_dir
from hf_deep_nmt.data.preparation import (  # noqa: F401  (given_tokenizer, load_tokenizer: their earlier home)
    Prepared,
    check_tokenizer_vocabulary,
    given_tokenizer,
    load_tokenizer,
)
from hf_deep_nmt.fingerprints import check_tokenizer_matches
from hf_deep_nmt.folders import atomic_file
from hf_deep_nmt.hub import export_hub_folder
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTForConditionalGeneration
from hf_deep_nmt.serving.options import DecodingOptions
from hf_deep_nmt.serving.translate import translate
from hf_deep_nmt.training.arguments import (
    PRESETS,
    DataArguments,
    DeepNMTTrainingArguments,
    EvalExportArguments,
    ModelArguments,
    check_explicit_run,
    parse_arguments,
)
from hf_deep_nmt.training.averaging import average_checkpoints, last_checkpoints
from hf_deep_nmt.training.callbacks import NonFiniteGuard, nonfinite_steps_skipped
from hf_deep_nmt.training.checkpoints import TRAINER_STATE_FILE, resolve_resume_checkpoint, training_finished
from hf_deep_nmt.training.curves import CURVES_FILE, plot_training_curves
from hf_deep_nmt.training.evaluation import corpus_scores, make_compute_metrics
from hf_deep_nmt.training.plan import (  # noqa: F401  (check_saved_model, check_repo_id, ...: their old home)
    RunPlan,
    as_plan,
    check_checkpoints_to_average,
    check_recipe_agrees_with_saved_model,
    check_repo_id,
    check_saved_model,
    plan_run,
    recipe_inputs,
)
from hf_deep_nmt.training.preemption import raise_if_preempted, signals_held
from hf_deep_nmt.training.run_folder import RunFolder
from hf_deep_nmt.training.run_record import claim_outputs, run_recipe, run_shape
from hf_deep_nmt.training.sharded import load_whole_state, whole_model
from hf_deep_nmt.training.trainer import DeepNMTTrainer

logger = logging.get_logger(__name__)


def run(argv: list[str] | None = None) -> dict[str, Any]:
    """Train, evaluate (sacreBLEU), translate a few sentences and export a Hub-ready folder. Returns the summary."""
    given: set[str] = set()
    arguments = parse_arguments(argv, given=given)
    check_explicit_run(argv, "train", given)
    shape = run_shape(arguments[3])
    with RunFolder(arguments[3].output_dir, "train", run_recipe(*arguments), shape) as folder:
        return _run(plan_run(*arguments), folder)


def _run(plan: RunPlan, folder: RunFolder) -> dict[str, Any]:
    training_args = plan.training_args
    resume = folder.start(training_args.resume_from_checkpoint, training_args.overwrite_output_dir, list(plan.inputs))
    prepared = prepare(plan)
    model = build_model(plan, prepared.tokenizer)
    configure_generation(model, prepared.tokenizer, plan)
    trainer = make_trainer(model, training_args, prepared)
    started, cpu_started = time.perf_counter(), time.process_time()
    checkpoint = resolve_resume_checkpoint(resume, training_args.output_dir)
    if checkpoint and training_finished(checkpoint, training_args):
        # stopped after its last step (while saving it, averaging, evaluating or exporting): nothing is trained again
        summary = continue_finished_training(trainer, checkpoint, training_args.output_dir)
    else:
        if checkpoint:
            logger.warning(f"Resuming from {checkpoint}.")
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        summary = {
            "train_loss": round(train_result.training_loss, 4),
            "train_seconds": round(time.perf_counter() - started, 1),
            # this process's CPU time (all its threads): at one thread, a cost that other work on the machine does not
            # inflate as it does the wall time
            "train_cpu_seconds": round(time.process_time() - cpu_started, 1),
            "train_steps": train_result.global_step,
            "nonfinite_steps_skipped": nonfinite_steps_skipped(trainer),
        }
        if trainer.state.global_step >= trainer.state.max_steps:  # kept for a run continued after its last step
            write_results(training_args.output_dir, summary, trainer)
        raise_if_preempted(trainer)  # stopped by SIGTERM / SIGUSR1 after a checkpoint: nothing to evaluate yet
    average_last_checkpoints(trainer, training_args.output_dir, plan.export_args.average_checkpoints, summary)
    return evaluate_and_export(trainer, prepared, plan, summary, finish=folder.finish)


def continue_finished_training(trainer, checkpoint: str | Path, output_dir: str | Path) -> dict[str, Any]:
    """A run stopped after its last optimizer step continues here instead of in `trainer.train()` (which would train
    one step more): the trainer takes the checkpoint's weights and state (`load_finished_training`), and the summary
    is the one its training recorded in `results.json` (a training preempted during its last step recorded none: the
    loss and time are then unknown, `None`)."""
    state = load_finished_training(trainer, checkpoint)
    logger.warning(
        f"{checkpoint} ends this training (step {state.global_step}): continuing with what follows training, "
        "without training again."
    )
    try:
        recorded = json.loads((Path(output_dir) / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        recorded = None
    keys = ("train_loss", "train_seconds", "train_cpu_seconds", "train_steps", "nonfinite_steps_skipped")
    if isinstance(recorded, dict) and recorded.get("train_steps") == state.global_step:
        return {key: recorded.get(key) for key in keys}
    return {
        "train_loss": None,
        "train_seconds": None,
        "train_cpu_seconds": None,
        "train_steps": state.global_step,
        "nonfinite_steps_skipped": skipped_steps_in_state(state),
    }


def load_finished_training(trainer, checkpoint: str | Path):
    """Give `trainer` the weights and Trainer state (log history, step) saved in the checkpoint of a finished training,
    as `trainer.train()` would leave them had it run to that checkpoint. Returns the state."""
    state = TrainerState.load_from_json(str(Path(checkpoint) / TRAINER_STATE_FILE))
    saved = AutoModelForSeq2SeqLM.from_pretrained(checkpoint)
    load_whole_state(trainer.model, saved.state_dict())  # every rank: its shards under FSDP2
    trainer.state = state
    return state


def skipped_steps_in_state(state) -> int:
    """The `NonFiniteGuard` count saved with a Trainer state (0 when it holds none)."""
    stored = (state.stateful_callbacks or {}).get(NonFiniteGuard.__name__)
    attributes = stored.get("attributes") if isinstance(stored, dict) else None
    return int((attributes or {}).get("skipped", 0))


def write_results(output_dir: str | Path, summary: dict[str, Any], trainer=None) -> None:
    """`results.json` in `output_dir` (claimed in the run record first), written beside and renamed into place; main
    process only."""
    if trainer is not None and not trainer.is_world_process_zero():
        return
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    claim_outputs(output_dir, output_dir / "results.json")
    with atomic_file(output_dir / "results.json", encoding="utf-8") as stream:
        stream.write(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")


# ---- the steps, in the order a run takes them -----------------------------------------------------------------------


def check_before_work(
    model_args: ModelArguments,
    data_args: DataArguments,
    export_args: EvalExportArguments,
    training_args: DeepNMTTrainingArguments,
) -> RunPlan:
    """`hf_deep_nmt.training.plan.plan_run` of a `train` recipe: every check, once, before any work; returns the
    plan."""
    return plan_run(model_args, data_args, export_args, training_args)


def prepare(
    model_args: ModelArguments | RunPlan,
    data_args: DataArguments | None = None,
    training_args: DeepNMTTrainingArguments | None = None,
    tokenizer_dir: Path | None = None,
) -> Prepared:
    """The run's prepared data (`hf_deep_nmt.data.preparation.prepare`): tokenizer, training data (the prepared-data
    folder's tokenized splits, built once and reused by every run and rank, or with `streaming: true` a stream read
    while training), validation text and references. Pass the run's `RunPlan` (`prepare(plan)`); the recipe's argument
    dataclasses in its place are checked into one first (`as_plan`)."""
    plan = as_plan(*(given for given in (model_args, data_args, training_args) if given is not None))
    return preparation.prepare(plan, tokenizer_dir, claim=_claim_beside)


def _claim_beside(path: Path) -> None:
    """List `path` in the run record of the folder it is in, before it is written."""
    claim_outputs(path.parent, path)


def run_prepare(argv: list[str] | None = None) -> dict[str, Any]:
    """`hf-deep-nmt prepare RECIPE [--field value ...]`: build (or find) the recipe's prepared data ahead of training,
    e.g. on a CPU node before the GPUs are booked; `train` / `train-staged` of the same data and settings then reuse
    it. The recipe is read as `train` (or `train-staged`) reads it; only its data and tokenizer settings are used and
    no output folder is touched. Returns `PreparedData.summary()`."""
    from hf_deep_nmt.training.arguments import ARGUMENT_CLASSES, StageArguments

    model_args, data_args, export_args, training_args, _ = parse_arguments(argv, (*ARGUMENT_CLASSES, StageArguments))
    if data_args.streaming:
        raise ValueError(
            "`streaming: true` reads the corpus while training: there is nothing to prepare ahead (a streamed corpus "
            "may not fit the disk); train it directly, or remove `streaming` to prepare the data once."
        )
    return preparation.prepare_ahead(plan_run(model_args, data_args, export_args, training_args, command="prepare"))


def build_model(plan: RunPlan | ModelArguments, tokenizer: PreTrainedTokenizerBase) -> DeepNMTForConditionalGeneration:
    """A fresh model from the plan's preset plus overrides, sized to the tokenizer (`build_config`); or the saved
    model of `model_name_or_path` as saved (checked by the plan: `check_saved_model`). The recipe's `ModelArguments`
    in place of the plan are checked into one first (`as_plan`)."""
    plan = as_plan(plan)
    if plan.model_args.model_name_or_path:
        return AutoModelForSeq2SeqLM.from_pretrained(plan.model_args.model_name_or_path)
    config = build_config(plan, tokenizer)
    return MODEL_CLASSES[type(config)](config)


def build_config(plan: RunPlan | ModelArguments, tokenizer: PreTrainedTokenizerBase | None = None):
    """The plan's preset config with the overrides (checked there: `check_model_arguments`), sized to `tokenizer`;
    without one, to a joint tokenizer of `tokenizer_vocab_size` as `train_joint_tokenizer` makes it (`<s>`=0,
    `<pad>`=1, `</s>`=2). The recipe's `ModelArguments` in place of the plan are checked into one first (`as_plan`)."""
    model_args = as_plan(plan).model_args
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


def configure_generation(model, tokenizer, *plan: RunPlan | DataArguments | EvalExportArguments) -> None:
    """The plan's generation settings: beam size, length penalty and the recipe's output cap at the longest allowed
    source; the tokenizer must fit the model (`check_tokenizer_matches`). The recipe's `DataArguments` and
    `EvalExportArguments` in place of the plan are checked into one first (`as_plan`).

    The cap is `max_length`, the start token + `max_length_a * max_source_length + max_length_b` tokens + `</s>` (what
    `translate` allows the longest source): not `max_new_tokens`, beside which `Seq2SeqTrainer` evaluation would fill
    in transformers' default `max_length` of 20, and which would override a caller's `generate(max_length=...)`."""
    settings = as_plan(*plan).generation
    check_tokenizer_matches(model, tokenizer)
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
    averaged = None
    if trainer.is_world_process_zero():
        checkpoints = last_checkpoints(checkpoint_dir, count)
        averaged = average_checkpoints(checkpoints).state_dict()
        summary["averaged_checkpoints"] = [path.name for path in checkpoints]
    load_whole_state(trainer.model, averaged)  # the main process's model; every rank's shards under FSDP2


def evaluate_and_export(
    trainer: Seq2SeqTrainer,
    prepared: Prepared,
    plan: RunPlan,
    summary: dict[str, Any],
    finish=None,
) -> dict[str, Any]:
    """sacreBLEU/chrF on the validation split (decoded with the plan's options), a few translations, the curves, the
    Hub-ready folder (never replacing the plan's protected folders) and `results.json`, all on the main process;
    then `finish()` (the run folder's, marking the run finished). Other processes only call `finish()` (and send
    their shards of an FSDP2 model, which the main process decodes and exports whole: `whole_model`)."""
    model = whole_model(trainer.model, trainer.is_world_process_zero())
    if not trainer.is_world_process_zero():
        if finish is not None:
            finish()
        return summary
    _, data_args, export_args, training_args = plan.arguments
    if prepared.eval_dataset is not None:
        summary.update(score_validation(model, prepared, export_args, plan.decoding))
    output_dir = Path(training_args.output_dir)
    if export_args.plot_curves:
        claim_outputs(output_dir, output_dir / CURVES_FILE)
        curves = plot_training_curves(trainer.state.log_history, Path(training_args.output_dir))
        if curves is not None:
            summary["training_curves"] = str(curves)
    # the export swapped in, the results written and the run marked finished with the signals held back: a signal
    # meanwhile never leaves an export in place beside a record that says the run is unfinished
    with signals_held(finished=lambda: finish is not None):
        if export_args.export_dir:
            train_file = data_args.corpus_paths()[0]
            export_hub_folder(
                model,
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
                protected=plan.protected,
            )
            summary["export_dir"] = export_args.export_dir
        write_results(output_dir, summary)
        if finish is not None:
            finish()
    return summary


def score_validation(
    model, prepared: Prepared, export_args: EvalExportArguments, options: DecodingOptions
) -> dict[str, Any]:
    """Translate the validation split as the recipe decodes (`options`: `evaluation_options`, checked by the plan)
    and score it; the first `translate_examples` translations are kept and logged."""
    sources, references = prepared.raw["validation"][SOURCE], prepared.references
    started = time.perf_counter()
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
        f"{steps} optimizer steps"
        + (f" in {summary['train_seconds']} s." if summary.get("train_seconds") is not None else ".")
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
