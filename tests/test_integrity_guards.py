"""Guards on what a user hands in or finds on disk: prepared data checked against its record by content, settings
named in their own errors, the newer methods' settings bounded and counted by the estimates, the Python API bounded,
and the smaller tools (export, average, convert-marian) honest about what they checked."""

import json
import random
import re
from pathlib import Path

import pytest

from hf_deep_nmt.cli import main
from hf_deep_nmt.data.prepared import RECORD, PreparedDataError, prepare_data
from hf_deep_nmt.training.arguments import DataArguments, ModelArguments

WORDS = [f"w{index}" for index in range(40)]


def write_corpus(path: Path, pairs: int = 60) -> Path:
    generator = random.Random(0)
    lines = [
        " ".join(generator.choices(WORDS, k=generator.randint(2, 5)))
        + "\t"
        + " ".join(generator.choices(WORDS, k=generator.randint(2, 5)))
        for _ in range(pairs)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def prepared_once(tmp_path_factory):
    """A small prepared folder, built once; each test works on its own copy."""
    root = tmp_path_factory.mktemp("prepared")
    corpus = write_corpus(root / "train.tsv")
    model_args = ModelArguments(model_type="deep_nmt", tokenizer_vocab_size=120)
    data_args = DataArguments(
        train_file=str(corpus),
        validation_file=str(corpus),
        max_source_length=16,
        max_target_length=16,
        max_eval_samples=5,
        preprocessing_num_workers=1,
        prepared_data_dir=str(root / "built"),
    )
    prepare_data(model_args, data_args, seed=1)
    return model_args, data_args, root / "built"


@pytest.fixture
def prepared(prepared_once, tmp_path):
    import shutil

    model_args, data_args, built = prepared_once
    folder = tmp_path / "copy"
    shutil.copytree(built, folder)
    data_args = DataArguments(**{**vars(data_args), "prepared_data_dir": str(folder)})
    return model_args, data_args, folder


def _flip_a_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_same_size_edit_of_the_tokenized_ids_is_refused_naming_the_file(prepared):
    model_args, data_args, folder = prepared
    shard = next((folder / "train").glob("*.arrow"))
    size = shard.stat().st_size
    _flip_a_byte(shard, size // 2)
    assert shard.stat().st_size == size
    with pytest.raises(PreparedDataError, match=rf"train/{shard.name} was changed since it was prepared"):
        prepare_data(model_args, data_args, seed=1)


def test_a_same_size_edit_of_the_prepared_tokenizer_is_refused_naming_the_file(prepared):
    model_args, data_args, folder = prepared
    path = folder / "tokenizer" / "tokenizer.json"
    text = path.read_text()
    assert '"!": 4,' in text and '"#": 6,' in text
    # two pieces' ids swapped: the same size, another tokenizer
    path.write_text(text.replace('"!": 4,', "\0").replace('"#": 6,', '"#": 4,').replace("\0", '"!": 6,'))
    with pytest.raises(PreparedDataError, match=r"tokenizer/tokenizer.json was changed since it was prepared"):
        prepare_data(model_args, data_args, seed=1)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda record: {**record, "files": []}, "`files` is [], not an object"),
        (lambda record: {**record, "counts": {**record["counts"], "train": {"pairs_kept": "x"}}}, "`counts.train"),
        (lambda record: {key: value for key, value in record.items() if key != "id_dtype"}, "`id_dtype` is missing"),
        (lambda record: {**record, "sha256": {"train": "0"}}, "`sha256` is"),
        (lambda record: {**record, "inputs": {**record["inputs"], "max_source_length": 4}}, "`inputs` is"),
    ],
)
def test_a_malformed_record_is_one_line_naming_the_file_and_the_field(prepared, edit, field, capsys):
    model_args, data_args, folder = prepared
    record = json.loads((folder / RECORD).read_text())
    (folder / RECORD).write_text(json.dumps(edit(record)))
    with pytest.raises(PreparedDataError, match=re.escape(f"{folder / RECORD}: {field}")):
        prepare_data(model_args, data_args, seed=1)


def test_a_record_that_is_not_an_object_is_refused_by_name(prepared):
    model_args, data_args, folder = prepared
    (folder / RECORD).write_text("[1, 2]")
    with pytest.raises(PreparedDataError, match=rf"{folder} does not match: format 'list'"):
        prepare_data(model_args, data_args, seed=1)


def test_the_counts_printed_are_checked_against_the_data(prepared):
    model_args, data_args, folder = prepared
    record = json.loads((folder / RECORD).read_text())
    kept = record["counts"]["train"]["pairs_kept"]
    record["counts"]["train"]["pairs_kept"] += 1000
    record["counts"]["train"]["source_tokens"] = 7
    (folder / RECORD).write_text(json.dumps(record))
    shown = rf"{folder / RECORD} does not describe its data: `counts.train.pairs_kept` {kept + 1000}, the data holds"
    with pytest.raises(PreparedDataError, match=rf"{shown} {kept}; `counts.train.source_tokens` 7, the data holds"):
        prepare_data(model_args, data_args, seed=1)


def test_prepare_reports_a_malformed_record_as_a_usage_error_not_unexpected(prepared, tmp_path, capsys):
    model_args, data_args, folder = prepared
    record = json.loads((folder / RECORD).read_text())
    (folder / RECORD).write_text(json.dumps({**record, "files": {"train": "big"}}))
    recipe = tmp_path / "recipe.json"
    values = {"model_type": "deep_nmt", "tokenizer_vocab_size": 120, "output_dir": str(tmp_path / "run")}
    values.update({key: getattr(data_args, key) for key in ("train_file", "validation_file", "prepared_data_dir")})
    values.update(max_source_length=16, max_target_length=16, max_eval_samples=5, seed=1)
    recipe.write_text(json.dumps(values))
    assert main(["prepare", str(recipe), "--preprocessing-num-workers", "1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "unexpected" not in error[0]
    assert f'{folder / RECORD}: `files.train` is "big"' in error[0]


def test_a_record_written_before_the_digests_is_checked_by_size_with_a_warning(prepared, caplog):
    model_args, data_args, folder = prepared
    record = json.loads((folder / RECORD).read_text())
    del record["sha256"]
    (folder / RECORD).write_text(json.dumps(record))
    with caplog.at_level("WARNING"):
        reused = prepare_data(model_args, data_args, seed=1)
    assert reused.reused
    assert f"{folder / RECORD} records no sha256 of its files (prepared by an earlier version)" in caplog.text
