"""The tokenizer of a folder of exported graphs without transformers: `PlainTokenizer`, over `tokenizers.Tokenizer`.

The ONNX Runtime and CTranslate2 backends need of their tokenizer only what the translate loop, the server and
their decoders call (text to ids with the special tokens, right padding into numpy arrays, ids to text without the
special tokens, ids to token strings and back, the padding and end ids); importing transformers for that costs
seconds and hundreds of megabytes at every start. `load_tokenizer` reads a folder's `tokenizer.json` into a
`PlainTokenizer` where the folder's `tokenizer_config.json` asks for nothing transformers would do beyond the
`tokenizers` library's own encoding and decoding, and returns `AutoTokenizer.from_pretrained(folder)` otherwise: a
setting it does not reproduce never gives other ids or text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# The tokenizer classes whose encoding and decoding are the `tokenizers` library's own, untouched (transformers 5
# writes `TokenizersBackend`).
PLAIN_CLASSES = ("TokenizersBackend",)
# The special tokens a tokenizer_config.json may name: each must be a special added token of tokenizer.json already,
# else transformers would add it (a new id) when it loads the folder.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Settings that leave the ids and text alone (bookkeeping, and the length beyond which transformers only warns), and
# those that do nothing at the value given here.
IGNORED_SETTINGS = frozenset({"tokenizer_class", "backend", "is_local", "local_files_only", "model_max_length"})
HARMLESS_VALUES = {
    "clean_up_tokenization_spaces": (False,),
    "padding_side": ("right",),
    "truncation_side": ("right", "left"),  # nothing is truncated
    "split_special_tokens": (False,),
    "model_input_names": (["input_ids", "attention_mask"],),
    # a tokenizer once called with padding or truncation saves the call's settings; unset, they change nothing
    "max_length": (None,),
    "pad_to_multiple_of": (None,),
    "pad_token_type_id": (0,),
}


def plain_reason(folder: str | Path) -> str | None:
    """Why the tokenizer of `folder` cannot be a `PlainTokenizer` (a few words), None when it can."""
    folder = Path(folder)
    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"no readable tokenizer_config.json and tokenizer.json ({type(error).__name__})"
    if not isinstance(settings, dict) or not isinstance(data, dict):
        return "not a tokenizer's files"
    if settings.get("tokenizer_class") not in PLAIN_CLASSES:
        return f"tokenizer_class {settings.get('tokenizer_class')!r}"
    special = {token.get("content") for token in data.get("added_tokens") or () if token.get("special")}
    for key, value in settings.items():
        if key in SPECIAL_TOKENS:
            if value is not None and value not in special:
                return f"{key} {value!r} is no special token of tokenizer.json"
        elif key not in IGNORED_SETTINGS and value not in HARMLESS_VALUES.get(key, ()):
            return f"the setting {key}={value!r}"
    for key in ("eos_token", "pad_token"):
        if settings.get(key) is None:
            return f"no {key}"
    return None


def load_tokenizer(folder: str | Path):
    """The tokenizer of `folder`: a `PlainTokenizer` where `plain_reason` finds nothing against it, else
    transformers' `AutoTokenizer.from_pretrained(folder)`."""
    if plain_reason(folder) is None:
        return PlainTokenizer(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class PlainTokenizer:
    """What the translate loop, `OnnxDecoder`, `CTranslate2Decoder` and the server call of a transformers tokenizer,
    with the same ids and text as `AutoTokenizer.from_pretrained(folder)` for a folder `plain_reason` accepts: calling
    it on a text (or a list of texts; special tokens added), `pad` (right padding, numpy), `decode` and `batch_decode`,
    token strings to ids and back, the special tokens and their ids."""

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.backend_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        # the truncation and padding a tokenizer.json may have been saved with: transformers turns both off for every
        # call that neither pads nor truncates, as every call here is (`pad` pads apart)
        self.backend_tokenizer.no_truncation()
        self.backend_tokenizer.no_padding()
        self.name_or_path = str(folder)
        for key in SPECIAL_TOKENS:
            token = settings.get(key)
            setattr(self, key, token)
            setattr(self, f"{key}_id", None if token is None else self.backend_tokenizer.token_to_id(token))
        self.padding_side = "right"

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str | Sequence[str], *, padding: bool = False, return_tensors=None, verbose=True):
        """{"input_ids", "attention_mask"} of `text` (lists; for a list of texts, one list each), the special tokens
        added; `padding=True` with `return_tensors="np"`: padded as `pad` pads. `verbose` is accepted for the calls
        written for transformers (nothing is truncated here, so there is nothing to warn of)."""
        single = isinstance(text, str)
        encodings = self.backend_tokenizer.encode_batch([text] if single else list(text), add_special_tokens=True)
        ids = [encoding.ids for encoding in encodings]
        if padding or return_tensors is not None:
            if single or not padding or return_tensors != "np":
                raise ValueError("PlainTokenizer pads a list of texts into numpy arrays only (`return_tensors='np'`).")
            return self.pad({"input_ids": ids}, return_tensors="np")
        masks = [[1] * len(row) for row in ids]
        return (
            {"input_ids": ids[0], "attention_mask": masks[0]}
            if single
            else {"input_ids": ids, "attention_mask": masks}
        )

    def pad(self, encoded: dict, return_tensors: str = "np") -> dict[str, np.ndarray]:
        """`encoded["input_ids"]` (lists of ids) padded on the right to the longest with the padding id, and the
        attention mask, as int64 arrays."""
        if return_tensors != "np":
            raise ValueError(
                f"PlainTokenizer pads into numpy arrays only (`return_tensors='np'`), not {return_tensors!r}."
            )
        rows = encoded["input_ids"]
        longest = max((len(row) for row in rows), default=0)
        ids = np.full((len(rows), longest), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), longest), dtype=np.int64)
        for index, row in enumerate(rows):
            ids[index, : len(row)] = row
            mask[index, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The token string of each id (what CTranslate2 is given), as transformers' fast tokenizers give it."""
        return [self.backend_tokenizer.id_to_token(int(index)) for index in ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]:
        """The id of each token string (what CTranslate2 returns), the unknown token's where there is none, as
        transformers' fast tokenizers give it."""
        ids = (self.backend_tokenizer.token_to_id(token) for token in tokens)
        return [self.unk_token_id if index is None else index for index in ids]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        rows = [np.asarray(row, dtype=np.int64).tolist() for row in sequences]
        return self.backend_tokenizer.decode_batch(rows, skip_special_tokens=skip_special_tokens)
