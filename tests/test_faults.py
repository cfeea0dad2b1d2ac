"""Faults during training: SIGKILL between checkpoints and during a checkpoint write (plain and staged runs), resumed
to the same weights as an uninterrupted run; a NaN loss stops training before a broken checkpoint; a 48-layer model
trains under bf16 autocast with finite losses and gradients.

The kill tests run the real command line in a child process (tests/fault_worker.py) on CPU, one thread, seed 0, no
data-loader workers: deterministic, so resumed and uninterrupted runs must agree to float rounding.
"""

import json
import math
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import fault_worker
import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, default_data_collator

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.training.callbacks import (
    NonFiniteGuard,
    NonFiniteTrainingError,
    checkpoint_problem,
    last_complete_checkpoint,
    resolve_resume_checkpoint,
)

OVERRIDES = {
    "d_model": 16,
    "encoder_layers": 2,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 24,
    "decoder_ffn_dim": 20,
    "dropout": 0.1,  # dropout on: the resumed run must also restore the random state
}
STEPS, SAVE_EVERY = 9, 3


@pytest.fixture(scope="module")
def corpus(sample_slice):
    return sample_slice(96, 300)


def train_arguments(corpus: Path, output_dir: Path) -> list[str]:
    recipe = output_dir.parent / f"{output_dir.name}-recipe.json"
    recipe.write_text(json.dumps({"model_type": "deep_nmt", "model_overrides": OVERRIDES}))
    return [
        "train",
        str(recipe),
        *("--train-file", str(corpus / "train.tsv"), "--validation-file", str(corpus / "valid.tsv")),
        *("--tokenizer-name-or-path", str(corpus / "tokenizer")),
        *("--max-source-length", "64", "--max-target-length", "64", "--max-length-b", "2", "--num-beams", "1"),
        *("--max-steps", str(STEPS), "--save-strategy", "steps", "--save-steps", str(SAVE_EVERY)),
        *("--logging-steps", "1", "--learning-rate", "0.003", "--per-device-train-batch-size", "8"),
        *("--output-dir", str(output_dir), "--report-to", "none", "--disable-tqdm", "true", "--use-cpu", "true"),
        *("--seed", "0", "--dataloader-num-workers", "0", "--translate-examples", "0"),
        # no training_curves.png (test_curves.py's): matplotlib's import and a PNG were a CPU second of each run
        *("--plot-curves", "false"),
    ]


def worker_environment(**settings) -> dict:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    environment.update({key: str(value) for key, value in settings.items()})
    return environment


def start_worker(arguments: list[str], **settings):
    """The run in a process of its own (forked from `fault_worker`'s fork server), with its output log (beside the
    recipe, outside the run's folder)."""
    log = Path(arguments[1]).parent / f"worker-{time.monotonic_ns()}.log"
    return fault_worker.start(arguments, worker_environment(**settings), log), log


def run_to_completion(arguments: list[str], **settings) -> None:
    process, log = start_worker(arguments, **settings)
    process.join(timeout=300)
    if process.exitcode is None:
        process.kill()
        process.join()
    assert process.exitcode == 0, log.read_text()[-3000:]


def kill_when(arguments: list[str], condition, **settings) -> None:
    """Start the worker, SIGKILL it as soon as `condition()` holds; fail if it ends on its own first."""
    process, log = start_worker(arguments, **settings)
    deadline = time.monotonic() + 300
    try:
        while not condition():
            if process.exitcode is not None:
                pytest.fail(f"the run ended (status {process.exitcode}) before the kill:\n{log.read_text()}")
            assert time.monotonic() < deadline, "the kill condition was never met"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=30)
        assert process.exitcode == -signal.SIGKILL
    finally:
        if process.exitcode is None:
            process.kill()
            process.join()


def complete(folder: Path):
    return lambda: folder.is_dir() and checkpoint_problem(folder) is None


def step_losses(checkpoint: Path) -> dict[int, float]:
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    return {entry["step"]: entry["loss"] for entry in history if "loss" in entry}


