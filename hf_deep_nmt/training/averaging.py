"""Checkpoint averaging, as all four papers evaluate: the element-wise mean of the weights of the last N checkpoints
(or of a given list) written as an ordinary, loadable model folder.

No library offers this for Trainer checkpoints (fairseq's `average_checkpoints.py` does it for fairseq files); the
file handling is `safetensors`, checkpoint discovery and checksums those of `hf_deep_nmt.training.checkpoints`, the
rest is written here.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, PreTrainedModel
from transformers.utils import logging

from hf_deep_nmt import registration  # noqa: F401  (checkpoints load through the Auto classes)
from hf_deep_nmt.fingerprints import (
    first_tokenizer_difference,
    folder_tokenizer_fingerprint,
    record_tokenizer_fingerprint,
)
from hf_deep_nmt.folders import check_export_folder, write_marked_folder
from hf_deep_nmt.hub import settle_output_cap
from hf_deep_nmt.memory import check_memory
from hf_deep_nmt.model_folders import check_saved_json_files
from hf_deep_nmt.training.checkpoints import (
    RNG_STATE_PATTERN,
    TRAINER_STATE_FILE,
    TRAINING_STATE_FILES,
    checkpoint_problem,
    numbered_checkpoints,
    safetensors_problem,
    verify_checkpoint,
)
from hf_deep_nmt.weights import saved_parameters

logger = logging.get_logger(__name__)

WEIGHTS_NAME = "model.safetensors"
# The tokenizer files of a saved model folder; copied from the newest input that has them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
AVERAGE_FLAG = "`--overwrite` on the command line, `overwrite=True` in Python"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete `checkpoint-<step>` folders of a Trainer output folder, oldest step first; incomplete or damaged ones
    are left out with a warning (the rule of `hf_deep_nmt.training.checkpoints.checkpoint_problem`, where a checkpoint
    saved with `save_only_model` counts as complete)."""
    if not Path(output_dir).is_dir():
        raise FileNotFoundError(f"Training output folder not found: {output_dir}")
    complete = []
    for path in numbered_checkpoints(output_dir):
        problem = checkpoint_problem(path, model_only_allowed=True)
        if problem is None:
            complete.append(path)
        elif any(path.iterdir()):
            logger.warning(f"Not averaging incomplete checkpoint: {problem}.")
    return complete


def input_problem(folder: Path) -> str | None:
    """Why `folder` cannot be averaged: a Trainer checkpoint must be complete, a plain model folder needs whole
    weights."""
    if not folder.exists():
        return f"No such checkpoint folder: {str(folder)!r} does not exist (check the path)"
    if not folder.is_dir():
        return f"Checkpoint {str(folder)!r} is not a folder (a file, FIFO or device); name a checkpoint-<step> folder"
    if not (folder / WEIGHTS_NAME).is_file():
        return f"No {WEIGHTS_NAME} in checkpoint folder {str(folder)!r}"
    state_files = [TRAINER_STATE_FILE, *TRAINING_STATE_FILES]
    if any((folder / name).exists() for name in state_files) or list(folder.glob(RNG_STATE_PATTERN)):
        return checkpoint_problem(folder, model_only_allowed=True)
    return safetensors_problem(folder / WEIGHTS_NAME)


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


