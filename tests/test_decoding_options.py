"""One decoding-options type and one model-folder check.

`DecodingOptions`: built from the recipe and from the command line with the values given (and the model's generation
config where the command line leaves beams and penalty open), turned into `generate()` options as computed here by
hand, taken whole or with single settings by name by `translate` with the same translations; the flags of
`hf-deep-nmt translate` are its fields. `check_model_folder`: each parameter's refusal, and the same bad folder
refused in the same words by the four commands that load a model folder.
"""

import argparse
import dataclasses
import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch

from hf_deep_nmt.cli import _add_decoding_flags, main
from hf_deep_nmt.model_folders import check_model_folder, check_saved_model_folder
from hf_deep_nmt.serving.options import MAX_OUTPUT_TOKENS, MAX_SOURCE_TOKENS, DecodingOptions
from hf_deep_nmt.serving.translate import translate
from hf_deep_nmt.tools.marian import convert_marian
from hf_deep_nmt.tools.upgrade_code import upgrade_folder
from hf_deep_nmt.training.arguments import EvalExportArguments

LINES = ["el sol sale", "", "la mar no se llena", "hola mundo", "el sol sale hola"]


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _add_decoding_flags(parser)
    return parser.parse_args(list(argv))


# ---- DecodingOptions ------------------------------------------------------------------------------------------------


def test_the_translate_flags_are_the_fields_with_the_command_line_defaults():
    parser = argparse.ArgumentParser()
    _add_decoding_flags(parser)
    flags = {action.option_strings[0]: action.dest for action in parser._actions if action.dest != "help"}
    fields = [item.name for item in dataclasses.fields(DecodingOptions)]
    assert flags == {"--" + name.replace("_", "-"): name for name in fields}
    # before the model is loaded, beams and penalty are not known: the library's defaults stand in for the check
    assert DecodingOptions.from_arguments(parsed()) == DecodingOptions(
        batch_size=64, max_tokens=4096, buffer_size=1000, num_beams=4, length_penalty=1.0
    )


def test_the_command_line_values_are_taken_as_given():
    args = parsed(
        "--num-beams", "3", "--length-penalty", "0.6", "--length-penalty-form", "gnmt", "--batch-size", "5",
        "--max-tokens", "70", "--max-length-a", "0", "--max-length-b", "7", "--max-source-tokens", "40",
        "--max-output-tokens", "9", "--buffer-size", "11",
    )  # fmt: skip
    expected = DecodingOptions(
        batch_size=5,
        num_beams=3,
        length_penalty=0.6,
        max_length_a=0.0,
        max_length_b=7,
        max_tokens=70,
        length_penalty_form="gnmt",
        max_source_tokens=40,
        max_output_tokens=9,
        buffer_size=11,
    )
    generation = SimpleNamespace(num_beams=6, length_penalty=2.0)
    assert DecodingOptions.from_arguments(args, generation) == expected  # the flags win over the model's settings


@pytest.mark.parametrize(
    ("saved", "beams", "penalty"),
    [((5, 0.7), 5, 0.7), ((None, None), 1, 1.0), ((0, 0.0), 1, 0.0)],
    ids=["the model's", "none saved", "zero beams saved"],
)
def test_open_beams_and_penalty_come_from_the_generation_config(saved, beams, penalty):
    generation = SimpleNamespace(num_beams=saved[0], length_penalty=saved[1])
    options = DecodingOptions.from_arguments(parsed(), generation)
    assert (options.num_beams, options.length_penalty) == (beams, penalty)


def test_a_recipe_decodes_its_final_evaluation_with_its_values():
    export_args = EvalExportArguments(
        num_beams=5, length_penalty=0.6, length_penalty_form="gnmt", max_length_a=1.2, max_length_b=3
    )
    export_args.eval_max_tokens = 300
    training_args = SimpleNamespace(per_device_eval_batch_size=7)
    assert DecodingOptions.from_recipe(export_args, training_args) == DecodingOptions(
        batch_size=7,
        num_beams=5,
        length_penalty=0.6,
        length_penalty_form="gnmt",
        max_length_a=1.2,
        max_length_b=3,
        max_tokens=300,
        max_source_tokens=None,
        max_output_tokens=4096,
    )


