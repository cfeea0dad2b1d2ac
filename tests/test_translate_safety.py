"""`translate` never loses what a user has: the input is never replaced, an existing output only on request, every
`\\n` line of the input gets exactly one output line, translations reach the disk in input order as they are made,
and decoding options and lengths stay within documented bounds."""

import os
from pathlib import Path

import pytest

from hf_deep_nmt import DlclForConditionalGeneration
from hf_deep_nmt.cli import main
from hf_deep_nmt.serving.translate import (
    MAX_OUTPUT_TOKENS,
    check_translation_options,
    split_lines,
    translate,
    translate_file,
    write_translations,
)

LINES = ["el sol sale", "", "la mar no se llena", "hola mundo", "el sol sale hola"]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (links followed), by relative path, with its bytes."""
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.name.startswith(".")
    }


def run(tiny_export, *arguments) -> list[str]:
    return ["translate", "--model", str(tiny_export[0]), "--no-progress", *arguments]


def one_error_line(capsys) -> str:
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error, error
    return error


# ---- the input is never replaced, an existing output only on request ------------------------------------------------


@pytest.mark.parametrize("alias", ["same", "relative", "symlink", "hardlink", "dotted"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_output_naming_the_input_file_is_refused_and_leaves_it_intact(
    tiny_export, tmp_path, monkeypatch, capsys, alias, overwrite
):
    source = tmp_path / "text.es"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    output = {
        "same": str(source),
        "relative": "text.es",
        "dotted": f"../{tmp_path.name}/./text.es",
        "symlink": "link.es",
        "hardlink": "hard.es",
    }[alias]
    if alias == "symlink":
        os.symlink(source, tmp_path / "link.es")
    if alias == "hardlink":
        os.link(source, tmp_path / "hard.es")
    before = snapshot(tmp_path)
    command = run(tiny_export, "--input", str(source), "--output", output, *(["--overwrite"] if overwrite else []))
    assert main(command) == 2
    error = one_error_line(capsys)
    assert f"output {output} is the input file {source}" in error and "another file" in error
    assert snapshot(tmp_path) == before


def test_an_existing_output_file_is_kept_unless_overwrite_is_given(tiny_export, tmp_path, capsys):
    folder, model, tokenizer = tiny_export
    source, target = tmp_path / "in.es", tmp_path / "out.en"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    target.write_bytes(b"my earlier translations\n")
    before = snapshot(tmp_path)
    assert main(run(tiny_export, "--input", str(source), "--output", str(target))) == 2
    error = one_error_line(capsys)
    assert f"output file {target} exists" in error and "--overwrite" in error
    assert snapshot(tmp_path) == before
    assert main(run(tiny_export, "--input", str(source), "--output", str(target), "--overwrite")) == 0
    assert target.read_text(encoding="utf-8").split("\n")[:-1] == translate(model, tokenizer, LINES, num_beams=2)
    with pytest.raises(FileExistsError, match="exists"):
        translate_file(model, tokenizer, source, target)


def test_an_output_path_that_is_a_folder_or_in_a_missing_folder_is_a_clear_error(tiny_export, tmp_path, capsys):
    source = tmp_path / "in.es"
    source.write_text("hola\n", encoding="utf-8")
    (tmp_path / "results").mkdir()
    before = snapshot(tmp_path)
    for output, expected in [
        (tmp_path / "results", "is a folder; name a file"),
        (tmp_path / "absent" / "out.en", "does not exist"),
    ]:
        for flags in ([], ["--overwrite"]):
            assert main(run(tiny_export, "--input", str(source), "--output", str(output), *flags)) == 2
            assert expected in one_error_line(capsys)
    assert snapshot(tmp_path) == before and sorted(path.name for path in tmp_path.iterdir()) == ["in.es", "results"]


def test_a_device_file_is_written_without_overwrite(tiny_export, tmp_path):
    source = tmp_path / "in.es"
    source.write_text("hola\n", encoding="utf-8")
    assert main(run(tiny_export, "--input", str(source), "--output", os.devnull)) == 0


# ---- one output line per input \n line ------------------------------------------------------------------------------

SEPARATORS = ["\x85", "\u2028", "\u2029", "\x0c", "\x1c", "\x1d", "\x1e", "\x0b", "\r"]


def test_split_lines_splits_on_newline_alone_and_drops_the_cr_of_crlf():
    text = "".join(f"a{separator}b\n" for separator in SEPARATORS)
    assert split_lines(text) == [f"a{separator}b" for separator in SEPARATORS]
    assert split_lines("one\r\ntwo\r\n\r\nfour") == ["one", "two", "", "four"]
    assert split_lines("one\r\r\ntwo\r") == ["one\r", "two"]  # one \r per line end, no more
    assert split_lines("") == [] and split_lines("\n") == [""] and split_lines("x") == ["x"]


def test_line_breaking_characters_inside_a_line_keep_one_output_line_per_input_line(tiny_export, tmp_path):
    folder, model, tokenizer = tiny_export
    lines = [f"el sol{separator}sale" for separator in SEPARATORS] + ["hola mundo"]
    source, target = tmp_path / "in.es", tmp_path / "out.en"
    source.write_bytes("".join(line + "\n" for line in lines).encode("utf-8"))
    assert main(run(tiny_export, "--input", str(source), "--output", str(target))) == 0
    written = target.read_bytes().decode("utf-8")
    assert written.count("\n") == len(lines) and written.endswith("\n")
    assert written.split("\n")[:-1] == translate(model, tokenizer, lines, num_beams=2)


def test_a_crlf_file_translates_as_its_lf_copy(tiny_export, tmp_path):
    lf, crlf = tmp_path / "lf.es", tmp_path / "crlf.es"
    lf.write_bytes("".join(line + "\n" for line in LINES).encode())
    crlf.write_bytes("".join(line + "\r\n" for line in LINES).encode())
    for source in (lf, crlf):
        assert main(run(tiny_export, "--input", str(source), "--output", str(source.with_suffix(".en")))) == 0
    assert (tmp_path / "crlf.en").read_bytes() == (tmp_path / "lf.en").read_bytes()
    assert (tmp_path / "lf.en").read_bytes().count(b"\n") == len(LINES) and b"\r" not in (
        tmp_path / "lf.en"
    ).read_bytes()


def test_a_translation_holding_a_line_break_stays_on_its_line(tiny_export, tmp_path, monkeypatch):
    folder, model, tokenizer = tiny_export
    decode = tokenizer.batch_decode
    monkeypatch.setattr(tokenizer, "batch_decode", lambda *a, **k: [f"x\ny\r{text}" for text in decode(*a, **k)])
    target = tmp_path / "out.en"
    assert write_translations(model, tokenizer, ["hola", "el sol sale"], target, num_beams=1) == 2
    assert len(target.read_text(encoding="utf-8").split("\n")) == 3  # two lines and the final newline


# ---- streaming: a stopped run leaves the first translations in a temporary file, the output unchanged ---------------


class StopAfter:
    """Wraps `model.generate`, raising on call `calls + 1`."""

    def __init__(self, model, calls: int):
        self.generate, self.calls, self.seen = model.generate, calls, []

    def __call__(self, **kwargs):
        if len(self.seen) == self.calls:
            raise RuntimeError("stopped")
        self.seen.append(kwargs["input_ids"].shape[0])
        return self.generate(**kwargs)


def test_a_stopped_run_leaves_every_finished_window_on_disk_in_order(tiny_export, tmp_path, monkeypatch):
    folder, model, tokenizer = tiny_export
    lines = ["la mar no se llena " * 3, "hola", "el sol sale", "la mar", "hola mundo", "el sol", "sale", "mar"]
    expected = translate(model, tokenizer, lines, batch_size=2, num_beams=1, buffer_size=4)
    stop = StopAfter(model, calls=2)
    monkeypatch.setattr(model, "generate", stop)
    target = tmp_path / "out.en"
    with pytest.raises(RuntimeError, match="stopped") as raised:
        write_translations(model, tokenizer, lines, target, batch_size=2, num_beams=1, buffer_size=4)
    assert stop.seen == [2, 2]
    assert not target.exists()  # only a complete file is put in place
    (partial,) = tmp_path.glob(".out.en.*.partial")
    assert partial.read_text(encoding="utf-8") == "".join(text + "\n" for text in expected[:4])
    assert raised.value.__notes__ == [f"the first 4 of 8 translations are in {partial} ({target} was not changed)"]


def test_length_sorted_batches_still_reach_the_disk_as_an_input_prefix(tiny_export, tmp_path, monkeypatch):
    """The first line is the longest: its batch (with line 4) runs first, so after that batch line 1 is on disk and
    line 4 waits for lines 2 and 3."""
    folder, model, tokenizer = tiny_export
    lines = ["la mar no se llena " * 4, "hola", "el sol", "la mar no se llena"]
    expected = translate(model, tokenizer, lines, batch_size=2, num_beams=1)
    target = tmp_path / "out.en"
    stop = StopAfter(model, calls=1)
    monkeypatch.setattr(model, "generate", stop)
    with pytest.raises(RuntimeError, match="stopped"):
        write_translations(model, tokenizer, lines, target, batch_size=2, num_beams=1)
    (partial,) = tmp_path.glob(".out.en.*.partial")
    assert partial.read_text(encoding="utf-8") == expected[0] + "\n"


def test_a_run_failing_before_its_first_translation_touches_no_file(tiny_export, tmp_path, monkeypatch, capsys):
    folder, model, tokenizer = tiny_export
    source, kept = tmp_path / "in.es", tmp_path / "kept.en"
    source.write_text("hola\nel sol\n", encoding="utf-8")
    kept.write_text("earlier\n", encoding="utf-8")
    before = snapshot(tmp_path)
    monkeypatch.setattr(DlclForConditionalGeneration, "generate", lambda self, **kwargs: 1 / 0)
    for output in (kept, tmp_path / "new.en"):
        assert main(run(tiny_export, "--input", str(source), "--output", str(output), "--overwrite")) == 1
        assert "ZeroDivisionError" in one_error_line(capsys)
    assert snapshot(tmp_path) == before


def test_the_cli_says_how_many_lines_a_stopped_run_wrote(tiny_export, tmp_path, monkeypatch, capsys):
    source, target = tmp_path / "in.es", tmp_path / "out.en"
    source.write_text("hola\nel sol\nla mar\n", encoding="utf-8")
    original = DlclForConditionalGeneration.generate
    calls = []

    def interrupted(self, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, **kwargs)

    monkeypatch.setattr(DlclForConditionalGeneration, "generate", interrupted)
    assert main(run(tiny_export, "--input", str(source), "--output", str(target), "--batch-size", "1")) == 130
    error = one_error_line(capsys)
    (partial,) = tmp_path.glob(".out.en.*.partial")
    assert f"interrupted (the first 1 of 3 translations are in {partial} ({target} was not changed))" in error
    assert partial.read_text(encoding="utf-8").count("\n") == 1 and not target.exists()


# ---- bounds ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--length-penalty", "nan", "must be a finite number, got 'nan'"),
        ("--length-penalty", "inf", "must be a finite number, got 'inf'"),
        ("--max-length-a", "nan", "must be a finite number, got 'nan'"),
        ("--max-length-a", "inf", "must be a finite number, got 'inf'"),
        ("--max-length-a", "-1", "--max-length-a must be a number in [0, 10]"),
        ("--max-length-a", "1e6", "--max-length-a must be a number in [0, 10]"),
        ("--max-length-b", "-2", "must be an integer >= 0, got '-2'"),
        ("--max-length-b", "5000", "--max-length-b must be an integer in [0, 1024]"),
        ("--num-beams", "0", "must be an integer >= 1, got '0'"),
        ("--num-beams", "-3", "must be an integer >= 1, got '-3'"),
        ("--max-tokens", "0", "must be an integer >= 1, got '0'"),
        ("--max-tokens", "-5", "must be an integer >= 1, got '-5'"),
        ("--batch-size", "0", "must be an integer >= 1, got '0'"),
        ("--batch-size", "two", "must be an integer >= 1, got 'two'"),
        ("--max-output-tokens", "0", "must be an integer >= 1, got '0'"),
    ],
)
def test_out_of_range_decoding_options_are_refused_before_the_model_is_loaded(tmp_path, capsys, flag, value, expected):
    source = tmp_path / "in.es"
    source.write_text("hola\n", encoding="utf-8")
    before = snapshot(tmp_path)
    command = ["translate", "--model", str(tmp_path / "no-model"), "--input", str(source), f"{flag}={value}"]
    assert main(command) == 2
    error = one_error_line(capsys)
    assert expected in error and flag.lstrip("-") in error and "no-model" not in error
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("length_penalty", float("nan")),
        ("max_length_a", float("inf")),
        ("max_length_a", 1e6),
        ("max_length_a", -0.5),
        ("num_beams", 0),
        ("batch_size", 0),
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_length_b", 1.5),
        ("max_source_tokens", 0),
    ],
)
def test_the_library_refuses_the_same_values_naming_them(tiny_export, option, value):
    folder, model, tokenizer = tiny_export
    with pytest.raises(ValueError, match=rf"`{option}` must be .*got {value!r}"):
        check_translation_options(**{option: value})
    with pytest.raises(ValueError, match=rf"`{option}`"):
        translate(model, tokenizer, ["hola"], **{option: value})


def test_output_length_is_capped_absolutely_whatever_a_and_b_allow(tiny_export, monkeypatch):
    folder, model, tokenizer = tiny_export
    original, seen = model.generate, []

    def record(**kwargs):
        result = original(**kwargs)
        seen.append((kwargs["max_length"], result.sequences.shape[1]))
        return result

    monkeypatch.setattr(model, "generate", record)
    translate(model, tokenizer, ["la mar no se llena " * 5], num_beams=1, max_length_a=10, max_length_b=1000)
    assert seen[-1][0] == MAX_OUTPUT_TOKENS + 2  # the start token, the tokens, `</s>`
    translate(
        model,
        tokenizer,
        ["la mar no se llena " * 5],
        num_beams=1,
        max_length_a=10,
        max_length_b=3,
        max_output_tokens=3,
    )
    assert seen[-1][0] == 5 and seen[-1][1] <= 5  # the start token, 3 tokens, `</s>`


def test_an_overlong_line_is_refused_naming_it_before_anything_is_translated(tiny_export, tmp_path, capsys):
    folder, model, tokenizer = tiny_export
    source, target = tmp_path / "in.es", tmp_path / "out.en"
    source.write_text("hola\n" + "el sol sale " * 7000 + "\nhola\n", encoding="utf-8")
    before = snapshot(tmp_path)
    assert main(run(tiny_export, "--input", str(source), "--output", str(target))) == 2
    error = one_error_line(capsys)
    assert "1 input line(s) are longer than 1024 tokens (line 2 has" in error and "--max-source-tokens" in error
    assert snapshot(tmp_path) == before
    length = len(tokenizer("el sol sale hola mundo")["input_ids"])
    with pytest.raises(ValueError, match=rf"longer than {length - 1} tokens \(line 2 has {length}\)"):
        translate(model, tokenizer, ["hola", "el sol sale hola mundo"], max_source_tokens=length - 1)
    assert translate(model, tokenizer, ["el sol sale hola mundo"], num_beams=1, max_source_tokens=length)[0]


@pytest.mark.parametrize(("buffer_size", "batches"), [(None, [4, 2]), (3, [3, 3]), (1, [1] * 6)])
def test_batches_are_formed_within_windows_of_buffer_size_lines(tiny_export, monkeypatch, buffer_size, batches):
    folder, model, tokenizer = tiny_export
    stop = StopAfter(model, calls=100)
    monkeypatch.setattr(model, "generate", stop)
    lines = ["hola", "el sol", "la mar", "hola mundo", "el sol sale", "la mar no se llena"]
    translate(model, tokenizer, lines, batch_size=4, num_beams=1, buffer_size=buffer_size)
    assert stop.seen == batches
