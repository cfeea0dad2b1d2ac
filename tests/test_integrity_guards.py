"""Guards on what a user hands in or finds on disk: prepared data checked against its record by content, settings
named in their own errors, the newer methods' settings bounded and counted by the estimates, the Python API bounded,
and the smaller tools (export, average, convert-marian) honest about what they checked."""

import json
import random
import re
from pathlib import Path

import pytest
from conftest import TINY_SIZES

from hf_deep_nmt.cli import main
from hf_deep_nmt.data import prepared as prepared_data
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
    ],
)
def test_a_malformed_record_is_one_line_naming_the_file_and_the_field(prepared, edit, field, capsys):
    model_args, data_args, folder = prepared
    record = json.loads((folder / RECORD).read_text())
    (folder / RECORD).write_text(json.dumps(edit(record)))
    with pytest.raises(PreparedDataError, match=re.escape(f"{folder / RECORD}: {field}")):
        prepare_data(model_args, data_args, seed=1)


def test_a_record_whose_inputs_were_edited_is_refused(prepared):
    model_args, data_args, folder = prepared
    record = json.loads((folder / RECORD).read_text())
    record["inputs"]["max_source_length"] = 4
    (folder / RECORD).write_text(json.dumps(record))
    with pytest.raises(PreparedDataError, match=rf"{folder} does not match: its `inputs` were edited"):
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


# ---- every setting named in its own error ---------------------------------------------------------------------------


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    """A tiny train/prepare recipe in the current folder (`tmp_path`), with its run folder `run`."""
    monkeypatch.chdir(tmp_path)
    corpus = write_corpus(tmp_path / "train.tsv", pairs=20)
    values = {"model_type": "deep_nmt", "tokenizer_vocab_size": 120, "train_file": str(corpus)}
    values.update(validation_file=str(corpus), output_dir="run", max_steps=1, max_eval_samples=2)
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(values))
    return path


def _error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_prepared_data_root_that_is_a_file_or_cannot_be_created_names_the_variable(recipe, monkeypatch, capsys):
    (recipe.parent / "afile").write_text("x")
    monkeypatch.setenv(prepared_data.ENVIRONMENT_VARIABLE, "afile")
    assert main(["prepare", str(recipe)]) == 2
    error = _error(capsys)
    assert "HF_DEEP_NMT_PREPARED_DATA='afile' is not a folder (a file is there)" in error and "Errno" not in error
    monkeypatch.setenv(prepared_data.ENVIRONMENT_VARIABLE, "afile/below")
    assert main(["prepare", str(recipe)]) == 2
    error = _error(capsys)
    assert "Cannot create afile/below for the prepared data, as HF_DEEP_NMT_PREPARED_DATA='afile/below'" in error
    assert "Errno" not in error


@pytest.mark.parametrize(
    ("command", "flags", "expected"),
    [
        ("prepare", ["--prepared-data-dir", "."], "`prepared_data_dir` '.' is the current folder"),
        ("prepare", ["--prepared-data-dir", ".."], "`prepared_data_dir` '..' holds the current folder"),
        ("train", ["--prepared-data-dir", "run"], "`prepared_data_dir` 'run' is the run's `output_dir` 'run'"),
        ("train", ["--prepared-data-dir", "run/p"], "`prepared_data_dir` 'run/p' is inside the run's `output_dir`"),
        ("train", ["--prepared-data-dir", "ex", "--export-dir", "ex"], "'ex' is the run's `export_dir` 'ex'"),
    ],
)
def test_a_prepared_data_dir_that_is_not_a_folder_of_its_own_is_refused_before_anything_runs(
    recipe, capsys, command, flags, expected
):
    assert main([command, str(recipe), *flags]) == 2
    error = _error(capsys)
    assert expected in error and "name a new or empty folder" in error and "emove" not in error
    assert not (recipe.parent / "run").exists() and not (recipe.parent / "ex").exists()


def test_a_missing_model_or_tokenizer_path_is_reported_missing_before_any_hub_lookup(recipe, capsys, monkeypatch):
    from huggingface_hub import file_download

    def no_lookup(*args, **kwargs):
        raise AssertionError("looked up on the Hub")

    monkeypatch.setattr(file_download, "hf_hub_download", no_lookup)
    (recipe.parent / "runs").mkdir()
    for flags, setting in (
        (["--model-name-or-path", "runs/exp1/export"], "model_name_or_path"),
        (["--model-name-or-path", "runs/export"], "model_name_or_path"),  # `runs/` is a folder here: a path
        (["--tokenizer-name-or-path", "./tokenizer"], "tokenizer_name_or_path"),
        (["--tokenizer-name-or-path", "org/tokenizer"], "tokenizer_name_or_path"),  # offline, not in the cache
    ):
        assert main(["train", str(recipe), *flags]) == 2
        error = _error(capsys)
        assert f"`{setting}` {flags[1]!r} does not exist: it is not a local folder" in error, error
        assert "vocab" not in error and "internet" not in error


