"""What resume, averaging and loading read is what was written: checkpoint checksums recorded when a checkpoint
completes and checked before a resume or an average reads it (an edited step, swapped weights, one flipped byte)."""

import json
import shutil

import pytest
import torch
from datasets import Dataset
from transformers import Seq2SeqTrainingArguments, default_data_collator

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.averaging import average_checkpoints
from hf_deep_nmt.checkpoints import (
    CHECKSUMS_FILE,
    CheckpointChecksumError,
    checkpoint_problem,
    file_sha256,
    last_complete_checkpoint,
    record_checkpoint,
    resolve_resume_checkpoint,
    verify_checkpoint,
)
from hf_deep_nmt.trainer import DeepNMTTrainer


def tiny_dataset(rows: int = 8) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 37, (rows, 6), generator=generator)
    return Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.flip(1).tolist()})


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A 4-step run of `DeepNMTTrainer` saving at steps 2 and 4 (weights, optimizer, scheduler, RNG, state)."""
    output = tmp_path_factory.mktemp("run") / "out"
    config = DeepNMTConfig(
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        vocab_size=40,
    )
    torch.manual_seed(0)
    arguments = Seq2SeqTrainingArguments(
        output_dir=str(output),
        max_steps=4,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
        remove_unused_columns=False,
    )
    trainer = DeepNMTTrainer(
        model=DeepNMTForConditionalGeneration(config),
        args=arguments,
        train_dataset=tiny_dataset(),
        data_collator=default_data_collator,
    )
    trainer.train()
    return output


@pytest.fixture
def run(trained_run, tmp_path):
    """A copy of the trained run that a test may damage."""
    return shutil.copytree(trained_run, tmp_path / "out")


def test_each_saved_checkpoint_records_the_sha256_of_its_files(run):
    record = json.loads((run / CHECKSUMS_FILE).read_text())
    assert sorted(record["checkpoints"]) == ["checkpoint-2", "checkpoint-4"]
    files = record["checkpoints"]["checkpoint-4"]
    for name in ("model.safetensors", "trainer_state.json", "optimizer.pt", "scheduler.pt"):
        assert files[name] == file_sha256(run / "checkpoint-4" / name)
    assert files == {path.name: file_sha256(path) for path in (run / "checkpoint-4").iterdir()}
    assert resolve_resume_checkpoint("last", run) == str(run / "checkpoint-4")


def test_an_edited_trainer_state_step_is_refused_on_resume_and_averaging(run):
    """A step of 4 edited to 1000 (the JSON stays valid, the checkpoint looks complete) no longer matches."""
    state_file = run / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["global_step"] == 4
    state["global_step"] = 1000
    state_file.write_text(json.dumps(state))
    assert checkpoint_problem(run / "checkpoint-4") is None  # structurally whole: only the checksum catches it
    with pytest.raises(CheckpointChecksumError, match=r"checkpoint-4'.*trainer_state\.json is not the file its run"):
        resolve_resume_checkpoint("last", run)
    with pytest.raises(CheckpointChecksumError, match=r"checkpoint-4'.*trainer_state\.json"):
        resolve_resume_checkpoint(str(run / "checkpoint-4"), run)
    with pytest.raises(CheckpointChecksumError, match=r"checkpoint-4'.*trainer_state\.json"):
        average_checkpoints(output_dir=run, last=2)
    assert resolve_resume_checkpoint(str(run / "checkpoint-2"), run) == str(run / "checkpoint-2")


def test_weights_swapped_from_an_older_checkpoint_are_refused(run):
    shutil.copyfile(run / "checkpoint-2" / "model.safetensors", run / "checkpoint-4" / "model.safetensors")
    with pytest.raises(CheckpointChecksumError, match=r"checkpoint-4'.*model\.safetensors is not the file its run"):
        resolve_resume_checkpoint(True, run)
    with pytest.raises(CheckpointChecksumError, match=r"checkpoint-4'.*model\.safetensors"):
        average_checkpoints([run / "checkpoint-2", run / "checkpoint-4"], save_to=run.parent / "averaged")
    assert not (run.parent / "averaged").exists()


def test_one_flipped_byte_in_the_weights_is_refused(run):
    weights = run / "checkpoint-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's data: the header and the size stay right
    weights.write_bytes(bytes(data))
    assert checkpoint_problem(run / "checkpoint-4") is None
    with pytest.raises(CheckpointChecksumError, match=r"checkpoint-4'.*model\.safetensors"):
        verify_checkpoint(run / "checkpoint-4")


def test_a_recorded_file_that_is_gone_is_named(run):
    (run / "checkpoint-4" / "scheduler.pt").unlink()
    with pytest.raises(CheckpointChecksumError, match=r"checkpoint-4' has lost scheduler\.pt"):
        verify_checkpoint(run / "checkpoint-4")


def test_an_unrecorded_checkpoint_of_a_recording_run_counts_as_unfinished(run, caplog):
    """A run stopped between the Trainer writing checkpoint-6 and recording it: resume goes back to checkpoint-4."""
    shutil.copytree(run / "checkpoint-4", run / "checkpoint-6")
    assert "has no checksums in" in checkpoint_problem(run / "checkpoint-6")
    assert last_complete_checkpoint(run) == str(run / "checkpoint-4")
    assert "checkpoint-6" in caplog.text
    record_checkpoint(run / "checkpoint-6")  # recording it completes it
    assert last_complete_checkpoint(run) == str(run / "checkpoint-6")


def test_folders_without_a_record_are_used_unchecked_and_a_broken_record_is_named(run):
    (run / CHECKSUMS_FILE).unlink()  # a run of an earlier version
    (run / "checkpoint-4" / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    assert resolve_resume_checkpoint("last", run) == str(run / "checkpoint-4")
    (run / CHECKSUMS_FILE).write_text('{"checkpoints": ')
    with pytest.raises(CheckpointChecksumError, match=rf"{CHECKSUMS_FILE}' cannot be read.*move it aside"):
        verify_checkpoint(run / "checkpoint-4")


def test_the_record_drops_checkpoints_the_rotation_removed(run):
    shutil.rmtree(run / "checkpoint-2")
    record_checkpoint(run / "checkpoint-4")
    assert sorted(json.loads((run / CHECKSUMS_FILE).read_text())["checkpoints"]) == ["checkpoint-4"]
    assert not list(run.glob(f".{CHECKSUMS_FILE}*"))  # no temporary file left behind
