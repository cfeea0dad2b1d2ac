"""A run interrupted anywhere ends, once the same command is run again, in the export an uninterrupted run writes:
the same weights, bit for bit. Interruptions are the preemption signal (SIGTERM) sent by the process to itself at a
point of `train` / `train-staged` (in-process: the handler and the code paths are those of a signal from outside),
and one real SIGTERM to a child process during the final evaluation.

The recipe is the smallest that has every part a resume can get wrong: 3 steps over 2-step epochs (the Trainer,
resumed from the last checkpoint, would train a 4th), checkpoints every 2 steps with `save_total_limit: 2`, and the
last 2 averaged (an extra checkpoint saved for a preemption must not take a scheduled one's place)."""

import json
import os
import signal
import time
from pathlib import Path

import fault_worker
import pytest
import transformers.trainer
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_deep_nmt.training import pipeline as training
from hf_deep_nmt.training import staged
from hf_deep_nmt.training.preemption import TrainingPreempted
from hf_deep_nmt.training.run_folder import RUN_RECORD

OVERRIDES = {
    "d_model": 16,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 24,
    "decoder_ffn_dim": 20,
    "dropout": 0.1,  # the resumed run must also restore the random state
}
STEPS = 3


@pytest.fixture(scope="module")
def corpus(sample_slice):
    return sample_slice(48, 300)


def arguments(corpus: Path, folder: Path, command: str = "train") -> list[str]:
    """The recipe of the module docstring, writing `folder`/run and exporting to `folder`/export."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = folder / "recipe.json"
    if command == "train":
        recipe.write_text(json.dumps({"model_type": "deep_nmt", "model_overrides": OVERRIDES}))
        extra = []
    else:
        recipe.write_text(json.dumps({"model_type": "deep_nmt_sdt", "model_overrides": OVERRIDES}))
        extra = ["--stage-depths", "1", "2", "--stage-max-steps", str(STEPS), "--schedule-warmup-steps", "2"]
    return [
        str(recipe),
        *("--train-file", str(corpus / "train.tsv"), "--validation-file", str(corpus / "valid.tsv")),
        *("--tokenizer-name-or-path", str(corpus / "tokenizer"), "--max-length-b", "2", "--num-beams", "1"),
        *("--max-source-length", "64", "--max-target-length", "64", "--max-steps", str(STEPS)),
        *("--save-strategy", "steps", "--save-steps", "2", "--save-total-limit", "2", "--average-checkpoints", "2"),
        *("--per-device-train-batch-size", "8", "--output-dir", str(folder / "run")),
        *("--export-dir", str(folder / "export"), "--report-to", "none", "--disable-tqdm", "true"),
        *("--use-cpu", "true", "--seed", "0", "--dataloader-num-workers", "0", "--translate-examples", "0"),
        *("--plot-curves", "false", *extra),
    ]


RUNS = {"train": training.run, "train-staged": staged.run_staged}


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    """The reference of each command: one uninterrupted run."""
    references = {}
    for command, run in RUNS.items():
        folder = tmp_path_factory.mktemp(command)
        summary = run(arguments(corpus, folder, command))
        references[command] = (folder, summary)
    return references


def interrupt_call(module, name: str, when=lambda *args, **kwargs: True):
    """`module.name` replaced by a function that sends SIGTERM when `when(...)` holds, then calls the original."""
    original = getattr(module, name)

    def replacement(*args, **kwargs):
        if when(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # where the signal is not held back, the handler raises within this sleep
        return original(*args, **kwargs)

    return replacement


class SignalAtStep(TrainerCallback):
    step = 1

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and Path(args.output_dir).name in ("run", "stage-2-2-layers"):
            os.kill(os.getpid(), signal.SIGTERM)


def assert_same_export(folder: Path, reference: Path) -> None:
    ours, theirs = folder / "export" / "model.safetensors", reference / "export" / "model.safetensors"
    if ours.read_bytes() != theirs.read_bytes():  # name the first tensor that differs
        expected = load_file(theirs)
        for name, tensor in load_file(ours).items():
            assert tensor.equal(expected[name]), name
        pytest.fail("the weights are equal but the files differ")


def assert_same_run(folder: Path, reference: Path, summary: dict, expected: dict) -> None:
    assert_same_export(folder, reference)
    for key in ("train_steps", "averaged_checkpoints", "stages", "bleu", "chrf"):
        assert summary.get(key) == expected.get(key), key
    ours = sorted(path.relative_to(folder).as_posix() for path in (folder / "run").rglob("checkpoint-*"))
    theirs = sorted(path.relative_to(reference).as_posix() for path in (reference / "run").rglob("checkpoint-*"))
    assert ours == theirs  # no step past the last one, no preemption checkpoint left beside the scheduled ones
    assert json.loads((folder / "run" / RUN_RECORD).read_text())["finished"] is True


# the points, in the order of a run; each is (module, function, condition on its arguments) or a training step
POINTS = {
    "train": {
        "before training": (training, "build_model", None),
        "during training": 1,
        "during the last step": STEPS,
        "after training": (training, "average_last_checkpoints", None),
        "during the final evaluation": (training, "score_validation", None),
    },
    "train-staged": {
        "between the stages": (staged, "grow_encoder", None),
        "during stage 2": 1,
        "after the last stage's training, before its record": (
            staged,
            "raise_if_preempted",
            lambda trainer: Path(trainer.args.output_dir).name == "stage-2-2-layers",
        ),
        "during the final evaluation": (training, "score_validation", None),
    },
}


@pytest.mark.parametrize("command", list(POINTS))
def test_a_run_interrupted_at_every_point_in_turn_exports_what_an_uninterrupted_one_does(
    corpus, uninterrupted, tmp_path, monkeypatch, command
):
    """One folder, interrupted at each point in turn, the same command run again after each (so that every point's
    continuation runs, at the cost of one run per point): the export is the uninterrupted run's, bit for bit."""
    reference, expected = uninterrupted[command]
    run = RUNS[command]
    argv = arguments(corpus, tmp_path, command)
    defaults = transformers.trainer.DEFAULT_CALLBACKS
    for point, where in POINTS[command].items():
        if isinstance(where, int):
            monkeypatch.setattr(SignalAtStep, "step", where)
            monkeypatch.setattr(transformers.trainer, "DEFAULT_CALLBACKS", [*defaults, SignalAtStep])
        else:
            module, name, when = where
            monkeypatch.setattr(module, name, interrupt_call(module, name, when or (lambda *args, **kwargs: True)))
        with pytest.raises(TrainingPreempted, match="SIGTERM received"):
            run(argv)
            pytest.fail(f"not interrupted {point}")
        assert not (tmp_path / "export").exists(), point
        assert json.loads((tmp_path / "run" / RUN_RECORD).read_text())["finished"] is False, point
        monkeypatch.undo()
    summary = run(argv)
    assert_same_run(tmp_path, reference, summary, expected)


