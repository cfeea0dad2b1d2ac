"""Publishing through huggingface_hub (offline: exactly which files would be uploaded, what is refused), the
translate command (file or stdin in, file or stdout out, order kept) and the training-curves plot."""

import builtins
import io
import logging
import sys

import pytest
import torch
from huggingface_hub import CommitOperationAdd, CommitOperationDelete

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.cli import main
from hf_deep_nmt.curves import curve_points, plot_training_curves
from hf_deep_nmt.hub import export_hub_folder, push_to_hub, upload_operations
from hf_deep_nmt.tokenizer import train_joint_tokenizer
from hf_deep_nmt.translate import translate

PAIRS = [("el sol sale", "the sun rises"), ("la mar no se llena", "the sea is not full"), ("hola mundo", "hi")]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_config):
    tokenizer = train_joint_tokenizer(PAIRS * 20, vocab_size=120, min_frequency=1)
    torch.manual_seed(0)
    model = DlclForConditionalGeneration(tiny_config(DlclConfig, vocab_size=len(tokenizer), tie_word_embeddings=False))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    model.generation_config.num_beams = 2
    folder = export_hub_folder(model, tokenizer, tmp_path_factory.mktemp("export") / "repo", repo_id="org/tiny")
    return folder, model.eval(), tokenizer


class FakeApi:
    """Stands in for `HfApi`: records the calls, holds the files of an existing repository."""

    def __init__(self, existing: list[str] | None = None):
        self.existing, self.calls = existing, []

    def repo_exists(self, repo_id, repo_type=None):
        return self.existing is not None

    def list_repo_files(self, repo_id, repo_type=None):
        return list(self.existing)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, operations))
        return "commit-url"


EXPORTED_FILES = [
    "README.md",
    "config.json",
    "configuration_deep_nmt.py",
    "generation_config.json",
    "model.safetensors",
    "modeling_deep_nmt.py",
    "tokenizer.json",
    "tokenizer_config.json",
]


def test_push_uploads_exactly_the_exported_files_in_one_commit(exported):
    folder = exported[0]
    (folder / ".cache").mkdir(exist_ok=True)
    (folder / ".cache" / "lock").write_text("")  # hidden files never travel
    api = FakeApi()
    assert push_to_hub(folder, "org/tiny", private=True, api=api) == "commit-url"
    (create, repo_id, kwargs), (commit, _, operations) = api.calls
    assert (create, repo_id, kwargs["private"], commit) == ("create_repo", "org/tiny", True, "create_commit")
    assert all(isinstance(operation, CommitOperationAdd) for operation in operations)
    assert [operation.path_in_repo for operation in operations] == EXPORTED_FILES
    weights = next(operation for operation in operations if operation.path_in_repo == "model.safetensors")
    assert weights.path_or_fileobj == str(folder / "model.safetensors")


def test_push_refuses_a_repository_with_files_unless_asked(exported):
    folder = exported[0]
    api = FakeApi(existing=[".gitattributes", "model.safetensors", "old_weights.bin"])
    with pytest.raises(FileExistsError, match=r"'org/tiny' already holds 2 file\(s\).*overwrite=True"):
        push_to_hub(folder, "org/tiny", api=api)
    assert api.calls == []
    push_to_hub(folder, "org/tiny", api=api, overwrite=True)
    [(_, _, operations)] = api.calls
    deleted = [op.path_in_repo for op in operations if isinstance(op, CommitOperationDelete)]
    assert deleted == ["old_weights.bin"]  # stale files go in the same commit; .gitattributes stays
    assert push_to_hub(folder, "org/empty", api=FakeApi(existing=[".gitattributes"])) == "commit-url"


def test_push_needs_an_exported_folder(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="not an exported model folder"):
        upload_operations(tmp_path)
    assert main(["push", str(tmp_path), "org/x", "--dry-run"]) == 2


def test_push_dry_run_lists_the_files(exported, capsys):
    assert main(["push", str(exported[0]), "org/tiny", "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == EXPORTED_FILES


# ---- translate command ----------------------------------------------------------------------------------------------

LINES = ["el sol sale", "", "la mar no se llena", "hola mundo", "el sol sale hola"]


def test_translate_command_file_to_file_keeps_order_and_empty_lines(exported, tmp_path):
    folder, model, tokenizer = exported
    source, target = tmp_path / "in.es", tmp_path / "out.en"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    command = ["translate", "--model", str(folder), "--input", str(source), "--output", str(target)]
    assert main([*command, "--max-tokens", "30", "--no-progress"]) == 0
    expected = translate(model, tokenizer, LINES, num_beams=2)
    assert target.read_text(encoding="utf-8").split("\n")[:-1] == expected
    assert expected[1] == "" and len(set(expected)) > 2


def test_translate_command_stdin_to_stdout_with_options(exported, monkeypatch, capsys):
    folder, model, tokenizer = exported
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(LINES)))
    options = ["--num-beams", "3", "--length-penalty", "0.6", "--length-penalty-form", "gnmt", "--no-progress"]
    assert main(["translate", "--model", str(folder), *options]) == 0
    expected = translate(model, tokenizer, LINES, num_beams=3, length_penalty=0.6, length_penalty_form="gnmt")
    assert capsys.readouterr().out.split("\n")[:-1] == expected


def test_translate_command_names_a_missing_input(exported, tmp_path, capsys):
    assert main(["translate", "--model", str(exported[0]), "--input", str(tmp_path / "absent.txt")]) == 2
    assert "absent.txt" in capsys.readouterr().err


# ---- training curves ------------------------------------------------------------------------------------------------

HISTORY = [
    {"loss": 9.5, "step": 1},
    {"loss": 8.0, "step": 2},
    {"eval_loss": 7.9, "eval_bleu": 0.4, "step": 2},
    {"nonfinite_steps_skipped": 1, "step": 3},
    {"loss": 6.5, "step": 3},
    {"nonfinite_steps_skipped": 2, "step": 4},
    {"eval_loss": 6.8, "eval_bleu": 1.7, "step": 4},
    {"train_runtime": 3.0, "step": 4},
]


def test_curve_points_come_from_the_log_history():
    points = curve_points(HISTORY)
    assert points["loss"] == [(1, 9.5), (2, 8.0), (3, 6.5)]
    assert points["eval_bleu"] == [(2, 0.4), (4, 1.7)] and points["eval_loss"] == [(2, 7.9), (4, 6.8)]
    assert points["skipped"] == [(3, 1), (4, 2)]  # optimizer steps skipped for a non-finite loss or gradient


def test_curves_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_training_curves(HISTORY, tmp_path / "run")
    assert path == tmp_path / "run" / "training_curves.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_plot_is_skipped_with_a_message(tmp_path, monkeypatch, caplog):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with caplog.at_level(logging.WARNING):
        assert plot_training_curves(HISTORY, tmp_path) is None
    assert "matplotlib is not installed: training curves skipped" in caplog.text
    assert not (tmp_path / "training_curves.png").exists()
