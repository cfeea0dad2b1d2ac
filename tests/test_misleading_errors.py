"""Errors that used to mislead, and work that used to be refused only after training: each message names the file,
the value at fault and the way out, and comes before step 1."""

import json
import os
import re
from pathlib import Path

import pytest

from hf_deep_nmt.data.corpus import load_parallel_dataset, sample_corpus_dir
from hf_deep_nmt.data.preparation import check_source_lengths
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.folders import check_export_folder
from hf_deep_nmt.serving.translate import decode_lines, read_lines
from hf_deep_nmt.training.arguments import parse_arguments
from hf_deep_nmt.training.pipeline import prepare

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


# ---- damaged files of a saved model folder ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tiny_config, tokenizer):
    from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
    from hf_deep_nmt.hub import export_hub_folder

    model = DlclForConditionalGeneration(tiny_config(DlclConfig, vocab_size=len(tokenizer)))
    return export_hub_folder(model, tokenizer, tmp_path_factory.mktemp("saved") / "model", repo_id="org/tiny")


def damaged_copy(saved_model: Path, tmp_path: Path, name: str, data: bytes) -> Path:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(saved_model, folder)
    (folder / name).write_bytes(data)
    return folder


DAMAGED = [
    ("tokenizer.json", b'{"version": "1.0", "trunc', r"tokenizer\.json is not valid JSON \(Unterminated string"),
    ("tokenizer.json", b'{"a": 1}', r"tokenizer\.json is JSON but not a tokenizer \("),
    ("tokenizer.json", b"[1, 2]", r"tokenizer\.json holds a JSON list, not the object"),
    ("config.json", b"[1, 2]", r"config\.json holds a JSON list, not the object"),
    ("config.json", b'{"model_type": ', r"config\.json is not valid JSON \(Expecting value: line 1 column 16 of 15"),
    ("tokenizer_config.json", b"{", r"tokenizer_config\.json is not valid JSON"),
    ("generation_config.json", b"\xff\xfe{}", r"generation_config\.json is not UTF-8 text"),
]


@pytest.mark.parametrize(("name", "data", "pattern"), DAMAGED, ids=[f"{n}:{d[:8]!r}" for n, d, _ in DAMAGED])
def test_a_damaged_json_file_of_a_model_folder_is_named_with_the_way_out(
    saved_model, tmp_path, capsys, name, data, pattern
):
    from hf_deep_nmt.cli import main

    folder = damaged_copy(saved_model, tmp_path, name, data)
    source = tmp_path / "in.es"
    source.write_text("hola\n", encoding="utf-8")
    assert main(["translate", "--model", str(folder), "--input", str(source), "--output", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "unexpected" not in error, error
    assert re.search(rf"Model folder '{folder}': {pattern}", error), error
    assert "restore it from the exported folder" in error
    assert not (tmp_path / "o").exists()


def test_a_damaged_tokenizer_file_of_a_ctranslate2_folder_is_named_before_ctranslate2_loads_it(
    saved_model, tmp_path, monkeypatch
):
    from hf_deep_nmt.serving import ctranslate2_decoder

    folder = damaged_copy(saved_model, tmp_path, "config.json", (saved_model / "config.json").read_bytes())
    converted = folder / "ctranslate2"
    converted.mkdir()
    (converted / "model.bin").write_bytes(b"\0")
    (converted / "config.json").write_text('{"add_source_bos": false}')  # CTranslate2's own config
    (converted / "tokenizer.json").write_bytes(b'{"version": "1.0", "trunc')
    monkeypatch.setattr(ctranslate2_decoder, "require_ctranslate2", lambda purpose: None)
    monkeypatch.setattr(ctranslate2_decoder, "CTranslate2Decoder", lambda *a, **k: pytest.fail("loaded"))
    pattern = rf"CTranslate2 folder '{converted}': tokenizer\.json is not valid JSON \(Unterminated string"
    with pytest.raises(ValueError, match=pattern) as caught:
        ctranslate2_decoder.load_ctranslate2_model(folder)
    assert f"write it again with `hf-deep-nmt export-ctranslate2 --model {folder} --into-model`" in str(caught.value)


@pytest.mark.parametrize(("data", "announced"), [(b"", 0), (b"not safetensors" * 4, 0x6566617320746F6E)])
def test_a_weights_file_that_is_not_safetensors_says_what_its_header_announces(saved_model, tmp_path, data, announced):
    from hf_deep_nmt.weights import safetensors_header

    folder = damaged_copy(saved_model, tmp_path, "model.safetensors", data)
    size = len(data)
    announced = announced or size
    with pytest.raises(ValueError) as caught:
        safetensors_header(folder / "model.safetensors")
    message = str(caught.value)
    assert f"'{folder / 'model.safetensors'}' is not a whole safetensors file" in message
    assert f"header of {announced} bytes in a file of {size}" in message and "restore the file" in message


def test_a_damaged_tokenizer_given_to_a_training_run_is_named_before_training(saved_model, tmp_path):
    folder = damaged_copy(saved_model, tmp_path, "tokenizer.json", b"[]")
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"tokenizer_name_or_path": str(folder), "output_dir": str(tmp_path / "out")}))
    model_args, data_args, _, training_args = parse_arguments([str(recipe)])
    with pytest.raises(ValueError, match=rf"Tokenizer folder '{folder}': tokenizer\.json holds a JSON list"):
        prepare(model_args, data_args, training_args)


