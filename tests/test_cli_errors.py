"""The command line's failures: one line on stderr naming the problem and the way out, exit code 2 for a mistake in
what was asked and 1 for a run that failed, the traceback only with `--debug` or `HF_DEEP_NMT_DEBUG=1`; and every
file there before is byte-identical afterwards."""

import errno
import io
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.cli import COMMANDS, main
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.hub import export_hub_folder, push_to_hub, upload_operations
from hf_deep_nmt.training.callbacks import NonFiniteTrainingError

PAIRS = [("el sol sale", "the sun rises"), ("la mar no se llena", "the sea is not full"), ("hola mundo", "hi")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_config):
    tokenizer = train_joint_tokenizer(PAIRS * 20, vocab_size=120, min_frequency=1)
    model = DlclForConditionalGeneration(tiny_config(DlclConfig, vocab_size=len(tokenizer)))
    return export_hub_folder(model, tokenizer, tmp_path_factory.mktemp("export") / "repo", repo_id="org/tiny")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }


def error_line(capsys) -> str:
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error, error
    return error


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "in.es"
    path.write_text("hola\nel sol sale\n", encoding="utf-8")
    return path


# ---- --debug ------------------------------------------------------------------------------------------------------


def test_the_traceback_is_shown_only_with_debug(tmp_path, capsys, monkeypatch):
    command = ["translate", "--model", "x", "--input", str(tmp_path / "absent.es")]
    assert main(command) == 2
    assert "input file not found" in error_line(capsys)
    assert main(["--debug", *command]) == 2
    error = capsys.readouterr().err
    assert error.startswith("Traceback") and "FileNotFoundError" in error
    assert error.splitlines()[-1] == f"hf-deep-nmt translate: error: input file not found: {tmp_path / 'absent.es'}"
    monkeypatch.setenv("HF_DEEP_NMT_DEBUG", "1")
    assert main(command) == 2 and capsys.readouterr().err.startswith("Traceback")
    monkeypatch.setenv("HF_DEEP_NMT_DEBUG", "0")
    assert main(command) == 2 and "Traceback" not in capsys.readouterr().err


def test_argument_mistakes_are_one_line_with_exit_code_2(capsys):
    assert main(["translate", "--input", "in.es"]) == 2
    assert "the following arguments are required: --model (see `hf-deep-nmt translate --help`)" in error_line(capsys)
    assert main(["push", "--model", "only-a-folder"]) == 2
    assert "required: --repo-id" in error_line(capsys)


# ---- failures of a run: exit code 1 ---------------------------------------------------------------------------------


def _raising(error: BaseException):
    def command(argv):
        raise error

    return command


