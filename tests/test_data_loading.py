"""Malformed parallel data stops with the file and the line; only trailing blank lines are skipped."""

import pytest

from hf_deep_nmt.data import load_parallel_dataset, read_jsonl, read_tsv


def test_a_blank_line_inside_a_tsv_is_named_not_dropped(tmp_path):
    path = tmp_path / "gap.tsv"
    path.write_text("uno\tone\n\ndos\ttwo\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"gap\.tsv:2: empty line inside the file"):
        read_tsv(path)
    path.write_text("uno\tone\ndos\ttwo\n\n\n", encoding="utf-8")
    assert read_tsv(path) == {"source": ["uno", "dos"], "target": ["one", "two"]}


def test_invalid_json_and_blank_lines_in_jsonl_are_named(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"es": "uno", "en": "one"}\n{"es": "dos", "en": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs\.jsonl:2: invalid JSON"):
        read_jsonl(path, "es", "en")
    path.write_text('{"es": "uno", "en": "one"}\n\n{"es": "dos", "en": "two"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs\.jsonl:2: empty line inside the file"):
        read_jsonl(path, "es", "en")


def test_a_bad_validation_file_is_named_too(tmp_path):
    (tmp_path / "train.tsv").write_text("uno\tone\n", encoding="utf-8")
    (tmp_path / "valid.tsv").write_text("dos\ttwo\ttres\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"valid\.tsv:1: expected 2 tab-separated fields"):
        load_parallel_dataset(tmp_path / "train.tsv", tmp_path / "valid.tsv")


def test_unrecognised_corpus_names_say_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match=r"expected a \.tsv or \.jsonl file, or a prefix with 'corpus\.es'"):
        load_parallel_dataset(tmp_path / "corpus", source_lang="es", target_lang="en")
