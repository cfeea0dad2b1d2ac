"""`translate --backend onnxruntime` imports what its backend needs (onnxruntime, numpy, tokenizers), not torch and
transformers: the torch-free stand-ins it uses give what the transformers and torch code they replace gives — the
tokenizer (`PlainTokenizer` against `AutoTokenizer`), the seeded shuffle of its batches (against `torch.randperm`),
the output caps (against the tensor version) and the decoding-memory estimate (against the model code's)."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import method_families
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from hf_deep_nmt.data.batching import SMALL_PERMUTATION, seeded_permutation
from hf_deep_nmt.data.corpus import sample_corpus_dir
from hf_deep_nmt.modeling.sizes_deep_nmt import decoding_memory
from hf_deep_nmt.serving.onnx_checks import decoding_bytes
from hf_deep_nmt.serving.options import DecodingOptions
from hf_deep_nmt.serving.plain_tokenizer import PlainTokenizer, load_tokenizer, plain_reason

EDGE_TEXTS = [
    "",
    " ",
    "   dos   espacios  ",
    "\t\n línea\r\n",
    "<unk>",
    "hola <unk> mundo",
    "</s>",
    "<s> hola <pad> mundo </s>",
    "x</s>y<pad>z",
    "日本語 ☃ 🙂 \u0301e",
    "ﬁ ＡＢＣ ½ \u00a0nbsp",
]


@pytest.fixture(scope="module")
def tokenizer_folder(sample_slice):
    return sample_slice(160, 300) / "tokenizer"


def sample_texts(every: int = 8) -> list[str]:
    """Both sides of the sample corpus's validation pairs and of every `every`-th training pair, and `EDGE_TEXTS`
    (the whole corpus, `every=1`, takes seconds: the test does not need every line to meet every merge)."""
    rows = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[::every]
    rows += (sample_corpus_dir() / "valid.tsv").read_text(encoding="utf-8").splitlines()
    return [text for row in rows for text in row.split("\t")] + EDGE_TEXTS


def test_the_plain_tokenizer_gives_autotokenizers_ids_and_text(tokenizer_folder):
    assert plain_reason(tokenizer_folder) is None
    auto, plain = AutoTokenizer.from_pretrained(tokenizer_folder), load_tokenizer(tokenizer_folder)
    assert isinstance(plain, PlainTokenizer)
    assert (plain.pad_token_id, plain.eos_token_id, len(plain)) == (auto.pad_token_id, auto.eos_token_id, len(auto))
    texts = sample_texts()
    ids = plain(texts)["input_ids"]
    assert ids == auto(texts)["input_ids"]
    for text in EDGE_TEXTS:  # one text at a time, as the translate loop calls it
        assert plain(text, verbose=False) == dict(auto(text, verbose=False))
    for start in range(0, len(ids), 1000):
        rows = ids[start : start + 1000]
        padded, expected = (
            plain.pad({"input_ids": rows}, return_tensors="np"),
            auto.pad({"input_ids": rows}, return_tensors="np"),
        )
        for key in ("input_ids", "attention_mask"):
            assert padded[key].dtype == expected[key].dtype and np.array_equal(padded[key], expected[key])
        for skip in (True, False):
            decoded = plain.batch_decode(padded["input_ids"], skip_special_tokens=skip)
            assert decoded == auto.batch_decode(expected["input_ids"], skip_special_tokens=skip)
    noise = np.random.default_rng(0).integers(0, len(auto), size=(64, 30))  # ids in any order, specials among them
    assert plain.batch_decode(noise, skip_special_tokens=True) == auto.batch_decode(noise, skip_special_tokens=True)
    batch, expected = (
        plain(texts[:9], padding=True, return_tensors="np"),
        auto(texts[:9], padding=True, return_tensors="np"),
    )
    assert all(np.array_equal(batch[key], expected[key]) for key in ("input_ids", "attention_mask"))


def test_the_settings_a_padding_call_saves_leave_the_tokenizer_plain(tokenizer_folder, tmp_path):
    """A tokenizer once called with padding or truncation saves those calls' settings with itself (as `export-onnx`
    writes it), unset in its config, set in its tokenizer.json: transformers sets them anew at every call, and they
    change no ids."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_folder, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    saved = {"max_length": None, "pad_to_multiple_of": None, "pad_token_type_id": 0, "padding_side": "right"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, **saved}), encoding="utf-8")
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.enable_truncation(max_length=4)
    backend.enable_padding(length=6)
    backend.save(str(folder / "tokenizer.json"))
    auto, plain = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    assert isinstance(plain, PlainTokenizer)
    ids = plain(EDGE_TEXTS)["input_ids"]
    assert ids == auto(EDGE_TEXTS)["input_ids"] and max(map(len, ids)) > 6  # neither truncated nor padded
    padded, expected = plain.pad({"input_ids": ids}), auto.pad({"input_ids": ids}, return_tensors="np")
    assert all(np.array_equal(padded[key], expected[key]) for key in ("input_ids", "attention_mask"))


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer_class": "PreTrainedTokenizerFast"},
        {"clean_up_tokenization_spaces": True},
        {"padding_side": "left"},
        {"add_prefix_space": False},
        {"sep_token": "</s>"},
        {"pad_token": "<new-pad>"},  # not a special token of tokenizer.json: transformers would add it
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_tokenizer_the_plain_one_cannot_reproduce_is_transformers(tokenizer_folder, tmp_path, change):
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_folder, folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, **change}), encoding="utf-8")
    assert plain_reason(folder) is not None
    assert not isinstance(load_tokenizer(folder), PlainTokenizer)


