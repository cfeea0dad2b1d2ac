"""Errors that used to mislead, and work that used to be refused only after training: each message names the file,
the value at fault and the way out, and comes before step 1."""

import json
import os
from pathlib import Path

import pytest

from hf_deep_nmt.arguments import parse_arguments
from hf_deep_nmt.data import load_parallel_dataset, sample_corpus_dir
from hf_deep_nmt.evaluation import check_source_lengths
from hf_deep_nmt.folders import check_export_folder
from hf_deep_nmt.tokenizer import train_joint_tokenizer
from hf_deep_nmt.training import prepare
from hf_deep_nmt.translate import decode_lines, read_lines

TEXT = "niño\tchild\nsí\tyes\n"


@pytest.fixture(scope="module")
def tokenizer():
    return train_joint_tokenizer([("hola mundo", "hello world"), ("el sol sale", "the sun rises")] * 10, vocab_size=80)


def load(path: Path):
    return load_parallel_dataset(train_file=str(path))


# ---- what a corpus path is: a FIFO, a folder, links --------------------------------------------------------------


def test_a_fifo_as_corpus_is_called_a_fifo_with_the_way_out(tmp_path):
    fifo = tmp_path / "stream.tsv"
    os.mkfifo(fifo)
    with pytest.raises(ValueError) as caught:
        load(fifo)
    message = str(caught.value)
    assert "not found" not in message
    assert f"{fifo} is not a regular file (a FIFO, socket or device)" in message
    assert f"`cat {fifo} > corpus.tsv`" in message


def test_a_folder_as_corpus_is_called_a_folder(tmp_path):
    folder = tmp_path / "corpus.tsv"
    folder.mkdir()
    with pytest.raises(
        IsADirectoryError, match=rf"{folder} is a folder, not a file; name a .tsv or .jsonl file in it"
    ):
        load(folder)


def test_a_loop_of_links_and_a_dangling_link_are_told_apart(tmp_path):
    loop = tmp_path / "loop.tsv"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match=rf"{loop} is a loop of symbolic links .* point the link at the corpus file"):
        load(loop)
    dangling = tmp_path / "dangling.tsv"
    dangling.symlink_to(tmp_path / "moved.tsv")
    with pytest.raises(FileNotFoundError, match=rf"{dangling} is a symbolic link to '{tmp_path / 'moved.tsv'}'"):
        load(dangling)
    with pytest.raises(FileNotFoundError, match=rf"not found: {tmp_path / 'absent.tsv'} \(check the path"):
        load(tmp_path / "absent.tsv")


def test_a_loop_of_links_as_translate_input_is_not_called_missing(tmp_path):
    loop = tmp_path / "loop.es"
    loop.symlink_to(loop)
    with pytest.raises(ValueError, match=rf"input {loop} is a loop of symbolic links"):
        read_lines(loop)


# ---- encodings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be"])
def test_a_utf16_corpus_gets_the_utf16_conversion_not_a_latin1_one(tmp_path, encoding):
    path = tmp_path / "corpus.tsv"
    path.write_bytes(TEXT.encode(encoding))
    with pytest.raises(ValueError) as caught:
        load(path)
    message = str(caught.value)
    assert f"{path} is UTF-16 text, not UTF-8" in message
    assert f"`iconv -f UTF-16 -t UTF-8 {path} > corpus.utf8.tsv`" in message
    assert "latin" not in message and "NUL" not in message
    # the advice keeps every character: converting as it says gives the UTF-8 text back
    assert path.read_bytes().decode("utf-16" if encoding == "utf-16" else encoding) == TEXT


def test_a_latin1_corpus_is_told_to_find_its_encoding(tmp_path):
    path = tmp_path / "corpus.tsv"
    path.write_bytes("a\tb\nniño\tchild\n".encode("latin-1"))
    with pytest.raises(ValueError) as caught:
        load(path)
    message = str(caught.value)
    assert f"{path}:2: not valid UTF-8 (invalid continuation byte at byte 2 of the line, 0xf1)" in message
    assert f"`file -i {path}`" in message and "`iconv -f ENCODING -t UTF-8`" in message


