"""Bad input at the public entry points: each gets an error naming the bad value (or, where the behaviour is defined,
a test pinning it). Model forward / generate, translate, build_model, prepare, the recipe parser, from_pretrained."""

import json
import re

import pytest
import torch
from conftest import method_families
from transformers import AutoModelForSeq2SeqLM, BertConfig, BertModel

from hf_deep_nmt import (
    DeepNMTConfig,
    DeepNMTForConditionalGeneration,
    DlclConfig,
    DlclForConditionalGeneration,
    MscForConditionalGeneration,
)
from hf_deep_nmt.data.corpus import sample_corpus_dir
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.serving.translate import translate
from hf_deep_nmt.training.arguments import ModelArguments, parse_arguments
from hf_deep_nmt.training.pipeline import build_model, prepare

SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
START = torch.tensor([[0], [0]])


@pytest.fixture(scope="module")
def tokenizer():
    pairs = [("hola mundo", "hello world"), ("buenos días", "good morning"), ("gracias", "thank you")] * 10
    return train_joint_tokenizer(pairs, vocab_size=70)


@pytest.fixture(params=list(method_families().values()), ids=list(method_families()))  # one per registered method
def model(request, tiny_config, random_model):
    config_class, overrides = request.param
    return random_model(tiny_config(config_class, **overrides))


# ---- token ids, empty and padded sources, mask shapes ---------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [37, 1000, -1])
@pytest.mark.parametrize("where", ["input_ids", "decoder_input_ids", "generate"])
def test_token_ids_out_of_range_name_the_id_and_the_valid_range(model, bad_id, where):
    source = SOURCE.clone()
    target = torch.tensor([[0, 4], [0, 6]])
    if where == "decoder_input_ids":
        target[1, 1] = bad_id
    else:
        source[0, 2] = bad_id
    with pytest.raises(
        ValueError, match=rf"Token id {bad_id} is out of range for a vocabulary of 37 ids \(valid: 0..36\)"
    ):
        if where == "generate":
            model.generate(input_ids=source, num_beams=2, max_new_tokens=3)
        else:
            model(input_ids=source, decoder_input_ids=target)


def test_labels_out_of_range_name_the_label(model):
    with pytest.raises(IndexError, match="Target 40 is out of bounds"):
        model(input_ids=SOURCE, labels=torch.tensor([[4, 40], [5, 2]]))


@pytest.mark.parametrize("shape", [(1, 0), (0,), (2, 3, 1)])
def test_an_empty_or_misshapen_source_is_refused_naming_its_shape(model, shape):
    input_ids = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(
        ValueError, match=re.escape(f"`input_ids` must have shape (batch >= 1, source_length >= 1), got {shape}")
    ):
        model(input_ids=input_ids, decoder_input_ids=START[:1])
    if len(shape) == 2:
        with pytest.raises(ValueError, match=r"source_length >= 1"):
            model.generate(input_ids=input_ids, max_new_tokens=2)


def test_an_attention_mask_of_another_shape_is_refused(model):
    # an all-ones mask of the wrong length used to be dropped silently (nothing masked)
    for mask in (torch.ones(2, 4, dtype=torch.long), SOURCE.ne(1).long()[:1]):
        with pytest.raises(ValueError, match=r"`attention_mask` must have the shape of `input_ids` \(2, 5\), got"):
            model(input_ids=SOURCE, attention_mask=mask, decoder_input_ids=START)