@pytest.mark.parametrize(
    ("error", "code", "expected"),
    [
        (
            NonFiniteTrainingError("Non-finite loss nan at optimizer step 7; the last checkpoint is checkpoint-5."),
            1,
            "error: Non-finite loss nan at optimizer step 7; the last checkpoint is checkpoint-5.",
        ),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"), 1, "out of memory (CUDA"),
        (PermissionError(errno.EACCES, "Permission denied", "/runs/x"), 1, "Permission denied: '/runs/x' (check"),
        (OSError(errno.ENOSPC, "No space left on device"), 1, "no space left on the device"),
        (KeyError("weights"), 1, "KeyError: 'weights' (unexpected; rerun with --debug for the traceback)"),
        (ValueError("first line\n  second line"), 2, "error: first line second line"),
        (KeyboardInterrupt(), 130, "error: interrupted"),
    ],
)
def test_each_failure_is_one_line_with_its_exit_code(monkeypatch, capsys, error, code, expected):
    monkeypatch.setitem(COMMANDS, "train", _raising(error))
    assert main(["train", "recipe.json"]) == code
    line = error_line(capsys)
    assert line.startswith("hf-deep-nmt train: error: ") and expected in line


def test_a_type_error_is_reported_as_unexpected_with_the_way_to_its_traceback(monkeypatch, capsys):
    # the checks raise ValueError for a user's mistake; a TypeError is a programming error and must not read as one
    monkeypatch.setitem(COMMANDS, "train", _raising(TypeError("unsupported operand type(s) for +: 'int' and 'str'")))
    assert main(["train", "recipe.json"]) == 1
    line = error_line(capsys)
    assert "TypeError: unsupported operand type(s) for +: 'int' and 'str'" in line
    assert "(unexpected; rerun with --debug for the traceback)" in line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_write_failure_while_translating_is_a_run_failure(exported, source, capsys):
    assert (
        main(["translate", "--model", str(exported), "--input", str(source), "--output", "/dev/full", "--no-progress"])
        == 1
    )
    assert "no space left on the device" in error_line(capsys)


# ---- devices --------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused_before_the_model_is_loaded(source, tmp_path, capsys):
    command = ["translate", "--model", str(tmp_path / "no-model"), "--input", str(source), "--device", "cuda:0"]
    assert main(command) == 2
    error = error_line(capsys)
    assert "--device cuda:0: CUDA is not available here" in error and "use --device cpu" in error
    assert "no-model" not in error


@pytest.mark.parametrize(("device", "expected"), [("gpu", "is not a device name"), ("meta", "is not supported")])
def test_an_unknown_device_names_the_valid_ones(source, tmp_path, capsys, device, expected):
    command = ["translate", "--model", str(tmp_path / "no-model"), "--input", str(source), "--device", device]
    assert main(command) == 2
    error = error_line(capsys)
    assert expected in error and "cpu, cuda, cuda:N or mps" in error


# ---- paths ----------------------------------------------------------------------------------------------------------


def test_an_unwritable_output_folder_is_refused_before_loading(exported, source, tmp_path, monkeypatch, capsys):
    before = snapshot(tmp_path)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert main(["translate", "--model", str(exported), "--input", str(source), "--output", str(tmp_path / "o")]) == 1
    assert f"the folder {tmp_path} is not writable" in error_line(capsys)
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the file modes say")
def test_unreadable_input_and_read_only_folder_are_permission_errors(exported, source, tmp_path, capsys):
    source.chmod(0)
    try:
        assert main(["translate", "--model", str(exported), "--input", str(source)]) == 1
        assert "cannot read the input file" in error_line(capsys)
    finally:
        source.chmod(0o644)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert main(["translate", "--model", str(exported), "--input", str(source), "--output", str(locked / "o")]) == 1
    assert "is not writable" in error_line(capsys)


def test_a_missing_relative_model_path_says_it_is_neither_a_folder_nor_a_cached_repository(
    source, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    for model in ("runs/model", "model"):
        assert main(["translate", "--model", model, "--input", str(source)]) == 2
        error = error_line(capsys)
        assert f"Model {model!r} is not a local folder (no such folder: {tmp_path / model})" in error
        assert "offline mode (HF_HUB_OFFLINE is set)" in error
    assert main(["translate", "--model", "runs//model", "--input", str(source)]) == 2
    assert "neither a local folder" in error_line(capsys)


@pytest.mark.parametrize(
    ("removed", "expected"),
    [
        (("tokenizer.json", "tokenizer_config.json"), "has no tokenizer files (expected tokenizer.json and"),
        (("config.json",), "has no config.json: it is not a saved model"),
    ],
)
def test_a_model_folder_missing_its_tokenizer_or_config_says_which_files(
    exported, source, tmp_path, capsys, removed, expected
):
    folder = tmp_path / "model"
    shutil.copytree(exported, folder)
    for name in removed:
        (folder / name).unlink()
    before = snapshot(tmp_path)
    assert main(["translate", "--model", str(folder), "--input", str(source)]) == 2
    error = error_line(capsys)
    assert expected in error and "sentencepiece" not in error
    assert snapshot(tmp_path) == before


def test_non_utf8_input_names_the_file_line_and_byte(exported, tmp_path, monkeypatch, capsys):
    data = b"hola\nbuen\xe9 d\xeda\n"
    path = tmp_path / "latin1.es"
    path.write_bytes(data)
    assert main(["translate", "--model", str(exported), "--input", str(path)]) == 2
    assert f"{path} is not valid UTF-8: byte 9 (line 2) is 0xe9 (invalid continuation byte)" in error_line(capsys)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert main(["translate", "--model", str(exported)]) == 2
    assert "stdin is not valid UTF-8: byte 9 (line 2)" in error_line(capsys)
    assert path.read_bytes() == data


def test_a_folder_or_fifo_as_input_is_not_a_regular_file(exported, tmp_path, capsys):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["translate", "--model", str(exported), "--input", str(tmp_path)]) == 2
    assert f"input {tmp_path} is a folder, not a text file" in error_line(capsys)
    assert main(["translate", "--model", str(exported), "--input", str(fifo)]) == 2
    error = error_line(capsys)
    assert f"input {fifo} is not a regular file" in error and "not found" not in error and "stdin" in error


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_line(exported, tmp_path, capsys):
    plain, marked = tmp_path / "plain.es", tmp_path / "marked.es"
    plain.write_bytes(b"hola\n")
    marked.write_bytes(b"\xef\xbb\xbfhola\n")
    for path in (plain, marked):
        assert main(["translate", "--model", str(exported), "--input", str(path), "--output", f"{path}.en"]) == 0
    assert Path(f"{marked}.en").read_bytes() == Path(f"{plain}.en").read_bytes()


# ---- push -----------------------------------------------------------------------------------------------------------


def test_push_in_offline_mode_fails_at_once_saying_so(exported, capsys):
    assert constants.is_offline_mode()
    assert main(["push", "--model", str(exported), "--repo-id", "org/tiny"]) == 1
    error = error_line(capsys)
    assert "offline mode is on (HF_HUB_OFFLINE is set)" in error and "--dry-run" in error


def test_push_without_network_says_the_hub_cannot_be_reached(exported, monkeypatch, capsys):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert main(["push", "--model", str(exported), "--repo-id", "org/tiny"]) == 1
    error = error_line(capsys)
    assert "cannot reach the Hugging Face Hub at https://huggingface.co" in error and "nothing was uploaded" in error


class RecordingApi:
    def __init__(self):
        self.calls = []

    def repo_exists(self, repo_id, repo_type=None):
        return False

    def create_repo(self, repo_id, **kwargs):
        self.calls.append("create_repo")

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append("create_commit")


@pytest.mark.parametrize("kind", ["file", "folder", "dangling"])
def test_push_refuses_a_symlink_leading_out_of_the_export_folder(exported, tmp_path, capsys, kind):
    folder = tmp_path / "repo"
    shutil.copytree(exported, folder)
    outside = tmp_path / "secrets"
    outside.mkdir()
    (outside / "token").write_text("hf_private")
    target = {"file": outside / "token", "folder": outside, "dangling": tmp_path / "gone"}[kind]
    (folder / "extra").symlink_to(target)
    before = snapshot(tmp_path)
    push = ["push", "--model", str(folder), "--repo-id", "org/tiny"]
    for command in ([*push, "--dry-run"], push):
        assert main(command) == 2
        error = error_line(capsys)
        assert f"{folder / 'extra'} is a symbolic link to {str(target)!r}, outside the export folder" in error
    api = RecordingApi()
    with pytest.raises(ValueError, match="outside the export folder"):
        push_to_hub(folder, "org/tiny", api=api)
    assert api.calls == [] and snapshot(tmp_path) == before


def test_push_uploads_a_link_to_a_file_inside_the_folder_and_refuses_a_link_to_a_folder(exported, tmp_path):
    folder = tmp_path / "repo"
    shutil.copytree(exported, folder)
    (folder / "docs").mkdir()
    (folder / "docs" / "card.md").symlink_to(folder / "README.md")
    paths = {operation.path_in_repo: operation.path_or_fileobj for operation in upload_operations(folder)}
    assert paths["docs/card.md"] == str(folder / "docs" / "card.md")
    (folder / "more").symlink_to(folder / "docs")
    with pytest.raises(ValueError, match=r"more is a symbolic link to a folder"):
        upload_operations(folder)


# ---- issue 40, class 7: the commands' remaining silent and misleading one-liners ------------------------------------


def test_no_command_is_a_usage_error_and_help_is_not(capsys):
    assert main([]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-deep-nmt: error: a command is required (see `hf-deep-nmt --help`).\nusage:")
    assert main(["--help"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("usage: hf-deep-nmt") and printed.err == ""


@pytest.mark.parametrize(
    "command, message",
    [
        (
            ["inspect", "--model", "m", "--output", "o", "--max-length", "0"],
            "argument --max-length: must be an integer >= 2, got '0'",
        ),
        (
            ["inspect", "--model", "m", "--output", "o", "--num-sentences", "-1"],
            "argument --num-sentences: must be an integer >= 1, got '-1'",
        ),
        (
            ["export-ctranslate2", "--model", "m", "--output", "o", "--max-positions", "1"],
            "argument --max-positions: must be an integer >= 2, got '1'",
        ),
        (
            ["average", "--run", "run", "--last", "0", "--output", "avg"],
            "argument --last: must be an integer >= 1",
        ),
        (["translate", "--model", "m", "--output", ""], "argument --output: must name a path, got ''"),
        (["inspect", "--model", "m", "--output", " "], "argument --output: must name a path, got ' '"),
        (["grow", "--model", "m", "--output", "", "--layers", "1"], "argument --output: must name a path, got ''"),
        (["export-ctranslate2", "--model", "m", "--output", ""], "argument --output: must name a path, got ''"),
        (["upgrade-code", "--model", ""], "argument --model: must name a path, got ''"),
    ],
)
def test_sizes_a_command_cannot_work_with_are_refused_by_the_parser(tmp_path, monkeypatch, capsys, command, message):
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    assert message in error_line(capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("repo_id", ["not a/valid/id", "org/", "org//x"])
def test_push_names_an_invalid_repo_id_even_in_a_dry_run(exported, capsys, repo_id):
    for extra in (["--dry-run"], []):
        assert main(["push", "--model", str(exported), "--repo-id", repo_id, *extra]) == 2
        error = error_line(capsys)
        assert f"--repo-id {repo_id!r} is not a Hub repository id (" in error and "'your-name/model-name'" in error
        assert "repo_type" not in error


def test_translate_names_a_closed_stdin_and_a_closed_stdout(tmp_path):
    """A real process started with stdin and stdout closed (Python then has no stream there): both cases in one."""
    import subprocess

    source = tmp_path / "in.es"
    source.write_text("hola\n", encoding="utf-8")
    script = (
        "import sys\nfrom hf_deep_nmt_cli import main\n"  # the command line's entry: refusals import no torch
        "print('codes', main(['translate', '--model', 'absent']), "
        f"main(['translate', '--model', 'absent', '--input', {str(source)!r}]), file=sys.stderr)\n"
    )

    def close_stdin_and_stdout():
        os.close(0)
        os.close(1)

    done = subprocess.run(
        [sys.executable, "-c", script],
        preexec_fn=close_stdin_and_stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    lines = done.stderr.splitlines()
    assert lines[-1] == "codes 2 2", done.stderr
    assert lines[-3] == (
        "hf-deep-nmt translate: error: --input - reads stdin, but stdin is closed; name a file with --input, or pipe "
        "the text in."
    )
    assert lines[-2] == (
        "hf-deep-nmt translate: error: --output - writes to stdout, but stdout is closed; name a file with --output, "
        "or redirect stdout."
    )
