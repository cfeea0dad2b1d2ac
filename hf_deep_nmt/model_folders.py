"""Model folders that a command is about to load, checked before anything is loaded, each failure naming the value
and what would be valid: a local path that does not exist, a file, a folder without `config.json` or tokenizer files,
a Hub id that is none (or, offline, not in the cache), a folder without the model code a Hub folder carries, and JSON
files of a saved folder that transformers would fail on without naming them.

The heavy libraries (transformers, tokenizers, huggingface_hub, the model classes) are imported inside the checks that
need them: a command refused on a missing folder stops before any of them is imported."""

from __future__ import annotations

import json
import re
from pathlib import Path

# The model code an exported folder carries. Folders of 0.1.0 have the first two only, folders exported before the
# transformers contract left the model file lack the fourth, and those exported before the size arithmetic left it the
# fifth: `hf-deep-nmt upgrade-code` installs what a folder lacks.
CODE_FILES = (
    "configuration_deep_nmt.py",
    "modeling_deep_nmt.py",
    "kernels_deep_nmt.py",
    "contract_deep_nmt.py",
    "sizes_deep_nmt.py",
)
REQUIRED_CODE_FILES = CODE_FILES[:2]  # what makes a folder one with model code to upgrade


# How a name is written when it is a local path, not a Hub repository id.
_LOCAL_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def check_local_path(value: str | None, what: str) -> None:
    """`FileNotFoundError` naming `what` when `value` is written as a local path (absolute, `./`, `../`, `~`) that does
    not exist, or is neither a local path nor a Hub id (`check_model_name`); anything else is left to
    `from_pretrained` as a Hub id."""
    if value is None:
        return
    check_model_name(value, what, check_hub_id=False)


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


_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def check_model_folder(
    value: str | Path,
    what: str = "Model folder",
    *,
    tokenizer: bool = False,
    own_code: bool = False,
    hub_ids: bool = True,
    check_hub_id: bool = False,
    config_hint: str = "name the exported folder, or a checkpoint-<step> folder",
    tokenizer_hint: str = "copy the tokenizer saved with the model into it",
) -> Path | None:
    """The one check of a model folder that a command is about to load, before anything is loaded: the folder (a
    `Path`), or None for a Hub id (left to `from_pretrained`). Each failure names `what` and `value`:

    * a path that does not exist (`FileNotFoundError`): with `hub_ids`, only one written as a local path (absolute,
      `./`, `../`, `~`); any other name is a Hub id, which must look like one and, in offline mode, be in the local
      cache when `check_hub_id`; without, any name (`config_hint` saying what to name instead);
    * a file (`NotADirectoryError`), a folder without `config.json` (`FileNotFoundError`, `config_hint` saying what
      to name instead);
    * `tokenizer`: a folder without tokenizer files (`TOKENIZER_FILES`; `tokenizer_hint` saying the way out);
    * `own_code`: a `config.json` that is not JSON, or not of a model of this package, or a folder without the model
      code a Hub folder carries (`ValueError`): what `upgrade-code` mends.

    Marian folders are checked with neither `tokenizer` nor `own_code` (their config's model type is read by
    `hf_deep_nmt.tools.marian`, for Hub ids too)."""
    text = str(value)
    folder = Path(text).expanduser()
    if not folder.exists():
        if not hub_ids:
            raise FileNotFoundError(f"{what} {text!r} does not exist ({config_hint}).")
        return check_model_name(text, what, check_hub_id=check_hub_id, hint=f" ({config_hint})")
    if not folder.is_dir():
        raise NotADirectoryError(f"{what} {text!r} is a file; name the model folder (the one holding config.json).")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{what} {text!r} has no config.json: it is not a saved model folder ({config_hint}).")
    if tokenizer and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{what} {text!r} holds no tokenizer: it has no tokenizer files (expected tokenizer.json and "
            f"tokenizer_config.json, as an export or `tokenizer.save_pretrained` writes them); {tokenizer_hint}."
        )
    if own_code:
        _check_own_code(folder, what, text)
    return folder


