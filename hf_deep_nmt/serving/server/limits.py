"""What a request may ask and how it is refused: `ServerLimits` (the server's bounds, one flag of `hf-deep-nmt serve`
each), `RequestError` (an HTTP status, a kind for the error metric, and one sentence naming the limit and the way
out) and `read_request`, which turns a LibreTranslate-style body into a `TranslationRequest` or refuses it.

The body is LibreTranslate's: `q` (a string, or a list of strings answered in the same order), `source` (`auto`
allowed) and `target`, `format` (`text`, the only one served), `api_key`; beside them `num_beams` and `max_length` (the
most tokens of each translated sentence), each within the server's limits. JSON, or the form encoding LibreTranslate
also reads. Fields of LibreTranslate's this server has no use for are ignored, as LibreTranslate ignores unknown ones.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from hf_deep_nmt.serving.options import DecodingOptions


def _limit(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerLimits:
    """The bounds of `hf-deep-nmt serve`, each a flag of the same name (`--max-body-bytes`, ...); every request stays
    within them."""

    max_body_bytes: int = _limit(1_000_000, "a larger request body is refused (413)")
    max_sentences: int = _limit(128, "the most sentences in one request, once its paragraphs are split (more: 413)")
    max_queue: int = _limit(2048, "the most sentences waiting for a batch; a request past it is refused (503)")
    max_num_beams: int = _limit(8, "the most beams a request may ask for (`num_beams`)")
    timeout_s: float = _limit(60.0, "a request not answered within this many seconds gets 504")
    max_batch_tokens: int = _limit(4096, "the most padded source tokens in a batch (a longer sentence goes alone)")
    max_batch_sentences: int = _limit(64, "the most sentences in a batch")
    max_wait_ms: float = _limit(10.0, "the longest the first sentence of a batch waits for others to join it")

    def __post_init__(self):
        for item in dataclasses.fields(self):
            value, whole = getattr(self, item.name), item.type in (int, "int")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"`{item.name}` must be a number, got {value!r}.")
            if whole and (value < 1 or value != int(value)):
                raise ValueError(f"`{item.name}` must be a whole number >= 1, got {value!r}.")
            if value < 0 or (value == 0 and item.name == "timeout_s"):
                least = "> 0" if item.name == "timeout_s" else ">= 0"
                raise ValueError(f"`{item.name}` must be a number {least}, got {value!r}.")


class RequestError(Exception):
    """A request refused or failed: the HTTP `status`, the `kind` counted in the error metric, the `message` the client
    reads, and any extra response `headers` (Retry-After)."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers or {}


# every kind an error is counted under (the metric starts each at 0)
ERROR_KINDS = (
    "body_too_large",
    "too_many_sentences",
    "sentence_too_long",
    "malformed",
    "language_pair",
    "unauthorized",
    "queue_full",
    "draining",
    "deadline",
    "decoding",
)


@dataclass(frozen=True)
class TranslationRequest:
    """A checked request: its texts, whether `q` was a single string (answered with one), its languages and the
    decoding options of its sentences."""

    texts: list[str]
    single: bool
    source: str
    target: str
    options: DecodingOptions


def _malformed(message: str) -> RequestError:
    return RequestError(422, "malformed", message)


_FIELDS = "`q`, `source` and `target`"


def parse_body(body: bytes, content_type: str) -> dict:
    """The fields of a JSON object body, or of a form-encoded one (`application/x-www-form-urlencoded`)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed("The body is not UTF-8 text.") from None
    if content_type.split(";")[0].strip().lower() == "application/x-www-form-urlencoded":
        return dict(parse_qsl(text, keep_blank_values=True))
    try:
        payload = json.loads(text)
    except ValueError as error:
        raise _malformed(f"The body is not JSON ({error}); send a JSON object with {_FIELDS}.") from None
    if not isinstance(payload, dict):
        raise _malformed(f"The body must be a JSON object with {_FIELDS}, got {type(payload).__name__}.")
    return payload


def _whole_number(payload: dict, name: str, largest: int, limit_flag: str) -> int | None:
    """`payload[name]` as an integer in [1, largest] (a form sends it as text), None when absent."""
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= largest:
        raise _malformed(
            f"`{name}` must be a whole number from 1 to {largest} (this server's {limit_flag}), got {value!r}."
        )
    return value


def _texts(payload: dict) -> tuple[list[str], bool]:
    if "q" not in payload:
        raise _malformed("`q` is required: the text to translate, a string or a list of strings.")
    q = payload["q"]
    if isinstance(q, str):
        return [q], True
    if isinstance(q, list) and all(isinstance(text, str) for text in q):
        return q, False
    raise _malformed(f"`q` must be a string or a list of strings, got {type(q).__name__}.")


def _languages(payload: dict, languages: tuple[str, str] | None) -> tuple[str, str]:
    names = []
    for name in ("source", "target"):
        value = payload.get(name)
        if not isinstance(value, str) or not value.strip():
            raise _malformed(f"`{name}` is required: a language code (a string{', or auto' * (name == 'source')}).")
        names.append(value.strip())
    source, target = names
    if languages is not None and (source not in (languages[0], "auto") or target != languages[1]):
        raise RequestError(
            400,
            "language_pair",
            f"This server translates {languages[0]} to {languages[1]}; the request asks {source} to {target}.",
        )
    return source, target


def read_request(
    payload: dict, limits: ServerLimits, options: DecodingOptions, languages: tuple[str, str] | None
) -> TranslationRequest:
    """The checked request of a parsed body: 422 for a missing or malformed field (or one past its limit), 400 for a
    language pair this model does not translate (`languages`: (source, target); None: any pair is taken)."""
    texts, single = _texts(payload)
    if payload.get("format", "text") != "text":
        raise _malformed(f"`format` {payload['format']!r} is not served: send plain text (`format: text`).")
    source, target = _languages(payload, languages)
    num_beams = _whole_number(payload, "num_beams", limits.max_num_beams, "--max-num-beams")
    max_length = _whole_number(payload, "max_length", options.max_output_tokens, "--max-output-tokens")
    settings = {}
    if num_beams is not None:
        settings["num_beams"] = num_beams
    if max_length is not None:
        settings.update(max_output_tokens=max_length, max_length_b=min(options.max_length_b, max_length))
    return TranslationRequest(texts, single, source, target, DecodingOptions.build(options, **settings))