# ---- staged runs: a finished stage's record and model, read before any stage trains -------------------------------


def stage_folder(tmp_path: Path, saved_model: Path, record: bytes | None) -> Path:
    import shutil

    stage = tmp_path / "run" / "stage-2-4-layers"
    stage.mkdir(parents=True)
    shutil.copytree(saved_model, stage / "model")
    if record is not None:
        (stage / "stage.json").write_bytes(record)
    return stage


GOOD_RECORD = {"stage": 2, "encoder_layers": 4, "steps": 6, "schedule_start": 4}
BAD_RECORDS = [
    (b'{"stage": 2, "encoder', r"is not valid JSON \("),
    (b"[2, 4, 6]", r"holds no step count \(`steps`: None, expected an integer >= 0\)"),
    (json.dumps({**GOOD_RECORD, "steps": "6"}).encode(), r"holds no step count \(`steps`: '6'"),
    (
        json.dumps({**GOOD_RECORD, "encoder_layers": 6}).encode(),
        r"records 6 encoder layers but the recipe's stage 2 has 4",
    ),
]


@pytest.mark.parametrize(("record", "pattern"), BAD_RECORDS, ids=["cut", "list", "steps", "depth"])
def test_a_damaged_stage_record_names_the_stage_folder_and_the_way_out(saved_model, tmp_path, record, pattern):
    from hf_deep_nmt.training.staged import finished_stage

    stage = stage_folder(tmp_path, saved_model, record)
    with pytest.raises(ValueError, match=rf"^Stage 2: '{stage / 'stage.json'}' {pattern}") as caught:
        finished_stage(stage, 2, 4)
    assert f"delete the folder '{stage}' to train stage 2 again (the other stages are kept)" in str(caught.value)


def test_a_finished_stage_without_a_whole_model_is_named_before_training(saved_model, tmp_path):
    from hf_deep_nmt.training.staged import finished_stage

    stage = stage_folder(tmp_path, saved_model, json.dumps(GOOD_RECORD).encode())
    assert finished_stage(stage, 2, 4) == GOOD_RECORD
    assert finished_stage(tmp_path / "run" / "stage-3-6-layers", 3, 6) is None  # not trained yet
    weights = stage / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    with pytest.raises(
        ValueError, match=rf"'{weights}' is not a whole safetensors file.* Or delete the folder '{stage}'"
    ):
        finished_stage(stage, 2, 4)
    weights.unlink()
    with pytest.raises(ValueError, match=rf"final model '{stage / 'model'}' is missing or incomplete"):
        finished_stage(stage, 2, 4)