def check_model_name(
    value: str | Path, what: str = "Model folder", *, check_hub_id: bool = True, hint: str = ""
) -> Path | None:
    """The local path `value` names when it exists, else None for a Hub repository id, checked before any Hub lookup:
    `FileNotFoundError` naming `what` for a name written as a local path (absolute, `./`, `../`, `~`) that does not
    exist, a name that is no Hub id either (`runs/a/b`), and, with `check_hub_id` in offline mode, a repository
    that is not in the local cache. The one answer of every command to a model name that names nothing."""
    text = str(value)
    folder = Path(text).expanduser()
    if folder.exists():
        return folder
    if text.startswith(_LOCAL_PREFIXES):
        raise FileNotFoundError(
            f"{what} {text!r} does not exist (a local folder was given, not a Hub repository id); check the "
            f"path{hint}."
        )
    if check_hub_id or not _HUB_ID.fullmatch(text):
        _check_hub_id(text, folder, what.removesuffix(" folder"))
    return None


def _check_hub_id(text: str, folder: Path, what: str = "Model") -> None:
    from huggingface_hub import constants, try_to_load_from_cache  # here, not at start-up: a Hub id is rare

    where = f"no such folder: {folder.absolute()}"
    if not _HUB_ID.fullmatch(text):
        raise FileNotFoundError(f"{what} {text!r} is neither a local folder ({where}) nor a Hub repository id.")
    if constants.is_offline_mode() and not isinstance(try_to_load_from_cache(text, "config.json"), str):
        raise FileNotFoundError(
            f"{what} {text!r} is not a local folder ({where}), and in offline mode (HF_HUB_OFFLINE is set) it is "
            "not a Hub repository in the local cache; give the folder's path, or unset HF_HUB_OFFLINE to download."
        )


def _check_own_code(folder: Path, what: str, text: str) -> None:
    from hf_deep_nmt import MODEL_CLASSES  # here, not at start-up: the model classes import torch and transformers

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON ({error}).") from None
    model_types = sorted(config_class.model_type for config_class in MODEL_CLASSES)
    if not isinstance(config, dict) or config.get("model_type") not in model_types:
        found = config.get("model_type") if isinstance(config, dict) else None
        raise ValueError(
            f"{folder / 'config.json'} has model_type {found!r}, not one of hf-deep-nmt's ({', '.join(model_types)}); "
            "name a folder this package exported."
        )
    missing = [name for name in REQUIRED_CODE_FILES if not (folder / name).is_file()]
    if missing or "auto_map" not in config:
        raise ValueError(
            f"{what} {text!r} holds no model code ({', '.join(missing) or 'no auto_map in config.json'}): it loads "
            "through the installed package, so there is nothing to upgrade; `export_hub_folder` writes a folder with "
            "its code."
        )


def check_saved_model_folder(value: str, what: str, need_tokenizer: bool) -> Path | None:
    """`check_model_folder` as a training run checks the saved model it starts from (`need_tokenizer`: unless
    `tokenizer_name_or_path` names another tokenizer)."""
    return check_model_folder(
        value,
        what,
        tokenizer=need_tokenizer,
        config_hint="save one with `save_pretrained`, or convert a Marian model with `hf-deep-nmt convert-marian`",
        tokenizer_hint="save the model's tokenizer into it (`tokenizer.save_pretrained`), or name it with "
        "`tokenizer_name_or_path`",
    )


# Files of a saved model folder that transformers reads as JSON objects; a damaged one fails inside transformers
# with a message that names neither the file nor the way out.
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SAVED_JSON_FILES = ("config.json", "generation_config.json", *TOKENIZER_JSON_FILES)


