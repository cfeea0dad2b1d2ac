"""Shallow-to-deep training in one command (SDT, Li et al. 2020, §4): train the first depth, grow by copying the top
layers, restart the learning rate, train again, ... up to the last depth, then evaluate and export.

    hf-deep-nmt train-staged recipes/configs/sdt_sample_staged.json

Every stage writes its own folder under `output_dir` (`stage-1-2-layers/`, ...) with its Trainer checkpoints and, when
it is done, its final model and `stage.json`. Running the same command again resumes: finished stages are skipped, an
interrupted stage continues from its last checkpoint, and a stage stopped after its last step (while its model or
record was being saved) saves them from that checkpoint without training again. A folder holding a run of another
recipe is refused (`hf_deep_nmt.training.run_folder`), so a changed recipe never exports the old stages under its own
card. Each stage starts with a fresh optimizer; the schedule is the fairseq inverse square root with the SDT restart
rule (`hf_deep_nmt.training.schedules`). With `average_checkpoints: N`, the final evaluation and the export use the
mean of the last stage's newest N checkpoints (`hf_deep_nmt.training.pipeline.average_last_checkpoints`, the step
`train` takes).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from transformers import AutoModelForSeq2SeqLM, TrainerState
from transformers.utils import logging

from hf_deep_nmt.folders import atomic_file, write_marked_folder
from hf_deep_nmt.model_folders import check_saved_json_files
from hf_deep_nmt.training.arguments import ARGUMENT_CLASSES, StageArguments, check_explicit_run, parse_arguments
from hf_deep_nmt.training.callbacks import nonfinite_steps_skipped
from hf_deep_nmt.training.checkpoints import (
    TRAINER_STATE_FILE,
    last_complete_checkpoint,
    training_finished,
    verify_checkpoint,
)
from hf_deep_nmt.training.growing import grow_encoder
from hf_deep_nmt.training.pipeline import (
    average_last_checkpoints,
    build_model,
    configure_generation,
    evaluate_and_export,
    load_finished_training,
    make_trainer,
    prepare,
    skipped_steps_in_state,
)
from hf_deep_nmt.training.plan import RunPlan, plan_run
from hf_deep_nmt.training.preemption import raise_if_preempted
from hf_deep_nmt.training.run_folder import RunFolder
from hf_deep_nmt.training.run_record import claim_outputs, run_recipe, run_shape
from hf_deep_nmt.training.schedules import inverse_sqrt_scheduler, stage_start_step
from hf_deep_nmt.training.trainer import DeepNMTTrainer
from hf_deep_nmt.weights import safetensors_header, saved_weight_files

logger = logging.get_logger(__name__)


class StageTrainer(DeepNMTTrainer):
    """The recipe trainer (token-budget batches) whose schedule is the inverse square root started at
    `schedule_start_step`."""

    def __init__(self, *args, schedule_start_step: int, stage_arguments: StageArguments, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule_start_step = schedule_start_step
        self.stage_arguments = stage_arguments

    def _create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = inverse_sqrt_scheduler(
                optimizer or self.optimizer,
                self.stage_arguments.schedule_warmup_steps,
                self.stage_arguments.schedule_init_lr,
                start_step=self.schedule_start_step,
            )
        return self.lr_scheduler


def run_staged(argv: list[str] | None = None) -> dict[str, Any]:
    """Train every stage (skipping finished ones, resuming an interrupted one), then evaluate and export."""
    given: set[str] = set()
    arguments = parse_arguments(argv, (*ARGUMENT_CLASSES, StageArguments), given=given)
    check_explicit_run(argv, "train-staged", given)
    shape = run_shape(arguments[3])
    with RunFolder(arguments[3].output_dir, "train-staged", run_recipe(*arguments), shape) as folder:
        return _run_staged(plan_run(*arguments[:4], arguments[4], "train-staged"), folder)


def _run_staged(plan: RunPlan, folder: RunFolder) -> dict[str, Any]:
    training_args, stages = plan.training_args, plan.stages
    # finished stages are kept and interrupted ones resumed only in a folder of this same recipe
    folder.start(training_args.resume_from_checkpoint, training_args.overwrite_output_dir, list(plan.inputs))
    root = Path(training_args.output_dir)
    depths = list(enumerate(stages.stage_depths, start=1))
    finished = {  # read before anything is trained: a damaged record stops the run before step 1
        number: finished_stage(stage_folder(root, number, depth), number, depth) for number, depth in depths
    }
    prepared = prepare(plan, tokenizer_dir=root / "tokenizer")
    completed_steps, previous, trainer, summary = 0, None, None, {"stages": []}
    started = time.perf_counter()
    for number, depth in depths:
        stage_dir = stage_folder(root, number, depth)
        done = finished[number]  # None: not finished in an earlier run
        if done is None:
            model = stage_model(plan, prepared.tokenizer, number, depth, previous)
            start_step = stage_start_step(completed_steps, stages.schedule_warmup_steps) if previous else 0
            trainer, done = train_stage(plan, prepared, model, stage_dir, number, depth, start_step)
        completed_steps += done["steps"]
        previous = stage_dir / "model"
        summary["stages"].append(done)
    if trainer is None:  # every stage was already done: evaluate the last one
        trainer = last_stage_trainer(plan, prepared, stage_dir)
    summary.update(train_seconds=round(time.perf_counter() - started, 1), train_steps=completed_steps)
    summary["nonfinite_steps_skipped"] = sum(stage.get("nonfinite_steps_skipped", 0) for stage in summary["stages"])
    # the SDT paper averages the newest checkpoints of the last stage; the same step `train` takes on its run
    average_last_checkpoints(trainer, stage_dir, plan.export_args.average_checkpoints, summary)
    return evaluate_and_export(trainer, prepared, plan, summary, finish=folder.finish)


def stage_folder(root: Path, number: int, depth: int) -> Path:
    """Where stage `number` (`depth` encoder layers) writes its checkpoints, final model and record."""
    return root / f"stage-{number}-{depth}-layers"


def stage_model(plan: RunPlan, tokenizer, number: int, depth: int, previous: Path | None):
    """The model stage `number` trains: the preset at the first depth, else the previous stage's final model
    (`previous`) grown by the layers this stage adds; its generation settings the plan's."""
    stages = plan.stages
    if previous is None:
        overrides = {**plan.model_args.model_overrides, "encoder_layers": depth}
        first = dataclasses.replace(plan.model_args, model_overrides=overrides)
        model = build_model(dataclasses.replace(plan, model_args=first), tokenizer)
    else:
        previous_depth = stages.stage_depths[number - 2]
        model = grow_encoder(
            previous, depth - previous_depth, stages.growth_strategy, stages.reset_previous_block_norm
        ).train()
    configure_generation(model, tokenizer, plan)
    return model