def test_an_all_padding_row_gives_finite_output_and_leaves_the_other_rows_alone(model):
    """Defined behaviour: a row whose mask is all zeros attends uniformly to its (padding) positions — finite, never
    NaN — and does not change any other row of the batch."""
    source = torch.tensor([[5, 9, 14, 3, 2], [1, 1, 1, 1, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    with torch.no_grad():
        batched = model(input_ids=source, attention_mask=mask, decoder_input_ids=torch.tensor([[0, 6], [0, 6]]))
        alone = model(input_ids=source[:1], decoder_input_ids=torch.tensor([[0, 6]]))
        generated = model.generate(input_ids=source, attention_mask=mask, num_beams=2, max_new_tokens=4)
    assert torch.isfinite(batched.logits).all() and torch.isfinite(batched.encoder_last_hidden_state).all()
    torch.testing.assert_close(batched.logits[0], alone.logits[0], rtol=1e-4, atol=1e-5)
    assert generated.shape[0] == 2 and ((generated >= 0) & (generated < 37)).all()


def test_a_source_far_longer_than_any_training_sentence_is_encoded_with_sinusoidal_positions(
    tiny_config, random_model
):
    """Defined behaviour: positions are sinusoidal and computed on the fly (no table, no maximum length), so a source
    longer than anything seen in training is encoded — the position vector at p is [sin(p w_i), cos(p w_i)] with
    w_i = 10000^(-i / (d/2 - 1)) — and the model runs; nothing is truncated."""
    model = random_model(tiny_config(DeepNMTConfig))
    positions = model.model.encoder.embed_positions(torch.tensor([0, 7, 5000]))
    half = 8
    frequencies = torch.exp(torch.arange(half) * -(torch.log(torch.tensor(10000.0)) / (half - 1)))
    expected = torch.cat([torch.sin(5000 * frequencies), torch.cos(5000 * frequencies)])
    torch.testing.assert_close(positions[2], expected, rtol=0, atol=1e-3)
    assert not torch.allclose(positions[1], positions[2])
    long_source = torch.randint(3, 37, (1, 2000), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = model(input_ids=long_source, decoder_input_ids=START[:1])
    assert outputs.encoder_last_hidden_state.shape == (1, 2000, 16)
    assert torch.isfinite(outputs.encoder_last_hidden_state).all()


def test_translate_handles_long_and_empty_sources_as_documented(tokenizer, tiny_config):
    """An empty or blank sentence translates to "" (the model is not run for it); a long one is not truncated: the
    output may be up to `max_length_a * source_tokens + max_length_b` tokens long."""
    model = DeepNMTForConditionalGeneration(tiny_config(vocab_size=len(tokenizer), encoder_layers=1, decoder_layers=1))
    long_sentence = " ".join(["hola mundo buenos días gracias"] * 20)
    outputs = translate(model, tokenizer, ["", "   ", "gracias", long_sentence], num_beams=2, max_length_b=3)
    assert outputs[:2] == ["", ""]
    assert len(outputs) == 4 and all(isinstance(output, str) for output in outputs)
    assert translate(model, tokenizer, []) == []


# ---- tokenizer / model mismatch ------------------------------------------------------------------------------------


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tokenizer, tiny_config):
    model = DeepNMTForConditionalGeneration(tiny_config(vocab_size=len(tokenizer) - 5))
    pattern = rf"tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {len(tokenizer) - 5}"
    with pytest.raises(ValueError, match=pattern):
        translate(model, tokenizer, ["hola"])


@pytest.mark.parametrize(("field", "value"), [("pad_token_id", 3), ("eos_token_id", 3)])
def test_a_tokenizer_with_other_special_ids_is_refused(tokenizer, tiny_config, field, value):
    model = DeepNMTForConditionalGeneration(tiny_config(vocab_size=len(tokenizer), **{field: value}))
    with pytest.raises(
        ValueError, match=rf"tokenizer's {field} \({getattr(tokenizer, field)}\) differs .* \({value}\)"
    ):
        translate(model, tokenizer, ["hola"])


# ---- checkpoints of another model type ------------------------------------------------------------------------------


def test_a_checkpoint_of_another_model_type_is_refused(tmp_path, tokenizer):
    bert = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=37, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=8)).save_pretrained(bert)  # fmt: skip
    with pytest.raises(ValueError, match=r"takes a DeepNMTConfig \(model_type 'deep_nmt'\).*model_type 'bert'"):
        DeepNMTForConditionalGeneration.from_pretrained(bert)
    tokenizer.save_pretrained(bert)  # a saved model's folder holds its tokenizer
    with pytest.raises(ValueError, match=r"bert' is a BertConfig \(model_type 'bert'\), not a model of this package"):
        build_model(ModelArguments(model_name_or_path=str(bert)), tokenizer)


def test_a_checkpoint_of_another_preset_is_refused_by_a_preset_class(tmp_path, tiny_config):
    DlclForConditionalGeneration(tiny_config(DlclConfig)).save_pretrained(tmp_path / "dlcl")
    with pytest.raises(ValueError, match=r"MscForConditionalGeneration takes a MscConfig .*'deep_nmt_dlcl'"):
        MscForConditionalGeneration.from_pretrained(tmp_path / "dlcl")
    assert type(AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "dlcl")) is DlclForConditionalGeneration