def check_saved_json_files(
    folder: str | Path,
    what: str = "Model folder",
    way_out: str = "restore it from the exported folder (or save the model and tokenizer again)",
    names: tuple[str, ...] = SAVED_JSON_FILES,
) -> None:
    """`ValueError` naming the file, what is wrong with it and the way out when one of `names` in the local `folder`
    is not a JSON object (cut off, a list, not JSON), or its `tokenizer.json` is JSON but not a tokenizer that
    `tokenizers` can build. A folder that does not exist (a Hub id) is left alone. `TOKENIZER_JSON_FILES` checks a
    folder whose `config.json` is another tool's (a CTranslate2 model's)."""
    folder = Path(str(folder)).expanduser()
    if not folder.is_dir():
        return
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{what} {str(folder)!r}: {name} is not UTF-8 text ({error.reason} at byte {error.start}); {way_out}."
            ) from None
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{what} {str(folder)!r}: {name} is not valid JSON ({error.msg}: line {error.lineno} column "
                f"{error.colno} of {path.stat().st_size} bytes; cut off, or edited by hand?); {way_out}."
            ) from None
        except RecursionError:
            raise ValueError(f"{what} {str(folder)!r}: {name} is nested too deeply to parse; {way_out}.") from None
        if not isinstance(value, dict):
            raise ValueError(
                f"{what} {str(folder)!r}: {name} holds a JSON {type(value).__name__}, not the object of settings it "
                f"should; {way_out}."
            )
        if name == "config.json" and "auto_map" not in value:
            _check_model_type(value.get("model_type"), f"{what} {str(folder)!r}: config.json", way_out)
        if name == "config.json":
            _check_dtype(value, f"{what} {str(folder)!r}: config.json", way_out)
    path = folder / "tokenizer.json"
    if "tokenizer.json" in names and path.is_file():
        from tokenizers import Tokenizer  # here, not at start-up: only a folder with a tokenizer needs it

        try:
            Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises its own exception type, with serde's message
            raise ValueError(
                f"{what} {str(folder)!r}: tokenizer.json is JSON but not a tokenizer ({' '.join(str(error).split())})"
                f"; {way_out}."
            ) from None


def _check_dtype(values: dict, where: str, way_out: str) -> None:
    """`ValueError` naming the field for a config's `dtype` / `torch_dtype` that torch does not know (transformers
    would fail on `getattr(torch, ...)` with no file named)."""
    import torch

    for field in ("dtype", "torch_dtype"):
        value = values.get(field)
        if value is None or value == "auto":
            continue
        known = isinstance(value, str) and isinstance(getattr(torch, value.removeprefix("torch."), None), torch.dtype)
        if not known:
            raise ValueError(f"{where}: `{field}` {value!r} is not a torch dtype (e.g. 'float32'); {way_out}.")


def _check_model_type(model_type, where: str, way_out: str) -> None:
    """`ValueError` when a config's `model_type` is missing or one that neither this package nor transformers
    registers (transformers would advise upgrading itself)."""
    # here, not at start-up: transformers and the model classes are heavy, and only a config.json needs them
    from transformers import CONFIG_MAPPING

    from hf_deep_nmt import MODEL_CLASSES  # the package registers its model types before they are read

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    ours = ", ".join(sorted(config_class.model_type for config_class in MODEL_CLASSES))
    if model_type is None:
        raise ValueError(f"{where} has no `model_type` (this package's are {ours}); {way_out}.")
    raise ValueError(
        f"{where} names `model_type` {model_type!r}, which neither this package ({ours}) nor transformers knows; "
        f"{way_out}."
    )


def check_saved_weights_finite(folder: str | Path, what: str = "Model folder") -> None:
    """`ValueError` naming `folder`, the weight file and the first tensor that holds a NaN or an infinite value, read
    from the folder's safetensors files one tensor at a time (nothing is built): a model that starts a training run
    with such a weight makes every loss NaN, and the run would skip step after step and blame the learning rate. A
    folder without safetensors weights, or a Hub id, is left to the checks after loading."""
    import torch  # here, not at start-up: only a saved model to start from needs it
    from safetensors import safe_open

    from hf_deep_nmt.weights import safetensors_header, saved_weight_files

    local = Path(str(folder)).expanduser()
    if not local.is_dir():
        return
    for path in saved_weight_files(local):
        safetensors_header(path)  # a cut-off file is named as such, not as an error of the library
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():
                tensor = weights.get_tensor(name)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    kind = "NaN" if bool(torch.isnan(tensor).any()) else "infinite"
                    raise ValueError(
                        f"{what} {str(folder)!r} holds {kind} weights (the first: {name} in {path.name}); a run "
                        "started from it trains on NaN losses. Start from an earlier checkpoint of the model, or "
                        "from a fresh preset (`model_type`)."
                    )
