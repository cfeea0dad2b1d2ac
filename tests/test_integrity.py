"""What resume, averaging and loading read is what was written: checkpoint checksums recorded when a checkpoint
completes and checked before a resume or an average reads it (an edited step, swapped weights, one flipped byte);
NaN weights and missing weight matrices refused by the commands (warned about by `from_pretrained`); a tokenizer that
is not the model's refused by its fingerprint."""

import hashlib
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    Seq2SeqTrainingArguments,
    default_data_collator,
)

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.cli import main
from hf_deep_nmt.fingerprints import (
    check_tokenizer_matches,
    folder_tokenizer_fingerprint,
    record_tokenizer_fingerprint,
    tokenizer_fingerprint,
)
from hf_deep_nmt.training.averaging import average_checkpoints
from hf_deep_nmt.training.checkpoints import (
    CHECKSUMS_FILE,
    CheckpointChecksumError,
    checkpoint_problem,
    file_sha256,
    last_complete_checkpoint,
    record_checkpoint,
    resolve_resume_checkpoint,
    verify_checkpoint,
)
from hf_deep_nmt.training.run_folder import RUN_RECORD, RunFolder, RunFolderError, claim_outputs
from hf_deep_nmt.training.trainer import DeepNMTTrainer


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


# ---- weights and tokenizers at load -------------------------------------------------------------------------------


def error_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.fixture
def model_copy(tiny_export, tmp_path):
    """A copy of the exported tiny model folder, and a one-line input file."""
    folder = shutil.copytree(tiny_export[0], tmp_path / "model")
    (tmp_path / "input.txt").write_text("el sol sale\n")
    return folder


def rewrite_weights(folder, change) -> None:
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def test_nan_weights_are_refused_by_the_commands_and_warned_about_by_from_pretrained(model_copy, capsys, caplog):
    name = "model.decoder.layers.0.fc1.weight"
    rewrite_weights(model_copy, lambda weights: weights[name].view(-1).__setitem__(3, float("nan")))
    source = model_copy.parent / "input.txt"
    assert main(["translate", "--model", str(model_copy), "--input", str(source), "--no-progress"]) == 2
    line = error_line(capsys)
    assert f"hold NaN or infinite values ({name})" in line and "Use an earlier checkpoint" in line
    assert not (model_copy.parent / "grown").exists()
    assert (
        main(["grow", "--model", str(model_copy), "--output", str(model_copy.parent / "grown"), "--layers", "1"]) == 2
    )
    assert name in error_line(capsys)
    assert not (model_copy.parent / "grown").exists()
    with pytest.raises(ValueError, match=rf"Checkpoint '.*model' holds NaN or infinite weights \({name}\)"):
        average_checkpoints([model_copy], save_to=model_copy.parent / "averaged")
    caplog.clear()
    model = AutoModelForSeq2SeqLM.from_pretrained(model_copy)  # the API loads it, with a warning naming the tensor
    assert torch.isnan(model.get_parameter(name)).any()
    assert f"hold NaN or infinite values ({name})" in caplog.text


def test_a_finite_model_loads_without_a_warning(tiny_export, caplog):
    AutoModelForSeq2SeqLM.from_pretrained(tiny_export[0])
    assert "NaN" not in caplog.text


def test_a_missing_weight_matrix_is_refused_by_name(model_copy, capsys):
    name = "model.encoder.layers.1.fc2.weight"
    rewrite_weights(model_copy, lambda weights: weights.pop(name))
    source = model_copy.parent / "input.txt"
    assert main(["translate", "--model", str(model_copy), "--input", str(source), "--no-progress"]) == 2
    line = error_line(capsys)
    assert f"lack {name}: they would be initialised at random" in line


def test_the_tokenizer_fingerprint_is_that_of_its_file_and_ignores_padding_settings(tiny_export, tmp_path):
    _, _, tokenizer = tiny_export
    fingerprint = tokenizer_fingerprint(tokenizer)
    assert folder_tokenizer_fingerprint(tiny_export[0]) == fingerprint
    data = json.loads((tiny_export[0] / "tokenizer.json").read_text())
    data["padding"] = {"strategy": "BatchLongest", "pad_id": 1}
    data["truncation"] = {"max_length": 7}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert folder_tokenizer_fingerprint(tmp_path) == fingerprint
    data["model"]["vocab"] = {**data["model"]["vocab"]}
    first = next(iter(data["model"]["vocab"]))
    data["model"]["vocab"][first + "x"] = data["model"]["vocab"].pop(first)  # one token renamed
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert folder_tokenizer_fingerprint(tmp_path) != fingerprint
    assert folder_tokenizer_fingerprint(tmp_path / "none") is None


