"""The command line starts without torch and transformers: every `--help`, and a command refused on its arguments,
finish before either is imported (importing them, and tearing them down at exit, is what made a refusal slow); the
package's names are handed on, and its models registered, at their first use."""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "datasets", "sacrebleu", "peft")

# Runs the command line in a fresh interpreter, then prints what it returned (or exited with) and which heavy packages
# it imported.
PROBE = """
import json, sys
from hf_deep_nmt_cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:  # argparse's --help
    code = exit.code
print(json.dumps({"code": code, "imported": sorted(name for name in HEAVY if name in sys.modules)}))
""".replace("HEAVY", repr(HEAVY))


def run_cli(*arguments: str, cwd) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *arguments], capture_output=True, text=True, cwd=cwd, check=True
    )
    *printed, outcome = result.stdout.splitlines()
    return {**json.loads(outcome), "stdout": "\n".join(printed), "stderr": result.stderr}


@pytest.mark.parametrize(
    "arguments, code, message",
    [
        (["no-such-command"], 2, "unknown command 'no-such-command'"),
        (["translate"], 2, "the following arguments are required: --model"),
        (["translate", "--model", "m", "--num-beams", "0"], 2, "--num-beams"),
        (["train", "missing.json"], 2, "Config file not found: missing.json"),
        (["train-staged", "missing.yaml"], 2, "Config file not found: missing.yaml"),
        (["average"], 2, "the following arguments are required: --output"),
        (["upgrade-code"], 2, "the following arguments are required: --model"),
        (["serve", "--model", "./no-such-model"], 2, "Model folder './no-such-model' does not exist"),
    ],
)
def test_a_refused_command_imports_neither_torch_nor_transformers(tmp_path, arguments, code, message):
    outcome = run_cli(*arguments, cwd=tmp_path)
    assert outcome["code"] == code and message in outcome["stderr"]
    assert outcome["imported"] == []


def test_every_help_answers_on_stdout_without_torch_or_transformers(tmp_path):
    """`hf-deep-nmt --help | less` shows the commands, and each command's `--help` its arguments, at once: importing
    torch and transformers would take seconds."""
    from hf_deep_nmt.cli import COMMANDS

    for arguments in (["--help"], *([name, "--help"] for name in COMMANDS)):
        outcome = run_cli(*arguments, cwd=tmp_path)
        assert outcome["code"] == 0 and outcome["stdout"].startswith("usage: hf-deep-nmt"), (arguments, outcome)
        assert outcome["imported"] == [] and outcome["stderr"] == "", (arguments, outcome)


def test_a_bare_import_registers_the_models(tmp_path):
    """What the README promises the Python API: `import hf_deep_nmt`, then the Auto classes load a saved folder
    without `trust_remote_code`; peft is not imported by it, and has the default LoRA targets once it is."""
    script = """
import importlib.util, json, sys
import hf_deep_nmt
from transformers import CONFIG_MAPPING, AutoModelForSeq2SeqLM
from hf_deep_nmt.registration import MODEL_CLASSES
peft_imported = "peft" in sys.modules
lora = True
if importlib.util.find_spec("peft") is not None:
    import peft
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    lora = all(c.model_type in defaults for c in MODEL_CLASSES)
print(json.dumps([[c.model_type in CONFIG_MAPPING for c in MODEL_CLASSES], peft_imported, lora]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True)
    registered, peft_imported, lora = json.loads(result.stdout)
    assert len(registered) >= 6 and all(registered)
    assert not peft_imported and lora


def test_the_command_line_registers_the_models_at_the_first_use_of_a_name(tmp_path):
    script = """
import json, sys
import hf_deep_nmt_cli
import hf_deep_nmt
before = "torch" in sys.modules
from transformers import CONFIG_MAPPING
known = "deep_nmt_dlcl" in CONFIG_MAPPING
from hf_deep_nmt import DlclConfig
print(json.dumps([before, known, DlclConfig.model_type in CONFIG_MAPPING, hf_deep_nmt.__version__]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True)
    before, known, registered, version = json.loads(result.stdout)
    assert (before, known, registered) == (False, False, True)
    assert version == __import__("hf_deep_nmt").registration.CODE_VERSION


def test_an_unknown_name_of_the_package_is_an_attribute_error():
    import hf_deep_nmt

    with pytest.raises(AttributeError, match="has no attribute 'NoSuchConfig'"):
        hf_deep_nmt.NoSuchConfig  # noqa: B018
    assert "DlclConfig" in dir(hf_deep_nmt)


def test_the_0_1_0_path_of_inspect_model_is_retired():
    from hf_deep_nmt.tools import diagnostics

    with pytest.raises(AttributeError, match="has no attribute 'inspect_model'"):
        diagnostics.inspect_model  # noqa: B018  (it lives in `hf_deep_nmt.tools.inspection`, with its command)


def test_the_entry_point_freezes_the_heap_once_the_command_has_returned(monkeypatch):
    """What the command made is done when its `main` returns: the heap is frozen then, whether it returned or raised,
    so that interpreter shutdown does not walk every object torch and transformers made (about 1.5 CPU s after a
    refusal was printed, measured)."""
    import gc

    import hf_deep_nmt_cli

    def refuse(argv):
        raise SystemExit(2)

    try:
        for command, outcome in ((lambda argv: 3, 3), (refuse, SystemExit)):
            gc.unfreeze()
            monkeypatch.setattr(hf_deep_nmt_cli, "_main", command)
            if outcome is SystemExit:
                with pytest.raises(SystemExit):
                    hf_deep_nmt_cli.main([])
            else:
                assert hf_deep_nmt_cli.main([]) == outcome
            assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_python_dash_m_starts_the_command_line_as_the_script_does(tmp_path):
    """`python -m hf_deep_nmt_cli` runs the entry point as `__main__`: the package must still see the command line
    starting, and leave torch and transformers unimported for a refused command (`-X importtime` lists every
    module the interpreter imported)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hf_deep_nmt_cli", "no-such-command"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "unknown command 'no-such-command'" in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines}
    assert "hf_deep_nmt.cli" in imported
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