def train_stage(plan: RunPlan, prepared, model, stage_dir: Path, number: int, depth: int, start_step: int):
    """Train one stage from its last complete checkpoint, if any (or take a checkpoint that ends it, without training
    again), then save its final model and record. Returns the stage's trainer and record."""
    stages = plan.stages
    stage_args = dataclasses.replace(plan.training_args, output_dir=str(stage_dir), max_steps=stages.stage_max_steps)
    trainer = make_trainer(
        model, stage_args, prepared, StageTrainer, schedule_start_step=start_step, stage_arguments=stages
    )
    checkpoint = last_complete_checkpoint(stage_dir)
    if checkpoint:
        verify_checkpoint(checkpoint)  # its files are those the stage recorded
    claim_outputs(stage_dir.parent, stage_dir)
    if checkpoint and training_finished(checkpoint, stage_args):
        # stopped after the stage's last step, before its record: its model is saved, nothing trained again
        logger.warning(f"Stage {number} ({depth} layers): {checkpoint} ends the stage; saving its model.")
        state = load_finished_training(trainer, checkpoint)
        steps, skipped = state.global_step, skipped_steps_in_state(state)
    else:
        if checkpoint:
            logger.warning(f"Stage {number} ({depth} layers): resuming from {checkpoint}.")
        result = trainer.train(resume_from_checkpoint=checkpoint)
        raise_if_preempted(trainer)  # before stage.json: a preempted stage is not finished
        steps, skipped = result.global_step, nonfinite_steps_skipped(trainer)
    done = {"stage": number, "encoder_layers": depth, "steps": steps, "schedule_start": start_step}
    done["nonfinite_steps_skipped"] = skipped
    save_stage(trainer, stage_dir, done)
    return trainer, done