def test_a_saved_config_with_a_wrong_type_names_the_field(tmp_path, tiny_config):
    DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["encoder_layers"] = "3"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"`encoder_layers` must be a positive integer, got '3'"):
        AutoModelForSeq2SeqLM.from_pretrained(tmp_path)


# ---- recipe files and model overrides -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("max_steps", "ten", "int"),
        ("learning_rate", "fast", "float"),
        ("fp16", "yes", "bool"),
        ("num_beams", 2.5, "int"),
        ("model_overrides", "d_model=8", "dict"),
        ("train_file", 7, "str"),
        ("stage_depths", 6, "list"),
    ],
)
def test_a_recipe_value_of_the_wrong_type_names_file_key_and_type(tmp_path, key, value, expected):
    from hf_deep_nmt.training.arguments import ARGUMENT_CLASSES, StageArguments

    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({key: value, "output_dir": str(tmp_path)}))
    pattern = rf"recipe\.json: `{key}` must be of type .*{expected}.*, got {value!r}"
    with pytest.raises(ValueError, match=pattern.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_arguments([str(recipe)], (*ARGUMENT_CLASSES, StageArguments))


@pytest.mark.parametrize(("suffix", "text"), [(".json", "{not json"), (".yaml", "a: [unclosed")])
def test_a_recipe_that_does_not_parse_names_the_file(tmp_path, suffix, text):
    recipe = tmp_path / f"recipe{suffix}"
    recipe.write_text(text)
    with pytest.raises(ValueError, match=rf"recipe{suffix}: not valid {suffix[1:].upper()}"):
        parse_arguments([str(recipe)])


def test_a_misspelt_model_override_is_refused_with_a_suggestion(tokenizer):
    arguments = ModelArguments(model_type="deep_nmt", model_overrides={"encoder_layer": 2, "d_model": 16})
    with pytest.raises(ValueError, match=r"not DeepNMTConfig fields: 'encoder_layer' \(did you mean 'encoder_layers'"):
        build_model(arguments, tokenizer)
    arguments.model_overrides = {"d_model": "16"}
    with pytest.raises(ValueError, match=r"`d_model` must be a positive integer, got '16'"):
        build_model(arguments, tokenizer)


@pytest.mark.parametrize("field", ["model_name_or_path", "tokenizer_name_or_path", "train_file", "validation_file"])
def test_a_recipe_pointing_at_a_missing_file_names_it(tmp_path, field):
    missing = tmp_path / "nowhere" / ("corpus.tsv" if field.endswith("_file") else "folder")
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({field: str(missing), "output_dir": str(tmp_path / "out")}))
    arguments = parse_arguments([str(recipe)])
    with pytest.raises(FileNotFoundError, match=str(missing)):
        if field == "model_name_or_path":
            build_model(arguments[0], None)
        else:
            model_args, data_args, _, training_args = arguments
            prepare(model_args, data_args, training_args)


def test_length_limits_that_drop_every_training_pair_are_named(tmp_path):
    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:20]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    recipe = tmp_path / "recipe.json"
    settings = {"train_file": str(tmp_path / "train.tsv"), "max_source_length": 3, "tokenizer_vocab_size": 300}
    recipe.write_text(json.dumps({**settings, "output_dir": str(tmp_path / "out")}))
    with pytest.raises(ValueError, match=r"No training pair is within `max_source_length=3`.*\(20 pairs read\)"):
        model_args, data_args, _, training_args = parse_arguments([str(recipe)])
        prepare(model_args, data_args, training_args)


def test_translate_command_names_a_missing_input_file_and_model_folder_in_one_line(tmp_path, capsys):
    from hf_deep_nmt.cli import main

    # the input is checked before any model is loaded: the missing model folder is not the error reported
    assert main(["translate", "--model", str(tmp_path / "no-model"), "--input", str(tmp_path / "absent.es")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "input file not found" in error and "absent.es" in error
    assert "no-model" not in error
    (tmp_path / "in.es").write_text("hola\n", encoding="utf-8")
    assert main(["translate", "--model", str(tmp_path / "no-model"), "--input", str(tmp_path / "in.es")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Model folder" in error and "no-model' does not exist" in error
