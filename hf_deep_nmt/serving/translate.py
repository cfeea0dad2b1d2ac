r"""Batch translation, one loop for every backend.

Written here, around a `Decoder` (`hf_deep_nmt.serving.decoder`; a transformers model is decoded by its
`generate()`, `TorchDecoder`, an `OnnxDecoder` by ONNX Runtime): batches formed by a token budget
(`hf_deep_nmt.data.batching`) within windows of consecutive lines, overlong inputs refused before anything is
translated, input order kept, empty lines passed through, a progress bar, and the translations streamed in input
order to a file (`hf_deep_nmt.serving.text_files`). The output caps (fairseq's `--max-len-a/b` relative to each
sentence's own length, under an absolute cap) and the length penalties are `DecodingOptions`', applied by the decoder.

The names of the rooms beside it (text files, threads, compiled decoding, the torch decoder) stay importable from
here, as they were when this module held them all.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from hf_deep_nmt.data.batching import token_batches
from hf_deep_nmt.serving.decoder import Decoder
from hf_deep_nmt.serving.options import MAX_LENGTH_A, MAX_OUTPUT_TOKENS, MAX_SOURCE_TOKENS, DecodingOptions  # noqa: F401
from hf_deep_nmt.serving.text_files import (  # noqa: F401
    check_output_path,
    decode_lines,
    read_lines,
    split_lines,
    write_pieces,
)
from hf_deep_nmt.serving.threads import check_threads, default_threads, set_threads, usable_cores  # noqa: F401

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The torch decoder's names and compiled decoding's, importable from here too, imported at their first use: they
# import torch, transformers and the model code, which the ONNX Runtime backend's `translate` never needs.
_BESIDE = {
    **dict.fromkeys(
        ("SourceRelativeMaxLength", "TorchDecoder", "check_decoding_memory", "decoding_memory", "load_model"),
        "hf_deep_nmt.serving.torch_decoder",
    ),
    **dict.fromkeys(("STATIC_CACHE_BUCKET", "compiled_decoding", "own_forward"), "hf_deep_nmt.serving.compiled"),
}


def __getattr__(name: str):
    if name in _BESIDE:
        return getattr(importlib.import_module(_BESIDE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def as_decoder(model: PreTrainedModel | Decoder, compile: bool = False) -> Decoder:
    """The decoder that runs `model`: `model` itself when it is a `Decoder` (an `OnnxDecoder` of `load_onnx_model`,
    say), else the `TorchDecoder` of a transformers model. `compile=True` asks for the compiled decoding step,
    which a backend without one refuses by name (`Decoder.check_settings`)."""
    if not isinstance(model, Decoder):
        return __getattr__("TorchDecoder")(model, compile=compile)  # imported here first when no name was
    type(model).check_settings(compile=compile)
    return model.compiled() if compile else model


def check_translation_options(*args, **settings) -> None:
    """`ValueError` naming the first decoding option out of its range (the options of `translate`, positional in the
    order of `DecodingOptions`' fields, or by name); nothing is replaced by a default. Cheap: call it before loading
    a model or training one. The checks are `DecodingOptions`' own."""
    names = [item.name for item in dataclasses.fields(DecodingOptions)]
    if len(args) > len(names):
        raise TypeError(f"check_translation_options takes at most {len(names)} options ({names}), got {len(args)}.")
    DecodingOptions.build(**dict(zip(names, args)), **settings)


def _check_sentences(sentences) -> None:
    if isinstance(sentences, str) or not all(isinstance(sentence, str) for sentence in sentences):
        raise TypeError("`sentences` must be a list of strings.")


def _check_source_lengths(encoded: dict[int, list[int]], limit: int | None) -> None:
    """`ValueError` naming the first input line of more than `limit` tokens, and how many there are."""
    overlong = [index for index, ids in encoded.items() if limit is not None and len(ids) > limit]
    if overlong:
        first = overlong[0]
        raise ValueError(
            f"{len(overlong)} input line(s) are longer than {limit} tokens (line {first + 1} has "
            f"{len(encoded[first])}); split them into sentences, or raise the limit (`max_source_tokens`, "
            "`--max-source-tokens`) knowing that the time grows with the square of the length."
        )


def encode_sentences(tokenizer, sentences: Sequence[str], options: DecodingOptions) -> dict[int, list[int]]:
    """The token ids of every sentence that is not blank, by its index; `ValueError` naming the first of more than
    `options.max_source_tokens` tokens. The loop below and the server's request handling tokenize through it."""
    wanted = [index for index, sentence in enumerate(sentences) if sentence.strip()]
    # the length check is ours (below): no tokenizer warning about its own maximum
    encoded = {index: tokenizer(sentences[index], verbose=False)["input_ids"] for index in wanted}
    _check_source_lengths(encoded, options.max_source_tokens)
    return encoded


def _window_batches(window: list[int], encoded, batch_size: int, max_tokens: int | None) -> list[list[int]]:
    """The batches (sentence indices) of one window, in the order they are run."""
    lengths = [len(encoded[index]) for index in window]
    # No token budget: `batch_size` sentences a batch. A sentence longer than the budget goes on its own.
    budget = max(max_tokens or batch_size * max(lengths), max(lengths))
    groups = sorted(token_batches(lengths, budget, max_sentences=batch_size), key=min)
    return [[window[position] for position in group] for group in groups]


def iter_translations(
    model: PreTrainedModel | Decoder,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    options: DecodingOptions | None = None,
    *,
    progress: bool = False,
    compile: bool = False,
    **settings,
) -> Iterator[list[str]]:
    """The translations of `sentences` in input order, yielded in pieces as soon as they are known: after each batch,
    the translations that now follow, without a gap, those already yielded.

    The options (`options`, with single `settings` by name replacing its values: `DecodingOptions.build`) are
    checked, every sentence is tokenized and an overlong one refused (`ValueError` naming its line) when this
    function is called, before anything is translated, as is a decoding whose largest batch would not fit the memory
    of the model's device (`InsufficientMemoryError` stating the estimate, `Decoder.check_fits`). Batches are
    formed within windows of `buffer_size` consecutive sentences (`None`: one window), sorted by length inside a
    window and run in the order of their first sentence, so a stopped run has produced a prefix of the input. See
    `translate` for the options.
    """
    _check_sentences(sentences)
    decoder = as_decoder(model, compile)
    options = DecodingOptions.build(options, **settings)
    decoder.check(tokenizer, options)
    encoded = encode_sentences(tokenizer, sentences, options)
    wanted = list(encoded)
    size = options.buffer_size or max(len(wanted), 1)
    windows = [wanted[start : start + size] for start in range(0, len(wanted), size)]
    batches = [_window_batches(window, encoded, options.batch_size, options.max_tokens) for window in windows]
    shapes = [(len(batch), max(len(encoded[index]) for index in batch)) for window in batches for batch in window]
    decoder.check_fits(shapes, options)
    return _translated_pieces(decoder, tokenizer, len(sentences), batches, encoded, progress, options)


def _translated_pieces(decoder, tokenizer, count, batches, encoded, progress, options) -> Iterator[list[str]]:
    outputs: dict[int, str] = {index: "" for index in range(count) if index not in encoded}
    done = 0  # translations 0 .. done - 1 have been yielded

    def ready() -> list[str]:
        nonlocal done
        piece = []
        while done in outputs:
            piece.append(outputs.pop(done))
            done += 1
        return piece

    with tqdm(total=count, desc="Translating", unit="sent", disable=not progress, file=sys.stderr) as bar:
        bar.update(len(outputs))
        for window in batches:
            for indices in window:
                texts = decoder.translate_batch(tokenizer, [encoded[index] for index in indices], options)
                outputs.update(zip(indices, texts))
                bar.update(len(indices))
                if piece := ready():
                    yield piece
        if piece := ready():
            yield piece


def translate(
    model: PreTrainedModel | Decoder,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    options: DecodingOptions | None = None,
    *,
    progress: bool = False,
    compile: bool = False,
    **settings,
) -> list[str]:
    """Translate `sentences`; output order follows the input, an empty line gives an empty line.

    The decoding is `options` (a `DecodingOptions`; its defaults when None), with single settings given by name
    (`num_beams=2`, ...) replacing its values. Batches hold sentences of similar length: at most `batch_size`
    sentences and, with `max_tokens`, at most that many padded source tokens. Each sentence may produce at most
    `max_length_a * source_tokens + max_length_b` tokens before `</s>` (source tokens counting its `</s>`), so long
    inputs are never cut at the 20-token default of `generate()`, and never more than `max_output_tokens`
    (`MAX_OUTPUT_TOKENS`, 1024). A sentence of more than `max_source_tokens` tokens (`MAX_SOURCE_TOKENS`, 1024;
    `None`: no limit) is refused before anything is translated. `length_penalty_form="fairseq"` divides a
    hypothesis' log-probability by `|Y|^alpha` (what `generate()` does); `"gnmt"` by `((5 + |Y|) / 6)^alpha`, applied
    by rescoring the `num_beams` finished hypotheses that beam search (run without a penalty) returns. `buffer_size`
    sentences at a time are sorted into batches (`None`: all of them). Options out of range are refused (by
    `DecodingOptions`), as is a tokenizer whose vocabulary or padding / end ids do not match the model
    (`ValueError`). `compile=True` decodes with the static cache and a compiled decoding step (`compiled_decoding`):
    the same translations, faster once compiled where launches dominate (small batches on a GPU), at the price of a
    compilation per new shape. `model` may be a `Decoder` instead, e.g. an `OnnxDecoder`
    (`hf_deep_nmt.serving.onnx.load_onnx_model`): the same decoding on ONNX Runtime, greedy or beam search with the
    fairseq penalty (not `compile`, not the GNMT form).
    """
    pieces = iter_translations(model, tokenizer, sentences, options, progress=progress, compile=compile, **settings)
    return [text for piece in pieces for text in piece]


def write_translations(
    model: PreTrainedModel | Decoder,
    tokenizer: PreTrainedTokenizerBase,
    lines: Sequence[str],
    target: str | Path = "-",
    options: DecodingOptions | None = None,
    *,
    overwrite: bool = False,
    **settings,
) -> int:
    """Translate `lines` into `target` (`-`: stdout), one line each, streamed in input order and flushed after every
    batch. A file is written under a temporary name beside it and renamed to `target` once complete, so a stopped run
    never leaves a truncated `target` (nor destroys the one it replaces); an error after the first translation keeps
    the temporary file with the lines written and names it (an exception note). Nothing is written before the first
    translation.
    `options` and `settings` are those of `translate` (`progress`, `compile` too); without `options`, 1000 lines at
    a time are sorted into batches unless `buffer_size` says otherwise. Returns the number of lines."""
    check_output_path(target, overwrite=overwrite)
    if options is None:
        settings.setdefault("buffer_size", 1000)
    write_pieces(iter_translations(model, tokenizer, lines, options, **settings), target, overwrite, len(lines))
    return len(lines)


def translate_file(
    model: PreTrainedModel | Decoder,
    tokenizer: PreTrainedTokenizerBase,
    source: str | Path = "-",
    target: str | Path = "-",
    options: DecodingOptions | None = None,
    *,
    overwrite: bool = False,
    **settings,
) -> int:
    r"""Translate a UTF-8 text file (`-`: stdin), one sentence per `\n` line (`read_lines`), into `target` (`-`:
    stdout), line for line (`write_translations`). The output may not be the input file, nor an existing file
    unless `overwrite`. Returns the number of lines. `options` and `settings` are those of `write_translations`."""
    check_output_path(target, source, overwrite)
    lines = read_lines(source)
    return write_translations(model, tokenizer, lines, target, options, overwrite=overwrite, **settings)
