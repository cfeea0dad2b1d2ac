"""Whether a tokenizer is the one a model was made with: its fingerprint (a SHA-256 of what decides which ids a text
becomes), recorded in the model's config when it is exported, grown or averaged (`tokenizer_fingerprint`), and
checked with the vocabulary size and the padding / end-of-sentence ids before a command uses the pair."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hf_deep_nmt.modeling.configuration_deep_nmt import unknown_config_keys

TOKENIZER_FINGERPRINT_KEY = "tokenizer_fingerprint"


# what a tokenizer.json holds that decides which ids a text becomes (not its padding or truncation settings)
_TOKENIZER_ESSENTIALS = ("model", "normalizer", "pre_tokenizer", "added_tokens")


def tokenizer_json_fingerprint(data: dict) -> str:
    """SHA-256 (hex) of the essentials of a parsed `tokenizer.json`: vocabulary and merges, normalizer,
    pre-tokenizer, added tokens."""
    essentials = {key: data.get(key) for key in _TOKENIZER_ESSENTIALS}
    return hashlib.sha256(json.dumps(essentials, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """The fingerprint of a loaded tokenizer: that of its `tokenizer.json` (`tokenizer_json_fingerprint`) for a fast
    tokenizer, else the SHA-256 of its vocabulary (tokens and ids, sorted)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return tokenizer_json_fingerprint(json.loads(backend.to_str()))
    vocabulary = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocabulary, ensure_ascii=False).encode("utf-8")).hexdigest()


def folder_tokenizer_fingerprint(folder: str | Path) -> str | None:
    """The fingerprint of the `tokenizer.json` in `folder` (the file is read, no tokenizer built); None without one."""
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
    if unknown_config_keys(type(config), [TOKENIZER_FINGERPRINT_KEY]):
        return False
    fingerprint = tokenizer if isinstance(tokenizer, str) else tokenizer_fingerprint(tokenizer)
    setattr(config, TOKENIZER_FINGERPRINT_KEY, fingerprint)
    return True


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
