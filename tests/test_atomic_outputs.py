"""Outputs are written under a temporary name beside their place and renamed into it when complete: a command stopped
half-way (an error, Ctrl-C, a preemption) leaves the earlier file or folder as it was. A result is never written
inside the model folder it is made from, and an export marker vouches only for files whose size and SHA-256 it
recorded: a file added to its list by hand, or changed since the export, is kept."""

import json
import os
import threading
from pathlib import Path

import pytest

from hf_deep_nmt import DlclForConditionalGeneration
from hf_deep_nmt.cli import main
from hf_deep_nmt.folders import (
    WRITTEN_MARKER,
    atomic_file,
    changed_since_written,
    check_export_folder,
    files_not_written_by_us,
    write_marked_folder,
)
from hf_deep_nmt.hub import export_hub_folder

LINES = ["el sol sale", "la mar no se llena", "hola mundo", "el sol", "la mar", "hola"]


def leftovers(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("."))


# ---- one file -------------------------------------------------------------------------------------------------------


def test_a_file_written_half_way_leaves_the_old_one_and_a_complete_one_replaces_it(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("the old content\n")
    target.chmod(0o640)
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(target) as stream:
            stream.write("half of the new")
            raise KeyboardInterrupt
    assert target.read_text() == "the old content\n" and leftovers(tmp_path) == []
    with atomic_file(target) as stream:
        stream.write("the new content\n")
    assert target.read_text() == "the new content\n" and leftovers(tmp_path) == []
    assert target.stat().st_mode & 0o777 == 0o640  # the replaced file's mode, not the temporary file's 0o600
    # through a symbolic link, the file it names is replaced and the link kept
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with atomic_file(link) as stream:
        stream.write("through the link\n")
    assert link.is_symlink() and target.read_text() == "through the link\n"


def test_a_file_that_must_not_be_replaced_is_not_even_when_it_appears_while_writing(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(FileExistsError, match=r"'.*out\.txt' was created by another program while this one wrote it"):
        with atomic_file(target, replace=False) as stream:
            stream.write("ours\n")
            target.write_text("theirs\n")
    assert target.read_text() == "theirs\n" and leftovers(tmp_path) == []


# ---- translations ---------------------------------------------------------------------------------------------------


def failing_after(model, calls: int):
    generate, seen = model.generate, []

    def stopping(**kwargs):
        if len(seen) == calls:
            raise KeyboardInterrupt
        seen.append(1)
        return generate(**kwargs)

    return stopping


def test_cat_f_into_translate_writing_f_keeps_f_until_the_translation_is_complete(tiny_export, tmp_path, monkeypatch):
    """`cat F | hf-deep-nmt translate --output F --overwrite`: stdin is a pipe, which cannot be traced to F. The
    translation stopped half-way leaves F's text; the finished one replaces it with its translation."""
    folder, model, tokenizer = tiny_export
    text, expected = tmp_path / "text.es", tmp_path / "expected.en"
    text.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    arguments = ["translate", "--model", str(folder), "--no-progress", "--batch-size", "1"]
    assert main([*arguments, "--input", str(text), "--output", str(expected)]) == 0

    def piped_stdin():
        read, write = os.pipe()

        def cat():
            with open(text, "rb") as source, os.fdopen(write, "wb") as pipe:
                pipe.write(source.read())

        threading.Thread(target=cat).start()
        monkeypatch.setattr("sys.stdin", os.fdopen(read, "r", encoding="utf-8"))

    arguments += ["--output", str(text), "--overwrite"]
    stop = failing_after(model, calls=2)
    with monkeypatch.context() as patch:
        patch.setattr(DlclForConditionalGeneration, "generate", lambda self, **kwargs: stop(**kwargs))
        piped_stdin()
        assert main(arguments) == 130
    assert text.read_text(encoding="utf-8") == "\n".join(LINES) + "\n"
    (partial,) = tmp_path.glob(".text.es.*.partial")  # what was translated is kept (the error names it)
    first_two = expected.read_text(encoding="utf-8").split("\n")[:2]  # split on \n alone, as translate writes
    assert partial.read_text(encoding="utf-8") == "".join(line + "\n" for line in first_two)
    partial.unlink()
    piped_stdin()
    assert main(arguments) == 0
    assert text.read_text(encoding="utf-8") == expected.read_text(encoding="utf-8")
    assert leftovers(tmp_path) == []


# ---- folders --------------------------------------------------------------------------------------------------------


def test_a_folder_written_half_way_or_swapped_half_way_leaves_the_earlier_one(tmp_path, monkeypatch):
    target = tmp_path / "average"
    write_marked_folder(target, lambda staging: (staging / "model.safetensors").write_text("earlier"))

    def half(staging):
        (staging / "model.safetensors").write_text("new, half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_marked_folder(target, half, overwrite=True)
    assert (target / "model.safetensors").read_text() == "earlier" and leftovers(tmp_path) == []
    # interrupted between moving the earlier folder aside and moving the new one in: the earlier one goes back
    rename = Path.rename

    def interrupted(self, destination):
        if Path(destination) == target and self.name.startswith(".average."):
            raise KeyboardInterrupt
        return rename(self, destination)

    monkeypatch.setattr(Path, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_marked_folder(target, lambda staging: (staging / "model.safetensors").write_text("new"), overwrite=True)
    monkeypatch.undo()
    assert (target / "model.safetensors").read_text() == "earlier" and leftovers(tmp_path) == []


def test_a_marker_edited_to_list_a_users_file_no_longer_lets_an_export_delete_it(tiny_export, tmp_path):
    folder, model, tokenizer = tiny_export
    target = export_hub_folder(model, tokenizer, tmp_path / "export")
    marker = json.loads((target / WRITTEN_MARKER).read_text())
    assert marker["checksums"]["config.json"]["size"] == (target / "config.json").stat().st_size
    export_hub_folder(model, tokenizer, target, overwrite=True)  # an untouched export is replaced
    (target / "notes.txt").write_text("my notes\n")
    marker = json.loads((target / WRITTEN_MARKER).read_text())
    marker["files"].append("notes.txt")  # a hand edit
    (target / WRITTEN_MARKER).write_text(json.dumps(marker))
    with (target / "README.md").open("a") as card:
        card.write("\nMy own paragraph.\n")  # a listed file, changed since the export
    assert changed_since_written(target) == ["README.md", "notes.txt"]
    assert files_not_written_by_us(target) == ["README.md", "notes.txt"]
    with pytest.raises(
        FileExistsError,
        match=r"\['README\.md', 'notes\.txt'\]; \['README\.md', 'notes\.txt'\] are listed by its "
        r"\.hf-deep-nmt-written\.json but changed since the export wrote it .* never replaced, not even when asked; "
        r"they are kept",
    ):
        export_hub_folder(model, tokenizer, target, overwrite=True)
    assert (target / "notes.txt").read_text() == "my notes\n"
    assert (target / "README.md").read_text().endswith("My own paragraph.\n")


def test_a_result_inside_the_model_folder_it_is_made_from_is_refused(tiny_export, tmp_path, capsys):
    folder = tiny_export[0]
    before = sorted(path.name for path in folder.iterdir())
    assert main(["grow", "--model", str(folder), "--output", str(folder / "grown")]) == 2
    error = capsys.readouterr().err
    assert f"'{folder / 'grown'}' is inside the model folder '{folder}'" in error
    assert f"write it beside it, e.g. '{folder.parent / 'repo-grown'}'" in error
    assert sorted(path.name for path in folder.iterdir()) == before
    with pytest.raises(ValueError, match=rf"'{tmp_path}' holds the model folder '{tmp_path / 'model'}'"):
        check_export_folder(tmp_path, True, sources={"the model folder": tmp_path / "model"})
