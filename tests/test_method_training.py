"""Every registered method trains through `hf-deep-nmt train` from one recipe: its preset's `model_type`, tiny sizes
and the settings of its first doctor check, two steps on a slice of the bundled corpus, then evaluation, export and
a reload of the exported folder. The methods come from `METHODS`, so a new one is trained here without a new line."""

import json
from pathlib import Path

import pytest
from transformers import AutoModelForSeq2SeqLM

from hf_deep_nmt.cli import main
from hf_deep_nmt.data.corpus import sample_corpus_dir
from hf_deep_nmt.modeling.modeling_deep_nmt import METHODS

TINY = dict(
    d_model=16,
    encoder_layers=3,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("corpus")
    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()
    (folder / "train.tsv").write_text("\n".join(lines[:120]) + "\n", encoding="utf-8")
    (folder / "valid.tsv").write_text("\n".join(lines[120:124]) + "\n", encoding="utf-8")
    return {"train_file": str(folder / "train.tsv"), "validation_file": str(folder / "valid.tsv")}


@pytest.mark.parametrize("model_type", list(METHODS))
def test_the_method_trains_evaluates_and_exports_through_the_train_command(model_type, corpus, tmp_path, capsys):
    method = METHODS[model_type]
    settings = {**TINY, **next(iter(method.checks.values()))}
    if settings.get("msc_block_layers") is not None:
        settings.pop("encoder_layers")  # the blocks make the encoder
    recipe = {
        "model_type": model_type,
        "model_overrides": settings,
        **corpus,
        "tokenizer_vocab_size": 400,
        "max_source_length": 256,
        "max_target_length": 256,
        "max_steps": 2,
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-3,
        "save_strategy": "no",
        "report_to": "none",
        "plot_curves": False,
        "translate_examples": 1,
        "num_beams": 2,
        "output_dir": str(tmp_path / "run"),
        "export_dir": str(tmp_path / "export"),
    }
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    assert main(["train", str(path)]) == 0, capsys.readouterr().err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["train_steps"] == 2 and "bleu" in results
    exported = AutoModelForSeq2SeqLM.from_pretrained(Path(tmp_path / "export"))
    assert type(exported) is method.model_class and exported.config.model_type == model_type
    for key, value in settings.items():
        assert getattr(exported.config, key) == value, key
