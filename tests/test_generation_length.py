"""Every saved model carries an honest output cap: a new model's `generate()` runs to `DEFAULT_MAX_OUTPUT_TOKENS`
(not transformers' 20 tokens), a recipe's export to the recipe's cap, and no folder carries a stray `max_length: 20`
(what `Seq2SeqTrainer` evaluation fills in beside a `max_new_tokens`)."""

import json

import pytest
import torch
from conftest import method_families
from transformers import AutoModelForSeq2SeqLM, GenerationConfig, Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_deep_nmt import MODEL_CLASSES, DeepNMTConfig, DlclConfig
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.hub import export_hub_folder, settle_output_cap
from hf_deep_nmt.modeling.configuration_deep_nmt import DEFAULT_MAX_OUTPUT_TOKENS
from hf_deep_nmt.serving.translate import MAX_OUTPUT_TOKENS
from hf_deep_nmt.training.pipeline import DataArguments, EvalExportArguments, configure_generation

EOS = 2
SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 6, 2, 1]])
FAMILIES = method_families()  # one per registered method


def saved_generation_config(folder) -> dict:
    return json.loads((folder / "generation_config.json").read_text())


def never_ending(model):
    """`</s>` is never chosen (and the saved generation config says so): every output runs to the cap."""
    model.generation_config.suppress_tokens = [EOS]
    return model


def eval_dataset():
    labels = torch.tensor([[6, 8, 12, 2], [13, 4, 9, 2]])
    return [
        {"input_ids": source, "attention_mask": source.ne(1).long(), "labels": label}
        for source, label in zip(SOURCE, labels)
    ]


def evaluate_with_generate(model, tmp_path):
    """What a training run does between checkpoints: `Seq2SeqTrainer` evaluation with `predict_with_generate` (here
    through `predict`: `evaluate` only generates when given metrics to compute). Returns the predictions."""
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "trainer"),
        predict_with_generate=True,
        per_device_eval_batch_size=2,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    return Seq2SeqTrainer(model=model, args=args).predict(eval_dataset()).predictions


@pytest.mark.parametrize("family", FAMILIES)
def test_a_new_model_saves_the_default_cap_and_nothing_else(family, tiny_config, tmp_path):
    config_class, overrides = FAMILIES[family]
    model = MODEL_CLASSES[config_class](tiny_config(config_class, **overrides))
    model.save_pretrained(tmp_path)
    generation = saved_generation_config(tmp_path)
    assert generation["max_length"] == DEFAULT_MAX_OUTPUT_TOKENS + 2 == MAX_OUTPUT_TOKENS + 2
    assert "max_new_tokens" not in generation


def test_a_saved_folder_decodes_past_21_tokens_to_its_cap(tiny_config, random_model, tmp_path):
    never_ending(random_model(tiny_config(DlclConfig))).save_pretrained(tmp_path)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    with torch.no_grad():
        output = loaded.generate(input_ids=SOURCE, attention_mask=SOURCE.ne(1))
        shorter = loaded.generate(input_ids=SOURCE, attention_mask=SOURCE.ne(1), max_new_tokens=5)
        capped = loaded.generate(input_ids=SOURCE, attention_mask=SOURCE.ne(1), max_length=30)
    # the start token, DEFAULT_MAX_OUTPUT_TOKENS tokens and the place of `</s>`, none of them `</s>`
    assert output.shape == (2, DEFAULT_MAX_OUTPUT_TOKENS + 2) and not (output[:, 1:] == EOS).any()
    assert shorter.shape == (2, 6) and capped.shape == (2, 30)  # a call's own cap still wins, either way


def test_trainer_predictions_of_a_saved_folder_are_not_cut_at_21_tokens(tiny_config, random_model, tmp_path):
    never_ending(random_model(tiny_config(DeepNMTConfig))).save_pretrained(tmp_path / "saved")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "saved")
    predictions = evaluate_with_generate(model, tmp_path)
    assert predictions.shape == (2, DEFAULT_MAX_OUTPUT_TOKENS + 2)
    assert not (predictions[:, 1:] == EOS).any() and not (predictions == -100).any()
    model.save_pretrained(tmp_path / "again")  # evaluation left no default of its own behind
    generation = saved_generation_config(tmp_path / "again")
    assert generation["max_length"] == DEFAULT_MAX_OUTPUT_TOKENS + 2 and "max_new_tokens" not in generation


@pytest.fixture(scope="module")
def tokenizer():
    pairs = [("hola mundo", "hello world"), ("buenos días", "good morning"), ("gracias", "thank you")] * 10
    return train_joint_tokenizer(pairs, vocab_size=60)


def test_an_export_carries_the_recipe_cap_after_evaluation_and_decodes_to_it(
    tokenizer, tiny_config, random_model, tmp_path
):
    model = never_ending(random_model(tiny_config(DlclConfig, vocab_size=len(tokenizer))))
    recipe = EvalExportArguments(num_beams=1, max_length_a=1.5, max_length_b=20)
    configure_generation(model, tokenizer, DataArguments(max_source_length=8), recipe)
    assert evaluate_with_generate(model, tmp_path).shape == (2, 34)
    folder = export_hub_folder(model, tokenizer, tmp_path / "export", length_rule=(1.5, 20))
    generation = saved_generation_config(folder)
    # 1.5 * 8 + 20 = 32 tokens, `</s>`, and the start token: what `translate` allows the longest source
    assert generation["max_length"] == 34 and "max_new_tokens" not in generation
    card = " ".join((folder / "README.md").read_text().split())
    assert "`generate()` produces at most 33 tokens, `</s>` included" in card
    assert "caps each translation at 1.5 × its source tokens + 20" in card
    assert "--max-length-a 1.5 --max-length-b 20" in card
    loaded = AutoModelForSeq2SeqLM.from_pretrained(folder)
    with torch.no_grad():
        assert loaded.generate(input_ids=SOURCE, attention_mask=SOURCE.ne(1)).shape == (2, 34)


def test_an_export_drops_the_20_that_evaluation_puts_beside_max_new_tokens(tokenizer, tiny_config, tmp_path):
    model = MODEL_CLASSES[DeepNMTConfig](tiny_config(vocab_size=len(tokenizer)))
    model.generation_config.max_new_tokens = 43
    model.generation_config.max_length = None
    evaluate_with_generate(model, tmp_path)
    assert model.generation_config.max_length == 20  # what Seq2SeqTrainer leaves in the model's own config
    generation = saved_generation_config(export_hub_folder(model, tokenizer, tmp_path / "export"))
    assert generation["max_new_tokens"] == 43 and "max_length" not in generation


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"max_new_tokens": 43, "max_length": 20}, (None, 43)),
        ({"max_length": 50}, (50, None)),
        ({}, (DEFAULT_MAX_OUTPUT_TOKENS + 2, None)),  # a folder saved before models had a cap
    ],
)
def test_settle_output_cap_leaves_one_cap(given, expected):
    config = settle_output_cap(GenerationConfig(**given))
    assert (config.max_length, config.max_new_tokens) == expected