def finite_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of `folder`; `ValueError` naming the checkpoint and its tensors holding NaN or infinite values
    (an average with them would be NaN too)."""
    state = load_file(folder / WEIGHTS_NAME)
    bad = [name for name, tensor in state.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        raise ValueError(
            f"Checkpoint {str(folder)!r} holds NaN or infinite weights ({', '.join(bad[:5])}"
            f"{f' and {len(bad) - 5} more' if len(bad) > 5 else ''}); leave it out of the average."
        )
    return state


def check_same_tokenizer(paths: Sequence[Path]) -> None:
    """`ValueError` naming two inputs whose tokenizers differ (their `tokenizer.json` essentials, or a fingerprint a
    config records): their embedding rows mean different tokens, and their mean means nothing."""
    differ = first_tokenizer_difference(paths)  # each pair in the newest fingerprint format both have
    if differ is not None:
        first, second = differ
        where = f"{str(first)!r} and {str(second)!r}" if first != second else f"{str(first)!r} (its config)"
        raise ValueError(
            f"The checkpoints were trained with different tokenizers ({where} differ): the same embedding row is "
            "another token in each, so their average means nothing. Average checkpoints of one run."
        )


def check_distinct_checkpoints(paths: Sequence[Path]) -> None:
    """`ValueError` naming a checkpoint given more than once (by any spelling of its path): the mean would weigh it
    twice, silently, where an average of distinct checkpoints was asked for."""
    seen: dict[Path, Path] = {}
    for path in paths:
        resolved = path.resolve()
        if resolved in seen:
            same = "" if str(seen[resolved]) == str(path) else f" (as {str(seen[resolved])!r} and {str(path)!r})"
            raise ValueError(
                f"The checkpoint {str(path)!r} is given twice{same}: the average would count it twice. Give each "
                "checkpoint once."
            )
        seen[resolved] = path


def check_inputs(paths: Sequence[Path]) -> None:
    """Refuse, naming it, a checkpoint given twice, incomplete or damaged, changed since its run recorded its
    checksums, or of another tokenizer than the others."""
    check_distinct_checkpoints(paths)
    for path in paths:
        problem = input_problem(path)
        if problem is not None:
            error = FileNotFoundError if problem.startswith("No ") else ValueError
            raise error(f"{problem}; it cannot be averaged.")
    for path in paths:
        verify_checkpoint(path)  # the files its run recorded, if it recorded any
        check_saved_json_files(path, "Checkpoint", "leave it out of the average, or restore the file")
    check_same_tokenizer(paths)


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
    model folder (weights, config, generation config, and the tokenizer files of the newest input that has them). An
    existing non-empty `save_to` is refused unless `overwrite`, and even then unless every file in it was written by
    an earlier export or average; `save_to` may not be one of the inputs or the Trainer output folder holding them.
    Incomplete or damaged checkpoints are refused (named) or, when found through `output_dir`, skipped; a checkpoint
    whose files differ from the checksums its run recorded is refused, naming it and the file.
    """
    if (checkpoints is None) == (output_dir is None):
        raise ValueError("Give either `checkpoints` (a list of folders) or `output_dir` with `last`.")
    if output_dir is not None:
        if last is None:
            raise ValueError("`output_dir` needs `last`, the number of newest checkpoints to average.")
        checkpoints = last_checkpoints(output_dir, last)
    paths = [Path(path) for path in checkpoints]
    check_inputs(paths)
    _, size = saved_parameters(paths[-1])
    # every input in memory at once, the float64 sums, the result and the model it is loaded into
    check_memory(
        len(paths) * size + 4 * size,
        f"Averaging {len(paths)} checkpoints of {size:,} bytes each",
        "average fewer checkpoints at a time, or on a machine with more memory",
    )
    protected: dict[str, str | Path] = {}
    for path in paths:
        protected[f"one of the averaged checkpoints ({str(path)!r})"] = path
        if numbered_checkpoints(path.parent):
            protected[f"the Trainer output folder holding the checkpoint {str(path)!r}"] = path.parent
    if save_to is not None:
        inputs = {f"the checkpoint {str(path)!r}": path for path in paths}  # the result inside one: saved with it
        check_export_folder(save_to, overwrite, flag=AVERAGE_FLAG, protected=protected, sources=inputs)
    averaged = average_state_dicts([finite_weights(path) for path in paths])
    model = AutoModelForSeq2SeqLM.from_pretrained(paths[-1])
    missing, unexpected = model.load_state_dict(averaged, strict=False)
    # a weight tied to a loaded one (the shared embeddings of each stack) shares its storage: not missing
    state = model.state_dict()
    loaded = {state[key].data_ptr() for key in averaged if key in state}
    missing = [key for key in missing if state[key].data_ptr() not in loaded]
    if unexpected or missing:
        raise ValueError(f"Averaged weights do not fit the model: missing {missing}, unexpected {unexpected}.")
    logger.warning(f"Averaged {len(paths)} checkpoints: {[path.name for path in paths]}.")
    if save_to is not None:
        with_tokenizer = [path for path in reversed(paths) if (path / "tokenizer_config.json").is_file()]

        def write(staging: Path) -> None:
            settle_output_cap(model.generation_config)
            fingerprint = folder_tokenizer_fingerprint(with_tokenizer[0]) if with_tokenizer else None
            if fingerprint is not None:
                record_tokenizer_fingerprint(model.config, fingerprint)
            model.save_pretrained(staging)
            for name in TOKENIZER_FILES if with_tokenizer else ():
                if (with_tokenizer[0] / name).is_file():
                    shutil.copyfile(with_tokenizer[0] / name, staging / name)

        write_marked_folder(save_to, write, overwrite=overwrite, flag=AVERAGE_FLAG, protected=protected)
    return model
