"""The module paths of 0.2.0, before the library was split into `data`, `training`, `serving` and `tools`: each still
imports, as the module it moved to (the same object, so code that patches it patches the real one), with a
`FutureWarning` naming the new path. They go in the release after next."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "batching": "data.batching",
    "prepared_data": "data.prepared",
    "streaming": "data.streaming",
    "tokenizer": "data.tokenizer",
    "arguments": "training.arguments",
    "averaging": "training.averaging",
    "callbacks": "training.callbacks",
    "checkpoints": "training.checkpoints",
    "curves": "training.curves",
    "evaluation": "training.evaluation",
    "growing": "training.growing",
    "plan": "training.plan",
    "preemption": "training.preemption",
    "recipes": "training.recipes",
    "run_folder": "training.run_folder",
    "schedules": "training.schedules",
    "staged": "training.staged",
    "trainer": "training.trainer",
    "ctranslate2_export": "serving.ctranslate2",
    "decoding": "serving.options",
    "onnx_decoding": "serving.onnx",
    "translate": "serving.translate",
    "diagnostics": "tools.diagnostics",
    "doctor": "tools.doctor",
    "inspection": "tools.inspection",
    "marian": "tools.marian",
    "upgrade_code": "tools.upgrade_code",
}
# `hf_deep_nmt.data` and `hf_deep_nmt.training` were modules and are packages now: the names of the old modules are
# handed on by the packages themselves (`moved_names`).
MOVED_NAMES = {"data": "data.corpus", "training": "training.pipeline"}


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    message = f"`{old}` moved to `{new}`; the old path goes in the release after next."
    warnings.warn(message, FutureWarning, stacklevel=stacklevel)


def moved_names(package: str, name: str):
    """A name of the old module `package` (`hf_deep_nmt.data` or `.training`), from the module it moved to."""
    if name.startswith("__"):
        raise AttributeError(name)
    new = "hf_deep_nmt." + MOVED_NAMES[package.removeprefix("hf_deep_nmt.")]
    module = importlib.import_module(new)
    if not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warn_moved(f"{package}.{name}", f"{new}.{name}", stacklevel=4)
    value = getattr(module, name)
    vars(sys.modules[package])[name] = value  # warned once
    return value


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `hf_deep_nmt.<old>` as the module it moved to."""

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("hf_deep_nmt.")
        return importlib.util.spec_from_loader(fullname, self) if old in MOVED and old != fullname else None

    def create_module(self, spec):
        new = "hf_deep_nmt." + MOVED[spec.name.removeprefix("hf_deep_nmt.")]
        warn_moved(spec.name, new)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module it moved to is already run


if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
    sys.meta_path.append(_OldPaths())
