"""The registration of the package's models: importing this module registers every config with `AutoConfig`, its
translation model with `AutoModelForSeq2SeqLM` and its encoder-decoder without the output layer with `AutoModel`, and
marks them for auto-class saving, so that `save_pretrained` writes `auto_map` and the modeling files (Hub remote
code). With `peft` installed, it also registers the models' default LoRA target modules (`hf_deep_nmt.adapters`):
at once where peft's table is already imported, else when it is (`register_lora_defaults_on_import`), so that
registering, and so `import hf_deep_nmt`, does not import peft (a third of a second, for a command that never uses it).

It is also where the package's names live. The classes of every method (config, model, encoder-decoder) are names of
this module by the names `METHODS` gives them, read at each lookup (`method_classes`), so that no list of them is kept
by hand and a method registered later is named too. The package imports it when one of its names is first used
(`from hf_deep_nmt import DlclConfig`, `hf_deep_nmt.register()`), and so does every module of the package that loads
or builds a model."""

import sys

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from hf_deep_nmt.adapters import register_lora_defaults
from hf_deep_nmt.modeling import modeling_deep_nmt
from hf_deep_nmt.modeling.contract_deep_nmt import TESTED_TRANSFORMERS
from hf_deep_nmt.modeling.modeling_deep_nmt import (  # noqa: F401  (handed on by the package)
    CODE_VERSION,
    METHODS,
    DeepNMTMethod,
    DeepNMTPreTrainedModel,
)

__version__ = CODE_VERSION  # one version for the package and the model code it ships to the Hub

# The (oldest, newest) minor releases CI runs the tests against; `pyproject.toml` admits exactly these (the torch
# bound is open above: only the CPU build of 2.13 is run here). The model code carries the transformers window itself,
# as it ships to the Hub without the package.
TESTED_VERSIONS: dict[str, tuple[str, str]] = {"transformers": TESTED_TRANSFORMERS, "torch": ("2.13", "2.13")}

# Derived from the model code's one table of methods (`METHODS`), kept in step by `register_method`.
MODEL_CLASSES: dict[type, type] = {}
# what `AutoModel` loads: the encoder-decoder without the output layer
BASE_MODEL_CLASSES: dict[type, type] = {}


def register_method(method: DeepNMTMethod) -> DeepNMTMethod:
    """Make `method` a method of the package: added to the model code's `METHODS`, its classes to `MODEL_CLASSES` /
    `BASE_MODEL_CLASSES`, registered with `AutoConfig`, `AutoModelForSeq2SeqLM` and `AutoModel` and marked for
    auto-class saving (so `save_pretrained` writes remote code), and given peft's default LoRA targets (when peft is
    imported: `register_lora_defaults_on_import`); its classes
    are names of this module and of the package from then on (`method_classes`). Every built-in method comes this
    way; `docs/methods.md` ("Adding a method") says what a new one needs besides."""
    modeling_deep_nmt.register_method(method)
    config_class, model_class, base_model_class = method.config_class, method.model_class, method.base_model_class
    MODEL_CLASSES[config_class] = model_class
    BASE_MODEL_CLASSES[config_class] = base_model_class
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModelForSeq2SeqLM.register(config_class, model_class, exist_ok=True)
    config_class.register_for_auto_class()
    model_class.register_for_auto_class("AutoModelForSeq2SeqLM")
    AutoModel.register(config_class, base_model_class, exist_ok=True)
    base_model_class.register_for_auto_class("AutoModel")
    register_lora_defaults_on_import([config_class.model_type])
    return method


PEFT_TABLE = "peft.utils.constants"  # the module of peft's table of default LoRA targets
_LORA_PENDING: list[str] = []  # model types whose LoRA defaults wait for peft's table to be imported


class _AfterPeftTable:
    """A meta path finder that lets the usual finders find `PEFT_TABLE`, then has its module, once executed, take
    the pending LoRA defaults (`register_lora_defaults`): the registration happens when peft is imported, however
    it is imported, and never imports it."""

    def find_spec(self, name, path=None, target=None):
        if name != PEFT_TABLE:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *_: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                execute = spec.loader.exec_module

                def exec_module(module, execute=execute):
                    execute(module)
                    register_lora_defaults(_LORA_PENDING)

                spec.loader.exec_module = exec_module  # this module's own loader object
                return spec
        return None


_PEFT_HOOK = _AfterPeftTable()


def register_lora_defaults_on_import(model_types: list[str]) -> None:
    """`register_lora_defaults(model_types)` now if peft's table is imported, else as soon as it is."""
    _LORA_PENDING.extend(model_types)
    if PEFT_TABLE in sys.modules:
        register_lora_defaults(model_types)
    elif _PEFT_HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _PEFT_HOOK)


def method_classes() -> dict[str, type]:
    """Every method's config, model and base-model class by its name, read from `METHODS` at each call: the names
    the package hands on, so a method registered later is among them."""
    return {
        cls.__name__: cls
        for method in METHODS.values()
        for cls in (method.config_class, method.model_class, method.base_model_class)
    }


def __getattr__(name: str) -> type:
    # the classes of the methods are names of this module (`from hf_deep_nmt.registration import DlclConfig`)
    try:
        return method_classes()[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def _register() -> None:
    for method in list(METHODS.values()):
        register_method(method)


_register()


def register() -> None:
    """Nothing more to do: importing this module registered the package's models (see the module docstring)."""