# ---- averaging more checkpoints than the run writes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_steps", "save_steps", "count", "written"),
    [(4, 3, 3, "[3, 4]"), (4, 0.5, 3, "[2, 4]"), (10, 5, 3, "[5, 10]"), (1, 1, 2, "[1]")],
)
def test_averaging_more_checkpoints_than_the_run_writes_is_refused_before_step_1(
    tmp_path, max_steps, save_steps, count, written
):
    from hf_deep_nmt.training.pipeline import check_before_work

    recipe = tmp_path / "recipe.json"
    settings = {"model_type": "deep_nmt", "max_steps": max_steps, "save_strategy": "steps", "save_steps": save_steps}
    recipe.write_text(json.dumps({**settings, "average_checkpoints": count, "output_dir": str(tmp_path / "out")}))
    arguments = parse_arguments([str(recipe)])
    pattern = rf"`average_checkpoints={count}` averages .* `max_steps={max_steps}` with `save_steps=.*` writes "
    with pytest.raises(ValueError, match=pattern + re.escape(f"{written.count(',') + 1} (at steps {written})")):
        check_before_work(*arguments)
    assert not (tmp_path / "out").exists()


def test_averaging_as_many_checkpoints_as_the_run_writes_is_allowed(tmp_path):
    from hf_deep_nmt.training.pipeline import check_checkpoints_to_average

    recipe = tmp_path / "recipe.json"
    settings = {"max_steps": 7, "save_strategy": "steps", "save_steps": 3, "average_checkpoints": 3}
    recipe.write_text(json.dumps({**settings, "output_dir": str(tmp_path / "out")}))
    _, _, export_args, training_args = parse_arguments([str(recipe)])
    check_checkpoints_to_average(export_args, training_args)  # steps 3, 6 and the last, 7


# ---- `hf-deep-nmt average` ------------------------------------------------------------------------------------------


def test_average_names_a_missing_path_a_file_and_a_fifo_for_what_they_are(saved_model, tmp_path, capsys, monkeypatch):
    from hf_deep_nmt.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    expected = {
        "absent": "No such checkpoint folder: 'absent' does not exist (check the path)",
        "afile": "Checkpoint 'afile' is not a folder (a file, FIFO or device)",
        "fifo": "Checkpoint 'fifo' is not a folder (a file, FIFO or device)",
    }
    for name, message in expected.items():
        assert main(["average", str(saved_model), name, "--output", "out"]) == 2
        error = capsys.readouterr().err
        assert message in error and "No model.safetensors" not in error, error
    assert not (tmp_path / "out").exists()


def test_average_names_a_checkpoint_whose_config_is_a_list(saved_model, tmp_path, capsys):
    from hf_deep_nmt.cli import main

    folder = damaged_copy(saved_model, tmp_path, "config.json", b"[]")
    assert main(["average", str(saved_model), str(folder), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert f"Checkpoint '{folder}': config.json holds a JSON list" in error and "leave it out of the average" in error
    assert "AttributeError" not in error and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["grow", "inspect"])
@pytest.mark.parametrize(("name", "data"), [("config.json", b"[1]"), ("tokenizer.json", b"[]")])
def test_grow_and_inspect_name_a_damaged_file_of_the_model_folder(saved_model, tmp_path, capsys, command, name, data):
    from hf_deep_nmt.cli import main

    folder = damaged_copy(saved_model, tmp_path, name, data)
    out = tmp_path / "out"
    argv = ["--model", str(folder), "--output", str(out)] + (["--layers", "2"] if command == "grow" else [])
    assert main([command, *argv]) == 2
    error = capsys.readouterr().err
    assert f"Model folder '{folder}': {name} holds a JSON list, not the object of settings it should" in error, error
    assert not out.exists()


def test_inspect_names_a_cut_off_weights_file(saved_model, tmp_path, capsys):
    from hf_deep_nmt.cli import main

    weights = (saved_model / "model.safetensors").read_bytes()
    folder = damaged_copy(saved_model, tmp_path, "model.safetensors", weights[:100])
    assert main(["inspect", "--model", str(folder), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert (
        f"'{folder / 'model.safetensors'}' is not a whole safetensors file" in error and "SafetensorError" not in error
    )


# ---- a recipe's corpus files and repo_id, checked with the settings -------------------------------------------------


def recipe_arguments(tmp_path: Path, **settings):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"model_type": "deep_nmt", "output_dir": str(tmp_path / "out"), **settings}))
    return parse_arguments([str(recipe)])


