"""Nothing a user has is lost: one run per output folder (lock, recipe record, resume / clear / refuse), overwrites
that remove only what this package wrote, exports with the user's file modes, damaged checkpoints skipped, and mistakes
refused before any work. Every refusal leaves each file that was there byte-identical."""

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.cli import main
from hf_deep_nmt.data.corpus import load_parallel_dataset
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.hub import WRITTEN_MARKER, export_hub_folder
from hf_deep_nmt.training.arguments import ARGUMENT_CLASSES, StageArguments, parse_arguments
from hf_deep_nmt.training.averaging import average_checkpoints, list_checkpoints
from hf_deep_nmt.training.callbacks import checkpoint_problem, last_complete_checkpoint
from hf_deep_nmt.training.pipeline import run
from hf_deep_nmt.training.run_folder import LOCK_FILE, RUN_RECORD, RunFolder, RunFolderError
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
STEPS = 4


def tree(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `folder` (folders as 'dir')."""
    return {
        path.relative_to(folder).as_posix(): "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="module")
def corpus(sample_slice):
    return sample_slice(48, 400)


def recipe_arguments(corpus: Path, output_dir: Path, *extra: str) -> list[str]:
    recipe = output_dir.parent / f"{output_dir.name}-recipe.json"
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    recipe.write_text(json.dumps({"model_type": "deep_nmt", "model_overrides": OVERRIDES}))
    return [
        str(recipe),
        *("--train-file", str(corpus / "train.tsv"), "--validation-file", str(corpus / "valid.tsv")),
        *("--tokenizer-name-or-path", str(corpus / "tokenizer"), "--max-length-b", "2", "--num-beams", "1"),
        *("--max-source-length", "64", "--max-target-length", "64", "--max-steps", str(STEPS)),
        *("--save-strategy", "steps", "--save-steps", "1", "--per-device-train-batch-size", "8"),
        *("--output-dir", str(output_dir), "--report-to", "none", "--disable-tqdm", "true", "--use-cpu", "true"),
        *("--seed", "0", "--translate-examples", "0", "--plot-curves", "false"),
        *extra,
    ]


@pytest.fixture(scope="module")
def finished_run(corpus, tmp_path_factory):
    """A finished `train` run: checkpoint-1 .. -4, results.json and its record."""
    output_dir = tmp_path_factory.mktemp("finished") / "run"
    run(recipe_arguments(corpus, output_dir))
    return output_dir


@pytest.fixture
def old_run(finished_run, tmp_path):
    """A private copy of the finished run, in a folder where the recipe file of `recipe_arguments` is written."""
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def fail_on_training(monkeypatch):
    from hf_deep_nmt.data import preparation

    monkeypatch.setattr(preparation, "prepare_data", lambda *args, **kwargs: pytest.fail("work started"))


# ---- one run per output folder -------------------------------------------------------------------------------------


def test_a_second_run_into_a_locked_output_dir_is_refused(corpus, old_run, monkeypatch, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = old_run / LOCK_FILE
        lock.write_text(json.dumps({"pid": holder.pid, "host": os.uname().nodename, "command": "train"}))
        before = tree(old_run)
        fail_on_training(monkeypatch)
        assert main(["train", *recipe_arguments(corpus, old_run)]) == 2
        error = capsys.readouterr().err
        assert f"is in use by another hf-deep-nmt run (process {holder.pid}" in error and str(lock) in error
        assert tree(old_run) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_left_by_a_dead_process_is_taken_over_and_every_lock_is_released(tmp_path, caplog):
    dead_pid = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid.wait()
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_FILE).write_text(json.dumps({"pid": dead_pid.pid, "host": os.uname().nodename}))
    with caplog.at_level(logging.WARNING), RunFolder(folder, "train", {}):
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
        with pytest.raises(RunFolderError, match="in use by another hf-deep-nmt run"):
            with RunFolder(folder, "train", {}):
                pass
    assert f"left by process {dead_pid.pid}, which has ended" in caplog.text
    assert not (folder / LOCK_FILE).exists()
    with pytest.raises(KeyError):  # released on error too
        with RunFolder(folder, "train", {}):
            raise KeyError("stop")
    assert not (folder / LOCK_FILE).exists()


def test_an_output_dir_holding_another_recipe_or_an_unrecorded_run_is_refused(corpus, old_run, monkeypatch, capsys):
    fail_on_training(monkeypatch)
    before = tree(old_run)
    assert main(["train", *recipe_arguments(corpus, old_run, "--learning-rate", "0.01")]) == 2
    error = capsys.readouterr().err
    assert "holds a run of another recipe (learning_rate: 5e-05 -> 0.01)" in error
    assert "--resume-from-checkpoint last" in error and "--overwrite-output-dir true" in error
    (old_run / RUN_RECORD).unlink()
    before.pop(RUN_RECORD)
    assert main(["train", *recipe_arguments(corpus, old_run)]) == 2
    assert "outputs of an earlier run without a recipe record" in capsys.readouterr().err
    assert tree(old_run) == before


def test_a_folder_left_by_a_run_that_saved_nothing_is_taken_by_another_recipe(tmp_path, caplog):
    """A run refused or failed after it wrote its record but before it saved anything leaves only the record: a
    corrected recipe starts afresh there. A record of a finished run, or any saved output, still means refusal."""
    folder = tmp_path / "run"
    with pytest.raises(KeyError), RunFolder(folder, "train", {"learning_rate": 0.1}) as first:
        first.start(None, False)
        raise KeyError("failed while preparing")
    assert [path.name for path in folder.iterdir()] == [RUN_RECORD]
    with caplog.at_level(logging.WARNING), RunFolder(folder, "train", {"learning_rate": 0.01}) as second:
        assert second.start(None, False) is None
    assert "holds only the record of a run that saved nothing: starting afresh" in caplog.text
    assert json.loads((folder / RUN_RECORD).read_text()) == {
        "command": "train",
        "finished": False,
        "recipe": {"learning_rate": 0.01},
    }
    (folder / RUN_RECORD).write_text(json.dumps({"command": "train", "finished": True, "recipe": {"seed": 1}}))
    with (
        pytest.raises(RunFolderError, match=r"another recipe \(seed: 1"),
        RunFolder(folder, "train", {}) as third,
    ):
        third.start(None, False)
    (folder / RUN_RECORD).write_text(json.dumps({"command": "train", "finished": False, "recipe": {"seed": 1}}))
    (folder / "checkpoint-1").mkdir()
    with pytest.raises(RunFolderError, match="another recipe"), RunFolder(folder, "train", {}) as fourth:
        fourth.start(None, False)


def test_the_same_command_on_a_finished_run_is_refused_with_the_way_out(corpus, old_run, monkeypatch, capsys):
    fail_on_training(monkeypatch)
    before = tree(old_run)
    assert main(["train", *recipe_arguments(corpus, old_run)]) == 2
    error = capsys.readouterr().err
    assert "holds a finished run of this same recipe" in error and "--overwrite-output-dir true" in error
    assert tree(old_run) == before


def test_the_same_command_after_a_kill_continues_from_the_last_whole_checkpoint(corpus, old_run, caplog):
    # as a kill leaves it: no results, the record unfinished, the newest checkpoint's weights cut short
    (old_run / "results.json").unlink()
    record = json.loads((old_run / RUN_RECORD).read_text())
    (old_run / RUN_RECORD).write_text(json.dumps({**record, "finished": False}))
    weights = old_run / f"checkpoint-{STEPS}" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    kept = {name: tree(old_run / f"checkpoint-{name}") for name in (1, 2, 3)}
    with caplog.at_level(logging.WARNING):
        summary = run(recipe_arguments(corpus, old_run))
    assert "holds an interrupted run of this recipe: continuing it" in caplog.text
    assert f"checkpoint-{STEPS}/model.safetensors' is damaged" in caplog.text and "Resuming from" in caplog.text
    assert summary["train_steps"] == STEPS
    assert {name: tree(old_run / f"checkpoint-{name}") for name in (1, 2, 3)} == kept
    assert checkpoint_problem(old_run / f"checkpoint-{STEPS}") is None  # rewritten whole
    assert json.loads((old_run / RUN_RECORD).read_text())["finished"] is True


def test_overwrite_output_dir_removes_only_what_our_runs_wrote(corpus, old_run):
    (old_run / "notes.txt").write_text("mine")
    (old_run / "data").mkdir()
    (old_run / "data" / "extra.tsv").write_text("a\tb\n")
    kept = {name: tree(old_run)[name] for name in ("notes.txt", "data/extra.tsv")}
    run(recipe_arguments(corpus, old_run, "--max-steps", "2", "--overwrite-output-dir", "true"))
    assert {name: tree(old_run)[name] for name in kept} == kept
    assert sorted(path.name for path in old_run.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((old_run / "results.json").read_text())["train_steps"] == 2


def test_the_run_record_lists_what_the_run_wrote_and_its_shape(finished_run):
    record = json.loads((finished_run / RUN_RECORD).read_text())
    # each checkpoint, the checksum record beside them, the results
    expected = [f"checkpoint-{step}" for step in range(1, STEPS + 1)] + ["checkpoint_checksums.json", "results.json"]
    assert record["written"] == expected
    # one process, 8 sentences a device, no accumulation
    assert record["shape"] == {
        "world_size": 1,
        "per_process": 8,
        "gradient_accumulation_steps": 1,
        "unit": "sentences",
        "per_update": 8,
    }


def interrupted(folder: Path, **shape) -> None:
    """Make `folder` look like a run killed before its end, trained with `shape` changed in its record."""
    (folder / "results.json").unlink()
    record = json.loads((folder / RUN_RECORD).read_text())
    (folder / RUN_RECORD).write_text(json.dumps({**record, "finished": False, "shape": {**record["shape"], **shape}}))


def test_a_run_continued_with_another_process_count_or_update_size_is_refused(corpus, old_run, monkeypatch, capsys):
    interrupted(old_run, world_size=2, per_update=16)
    before = tree(old_run)
    fail_on_training(monkeypatch)
    assert main(["train", *recipe_arguments(corpus, old_run)]) == 2
    error = capsys.readouterr().err
    assert "was trained with 2 process(es), 16 sentences per update (8 x 1 accumulation x 2)" in error
    assert "this one has 1 process(es), 8 sentences per update (8 x 1 accumulation x 1)" in error
    assert "launch it with 2 process(es)" in error
    assert (
        "keep 16 sentences per update with `--gradient-accumulation-steps 2` or `--per-device-train-batch-size 16`"
        in error
    )
    assert main(["train", *recipe_arguments(corpus, old_run, "--resume-from-checkpoint", "last")]) == 2
    assert "Cannot continue" in capsys.readouterr().err
    assert tree(old_run) == before


def test_another_process_count_with_the_same_update_size_needs_an_explicit_resume(tmp_path, caplog):
    folder = tmp_path / "run"
    (folder / "checkpoint-1").mkdir(parents=True)
    recorded = {"world_size": 2, "per_process": 4, "gradient_accumulation_steps": 1, "unit": "tokens", "per_update": 8}
    now = {**recorded, "world_size": 1, "per_process": 8}
    (folder / RUN_RECORD).write_text(json.dumps({"command": "train", "recipe": {}, "shape": recorded}))
    with pytest.raises(RunFolderError, match=r"accept the new data order with `--resume-from-checkpoint last`"):
        with RunFolder(folder, "train", {}, now) as again:
            again.start(None, False)
    with caplog.at_level(logging.WARNING), RunFolder(folder, "train", {}, now) as resumed:
        assert resumed.start("last", False) == "last"
    assert "Resuming with another process count" in caplog.text
    assert json.loads((folder / RUN_RECORD).read_text())["shape"] == now


def test_two_processes_after_one_are_refused_naming_the_settings_that_keep_the_tokens_per_update(tmp_path):
    folder = tmp_path / "run"
    (folder / "checkpoint-5").mkdir(parents=True)
    one = {"world_size": 1, "per_process": 4096, "gradient_accumulation_steps": 2, "unit": "tokens"}
    one["per_update"] = 4096 * 2 * 1
    two = {**one, "world_size": 2, "per_update": 16384}  # the same recipe under a launcher of 2 processes
    (folder / RUN_RECORD).write_text(json.dumps({"command": "train", "recipe": {}, "shape": one}))
    message = (
        r"trained with 1 process\(es\), 8192 tokens per update \(4096 x 2 accumulation x 1\), this one has 2 "
        r"process\(es\), 16384 tokens per update \(4096 x 2 accumulation x 2\)\. To continue it, launch it with 1 "
        r"process\(es\) .*; or keep 8192 tokens per update with `--gradient-accumulation-steps 1` or "
        r"`--max-tokens 2048` and `--resume-from-checkpoint last`"
    )
    for resume in (None, "last"):
        with pytest.raises(RunFolderError, match=message), RunFolder(folder, "train", {}, two) as again:
            again.start(resume, False)
    assert json.loads((folder / RUN_RECORD).read_text())["shape"] == one


def test_overwrite_keeps_the_tokenizer_the_recipe_reads_from_the_output_dir(corpus, old_run, caplog):
    shutil.copytree(corpus / "tokenizer", old_run / "tokenizer")
    kept = tree(old_run / "tokenizer")
    arguments = recipe_arguments(corpus, old_run, "--max-steps", "1", "--overwrite-output-dir", "true")
    arguments[arguments.index("--tokenizer-name-or-path") + 1] = str(old_run / "tokenizer")
    run(arguments)  # not listed as ours: neither removed nor counted as an earlier output
    assert tree(old_run / "tokenizer") == kept
    assert sorted(path.name for path in old_run.glob("checkpoint-*")) == ["checkpoint-1"]
    record = json.loads((old_run / RUN_RECORD).read_text())
    (old_run / RUN_RECORD).write_text(json.dumps({**record, "written": [*record["written"], "tokenizer"]}))
    with caplog.at_level(logging.WARNING):
        run(arguments)  # listed (as a train-staged run writes it), but the recipe reads it
    assert tree(old_run / "tokenizer") == kept
    assert f"keeping '{old_run / 'tokenizer'}': the recipe reads" in caplog.text
    assert json.loads((old_run / RUN_RECORD).read_text())["written"] == [
        "checkpoint-1",
        "checkpoint_checksums.json",
        "results.json",
        "tokenizer",
    ]


def test_overwrite_refuses_a_folder_no_record_lists_and_removes_nothing(corpus, old_run, monkeypatch, capsys):
    record = json.loads((old_run / RUN_RECORD).read_text())
    del record["written"]  # as an older version wrote it
    (old_run / RUN_RECORD).write_text(json.dumps(record))
    before = tree(old_run)
    fail_on_training(monkeypatch)
    assert main(["train", *recipe_arguments(corpus, old_run, "--overwrite-output-dir", "true")]) == 2
    error = capsys.readouterr().err
    names = [f"checkpoint-{step}" for step in range(1, STEPS + 1)] + ["results.json"]
    assert f"holds {names}, which may not be removed: no record lists them as written" in error
    assert "Nothing was removed" in error and "choose another output_dir" in error
    assert tree(old_run) == before
    (old_run / RUN_RECORD).unlink()  # no record at all: the same
    assert main(["train", *recipe_arguments(corpus, old_run, "--overwrite-output-dir", "true")]) == 2
    assert "Nothing was removed" in capsys.readouterr().err
    assert sorted(tree(old_run)) == sorted(name for name in before if name != RUN_RECORD)


def test_train_staged_never_saves_its_tokenizer_into_a_folder_of_other_files(tmp_path):
    from hf_deep_nmt.training.arguments import ModelArguments
    from hf_deep_nmt.training.pipeline import load_tokenizer

    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "notes.txt").write_text("mine")
    raw = {"train": {"source": ["hola mundo"] * 4, "target": ["hello world"] * 4}}
    message = rf"'{tmp_path}/tokenizer', where this run saves the tokenizer it trains, already holds files but no"
    with pytest.raises(FileExistsError, match=message):
        load_tokenizer(ModelArguments(model_type="deep_nmt"), raw, tmp_path / "tokenizer")
    assert [path.name for path in (tmp_path / "tokenizer").iterdir()] == ["notes.txt"]


def test_translate_refuses_an_output_that_is_the_file_read_on_stdin(tmp_path, monkeypatch, capsys):
    source = tmp_path / "source.txt"
    source.write_text("hola\n")
    os.link(source, tmp_path / "other-name.txt")
    for output in (source, tmp_path / "other-name.txt"):
        with source.open() as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            arguments = ["translate", "--model", str(tmp_path / "no-model"), "--output", str(output), "--overwrite"]
            assert main(arguments) == 2
        assert f"output {output} is the file stdin is read from" in capsys.readouterr().err
    assert source.read_text() == "hola\n"
    with (tmp_path / "other.txt").open("w+") as stdin:  # another file on stdin: the output is not refused for it
        monkeypatch.setattr(sys, "stdin", stdin)
        assert main(["translate", "--model", str(tmp_path / "no-model"), "--output", str(source), "--overwrite"]) == 2
    assert "stdin is read from" not in capsys.readouterr().err


def test_train_staged_refuses_a_folder_of_another_recipe(corpus, tmp_path, monkeypatch):
    output_dir = tmp_path / "staged"
    arguments = [*recipe_arguments(corpus, output_dir), "--stage-depths", "1", "2", "--stage-max-steps", "2"]
    classes = (*ARGUMENT_CLASSES, StageArguments)
    from hf_deep_nmt.training.run_folder import run_recipe

    old = run_recipe(*parse_arguments([*arguments[:-1], "3"], classes))
    (output_dir / "stage-1-1-layers").mkdir(parents=True)
    (output_dir / "stage-1-1-layers" / "stage.json").write_text('{"stage": 1, "steps": 3}')
    (output_dir / RUN_RECORD).write_text(json.dumps({"command": "train-staged", "finished": True, "recipe": old}))
    before = tree(output_dir)
    fail_on_training(monkeypatch)
    with pytest.raises(RunFolderError, match=r"another recipe \(stage_max_steps: 3 -> 2\)"):
        run_staged(arguments)
    assert tree(output_dir) == before


# ---- exports and averages ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["output_dir", "corpus", "holds_output"])
def test_an_export_into_the_output_or_corpus_folder_is_refused_before_work(corpus, tmp_path, where, monkeypatch):
    shutil.copytree(corpus, tmp_path / "corpus")
    output_dir = tmp_path / "out" / "run"
    export = {"output_dir": output_dir, "corpus": tmp_path / "corpus", "holds_output": tmp_path / "out"}[where]
    arguments = recipe_arguments(tmp_path / "corpus", output_dir, "--export-dir", str(export))
    arguments += ["--overwrite-export", "true"]
    before = tree(tmp_path)
    fail_on_training(monkeypatch)
    message = {"output_dir": "is the training output_dir", "corpus": "is the folder of the corpus file"}
    with pytest.raises(ValueError, match=message.get(where, "is inside export_dir")):
        run(arguments)
    assert tree(tmp_path) == before


def test_an_export_under_an_unwritable_folder_is_refused_before_work(corpus, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    parent = Path("/sys") if os.geteuid() == 0 else locked  # root writes anywhere but on a read-only mount
    fail_on_training(monkeypatch)
    try:
        with pytest.raises(PermissionError, match=rf"Export folder '{parent}/export' cannot be written"):
            run(recipe_arguments(corpus, tmp_path / "run", "--export-dir", str(parent / "export")))
    finally:
        locked.chmod(0o755)


@pytest.fixture
def checkpoints(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def test_average_refuses_to_write_over_its_inputs_or_their_output_folder(checkpoints, capsys):
    inputs = [str(checkpoints / "checkpoint-3"), str(checkpoints / "checkpoint-4")]
    before = tree(checkpoints)
    assert main(["average", *inputs, "--output", str(checkpoints), "--overwrite"]) == 2
    error = capsys.readouterr().err
    assert "is the Trainer output folder holding the checkpoint" in error
    assert main(["average", *inputs, "--output", inputs[0], "--overwrite"]) == 2
    assert "is one of the averaged checkpoints" in capsys.readouterr().err
    assert tree(checkpoints) == before


def test_an_average_overwrites_only_an_earlier_average_and_carries_the_tokenizer(checkpoints, tmp_path, capsys):
    target = tmp_path / "averaged"
    assert main(["average", "--run", str(checkpoints), "--last", "2", "--output", str(target)]) == 0
    assert (target / "tokenizer.json").is_file() and (target / WRITTEN_MARKER).is_file()
    assert main(["average", "--run", str(checkpoints), "--last", "2", "--output", str(target)]) == 2
    error = capsys.readouterr().err
    assert "`--overwrite` on the command line" in error and "overwrite_export" not in error
    assert main(["average", str(checkpoints / "checkpoint-1"), "--output", str(target), "--overwrite"]) == 0
    expected = load_file(checkpoints / "checkpoint-1" / "model.safetensors")
    assert torch.equal(load_file(target / "model.safetensors")["model.shared.weight"], expected["model.shared.weight"])
    (target / "notes.txt").write_text("mine")
    before = tree(target)
    assert main(["average", str(checkpoints / "checkpoint-2"), "--output", str(target), "--overwrite"]) == 2
    assert "holds files that no export or average of hf-deep-nmt wrote (['notes.txt'])" in capsys.readouterr().err
    assert tree(target) == before


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_get_the_users_normal_mode(tiny_config, tmp_path, umask):
    tokenizer = train_joint_tokenizer([("hola mundo", "hello world")] * 20, vocab_size=80, min_frequency=1)
    model = DlclForConditionalGeneration(tiny_config(DlclConfig, vocab_size=len(tokenizer)))
    previous = os.umask(umask)
    try:
        folder = export_hub_folder(model, tokenizer, tmp_path / "export")
    finally:
        os.umask(previous)
    assert folder.stat().st_mode & 0o777 == 0o777 & ~umask
    modes = {path.name: path.stat().st_mode & 0o777 for path in folder.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}


# ---- damaged checkpoints -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    ["truncated model.safetensors", "truncated optimizer.pt", "no scheduler.pt", "no rng_state.pth"],
)
def test_a_damaged_or_partial_newest_checkpoint_is_skipped_for_resume_and_averaging(checkpoints, damage, caplog):
    newest = checkpoints / f"checkpoint-{STEPS}"
    verb, name = damage.split(" ")
    if verb == "truncated":
        (newest / name).write_bytes((newest / name).read_bytes()[: (newest / name).stat().st_size // 2])
    else:
        (newest / name).unlink()
    with caplog.at_level(logging.WARNING):
        assert last_complete_checkpoint(checkpoints) == str(checkpoints / f"checkpoint-{STEPS - 1}")
        assert [path.name for path in list_checkpoints(checkpoints)][-1] == f"checkpoint-{STEPS - 1}"
    assert "damaged" in caplog.text or f"has no {name}" in caplog.text
    with pytest.raises(ValueError, match=r"cannot be averaged"):
        average_checkpoints([newest])


# ---- mistakes refused before any work -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--max-eval-samples", "-3"), r"`max_eval_samples` must be >= 1, got -3"),
        (("--num-beams", "0"), r"`num_beams` must be >= 1, got 0"),
        (("--per-device-eval-batch-size", "0"), r"`per_device_eval_batch_size` must be >= 1, got 0"),
        (("--gradient-accumulation-steps", "0"), r"`gradient_accumulation_steps` must be >= 1, got 0"),
        (
            ("--bleu-tokenize", "13b"),
            r"`bleu_tokenize` must be one of sacreBLEU's tokenizers .*\(did you mean '13a'\?\)",
        ),
        (("--length-penalty", "nan"), r"`length_penalty` must be a finite number, got nan"),
        (("--max-length-a", "inf"), r"`max_length_a` must be a finite number, got inf"),
        (("--max-length-a", "1e6"), r"= 1000000.0 \* 64 \+ 2 = 6.4e\+07 tokens must be between 1 and 4096"),
        (("--max-length-a", "0", "--max-length-b", "0"), r"= 0.0 \* 64 \+ 0 = 0 tokens must be between 1 and 4096"),
    ],
)
def test_bad_settings_are_refused_before_any_work(corpus, tmp_path, flags, message, monkeypatch):
    fail_on_training(monkeypatch)
    before = tree(tmp_path)
    with pytest.raises(ValueError, match=message):
        run(recipe_arguments(corpus, tmp_path / "run", *flags))
    assert tree(tmp_path) == {**before, "run-recipe.json": tree(tmp_path)["run-recipe.json"]}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"msc_context": "bogus"}, r"`msc_context` must be one of \('gru', .*\), got 'bogus'"),
        ({"msc_context": "ffn"}, r"`msc_context='ffn'`.* only apply to MSC: set `msc_block_layers`"),
        ({"dropout": 1.5}, r"`dropout` must be a number in \[0, 1\), got 1.5"),
    ],
)
def test_a_bad_override_value_is_refused_before_any_work(corpus, tmp_path, override, message, monkeypatch):
    fail_on_training(monkeypatch)
    arguments = recipe_arguments(corpus, tmp_path / "run")
    Path(arguments[0]).write_text(json.dumps({"model_type": "deep_nmt", "model_overrides": {**OVERRIDES, **override}}))
    with pytest.raises(ValueError, match=message):
        run(arguments)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config", [None, "{}"])
def test_train_without_a_recipe_is_refused_naming_what_is_missing(tmp_path, config, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    arguments = []
    if config is not None:
        (tmp_path / "empty.json").write_text(config)
        arguments = ["empty.json"]
    assert main(["train", *arguments]) == 2
    error = capsys.readouterr().err
    assert "needs a recipe naming a model (`model_type`" in error and "and an `output_dir`" in error
    assert sorted(path.name for path in tmp_path.iterdir()) == (["empty.json"] if config else [])


def test_an_empty_validation_file_is_refused_by_name(corpus, tmp_path):
    (tmp_path / "valid.tsv").write_text("")
    with pytest.raises(ValueError, match=rf"`validation_file` '{tmp_path}/valid.tsv' holds no sentence pairs"):
        load_parallel_dataset(train_file=corpus / "train.tsv", validation_file=tmp_path / "valid.tsv")
    (tmp_path / "train.tsv").write_text("\n\n")
    with pytest.raises(ValueError, match=r"`train_file` .* holds no sentence pairs; give a corpus") as error:
        load_parallel_dataset(train_file=tmp_path / "train.tsv")
    assert "raise" not in str(error.value)


def test_a_byte_order_mark_is_dropped_and_a_nul_byte_refused(tmp_path):
    (tmp_path / "bom.tsv").write_bytes("\ufeffhola\thello\nadiós\tbye\n".encode())
    assert load_parallel_dataset(train_file=tmp_path / "bom.tsv")["train"]["source"] == ["hola", "adiós"]
    (tmp_path / "nul.tsv").write_bytes(b"hola\thello\nadi\x00os\tbye\n")
    with pytest.raises(ValueError, match=r"nul.tsv:2: NUL byte at column 4"):
        load_parallel_dataset(train_file=tmp_path / "nul.tsv")


def test_a_header_line_and_training_on_the_validation_file_are_warned_about(corpus, tmp_path, caplog):
    lines = (corpus / "train.tsv").read_text(encoding="utf-8")
    (tmp_path / "train.tsv").write_text("source\ttarget\n" + lines, encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        raw = load_parallel_dataset(
            train_file=tmp_path / "train.tsv", validation_file=tmp_path / "train.tsv", source_lang="es"
        )
    assert raw["train"]["source"][0] == "source"  # kept: it is only a warning
    assert "train.tsv:1 looks like a header ('source' / 'target')" in caplog.text
    assert "The validation file is the training file" in caplog.text


def test_a_dataset_name_offline_fails_at_once_saying_so(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match=r"Dataset 'no-such/corpus' cannot be loaded: HF_HUB_OFFLINE is set"):
        load_parallel_dataset(dataset_name="no-such/corpus")


def test_a_saved_model_with_a_smaller_tokenizer_is_refused(corpus, finished_run, tmp_path, monkeypatch):
    small = tmp_path / "small-tokenizer"
    pairs = [line.split("\t") for line in (corpus / "train.tsv").read_text().splitlines()]
    smaller = train_joint_tokenizer(pairs, vocab_size=300)
    smaller.save_pretrained(small)
    model_vocab = json.loads((finished_run / "checkpoint-4" / "config.json").read_text())["vocab_size"]
    assert len(smaller) < model_vocab
    from hf_deep_nmt.training import pipeline as training

    arguments = recipe_arguments(corpus, tmp_path / "run", "--model-name-or-path", str(finished_run / "checkpoint-4"))
    arguments[arguments.index("--tokenizer-name-or-path") + 1] = str(small)
    monkeypatch.setattr(training, "build_model", lambda *args: pytest.fail("model built"))
    with pytest.raises(
        ValueError, match=rf"has {len(smaller)} tokens but the model .* has a vocabulary of {model_vocab}"
    ):
        run(arguments)


def test_a_record_written_before_a_setting_existed_resumes_only_at_the_value_it_trained_with():
    from hf_deep_nmt.data.streaming import DEFAULT_STREAM_BUFFER_PAIRS
    from hf_deep_nmt.training.run_folder import ADDED_SETTINGS, recipe_differences

    assert ADDED_SETTINGS["stream_buffer_pairs"] == DEFAULT_STREAM_BUFFER_PAIRS
    old_record = {"learning_rate": 0.001, "max_steps": 10}
    today = {**old_record, "streaming": False, "stream_buffer_pairs": 100_000, "tokenizer_train_pairs": None}
    assert recipe_differences(old_record, today) == []
    assert recipe_differences(old_record, {**today, "streaming": True}) == ["streaming: '(unset)' -> True"]
    assert recipe_differences(old_record, {**today, "tokenizer_train_pairs": 500}) == [
        "tokenizer_train_pairs: '(unset)' -> 500"
    ]
    # a record that holds the setting compares it as any other
    assert recipe_differences({**today, "streaming": True}, today) == ["streaming: True -> False"]