def test_options_are_frozen_and_checked_when_built_or_changed():
    options = DecodingOptions()
    assert (options.max_source_tokens, options.max_output_tokens) == (MAX_SOURCE_TOKENS, MAX_OUTPUT_TOKENS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_beams = 2
    with pytest.raises(ValueError, match=r"`num_beams` must be an integer >= 1, got 0"):
        DecodingOptions.build(options, num_beams=0)
    with pytest.raises(ValueError, match=r"`max_length_b` must be an integer in \[0, 5\] .*got 6"):
        DecodingOptions(max_output_tokens=5, max_length_b=6)
    with pytest.raises(TypeError, match=r"'beam_size' is no decoding option; the options are \['batch_size', "):
        DecodingOptions.build(beam_size=4)
    with pytest.raises(TypeError, match=r"`options` must be a DecodingOptions, got 4"):
        DecodingOptions.build(4)
    assert DecodingOptions.build(options, num_beams=2) == DecodingOptions(num_beams=2)
    assert DecodingOptions.build(options) is options


def test_generate_options_by_hand():
    fairseq = DecodingOptions(num_beams=4, length_penalty=0.6)
    assert fairseq.generate_kwargs(7) == dict(
        num_beams=4,
        num_return_sequences=1,
        length_penalty=0.6,
        max_length=9,  # the start token, 7 tokens, `</s>`
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=False,
    )
    # GNMT: beam search without a penalty returns every hypothesis with its score, for the rescoring
    gnmt = DecodingOptions(num_beams=3, length_penalty=0.6, length_penalty_form="gnmt")
    kwargs = gnmt.generate_kwargs(7)
    assert (kwargs["num_return_sequences"], kwargs["length_penalty"], kwargs["output_scores"]) == (3, 0.0, True)
    greedy = DecodingOptions(num_beams=1, length_penalty=0.6, length_penalty_form="gnmt")
    assert not greedy.gnmt and greedy.generate_kwargs(7)["length_penalty"] == 0.6


def test_output_caps_by_hand():
    options = DecodingOptions(max_length_a=1.5, max_length_b=10, max_output_tokens=20)
    # 1.5 * 3 + 10 = 14.5 -> 14; 1.5 * 7 + 10 = 20.5 -> capped at 20
    assert options.output_limits(torch.tensor([3, 7])).tolist() == [14, 20]
    assert [options.output_cap(3), options.output_cap(7)] == [14, 20]
    # a model's generation config: the start token, 1.5 * 8 + 20 = 32 tokens, `</s>`
    recipe = DecodingOptions(num_beams=5, length_penalty=0.6, max_length_a=1.5, max_length_b=20)
    assert recipe.generation_settings(8) == dict(num_beams=5, length_penalty=0.6, max_length=34, max_new_tokens=None)
    short = DecodingOptions(max_length_a=0.5, max_length_b=0)
    assert short.output_limits(torch.tensor([1, 4])).tolist() == [1, 2]  # 0.5 -> 0, raised to one token


def test_translate_takes_the_options_whole_or_by_name_alike(tiny_export):
    _, model, tokenizer = tiny_export
    by_name = translate(model, tokenizer, LINES, num_beams=2, batch_size=2, max_length_a=1.0, max_length_b=3)
    options = DecodingOptions(num_beams=2, batch_size=2, max_length_a=1.0, max_length_b=3)
    assert translate(model, tokenizer, LINES, options) == by_name
    assert translate(model, tokenizer, LINES, dataclasses.replace(options, num_beams=3), num_beams=2) == by_name
    assert by_name[1] == "" and len(set(by_name)) > 2
    with pytest.raises(TypeError, match="`options` must be a DecodingOptions, got 32"):
        translate(model, tokenizer, LINES, 32)


def test_the_command_passes_its_options_to_translate(tiny_export, tmp_path):
    folder, model, tokenizer = tiny_export
    source, target = tmp_path / "in.es", tmp_path / "out.en"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    flags = ["--max-length-a", "0.5", "--max-length-b", "2", "--batch-size", "2", "--no-progress"]
    assert main(["translate", "--model", str(folder), "--input", str(source), "--output", str(target), *flags]) == 0
    # the model's generation config says 2 beams
    expected = translate(model, tokenizer, LINES, DecodingOptions(num_beams=2, max_length_a=0.5, max_length_b=2))
    assert target.read_text(encoding="utf-8").split("\n")[:-1] == expected


# ---- check_model_folder --------------------------------------------------------------------------------------------


def test_each_parameter_of_the_folder_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"^Saved model 'file' is a file; name the model folder"):
        check_model_folder("file", "Saved model")
    # a missing name: a Hub id unless written as a path or Hub ids are not taken
    assert check_model_folder("org/model") is None
    with pytest.raises(FileNotFoundError, match=r"'./org/model' does not exist \(a local folder was given"):
        check_model_folder("./org/model")
    with pytest.raises(FileNotFoundError, match=r"^Model folder 'org/model' does not exist \(name it here\)"):
        check_model_folder("org/model", hub_ids=False, config_hint="name it here")
    with pytest.raises(FileNotFoundError, match="is neither a local folder .* nor a Hub repository id"):
        check_model_folder("org//model", check_hub_id=True)
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config.json: it is not a saved model folder \(try again\)"):
        check_model_folder(folder, config_hint="try again")
    (folder / "config.json").write_text(json.dumps({"model_type": "marian"}))
    assert check_model_folder(folder) == folder
    with pytest.raises(FileNotFoundError, match=r"'.*model' holds no tokenizer: .*\); save one\.$"):
        check_model_folder(folder, tokenizer=True, tokenizer_hint="save one")
    (folder / "tokenizer_config.json").write_text("{}")
    assert check_model_folder(folder, tokenizer=True) == folder
    with pytest.raises(ValueError, match=r"has model_type 'marian', not one of hf-deep-nmt's"):
        check_model_folder(folder, own_code=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "deep_nmt"}))
    with pytest.raises(ValueError, match=r"holds no model code \(configuration_deep_nmt.py, modeling_deep_nmt.py\)"):
        check_model_folder(folder, own_code=True)