def test_a_fifo_or_a_missing_half_of_a_two_file_corpus_is_refused_with_the_settings(tmp_path):
    from hf_deep_nmt.training.pipeline import check_before_work

    os.mkfifo(tmp_path / "stream.tsv")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'stream.tsv'} is not a regular file \(a FIFO"):
        check_before_work(*recipe_arguments(tmp_path, train_file=str(tmp_path / "stream.tsv")))
    (tmp_path / "corpus.es").write_text("hola\n", encoding="utf-8")
    arguments = recipe_arguments(tmp_path, train_file=str(tmp_path / "corpus"), source_lang="es", target_lang="en")
    with pytest.raises(FileNotFoundError, match=rf"not found: {tmp_path / 'corpus.en'} \(check the path"):
        check_before_work(*arguments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("repo_id", ["my model", "a/b/c"])
def test_a_repo_id_that_is_not_one_is_refused_before_training(tmp_path, repo_id):
    from hf_deep_nmt.training.pipeline import check_before_work

    with pytest.raises(
        ValueError, match=rf"`repo_id` '{repo_id}' is not a Hub repository id .* 'your-name/model-name'"
    ):
        check_before_work(*recipe_arguments(tmp_path, repo_id=repo_id))
    check_before_work(*recipe_arguments(tmp_path, repo_id="your-name/model-name"))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, "config.json has no `model_type` (this package's are deep_nmt, deep_nmt_attnres, deep_nmt_deepnorm,"),
        ({"model_type": "nosuch"}, "config.json names `model_type` 'nosuch', which neither this package (deep_nmt,"),
    ],
)
def test_a_config_without_a_known_model_type_is_not_told_to_upgrade_transformers(
    saved_model, tmp_path, capsys, config, expected
):
    from hf_deep_nmt.cli import main

    folder = damaged_copy(saved_model, tmp_path, "config.json", json.dumps(config).encode())
    source = tmp_path / "in.es"
    source.write_text("hola\n", encoding="utf-8")
    assert main(["translate", "--model", str(folder), "--input", str(source), "--output", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err
    assert f"Model folder '{folder}': {expected}" in error and "restore it from the exported folder" in error
    assert "pip install" not in error


def test_translate_input_in_utf16_without_a_byte_order_mark_is_refused_not_translated():
    data = "hola\nsí\n".encode("utf-16-le")
    with pytest.raises(
        ValueError, match=r"in\.es holds NUL bytes \(the first at byte 1, line 1\): UTF-16 text"
    ) as caught:
        decode_lines(data, "in.es")
    assert "`iconv -f UTF-16LE -t UTF-8`" in str(caught.value)
    assert decode_lines("hola\nsí\n".encode(), "in.es") == ["hola", "sí"]


def test_export_dir_dot_is_refused_with_the_settings_not_after_training(tmp_path, monkeypatch):
    from hf_deep_nmt.training.pipeline import check_before_work

    here = tmp_path / "project"
    here.mkdir()
    monkeypatch.chdir(here)
    arguments = recipe_arguments(tmp_path, export_dir=".")
    with pytest.raises(ValueError, match=rf"'\.' is the current folder \({here}\) or a folder above it"):
        check_before_work(*arguments)
    assert not (tmp_path / "out").exists() and list(here.iterdir()) == []


# ---- issue 40, class 7: corpus lines readers split differently, JSON keys twice, weights that lie ------------------


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("c.tsv", "sí\tyes\r\nmu\rndo\tworld\r\n", r"c\.tsv:2: a carriage return \(U\+000D\) at column 3 inside"),
        ("c.tsv", "sí\tyes\nmundo\tthe\u2028world\n", r"c\.tsv:2: a line separator \(U\+2028\) at column 10 inside"),
        ("c.jsonl", '{"es": "a\\u2029b", "en": "x"}\n', r"c\.jsonl:1: a paragraph separator \(U\+2029\) at column 2"),
    ],
)
def test_a_line_break_inside_a_sentence_is_refused_naming_line_and_character(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    with pytest.raises(ValueError, match=expected) as caught:
        load_parallel_dataset(train_file=str(path), source_lang="es", target_lang="en")
    assert "some readers split lines on it and others do not" in str(caught.value)
    assert "Replace it with a space, e.g. `perl -CSD -pi -e" in str(caught.value) and str(path) in str(caught.value)


def test_a_crlf_corpus_is_still_read_and_a_two_file_corpus_with_a_cr_is_refused(tmp_path):
    (tmp_path / "ok.tsv").write_bytes("sí\tyes\r\nmundo\tworld\r\n".encode())
    pairs = load_parallel_dataset(train_file=str(tmp_path / "ok.tsv"))["train"]
    assert pairs["source"] == ["sí", "mundo"] and pairs["target"] == ["yes", "world"]
    (tmp_path / "two.es").write_bytes(b"uno\ndos\rtres\n")
    (tmp_path / "two.en").write_bytes(b"one\ntwo three\n")
    with pytest.raises(ValueError, match=r"two\.es:2: a carriage return \(U\+000D\) at column 4"):
        load_parallel_dataset(train_file=str(tmp_path / "two"), source_lang="es", target_lang="en")


def test_a_jsonl_key_given_twice_is_refused_naming_the_key_and_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"es": "hola", "en": "hi"}\n{"es": "sí", "en": "yes", "en": "no"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"c\.jsonl:2: the key 'en' is given twice in one object .* keep one"):
        load_parallel_dataset(train_file=str(path), source_lang="es", target_lang="en")