def assert_same_weights(actual: Path, expected: Path) -> None:
    actual_tensors, expected_tensors = load_file(actual), load_file(expected)
    assert actual_tensors.keys() == expected_tensors.keys()
    for name, tensor in expected_tensors.items():
        torch.testing.assert_close(actual_tensors[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_to_completion(train_arguments(corpus, output_dir))
    return output_dir / f"checkpoint-{STEPS}"


def test_killed_between_checkpoints_resumes_to_the_uninterrupted_weights(corpus, uninterrupted, tmp_path):
    output_dir = tmp_path / "run"
    arguments = train_arguments(corpus, output_dir)
    # slowed to 0.5 s a step: the kill lands during step 4 or 5, long before checkpoint 6
    kill_when(arguments, complete(output_dir / f"checkpoint-{SAVE_EVERY}"), FAULT_STEP_DELAY=0.5)
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == [f"checkpoint-{SAVE_EVERY}"]
    run_to_completion(arguments + ["--resume-from-checkpoint", "last"])
    final = output_dir / f"checkpoint-{STEPS}"
    assert_same_weights(final / "model.safetensors", uninterrupted / "model.safetensors")
    expected_losses, resumed_losses = step_losses(uninterrupted), step_losses(final)
    assert sorted(resumed_losses) == list(range(1, STEPS + 1))
    for step in range(SAVE_EVERY + 1, STEPS + 1):  # the steps trained again after the kill
        assert resumed_losses[step] == pytest.approx(expected_losses[step], rel=1e-5), step


def test_killed_during_a_checkpoint_write_keeps_the_previous_one_and_resumes_from_it(corpus, uninterrupted, tmp_path):
    output_dir = tmp_path / "run"
    arguments = train_arguments(corpus, output_dir)
    marker = tmp_path / "writing"
    kill_when(arguments, marker.exists, FAULT_HANG_AT_STEP=2 * SAVE_EVERY, FAULT_MARKER=marker)
    previous, broken = output_dir / f"checkpoint-{SAVE_EVERY}", output_dir / f"checkpoint-{2 * SAVE_EVERY}"
    # the interrupted write left a folder with weights and optimizer but no trainer state: it is not a checkpoint
    assert (broken / "model.safetensors").is_file() and (broken / "optimizer.pt").is_file()
    assert "no trainer_state.json" in checkpoint_problem(broken)
    # the previous checkpoint is untouched and loads
    assert checkpoint_problem(previous) is None
    assert DeepNMTForConditionalGeneration.from_pretrained(previous).config.encoder_layers == 2
    assert last_complete_checkpoint(output_dir) == str(previous)
    # naming the broken folder is refused with the reason and the alternative, before any training
    with pytest.raises(ValueError, match=r"checkpoint-6' has no trainer_state\.json.*newest complete one is .*-3'"):
        resolve_resume_checkpoint(str(broken), output_dir)
    # "last" skips it, and training from checkpoint 3 reaches the uninterrupted weights
    run_to_completion(arguments + ["--resume-from-checkpoint", "last"])
    final = output_dir / f"checkpoint-{STEPS}"
    assert_same_weights(final / "model.safetensors", uninterrupted / "model.safetensors")
    assert checkpoint_problem(broken) is None  # rewritten whole by the resumed run


def staged_arguments(corpus: Path, output_dir: Path) -> list[str]:
    recipe = output_dir.parent / "staged-recipe.json"
    overrides = {**OVERRIDES, "sparse_block_size": 2, "relative_position_window": 2}
    recipe.write_text(json.dumps({"model_type": "deep_nmt_sdt", "model_overrides": overrides}))
    arguments = train_arguments(corpus, output_dir)
    arguments[:2] = ["train-staged", str(recipe)]
    return arguments + ["--stage-depths", "2", "4", "--stage-max-steps", "6", "--schedule-warmup-steps", "4"]


def test_staged_run_killed_between_stages_and_during_a_write_resumes_to_the_same_model(corpus, tmp_path):
    expected_dir = tmp_path / "uninterrupted"
    run_to_completion(staged_arguments(corpus, expected_dir))
    output_dir = tmp_path / "run"
    arguments = staged_arguments(corpus, output_dir)
    stage_one, stage_two = output_dir / "stage-1-2-layers", output_dir / "stage-2-4-layers"
    # 1. killed between the stages: stage 1 finished (its record written), stage 2 not started
    kill_when(arguments, (stage_one / "stage.json").is_file, FAULT_STEP_DELAY=0.5)
    assert json.loads((stage_one / "stage.json").read_text())["steps"] == 6  # the record is never half-written
    assert not list(stage_two.glob("checkpoint-*"))
    finished_stage_one = (stage_one / "model" / "model.safetensors").stat().st_mtime_ns
    # 2. resumed, then killed while writing stage 2's checkpoint at step 6 (its last)
    marker = tmp_path / "writing"
    kill_when(arguments, marker.exists, FAULT_HANG_AT_STEP=6, FAULT_MARKER=marker)
    assert "no trainer_state.json" in checkpoint_problem(stage_two / "checkpoint-6")
    assert last_complete_checkpoint(stage_two) == str(stage_two / "checkpoint-3")
    # 3. resumed again: stage 1 is not retrained, stage 2 continues from checkpoint 3 (not the broken 6)
    run_to_completion(arguments)
    assert (stage_one / "model" / "model.safetensors").stat().st_mtime_ns == finished_stage_one
    assert json.loads((stage_two / "stage.json").read_text())["steps"] == 6
    for stage in ("stage-1-2-layers", "stage-2-4-layers"):
        assert_same_weights(
            output_dir / stage / "model" / "model.safetensors", expected_dir / stage / "model" / "model.safetensors"
        )


def test_resume_settings_are_resolved_or_refused(tmp_path):
    assert resolve_resume_checkpoint(None, tmp_path) is None
    assert resolve_resume_checkpoint("last", tmp_path) is None  # nothing yet: start from scratch
    with pytest.raises(ValueError, match=r"'.*nowhere' is not a folder"):
        resolve_resume_checkpoint(str(tmp_path / "nowhere"), tmp_path)
    empty = tmp_path / "checkpoint-4"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"checkpoint-4' has no model weights"):
        resolve_resume_checkpoint(str(empty), tmp_path)
    (empty / "model.safetensors").write_bytes(b"")
    (empty / "trainer_state.json").write_text('{"global_step": 4, "log_hist')  # cut off mid-write
    with pytest.raises(ValueError, match=r"trainer_state\.json' cannot be read"):
        resolve_resume_checkpoint(str(empty), tmp_path)
    assert last_complete_checkpoint(tmp_path) is None


# ---- numerics -------------------------------------------------------------------------------------------------------


def tiny_dataset(rows: int = 16) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 37, (rows, 6), generator=generator)
    return Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.flip(1).tolist()})


