"""Malformed parallel data stops with the file and the line; only trailing blank lines are skipped."""

import pytest

from hf_deep_nmt.data.corpus import load_parallel_dataset, read_jsonl, read_tsv


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


def _hub_style_dataset(folder, splits):
    """A local dataset folder in the layout `datasets.load_dataset` reads by name: `{split}.jsonl` files of
    `{"translation": {"de": ..., "en": ...}}` rows, as the Hub's wmt14/wmt16/iwslt2017 datasets have."""
    import json

    folder.mkdir()
    for split, rows in splits.items():
        lines = [json.dumps({"translation": {"de": de, "en": en}}, ensure_ascii=False) for de, en in rows]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(folder)


def test_a_dataset_by_name_gives_source_and_target_and_counts_empty_pairs(tmp_path, caplog):
    import logging

    name = _hub_style_dataset(
        tmp_path / "wmt-like",
        {
            "train": [("Hallo Welt", "hello world"), ("", "empty source"), ("Danke", "thanks")],
            "validation": [("Guten Morgen", "good morning")],
            "test": [("Gute Nacht", "good night")],
        },
    )
    with caplog.at_level(logging.WARNING):
        raw = load_parallel_dataset(dataset_name=name, source_lang="en", target_lang="de")
    assert raw["train"]["source"] == ["hello world", "thanks"] and raw["train"]["target"] == ["Hallo Welt", "Danke"]
    assert raw["validation"]["source"] == ["good morning"]
    assert "dropped 1 of 3 pairs with an empty side" in caplog.text
    test = load_parallel_dataset(dataset_name=name, source_lang="en", target_lang="de", validation_split="test")
    assert test["validation"]["target"] == ["Gute Nacht"]
    with pytest.raises(ValueError, match=r"no 'newstest2014' split; it has \['test', 'train', 'validation'\]"):
        load_parallel_dataset(dataset_name=name, source_lang="en", target_lang="de", validation_split="newstest2014")
    with pytest.raises(ValueError, match=r"no \['fr'\] text in its translations; it has \['de', 'en'\]"):
        load_parallel_dataset(dataset_name=name, source_lang="en", target_lang="fr")


def test_the_data_package_imports_nothing_of_the_training_journey():
    """The walk goes down: data is read by training, never the other way (its constants and helpers live in data/ or
    the package root)."""
    import ast
    from pathlib import Path

    import hf_deep_nmt.data

    for path in sorted(Path(hf_deep_nmt.data.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            assert not any(name.startswith("hf_deep_nmt.training") for name in names), (path.name, names)