@pytest.fixture
def other_tokenizer(tiny_export, tmp_path):
    """The model's tokenizer with the ids of two tokens swapped (as another run's tokenizer of the same size may
    number them): the vocabulary-size and special-id checks alone accept it."""
    folder = tmp_path / "other-tokenizer"
    tiny_export[2].save_pretrained(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["e"] = vocab["e"], vocab["a"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    other = AutoTokenizer.from_pretrained(folder)
    assert len(other) == len(tiny_export[2]) and other("sale")["input_ids"] != tiny_export[2]("sale")["input_ids"]
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tiny_export[2])
    return other


def test_a_tokenizer_that_is_not_the_models_is_refused_by_its_fingerprint(
    tiny_export, other_tokenizer, model_copy, capsys
):
    _, model, tokenizer = tiny_export
    config = model.config
    try:
        config.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        check_tokenizer_matches(model, tokenizer)
        with pytest.raises(ValueError, match=r"not the one this model was exported with .* Use the tokenizer saved"):
            check_tokenizer_matches(model, other_tokenizer)
    finally:
        del config.tokenizer_fingerprint
    # another run's tokenizer copied into an exported folder whose config records the fingerprint
    values = json.loads((model_copy / "config.json").read_text())
    values["tokenizer_fingerprint"] = tokenizer_fingerprint(tokenizer)
    (model_copy / "config.json").write_text(json.dumps(values))
    other_tokenizer.save_pretrained(model_copy)
    source = model_copy.parent / "input.txt"
    assert main(["translate", "--model", str(model_copy), "--input", str(source), "--no-progress"]) == 2
    assert "is not the one this model was exported with" in error_line(capsys)


def test_the_fingerprint_is_stored_only_where_the_config_admits_it(tiny_export, monkeypatch):
    _, model, tokenizer = tiny_export
    config = model.config.__class__.from_dict(model.config.to_dict())
    stored = record_tokenizer_fingerprint(config, tokenizer)
    assert stored == (getattr(config, "tokenizer_fingerprint", None) == tokenizer_fingerprint(tokenizer))
    # read from the model code at each call (importing it imports transformers)
    monkeypatch.setattr("hf_deep_nmt.modeling.configuration_deep_nmt.unknown_config_keys", lambda *args: {})
    assert record_tokenizer_fingerprint(config, tokenizer)
    assert config.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer)


def test_averaging_checkpoints_of_different_tokenizers_is_refused(model_copy, other_tokenizer, tmp_path):
    second = shutil.copytree(model_copy, tmp_path / "second")
    other_tokenizer.save_pretrained(second)
    with pytest.raises(ValueError, match=r"different tokenizers \('.*model' and '.*second' differ\)"):
        average_checkpoints([model_copy, second], save_to=tmp_path / "averaged")
    assert not (tmp_path / "averaged").exists()
    shutil.copyfile(model_copy / "tokenizer.json", second / "tokenizer.json")
    averaged = average_checkpoints([model_copy, second], save_to=tmp_path / "averaged")
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "averaged").get_vocab()
        == AutoTokenizer.from_pretrained(model_copy).get_vocab()
    )
    assert averaged.config.d_model == 16