def test_model_overrides_given_as_a_json_flag_are_read(recipe, capsys):
    from hf_deep_nmt.training.arguments import parse_arguments

    model_args, *_ = parse_arguments([str(recipe), "--model-overrides", '{"d_model": 32, "encoder_layers": 2}'])
    assert model_args.model_overrides == {"d_model": 32, "encoder_layers": 2}
    with pytest.raises(SystemExit):
        parse_arguments([str(recipe), "--model-overrides", "[1]"])
    assert 'a JSON object ({"key": value, ...}) is needed' in capsys.readouterr().err


@pytest.mark.parametrize("name", ["recipe.txt", "missing.txt", "missing.json", "folder"])
def test_a_recipe_path_that_is_missing_or_not_a_recipe_is_named(recipe, capsys, name):
    if name == "recipe.txt":
        (recipe.parent / name).write_text(recipe.read_text())
    if name == "folder":
        (recipe.parent / name).mkdir()
    for command in ("train", "prepare"):
        assert main([command, name]) == 2
        error = _error(capsys)
        if name.startswith("missing"):
            assert f"Config file not found: {name}" in error
        else:
            assert f"{name}: a recipe is a JSON (.json) or YAML (.yaml, .yml) file" in error
        assert "not used" not in error


# ---- the newer methods inside their ranges and the estimates --------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            dict(hyper_connections=2000),
            r"`hyper_connections` must be 0 \(off\) or an integer >= 2 and <= 64 .*got 2000",
        ),
        (
            dict(hyper_connections=4, hyper_connections_sinkhorn_iterations=10**9),
            r"`hyper_connections_sinkhorn_iterations` must be a non-negative integer <= 100 .*got 1000000000",
        ),
        (
            dict(layer_aggregation="dlcl", dlcl_history_norm=False, dlcl_dilation=7, encoder_layers=6),
            r"`dlcl_dilation` must be smaller than the number of stored outputs of its stacks \(7",
        ),
        (
            dict(layer_aggregation="dlcl", dlcl_history_norm=False, dlcl_period=10**6),
            r"`dlcl_period` must be smaller than the number of stored outputs",
        ),
    ],
)
def test_the_newer_methods_settings_have_ranges(overrides, expected):
    from hf_deep_nmt import DeepNMTConfig

    with pytest.raises(ValueError, match=expected):
        DeepNMTConfig(**overrides)


