"""hf-deep-nmt: deep-Transformer translation models (DLCL, DS-Init + MAtt, SDT, MSC) as Hugging Face models.

Importing the package registers every config/model pair with `AutoConfig` and `AutoModelForSeq2SeqLM`, and marks
them for auto-class saving, so that `save_pretrained` writes `auto_map` and the modeling files (Hub remote code).
"""

from transformers import AutoConfig, AutoModelForSeq2SeqLM

from hf_deep_nmt.modeling.configuration_deep_nmt import DeepNMTConfig, DlclConfig, DsInitConfig, MscConfig, SdtConfig
from hf_deep_nmt.modeling.modeling_deep_nmt import (
    DeepNMTForConditionalGeneration,
    DeepNMTModel,
    DeepNMTPreTrainedModel,
    DlclForConditionalGeneration,
    DsInitForConditionalGeneration,
    MscForConditionalGeneration,
    SdtForConditionalGeneration,
)

__version__ = "0.1.0"

MODEL_CLASSES: dict[type, type] = {
    DeepNMTConfig: DeepNMTForConditionalGeneration,
    DlclConfig: DlclForConditionalGeneration,
    DsInitConfig: DsInitForConditionalGeneration,
    SdtConfig: SdtForConditionalGeneration,
    MscConfig: MscForConditionalGeneration,
}


def _register() -> None:
    for config_class, model_class in MODEL_CLASSES.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModelForSeq2SeqLM.register(config_class, model_class, exist_ok=True)
        config_class.register_for_auto_class()
        model_class.register_for_auto_class("AutoModelForSeq2SeqLM")


_register()

__all__ = [
    "DeepNMTConfig",
    "DlclConfig",
    "DeepNMTPreTrainedModel",
    "DeepNMTModel",
    "DeepNMTForConditionalGeneration",
    "DlclForConditionalGeneration",
    "DsInitConfig",
    "DsInitForConditionalGeneration",
    "MODEL_CLASSES",
    "MscConfig",
    "MscForConditionalGeneration",
    "SdtConfig",
    "SdtForConditionalGeneration",
]
