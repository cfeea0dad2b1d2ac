"""Whether a tokenizer is the one a model was made with: its fingerprint (a SHA-256 of what decides which ids a text
becomes and which text ids become), recorded in the model's config when it is exported, grown or averaged
(`tokenizer_fingerprint`), and checked with the vocabulary size and the padding / end-of-sentence ids before a command
uses the pair.

Fingerprints are versioned. Version 2 (`v2:<hex>`, written since 0.2.0) covers every part of a `tokenizer.json` that
changes token ids or the text they decode to: the model (vocabulary, merges and their options), normalizer,
pre-tokenizer, post-processor (the `</s>` appended to every source), decoder and added tokens. Version 1 (64 hex
digits, no prefix) left out the post-processor and the decoder; a config that records one is still checked, the old
way. Truncation and padding are not covered: transformers sets them on every call (a tokenizer used once with
`truncation=True` holds other values), so they never change the ids a command gets. A model without a fingerprint
(exported by 0.1.0, or by another tool) is checked on what can be compared, with a warning that says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

# the standard library's logger (what transformers' `get_logger` returns for this name): the ONNX Runtime backend
# checks its tokenizer's fingerprint here at every start, without importing transformers
logger = logging.getLogger(__name__)

TOKENIZER_FINGERPRINT_KEY = "tokenizer_fingerprint"
FINGERPRINT_VERSION = 2  # what this version writes

# what a tokenizer.json holds that decides which ids a text becomes (and, from version 2, which text ids become), by
# fingerprint version
_TOKENIZER_ESSENTIALS = {
    1: ("model", "normalizer", "pre_tokenizer", "added_tokens"),
    2: ("model", "normalizer", "pre_tokenizer", "post_processor", "decoder", "added_tokens"),
}
_FINGERPRINT = re.compile(r"(?:v(\d+):)?([0-9a-f]{64})")
_warned_unrecorded: set[str] = set()


def fingerprint_version(fingerprint: str) -> int | None:
    """The version of a recorded fingerprint (1: bare hex, N: `vN:` hex), None for a string that is not one."""
    match = _FINGERPRINT.fullmatch(fingerprint) if isinstance(fingerprint, str) else None
    if match is None:
        return None
    return int(match.group(1)) if match.group(1) is not None else 1


def _formatted(digest: str, version: int) -> str:
    return digest if version == 1 else f"v{version}:{digest}"


def tokenizer_json_fingerprint(data: dict, version: int = FINGERPRINT_VERSION) -> str:
    """The fingerprint (in format `version`) of a parsed `tokenizer.json`: a SHA-256 of its parts that change token
    ids (`_TOKENIZER_ESSENTIALS`)."""
    essentials = {key: data.get(key) for key in _TOKENIZER_ESSENTIALS[version]}
    digest = hashlib.sha256(json.dumps(essentials, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()
    return _formatted(digest, version)


def tokenizer_fingerprint(tokenizer, version: int = FINGERPRINT_VERSION) -> str:
    """The fingerprint of a loaded tokenizer: that of its `tokenizer.json` (`tokenizer_json_fingerprint`) for a fast
    tokenizer, else the SHA-256 of its vocabulary (tokens and ids, sorted)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return tokenizer_json_fingerprint(json.loads(backend.to_str()), version)
    vocabulary = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocabulary, ensure_ascii=False).encode("utf-8")).hexdigest()
    return _formatted(digest, version)


def _read_tokenizer_json(folder: str | Path) -> dict | None:
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{str(path)!r} cannot be read ({error}); restore the tokenizer saved with the model."
        ) from None


def folder_tokenizer_fingerprint(folder: str | Path, version: int = FINGERPRINT_VERSION) -> str | None:
    """The fingerprint of the `tokenizer.json` in `folder` (the file is read, no tokenizer built); None without one."""
    data = _read_tokenizer_json(folder)
    return None if data is None else tokenizer_json_fingerprint(data, version)


def first_tokenizer_difference(paths: Sequence[Path]) -> tuple[Path, Path] | None:
    """The first two of `paths` (model folders or checkpoints) whose tokenizers differ, by their `tokenizer.json` and
    the fingerprint their config records, each compared in the newest format both have (a config of version 1 is
    compared the old way); `(path, path)` when a folder's config disagrees with its own tokenizer; None when all
    agree."""
    seen: list[tuple[Path, dict[int, str]]] = []

    def differing(identity: dict[int, str]) -> Path | None:
        for earlier_path, earlier in seen:
            common = set(earlier) & set(identity)
            if common and earlier[max(common)] != identity[max(common)]:
                return earlier_path
        return None

    for path in paths:
        data = _read_tokenizer_json(path)
        identity = {} if data is None else {v: tokenizer_json_fingerprint(data, v) for v in _TOKENIZER_ESSENTIALS}
        config_file = Path(path) / "config.json"
        values = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        recorded = values.get(TOKENIZER_FINGERPRINT_KEY) if isinstance(values, dict) else None
        version = fingerprint_version(recorded)
        for candidate in (identity, {version: recorded} if version is not None else {}):
            earlier_path = differing(candidate)
            if earlier_path is not None:
                return earlier_path, path
        if version is not None and identity.get(version, recorded) != recorded:
            return path, path
        if version is not None:
            identity.setdefault(version, recorded)
        if identity:
            seen.append((path, identity))
    return None


