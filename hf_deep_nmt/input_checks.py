"""Checks of what a user hands in at the public entry points beyond the recipe's own values (those are in
`hf_deep_nmt.arguments`), each failing with an error that names the bad value and what would be valid: unknown model
overrides, local paths that do not exist, a tokenizer that does not match the model (its ids, or its fingerprint),
output and export folders that would overwrite each other or cannot be written; and sizes and weights: a config
claiming more than its weights, a model or a decoding beyond the memory (checked before anything is allocated), NaN,
infinite or missing weights (after loading)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

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


# How a name is written when it is a local path, not a Hub repository id.
_LOCAL_PREFIXES = ("/", "./", "../", "~", ".\\", "..\\")


def check_local_path(value: str | None, what: str) -> None:
    """`FileNotFoundError` naming `what` when `value` is written as a local path (absolute, `./`, `../`, `~`) that does
    not exist; anything else is left to `from_pretrained` as a Hub id."""
    if value is None:
        return
    text = str(value)
    if text.startswith(_LOCAL_PREFIXES) and not Path(text).expanduser().exists():
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
    return text.startswith(_LOCAL_PREFIXES) or Path(text).expanduser().exists()


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
    `hf_deep_nmt.marian`, for Hub ids too)."""
    text = str(value)
    folder = Path(text).expanduser()
    if not folder.exists():
        if not hub_ids:
            raise FileNotFoundError(f"{what} {text!r} does not exist ({config_hint}).")
        if text.startswith(_LOCAL_PREFIXES):
            raise FileNotFoundError(
                f"{what} {text!r} does not exist (a local folder was given, not a Hub repository id)."
            )
        if check_hub_id:
            _check_hub_id(text, folder)
        return None
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


def _check_hub_id(text: str, folder: Path) -> None:
    from huggingface_hub import constants, try_to_load_from_cache

    where = f"no such folder: {folder.absolute()}"
    if not _HUB_ID.fullmatch(text):
        raise FileNotFoundError(f"Model {text!r} is neither a local folder ({where}) nor a Hub repository id.")
    if constants.is_offline_mode() and not isinstance(try_to_load_from_cache(text, "config.json"), str):
        raise FileNotFoundError(
            f"Model {text!r} is not a local folder ({where}), and in offline mode (HF_HUB_OFFLINE is set) it is "
            "not a Hub repository in the local cache; give the folder's path, or unset HF_HUB_OFFLINE to download."
        )


def _check_own_code(folder: Path, what: str, text: str) -> None:
    from hf_deep_nmt import MODEL_CLASSES
    from hf_deep_nmt.upgrade_code import REQUIRED_CODE_FILES

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


def check_tokenizer_matches(model, tokenizer) -> None:
    """`ValueError` when the tokenizer is not the one the model was exported with (the config's
    `tokenizer_fingerprint`, when it has one), can produce ids the model has no embedding for, or disagrees with the
    model on the padding / end-of-sentence ids (decoding would then stop or mask at the wrong token)."""
    config = model.config
    recorded = getattr(config, TOKENIZER_FINGERPRINT_KEY, None)
    if isinstance(recorded, str):
        actual = tokenizer_fingerprint(tokenizer)
        if actual != recorded:
            raise ValueError(
                f"The tokenizer is not the one this model was exported with (its fingerprint is {actual[:16]}..., "
                f"the model's config records {recorded[:16]}...): the same text would become other ids. Use the "
                "tokenizer saved with the model."
            )
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


# ---- sizes and weights: checked before anything is allocated, and after loading -------------------------------------

