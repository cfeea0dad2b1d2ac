"""A cluster may preempt a run and requeue it on another node: SIGTERM (or SIGUSR1) saves a checkpoint at the end of
the current step and releases the output folder's lock, and the same command, even on another host, continues from
that checkpoint. The lock carries a lease renewed by a heartbeat: a lock whose lease ran out on another host is taken
over (atomically), a live one never; on this host a lock of a process that ended (a zombie, pid 0 or -1) is taken
over. The preemption test runs the real command line in a child process (tests/fault_worker.py)."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import fault_worker
import pytest
import transformers.trainer
from transformers import TrainerCallback

from hf_deep_nmt.cli import main
from hf_deep_nmt.training import lock
from hf_deep_nmt.training.arguments import parse_arguments
from hf_deep_nmt.training.callbacks import checkpoint_problem, numbered_checkpoints
from hf_deep_nmt.training.preemption import (
    OutputFolderTakenOver,
    PreemptionCallback,
    PreemptionSignals,
    TrainingPreempted,
    raise_if_preempted,
)
from hf_deep_nmt.training.run_folder import (
    LOCK_FILE,
    RUN_RECORD,
    RunFolder,
    RunFolderError,
    _process_alive,
    recipe_differences,
    run_recipe,
)
from hf_deep_nmt.training.staged import run_staged

OVERRIDES = {
    "d_model": 16,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 24,
    "decoder_ffn_dim": 20,
}
STEPS = 8


@pytest.fixture(scope="module")
def corpus(sample_slice):
    return sample_slice(48, 300)


def train_arguments(corpus: Path, output_dir: Path) -> list[str]:
    recipe = output_dir.parent / f"{output_dir.name}-recipe.json"
    recipe.write_text(json.dumps({"model_type": "deep_nmt", "model_overrides": OVERRIDES}))
    return [
        "train",
        str(recipe),
        *("--train-file", str(corpus / "train.tsv"), "--validation-file", str(corpus / "valid.tsv")),
        *("--tokenizer-name-or-path", str(corpus / "tokenizer"), "--max-length-b", "2", "--num-beams", "1"),
        *("--max-source-length", "64", "--max-target-length", "64", "--max-steps", str(STEPS)),
        # no periodic checkpoint: the only ones are the preemption's and the last
        *("--save-strategy", "steps", "--save-steps", "1000", "--per-device-train-batch-size", "8"),
        *("--output-dir", str(output_dir), "--report-to", "none", "--disable-tqdm", "true", "--use-cpu", "true"),
        *("--seed", "0", "--dataloader-num-workers", "0", "--translate-examples", "0", "--plot-curves", "false"),
    ]


def another_hosts_lock(folder: Path, heartbeat_age: float, lease: float | None = 60.0) -> str:
    holder = {"pid": 4242, "host": "node-17", "command": "train", "since": "earlier"}
    if lease is not None:
        holder.update(heartbeat=time.time() - heartbeat_age, lease_seconds=lease)
    text = json.dumps(holder)
    (folder / LOCK_FILE).write_text(text)
    return text


def test_sigterm_saves_a_checkpoint_frees_the_folder_and_the_requeued_command_continues(corpus, tmp_path, caplog):
    output_dir, step_file = tmp_path / "run", tmp_path / "step"
    arguments = train_arguments(corpus, output_dir)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    environment.update(FAULT_STEP_DELAY="0.3", FAULT_STEP_FILE=str(step_file))
    log = tmp_path / "worker.log"
    process = fault_worker.start(arguments, environment, log)
    try:
        deadline = time.monotonic() + 120
        while not (step_file.is_file() and step_file.read_text().strip() not in ("", "0", "1")):
            assert process.exitcode is None, f"the run ended before the signal: {log.read_text()}"
            assert time.monotonic() < deadline, "training never reached step 2"
            time.sleep(0.02)
        lock = json.loads((output_dir / LOCK_FILE).read_text())
        assert lock["pid"] == process.pid and lock["lease_seconds"] > 0 and lock["heartbeat"] <= time.time()
        os.kill(process.pid, signal.SIGTERM)
        process.join(timeout=60)
        assert process.exitcode == 130
        error = log.read_text()
    finally:
        if process.exitcode is None:
            process.kill()
            process.join()
    saved = numbered_checkpoints(output_dir)
    assert len(saved) == 1, error
    step = int(saved[0].name.split("-")[1])
    assert 2 <= step < STEPS and checkpoint_problem(saved[0]) is None
    assert f"SIGTERM received: checkpoint '{saved[0]}' saved; run the same command to continue from it" in error
    assert not (output_dir / LOCK_FILE).exists()
    record = json.loads((output_dir / RUN_RECORD).read_text())
    assert record["finished"] is False and record["written"] == [saved[0].name, "checkpoint_checksums.json"]
    # requeued on another node, where the dead run's lock has not been released (its lease ran out long ago)
    another_hosts_lock(output_dir, heartbeat_age=600)
    with caplog.at_level(logging.WARNING):
        assert main(arguments[:]) == 0
    assert "Taking over the lock" in caplog.text and "node-17" in caplog.text and "lease ran out" in caplog.text
    assert "holds an interrupted run of this recipe: continuing it" in caplog.text
    assert f"Resuming from {saved[0]}" in caplog.text
    assert json.loads((output_dir / "results.json").read_text())["train_steps"] == STEPS
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS
    assert not (output_dir / LOCK_FILE).exists()
    assert json.loads((output_dir / RUN_RECORD).read_text())["written"] == [
        saved[0].name,
        f"checkpoint-{STEPS}",
        "checkpoint_checksums.json",
        "results.json",
    ]


class SignalDuringStageTwo(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2 and Path(args.output_dir).name == "stage-2-2-layers":
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_preempted_stage_is_not_marked_finished_and_the_same_command_continues_it(corpus, tmp_path, monkeypatch):
    output_dir = tmp_path / "staged"
    arguments = train_arguments(corpus, output_dir)[1:]
    arguments[arguments.index("--tokenizer-name-or-path") : arguments.index("--tokenizer-name-or-path") + 2] = [
        *("--tokenizer-vocab-size", "300")  # trained by the run and saved in output_dir/tokenizer
    ]
    arguments += ["--stage-depths", "1", "2", "--stage-max-steps", "3"]
    defaults = transformers.trainer.DEFAULT_CALLBACKS
    monkeypatch.setattr(transformers.trainer, "DEFAULT_CALLBACKS", [*defaults, SignalDuringStageTwo])
    stage_two = output_dir / "stage-2-2-layers"
    with pytest.raises(TrainingPreempted, match=rf"SIGTERM received: checkpoint '{stage_two}/checkpoint-2' saved"):
        run_staged(arguments)
    assert (output_dir / "stage-1-1-layers" / "stage.json").is_file() and not (stage_two / "stage.json").exists()
    assert checkpoint_problem(stage_two / "checkpoint-2") is None and not (output_dir / LOCK_FILE).exists()
    record = json.loads((output_dir / RUN_RECORD).read_text())
    assert record["written"] == ["stage-1-1-layers", "stage-2-2-layers", "tokenizer"]
    monkeypatch.setattr(transformers.trainer, "DEFAULT_CALLBACKS", defaults)
    summary = run_staged(arguments)
    assert [stage["steps"] for stage in summary["stages"]] == [3, 3]
    assert json.loads((stage_two / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    record = json.loads((output_dir / RUN_RECORD).read_text())
    assert record["finished"] and record["written"] == [
        "results.json",
        "stage-1-1-layers",
        "stage-2-2-layers",
        "tokenizer",
    ]


def test_a_run_whose_folder_was_taken_over_stops_without_saving(tmp_path):
    signals = PreemptionSignals()
    signals.taken_over = "taken over by node-17"
    callback = PreemptionCallback()
    callback.signals = signals
    control = transformers.trainer.TrainerControl()
    arguments = type("Arguments", (), {"world_size": 1, "output_dir": str(tmp_path)})()
    with pytest.raises(OutputFolderTakenOver, match="taken over by node-17"):
        callback.on_step_end(arguments, transformers.trainer.TrainerState(), control)
    assert not control.should_save


def test_the_launchers_rank_is_not_part_of_the_recipe(tmp_path):
    parsed = parse_arguments(["--model-type", "deep_nmt", "--output-dir", str(tmp_path), "--use-cpu", "true"])
    assert "local_rank" not in run_recipe(*parsed)
    # a record of an earlier version holds it: continuing that run under a launcher is not a changed recipe
    assert recipe_differences({"local_rank": -1, "seed": 0}, {"seed": 0}) == []
    assert recipe_differences({"local_rank": -1, "seed": 0}, {"seed": 1}) == ["seed: 0 -> 1"]


def test_a_signal_before_training_stops_at_once_and_releases_the_lock(tmp_path):
    folder = tmp_path / "run"
    previous = signal.getsignal(signal.SIGUSR1)
    with pytest.raises(TrainingPreempted, match="SIGUSR1 received: stopped before training started"):
        with RunFolder(folder, "train", {}):
            assert (folder / LOCK_FILE).is_file()
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(5)  # the handler interrupts this
    assert not folder.exists()  # created by the run, left empty: removed
    assert signal.getsignal(signal.SIGUSR1) == previous
    with PreemptionSignals() as signals:
        signals.training = True  # during training the signal is only noted, for the callback to act on
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == signal.SIGTERM
        signals.training, signals.trained = False, True
        with pytest.raises(TrainingPreempted, match="SIGTERM received: stopped after the last checkpoint"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)


def test_a_signal_after_the_last_step_end_names_the_last_checkpoint(tmp_path):
    (tmp_path / "checkpoint-3").mkdir()
    callback = PreemptionCallback()
    arguments = type("Arguments", (), {"world_size": 1, "output_dir": str(tmp_path)})()
    state, control = transformers.trainer.TrainerState(global_step=3), transformers.trainer.TrainerControl()
    with PreemptionSignals() as signals:
        callback.on_train_begin(arguments, state, control)
        callback.on_step_end(arguments, state, control)
        assert callback.stopped_at is None and not control.should_save
        signals.received = signal.SIGUSR1  # after the last step's end, before the end of training
        callback.on_train_end(arguments, state, control)
    trainer = type("Trainer", (), {"callback_handler": type("Handler", (), {"callbacks": [callback]})()})()
    with pytest.raises(TrainingPreempted, match=rf"SIGUSR1 received: checkpoint '{tmp_path}/checkpoint-3' saved"):
        raise_if_preempted(trainer)


def test_a_live_lease_on_another_host_is_never_taken_over_and_a_run_out_one_is(tmp_path, caplog):
    folder = tmp_path / "run"
    folder.mkdir()
    text = another_hosts_lock(folder, heartbeat_age=10, lease=60)
    live = r"process 4242 on node-17.*lease was renewed 10 s ago and runs 50 s more"
    with pytest.raises(RunFolderError, match=live):
        with RunFolder(folder, "train", {}):
            pass
    assert (folder / LOCK_FILE).read_text() == text
    another_hosts_lock(folder, heartbeat_age=10, lease=None)  # written by a version without leases
    with pytest.raises(RunFolderError, match=r"its lock has no lease .* never taken over.* delete '.*\.lock'"):
        with RunFolder(folder, "train", {}):
            pass
    another_hosts_lock(folder, heartbeat_age=61, lease=60)
    with caplog.at_level(logging.WARNING), RunFolder(folder, "train", {}):
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "whose lease ran out 1 s ago" in caplog.text
    # not renewed for more than half its lease (a running holder renews it every quarter): waited for, then taken
    another_hosts_lock(folder, heartbeat_age=0.7, lease=1.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING), RunFolder(folder, "train", {}):
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "was last renewed 1 s ago, though a running holder renews it every 0.25 s: waiting 0 s" in caplog.text
    assert "whose lease ran out 0 s ago" in caplog.text
    assert sorted(path.name for path in folder.iterdir()) == []  # no stale copy left behind


def test_the_heartbeat_keeps_a_running_lease_alive_for_other_hosts(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "LEASE_SECONDS", 1.0)
    folder = tmp_path / "run"
    with RunFolder(folder, "train", {}):
        first = json.loads((folder / LOCK_FILE).read_text())
        time.sleep(2.5)  # more than two leases: without renewal it would have run out
        renewed = json.loads((folder / LOCK_FILE).read_text())
        assert renewed["heartbeat"] > first["heartbeat"] + 1.0 and renewed["pid"] == os.getpid()
        assert (folder / LOCK_FILE).stat().st_size == lock.LOCK_SIZE
        monkeypatch.setattr(socket, "gethostname", lambda: "node-17")  # a requeued copy, seen from another node
        with pytest.raises(RunFolderError, match="in use by another hf-deep-nmt run"):
            with RunFolder(folder, "train", {}):
                pass
    assert not (folder / LOCK_FILE).exists()


def test_a_lock_taken_over_is_neither_renewed_nor_removed_by_its_former_holder(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "LEASE_SECONDS", 0.4)
    folder = tmp_path / "run"
    with RunFolder(folder, "train", {}) as held:
        (folder / LOCK_FILE).unlink()  # what a takeover does: the lock renamed away, a new one created
        text = another_hosts_lock(folder, heartbeat_age=0)
        assert held.lock_lost.wait(timeout=10)
    assert (folder / LOCK_FILE).read_text() == text


def test_a_takeover_puts_back_a_lock_that_changed_since_it_was_read(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    renewed = another_hosts_lock(folder, heartbeat_age=0)
    assert lock.FolderLock(folder, "train")._take_over(folder / LOCK_FILE, seen="the text read before") is False
    assert (folder / LOCK_FILE).read_text() == renewed
    assert [path.name for path in folder.iterdir()] == [LOCK_FILE]


def test_a_zombie_and_pids_0_and_minus_1_are_not_alive(tmp_path, caplog):
    assert not _process_alive(0) and not _process_alive(-1)
    assert _process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never ended"
            time.sleep(0.02)
        assert not _process_alive(child.pid)  # ended, not yet reaped
    finally:
        child.wait()
    folder = tmp_path / "run"
    folder.mkdir()
    # no run writes pid 0: a lock holding it is refused as one no run wrote, never taken over (tests/test_locks.py)
    (folder / LOCK_FILE).write_text(json.dumps({"pid": 0, "host": socket.gethostname()}))
    with pytest.raises(RunFolderError, match=r"which no run of hf-deep-nmt wrote: its `pid` is 0"):
        with RunFolder(folder, "train", {}):
            pass