def _saved_floats_per_token(config, batch: int = 2, length: int = 8) -> float:
    """float32 values a training forward of `config`'s model keeps for the backward pass (its saved tensors, each
    storage once, the parameters left out), per source token (as many target tokens)."""
    import torch

    from hf_deep_nmt import MODEL_CLASSES

    model = MODEL_CLASSES[type(config)](config).train()
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    held: dict[int, int] = {}

    def keep(tensor):
        pointer = tensor.untyped_storage().data_ptr()
        if pointer not in parameters:
            held[pointer] = max(held.get(pointer, 0), tensor.untyped_storage().nbytes())
        return tensor

    ids = torch.randint(4, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    return sum(held.values()) / 4 / (batch * length)


SMALL = {key: value for key, value in TINY_SIZES.items() if key != "encoder_layers"}  # each use sets its depth


@pytest.mark.parametrize("layers", [4, 16])
@pytest.mark.parametrize(
    "method",
    [
        dict(encoder_layer_aggregation="attnres"),
        dict(encoder_layer_aggregation="block_attnres", encoder_block_boundaries="layers:4"),
        dict(encoder_hyper_connections=4),
        dict(encoder_hyper_connections=4, hyper_connections_dynamic=True),
        dict(encoder_hyper_connections=4, hyper_connections_dynamic=True, hyper_connections_sinkhorn_iterations=20),
    ],
    ids=["attnres", "block-attnres", "hc", "dynamic-hc", "mhc"],
)
def test_the_training_estimate_counts_what_each_method_adds_as_measured(method, layers):
    """What a method adds to a plain stack's saved activations, measured, against what `training_memory` adds for it:
    a lower bound (never above), and no less than half (Attention Residuals grow with the square of the depth,
    the streams with their number, mHC with its iterations)."""
    from hf_deep_nmt import DeepNMTConfig
    from hf_deep_nmt.memory import training_memory

    method = dict(method)
    if method.get("encoder_block_boundaries") == "layers:4":
        method["encoder_block_boundaries"] = list(range(0, layers + 1, 4))
    plain = DeepNMTConfig(**SMALL, encoder_layers=layers)
    config = DeepNMTConfig(**SMALL, encoder_layers=layers, **method)
    measured = _saved_floats_per_token(config) - _saved_floats_per_token(plain)

    def activations(sizes) -> float:  # per token, without the weights, gradients and moments
        return (training_memory(sizes, 1000) - training_memory(sizes, 0)) / 4 / 1000

    estimated = activations(config) - activations(plain)
    assert 0.5 * measured <= estimated <= measured, (estimated, measured)


def test_a_thin_deep_attention_residuals_model_and_many_streams_are_refused_by_the_training_estimate():
    from hf_deep_nmt import DeepNMTConfig
    from hf_deep_nmt.memory import InsufficientMemoryError, check_training_size

    thin = DeepNMTConfig(
        **{**SMALL, "d_model": 8, "encoder_attention_heads": 2, "decoder_attention_heads": 2},
        encoder_layers=5000,
        encoder_layer_aggregation="attnres",
    )
    with pytest.raises(InsufficientMemoryError, match=r"Training the model \(d_model=8, encoder_layers=5000"):
        check_training_size(thin, 256)  # the plain stack's estimate: 0.6 GB; the history's: 200 GB


# ---- the Python API bounded -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    import torch

    from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration

    torch.manual_seed(0)
    config = DeepNMTConfig(**{**SMALL, "encoder_layers": 1, "decoder_layers": 1})
    return DeepNMTForConditionalGeneration(config).eval()


@pytest.mark.parametrize("setting", ["max_new_tokens", "max_length"])
def test_generate_refuses_an_output_cap_beyond_its_bound_with_the_number(tiny_model, setting):
    import torch

    from hf_deep_nmt.modeling.configuration_deep_nmt import MAX_GENERATE_TOKENS

    ids = torch.tensor([[5, 6, 7, 2]])
    with pytest.raises(ValueError, match=rf"`{setting}` allows .* over the {MAX_GENERATE_TOKENS:,} one generate\(\)"):
        tiny_model.generate(input_ids=ids, num_beams=2, **{setting: 10**6})
    assert tiny_model.generate(input_ids=ids, num_beams=2, max_new_tokens=2).shape[0] == 1


def test_all_ignored_labels_and_padding_read_as_text_are_warned_once(tiny_model, caplog):
    import logging

    import torch

    logging.Logger.warning_once.cache_clear()  # said once per process: another test may have said it already
    ids = torch.tensor([[5, 6, 7, 2], [1, 1, 1, 1]])
    with caplog.at_level("WARNING"):
        for _ in range(2):
            loss = tiny_model(input_ids=ids[:1], labels=torch.full((1, 3), -100)).loss
            tiny_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2)
    assert torch.isnan(loss)
    assert caplog.text.count("Every label of this batch is -100") == 1
    assert caplog.text.count("`input_ids` hold the pad id (1) where `attention_mask` is 1") == 1
    assert "in 1 row(s)" in caplog.text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[1, 2]", "holds a JSON list, not an object of config fields"),
        ('{"a": ' * 50_000 + "1" + "}" * 50_000, "is nested too deeply"),
        ("edit:model_type", "not one of model_type 'bogus_type'"),
        ("edit:dtype", "`dtype` 'floaty' is not a torch dtype"),
    ],
    ids=["list", "deep", "model-type", "dtype"],
)
def test_a_malformed_config_json_is_one_line_naming_the_file_and_the_field(tiny_model, tmp_path, text, expected):
    from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration

    tiny_model.config.save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    if text == "edit:model_type":
        text = json.dumps({**values, "model_type": "bogus_type"})
    elif text == "edit:dtype":
        text = json.dumps({**values, "dtype": "floaty"})
    (tmp_path / "config.json").write_text(text)
    for load in (DeepNMTConfig.from_pretrained, DeepNMTForConditionalGeneration.from_pretrained):
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'}") + ".*" + re.escape(expected)):
            load(str(tmp_path))


