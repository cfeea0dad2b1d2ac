"""What the weights of a saved model hold, read without loading them (the safetensors headers: tensor names, shapes,
sizes), and what a loaded model's weights must not be: missing from the file (initialised at random), or NaN or
infinite (found by the model code itself, `nonfinite_parameters`, which also warns on `from_pretrained`)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from hf_deep_nmt.modeling.contract_deep_nmt import nonfinite_parameters

_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
_SAFETENSORS_DTYPE_BYTES.update({"I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1})


def safetensors_header(path: str | Path) -> dict:
    """The JSON header of the safetensors file `path` (tensor names to dtype, shape, offsets); only the header is
    read. `ValueError` naming the file when it is not a safetensors file."""
    path = Path(path)
    with path.open("rb") as handle:
        prefix = handle.read(8)
        size = path.stat().st_size
        header_size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
        if header_size > size - 8:
            raise ValueError(
                f"{str(path)!r} is not a whole safetensors file (cut off, or not safetensors at all): its first 8 "
                f"bytes announce a header of {header_size} bytes in a file of {size}; save the model again, or "
                "restore the file from the exported folder."
            )
        try:
            header = json.loads(handle.read(header_size))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise ValueError(
            f"{str(path)!r} has an unreadable safetensors header (not a JSON object); save the model again, or "
            "restore the file from the exported folder."
        )
    header.pop("__metadata__", None)
    ends = [entry.get("data_offsets", [0, 0])[-1] for entry in header.values() if isinstance(entry, dict)]
    data_size = max([end for end in ends if isinstance(end, int)], default=0)
    if 8 + header_size + data_size > size:
        raise ValueError(
            f"{str(path)!r} is not a whole safetensors file (cut off): its header places tensor data up to byte "
            f"{8 + header_size + data_size} in a file of {size}; save the model again, or restore the file from the "
            "exported folder."
        )
    return header


def saved_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a saved model folder (one, or the shards its index names)."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        return [folder / shard for shard in shards]
    return []


def saved_parameters(folder: str | Path) -> tuple[int, int] | None:
    """(elements, bytes) of the tensors a saved model folder holds, from the safetensors headers alone; None when the
    folder has no safetensors weights."""
    files = saved_weight_files(folder)
    if not files:
        return None
    elements = size = 0
    for path in files:
        for entry in safetensors_header(path).values():
            count = math.prod(entry.get("shape", []))
            elements += count
            size += count * _SAFETENSORS_DTYPE_BYTES.get(entry.get("dtype"), 4)
    return elements, size


def check_finite_weights(model, source: str) -> None:
    """`ValueError` naming the weights of `model` (loaded from `source`) that hold NaN or infinite values: such a model
    translates every sentence into nothing."""
    bad = nonfinite_parameters(model)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise ValueError(
            f"The weights of {source!r} hold NaN or infinite values ({shown}); the model cannot translate. Use an "
            "earlier checkpoint (training stops before a non-finite step reaches the weights)."
        )


def check_missing_weights(model, loading_info: dict, source: str) -> None:
    """`ValueError` naming the weights `from_pretrained` did not find in `source` and so initialised at random (tied
    copies of loaded weights are not missing)."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = sorted(set(loading_info.get("missing_keys", ())) - tied)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"The weights of {source!r} lack {shown}: they would be initialised at random. The weight file does not "
            "belong to this config, or was damaged; restore the folder as it was saved."
        )
