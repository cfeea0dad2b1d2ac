"""Checks of what a user hands in at the public entry points, each failing with an error that names the bad value and
what would be valid: recipe values of the wrong type, unknown model overrides, local paths that do not exist, a
tokenizer that does not match the model."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any

from hf_deep_nmt.modeling.configuration_deep_nmt import describe_unknown_keys, unknown_config_keys


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether `value` (as read from JSON / YAML) fits `annotation`; unknown annotations accept anything."""
    if annotation is Any or annotation is typing.Any:
        return True
    if annotation is None or annotation is type(None):
        return value is None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(argument, value) for argument in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin is not None:  # list[int], dict[str, Any], ...: the container type only
        return isinstance(origin, type) and isinstance(value, origin)
    if not isinstance(annotation, type):
        return True
    if issubclass(annotation, enum.Enum):
        return isinstance(value, annotation) or value in {member.value for member in annotation}
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if annotation in (list, dict):
        return isinstance(value, annotation)
    return True


def check_recipe_values(values: dict[str, Any], classes: tuple, source: str) -> None:
    """Raise `ValueError` naming `source`, the key, the value and the expected type for the first recipe value whose
    type does not fit its argument (e.g. `"max_steps": "ten"`), which the argument dataclasses would otherwise take
    as is and fail on much later."""
    hints: dict[str, Any] = {}
    for cls in classes:
        try:
            resolved = typing.get_type_hints(cls)
        except Exception:  # an annotation that cannot be resolved is left unchecked
            resolved = {}
        for item in dataclasses.fields(cls):
            hints.setdefault(item.name, resolved.get(item.name, Any))
    for key, value in values.items():
        if key in hints and not _accepts(hints[key], value):
            expected = getattr(hints[key], "__name__", None) or str(hints[key]).replace("typing.", "")
            raise ValueError(f"{source}: `{key}` must be of type {expected}, got {value!r} ({type(value).__name__}).")


def check_config_overrides(config_class: type, overrides: dict[str, Any]) -> None:
    """Raise `ValueError` naming every key of `overrides` that is not a field of `config_class`: in a recipe a misspelt
    field is an error (the config itself only warns, since saved folders may hold such keys)."""
    if not isinstance(overrides, dict):
        raise ValueError(f"`model_overrides` must be a mapping of config fields to values, got {overrides!r}.")
    unknown = unknown_config_keys(config_class, overrides)
    if unknown:
        raise ValueError(
            f"`model_overrides` has keys that are not {config_class.__name__} fields: "
            f"{describe_unknown_keys(unknown)}; see the {config_class.__name__} documentation for the valid ones."
        )


def check_local_path(value: str | None, what: str) -> None:
    """`FileNotFoundError` naming `what` when `value` is written as a local path (absolute, `./`, `../`, `~`) that does
    not exist; anything else is left to `from_pretrained` as a Hub id."""
    if value is None:
        return
    text = str(value)
    if text.startswith(("/", "./", "../", "~", ".\\", "..\\")) and not Path(text).expanduser().exists():
        raise FileNotFoundError(f"{what} {text!r} does not exist (a local folder was given, not a Hub repository id).")


def check_tokenizer_matches(model, tokenizer) -> None:
    """`ValueError` when the tokenizer can produce ids the model has no embedding for, or when the two disagree on
    the padding / end-of-sentence ids (decoding would then stop or mask at the wrong token)."""
    config = model.config
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab}: ids "
            f"{vocab}..{len(tokenizer) - 1} have no embedding. Use the tokenizer saved with the model."
        )
    for name in ("pad_token_id", "eos_token_id"):
        tokenizer_id, model_id = getattr(tokenizer, name, None), getattr(config, name, None)
        agrees = tokenizer_id in model_id if isinstance(model_id, list) else tokenizer_id == model_id
        if tokenizer_id is not None and model_id is not None and not agrees:
            raise ValueError(
                f"The tokenizer's {name} ({tokenizer_id}) differs from the model's ({model_id}). Use the tokenizer "
                "saved with the model."
            )


# An output cap above this many tokens per sentence (max_length_a * max_source_length + max_length_b) is refused:
# no sentence of a translation corpus needs it, and decoding up to it would run for hours.
MAX_OUTPUT_TOKENS = 4096