GIB = 1 << 30
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
_SAFETENSORS_DTYPE_BYTES.update({"I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1})


def describe_bytes(size: float) -> str:
    """`1.5 GiB`, `12.0 MiB`: a size for a message."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 1024:.1f} KiB"


def estimate_parameters(config) -> int:
    """A lower bound of the parameters of a model of this package with `config`, from its sizes alone (nothing is
    built): embeddings, output layer, attention and feed-forward matrices with their biases, LayerNorms. What it
    leaves out (DLCL weights, MSC contexts, relative keys, the AAN's gates) only adds to the real count."""
    d = int(config.d_model)
    vocab = int(config.vocab_size)
    decoder_vocab = int(getattr(config, "decoder_vocab_size", None) or vocab)
    total = vocab * d + (4 * d if getattr(config, "pre_norm", True) else 0)  # pre-norm: each stack's last LayerNorm
    if not getattr(config, "share_embeddings", True):
        total += decoder_vocab * d
    if not getattr(config, "tie_word_embeddings", True):
        total += decoder_vocab * d
    attention = 4 * d * d + 4 * d
    encoder_ffn, decoder_ffn = int(config.encoder_ffn_dim), int(config.decoder_ffn_dim)
    encoder_layer = attention + 2 * d * encoder_ffn + encoder_ffn + d + 4 * d
    # MAtt merges the self-attention into the cross-attention's matrices, the AAN replaces it: counted for multi-head
    multi_head = getattr(config, "decoder_self_attention", "multi_head") == "multi_head"
    self_attention = attention + 2 * d if multi_head else 0  # with its LayerNorm
    decoder_layer = self_attention + attention + 2 * d * decoder_ffn + decoder_ffn + d + 4 * d
    return total + int(config.encoder_layers) * encoder_layer + int(config.decoder_layers) * decoder_layer


def safetensors_header(path: str | Path) -> dict:
    """The JSON header of the safetensors file `path` (tensor names to dtype, shape, offsets); only the header is
    read. `ValueError` naming the file when it is not a safetensors file."""
    import json
    import struct

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
    return header


def saved_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a saved model folder (one, or the shards its index names)."""
    import json

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


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes this process can still allocate on `device`: on a GPU what the driver reports free (plus what torch's
    cache holds unused); on the CPU the kernel's MemAvailable, lowered to what the address-space limit of this process
    (`ulimit -v`, RLIMIT_AS) leaves. None when it cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
            limits.append(max(soft - used, 0))
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else None


class InsufficientMemoryError(ValueError):
    """What was asked needs more memory than the machine has: refused, with the estimate, before any allocation."""


def check_memory(needed: int, what: str, way_out: str, device: str | torch.device = "cpu") -> None:
    """`InsufficientMemoryError` stating `what` needs about `needed` bytes when `device` has less available (see
    `available_memory`), before anything is allocated; `way_out` says what to change."""
    available = available_memory(device)
    if available is not None and needed > available:
        raise InsufficientMemoryError(
            f"{what} needs about {describe_bytes(needed)} ({needed:,} bytes), but only {describe_bytes(available)} "
            f"is available on {device}; {way_out}."
        )


def training_memory(config, batch_tokens: int) -> int:
    """Bytes a training step of a model with `config` holds at least, in float32, for batches of `batch_tokens`
    (padded) source and as many target tokens: weights, gradients and the two Adam moments (4 copies of
    `estimate_parameters`), and the activations each layer keeps for the backward pass (per token, about 8 vectors of
    `d_model` and 2 of the FFN width in an encoder layer, 12 and 2 in a decoder layer). A lower bound, for refusing a
    run that cannot fit before anything is built."""
    d = int(config.d_model)
    encoder = int(config.encoder_layers) * (8 * d + 2 * int(config.encoder_ffn_dim))
    decoder = int(config.decoder_layers) * (12 * d + 2 * int(config.decoder_ffn_dim))
    return 4 * (4 * estimate_parameters(config) + batch_tokens * (encoder + decoder))


def check_training_size(config, batch_tokens: int, device: str | torch.device = "cpu") -> None:
    """`InsufficientMemoryError` stating the estimate (`training_memory`) when a training step cannot fit `device`,
    or the model cannot even be built in the CPU's memory, before the model is built (10^6 layers would otherwise be
    built for minutes, and then fail)."""
    sizes = ", ".join(f"{name}={getattr(config, name)}" for name in ("d_model", "encoder_layers", "decoder_layers"))
    check_memory(
        4 * estimate_parameters(config),
        f"Building the model ({estimate_parameters(config):,} parameters or more: {sizes})",
        "make the model smaller (`model_overrides`)",
    )
    check_memory(
        training_memory(config, batch_tokens),
        f"Training the model ({sizes}) on batches of {batch_tokens} tokens (weights, gradients, Adam moments and "
        "activations)",
        "make the model or the batches smaller (`model_overrides`, `max_tokens` or `per_device_train_batch_size`)",
        device,
    )


def check_saved_model_size(folder: str | Path, device: str | torch.device = "cpu") -> None:
    """Before a saved model is built: its config's parameters (`estimate_parameters`) must be no more than the
    safetensors headers of the folder hold, give or take 10% (a config.json that does not belong to the weights, e.g.
    a wider `d_model`, would otherwise allocate its model before the shapes are compared), and the model must fit the
    memory of the CPU, where it is loaded, and of `device` (float32: 4 bytes a parameter). Reads `config.json` and the
    headers only."""
    import json

    folder = Path(folder)
    config_file = folder / "config.json"
    try:
        values = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # `from_pretrained` reports an unreadable config itself
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(**values) if "model_type" in values else None
    except (ValueError, KeyError, TypeError):
        return  # an invalid config is refused by the config's own checks when loaded
    if config is None or not hasattr(config, "encoder_ffn_dim"):
        return
    estimate = estimate_parameters(config)
    saved = saved_parameters(folder)
    # a margin for weights left out of the file (those are named after loading, `check_missing_weights`)
    if saved is not None and estimate > 1.1 * saved[0]:
        sizes = ", ".join(
            f"{name}={getattr(config, name)}"
            for name in ("d_model", "encoder_layers", "decoder_layers", "encoder_ffn_dim", "vocab_size")
        )
        raise ValueError(
            f"{str(config_file)!r} describes a model of at least {estimate:,} parameters ({sizes}), but its weights "
            f"({', '.join(path.name for path in saved_weight_files(folder))}) hold {saved[0]:,}: the config does not "
            "belong to these weights. Restore the config.json saved with them."
        )
    # loaded into the CPU's memory first, then moved to `device`
    for place in dict.fromkeys(["cpu", str(device)]):
        check_memory(
            4 * max(estimate, saved[0] if saved else 0),
            f"The model of {str(folder)!r} ({estimate:,} parameters or more, float32)",
            "use a machine or device with more memory",
            place,
        )


def nonfinite_parameters(model) -> list[str]:
    """Names of the parameters and buffers of `model` holding a NaN or an infinite value (tensors without data, on
    the meta device, are skipped)."""
    import itertools

    return [
        name
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
        if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all())
    ]


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


def warn_nonfinite_weights(model, source: str) -> None:
    """A warning naming the non-finite weights of a model just loaded (what `from_pretrained` of this package's
    models does: the API warns where the commands refuse)."""
    from transformers.utils import logging

    bad = nonfinite_parameters(model)
    if bad:
        logging.get_logger("hf_deep_nmt").warning(
            f"The weights of {source!r} hold NaN or infinite values ({', '.join(bad[:5])}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            + "): its outputs will be NaN or empty."
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


def install_load_warning(model_class: type) -> None:
    """Make `model_class.from_pretrained` (and its subclasses') warn about NaN or infinite weights in what it loaded
    (`warn_nonfinite_weights`), once per class; the commands refuse such a model instead (`check_finite_weights`)."""
    import functools

    if model_class.__dict__.get("_hf_deep_nmt_warns_nonfinite"):
        return
    inherited = model_class.from_pretrained.__func__

    @functools.wraps(inherited)
    def from_pretrained(cls, *args, **kwargs):
        loaded = inherited(cls, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        warn_nonfinite_weights(model, str(source))
        return loaded

    model_class.from_pretrained = classmethod(from_pretrained)
    model_class._hf_deep_nmt_warns_nonfinite = True


# ---- tokenizer fingerprints -----------------------------------------------------------------------------------------

TOKENIZER_FINGERPRINT_KEY = "tokenizer_fingerprint"
# what a tokenizer.json holds that decides which ids a text becomes (not its padding or truncation settings)
_TOKENIZER_ESSENTIALS = ("model", "normalizer", "pre_tokenizer", "added_tokens")


def tokenizer_json_fingerprint(data: dict) -> str:
    """SHA-256 (hex) of the essentials of a parsed `tokenizer.json`: vocabulary and merges, normalizer,
    pre-tokenizer, added tokens."""
    import hashlib
    import json

    essentials = {key: data.get(key) for key in _TOKENIZER_ESSENTIALS}
    return hashlib.sha256(json.dumps(essentials, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """The fingerprint of a loaded tokenizer: that of its `tokenizer.json` (`tokenizer_json_fingerprint`) for a fast
    tokenizer, else the SHA-256 of its vocabulary (tokens and ids, sorted)."""
    import hashlib
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return tokenizer_json_fingerprint(json.loads(backend.to_str()))
    vocabulary = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocabulary, ensure_ascii=False).encode("utf-8")).hexdigest()


def folder_tokenizer_fingerprint(folder: str | Path) -> str | None:
    """The fingerprint of the `tokenizer.json` in `folder` (the file is read, no tokenizer built); None without one."""
    import json

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return tokenizer_json_fingerprint(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{str(path)!r} cannot be read ({error}); restore the tokenizer saved with the model."
        ) from None


def record_tokenizer_fingerprint(config, tokenizer) -> bool:
    """Store the fingerprint of `tokenizer` (a tokenizer, or a fingerprint already computed) in `config`
    (`tokenizer_fingerprint`), for `check_tokenizer_matches`, when the config class admits the key (a config class
    that does not would warn about an unknown key on every load). Returns whether it was stored."""
    from hf_deep_nmt.modeling.configuration_deep_nmt import unknown_config_keys

    if unknown_config_keys(type(config), [TOKENIZER_FINGERPRINT_KEY]):
        return False
    fingerprint = tokenizer if isinstance(tokenizer, str) else tokenizer_fingerprint(tokenizer)
    setattr(config, TOKENIZER_FINGERPRINT_KEY, fingerprint)
    return True


# Files of a saved model folder that transformers reads as JSON objects; a damaged one fails inside transformers
# with a message that names neither the file nor the way out.
SAVED_JSON_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def check_saved_json_files(
    folder: str | Path,
    what: str = "Model folder",
    way_out: str = "restore it from the exported folder (or save the model and tokenizer again)",
) -> None:
    """`ValueError` naming the file, what is wrong with it and the way out when one of `SAVED_JSON_FILES` in the
    local `folder` is not a JSON object (cut off, a list, not JSON), or its `tokenizer.json` is JSON but not a
    tokenizer that `tokenizers` can build. A folder that does not exist (a Hub id) is left alone."""
    import json

    folder = Path(str(folder)).expanduser()
    if not folder.is_dir():
        return
    for name in SAVED_JSON_FILES:
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
        if not isinstance(value, dict):
            raise ValueError(
                f"{what} {str(folder)!r}: {name} holds a JSON {type(value).__name__}, not the object of settings it "
                f"should; {way_out}."
            )
        if name == "config.json" and "auto_map" not in value:
            _check_model_type(value.get("model_type"), f"{what} {str(folder)!r}: config.json", way_out)
    path = folder / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises its own exception type, with serde's message
            raise ValueError(
                f"{what} {str(folder)!r}: tokenizer.json is JSON but not a tokenizer ({' '.join(str(error).split())})"
                f"; {way_out}."
            ) from None


def _check_model_type(model_type, where: str, way_out: str) -> None:
    """`ValueError` when a config's `model_type` is missing or one that neither this package nor transformers
    registers (transformers would advise upgrading itself)."""
    from transformers import CONFIG_MAPPING

    from hf_deep_nmt import MODEL_CLASSES  # importing the package registers its model types

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    ours = ", ".join(sorted(config_class.model_type for config_class in MODEL_CLASSES))
    if model_type is None:
        raise ValueError(f"{where} has no `model_type` (this package's are {ours}); {way_out}.")
    raise ValueError(
        f"{where} names `model_type` {model_type!r}, which neither this package ({ours}) nor transformers knows; "
        f"{way_out}."
    )