@pytest.mark.parametrize("mark", [b"\xff\xfe", b"\xfe\xff"])
def test_translate_input_in_utf16_gets_the_utf16_conversion(mark):
    data = mark + "hola\n".encode("utf-16-le" if mark == b"\xff\xfe" else "utf-16-be")
    with pytest.raises(ValueError, match=r"in\.es is UTF-16 text .* `iconv -f UTF-16 -t UTF-8`") as caught:
        decode_lines(data, "in.es")
    assert "latin1" not in str(caught.value)


def test_translate_input_in_latin1_is_not_told_it_is_latin1(tmp_path):
    with pytest.raises(ValueError, match=r"in\.es is not valid UTF-8: byte 2 \(line 1\) is 0xf1") as caught:
        decode_lines("niño\n".encode("latin-1"), "in.es")
    assert "latin1" not in str(caught.value) and "iconv -f ENCODING -t UTF-8" in str(caught.value)


def test_crlf_and_a_byte_order_mark_read_as_the_plain_file(tmp_path):
    plain, other = tmp_path / "plain.tsv", tmp_path / "other.tsv"
    plain.write_bytes(TEXT.encode())
    other.write_bytes(b"\xef\xbb\xbf" + TEXT.replace("\n", "\r\n").encode())
    assert (
        load(other)["train"].to_dict()
        == load(plain)["train"].to_dict()
        == {
            "source": ["niño", "sí"],
            "target": ["child", "yes"],
        }
    )


# ---- contents ------------------------------------------------------------------------------------------------------


def test_a_corpus_of_only_a_header_is_refused_naming_the_header(tmp_path):
    path = tmp_path / "corpus.tsv"
    path.write_text("source\ttarget\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"`train_file` '{path}' holds only a header line \('source' / 'target'\)"):
        load(path)


@pytest.mark.parametrize(("line", "count", "way_out"), [("hola", 1, "no tab"), ("a\tb\tc", 3, "a tab inside")])
def test_a_line_with_the_wrong_number_of_fields_says_why(tmp_path, line, count, way_out):
    path = tmp_path / "corpus.tsv"
    path.write_text(f"x\ty\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}:2: expected 2 tab-separated fields .* got {count} \({way_out}"):
        load(path)


def test_a_jsonl_line_that_is_not_an_object_names_what_it_is(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"src": "a", "tgt": "b"}\n[1, 2]\n{"es": "a"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path}:2: expected string fields 'src' and 'tgt', got a JSON list"):
        load(path)
    path.write_text('{"es": "a"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r":1: expected string fields 'src' and 'tgt', got \['es'\]; each line must"):
        load(path)


# ---- refused before step 1 ----------------------------------------------------------------------------------------


def test_a_source_over_the_translate_limit_is_named_with_its_line_and_length(tokenizer):
    sources = ["hola mundo", "hola " * 30, "el sol", "hola " * 40]
    with pytest.raises(ValueError) as caught:
        check_source_lengths(sources, tokenizer, 20, "`validation_file` 'v.tsv'")
    message = str(caught.value)
    length = len(tokenizer("hola " * 30)["input_ids"])
    assert message.startswith("`validation_file` 'v.tsv': 2 source sentence(s) are longer than 20 tokens")
    assert f"(line 2 has {length})" in message and "Split them into sentences" in message
    check_source_lengths(sources[:1], tokenizer, 20, "unused")  # within the limit: nothing to say


def test_an_overlong_validation_line_stops_the_run_before_training(tmp_path):
    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:20]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    valid = tmp_path / "valid.tsv"
    valid.write_text(f"{lines[0]}\n{'palabra ' * 3000}\tword\n", encoding="utf-8")
    settings = {"train_file": str(tmp_path / "train.tsv"), "validation_file": str(valid), "tokenizer_vocab_size": 300}
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({**settings, "output_dir": str(tmp_path / "out")}))
    model_args, data_args, _, training_args = parse_arguments([str(recipe)])
    with pytest.raises(
        ValueError, match=rf"`validation_file` '{valid}': 1 source sentence\(s\) .* 1024 tokens.*\(line 2 has 18002\)"
    ):
        prepare(model_args, data_args, training_args)


@pytest.mark.parametrize("name", [".", "..", "./"])
def test_the_current_folder_or_one_above_it_is_refused_as_an_export_folder(tmp_path, monkeypatch, name):
    here = tmp_path / "work" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    with pytest.raises(ValueError, match=r"is the current folder .* or a folder above it.*name a new folder"):
        check_export_folder(name)
    check_export_folder("export")  # a new folder inside is fine