def test_a_checksum_record_the_run_record_lists_cannot_be_deleted_to_resume_swapped_weights(run):
    """The run record lists `checkpoint_checksums.json` as written by the run: deleting it no longer turns the check
    off. Continuing the run (as the same command does, or with `resume_from_checkpoint`) is refused, naming the file
    and the ways out; starting afresh is not."""
    recipe = {"learning_rate": 0.1}
    written = ["checkpoint-2", "checkpoint-4", CHECKSUMS_FILE]
    (run / RUN_RECORD).write_text(
        json.dumps({"command": "train", "finished": False, "recipe": recipe, "written": written})
    )
    with RunFolder(run, "train", recipe) as folder:
        assert folder.start(None, False) == "last"  # the record is there: continued, and checked on resume
    shutil.copyfile(run / "checkpoint-2" / "model.safetensors", run / "checkpoint-4" / "model.safetensors")
    (run / CHECKSUMS_FILE).unlink()
    assert resolve_resume_checkpoint("last", run) == str(run / "checkpoint-4")  # what resume alone would take
    for resume in (None, "last"):
        with pytest.raises(RunFolderError) as refused, RunFolder(run, "train", recipe) as folder:
            folder.start(resume, False)
        assert str(refused.value) == (
            f"Cannot continue the run in {str(run)!r}: {str(run / CHECKSUMS_FILE)!r} is missing, though the run "
            f"record {str(run / RUN_RECORD)!r} lists it (deleted or moved, unless the run stopped between writing "
            f"its first checkpoint and recording it). It holds the checksums of the checkpoints in {str(run)!r}; "
            "without it a swapped or edited checkpoint would be resumed unchecked. Restore it; or start afresh with "
            "`--overwrite-output-dir true` or another output_dir; or, to continue from these checkpoints unchecked, "
            f"remove '{CHECKSUMS_FILE}' from the run record's `written`."
        )
    for name in ("checkpoint-2", "checkpoint-4"):  # as a run killed while writing its first checkpoint leaves it
        (run / name / "trainer_state.json").unlink()
    with RunFolder(run, "train", recipe) as folder:
        assert folder.start(None, False) == "last"  # no checkpoint to trust: continued, from scratch
    assert resolve_resume_checkpoint("last", run) is None
    with RunFolder(run, "train", recipe) as folder:
        assert folder.start(None, True) is None  # starting afresh removes what the run wrote
    assert not (run / "checkpoint-4").exists()


def test_a_stage_folders_checksum_record_is_listed_and_its_absence_refused(trained_run, tmp_path):
    """`train-staged` keeps each stage's checksum record inside the stage folder: the run record lists it by its path
    (`checksum_records`), keeps it across rewrites, and a continued run is refused without it."""
    root, recipe = tmp_path / "run", {"stage_depths": [1, 2]}
    stage = root / "stage-1-1-layers"
    with RunFolder(root, "train-staged", recipe) as folder:
        folder.start(None, False)
        # two complete checkpoints: one alone without a record is what a kill before its first recording leaves
        for name in ("checkpoint-2", "checkpoint-4"):
            claim_outputs(root, stage / name, stage / CHECKSUMS_FILE)
            shutil.copytree(trained_run / name, stage / name)
        (stage / CHECKSUMS_FILE).write_text(json.dumps({"format": 1, "checkpoints": {}}))
    record = json.loads((root / RUN_RECORD).read_text())
    assert record["written"] == ["stage-1-1-layers"]
    assert record["checksum_records"] == ["stage-1-1-layers/checkpoint_checksums.json"]
    with RunFolder(root, "train-staged", recipe) as folder:
        assert folder.start(None, False) == "last"
    assert json.loads((root / RUN_RECORD).read_text())["checksum_records"] == record["checksum_records"]
    (stage / CHECKSUMS_FILE).unlink()
    with (
        pytest.raises(RunFolderError, match=r"stage-1-1-layers/checkpoint_checksums.json' is missing, though the run"),
        RunFolder(root, "train-staged", recipe) as folder,
    ):
        folder.start(None, False)
    with RunFolder(root, "train-staged", recipe) as folder:
        folder.start(None, True)
    assert "checksum_records" not in json.loads((root / RUN_RECORD).read_text())  # its folder was removed