def test_a_signal_during_the_export_is_held_until_the_run_is_finished(corpus, uninterrupted, tmp_path, monkeypatch):
    """The export, the results and the finished record go together: the signal is taken at their end, and the
    command ends as a finished run (a requeued copy would find nothing to do), never with the export in place and
    the run unfinished."""
    reference, expected = uninterrupted["train"]
    monkeypatch.setattr(training, "export_hub_folder", interrupt_call(training, "export_hub_folder"))
    summary = training.run(arguments(corpus, tmp_path))
    assert_same_run(tmp_path, reference, summary, expected)


def test_sigterm_to_a_run_in_its_final_evaluation_resumes_into_evaluation_and_export_only(
    corpus, uninterrupted, tmp_path, caplog
):
    """The issue's case, with a real signal from outside: SIGTERM while the child process evaluates after its last
    step; the same command then trains no step (the Trainer would have trained a 4th and averaged checkpoints 3 and
    4) and exports what the uninterrupted run exports."""
    reference, expected = uninterrupted["train"]
    argv = arguments(corpus, tmp_path)
    marker = tmp_path / "evaluating"
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "FAULT_HANG_IN_EVALUATION": str(marker),
    }
    log = tmp_path / "worker.log"
    process = fault_worker.start(["train", *argv], environment, log)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.exitcode is None, f"the run ended before the signal: {log.read_text()}"
            assert time.monotonic() < deadline, "the run never reached its final evaluation"
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
        process.join(timeout=60)
        assert process.exitcode == 130
        error = log.read_text()
    finally:
        if process.exitcode is None:
            process.kill()
            process.join()
    assert "SIGTERM received: stopped after the last checkpoint of a training" in error
    assert not (tmp_path / "export").exists()
    with caplog.at_level("WARNING"):
        summary = training.run(argv)
    assert f"checkpoint-{STEPS} ends this training (step {STEPS})" in caplog.text
    assert "Resuming from" not in caplog.text
    assert_same_run(tmp_path, reference, summary, expected)
    # the training's own numbers, recorded when it ended in the child, not those of a training call that trained none
    assert summary["train_loss"] == expected["train_loss"]
