"""Checks of what a user hands in at the public entry points beyond the recipe's own values (those are in
`hf_deep_nmt.arguments`), each failing with an error that names the bad value and what would be valid: unknown model
overrides, local paths that do not exist, a tokenizer that does not match the model, output and export folders that
would overwrite each other or cannot be written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_deep_nmt.modeling.configuration_deep_nmt import describe_unknown_keys, unknown_config_keys


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


# A folder holds a tokenizer `AutoTokenizer` can load when it has one of these (a fast tokenizer's `tokenizer.json`;
# the `tokenizer_config.json` beside it, or beside SentencePiece files such as OPUS-MT's `source.spm`; the files of a
# slow tokenizer).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
)


def is_local_path(value: str) -> bool:
    """Whether `value` names a local path: written as one (absolute, `./`, `../`, `~`) or existing here. Anything
    else is a Hub id (`from_pretrained` also prefers an existing local folder to a repository of the same name)."""
    text = str(value)
    return text.startswith(("/", "./", "../", "~", ".\\", "..\\")) or Path(text).expanduser().exists()


def check_saved_model_folder(value: str, what: str, need_tokenizer: bool) -> Path | None:
    """`FileNotFoundError` naming `what` and `value` when a local model folder does not exist, is not a folder, has no
    `config.json`, or (`need_tokenizer`) no tokenizer files. Returns the folder; None for a Hub id (left to
    `from_pretrained`)."""
    if not is_local_path(value):
        return None
    folder = Path(str(value)).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"{what} {str(value)!r} does not exist (a local folder was given, not a Hub id).")
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} {str(value)!r} is a file, not a saved model folder.")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{what} {str(value)!r} has no config.json: it is not a saved model folder (save one with "
            "`save_pretrained`, or convert a Marian model with `hf-deep-nmt convert-marian`)."
        )
    if need_tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{what} {str(value)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the model's "
            "tokenizer into it (`tokenizer.save_pretrained`), or name it with `tokenizer_name_or_path`."
        )
    return folder


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
    from hf_deep_nmt.folders import check_writable_location

    check_writable_location(output_dir, "output_dir")
    return protected
