"""hf-deep-nmt: deep-Transformer translation models (DLCL, DS-Init + MAtt, SDT, MSC, DeepNorm) as Hugging Face models.

Importing the package registers every config with `AutoConfig`, its translation model with
`AutoModelForSeq2SeqLM` and its encoder-decoder without the output layer with `AutoModel`, and marks them for
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

__all__ = [
    "BASE_MODEL_CLASSES",
    "DeepNMTConfig",
    "DlclConfig",
    "DeepNMTPreTrainedModel",
    "DeepNMTModel",
    "DeepNMTForConditionalGeneration",
    "DeepNormConfig",
    "DeepNormForConditionalGeneration",
    "DeepNormModel",
    "DenseFormerConfig",
    "DenseFormerForConditionalGeneration",
    "DenseFormerModel",
    "MixLnConfig",
    "MixLnForConditionalGeneration",
    "MixLnModel",
    "AttnResConfig",
    "AttnResForConditionalGeneration",
    "AttnResModel",
    "HyperConnectionsConfig",
    "HyperConnectionsForConditionalGeneration",
    "HyperConnectionsModel",
    "DlclForConditionalGeneration",
    "DlclModel",
    "DsInitConfig",
    "DsInitForConditionalGeneration",
    "DsInitModel",
    "METHODS",
    "MODEL_CLASSES",
    "DeepNMTMethod",
    "register_method",
    "MscConfig",
    "MscForConditionalGeneration",
    "MscModel",
    "SdtConfig",
    "SdtForConditionalGeneration",
    "SdtModel",
    "register",
]

# They live in `hf_deep_nmt.registration`, imported on first use (PEP 562): importing it imports torch, transformers
# and the model code, which a command refused on its arguments never needs.
_REGISTERED_NAMES = frozenset(__all__) | {"TESTED_VERSIONS", "__version__"}


def __getattr__(name: str):
    if name in MOVED:  # a module path of 0.2.0 (`hf_deep_nmt.translate`, ...)
        return importlib.import_module(f"{__name__}.{name}")
    if name in _REGISTERED_NAMES:
        from hf_deep_nmt import registration

        value = getattr(registration, name)
        globals()[name] = value  # looked up once
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_REGISTERED_NAMES})


if "hf_deep_nmt_cli" not in sys.modules:  # the Python API: registered on import, as 0.1.0 did
    from hf_deep_nmt import registration  # noqa: F401