class PoisonedModel(DeepNMTForConditionalGeneration):
    """Returns a NaN loss from the forward pass number `poison_at` (1-based) on."""

    poison_at = 5

    def forward(self, *args, **kwargs):
        outputs = super().forward(*args, **kwargs)
        self.calls = getattr(self, "calls", 0) + 1
        if self.training and self.calls >= self.poison_at:
            outputs.loss = outputs.loss * float("nan")
        return outputs


def guarded_trainer(model, tmp_path, guard=None, **settings) -> Seq2SeqTrainer:
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        **{
            "max_steps": 8,
            "per_device_train_batch_size": 4,
            "save_strategy": "steps",
            "save_steps": 2,
            "report_to": "none",
            "disable_tqdm": True,
            "use_cpu": True,
            "seed": 0,
            "remove_unused_columns": False,
            **settings,
        },
    )
    return Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=tiny_dataset(),
        data_collator=default_data_collator,
        callbacks=[guard or NonFiniteGuard()],
    )


def test_a_nan_loss_stops_training_naming_the_step_before_a_broken_checkpoint(tiny_config, tmp_path):
    """With no skipping allowed (`max_consecutive_nonfinite_steps=0`) the first NaN loss stops the run."""
    model = PoisonedModel(tiny_config(DeepNMTConfig))
    trainer = guarded_trainer(model, tmp_path, guard=NonFiniteGuard(0))
    with pytest.raises(NonFiniteTrainingError, match=r"loss is nan at optimizer step 5; last checkpoint written: "):
        trainer.train()
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert trainer.state.global_step == 4
    for name, tensor in model.state_dict().items():
        assert torch.isfinite(tensor).all(), name
    # without the guard the transformers default drops the NaN from the logs and writes NaN weights
    model = PoisonedModel(tiny_config(DeepNMTConfig))
    trainer = guarded_trainer(model, tmp_path / "unguarded")
    trainer.remove_callback(NonFiniteGuard)
    trainer.train()
    saved = load_file(tmp_path / "unguarded" / "checkpoint-6" / "model.safetensors")
    assert not all(torch.isfinite(tensor).all() for tensor in saved.values())


