"""Folders saved by version 0.1.0 (tests/fixtures/v0_1_0, written by `make_fixtures.py` at that version) load to the
same configs, save the same config.json again, and decode identically: same logits, greedy and beam outputs."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM

from hf_deep_nmt import registration  # noqa: F401  (registers the classes)

FIXTURES = Path(__file__).parent / "fixtures" / "v0_1_0"
LOADED = json.loads((FIXTURES / "configs_loaded.json").read_text())
OUTPUTS = json.loads((FIXTURES / "models_outputs.json").read_text())
SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
# Changed on purpose since 0.1.0, to the values stated below: every decoder layer gets the one cache-layer type that
# holds all of its decoding state (static and dynamic), the saved `auto_map` also names the encoder-decoder for
# `AutoModel`, and the five MSC keys are replaced by `msc_context` and `msc_context_sides`, which say the same.
# What the MSC keys of the fixtures stand for, written out here (not taken from the package, so that a wrong mapping
# fails): (msc_context_attention, msc_contextual_collaboration, msc_context_cell, msc_share_gru) -> msc_context, and
# msc_decoder_context -> msc_context_sides.
CONTEXT_KEYS_0_1_0 = ("msc_context_attention", "msc_contextual_collaboration", "msc_context_cell", "msc_share_gru")
MSC_CONTEXT_NOW = {
    (True, True, "gru", True): "gru",
    (True, True, "ffn", False): "ffn_per_block",
    (True, False, "gru", True): "block_output",
    (False, True, "gru", True): "none",
}
MSC_CONTEXT_SIDES_NOW = {True: "encoder_and_decoder", False: "encoder"}


def expected_now(saved: dict) -> dict:
    expected = dict(saved)
    if "decoder_layers" in expected:
        expected["decoder_layer_types"] = ["deep_nmt"] * expected["decoder_layers"]
    if "msc_context_attention" in expected:
        expected["msc_context"] = MSC_CONTEXT_NOW[tuple(expected.pop(key) for key in CONTEXT_KEYS_0_1_0)]
        expected["msc_context_sides"] = MSC_CONTEXT_SIDES_NOW[expected.pop("msc_decoder_context")]
    return expected


def without_auto_model(saved: dict) -> dict:
    saved = dict(saved)
    if "auto_map" in saved:
        saved["auto_map"] = {key: value for key, value in saved["auto_map"].items() if key != "AutoModel"}
    return saved


TARGET = torch.tensor([[0, 6, 8, 12], [0, 13, 4, 4]])


def test_every_fixture_config_has_its_expected_load():
    assert sorted(path.stem for path in (FIXTURES / "configs").glob("*.json")) == sorted(LOADED)
    assert sorted(path.name for path in (FIXTURES / "models").iterdir()) == sorted(OUTPUTS)


@pytest.mark.parametrize("name", sorted(LOADED))
def test_a_saved_config_loads_to_the_same_resolved_config(name, tmp_path, caplog):
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "config.json").write_bytes((FIXTURES / "configs" / f"{name}.json").read_bytes())
    with caplog.at_level("WARNING"):
        config = AutoConfig.from_pretrained(folder)
    assert caplog.text == ""  # nothing unknown, unused or replaced in a folder the package wrote
    assert type(config).__name__ == LOADED[name]["class"]
    resolved = json.loads(json.dumps(config.to_dict()))  # as the fixture holds it (JSON keys are strings)
    resolved.pop("_name_or_path", None)
    # `transformers_version` names a release (the one that wrote or the one that reads, by release): not compared
    assert {**resolved, "transformers_version": None} == {
        **expected_now(LOADED[name]["to_dict"]),
        "transformers_version": None,
    }
    # and saving it again writes the same file (but for the transformers version that wrote it)
    config.save_pretrained(tmp_path / "again")
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    original = json.loads((FIXTURES / "configs" / f"{name}.json").read_text())
    original = expected_now(original) if "decoder_layer_types" in original else original
    assert without_auto_model({**written, "transformers_version": None}) == {**original, "transformers_version": None}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_a_saved_model_decodes_identically(name):
    model = AutoModelForSeq2SeqLM.from_pretrained(FIXTURES / "models" / name).eval()
    expected = OUTPUTS[name]
    mask = SOURCE.ne(1)
    with torch.no_grad():
        logits = model(input_ids=SOURCE, attention_mask=mask, decoder_input_ids=TARGET).logits
        greedy, beam = (
            model.generate(
                input_ids=SOURCE,
                attention_mask=mask,
                max_new_tokens=6,
                num_beams=beams,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
            for beams in (1, 3)
        )
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), **close)
    assert greedy.sequences.tolist() == expected["greedy"]
    torch.testing.assert_close(
        torch.stack(greedy.scores, dim=1), torch.tensor(expected["greedy_step_scores"]), **close
    )
    assert beam.sequences.tolist() == expected["beam3"]
    torch.testing.assert_close(beam.sequences_scores, torch.tensor(expected["beam3_sequence_scores"]), **close)