def save_stage(trainer, stage_dir: Path, done: dict[str, Any]) -> None:
    """The stage's final model (`model/`, which the next stage grows from) and then its record (`stage.json`), on the
    main process; every process waits for them."""
    if trainer.is_world_process_zero():
        model_dir = stage_dir / "model"
        if model_dir.is_dir():  # left half-written by an interrupted save (the stage has no record yet)
            shutil.rmtree(model_dir)
        write_marked_folder(model_dir, trainer.save_model)
        # written beside and renamed into place: a run killed meanwhile leaves no half-written record
        with atomic_file(stage_dir / "stage.json", encoding="utf-8") as stream:
            stream.write(json.dumps(done, indent=2) + "\n")
    trainer.accelerator.wait_for_everyone()


def last_stage_trainer(plan: RunPlan, prepared, stage_dir: Path):
    """A trainer holding the final model of the last stage, finished in an earlier run, with that stage's log history
    (for the curves, as the run that trained it had it)."""
    model = AutoModelForSeq2SeqLM.from_pretrained(stage_dir / "model")
    configure_generation(model, prepared.tokenizer, plan)
    trainer = make_trainer(model, plan.training_args, prepared)
    last = last_complete_checkpoint(stage_dir)
    if last:
        trainer.state = TrainerState.load_from_json(str(Path(last) / TRAINER_STATE_FILE))
    return trainer


def finished_stage(stage_dir: Path, number: int, depth: int) -> dict[str, Any] | None:
    """The record (`stage.json`) of a stage an earlier run finished, None for a stage still to train. `ValueError`
    naming the stage folder, what is wrong and the way out when the record is damaged, is another stage's, or its
    final model (`model/`, which the next stage grows from) is missing or damaged."""
    record = stage_dir / "stage.json"
    if not record.is_file():
        return None
    way_out = f"delete the folder {str(stage_dir)!r} to train stage {number} again (the other stages are kept)"
    try:
        done = json.loads(record.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"Stage {number}: {str(record)!r} is not valid JSON ({error}); {way_out}.") from None
    steps = done.get("steps") if isinstance(done, dict) else None
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(
            f"Stage {number}: {str(record)!r} holds no step count (`steps`: {steps!r}, expected an integer >= 0); "
            f"{way_out}."
        )
    if done.get("encoder_layers") != depth:
        raise ValueError(
            f"Stage {number}: {str(record)!r} records {done.get('encoder_layers')!r} encoder layers but the recipe's "
            f"stage {number} has {depth}; {way_out}."
        )
    model = stage_dir / "model"
    weights = saved_weight_files(model)
    if not (model / "config.json").is_file() or not weights or not all(path.is_file() for path in weights):
        raise ValueError(
            f"Stage {number}: {str(record)!r} says the stage is finished but its final model {str(model)!r} is "
            f"missing or incomplete (no config.json or weights); {way_out}."
        )
    try:
        check_saved_json_files(model, f"Stage {number}'s final model")
        for path in weights:
            safetensors_header(path)
    except ValueError as error:
        raise ValueError(f"{error} Or {way_out}.") from None
    return done
