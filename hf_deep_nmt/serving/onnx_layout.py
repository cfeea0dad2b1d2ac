"""The names and digests a folder of exported graphs is read by, shared by the exporter
(`hf_deep_nmt.serving.onnx_export`, which imports torch) and the decoder and its checks (`hf_deep_nmt.serving.onnx`,
`onnx_checks`), which must not: translating with ONNX Runtime needs neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hf_deep_nmt.folders import saved_weight_files

LAYOUT_FILE = "onnx_layout.json"
ENCODER_FIELDS = ("last_hidden_state", "block_outputs", "context_states")  # the tensors of a DeepNMTEncoderOutput
SLOTS = ("keys", "values", "running_sum", "context_keys", "context_values")
ONNX_SUBFOLDER = "onnx"  # a model folder (and its Hub repository) carries its graphs here
# What a config.json holds that says where and by which version it was saved, not what the model computes: left out of
# its digest, so that saving the same config again (`upgrade-code`, another transformers release) keeps the graphs.
CONFIG_BOOKKEEPING = ("transformers_version", "_name_or_path", "auto_map", "architectures")


def slot_name(entry) -> str:
    """The graph input (and, prefixed `new.`, output) name of a cache slot (half, layer, slot) of the layout."""
    half, index, slot = entry
    return f"{half}.{index}.{slot}"


def config_digest(values: dict) -> str:
    """The SHA-256 of a config's settings (a parsed `config.json`), its bookkeeping keys (`CONFIG_BOOKKEEPING`) left
    out and the rest in a fixed order: the same for the same model whatever saved it."""
    kept = {key: value for key, value in values.items() if key not in CONFIG_BOOKKEEPING}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a saved model folder: its safetensors files, else a `pytorch_model.bin`."""
    files = saved_weight_files(folder)
    return files or [path for path in (folder / "pytorch_model.bin",) if path.is_file()]
