"""Recipe files: the JSON or YAML file `hf-deep-nmt train` / `train-staged` read their values from, named first on the
command line. Reading one needs neither torch nor transformers, so the command line refuses a missing or invalid file
before importing them (`hf_deep_nmt.cli`); `hf_deep_nmt.training.arguments` turns the values into the run's
arguments."""

from __future__ import annotations

import codecs
import json
import os
from pathlib import Path
from typing import Any

import yaml

CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


class DuplicateKeyError(ValueError):
    """A recipe mapping names the same key twice (JSON and YAML loaders would keep the last without a word)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKeyError(f"key {key!r} appears more than once")
        seen[key] = value
    return seen


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping, at any depth."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:  # the keys written here: a `<<` merge's keys may be overridden
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    line = key_node.start_mark.line + 1
                    raise DuplicateKeyError(f"key {key!r} appears more than once (again at line {line})")
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_recipe(path: Path) -> Any:
    """The values of a JSON or YAML recipe file; `ValueError` naming the file for text that is not valid and for a
    key given twice in one mapping (the last would silently win, e.g. a second `model_overrides`). The text is UTF-8,
    with or without a byte-order mark (as some editors save it); any other encoding is refused, naming the file."""
    text = _recipe_text(path)
    try:
        if path.suffix == ".json":
            return json.loads(text, object_pairs_hook=_unique_pairs)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except DuplicateKeyError as error:
        raise ValueError(f"{path}: {error}; the last would silently win, so keep one.") from None
    except (ValueError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: not valid {path.suffix[1:].upper()}: {error}") from None


def _recipe_text(path: Path) -> str:
    data = path.read_bytes()
    for mark, encoding in (
        (codecs.BOM_UTF32_LE, "UTF-32"),
        (codecs.BOM_UTF32_BE, "UTF-32"),
        (codecs.BOM_UTF16_LE, "UTF-16"),
        (codecs.BOM_UTF16_BE, "UTF-16"),
    ):
        if data.startswith(mark):
            raise ValueError(
                f"{path}: the recipe is {encoding} text (it starts with a {encoding} byte-order mark); save it as "
                f"UTF-8 (e.g. `iconv -f {encoding} -t UTF-8 {path} > recipe{path.suffix}`)."
            )
    try:
        return data.decode("utf-8-sig")  # a UTF-8 byte-order mark is dropped
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(
            f"{path}: not UTF-8 text (byte {data[error.start]:#04x} at byte {error.start}, line {line}); save the "
            "recipe as UTF-8."
        ) from None


def recipe_path(argv: list[str]) -> Path | None:
    """The recipe file a command line names first (a `.json`, `.yaml` or `.yml` name), None when it starts with flags;
    `FileNotFoundError` when that file does not exist, `ValueError` for a first word that is not a flag and not a
    recipe file name (a `.txt` file, a folder), which would otherwise be reported as an argument not used."""
    if not argv or argv[0].startswith("-"):
        return None
    path = Path(argv[0])
    if not argv[0].endswith(CONFIG_SUFFIXES):
        if not os.path.lexists(path):
            raise FileNotFoundError(f"Config file not found: {path} (a recipe is a .json, .yaml or .yml file)")
        raise ValueError(
            f"{path}: a recipe is a JSON (.json) or YAML (.yaml, .yml) file, named so; rename it, or give the "
            "settings as flags (--output-dir run ...)."
        )
    if not path.is_file():
        raise FileNotFoundError(f"Config file not found: {path}")
    return path