def record_tokenizer_fingerprint(config, tokenizer) -> bool:
    """Store the fingerprint of `tokenizer` (a tokenizer, or a fingerprint already computed) in `config`
    (`tokenizer_fingerprint`), for `check_tokenizer_matches`, when the config class admits the key (a config class
    that does not would warn about an unknown key on every load). Returns whether it was stored."""
    from hf_deep_nmt.modeling.configuration_deep_nmt import (
        unknown_config_keys,  # transformers: a config's caller has it
    )

    if unknown_config_keys(type(config), [TOKENIZER_FINGERPRINT_KEY]):
        return False
    fingerprint = tokenizer if isinstance(tokenizer, str) else tokenizer_fingerprint(tokenizer)
    setattr(config, TOKENIZER_FINGERPRINT_KEY, fingerprint)
    return True


def check_tokenizer_matches(model, tokenizer) -> None:
    """`ValueError` when the tokenizer is not the one the model was exported with (the config's
    `tokenizer_fingerprint`, when it has one, compared in its own format), can produce ids the model has no embedding
    for, or disagrees with the model on the padding / end-of-sentence ids (decoding would then stop or mask at the
    wrong token). A loaded model without a fingerprint is compared on what can be compared (sizes and special ids,
    the start token too), with a warning that the tokenizer itself could not be checked."""
    config = model.config
    recorded = getattr(config, TOKENIZER_FINGERPRINT_KEY, None)
    if recorded is not None:
        version = fingerprint_version(recorded)
        if version is None:
            raise ValueError(
                f"The model's config records {TOKENIZER_FINGERPRINT_KEY} {str(recorded)[:80]!r}, which is not a "
                "tokenizer fingerprint (64 hex digits, or 'v2:' and 64 hex digits): restore the config.json saved "
                "with the model."
            )
        if version in _TOKENIZER_ESSENTIALS:
            actual = tokenizer_fingerprint(tokenizer, version)
            if actual != recorded:
                raise ValueError(
                    f"The tokenizer is not the one this model was exported with (its fingerprint is {actual[:19]}..., "
                    f"the model's config records {recorded[:19]}...): the same text would become other ids. Use the "
                    "tokenizer saved with the model."
                )
            if version < FINGERPRINT_VERSION:
                _warn_unchecked(
                    config,
                    f"records a tokenizer fingerprint of an earlier format (v{version}), which leaves out the "
                    "post-processor and the decoder: those were not checked. Exporting the model again with this "
                    "version records the full fingerprint",
                )
        else:
            _warn_unchecked(
                config,
                f"records a tokenizer fingerprint of format v{version}, newer than this hf-deep-nmt knows (v"
                f"{FINGERPRINT_VERSION}); upgrade hf-deep-nmt to check it",
            )
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab}: ids "
            f"{vocab}..{len(tokenizer) - 1} have no embedding. Use the tokenizer saved with the model."
        )
    names = ("pad_token_id", "eos_token_id")
    if recorded is None:
        names += ("bos_token_id",)  # without a fingerprint, the start token too: what the decoder is fed first
    for name in names:
        tokenizer_id, model_id = getattr(tokenizer, name, None), getattr(config, name, None)
        agrees = tokenizer_id in model_id if isinstance(model_id, list) else tokenizer_id == model_id
        if tokenizer_id is not None and model_id is not None and not agrees:
            raise ValueError(
                f"The tokenizer's {name} ({tokenizer_id}) differs from the model's ({model_id}). Use the tokenizer "
                "saved with the model."
            )
    if recorded is None:
        sizes = "" if vocab is None or len(tokenizer) == vocab else f" (the tokenizer has {len(tokenizer)} tokens)"
        _warn_unchecked(
            config,
            "records no tokenizer fingerprint (exported by hf-deep-nmt 0.1.0 or by another tool): only the vocabulary "
            f"size{sizes} and the special token ids were compared, not that the tokenizer is the one it was trained "
            "with. Use the tokenizer saved with the model; exporting it again with this version records the "
            "fingerprint",
        )


def _warn_unchecked(config, what: str) -> None:
    """Warn, once per model, that `what`: a model loaded from somewhere (a model built in this process, which has no
    name yet, is made with the tokenizer at hand)."""
    name = getattr(config, "_name_or_path", "") or ""
    if not name or name in _warned_unrecorded:
        return
    _warned_unrecorded.add(name)
    logger.warning(f"The model {name!r} {what}.")
