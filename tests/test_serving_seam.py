"""The serving seam: `translate` runs any `Decoder` through one loop (batches, order, empty lines, the memory check
before the first batch), each backend refuses by name what it cannot do, and the serving package stands on its own
(no module of it imports the training package, none imports another inside a function)."""

import ast
from pathlib import Path

import pytest

from hf_deep_nmt.serving.decoder import Decoder
from hf_deep_nmt.serving.onnx import OnnxDecoder
from hf_deep_nmt.serving.options import DecodingOptions
from hf_deep_nmt.serving.torch_decoder import TorchDecoder
from hf_deep_nmt.serving.translate import translate

SERVING = Path(__file__).resolve().parents[1] / "hf_deep_nmt" / "serving"


class WordTokenizer:
    """One id per word (its length), `</s>` = 0: enough for the loop, which only tokenizes."""

    def __call__(self, text, verbose=False):
        return {"input_ids": [len(word) for word in text.split()] + [0]}


class Spelling(Decoder):
    """Translates a batch into its ids, and records what the loop asked."""

    def __init__(self):
        self.batches, self.fits = [], None

    def check_fits(self, batches, options):
        self.fits = list(batches)

    def translate_batch(self, tokenizer, sources, options):
        self.batches.append(len(sources))
        return [" ".join(map(str, ids)) for ids in sources]


def test_translate_runs_any_decoder_through_one_loop():
    decoder = Spelling()
    lines = ["a bb ccc", "", "dddd", "ee f", " "]
    assert translate(decoder, WordTokenizer(), lines, batch_size=2) == ["1 2 3 0", "", "4 0", "2 1 0", ""]
    assert sorted(decoder.batches) == [1, 2] and sorted(decoder.fits) == [(1, 4), (2, 3)]


def test_a_decoder_without_a_compiled_step_refuses_compile():
    with pytest.raises(ValueError, match=r"`compile=True` \(`--compile`\) compiles the torch model"):
        translate(OnnxDecoder.__new__(OnnxDecoder), WordTokenizer(), ["a"], compile=True)


@pytest.mark.parametrize(
    ("decoder", "settings", "message"),
    [
        (TorchDecoder, dict(int8=True), "--int8 picks the int8 graphs of --backend onnxruntime"),
        (OnnxDecoder, dict(device="cuda"), "--device cuda is for --backend torch"),
        (OnnxDecoder, dict(compile=True), "`compile=True` (`--compile`) compiles the torch model"),
        (TorchDecoder, dict(compile="yes"), "`compile` must be True or False, got 'yes'"),
    ],
)
def test_each_backend_refuses_the_settings_it_cannot_honour(decoder, settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decoder.check_settings(**settings)
    decoder.check_settings(device="cpu" if decoder is OnnxDecoder else "cuda")  # what it can honour passes


def test_the_onnx_decoder_refuses_the_gnmt_penalty_before_decoding():
    options = DecodingOptions(num_beams=2, length_penalty_form="gnmt")
    with pytest.raises(ValueError, match="returns the best one only"):
        OnnxDecoder.__new__(OnnxDecoder).check(WordTokenizer(), options)


@pytest.mark.parametrize("path", sorted(SERVING.glob("*.py")), ids=lambda path: path.name)
def test_serving_imports_no_training_and_nothing_of_its_own_inside_functions(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = set(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_deep_nmt"):
            assert not node.module.startswith("hf_deep_nmt.training"), (path.name, node.module)
            if node.module.startswith("hf_deep_nmt.serving"):
                assert node in top, f"{path.name} imports {node.module} inside a function"
