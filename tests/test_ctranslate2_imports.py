"""`translate --backend ctranslate2` (and `serve` on that backend) imports what its backend needs (ctranslate2, numpy,
tokenizers), not torch and transformers: what it reads of a model's files without them reads as transformers reads
it (the generation config, the model's config for what CTranslate2 can express, the tokenizer's token strings), and
what it cannot reproduce is left to transformers. The fresh-interpreter test needs the optional `ctranslate2` package
and is skipped without it; the rest run without it."""

import importlib.util
import json
import subprocess
import sys

import pytest
from conftest import method_families
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PretrainedConfig

from hf_deep_nmt.cli import main
from hf_deep_nmt.serving.ctranslate2 import ctranslate2_blockers
from hf_deep_nmt.serving.ctranslate2_decoder import CTranslate2Decoder
from hf_deep_nmt.serving.ctranslate2_layout import (
    GENERATION_FIELDS,
    GENERIC_CONFIG_KEYS,
    IDENTITY_FILE,
    UNSUPPORTED_GENERATION,
    SavedGenerationConfig,
    read_generation_config,
    read_identity,
    servable_by_plain_reading,
)
from hf_deep_nmt.serving.plain_tokenizer import PlainTokenizer, load_tokenizer

needs_ctranslate2 = pytest.mark.skipif(
    importlib.util.find_spec("ctranslate2") is None, reason='ctranslate2 is in the optional "bench" extra'
)
needs_serve = pytest.mark.skipif(
    importlib.util.find_spec("uvicorn") is None, reason='uvicorn is in the optional "serve" extra'
)

# A fresh interpreter runs `translate`, then `serve` up to the point where it would listen, and prints which of the
# libraries the CTranslate2 backend does without they imported.
PROBE = """
import json, sys
from hf_deep_nmt_cli import main
import hf_deep_nmt.serving.server.runner as runner
served = []
runner.run_server = lambda service, *args, **kwargs: served.append(type(service.decoder).__name__)
model = sys.argv[sys.argv.index("--model") + 1]
codes = [main(sys.argv[1:]), main(["serve", "--backend", "ctranslate2", "--model", model, "--threads", "1"])]
imported = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print(json.dumps({"codes": codes, "served": served, "imported": imported}))
"""


@needs_ctranslate2
@needs_serve
def test_translating_and_serving_with_ctranslate2_import_neither_torch_nor_transformers(small_onnx_export, tmp_path):
    folder = tmp_path / "model"  # a model folder holding its config and, in ctranslate2/, its CTranslate2 model
    folder.mkdir()
    (folder / "config.json").write_bytes((small_onnx_export[0] / "config.json").read_bytes())
    export = ["export-ctranslate2", "--model", str(small_onnx_export[0]), "--output", str(folder / "ctranslate2")]
    assert main(export) == 0
    lines = ["hola", "", "buenos días", "la casa es grande"]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    command = ["translate", "--backend", "ctranslate2", "--model", str(folder), "--no-progress", "--threads", "1"]
    command += ["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt")]
    result = subprocess.run([sys.executable, "-c", PROBE, *command], capture_output=True, text=True, check=True)
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome == {"codes": [0, 0], "served": ["CTranslate2Decoder"], "imported": []}, result.stderr
    # the same lines as the decoder with transformers' tokenizer and generation config gives
    from hf_deep_nmt.serving.translate import translate

    decoder = CTranslate2Decoder(folder / "ctranslate2")
    expected = translate(decoder, AutoTokenizer.from_pretrained(folder / "ctranslate2"), lines, num_beams=2)
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")[:-1] == expected


@pytest.mark.parametrize(
    "saved",
    [
        None,
        {},
        {"num_beams": 4, "length_penalty": 0.6, "max_length": 108, "_from_model_config": True, "eos_token_id": 2},
        {
            "num_beams": 2,
            "early_stopping": True,
            "min_length": 3,
            "repetition_penalty": 1.2,
            "no_repeat_ngram_size": 3,
        },
        {"bad_words_ids": [[7], [3, 4]], "suppress_tokens": [5], "forced_eos_token_id": 2, "eos_token_id": [2]},
        {"early_stopping": "never", "forced_bos_token_id": 5, "min_new_tokens": 2},
    ],
    ids=["no-file", "empty", "exported", "penalties", "marian-like", "refused-settings"],
)
def test_the_generation_config_reads_as_transformers_reads_it(tmp_path, saved):
    """Every setting CTranslate2's decoding and the translate command read (and those `check` refuses), without
    transformers: the values and defaults of `GenerationConfig`."""
    if saved is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(saved), encoding="utf-8")
    plain = read_generation_config(tmp_path)
    assert isinstance(plain, SavedGenerationConfig)
    expected = GenerationConfig.from_pretrained(tmp_path) if saved is not None else GenerationConfig()
    for name in (*GENERATION_FIELDS, *UNSUPPORTED_GENERATION):
        assert getattr(plain, name) == getattr(expected, name), name
    decoder = CTranslate2Decoder.__new__(CTranslate2Decoder)
    decoder.folder = tmp_path
    assert isinstance(decoder.generation_config, SavedGenerationConfig)


