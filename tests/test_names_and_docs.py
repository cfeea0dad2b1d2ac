"""Names derived, documents checked. The package hands on every method's classes by the names `METHODS` gives them,
a method registered later included, with no list of them kept by hand. The documents that promise completeness keep
it, in the manner of transformers' `utils/check_config_docstrings.py`: every setting of a method's config has a row in
docs/configuration.md, and every choice of a choice setting is spelled out there; every method is in the README's
table of methods (by its named config) and its table of model classes (config, model type, model and encoder-decoder
in one row). A failure names what is missing, so the fix is one row."""

import ast
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_deep_nmt
from hf_deep_nmt import METHODS, DeepNMTConfig, DeepNMTMethod, register_method
from hf_deep_nmt.modeling.configuration_deep_nmt import FIELD_KINDS
from hf_deep_nmt.registration import BASE_MODEL_CLASSES, MODEL_CLASSES

ROOT = Path(__file__).resolve().parent.parent
# Fields that transformers itself reads, set here as for every encoder-decoder: not settings of the architecture,
# so the page of settings leaves them to transformers' documentation (what `SPECIAL_CASES_TO_ALLOW` is to
# transformers' check).
NOT_SETTINGS = {
    "use_cache": "transformers' switch for the decoding cache, which `generate()` sets",
    "is_encoder_decoder": "always True: every model here has both stacks",
}
# Choice fields whose choices are a table of transformers', named by reference rather than copied.
CHOICES_BY_REFERENCE = {"activation_function": "any key of `transformers.activations.ACT2CLS`"}


def section(text: str, heading: str) -> str:
    """The part of a Markdown page from `heading` to the next heading of its level or above."""
    start = text.index(heading)
    body = start + len(heading)
    level = len(heading.split(" ", 1)[0])
    following = re.search(rf"^#{{1,{level}}} ", text[body:], re.MULTILINE)
    return text[start : body + following.start()] if following else text[start:]


def table_rows(text: str) -> list[list[str]]:
    """The body rows of the Markdown tables in `text`, as lists of cells (header and rule rows left out)."""
    rows = []
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if not line.startswith("|") or re.fullmatch(r"\|[\s:|-]+\|", line):
            continue
        if number + 1 < len(lines) and re.fullmatch(r"\|[\s:|-]+\|", lines[number + 1]):
            continue  # a header row
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def settings_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    return table_rows(section(text, "## Settings of `DeepNMTConfig`"))


def config_fields() -> set[str]:
    """Every setting a method's config takes: the fields the package's config classes declare (the named configs
    normally only change defaults, but a field one of them adds is a setting too), less transformers' own."""
    fields = {name for method in METHODS.values() for name in inspect.get_annotations(method.config_class)}
    return (fields | set(FIELD_KINDS)) - set(NOT_SETTINGS)


def choices_of(field: str) -> tuple | None:
    """The choices of a choice field, read back from its kind's description (`one of (...)`), else None."""
    description = FIELD_KINDS[field].description if field in FIELD_KINDS else ""
    return ast.literal_eval(description.removeprefix("one of ")) if description.startswith("one of (") else None


def test_every_field_is_a_parameter_of_the_config():
    """The fields read from the classes are what the config takes: its init signature (the pattern's source)."""
    parameters = set(inspect.signature(DeepNMTConfig.__init__).parameters)
    assert config_fields() | set(NOT_SETTINGS) <= parameters


def test_every_setting_has_a_row_in_the_configuration_page():
    named = {name for row in settings_rows() for name in re.findall(r"`(\w+)`", row[0])}
    missing = sorted(config_fields() - named)
    assert not missing, f"docs/configuration.md has no row for these settings of DeepNMTConfig: {missing}"
    unknown = sorted(named - config_fields() - set(NOT_SETTINGS))
    assert not unknown, f"docs/configuration.md has rows for settings DeepNMTConfig does not have: {unknown}"


def test_every_choice_of_a_choice_setting_is_spelled_out_in_its_row():
    """Each set of choices is spelled out (`"value"`) in the row of a field that takes it; a per-stack override may
    refer to the row of its global setting, which takes the same set."""
    rows = {name: " | ".join(row) for row in settings_rows() for name in re.findall(r"`(\w+)`", row[0])}
    by_choices: dict[tuple, list[str]] = {}
    for field in FIELD_KINDS:
        choices = choices_of(field)
        if choices is not None and field not in CHOICES_BY_REFERENCE:
            by_choices.setdefault(choices, []).append(field)
    assert ("residual", "dlcl", "sparse", "attnres", "block_attnres") in by_choices  # the reading of the kinds works
    missing = []
    for choices, fields in by_choices.items():
        text = " ".join(rows.get(field, "") for field in fields)
        missing += [f"{fields[0]}={choice!r}" for choice in choices if f'"{choice}"' not in text]
    assert not missing, f"docs/configuration.md does not name these choices in their rows: {missing}"
    for field, reference in CHOICES_BY_REFERENCE.items():
        assert choices_of(field) is not None and reference in rows[field]


