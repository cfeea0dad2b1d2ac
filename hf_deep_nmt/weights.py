"""What the weights of a saved model hold, read without loading them (the safetensors headers: tensor names, shapes,
sizes; the model code's reader, which checks a config against its weights before building), and what a loaded model's
weights must not be: missing from the file (initialised at random), or NaN or infinite (found by the model code
itself, `nonfinite_parameters`, which also warns on `from_pretrained`)."""

from __future__ import annotations

import math
from pathlib import Path

from hf_deep_nmt.folders import saved_weight_files  # importable from here as before
from hf_deep_nmt.modeling.contract_deep_nmt import (
    SAFETENSORS_DTYPE_BYTES,
    missing_and_unexpected_weights,
    nonfinite_parameters,
)
from hf_deep_nmt.modeling.contract_deep_nmt import safetensors_header as safetensors_header


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
            size += count * SAFETENSORS_DTYPE_BYTES.get(entry.get("dtype"), 4)
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
    missing, _ = missing_and_unexpected_weights(model, loading_info)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"The weights of {source!r} lack {shown}: they would be initialised at random. The weight file does not "
            "belong to this config, or was damaged; restore the folder as it was saved."
        )
