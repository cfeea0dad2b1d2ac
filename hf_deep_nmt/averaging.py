"""Checkpoint averaging, as all four papers evaluate: the element-wise mean of the weights of the last N checkpoints
(or of a given list) written as an ordinary, loadable model folder.

No library offers this for Trainer checkpoints (fairseq's `average_checkpoints.py` does it for fairseq files); the
file handling is `safetensors`, checkpoint discovery that of `hf_deep_nmt.callbacks`, the rest is written here.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, PreTrainedModel
from transformers.utils import logging

from hf_deep_nmt.callbacks import numbered_checkpoints
from hf_deep_nmt.hub import check_export_folder

logger = logging.get_logger(__name__)

WEIGHTS_NAME = "model.safetensors"
# What a saved model folder holds besides its weights; copied from the newest checkpoint.
_COMPANION_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """`checkpoint-<step>` folders of a Trainer output folder that hold weights, oldest step first."""
    if not Path(output_dir).is_dir():
        raise FileNotFoundError(f"Training output folder not found: {output_dir}")
    return [path for path in numbered_checkpoints(output_dir) if (path / WEIGHTS_NAME).is_file()]


def last_checkpoints(output_dir: str | Path, count: int) -> list[Path]:
    """The newest `count` checkpoints of `output_dir`; an error naming what exists when there are fewer."""
    if count < 1:
        raise ValueError(f"`count` must be >= 1, got {count}.")
    checkpoints = list_checkpoints(output_dir)
    if len(checkpoints) < count:
        raise ValueError(
            f"Asked to average the last {count} checkpoints of {str(output_dir)!r}, but it holds {len(checkpoints)} "
            f"({[path.name for path in checkpoints]}); save more often (`save_steps`) or keep more "
            f"(`save_total_limit`)."
        )
    return checkpoints[-count:]


def average_state_dicts(state_dicts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Tensor-by-tensor mean (accumulated in float64, returned in each tensor's dtype); integer tensors must agree."""
    if not state_dicts:
        raise ValueError("Nothing to average: no state dicts given.")
    keys = list(state_dicts[0])
    for number, state in enumerate(state_dicts[1:], start=2):
        if set(state) != set(keys):
            difference = sorted(set(state) ^ set(keys))
            raise ValueError(f"Checkpoint {number} has different tensors from checkpoint 1: {difference[:5]}.")
    averaged = {}
    for key in keys:
        tensors = [state[key] for state in state_dicts]
        if any(tensor.shape != tensors[0].shape for tensor in tensors):
            raise ValueError(f"Tensor {key!r} has different shapes: {[tuple(t.shape) for t in tensors]}.")
        if tensors[0].is_floating_point():
            total = torch.zeros(tensors[0].shape, dtype=torch.float64)
            for tensor in tensors:
                total += tensor.to(torch.float64)
            averaged[key] = (total / len(tensors)).to(tensors[0].dtype)
        else:
            if any(not torch.equal(tensor, tensors[0]) for tensor in tensors):
                raise ValueError(f"Integer tensor {key!r} differs between checkpoints; it cannot be averaged.")
            averaged[key] = tensors[0].clone()
    return averaged


def average_checkpoints(
    checkpoints: Sequence[str | Path] | None = None,
    *,
    output_dir: str | Path | None = None,
    last: int | None = None,
    save_to: str | Path | None = None,
    overwrite: bool = False,
) -> PreTrainedModel:
    """The mean of `checkpoints` (model folders), or of the `last` N checkpoints of the Trainer folder `output_dir`.

    Returns the averaged model, built from the newest checkpoint's config; with `save_to`, also writes it there as a
    model folder (weights, config, generation config, tokenizer files of the newest checkpoint). An existing
    non-empty `save_to` is refused unless `overwrite`.
    """
    if (checkpoints is None) == (output_dir is None):
        raise ValueError("Give either `checkpoints` (a list of folders) or `output_dir` with `last`.")
    if output_dir is not None:
        if last is None:
            raise ValueError("`output_dir` needs `last`, the number of newest checkpoints to average.")
        checkpoints = last_checkpoints(output_dir, last)
    paths = [Path(path) for path in checkpoints]
    for path in paths:
        if not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"No {WEIGHTS_NAME} in checkpoint folder {str(path)!r}.")
    if save_to is not None:
        check_export_folder(save_to, overwrite)
    averaged = average_state_dicts([load_file(path / WEIGHTS_NAME) for path in paths])
    model = AutoModelForSeq2SeqLM.from_pretrained(paths[-1])
    missing, unexpected = model.load_state_dict(averaged, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    if unexpected or set(missing) - tied:
        raise ValueError(f"Averaged weights do not fit the model: missing {missing}, unexpected {unexpected}.")
    logger.warning(f"Averaged {len(paths)} checkpoints: {[path.name for path in paths]}.")
    if save_to is not None:
        save_to = Path(save_to)
        if save_to.exists() and overwrite:
            shutil.rmtree(save_to)  # asked for; stale files of an earlier average must not survive
        model.save_pretrained(save_to)
        for name in _COMPANION_FILES:
            if (paths[-1] / name).is_file() and not (save_to / name).exists():
                shutil.copy2(paths[-1] / name, save_to / name)
    return model