def check_run_settings(data_args, export_args, training_args) -> None:
    """`ValueError` for a setting that would fail or give nonsense only after training (or at its end): naming the
    setting, its value and what is valid. Cheap: nothing is loaded or built."""
    problems = []

    def at_least_one(name: str, value) -> None:
        if value is not None and value < 1:
            problems.append(f"`{name}` must be >= 1, got {value}")

    at_least_one("num_beams", export_args.num_beams)
    at_least_one("max_eval_samples", data_args.max_eval_samples)
    at_least_one("per_device_eval_batch_size", training_args.per_device_eval_batch_size)
    at_least_one("per_device_train_batch_size", training_args.per_device_train_batch_size)
    at_least_one("gradient_accumulation_steps", training_args.gradient_accumulation_steps)
    at_least_one("eval_max_tokens", export_args.eval_max_tokens)
    at_least_one("max_source_length", data_args.max_source_length)
    at_least_one("max_target_length", data_args.max_target_length)
    for name in ("length_penalty", "max_length_a"):
        value = getattr(export_args, name)
        if not math.isfinite(value):
            problems.append(f"`{name}` must be a finite number, got {value}")
    if math.isfinite(export_args.max_length_a):
        if export_args.max_length_a < 0:
            problems.append(f"`max_length_a` must be >= 0, got {export_args.max_length_a}")
        cap = export_args.max_length_a * data_args.max_source_length + export_args.max_length_b
        if not 1 <= cap <= MAX_OUTPUT_TOKENS:
            problems.append(
                f"the output cap `max_length_a * max_source_length + max_length_b` = {export_args.max_length_a} * "
                f"{data_args.max_source_length} + {export_args.max_length_b} = {cap:g} tokens must be between 1 and "
                f"{MAX_OUTPUT_TOKENS}"
            )
    if not problems:  # the final evaluation's decoding options, as `translate` will check them after training
        from hf_deep_nmt.translate import check_translation_options

        try:
            check_translation_options(**evaluation_options(export_args, training_args))
        except ValueError as error:
            problems.append(str(error).rstrip("."))
    tokenizers = sacrebleu_tokenizers()
    if export_args.bleu_tokenize not in tokenizers:
        hint = difflib.get_close_matches(export_args.bleu_tokenize, tokenizers, n=1)
        problems.append(
            f"`bleu_tokenize` must be one of sacreBLEU's tokenizers {tokenizers}, got {export_args.bleu_tokenize!r}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "")
        )
    if problems:
        raise ValueError("; ".join(problems) + ".")


def evaluation_options(export_args, training_args) -> dict:
    """The decoding options of the final evaluation, for `translate` / `check_translation_options`: every validation
    line is translated (no source length limit), outputs capped at `MAX_OUTPUT_TOKENS`."""
    return dict(
        batch_size=training_args.per_device_eval_batch_size,
        num_beams=export_args.num_beams,
        length_penalty=export_args.length_penalty,
        length_penalty_form=export_args.length_penalty_form,
        max_length_a=export_args.max_length_a,
        max_length_b=export_args.max_length_b,
        max_tokens=export_args.eval_max_tokens,
        max_source_tokens=None,
        max_output_tokens=MAX_OUTPUT_TOKENS,
    )


def sacrebleu_tokenizers() -> list[str]:
    from sacrebleu.metrics.bleu import BLEU

    return list(BLEU.TOKENIZERS)


def check_run_folders(output_dir: str, export_dir: str | None, corpus_files: list[str]) -> dict[str, Path]:
    """Refuse an export folder that is the output folder, holds it, or is a corpus folder, and an output or export
    folder that cannot be written. Returns the folders an export must never replace (for `check_export_folder`)."""
    output = Path(output_dir).resolve()
    protected = {f"the training output_dir ({output_dir!r}), which holds the checkpoints": output}
    for corpus in corpus_files:
        protected[f"the folder of the corpus file {corpus!r}"] = Path(corpus).resolve().parent
    if export_dir:
        export = Path(export_dir).resolve()
        for description, folder in protected.items():
            if export == folder:
                raise ValueError(f"export_dir {export_dir!r} is {description}; give the export a folder of its own.")
        if export in output.parents:
            raise ValueError(
                f"output_dir {output_dir!r} is inside export_dir {export_dir!r}: an overwritten export would take the "
                "checkpoints with it; give the two separate folders."
            )
    from hf_deep_nmt.hub import check_writable_location

    check_writable_location(output_dir, "output_dir")
    return protected
