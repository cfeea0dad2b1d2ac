"""LoRA (through `peft`) on the models of this package.

`peft` looks up the default target modules of a `LoraConfig` without `target_modules` by the model's `model_type`
(`peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`, the table its built-in architectures are
listed in). Registering the package's models (`hf_deep_nmt.registration`) adds every model type to it
(`register_lora_defaults`), so that

    get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM"))

adapts every linear map inside the layers of any family. The output layer and the embeddings are not adapted (nor
are the DLCL combination weights, the Attention Residuals pseudo-queries and key gains, the Hyper-Connections' stream
weights or the relative position tables, which are not linear layers: they stay frozen); the MSC context cell, a
`torch.nn.GRUCell`, is no layer type LoRA adapts, but its weight matrices are parameters it can adapt
(`target_parameters=GRU_PARAMETERS`), and
`modules_to_save=["context"]` trains the cell in full instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from hf_deep_nmt.modeling.modeling_deep_nmt import METHODS

# Every linear map inside the layers: attention projections (self-, cross-, MAtt and MSC context attention), the
# feed-forward networks (also the AAN's and the MSC feed-forward context cell's), the AAN gate and the MSC fusion gate.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "gate", "fusion_gate")
# The weight matrices of the MSC GRU context cell, for `LoraConfig(target_parameters=...)`.
GRU_PARAMETERS = ("weight_ih", "weight_hh")


def register_lora_defaults(model_types: Iterable[str] | None = None) -> bool:
    """Add `LORA_TARGET_MODULES` for every model type of the package to peft's table of default LoRA targets (an
    entry peft already has is kept). Returns False, doing nothing, when peft is not installed."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    except ImportError:
        return False
    for model_type in METHODS if model_types is None else model_types:
        defaults.setdefault(model_type, list(LORA_TARGET_MODULES))
    return True