def readme_rows(heading: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return table_rows(section(text, heading) if heading else text[: text.index("\n## ")])


def test_every_method_is_in_the_readme_table_of_methods():
    """The table under the README's introduction names each method's config class in its last column."""
    named = {name for row in readme_rows("") for name in re.findall(r"`(\w+)`", row[-1])}
    missing = sorted({method.config_class.__name__ for method in METHODS.values()} - named)
    assert not missing, f"README.md's table of methods does not name these configs: {missing}"


def test_every_method_has_a_row_in_the_readme_table_of_model_classes():
    rows = [" | ".join(row) for row in readme_rows("## The model classes")]
    missing = []
    for method in METHODS.values():
        names = [method.config_class.__name__, method.model_type, method.model_class.__name__]
        names.append(method.base_model_class.__name__)
        if not any(all(f"`{name}`" in row for name in names) for row in rows):
            missing.append(method.model_type)
    assert not missing, (
        f"README.md's table of model classes has no row (config, type, model, encoder-decoder) for {missing}"
    )


def test_the_checks_read_tables_and_choices():
    page = '# P\n## Settings\n\n| field | choices |\n|---|---|\n| `a`, `b` | `"x"` \\| `"y"` |\n## Next\n| `c` | z |\n'
    assert table_rows(section(page, "## Settings")) == [["`a`, `b`", '`"x"` \\| `"y"`']]
    assert choices_of("layer_aggregation")[:2] == ("residual", "dlcl") and choices_of("d_model") is None


# --- The package's names, derived from METHODS ----------------------------------------------------------------------


def method_class_names() -> set[str]:
    return {
        cls.__name__
        for method in METHODS.values()
        for cls in (method.config_class, method.model_class, method.base_model_class)
    }


def test_the_package_hands_on_every_method_class_by_its_name():
    exported = set(hf_deep_nmt.__all__)
    assert method_class_names() <= exported
    assert {"METHODS", "MODEL_CLASSES", "BASE_MODEL_CLASSES", "register_method", "DeepNMTPreTrainedModel"} <= exported
    for name in exported:
        assert getattr(hf_deep_nmt, name) is getattr(hf_deep_nmt.registration, name), name
    classes = [getattr(hf_deep_nmt, name) for name in exported]
    assert all(cls in classes for cls in [*MODEL_CLASSES.values(), *BASE_MODEL_CLASSES.values()])
    namespace: dict = {}
    exec("from hf_deep_nmt import *", namespace)
    assert method_class_names() <= set(namespace)


@pytest.fixture
def later_method():
    class LaterConfig(DeepNMTConfig):
        model_type = "deep_nmt_later"

    class LaterForConditionalGeneration(hf_deep_nmt.DeepNMTForConditionalGeneration):
        config_class = LaterConfig

    class LaterModel(hf_deep_nmt.DeepNMTModel):
        config_class = LaterConfig

    method = register_method(DeepNMTMethod(LaterConfig, LaterForConditionalGeneration, LaterModel, "deep_nmt", {}))
    yield method
    METHODS.pop(method.model_type)
    MODEL_CLASSES.pop(LaterConfig)
    BASE_MODEL_CLASSES.pop(LaterConfig)
    for name in ("LaterConfig", "LaterForConditionalGeneration", "LaterModel"):
        vars(hf_deep_nmt).pop(name, None)  # the package keeps a name once looked up


def test_a_method_registered_later_is_a_name_of_the_package(later_method):
    from hf_deep_nmt import LaterConfig, LaterModel

    assert (LaterConfig, LaterModel) == (later_method.config_class, later_method.base_model_class)
    assert {"LaterConfig", "LaterForConditionalGeneration", "LaterModel"} <= set(hf_deep_nmt.__all__)
    assert "LaterForConditionalGeneration" in dir(hf_deep_nmt)
    assert hf_deep_nmt.registration.LaterForConditionalGeneration is later_method.model_class


def test_the_command_line_reaches_the_package_modules_without_torch(tmp_path):
    """A module of the package is never mistaken for a name to hand on (only class names and the names of
    `registration` are): the command line reaches its modules without importing torch. That a class name imports the
    registration there is `tests/test_startup.py`'s to check."""
    script = """
import json, sys
import hf_deep_nmt_cli
from hf_deep_nmt import cli, settings
import hf_deep_nmt
print(json.dumps(["torch" in sys.modules, hasattr(hf_deep_nmt, "no_such_module")]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[false, false]"
