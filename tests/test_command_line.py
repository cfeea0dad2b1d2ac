"""The command line's vocabulary: every command names the model it reads `--model` and what it writes `--output`, its
flags in kebab case; each earlier spelling still works for one release and says, in one line on stderr, what replaces
it. `hf-deep-nmt --help` lists the commands on stdout; `train --help` the recipe's own settings, from a copy
(`hf_deep_nmt.cli_reference`) that must equal what the argument classes say."""

import re
from pathlib import Path

import pytest

from hf_deep_nmt import cli, cli_reference
from hf_deep_nmt.cli import COMMANDS, SUMMARIES, main


def deprecation_and_error(capsys) -> tuple[str, str]:
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    return lines[0], lines[1]


# ---- help -------------------------------------------------------------------------------------------------------


def test_the_overview_lists_every_command_with_one_line_on_stdout(capsys):
    assert main(["--help"]) == 0
    printed = capsys.readouterr()
    assert printed.err == "" and printed.out.startswith("usage: hf-deep-nmt")
    listed = [line.split()[0] for line in printed.out.split("commands:\n")[1].split("\n\n")[0].splitlines()]
    assert listed == list(COMMANDS) and set(SUMMARIES) == set(COMMANDS)
    assert all(f"  {name}" in printed.out and SUMMARIES[name] in printed.out for name in COMMANDS)


def test_train_help_shows_the_recipe_settings_first_and_points_to_the_full_list(capsys):
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for name in ("--model-type", "--train-file", "--num-beams", "--lr-schedule", "--max-steps", "--output-dir"):
        assert f"  {name} " in text, name
    assert text.index("--model-type") < text.index("--lr-schedule") < text.index("--learning-rate")
    assert "hf-deep-nmt train --help-all" in text and "--stage-depths" not in text
    assert len(text.splitlines()) < 250
    assert main(["train-staged", "-h"]) == 0 and "--stage-depths" in capsys.readouterr().out


def test_prepare_help_lists_only_what_prepare_reads(capsys):
    assert main(["prepare", "--help"]) == 0
    text = capsys.readouterr().out
    for name in ("--tokenizer-vocab-size", "--train-file", "--max-source-length", "--seed"):
        assert f"  {name} " in text, name
    for name in ("--model-type", "--num-beams", "--learning-rate", "--output-dir", "--streaming", "--max-steps"):
        assert f"  {name} " not in text, name


def test_help_all_is_the_trainer_parser_with_every_setting(capsys):
    assert main(["train", "--help-all"]) == 0
    text = capsys.readouterr().out
    assert "--lr-scheduler-type" in text and "--model-type" in text and "--gradient-checkpointing" in text


def test_the_help_copy_equals_the_argument_classes():
    """Changing a setting's help, type or default, or a choice of `grow` or `export-ctranslate2`, without rewriting
    hf_deep_nmt/cli_reference.py (`python -m hf_deep_nmt.cli_reference`, then `ruff format`) fails here."""
    for name, value in cli_reference.live_values().items():
        assert getattr(cli_reference, name) == value, (
            f"cli_reference.{name} is stale: run python -m {cli_reference.__name__}"
        )


def test_the_trainer_settings_shown_are_trainer_fields():
    import dataclasses

    from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments

    fields = {item.name for item in dataclasses.fields(DeepNMTTrainingArguments)}
    assert {name for name, _, _ in cli.COMMON_TRAINER_SETTINGS} <= fields
    settings = cli_reference.RECIPE_SETTINGS
    assert set(cli.PREPARE_MODEL_SETTINGS) <= {row[0] for row in settings["ModelArguments"]}
    assert set(cli.PREPARE_SKIPPED_DATA_SETTINGS) <= {row[0] for row in settings["DataArguments"]}


# ---- the earlier spellings: each works, saying what replaces it ---------------------------------------------------


def test_snake_case_recipe_flags_still_work_with_one_line_each(tmp_path, capsys):
    assert main(["train", str(tmp_path / "missing.json"), "--max_steps", "2", "--output-dir=x"]) == 2
    deprecation, error = deprecation_and_error(capsys)
    assert deprecation == (
        "hf-deep-nmt train: --max_steps is deprecated and goes in the next release; write --max-steps."
    )
    assert "Config file not found" in error
    assert main(["prepare", str(tmp_path / "missing.json"), "--source_lang=de"]) == 2
    deprecation, _ = deprecation_and_error(capsys)
    assert deprecation.endswith("--source_lang is deprecated and goes in the next release; write --source-lang.")


