"""The translate command: file or stdin in, file or stdout out, input order and empty lines kept, the options passed
through, the same translations as the library's `translate`. (What it guarantees about the user's files:
test_translate_safety.py.)"""

import io
import sys

from hf_deep_nmt.cli import main
from hf_deep_nmt.serving.translate import translate

LINES = ["el sol sale", "", "la mar no se llena", "hola mundo", "el sol sale hola"]


def test_translate_command_file_to_file_keeps_order_and_empty_lines(tiny_export, tmp_path):
    folder, model, tokenizer = tiny_export
    source, target = tmp_path / "in.es", tmp_path / "out.en"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    command = ["translate", "--model", str(folder), "--input", str(source), "--output", str(target)]
    assert main([*command, "--max-tokens", "30", "--no-progress"]) == 0
    expected = translate(model, tokenizer, LINES, num_beams=2)
    assert target.read_text(encoding="utf-8").split("\n")[:-1] == expected
    assert expected[1] == "" and len(set(expected)) > 2


def test_translate_command_stdin_to_stdout_with_options(tiny_export, monkeypatch, capsys):
    folder, model, tokenizer = tiny_export
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(LINES)))
    options = ["--num-beams", "3", "--length-penalty", "0.6", "--length-penalty-form", "gnmt", "--no-progress"]
    assert main(["translate", "--model", str(folder), *options]) == 0
    expected = translate(model, tokenizer, LINES, num_beams=3, length_penalty=0.6, length_penalty_form="gnmt")
    assert capsys.readouterr().out.split("\n")[:-1] == expected


def test_translate_command_names_a_missing_input(tiny_export, tmp_path, capsys):
    assert main(["translate", "--model", str(tiny_export[0]), "--input", str(tmp_path / "absent.txt")]) == 2
    assert "absent.txt" in capsys.readouterr().err