def test_the_four_commands_refuse_a_folder_alike(tiny_export, tmp_path, capsys):
    """A folder without config.json and a file, named to translate, training, convert-marian and upgrade-code."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_export[0], folder)
    (folder / "config.json").unlink()
    (tmp_path / "file").write_text("x")
    refusals = {
        "translate": lambda path: check_model_folder(path, tokenizer=True, check_hub_id=True),
        "training": lambda path: check_saved_model_folder(path, "`model_name_or_path`", need_tokenizer=True),
        "convert-marian": lambda path: convert_marian(path, tmp_path / "out"),
        "upgrade-code": lambda path: upgrade_folder(path),
    }
    for refuse in refusals.values():
        with pytest.raises(
            FileNotFoundError, match=rf"'{re.escape(str(folder))}' has no config.json: it is not a saved model folder"
        ):
            refuse(str(folder))
        with pytest.raises(
            NotADirectoryError, match=rf"'{re.escape(str(tmp_path / 'file'))}' is a file; name the model folder"
        ):
            refuse(str(tmp_path / "file"))
    assert not (tmp_path / "out").exists()
    source = tmp_path / "in.txt"
    source.write_text("hola\n")
    assert main(["translate", "--model", str(folder), "--input", str(source)]) == 2
    assert f"Model folder '{folder}' has no config.json: it is not a saved model folder" in capsys.readouterr().err