def test_a_hundred_thousand_decoder_layers_give_a_short_warning_and_are_refused_against_the_weights(
    tiny_model, tmp_path, caplog
):
    from hf_deep_nmt import DeepNMTForConditionalGeneration

    tiny_model.save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**values, "decoder_layers": 10**5}))
    with caplog.at_level("WARNING"), pytest.raises(ValueError, match=r"decoder_layers=100000, but the file holds 1"):
        DeepNMTForConditionalGeneration.from_pretrained(tmp_path)
    assert max(len(line) for line in caplog.text.splitlines()) < 1000


# ---- the smaller tools: average, convert-marian, the model card -----------------------------------------------------


def test_average_refuses_a_checkpoint_given_twice(tiny_model, tmp_path, monkeypatch, capsys):
    from hf_deep_nmt.training.averaging import average_checkpoints

    tiny_model.save_pretrained(tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"The checkpoint 'ck' is given twice: the average would count it twice"):
        average_checkpoints(["ck", "ck"])
    capsys.readouterr()
    assert main(["average", "ck", str(tmp_path / "ck"), "--output", "avg"]) == 2
    assert f"is given twice (as 'ck' and '{tmp_path / 'ck'}')" in _error(capsys)
    assert not (tmp_path / "avg").exists()


def test_a_converted_marian_model_has_a_start_token_and_its_tokenizer_fingerprint(tmp_path, caplog):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, MarianConfig, MarianMTModel, PreTrainedTokenizerFast

    from hf_deep_nmt.fingerprints import check_tokenizer_matches, tokenizer_fingerprint
    from hf_deep_nmt.tools.marian import convert_marian

    words = ["</s>", "<unk>", *(f"w{index}" for index in range(20)), "<pad>"]
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    pad = len(words) - 1
    marian = MarianMTModel(
        MarianConfig(
            vocab_size=len(words),
            d_model=16,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=16,
            decoder_ffn_dim=16,
            max_position_embeddings=32,
            pad_token_id=pad,
            decoder_start_token_id=pad,
            eos_token_id=0,
            bos_token_id=None,
        )
    ).eval()
    marian.save_pretrained(tmp_path / "marian")
    tokenizer.save_pretrained(tmp_path / "marian")
    out = convert_marian(tmp_path / "marian", tmp_path / "converted")
    values = json.loads((out / "config.json").read_text())
    assert values["bos_token_id"] == pad  # Marian's start: CTranslate2 needs an id of the vocabulary
    loaded = AutoModelForSeq2SeqLM.from_pretrained(out)
    from hf_deep_nmt.serving.ctranslate2 import _token, ctranslate2_blockers

    assert ctranslate2_blockers(loaded.config) == []
    assert _token(words, loaded.config.bos_token_id, "bos_token_id") == "<pad>"
    saved_tokenizer = AutoTokenizer.from_pretrained(out)
    assert values["tokenizer_fingerprint"] == tokenizer_fingerprint(saved_tokenizer)
    with caplog.at_level("WARNING"):
        check_tokenizer_matches(loaded, saved_tokenizer)
    assert "another tool" not in caplog.text


def test_the_model_card_names_the_default_lora_targets(tiny_model):
    from hf_deep_nmt.adapters import LORA_TARGET_MODULES
    from hf_deep_nmt.hub import render_model_card

    card = render_model_card(tiny_model, "org/tiny").text
    targets = ", ".join(f'"{name}"' for name in LORA_TARGET_MODULES)
    assert f'LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=[{targets}])' in card


def test_the_decoding_estimate_counts_what_a_step_of_the_newer_methods_holds():
    """d 16: a 5,000-layer Attention Residuals decoder holds 5,001 stored values of 16 per hypothesis in a step; four
    Hyper-Connections streams and their mix 2 * 4 * 16."""
    from hf_deep_nmt import DeepNMTConfig
    from hf_deep_nmt.modeling.sizes_deep_nmt import decoding_memory

    plain = DeepNMTConfig(**{**SMALL, "encoder_layers": 1, "decoder_layers": 5000})
    deep = DeepNMTConfig(**{**SMALL, "encoder_layers": 1, "decoder_layers": 5000}, decoder_layer_aggregation="attnres")
    assert decoding_memory(deep, 10, 5, 7) - decoding_memory(plain, 10, 5, 7) == 4 * 10 * 5001 * 16
    plain = DeepNMTConfig(**{**SMALL, "encoder_layers": 1})
    streams = DeepNMTConfig(**{**SMALL, "encoder_layers": 1}, decoder_hyper_connections=4)
    assert decoding_memory(streams, 10, 5, 7) - decoding_memory(plain, 10, 5, 7) == 4 * 10 * 2 * 4 * 16
