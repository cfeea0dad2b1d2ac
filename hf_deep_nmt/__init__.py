"""hf-deep-nmt: the methods of deep-Transformer machine translation (DLCL and those that came before and after it,
one configurable backbone) as Hugging Face models.

Every method of the model code's table, `METHODS`, is a name of the package three times: its config, its translation
model and its encoder-decoder without the output layer (`DlclConfig`, `DlclForConditionalGeneration`, `DlclModel`),
a method added with `register_method` too. Importing the package registers every config with `AutoConfig`, its
translation model with `AutoModelForSeq2SeqLM` and its encoder-decoder with `AutoModel`, and marks them for
auto-class saving, so that `save_pretrained` writes `auto_map` and the modeling files (Hub remote code); with `peft`
installed, also the models' default LoRA target modules (`hf_deep_nmt.registration`). Every module of the package
that loads or builds a model registers them too.

Only the command line, started through `hf_deep_nmt_cli` (the `hf-deep-nmt` script), imports the package without
registering: it starts, and refuses a bad argument, without torch and transformers; its commands register when they
load or build a model, and the package's names are handed on at their first use either way.
"""

import importlib
import sys

from hf_deep_nmt._moved import MOVED

# The names the package hands on besides the methods' classes, which `hf_deep_nmt.registration` reads from `METHODS`.
_NAMES = (
    "BASE_MODEL_CLASSES",
    "DeepNMTMethod",
    "DeepNMTPreTrainedModel",
    "METHODS",
    "MODEL_CLASSES",
    "register",
    "register_method",
)
# They live in `hf_deep_nmt.registration`, imported on first use (PEP 562): importing it imports torch, transformers
# and the model code, which a command refused on its arguments never needs. A class name (capitalised; the package's
# modules are lower case, so `from hf_deep_nmt import cli` never gets here) is looked up there too.
_REGISTERED_NAMES = frozenset(_NAMES) | {"TESTED_VERSIONS", "__version__"}


def _registration():
    from hf_deep_nmt import registration

    return registration


def __getattr__(name: str):
    if name in MOVED:  # a module path of 0.2.0 (`hf_deep_nmt.translate`, ...)
        return importlib.import_module(f"{__name__}.{name}")
    if name == "__all__":  # read at each `from hf_deep_nmt import *`: a method registered later is in it
        return [*_NAMES, *_registration().method_classes()]
    if name in _REGISTERED_NAMES or name[:1].isupper():
        try:
            value = getattr(_registration(), name)
        except AttributeError:
            pass
        else:
            globals()[name] = value  # looked up once
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_REGISTERED_NAMES, *_registration().method_classes()})


if "hf_deep_nmt_cli" not in sys.modules:  # the Python API: registered on import, as 0.1.0 did
    from hf_deep_nmt import registration  # noqa: F401