def test_kebab_case_flags_name_the_recipe_settings():
    """`--output-dir` counts as the recipe's `output_dir` for the check that a run names one (it did not)."""
    from hf_deep_nmt.training.arguments import check_explicit_run, parse_arguments

    check_explicit_run(["--model-type", "deep_nmt", "--output-dir", "runs/x"])
    model_args, data_args, _, training_args = parse_arguments(
        ["--model-type", "deep_nmt", "--max-source-length", "32", "--output-dir", "runs/x", "--no-plot-curves"]
    )
    assert (model_args.model_type, data_args.max_source_length, training_args.output_dir) == ("deep_nmt", 32, "runs/x")


@pytest.mark.parametrize(
    "command, old, new, error",
    [
        (["average", "--save-to", "a", "--run", "r", "--last", "0"], "--save-to", "--output", "--last"),
        (["average", "--output-dir", "r", "--output", "a", "--last", "0"], "--output-dir", "--run", "--last"),
        (["inspect", "--output-dir", "o", "--model", "m", "--max-length", "0"], "--output-dir", "--output", "2"),
        (["doctor", "--output-dir", "o", "--train-steps", "x"], "--output-dir", "--output", "--train-steps"),
    ],
)
def test_a_renamed_flag_still_works_saying_what_replaces_it(tmp_path, monkeypatch, capsys, command, old, new, error):
    monkeypatch.chdir(tmp_path)
    assert main(command) == 2
    deprecation, failure = deprecation_and_error(capsys)
    prog = f"hf-deep-nmt {command[0]}"
    assert deprecation == f"{prog}: {old} is deprecated and goes in the next release; write {new}."
    assert failure.startswith(f"{prog}: error:") and error in failure
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "command, old, new",
    [
        (["grow", "m", "o", "--layers", "1"], "MODEL OUT", "--model MODEL --output OUT"),
        (["export-ctranslate2", "m", "o", "--quantization", "int3"], "MODEL OUT", "--model MODEL --output OUT"),
        (["export-onnx", "m", "o", "--into-model"], "MODEL OUT", "--model MODEL --output OUT"),
        (["convert-marian", "m", "o", "x"], None, None),
        (["convert-marian", "m"], "SOURCE", "--model SOURCE"),
        (["upgrade-code", "m", "--revision", "main"], "SOURCE", "--model SOURCE"),
        (["push", "f", "not a/valid/id", "--dry-run"], "FOLDER REPO_ID", "--model FOLDER --repo-id REPO_ID"),
    ],
)
def test_the_positional_arguments_still_work_saying_what_replaces_them(
    tmp_path, monkeypatch, capsys, command, old, new
):
    monkeypatch.chdir(tmp_path)
    assert main(command) != 0  # 1 where CTranslate2 is not installed
    prog = f"hf-deep-nmt {command[0]}"
    if old is None:  # more than the earlier spelling took
        assert f"{prog}: error: unrecognized arguments: x" in capsys.readouterr().err
        return
    deprecation, failure = deprecation_and_error(capsys)
    assert deprecation == f"{prog}: the positional {old} is deprecated and goes in the next release; write {new}."
    assert failure.startswith(f"{prog}: error:")
    assert list(tmp_path.iterdir()) == []


def test_the_positional_spelling_gives_the_same_arguments_as_the_flags(tmp_path, capsys):
    """The old and new spellings reach the same checks with the same values: here the same refusal of OUT."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept").write_text("x")
    model = str(tmp_path / "model")
    assert main(["export-onnx", "--model", model, "--output", str(tmp_path / "out")]) == 2
    new = capsys.readouterr().err
    assert main(["export-onnx", model, str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == new.splitlines()
    assert main(["export-onnx", "--model", model, str(tmp_path / "out")]) == 2  # OUT would be read as MODEL
    error = capsys.readouterr().err
    assert f"'{tmp_path / 'out'}' and --model both name the model; give --model only" in error


def test_the_documents_commands_speak_the_vocabulary():
    """The commands in the ```bash blocks of README.md and docs/ use no spelling the command line calls deprecated."""
    root = Path(__file__).resolve().parent.parent
    positional = ("push", "export-onnx", "export-ctranslate2", "grow", "upgrade-code", "convert-marian")
    stale = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = line.split("#")[0].split()
                if len(words) < 2 or words[0] != "hf-deep-nmt":
                    continue
                old = [word for word in words if re.fullmatch(r"--[a-z0-9]+_[a-z0-9_]+(=.*)?", word)]
                if words[1] not in ("train", "train-staged", "prepare"):
                    old += [word for word in words if word in ("--save-to", "--output-dir")]
                if words[1] in positional and len(words) > 2 and not words[2].startswith("--"):
                    old.append(words[2])
                if old:
                    stale.append(f"{path.name}: {line.strip()} ({', '.join(old)})")
    assert not stale, stale