def test_non_finite_gradients_stop_training_naming_the_step(tiny_config, tmp_path):
    model = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig))
    # an infinite gradient on one weight from the third backward pass on, with a finite loss
    calls = {"n": 0}

    def poison(gradient):
        calls["n"] += 1
        return gradient * float("inf") if calls["n"] >= 3 else gradient

    model.model.encoder.layers[1].fc1.weight.register_hook(poison)
    trainer = guarded_trainer(model, tmp_path, guard=NonFiniteGuard(0), max_grad_norm=0.0)
    with pytest.raises(
        NonFiniteTrainingError,
        match=r"Non-finite gradients \(total norm (inf|nan)\) at optimizer step 3; last checkpoint written: .*-2",
    ):
        trainer.train()
    assert sorted(path.name for path in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]
    assert torch.isfinite(model.model.encoder.layers[1].fc1.weight).all()


DEEP_48 = [
    pytest.param(dict(layer_aggregation="dlcl"), id="dlcl-prenorm"),
    pytest.param(
        dict(pre_norm=False, init_scheme="ds_init", decoder_self_attention="merged_average"), id="dsinit-postnorm-matt"
    ),
    pytest.param(
        dict(encoder_layer_aggregation="sparse", sparse_block_size=6, relative_position_window=2), id="sdt-sparse"
    ),
    pytest.param(dict(msc_block_layers=24), id="msc-2x24"),
]


@pytest.mark.parametrize("settings", DEEP_48)
def test_a_48_layer_model_trains_under_bf16_autocast_with_finite_loss_and_gradients(tiny_config, settings):
    sizes = dict(d_model=8, encoder_layers=48, decoder_layers=2, encoder_ffn_dim=12, encoder_attention_heads=2)
    config = tiny_config(DeepNMTConfig, **sizes, **settings)
    assert config.encoder_layers == 48
    model = DeepNMTForConditionalGeneration(config).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = tiny_dataset(8)[:]
    inputs = {key: torch.tensor(value) for key, value in batch.items()}
    losses = []
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        for name, parameter in model.named_parameters():
            if parameter.grad is not None:
                assert torch.isfinite(parameter.grad).all(), name
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(loss), losses
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_a_48_layer_model_trains_with_the_trainer_in_bf16_on_cpu_under_the_guard(tiny_config, tmp_path):
    config = tiny_config(DeepNMTConfig, d_model=8, encoder_layers=48, encoder_ffn_dim=12, layer_aggregation="dlcl")
    model = DeepNMTForConditionalGeneration(config)
    trainer = guarded_trainer(model, tmp_path, bf16=True, max_steps=4, save_steps=4, logging_steps=1)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert all(
        torch.isfinite(tensor).all() for tensor in load_file(tmp_path / "checkpoint-4" / "model.safetensors").values()
    )


def test_in_a_multi_process_run_a_nan_loss_is_reported_by_the_gradient_check_on_every_process(tiny_config):
    """One process's NaN loss must not stop that process alone (the others would wait for it in the gradient
    all-reduce): the loss is recorded, and the gradient check, which every process runs on the same reduced gradients,
    raises naming it."""
    model = PoisonedModel(tiny_config(DeepNMTConfig))
    model.poison_at = 1
    guard = NonFiniteGuard(0)
    args, state = SimpleNamespace(world_size=2, fp16=False, output_dir="out"), SimpleNamespace(global_step=6)
    guard.on_train_begin(args, state, None, model=model)
    guard.on_step_begin(args, state, None)
    inputs = {key: torch.tensor(value) for key, value in tiny_dataset(4)[:].items()}
    loss = model.train()(**inputs).loss  # recorded, not raised
    loss.backward()
    with pytest.raises(NonFiniteTrainingError, match=r"after a training loss of nan at optimizer step 7"):
        guard.on_pre_optimizer_step(args, state, None, model=model)