def test_a_safetensors_file_cut_after_its_header_is_named_by_translate(saved_model, tmp_path, capsys):
    import struct

    from hf_deep_nmt.cli import main

    weights = (saved_model / "model.safetensors").read_bytes()
    header = 8 + struct.unpack("<Q", weights[:8])[0]
    folder = damaged_copy(saved_model, tmp_path, "model.safetensors", weights[: header + 16])
    source = tmp_path / "in.es"
    source.write_text("hola\n", encoding="utf-8")
    assert main(["translate", "--model", str(folder), "--input", str(source), "--output", str(tmp_path / "o")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "SafetensorError" not in error, error
    assert f"'{folder / 'model.safetensors'}' is not a whole safetensors file (cut off): its header places" in error
    assert f"up to byte {len(weights)} in a file of {header + 16}; save the model again" in error
    assert not (tmp_path / "o").exists()


def test_a_saved_model_with_nan_weights_is_refused_before_training_naming_the_tensor(saved_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from hf_deep_nmt.training.pipeline import check_before_work

    folder = tmp_path / "nan-model"
    shutil.copytree(saved_model, folder)
    weights = load_file(folder / "model.safetensors")
    name = sorted(weights)[3]
    weights[name].view(-1)[1] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    arguments = recipe_arguments(tmp_path, model_type=None, model_name_or_path=str(folder))
    with pytest.raises(ValueError) as caught:
        check_before_work(*arguments)
    message = str(caught.value)
    assert f"`model_name_or_path` '{folder}' holds NaN weights (the first: {name} in model.safetensors)" in message
    assert "learning rate" not in message and "earlier checkpoint" in message
    assert not (tmp_path / "out").exists()
    check_before_work(*recipe_arguments(tmp_path, model_type=None, model_name_or_path=str(saved_model)))


def test_a_run_of_another_recipe_also_names_a_changed_process_count(tmp_path):
    from hf_deep_nmt.training.run_folder import RUN_RECORD, RunFolder, RunFolderError

    folder = tmp_path / "run"
    (folder / "checkpoint-2").mkdir(parents=True)
    one = {"world_size": 1, "per_process": 8, "gradient_accumulation_steps": 1, "unit": "sentences", "per_update": 8}
    two = {**one, "world_size": 2, "per_update": 16}
    (folder / RUN_RECORD).write_text(json.dumps({"command": "train", "recipe": {"max_steps": 3}, "shape": one}))
    expected = (
        r"holds a run of another recipe \(max_steps: 3 -> 2\), trained with 1 process\(es\), 8 sentences per update "
        r"\(8 x 1 accumulation x 1\) where this one has 2 process\(es\), 16 sentences per update"
    )
    with pytest.raises(RunFolderError, match=expected), RunFolder(folder, "train", {"max_steps": 2}, two) as again:
        again.start(None, False)
