"""Allow-lists of config settings: a tool that rewrites or re-expresses a model (an exporter, growing) lists every
setting it knows and what it can do with each value; a setting it does not list (a new method's, say) is refused by
name instead of being carried along unread."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# A check of one setting's value: None when the tool handles it, else why not.
SettingCheck = Callable[[Any], "str | None"]


def model_settings(config) -> dict[str, Any]:
    """The settings of `config` that describe the model: `to_dict()` without transformers' own bookkeeping (the keys
    every `PretrainedConfig` has, and `auto_map`)."""
    from transformers import PretrainedConfig

    generic = set(PretrainedConfig().to_dict()) | {"auto_map"}
    return {field: value for field, value in config.to_dict().items() if field not in generic}


def refusals(config, known: Mapping[str, SettingCheck | None], tool: str) -> list[str]:
    """One line per setting of `config` that `tool` cannot handle: a value its check refuses (with the reason), or
    a setting not in `known` at all. `known[field] = None` accepts every value."""
    lines = []
    for field, value in model_settings(config).items():
        if field not in known:
            lines.append(f"`{field}={value!r}` (a setting {tool} does not know; it handles the settings it lists)")
            continue
        check = known[field]
        problem = check(value) if check is not None else None
        if problem is not None:
            lines.append(f"`{field}={value!r}` ({problem})")
    return lines