def test_the_batches_shuffle_as_torch_randperm_did():
    for count in (0, 1, 2, 7, 1000, SMALL_PERMUTATION, SMALL_PERMUTATION + 1):
        for seed in (0, 1, 2**31 + 3, 2**32 - 1, 2**32):
            expected = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).numpy()
            got = seeded_permutation(count, seed)
            assert got.dtype == expected.dtype and np.array_equal(got, expected), (count, seed)


def test_the_output_caps_of_an_array_are_those_of_a_tensor():
    lengths = np.arange(0, 1100)
    for a in (0.0, 0.1, 0.7, 1.0, 1.1, 1.2, 1.3, 1.7, 2.5, 3.3, 10.0):
        for b in (1, 5, 10, 200) if a == 0.0 else (0, 1, 5, 10, 200):
            options = DecodingOptions(max_length_a=a, max_length_b=b)
            expected = options.output_limits(torch.from_numpy(lengths)).numpy()
            assert np.array_equal(options.output_limits(lengths), expected), (a, b)


def test_the_onnx_memory_estimate_is_the_model_codes(tiny_config):
    """Every family's tiny config (Attention Residuals, Hyper-Connections, MSC, the averaging sublayers among them),
    read from its `to_dict` as an export's layout records it."""
    for name, (config_class, settings) in method_families(every_check=True).items():
        config = tiny_config(config_class, **settings)
        values = json.loads(json.dumps(config.to_dict()))
        for rows, source, cached in ((1, 1, 1), (12, 37, 50)):
            assert decoding_bytes(values, rows, source, cached) == decoding_memory(config, rows, source, cached), name


# A fresh interpreter runs the command, then prints which of the libraries the ONNX Runtime backend does without it
# imported.
PROBE = """
import json, sys
from hf_deep_nmt_cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "imported": sorted(m for m in ("torch", "transformers") if m in sys.modules)}))
"""


def test_translating_with_onnx_runtime_imports_neither_torch_nor_transformers(small_onnx_export, tmp_path):
    folder = small_onnx_export[0]
    (tmp_path / "in.txt").write_text("hola\n\nbuenos días\n", encoding="utf-8")
    command = ["translate", "--backend", "onnxruntime", "--model", str(folder), "--no-progress"]
    command += ["--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "out.txt"), "--threads", "1"]
    result = subprocess.run([sys.executable, "-c", PROBE, *command], capture_output=True, text=True, check=True)
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome["code"] == 0 and len((tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()) == 3
    assert outcome["imported"] == []


@pytest.mark.parametrize(
    "saved",
    [None, {}, {"num_beams": 4, "length_penalty": 0.6}, {"num_beams": 2, "early_stopping": True, "max_length": 30}],
    ids=["no-file", "empty", "beams-and-penalty", "early-stopping"],
)
def test_the_saved_generation_config_reads_as_transformers_reads_it(tmp_path, saved):
    """What the translate command reads of the decoder's generation config (beams, penalty; early stopping), without
    transformers: the values and defaults of `GenerationConfig`."""
    from transformers import GenerationConfig

    from hf_deep_nmt.serving.onnx import OnnxDecoder

    if saved is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(saved), encoding="utf-8")
    decoder = OnnxDecoder.__new__(OnnxDecoder)
    decoder.folder = tmp_path
    expected = GenerationConfig.from_pretrained(tmp_path) if saved is not None else GenerationConfig()
    for name in ("num_beams", "length_penalty", "early_stopping", "max_length"):
        assert getattr(decoder.generation_config, name) == getattr(expected, name), name