def version_1_fingerprint(data: dict) -> str:
    """The fingerprint as the previous version computed it (vocabulary and merges, normalizer, pre-tokenizer, added
    tokens), written out here independently of the package."""
    essentials = {key: data.get(key) for key in ("model", "normalizer", "pre_tokenizer", "added_tokens")}
    return hashlib.sha256(json.dumps(essentials, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


@pytest.mark.parametrize("part", ["post_processor", "decoder"])
def test_a_tokenizer_without_its_post_processor_or_decoder_is_refused(tiny_export, model_copy, part, capsys):
    """The previous fingerprint left both out: without the post-processor no source gets its `</s>`, without the
    decoder every output is detokenized otherwise; both passed it."""
    tokenizer = tiny_export[2]
    model = SimpleNamespace(config=AutoConfig.from_pretrained(model_copy))  # what the exported folder records
    recorded = json.loads((model_copy / "config.json").read_text())["tokenizer_fingerprint"]
    assert model.config.tokenizer_fingerprint == recorded
    assert recorded.startswith("v2:") and recorded == tokenizer_fingerprint(AutoTokenizer.from_pretrained(model_copy))
    data = json.loads((model_copy / "tokenizer.json").read_text())
    assert data[part] is not None
    before = version_1_fingerprint(data)
    data[part] = None
    (model_copy / "tokenizer.json").write_text(json.dumps(data))
    assert version_1_fingerprint(data) == before  # what the previous version could not see
    changed = AutoTokenizer.from_pretrained(model_copy)
    ids = tokenizer("el sol sale")["input_ids"]
    if part == "post_processor":
        assert changed("el sol sale")["input_ids"] != ids and ids[-1] == tokenizer.eos_token_id
    else:
        assert changed.decode(ids, skip_special_tokens=True) != tokenizer.decode(ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="not the one this model was exported with"):
        check_tokenizer_matches(model, changed)
    source = model_copy.parent / "input.txt"
    assert main(["translate", "--model", str(model_copy), "--input", str(source), "--no-progress"]) == 2
    assert "is not the one this model was exported with" in error_line(capsys)


def test_a_folder_with_a_version_1_fingerprint_loads_and_is_checked_the_old_way(
    model_copy, other_tokenizer, tmp_path, capsys, caplog
):
    """A folder written by the previous version records the old fingerprint: its own tokenizer still passes (with a
    warning of what that fingerprint leaves out), another is still refused, and averaging it beside folders that
    record the new one compares each pair in the format both have."""
    data = json.loads((model_copy / "tokenizer.json").read_text())
    values = json.loads((model_copy / "config.json").read_text())
    values["tokenizer_fingerprint"] = version_1_fingerprint(data)
    (model_copy / "config.json").write_text(json.dumps(values))
    source = model_copy.parent / "input.txt"
    assert main(["translate", "--model", str(model_copy), "--input", str(source), "--no-progress"]) == 0
    assert f"The model {str(model_copy)!r} records a tokenizer fingerprint of an earlier format (v1)" in caplog.text
    assert "post-processor and the decoder: those were not checked" in caplog.text
    newer = shutil.copytree(model_copy, tmp_path / "newer")
    values["tokenizer_fingerprint"] = folder_tokenizer_fingerprint(newer)
    (newer / "config.json").write_text(json.dumps(values))
    averaged = average_checkpoints([model_copy, newer], save_to=tmp_path / "averaged")
    assert averaged.config.tokenizer_fingerprint == folder_tokenizer_fingerprint(newer)
    other_tokenizer.save_pretrained(model_copy)
    assert main(["translate", "--model", str(model_copy), "--input", str(source), "--no-progress"]) == 2
    assert "is not the one this model was exported with" in error_line(capsys)
    with pytest.raises(ValueError, match=r"different tokenizers \('.*newer' and '.*model' differ\)"):
        average_checkpoints([newer, model_copy])


def test_a_model_without_a_fingerprint_is_compared_on_what_can_be_and_warned_about(tiny_export, model_copy, caplog):
    values = json.loads((model_copy / "config.json").read_text())
    del values["tokenizer_fingerprint"]
    (model_copy / "config.json").write_text(json.dumps(values))
    model = AutoModelForSeq2SeqLM.from_pretrained(model_copy)
    tokenizer = AutoTokenizer.from_pretrained(model_copy)
    caplog.clear()
    check_tokenizer_matches(model, tokenizer)
    warning = (
        f"The model {str(model_copy)!r} records no tokenizer fingerprint (exported by hf-deep-nmt 0.1.0 or by another "
        "tool): only the vocabulary size and the special token ids were compared, not that the tokenizer is the one "
        "it was trained with."
    )
    assert warning in caplog.text
    caplog.clear()
    check_tokenizer_matches(model, tokenizer)
    assert caplog.text == ""  # once per model
    tokenizer.bos_token = "<unk>"  # another run's tokenizer numbering its special tokens otherwise
    with pytest.raises(ValueError, match=r"tokenizer's bos_token_id \(3\) differs from the model's \(0\)"):
        check_tokenizer_matches(model, tokenizer)
    fresh = type(model.config).from_dict(values)
    assert fresh._name_or_path == "" and fresh.tokenizer_fingerprint is None
    # a model built in this process, from the tokenizer at hand (as training builds one): nothing to warn about
    check_tokenizer_matches(SimpleNamespace(config=fresh), tiny_export[2])
    assert caplog.text == ""


def test_a_fingerprint_in_no_known_format_is_named(tiny_export):
    _, model, tokenizer = tiny_export
    config = model.config
    recorded = config.tokenizer_fingerprint
    try:
        config.tokenizer_fingerprint = "not-a-fingerprint"
        with pytest.raises(ValueError, match=r"records tokenizer_fingerprint 'not-a-fingerprint', which is not a"):
            check_tokenizer_matches(model, tokenizer)
    finally:
        config.tokenizer_fingerprint = recorded
