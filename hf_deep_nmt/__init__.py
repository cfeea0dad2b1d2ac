"""hf-deep-nmt: deep-Transformer translation models (DLCL, DS-Init + MAtt, SDT, MSC) as Hugging Face models.

Importing the package registers every config with `AutoConfig`, its translation model with `AutoModelForSeq2SeqLM`
and its encoder-decoder without the output layer with `AutoModel`, and marks them for auto-class saving, so that
`save_pretrained` writes `auto_map` and the modeling files (Hub remote code). With `peft` installed, it also registers
the models' default LoRA target modules (`hf_deep_nmt.adapters`), and makes their `from_pretrained` warn about NaN or
infinite weights (`hf_deep_nmt.input_checks.install_load_warning`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from hf_deep_nmt.adapters import register_lora_defaults
from hf_deep_nmt.input_checks import install_load_warning
from hf_deep_nmt.modeling.configuration_deep_nmt import DeepNMTConfig, DlclConfig, DsInitConfig, MscConfig, SdtConfig
from hf_deep_nmt.modeling.modeling_deep_nmt import (
    CODE_VERSION,
    TESTED_TRANSFORMERS,
    DeepNMTForConditionalGeneration,
    DeepNMTModel,
    DeepNMTPreTrainedModel,
    DlclForConditionalGeneration,
    DlclModel,
    DsInitForConditionalGeneration,
    DsInitModel,
    MscForConditionalGeneration,
    MscModel,
    SdtForConditionalGeneration,
    SdtModel,
)

__version__ = CODE_VERSION  # one version for the package and the model code it ships to the Hub

# The (oldest, newest) minor releases CI runs the tests against; `pyproject.toml` admits exactly these (the torch
# bound is open above: only the CPU build of 2.13 is run here). The model code carries the transformers window itself,
# as it ships to the Hub without the package.
TESTED_VERSIONS: dict[str, tuple[str, str]] = {"transformers": TESTED_TRANSFORMERS, "torch": ("2.13", "2.13")}

MODEL_CLASSES: dict[type, type] = {
    DeepNMTConfig: DeepNMTForConditionalGeneration,
    DlclConfig: DlclForConditionalGeneration,
    DsInitConfig: DsInitForConditionalGeneration,
    SdtConfig: SdtForConditionalGeneration,
    MscConfig: MscForConditionalGeneration,
}
# what `AutoModel` loads: the encoder-decoder without the output layer
BASE_MODEL_CLASSES: dict[type, type] = {
    DeepNMTConfig: DeepNMTModel,
    DlclConfig: DlclModel,
    DsInitConfig: DsInitModel,
    SdtConfig: SdtModel,
    MscConfig: MscModel,
}


def _register() -> None:
    for config_class, model_class in MODEL_CLASSES.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForSeq2SeqLM.register(config_class, model_class, exist_ok=True)
        config_class.register_for_auto_class()
        model_class.register_for_auto_class("AutoModelForSeq2SeqLM")
        AutoModel.register(config_class, BASE_MODEL_CLASSES[config_class], exist_ok=True)
        BASE_MODEL_CLASSES[config_class].register_for_auto_class("AutoModel")
    register_lora_defaults()
    install_load_warning(DeepNMTPreTrainedModel)  # `from_pretrained` warns about NaN or infinite weights


_register()

__all__ = [
    "BASE_MODEL_CLASSES",
    "DeepNMTConfig",
    "DlclConfig",
    "DeepNMTPreTrainedModel",
    "DeepNMTModel",
    "DeepNMTForConditionalGeneration",
    "DlclForConditionalGeneration",
    "DlclModel",
    "DsInitConfig",
    "DsInitForConditionalGeneration",
    "DsInitModel",
    "MODEL_CLASSES",
    "MscConfig",
    "MscForConditionalGeneration",
    "MscModel",
    "SdtConfig",
    "SdtForConditionalGeneration",
    "SdtModel",
]
