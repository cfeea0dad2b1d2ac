"""Batches with nothing to translate and a NaN length penalty: refused by the model code (it ships as remote code, so
the checks live there), instead of being decoded as if they were normal."""

import math

import pytest
import torch

from hf_deep_nmt.modeling import modeling_deep_nmt
from hf_deep_nmt.serving.translate import translate
from hf_deep_nmt.tools import doctor


@pytest.fixture(scope="module")
def model():
    return doctor.family_model("prenorm", "cpu")


@pytest.fixture
def batch(model):
    padded = doctor.padded_batch("cpu", [7, 4, 5], model.config.vocab_size)
    return {key: padded[key] for key in ("input_ids", "attention_mask")}


def decoder_start(rows: int) -> torch.Tensor:
    return torch.zeros(rows, 1, dtype=torch.long)


def test_an_empty_batch_is_refused_by_forward_and_generate(model, batch):
    empty = {key: value[:0] for key, value in batch.items()}
    with pytest.raises(ValueError, match=r"shape \(batch >= 1, source_length >= 1\), got \(0, 7\)"):
        model(**empty, decoder_input_ids=decoder_start(0))
    with pytest.raises(ValueError, match=r"got \(0, 7\): there is no sentence to encode"):
        model.generate(**empty, max_length=5)


def test_a_batch_of_padding_only_is_refused(model, batch):
    padding = {**batch, "attention_mask": torch.zeros_like(batch["attention_mask"])}
    message = r"`attention_mask` is 0 everywhere \(all 3 row\(s\) of shape \(3, 7\) are padding\)"
    with pytest.raises(ValueError, match=message):
        model(**padding, decoder_input_ids=decoder_start(3))
    with pytest.raises(ValueError, match=message):
        model.generate(**padding, max_length=5, num_beams=2)


def test_a_padding_only_row_beside_real_ones_is_warned_about_and_leaves_the_others_alone(model, batch, monkeypatch):
    warnings = []
    monkeypatch.setattr(modeling_deep_nmt.logger, "warning", lambda message, *args: warnings.append(message))
    settings = dict(max_length=6, num_beams=2, do_sample=False)
    with torch.no_grad():
        normal = model.generate(**batch, **settings)
        mask = batch["attention_mask"].clone()
        mask[1] = 0
        with_empty_row = model.generate(input_ids=batch["input_ids"], attention_mask=mask, **settings)
    assert len(warnings) == 1
    assert "Rows [1] of the 3 in this batch are padding only" in warnings[0] and "mean nothing" in warnings[0]
    assert torch.equal(with_empty_row[[0, 2]], normal[[0, 2]])


def test_normal_padded_batches_still_decode_without_a_warning(model, batch, monkeypatch):
    warnings = []
    monkeypatch.setattr(modeling_deep_nmt.logger, "warning", lambda message, *args: warnings.append(message))
    with torch.no_grad():
        outputs = model.generate(**batch, max_length=6, num_beams=2)
        loss = model(**batch, labels=torch.full((3, 4), 5)).loss
    assert outputs.shape[0] == 3 and torch.isfinite(loss) and not warnings


@pytest.mark.parametrize("penalty", [math.nan, math.inf, -math.inf])
def test_a_non_finite_length_penalty_is_refused_by_generate(model, batch, penalty):
    message = rf"`length_penalty` must be a finite number \(1.0: the default\), got {penalty}"
    with pytest.raises(ValueError, match=message):
        model.generate(**batch, max_length=6, num_beams=2, length_penalty=penalty)


def test_a_non_finite_saved_length_penalty_is_refused_too(batch):
    model = doctor.family_model("prenorm", "cpu")
    model.generation_config.length_penalty = math.nan
    with pytest.raises(ValueError, match=r"`length_penalty` must be a finite number .* got nan"):
        model.generate(**batch, max_length=6, num_beams=2)


def test_translate_refuses_a_nan_length_penalty_before_translating(model):
    with pytest.raises(ValueError, match=r"`length_penalty` must be a finite number, got nan"):
        translate(model, tokenizer=None, sentences=["hola"], length_penalty=math.nan)