@pytest.mark.parametrize(
    ("saved", "named"),
    [
        ({"num_beams": "4"}, "`num_beams` is '4', not a positive integer"),
        ({"num_beams": 0}, "`num_beams` is 0, not a positive integer"),
        ({"length_penalty": True}, "`length_penalty` is True, not a number"),
        ({"early_stopping": "sometimes"}, "`early_stopping` is 'sometimes', not true, false or \"never\""),
        ({"bad_words_ids": [[]]}, "`bad_words_ids` is [[]], not a list of non-empty lists of token ids"),
        ({"suppress_tokens": 5}, "`suppress_tokens` is 5, not a list of token ids"),
        ({"eos_token_id": -1}, "`eos_token_id` is -1, not a token id or a list of them"),
    ],
)
def test_a_malformed_generation_setting_is_named_with_its_file(tmp_path, saved, named):
    (tmp_path / "generation_config.json").write_text(json.dumps(saved), encoding="utf-8")
    with pytest.raises(ValueError, match="generation_config.json: ") as caught:
        read_generation_config(tmp_path)
    assert named in str(caught.value) and "export-ctranslate2" in str(caught.value)


@pytest.mark.parametrize(
    "contents",
    ['{"num_beams": 4, "do_sample": true, "top_k": 5}', '{"num_beams": 4, "cache_implementation": "static"}', "[4]"],
)
def test_a_generation_config_the_plain_reading_does_not_reproduce_is_transformers(tmp_path, contents):
    (tmp_path / "generation_config.json").write_text(contents, encoding="utf-8")
    assert read_generation_config(tmp_path) is None
    decoder = CTranslate2Decoder.__new__(CTranslate2Decoder)
    decoder.folder = tmp_path
    if contents.startswith("{"):
        assert isinstance(decoder.generation_config, GenerationConfig)


def test_the_identity_file_names_a_malformed_field(tmp_path):
    assert read_identity(tmp_path) == {}  # exported before it was written
    fields = {"vocab_size": 300, "pad_token_id": 1, "eos_token_id": 2, "max_positions": 1026, "model_type": "deep_nmt"}
    (tmp_path / IDENTITY_FILE).write_text(json.dumps(fields), encoding="utf-8")
    assert read_identity(tmp_path) == fields
    for field, value, named in (
        ("max_positions", "1026", "`max_positions` is '1026', not an integer >= 2"),
        ("vocab_size", 0, "`vocab_size` is 0, not a positive integer"),
        ("eos_token_id", [], "`eos_token_id` is [], not a token id or a list of them"),
    ):
        (tmp_path / IDENTITY_FILE).write_text(json.dumps({**fields, field: value}), encoding="utf-8")
        with pytest.raises(ValueError, match=f"{IDENTITY_FILE}: ") as caught:
            read_identity(tmp_path)
        assert named in str(caught.value) and "export-ctranslate2" in str(caught.value)
    (tmp_path / IDENTITY_FILE).write_text('{"vocab_size": 3', encoding="utf-8")
    with pytest.raises(ValueError, match=f"{IDENTITY_FILE} is not JSON"):
        read_identity(tmp_path)


def test_the_plain_reading_of_a_config_passes_only_what_ctranslate2_expresses(tiny_config, tmp_path):
    """Every family's tiny config as `save_pretrained` writes it: the plain reading passes a model exactly where
    `ctranslate2_blockers` of the config transformers loads finds nothing (so the serving road needs no
    transformers for a servable model), and a key it does not know leaves the answer to transformers."""
    assert GENERIC_CONFIG_KEYS == set(PretrainedConfig().to_dict()) | {"auto_map"}
    passed = []
    for name, (config_class, settings) in method_families(every_check=True).items():
        tiny_config(config_class, **settings).save_pretrained(tmp_path / name)
        values = json.loads((tmp_path / name / "config.json").read_text(encoding="utf-8"))
        blockers = ctranslate2_blockers(AutoConfig.from_pretrained(tmp_path / name))
        assert servable_by_plain_reading(values) == (blockers == []), (name, blockers)
        assert not servable_by_plain_reading({**values, "a_new_setting": 1}), name
        passed += [name] * (blockers == [])
    assert passed  # the plain model among them
    values = json.loads((tmp_path / passed[0] / "config.json").read_text(encoding="utf-8"))
    for changed in ({"decoder_layer_aggregation": None}, {"activation_function": "mish"}, {"model_type": "marian"}):
        assert not servable_by_plain_reading({**values, **changed}), changed


def test_the_plain_tokenizer_converts_tokens_as_transformers_does(sample_slice):
    folder = sample_slice(160, 300) / "tokenizer"
    auto, plain = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    assert isinstance(plain, PlainTokenizer)
    ids = list(range(len(auto)))
    tokens = auto.convert_ids_to_tokens(ids)
    assert plain.convert_ids_to_tokens(ids) == tokens
    unknown = [*tokens, "<hf-deep-nmt-unused-9999>", "no-such-token"]
    assert plain.convert_tokens_to_ids(unknown) == auto.convert_tokens_to_ids(unknown)


def test_a_ctranslate2_model_written_as_a_missing_path_is_named_before_any_hub_lookup(tmp_path):
    """As `onnx_folder` names it: not the Hub's complaint that a path is no repository id."""
    from hf_deep_nmt.serving.ctranslate2_decoder import ctranslate2_folder

    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=r"^Model '.*no-such-model' does not exist \(a local folder was given"):
        ctranslate2_folder(str(missing))
