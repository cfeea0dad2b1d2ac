"""Streaming (`streaming: true`): train from a corpus larger than the machine's memory or disk cache, read lazily
while training, with token-budget batches and a resume that continues exactly where the stream stopped.

Where the pairs come from: a local TSV / JSONL / two-file corpus (`train_file`), read line by line with the checks and
error messages of `hf_deep_nmt.data.corpus` (encoding, NUL bytes, fields, empty sides, blank lines, aligned files), or
a `datasets` name (`dataset_name`) read through `datasets.load_dataset(..., streaming=True)` (rows with an empty side
dropped and counted, as `hf_deep_nmt.data.corpus` does). Nothing is written to disk and nothing beyond one buffer is
held.

How batches are made (the OpenNMT `bucket_size` / Marian maxi-batch idea), per process:

* a buffer takes the next `stream_buffer_pairs` pairs of this process's share of the stream, tokenized as
  `hf_deep_nmt.data.corpus.tokenize_parallel` does (pairs over `max_source_length` / `max_target_length` dropped and
  counted);
* the buffer is cut into batches by `hf_deep_nmt.data.batching.token_batches`, the budget of the non-streamed path:
  `sentences x longest side <= max_tokens` (the padded size), similar lengths together, ties broken by a seeded
  shuffle (without `max_tokens`: `per_device_train_batch_size` pairs per batch);
* the batches of the buffer are handed out in a seeded random order, every one of them, then the next buffer is read.
  The seeds derive from the run's seed (`data_seed`, else `seed`), the rank, the pass and the buffer's number.
* At the end of the corpus a new pass starts from its beginning (training is counted in `max_steps`, which streaming
  requires). Buffers never span two passes, so every pair is delivered exactly once per pass; the last batch of a
  buffer may be smaller than the budget.

The corpus order decides which pairs share a buffer: a corpus sorted by topic or length gets buffers of one topic or
length. Shuffle such a file once beforehand (`shuf corpus.tsv > shuffled.tsv`).

Several processes: a single-file corpus (TSV / JSONL) of `size` bytes is split by bytes, rank `r` reading the lines
that start in `[r x size / world_size, (r + 1) x size / world_size)` (it seeks to its first line start and stops at
the first line starting past its range), so the processes read the file once between them; a line is decoded and
checked by the process whose range holds it (a bad line stops that process, and the launcher the others), its number
counted only when an error names it. Two files (source and target) cannot be split by bytes (a line of one is found in
the other only by counting lines), so they are dealt out by pair: pair `j` (counting from 0) to rank
`j mod world_size`, every process reading every line but decoding, checking and tokenizing only its own. A
`dataset_name` is split by `datasets.distributed.split_dataset_by_node` (whole shards per rank where they divide
evenly, else every `world_size`-th row). So each pair goes to one process per pass; each makes its own buffers and
batches; the processes take the same number of steps (`max_steps`) and may be at slightly different places of their
passes (ranges hold pairs of different lengths).

Several loader workers (`dataloader_num_workers` N > 1): each process's share is read by N readers, one per worker, as
if there were `world_size x N` processes (reader `rank x N + i` of `world_size x N`: its byte range, or pair `j` to
reader `j mod (world_size x N)` for two files), each with its own buffers, seeds and position; the loader takes the
workers' batches in turn. Tokenizing, the costly part, is then spread over N cores. The recorded position holds every
reader's position and whose turn is next, so a resume continues each reader where it stopped and the turns where they
were; it needs the same N (another N deals the pairs otherwise, and is refused by name).

Collating: a buffer holds its ids as int32 arrays, and a batch's pairs are gathered from them (`BatchRows`). With the
Trainer's `DataCollatorForSeq2Seq` (padding to the longest pair, `pad_to_multiple_of` allowed, torch tensors) the
batch is padded from those arrays at once (`collate_rows`): the collator's tensors, key for key and value for value
(the model's own `prepare_decoder_input_ids_from_labels` makes `decoder_input_ids`), without its per-pair Python
lists, which cost as much CPU as the prepared path's whole loader. Any other collator, or other settings, is given the
features as lists (`input_ids`, `attention_mask`, `labels` per pair), as without streaming.

Resuming, and what it guarantees: after each batch it hands to the Trainer, the loader knows the position that comes
after it: the pass, the number of the buffer, where that buffer's first pair is read from (the byte offset of the next
line within the reader's range of a single file, or of each of two files with its line number; `datasets`' own
`state_dict()` of the stream for a `dataset_name`), and how many of that buffer's batches were already handed out.
`StreamPositionRecorder` writes the position of every process into each checkpoint (`checkpoint-N/stream_state.json`,
before the checksums of the checkpoint are recorded), and checks that it is the position after exactly `global_step x
gradient_accumulation_steps` batches. A resumed run reads the buffer in progress again from its recorded start (at most
`stream_buffer_pairs` pairs per process are read twice: read, never trained on twice), makes the same batches (same
pairs, same seeds), skips those already handed out, and continues. So, for the same corpus, tokenizer and settings, the
batches after a resume from step N are exactly the batches the uninterrupted run trains after step N, on every process:
nothing replayed, nothing skipped. The Trainer's own fast-forwarding (`ignore_data_skip`) is turned off for a streamed
run. A checkpoint whose position cannot hold is refused, naming why: written without streaming, another buffer size,
seed, token budget, length limit, tokenizer size or process count, or a corpus file whose size changed (its offsets
would point elsewhere).

The tokenizer, unless the recipe names one, is trained on the first `tokenizer_train_pairs` pairs of the stream and
saved in `output_dir/tokenizer/` (by the main process; the others wait and load it), where a resumed run loads it.
The validation data is read as without streaming (it is small).
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
import re
import sys
import unicodedata
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain, islice, repeat
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import regex
import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import BatchEncoding, DataCollatorForSeq2Seq, PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
from transformers.utils import PaddingStrategy, logging

from hf_deep_nmt.data.batching import token_batches
from hf_deep_nmt.data.corpus import (
    SOURCE,
    TARGET,
    _translation_pairs,
    check_read_pairs,
    decode_line,
    jsonl_pair,
    load_named_dataset,
    parallel_files,
    read_parallel_file,
    tsv_pair,
    warn_if_validation_is_training,
)
from hf_deep_nmt.data.prepared import file_digest
from hf_deep_nmt.folders import write_json_atomically

logger = logging.get_logger(__name__)

# pairs each process holds in its streaming buffer (`stream_buffer_pairs`)
DEFAULT_STREAM_BUFFER_PAIRS = 100_000
STREAM_STATE_FILE = "stream_state.json"
STREAM_STATE_FORMAT = 1
# pairs tokenized in one call (the batch `datasets.map` gives `tokenize_parallel`)
TOKENIZE_CHUNK = 1000


# ---- local files, read lazily ---------------------------------------------------------------------------------------


def _open_corpus(path: Path):
    """The binary file a streaming reader reads `path` through (one place, so that a test can count the lines)."""
    return path.open("rb")


class _Lines:
    """The lines of one UTF-8 corpus file from byte `offset` (line `number` there), each checked and decoded by
    `hf_deep_nmt.data.corpus.decode_line`. `offset` and `number` are those of the next line to read."""

    def __init__(self, path: Path, offset: int = 0, number: int = 1):
        self.path, self.offset, self.number = path, offset, number
        self.handle = _open_corpus(path)
        if offset:
            self.handle.seek(offset)

    def next(self) -> str | None:
        raw = self.handle.readline()
        if not raw:
            return None
        number = self.number
        self.offset += len(raw)
        self.number += 1
        return decode_line(self.path, number, raw)

    def skip(self) -> bytes | None:
        """The next line's bytes, unchecked (a line of another reader's pair)."""
        raw = self.handle.readline()
        if raw:
            self.offset += len(raw)
            self.number += 1
        return raw or None

    def close(self) -> None:
        self.handle.close()


def _blank(raw: bytes) -> bool:
    """Whether a line is blank as `hf_deep_nmt.data.corpus` sees it (after decoding: Unicode spaces too)."""
    return not raw.decode("utf-8", errors="replace").strip()


class _FileReader:
    """Pairs of a two-file corpus from a recorded position, this process's share only (pair `j` to rank
    `j mod world_size`; every line is read, this process's checked). `position()` is where the next pair is read
    from; `last` is the number of the pair read last."""

    def __init__(self, files: list[Path], kind: str, languages: tuple[str, str], position, rank: int, world: int):
        position = position or {"offsets": [0] * len(files), "line": 1, "pair": 0}
        self.files, self.kind, self.languages, self.rank, self.world = files, kind, languages, rank, world
        self.lines = [_Lines(file, offset, position["line"]) for file, offset in zip(files, position["offsets"])]
        self.pair = position["pair"]  # pairs of the whole stream (every rank's) read before the next one

    def position(self) -> dict[str, Any]:
        return {"offsets": [lines.offset for lines in self.lines], "line": self.lines[0].number, "pair": self.pair}

    def __iter__(self):
        return self

    def __next__(self) -> tuple[str, str]:
        while True:
            mine = self.pair % self.world == self.rank
            pair = self._next_pair() if mine else self._skip_pair()
            self.pair += 1
            if mine:
                self.last = self.pair - 1  # the pair's number in the stream
                return pair

    def _skip_pair(self) -> None:
        """Step over another reader's pair: its lines are counted (blank lines too, so that every reader numbers the
        pairs alike) but neither decoded nor checked; the reader whose pair it is checks it."""
        if self.kind == "two":
            sources, targets = self.lines
            source, target = sources.skip(), targets.skip()
            if source is None and target is None:
                raise StopIteration
            if source is None or target is None:  # as `_next_aligned` says it
                counts = []
                for lines, line in ((sources, source), (targets, target)):
                    while line is not None:
                        line = lines.skip()
                    counts.append(lines.number - 1)
                raise ValueError(
                    f"{sources.path} has {counts[0]} lines but {targets.path} has {counts[1]}; parallel files must "
                    "align."
                )
            return None
        lines, blank = self.lines[0], None
        while True:
            number = lines.number
            raw = lines.skip()
            if raw is None:
                raise StopIteration
            if _blank(raw):
                blank = blank or number
                continue
            if blank is not None:
                raise ValueError(
                    f"{lines.path}:{blank}: empty line inside the file (only trailing blank lines are allowed)."
                )
            return None

    def _next_pair(self) -> tuple[str, str]:
        if self.kind == "two":
            return self._next_aligned()
        lines, blank = self.lines[0], None
        while True:  # as `hf_deep_nmt.data.corpus._content_lines`: blank lines only at the end of the file
            number = lines.number
            line = lines.next()
            if line is None:
                raise StopIteration
            if not line.strip():
                blank = blank or number
                continue
            if blank is not None:
                raise ValueError(
                    f"{lines.path}:{blank}: empty line inside the file (only trailing blank lines are allowed)."
                )
            if self.kind == "tsv":
                return tsv_pair(lines.path, number, line)
            return jsonl_pair(lines.path, number, line, *self.languages)

    def _next_aligned(self) -> tuple[str, str]:
        """As `hf_deep_nmt.data.corpus.read_two_files`: the same line of both files, none of them empty."""
        sources, targets = self.lines
        number = sources.number
        source, target = sources.next(), targets.next()
        if source is None and target is None:
            raise StopIteration
        if source is None or target is None:
            counts = []
            for lines, line in ((sources, source), (targets, target)):
                while line is not None:
                    line = lines.next()
                counts.append(lines.number - 1)
            raise ValueError(
                f"{sources.path} has {counts[0]} lines but {targets.path} has {counts[1]}; parallel files must align."
            )
        if not source.strip() or not target.strip():
            bad = sources.path if not source.strip() else targets.path
            raise ValueError(f"{bad}:{number}: empty line in a parallel file.")
        return source, target

    def close(self) -> None:
        for lines in self.lines:
            lines.close()


def _line_number(path: Path, offset: int) -> int:
    """The number of the line that starts at byte `offset` of `path`: the newlines before it are counted only when an
    error names the line (a reader of a byte range does not number its lines)."""
    count, left = 0, offset
    with _open_corpus(path) as handle:
        while left:
            chunk = handle.read(min(left, 1 << 20))
            if not chunk:
                break
            count, left = count + chunk.count(b"\n"), left - len(chunk)
    return count + 1


def _first_blank_line(path: Path, offset: int) -> int:
    """The number of the first line of the run of blank lines that ends where the text at byte `offset` starts (the
    line `hf_deep_nmt.data.corpus` names for a blank line inside the file; it may lie in another reader's range)."""
    run, number, read = None, 1, 0
    with _open_corpus(path) as handle:
        while read < offset:
            raw = handle.readline()
            if not raw:
                break
            read += len(raw)
            run = (run or number) if _blank(raw) else None
            number += 1
    return run or number


class _RangeReader:
    """Pairs of a single-file corpus (TSV / JSONL) from reader `rank` of `world`'s byte range only: its lines are those
    that start in `[rank x size / world, (rank + 1) x size / world)`, so the readers share the file's lines without
    any of them reading another's. `position()` holds the byte offset of the next line (a line start within the range)
    and the pairs of the range read before it; `last` is the byte offset of the pair read last, its number in the
    stream (offsets order the pairs as the file does, and no reader knows the line numbers before its range)."""

    def __init__(self, path: Path, kind: str, languages: tuple[str, str], position, rank: int, world: int):
        self.path, self.kind, self.languages = path, kind, languages
        size = path.stat().st_size
        self.range = [rank * size // world, (rank + 1) * size // world]
        self.handle = _open_corpus(path)
        self.offset, self.pair, self.last = self._first_line(self.range[0]), 0, None
        if position is not None:
            self.offset, self.pair = position["offsets"][0], position["pair"]
        self.handle.seek(self.offset)

    def _first_line(self, start: int) -> int:
        """The first line start at or after `start` (the line that holds byte `start - 1` is the previous reader's)."""
        if start == 0:
            return 0
        self.handle.seek(start - 1)
        return start - 1 + len(self.handle.readline())

    def position(self) -> dict[str, Any]:
        return {"offsets": [self.offset], "pair": self.pair, "range": list(self.range)}

    def __iter__(self):
        return self

    def __next__(self) -> tuple[str, str]:
        blank = False  # a blank line read, to be followed by nothing but blank lines up to the end of the file
        while self.offset < self.range[1] or blank:  # past the range only to look for text after a blank line
            start = self.offset
            raw = self.handle.readline()
            if not raw:
                break
            self.offset += len(raw)
            mine = start < self.range[1]  # another reader's line is only looked at, never checked
            line = self._checked(start, raw, None) if mine else ("" if _blank(raw) else raw)
            if not line.strip():
                blank = True
                continue
            if blank:
                number = _first_blank_line(self.path, start)
                raise ValueError(
                    f"{self.path}:{number}: empty line inside the file (only trailing blank lines are allowed)."
                )
            self.pair, self.last = self.pair + 1, start
            return self._checked(start, raw, line)
        raise StopIteration

    def _checked(self, start: int, raw: bytes, line: str | None):
        """The line at byte `start` decoded (`line` None), else its pair, checked as `hf_deep_nmt.data.corpus` checks
        it; an error names the line's number, counted only then (whether it is line 1 is all a line needs before)."""

        def check(number: int):
            text = decode_line(self.path, number, raw) if line is None else line
            if line is None:
                return text
            if self.kind == "tsv":
                return tsv_pair(self.path, number, text)
            return jsonl_pair(self.path, number, text, *self.languages)

        try:
            return check(1 if start == 0 else 0)
        except ValueError:
            check(_line_number(self.path, start))  # the same error, naming the line
            raise

    def close(self) -> None:
        self.handle.close()


class FileSource:
    """A local parallel corpus (`train_file`: .tsv, .jsonl or a two-file prefix) read lazily."""

    def __init__(self, path: str | Path, source_lang: str, target_lang: str, files: tuple | None = None):
        self.name = str(path)
        self.files = list(files or parallel_files(path, source_lang, target_lang))
        self.kind = "two" if len(self.files) == 2 else ("tsv" if self.files[0].suffix == ".tsv" else "jsonl")
        self.languages = (source_lang, target_lang)
        self._digests: dict[str, str] | None = None

    def reader(self, position=None, rank: int = 0, world_size: int = 1) -> _FileReader | _RangeReader:
        """Reader `rank` of `world_size`: a byte range of a single file, every `world_size`-th pair of two files
        (whose lines cannot be split by bytes: a line of one file is found in the other by counting)."""
        if self.kind == "two":
            return _FileReader(self.files, self.kind, self.languages, position, rank, world_size)
        return _RangeReader(self.files[0], self.kind, self.languages, position, rank, world_size)

    def identity(self) -> dict[str, Any]:
        """What a recorded position depends on: each file's name and size (a file that grew or shrank has other
        offsets; the folder may differ, e.g. on the node a job was requeued to)."""
        return {"files": [{"name": file.name, "bytes": file.stat().st_size} for file in self.files]}

    def digests(self) -> dict[str, str]:
        """The sha256 of each file's bytes (by name), read once per source: a file edited in place keeps its size and
        may keep the recorded line starts, and only its contents tell it apart (as the prepared path's fingerprint
        does)."""
        if self._digests is None:
            self._digests = {file.name: file_digest(file) for file in self.files}
        return self._digests

    def check_digests(self, recorded: dict[str, str] | None, where: str) -> None:
        """`ValueError` naming the first file whose contents differ from `recorded` (None: a record written before
        digests were kept, which only the sizes and line starts check)."""
        if not recorded:
            return
        current = self.digests()
        for file in self.files:
            if recorded.get(file.name) not in (None, current[file.name]):
                raise ValueError(
                    f"{where} was written while streaming another version of {file}: its contents changed since "
                    f"(sha256 {recorded[file.name][:16]} then, {current[file.name][:16]} now; same size), so the "
                    "recorded position would continue in other text. Restore the corpus it was written with, or start "
                    "afresh in another output_dir."
                )

    def check_position(self, position: dict[str, Any], where: str, share: tuple[int, int] = (0, 1)) -> None:
        """`ValueError` unless every recorded offset is the start of a line of its file and, for a single file, the
        position is one in the byte range of reader `share` = (reader, readers)."""
        if self.kind != "two":
            size = self.files[0].stat().st_size
            reader, readers = share
            expected = [reader * size // readers, (reader + 1) * size // readers]
            recorded = position.get("range", [0, size] if readers == 1 else None)  # one reader: the same either way
            if recorded != expected:
                raise ValueError(
                    f"{where} records where reader {reader} of {readers} stopped in {self.files[0]} "
                    + ("with the lines dealt out by pair" if recorded is None else f"in bytes {recorded}")
                    + f", but that reader now reads bytes {expected}: the position would continue in another share "
                    "of the corpus. Resume it with the version that wrote it, or start afresh in another output_dir."
                )
        for file, offset in zip(self.files, position["offsets"]):
            if offset in (0, file.stat().st_size):  # the end of a file, which may lack a final newline
                continue
            with _open_corpus(file) as handle:
                handle.seek(offset - 1)
                if handle.read(1) != b"\n":
                    raise ValueError(
                        f"{where} records byte {offset} of {file} as the start of a line, but it is not one: the file "
                        "changed since the checkpoint. Restore the corpus it was written with, or start afresh."
                    )

    def check_head(self) -> None:
        """Before any work, what `load_parallel_dataset` refuses at once: an empty corpus or one holding only a
        header; a first pair that looks like a header is warned about."""
        head = self.first_pairs(2)
        if not head[SOURCE]:
            raise ValueError(f"`train_file` {self.name!r} holds no sentence pairs; give a corpus with at least one.")
        check_read_pairs(self.name, "train_file", head, *self.languages)

    def first_pairs(self, count: int) -> dict[str, list[str]]:
        """The first `count` pairs of the corpus (every rank's), read from its start."""
        reader = self.reader()
        try:
            pairs = list(islice(reader, count))
        finally:
            reader.close()
        return {SOURCE: [s for s, _ in pairs], TARGET: [t for _, t in pairs]}


# ---- a `datasets` name, streamed ------------------------------------------------------------------------------------


def _split_names(name: str, config: str | None) -> list[str]:
    try:
        return list(datasets.get_dataset_split_names(name, config))
    except (ConnectionError, TimeoutError, OSError, ValueError) as error:
        raise ConnectionError(
            f"Dataset {name!r} cannot be streamed: its splits cannot be listed ({type(error).__name__}: "
            f"{str(error)[:200]}). Check the name and the network, or train on local files (`train_file`)."
        ) from None


class _HubReader:
    """Pairs of a streamed `datasets` split from a recorded `state_dict()`; rows with an empty side are dropped and
    counted (as `hf_deep_nmt.data.corpus` drops them)."""

    def __init__(self, source: HubSource, position, rank: int, world_size: int):
        dataset = load_named_dataset(source.name, source.config, source.split, streaming=True)
        if world_size > 1:
            from datasets.distributed import split_dataset_by_node

            dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
        if position is not None:
            dataset.load_state_dict(position["state"])
        self.source, self.dataset = source, dataset
        self.rows = iter(dataset)
        self.pair = position["pair"] if position else 0  # rows of this process's share read before the next one
        self.dropped = 0

    def position(self) -> dict[str, Any]:
        return {"state": self.dataset.state_dict(), "pair": self.pair}

    def __iter__(self):
        return self

    def __next__(self) -> tuple[str, str]:
        source_lang, target_lang = self.source.languages
        while True:
            row = next(self.rows)
            self.pair += 1
            self.last = self.pair - 1
            where = f"{self.source.name}[{self.source.split}]"
            pair = row.get("translation") if isinstance(row, dict) else None
            if not isinstance(pair, dict):
                columns = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"{where}: expected a 'translation' column of {{language: text}}, got {columns}.")
            missing = [lang for lang in (source_lang, target_lang) if lang not in pair]
            if missing:
                raise ValueError(f"{where}: no {missing} text in its translations; it has {sorted(pair)}.")
            source, target = pair[source_lang], pair[target_lang]
            if not (source or "").strip() or not (target or "").strip():
                self.dropped += 1
                continue
            return source, target

    def close(self) -> None:
        pass


class HubSource:
    """The `train` split of a `datasets` name (`dataset_name`, `dataset_config`), streamed."""

    def __init__(self, name: str, config: str | None, source_lang: str, target_lang: str, split: str = "train"):
        self.name, self.config, self.split, self.languages = name, config, split, (source_lang, target_lang)

    def reader(self, position=None, rank: int = 0, world_size: int = 1) -> _HubReader:
        return _HubReader(self, position, rank, world_size)

    def identity(self) -> dict[str, Any]:
        return {"dataset": self.name, "config": self.config, "split": self.split}

    def check_position(self, position: dict[str, Any], where: str, share: tuple[int, int] = (0, 1)) -> None:
        pass  # `datasets` refuses a state that does not fit the stream

    def digests(self) -> None:
        return None  # a named dataset's revision is `datasets`' business; its state dict is checked on loading

    def check_digests(self, recorded, where: str) -> None:
        pass

    def check_head(self) -> None:
        pass  # nothing read ahead from the Hub: an empty stream is refused where it is first read

    def first_pairs(self, count: int) -> dict[str, list[str]]:
        pairs = list(islice(self.reader(), count))
        return {SOURCE: [s for s, _ in pairs], TARGET: [t for _, t in pairs]}


# ---- the stream of batches ------------------------------------------------------------------------------------------


def _derived_seed(seed: int, *parts: Any) -> int:
    """A seed for one buffer of one pass on one rank, the same in every process and run (not Python's `hash`)."""
    text = ":".join(str(part) for part in (seed, *parts))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def _backend_ids_are_the_tokenizers(tokenizer) -> bool:
    """Whether the `tokenizers` backend's batch encoding gives the ids `tokenizer(texts)` gives: a fast tokenizer
    without a target mode of its own, nor truncation or padding set on its backend."""
    backend = getattr(tokenizer, "_tokenizer", None)
    return bool(
        getattr(tokenizer, "is_fast", False)
        and backend is not None
        and backend.truncation is None
        and backend.padding is None
        and not hasattr(tokenizer, "_switch_to_target_mode")
        and not hasattr(tokenizer, "_switch_to_input_mode")
    )


def encode_texts(tokenizer, texts: list[str], target: bool) -> list[list[int]]:
    """The `input_ids` that `tokenizer(texts)` (`text_target=` for `target`) gives, from the `tokenizers` backend's
    batch encoding when that gives the same ids: the wrapper's per-text conversions cost about a sixth of the
    tokenizing."""
    if not _backend_ids_are_the_tokenizers(tokenizer):
        return tokenizer(text_target=texts)["input_ids"] if target else tokenizer(texts)["input_ids"]
    pieces = _piece_encoder(tokenizer)
    if pieces is not None:
        return pieces.encode(texts)
    backend = tokenizer._tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # `_fast`: no character offsets
    return [encoding.ids for encoding in encode(texts, add_special_tokens=True)]


def encode_arrays(tokenizer, texts: list[str], target: bool) -> tuple[np.ndarray, np.ndarray]:
    """`encode_texts`' ids as one int32 array (the texts' ids one after another) and each text's count; the
    word-by-word encoder (`_PieceEncoder`) makes them without a Python list per text."""
    pieces = _piece_encoder(tokenizer) if _backend_ids_are_the_tokenizers(tokenizer) else None
    if pieces is not None:
        return pieces.encode_arrays(texts)
    ids = encode_texts(tokenizer, texts, target)  # the backend's batch encoding, or the tokenizer's own call
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    return np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())), lengths


# `tokenizers`' ByteLevel pre-tokenizer split (`use_regex`: GPT-2's pattern)
_BYTE_LEVEL_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
# Texts `_PieceEncoder` takes: printable Latin only (U+0020-U+007E without '<', U+00A1-U+024F), where the `regex`
# module's and Oniguruma's letter, digit and space classes agree and NFKC has been the same in every Unicode version;
# without '<' no special token can start. Other texts go to the `tokenizers` backend.
_PLAIN_TEXT = re.compile(r"[\x20-\x3b\x3d-\x7e\u00a1-\u024f]+")


def _plain_split() -> re.Pattern:
    r"""`_BYTE_LEVEL_SPLIT` for the texts `_PLAIN_TEXT` takes, in Python's own `re` (about twice as fast as `regex`):
    its letter and digit classes listed character by character, each character of the plain range tested against
    `regex`'s `\p{L}` and `\p{N}`; the only space in the range is U+0020, which both modules' `\s` match alone."""
    characters = [chr(code) for code in (*range(0x20, 0x7F), *range(0xA1, 0x250))]

    def listed(name: str) -> str:
        return "".join(re.escape(character) for character in characters if regex.fullmatch(name, character))

    letters, digits = listed(r"\p{L}"), listed(r"\p{N}")
    return re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{digits}]+| ?[^\s{letters}{digits}]+|\s+(?!\S)|\s+")


_PLAIN_SPLIT = _plain_split()
# Distinct words (and lone pieces) remembered per process, each a dictionary entry and its ids in one int32 table: the
# first ones met; those met after that are tokenized each time they come, so the memory stays bounded whatever the
# corpus's size (18 MB at 95,000 words).
PIECE_MEMO_SIZE = 100_000
# ... and at most this many ids in all (4 MB): a corpus of long words (URLs, strings of digits) does not grow it either
PIECE_MEMO_IDS = 1_000_000
# `_PieceEncoder`'s key of the suffix's slot: a plain text holds no line break, and texts joined by " \n " split on
# spaces into their words with "\n" after each text, where its suffix goes
_SUFFIX_KEY = "\n"
# the mark of a key that is one piece of the byte-level split (a text with other spaces than single ones between
# words), not a word: a plain text holds no control character
_PIECE_MARK = "\x01"
# a chunk of plain texts joined by " \n " (`_PieceEncoder._joinable`)
_PLAIN_JOINED = re.compile(r"[\n\x20-\x3b\x3d-\x7e\u00a1-\u024f]+")
_BYTE_LEVEL_CONFIG = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}


def _byte_characters() -> dict[int, str]:
    """The byte-to-character table of byte-level BPE (GPT-2's `bytes_to_unicode`), which `tokenizers` applies to
    each piece before the model sees it; as a `str.translate` table of the characters U+0000-U+00FF that a piece's
    UTF-8 bytes read as Latin-1 give."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {byte: chr(byte) for byte in printable}, 0
    for byte in range(256):
        if byte not in table:
            table[byte], extra = chr(256 + extra), extra + 1
    return table


class _PieceEncoder:
    """The ids the `tokenizers` backend gives a text, for the tokenizer `train_joint_tokenizer` makes (NFKC, ByteLevel
    with a prefix space, BPE, `</s>` appended), computed word by word with each distinct word's ids remembered: a
    corpus repeats its words, so most words cost a dictionary look-up instead of a pass through the backend's
    normalizer, pre-tokenizer and BPE (whose costs are mostly allocations). Texts it is not sure of (`_PLAIN_TEXT`,
    NFKC) go to the backend, so the ids are the backend's for every text.

    Why words: the byte-level split of `" " + text` for a text of words separated by single spaces is the split of
    `" " + word` for each word, one after another (no piece holds a space but at its start, nor runs on past a word),
    so a text is split by `str.split` and a word's ids are those of its pieces. A text with other spaces is split by
    the pattern, each piece `" " + word` keyed as that word, any other piece (a space run, a text's first piece
    without a space) as itself behind `_PIECE_MARK`."""

    def __init__(self, backend, suffix: list[int]):
        self.backend, self.model, self.suffix = backend, backend.model, suffix
        self.bytes = _byte_characters()
        # each remembered key's ids: `table[starts[k]:starts[k] + lengths[k]]` for the key of slot `k` (`memo`);
        # slot 0 holds the suffix, under a key no word can be (a plain text holds no line break)
        self.memo: dict[str, int] = {}
        self.table, self.starts, self.lengths = (
            np.zeros(1 << 16, np.int32),
            np.zeros(1 << 12, np.int64),
            np.zeros(1 << 12, np.int64),
        )
        self.used, self.slots = 0, 0
        self._store(np.array(suffix, np.int32), np.array([len(suffix)]))
        self.memo[_SUFFIX_KEY] = 0

    def _keys_ids(self, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Each key's ids, one key after another (int32), and each key's count: a word's, the BPE of each piece of
        `" " + word`; a marked piece's, its own. The words are split at once (joined by "\\n ": "\\n" after each
        word's pieces), and the pieces' bytes mapped to byte-level characters at once (joined by a control character
        no piece holds)."""
        joined = " " + "\n ".join(keys) + _SUFFIX_KEY
        if _PIECE_MARK not in joined:
            pieces = _PLAIN_SPLIT.findall(joined)
        else:
            pieces = []
            for key in keys:
                pieces += [key[1:]] if key[0] == _PIECE_MARK else _PLAIN_SPLIT.findall(" " + key)
                pieces.append(_SUFFIX_KEY)
        mapped = "\x02".join(pieces).encode("utf-8").decode("latin-1").translate(self.bytes).split(self.bytes[2])
        newline, tokenize = self.bytes[ord(_SUFFIX_KEY)], self.model.tokenize
        rows = [[token.id for token in tokenize(piece)] if piece != newline else () for piece in mapped]
        ends = np.flatnonzero(np.fromiter(map(newline.__eq__, mapped), dtype=bool, count=len(mapped)))
        lengths = np.cumsum(np.fromiter(map(len, rows), dtype=np.int64, count=len(rows)))[ends]
        return np.fromiter(chain.from_iterable(rows), dtype=np.int32), np.diff(lengths, prepend=0)

    def _store(self, ids: np.ndarray, lengths: np.ndarray) -> int:
        """Append new slots, whose ids `ids` holds one after another (`lengths` each), to the table; the first new
        slot's number."""
        while self.used + len(ids) > len(self.table):
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        while self.slots + len(lengths) > len(self.starts):
            self.starts = np.concatenate([self.starts, np.zeros_like(self.starts)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        first = self.slots
        self.table[self.used : self.used + len(ids)] = ids
        self.starts[first : first + len(lengths)] = self.used + np.cumsum(lengths) - lengths
        self.lengths[first : first + len(lengths)] = lengths
        self.used, self.slots = self.used + len(ids), first + len(lengths)
        return first

    @staticmethod
    def _joinable(joined: str, texts: int) -> bool:
        """Whether `joined` (`texts` texts joined as `encode_arrays` joins them) splits on spaces into each text's
        words with "\\n" after each: every text plain and NFKC (so is the whole: "\\n" and " " never combine with a
        neighbour), without a line break, none empty, none with a space at either end or two in a row."""
        return bool(
            _PLAIN_JOINED.fullmatch(joined)
            and joined.count("\n") == texts
            and "  " not in joined
            and joined[0] != " "
            and unicodedata.is_normalized("NFKC", joined)
        )

    def encode_arrays(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of `texts` one after another (int32) and each text's count. Usually the texts are plain words
        between single spaces and are split at once (joined by " \\n ": their words, with the suffix's key after
        each text); otherwise each plain text is split alone and the others go to the backend."""
        joined = " \n ".join(texts) + " " + _SUFFIX_KEY
        if texts and self._joinable(joined, len(texts)):
            return self._encoded(joined.split(" "))
        mine = [index for index, text in enumerate(texts) if _PLAIN_TEXT.fullmatch(text)]
        mine = [index for index in mine if unicodedata.is_normalized("NFKC", texts[index])]
        keys = []
        for index in mine:
            keys += self._text_keys(texts[index])
        ids, lengths = self._encoded(keys)
        if len(mine) == len(texts):
            return ids, lengths
        others = np.setdiff1d(np.arange(len(texts)), mine)
        encodings = self.backend.encode_batch_fast([texts[index] for index in others], add_special_tokens=True)
        rows = [encoding.ids for encoding in encodings]
        other_lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        table = np.concatenate([ids, np.fromiter(chain.from_iterable(rows), dtype=np.int32)])
        all_lengths, starts = np.zeros(len(texts), np.int64), np.zeros(len(texts), np.int64)
        all_lengths[mine], all_lengths[others] = lengths, other_lengths
        starts[mine] = np.cumsum(lengths) - lengths
        starts[others] = len(ids) + np.cumsum(other_lengths) - other_lengths
        return _gather(table, starts, all_lengths)

    @staticmethod
    def _text_keys(text: str) -> list[str]:
        """The keys of one plain text, then the suffix's: its words, or, with other spaces than single ones between
        words, its pieces (`" " + word` as the word, any other behind `_PIECE_MARK`)."""
        if "  " not in text and text[0] != " " != text[-1]:
            return [*text.split(" "), _SUFFIX_KEY]
        pieces = _PLAIN_SPLIT.findall(text if text[0] == " " else " " + text)
        keys = [
            piece[1:] if piece[0] == " " and piece[1:2] not in ("", " ") else _PIECE_MARK + piece for piece in pieces
        ]
        return [*keys, _SUFFIX_KEY]

    def _encoded(self, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The ids of the texts whose keys `keys` lists (each text's followed by the suffix's), one text after
        another, and each text's count: every key is a slot (looked up in C, -1 for a key the memo lacks), new keys
        get theirs (kept while the memo has room, else for this call only), and the slots' ids are gathered from the
        table at once."""
        memo, before = self.memo, len(self.memo)
        slots = np.fromiter(map(memo.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))
        missing = np.flatnonzero(slots < 0).tolist()
        new: list[str] = []
        if missing:
            found = [keys[index] for index in missing]
            new = list(dict.fromkeys(found))
            self._store(*self._keys_ids(new))
            given = dict(zip(new, range(before, before + len(new))))
            slots[missing] = np.fromiter(map(given.__getitem__, found), dtype=np.int64, count=len(found))
        ids, lengths = _gather(self.table, self.starts[slots], self.lengths[slots])
        kept = 0  # the new keys remembered, while both the keys and their ids fit; the rest served this call only
        if new:
            room = PIECE_MEMO_IDS - int(self.starts[before])  # the ids held before this call
            fitting = np.searchsorted(np.cumsum(self.lengths[before : before + len(new)]), room, side="right")
            kept = max(0, min(len(new), PIECE_MEMO_SIZE + 1 - before, int(fitting)))
            memo.update(zip(new[:kept], range(before, before + kept)))
        if kept < len(new):
            self.slots = before + kept
            self.used = int(self.starts[self.slots])
        ends = np.cumsum(lengths)[slots == 0]  # where each text's suffix ends
        return ids, np.diff(ends, prepend=0)

    def encode(self, texts: list[str]) -> list[list[int]]:
        ids, lengths = self.encode_arrays(texts)
        return [row.tolist() for row in np.split(ids, np.cumsum(lengths)[:-1])]


def _suffix_of(config: dict) -> list[int] | None:
    """The ids a `TemplateProcessing` post-processor appends to a single text (`$A` then special tokens), or None."""
    processor = config.get("post_processor") or {}
    single = processor.get("single") or []
    if (
        processor.get("type") != "TemplateProcessing"
        or not single
        or single[0] != {"Sequence": {"id": "A", "type_id": 0}}
    ):
        return None
    suffix = []
    for item in single[1:]:
        if "SpecialToken" not in item:
            return None
        suffix += processor["special_tokens"][item["SpecialToken"]["id"]]["ids"]
    return suffix


_PIECE_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _piece_encoder(tokenizer) -> _PieceEncoder | None:
    """The `_PieceEncoder` of a tokenizer built as `train_joint_tokenizer` builds one (one per tokenizer and process),
    or None for any other: another normalizer, pre-tokenizer, model setting or post-processor, or an added token that
    a plain text could hold."""
    if tokenizer in _PIECE_ENCODERS:
        return _PIECE_ENCODERS[tokenizer]
    backend = tokenizer._tokenizer
    config = json.loads(backend.to_str())
    model = config.get("model") or {}
    suffix = _suffix_of(config)
    fits = (
        config.get("normalizer") == {"type": "NFKC"}
        and config.get("pre_tokenizer") == _BYTE_LEVEL_CONFIG
        and model.get("type") == "BPE"
        and not model.get("dropout")
        and suffix is not None
        and all("<" in token["content"] for token in config.get("added_tokens") or [])
    )
    _PIECE_ENCODERS[tokenizer] = encoder = _PieceEncoder(backend, suffix) if fits else None
    return encoder


def _kept(flat: np.ndarray, lengths: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows `keep` selects of the rows `flat` holds one after another (`lengths` ids each), as one int32 array
    and the offsets of its rows."""
    offsets = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    np.cumsum(lengths[keep], out=offsets[1:])
    return flat[np.repeat(keep, lengths)], offsets


def _gather(ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`ids[starts[i]:starts[i] + lengths[i]]` for each `i`, one after another, and `lengths`: one gather, no Python
    loop over the rows."""
    shift = starts - (np.cumsum(lengths) - lengths)  # where each row starts in `ids` minus where it starts in the out
    return ids[np.repeat(shift, lengths) + np.arange(int(lengths.sum()))], lengths


def _gathered(ids: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids of `rows` (of the rows `ids` holds one after another, row `i` at `offsets[i]:offsets[i + 1]`), one
    after another, and their lengths."""
    return _gather(ids, offsets[rows], offsets[rows + 1] - offsets[rows])


@dataclass
class BatchRows:
    """The pairs of one batch as arrays: the source ids of its pairs one after another (int32) and their lengths, the
    same for the targets. `features()` gives them as `tokenize_parallel` makes them; `collate_rows` pads them."""

    source_ids: np.ndarray
    source_lengths: np.ndarray
    target_ids: np.ndarray
    target_lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.source_lengths)

    def features(self) -> list[dict[str, list[int]]]:
        """One `{input_ids, attention_mask, labels}` dict of lists per pair (what any collator is given)."""
        sources = np.split(self.source_ids, np.cumsum(self.source_lengths)[:-1])
        targets = np.split(self.target_ids, np.cumsum(self.target_lengths)[:-1])
        return [
            {"input_ids": source.tolist(), "attention_mask": [1] * len(source), "labels": target.tolist()}
            for source, target in zip(sources, targets)
        ]


@dataclass
class TokenizedBuffer:
    """A buffer's kept pairs: the source and target ids of pair `i` are `ids[offsets[i]:offsets[i + 1]]` of each side
    (`(ids, offsets)`)."""

    sources: tuple[np.ndarray, np.ndarray]
    targets: tuple[np.ndarray, np.ndarray]

    def __len__(self) -> int:
        return len(self.sources[1]) - 1

    def rows(self, rows: list[int]) -> BatchRows:
        """The pairs `rows` of the buffer, in that order."""
        indices = np.asarray(rows, dtype=np.int64)
        return BatchRows(*_gathered(*self.sources, indices), *_gathered(*self.targets, indices))

    def features(self, rows: list[int]) -> list[dict[str, list[int]]]:
        """The features of `rows`, as `tokenize_parallel` makes them (`input_ids`, `attention_mask`, `labels`)."""
        return self.rows(rows).features()


@dataclass
class StreamBatch:
    """One batch: its pairs (`rows`; `features`: as `tokenize_parallel` makes them, `input_ids`, `attention_mask`,
    `labels` per pair), the stream's pair numbers (`pairs`: the byte offset of the pair's line in a single-file
    corpus, pair `j` of a two-file corpus counting from 0, or of this process's share of a `datasets` stream), and
    the position of the stream after it."""

    rows: BatchRows
    pairs: list[int]
    position: dict[str, Any]

    @property
    def features(self) -> list[dict[str, list[int]]]:
        return self.rows.features()


class StreamedPairs(IterableDataset):
    """The training data of a streamed run: an endless iterable of token-budget batches (see the module). Iterating
    yields `(rows, position)` (`rows`: a `BatchRows`) from `start` (None: the corpus's beginning); `batches()` yields
    `StreamBatch`es.

    `replace(...)` gives a copy with other settings (the Trainer's rank, seed and budget are set that way); copies
    share `progress`, which the loader updates with the position of the last batch handed to training."""

    def __init__(
        self,
        source,
        tokenizer,
        buffer_pairs: int = DEFAULT_STREAM_BUFFER_PAIRS,
        max_source_length: int = 128,
        max_target_length: int = 128,
        max_tokens: int | None = None,
        max_sentences: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start: dict[str, Any] | None = None,
        workers: int = 1,
    ):
        self.source, self.tokenizer = source, tokenizer
        self.workers = workers
        self.buffer_pairs, self.max_source_length, self.max_target_length = (
            buffer_pairs,
            max_source_length,
            max_target_length,
        )
        self.max_tokens, self.max_sentences, self.seed = max_tokens, max_sentences, seed
        self.rank, self.world_size, self.start = rank, world_size, start
        self.progress: dict[str, Any] = {"position": start}
        self._check()

    def _check(self) -> None:
        if self.buffer_pairs < 1:
            raise ValueError(f"`stream_buffer_pairs` must be >= 1, got {self.buffer_pairs}.")
        if self.max_tokens is None and self.max_sentences is None:
            raise ValueError("A stream needs a batch size: `max_tokens` or a sentence count.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"`rank` must be in [0, {self.world_size}), got {self.rank}.")
        if self.workers < 1:
            raise ValueError(f"A stream needs at least one reader, got `workers`={self.workers}.")

    def replace(self, **changes) -> StreamedPairs:
        stream = copy.copy(self)  # shares `progress`
        for name, value in changes.items():
            if not hasattr(stream, name):
                raise AttributeError(f"StreamedPairs has no setting {name!r}.")
            setattr(stream, name, value)
        stream._check()
        return stream

    def settings(self) -> dict[str, Any]:
        """What the batches after a recorded position depend on, besides the corpus itself."""
        return {
            "stream_buffer_pairs": self.buffer_pairs,
            "max_source_length": self.max_source_length,
            "max_target_length": self.max_target_length,
            "max_tokens": self.max_tokens,
            "sentences_per_batch": self.max_sentences if self.max_tokens is None else None,
            "seed": self.seed,
            "world_size": self.world_size,
            "tokenizer_size": len(self.tokenizer),
            **({"loader_workers": self.workers} if self.workers > 1 else {}),
        }

    def __iter__(self) -> Iterator[tuple[BatchRows, dict[str, Any]]]:
        if self.workers == 1:
            for batch in self.batches(self.start):
                yield batch.rows, batch.position
            return
        info = torch.utils.data.get_worker_info()
        if info is None or info.num_workers != self.workers:
            raise RuntimeError(f"A stream of {self.workers} readers is read by a loader of {self.workers} workers.")
        # the loader takes its workers' batches in turn from worker 0: worker `i` plays the reader whose turn is `i`th
        reader = (info.id + (self.start or {}).get("next", 0)) % self.workers
        shard = self.reader_share(reader)
        for batch in shard.batches(shard.start):
            yield batch.rows, {"reader": reader, "position": batch.position}

    def reader_share(self, reader: int) -> StreamedPairs:
        """The stream of reader `reader` of this process's `workers`: reader `rank x workers + reader` of
        `world_size x workers` (counted over every process's readers: a byte range of a single file, every such pair
        of two files), read from its own recorded position, with its own buffers and seeds; so the readers tokenize in
        parallel and a resume continues each where it stopped."""
        starts = (self.start or {}).get("readers") or [None] * self.workers
        readers = self.world_size * self.workers
        share = copy.copy(self)
        share.rank, share.world_size, share.workers = self.rank * self.workers + reader, readers, 1
        share.start = starts[reader]
        return share

    def tokenize(self, pairs: list[tuple[str, str]]) -> tuple[TokenizedBuffer, list[int]]:
        """The pairs within the length limits (as `tokenize_parallel` with `drop_long`), their ids held as two flat
        int32 arrays (a buffer then takes about 0.25 KB per pair of two 30-token sentences; each chunk's ids become
        arrays as soon as they are encoded, so no buffer-long lists of Python ids are held), and the positions in
        `pairs` they came from."""
        sides: list[list[tuple[np.ndarray, np.ndarray]]] = [[], []]
        for first in range(0, len(pairs), TOKENIZE_CHUNK):
            chunk = pairs[first : first + TOKENIZE_CHUNK]
            for side, chunks in enumerate(sides):
                chunks.append(encode_arrays(self.tokenizer, [pair[side] for pair in chunk], target=side == 1))
        (source_ids, source_lengths), (target_ids, target_lengths) = (
            (np.concatenate([flat for flat, _ in chunks]), np.concatenate([lengths for _, lengths in chunks]))
            for chunks in sides
        )
        keep = (source_lengths <= self.max_source_length) & (target_lengths <= self.max_target_length)
        buffer = TokenizedBuffer(_kept(source_ids, source_lengths, keep), _kept(target_ids, target_lengths, keep))
        return buffer, np.flatnonzero(keep).tolist()

    def buffer_batches(self, lengths: list[int], pass_number: int, buffer_number: int) -> list[list[int]]:
        """The batches of one buffer (indices into it), in the order they are handed out."""
        if not lengths:
            return []
        seed = _derived_seed(self.seed, self.rank, pass_number, buffer_number)
        budget = self.max_tokens if self.max_tokens is not None else sys.maxsize
        sentences = None if self.max_tokens is not None else self.max_sentences
        batches = token_batches(lengths, budget, seed, sentences)
        generator = torch.Generator().manual_seed(_derived_seed(self.seed, self.rank, pass_number, buffer_number, 1))
        return [batches[index] for index in torch.randperm(len(batches), generator=generator).tolist()]

    def batches(self, start: dict[str, Any] | None = None) -> Iterator[StreamBatch]:
        """Batches from `start` (a position a batch carried; None: the beginning), endlessly (pass after pass)."""
        start = start or {}
        while True:
            ended: dict[str, Any] = {}  # what the pass read, filled in when it ends
            yield from self._pass(start, ended)
            self._end_pass(start.get("pass", 0), whole=start.get("reader") is None, **ended)
            start = {"pass": start.get("pass", 0) + 1, "batches": ended["delivered"]}
            start["corpus_pairs"] = ended["corpus_pairs"]

    def _pass(self, start: dict[str, Any], ended: dict[str, Any]) -> Iterator[StreamBatch]:
        """The batches of one pass over this process's share, from `start` to the end of the corpus, buffer by
        buffer; `ended` gets the counts `_end_pass` reports."""
        pass_number, buffer_number = start.get("pass", 0), start.get("buffer", 0)
        done, delivered, corpus_pairs = start.get("done", 0), start.get("batches", 0), start.get("corpus_pairs")
        reader = self.source.reader(start.get("reader"), self.rank, self.world_size)
        read = kept_in_pass = 0
        try:
            buffer_start = reader.position()
            while True:
                numbered = [(reader.last, source, target) for source, target in islice(reader, self.buffer_pairs)]
                if not numbered:
                    break
                buffer_end = reader.position()
                read += len(numbered)
                kept, indices = self.tokenize([(source, target) for _, source, target in numbered])
                numbers = [numbered[index][0] for index in indices]
                del numbered  # the text is not kept while the buffer's batches are handed out
                kept_in_pass += len(kept)
                place = {"pass": pass_number, "buffer": buffer_number, "start": buffer_start, "end": buffer_end}
                for batch in self._buffer(kept, numbers, {**place, "corpus_pairs": corpus_pairs}, done, delivered):
                    delivered = batch.position["batches"]
                    yield batch
                buffer_number, done, buffer_start = buffer_number + 1, 0, buffer_end
            ended.update(corpus_pairs=reader.pair, dropped_rows=getattr(reader, "dropped", 0))
        finally:
            reader.close()
        ended.update(read=read, kept=kept_in_pass, delivered=delivered)

    def _buffer(self, kept: TokenizedBuffer, numbers: list[int], place: dict[str, Any], done: int, delivered: int):
        """The batches of one buffer (`kept`: its tokenized pairs, `numbers`: their pair numbers) after the `done`
        already handed out, each with the position after it (`delivered`: batches handed out before)."""
        lengths = np.maximum(np.diff(kept.sources[1]), np.diff(kept.targets[1])).tolist()
        order = self.buffer_batches(lengths, place["pass"], place["buffer"])
        for index in range(done, len(order)):
            delivered += 1
            last = index == len(order) - 1
            position = {
                "pass": place["pass"],
                "buffer": place["buffer"] + 1 if last else place["buffer"],
                "reader": place["end"] if last else place["start"],
                "done": 0 if last else index + 1,
                "batches": delivered,
                "corpus_pairs": place["corpus_pairs"],
            }
            rows = order[index]
            yield StreamBatch(kept.rows(rows), [numbers[row] for row in rows], position)

    def _end_pass(self, pass_number: int, whole: bool, read: int, kept: int, dropped_rows: int, **_) -> None:
        """What a pass says when it ends: the pairs it dropped; an error when a whole pass kept none."""
        if read > kept:
            logger.warning(
                f"Streaming pass {pass_number + 1}: dropped {read - kept} of {read} pairs longer than "
                f"{self.max_source_length} source / {self.max_target_length} target tokens"
                + (f" (process {self.rank} of {self.world_size})." if self.world_size > 1 else ".")
            )
        if dropped_rows:
            logger.warning(f"Streaming pass {pass_number + 1}: dropped {dropped_rows} rows with an empty side.")
        if whole and kept == 0:
            share = f" for process {self.rank} of {self.world_size}" if self.world_size > 1 else ""
            if read == 0:
                raise ValueError(f"The streamed corpus holds no sentence pairs{share}; give one with pairs.")
            raise ValueError(
                f"No training pair{share} is within `max_source_length={self.max_source_length}` / "
                f"`max_target_length={self.max_target_length}` tokens ({read} pairs read); raise them."
            )

    def train_dataloader(self, trainer) -> StreamLoader:
        """The Trainer's loader of this stream (`streaming_dataloader`): the training-data seam of
        `hf_deep_nmt.data.training_data`, which a tokenized dataset offers too."""
        return streaming_dataloader(trainer, self)


class StreamedCorpus:
    """`Prepared.raw["train"]` of a streamed run: its length is the corpus's pair count once a pass has ended, until
    then the pairs read so far (what the model card can say); for a single-file corpus read in byte ranges, the pairs
    of this process's ranges (the whole corpus with one process)."""

    def __init__(self, stream: StreamedPairs):
        self.stream = stream

    def __len__(self) -> int:
        position = self.stream.progress.get("position")
        positions = (
            [item for item in position["readers"] if item] if position and "readers" in position else [position]
        )
        if not positions or not positions[0]:
            return 0
        counts = [item.get("corpus_pairs") or item["reader"]["pair"] for item in positions]
        # readers of byte ranges count their own range's pairs: together, this process's share
        return sum(counts) if "range" in positions[0]["reader"] else max(counts)


# ---- the Trainer's side: loader, recorded position, resume ----------------------------------------------------------


def _fast_settings(collator) -> dict[str, Any] | None:
    """What `collate_rows` needs to make the batches `collator` makes, when it is a `DataCollatorForSeq2Seq` that
    pads to the longest pair (`pad_to_multiple_of` allowed) into torch tensors with a tokenizer whose `pad` is
    transformers' own; None for any other collator or setting, which then gets the features as lists."""
    tokenizer = getattr(collator, "tokenizer", None)
    names = list(getattr(tokenizer, "model_input_names", None) or [])
    multiple = getattr(collator, "pad_to_multiple_of", None)
    fits = (
        type(collator) is DataCollatorForSeq2Seq
        and collator.padding in (True, "longest", PaddingStrategy.LONGEST)
        and collator.max_length is None
        and collator.return_tensors == "pt"
        and isinstance(collator.label_pad_token_id, int)
        and (multiple is None or (isinstance(multiple, int) and multiple > 0))
        and names[:1] == ["input_ids"]
        and "attention_mask" in names
        and isinstance(tokenizer.pad_token_id, int)
        and tokenizer.padding_side in ("left", "right")
        and type(tokenizer).pad is PreTrainedTokenizerBase.pad
        and type(tokenizer)._pad is PreTrainedTokenizerBase._pad
    )
    if not fits:
        return None
    model = collator.model
    shift = getattr(model, "prepare_decoder_input_ids_from_labels", None) if model is not None else None
    return {
        "pad": tokenizer.pad_token_id,
        "label_pad": collator.label_pad_token_id,
        "left": tokenizer.padding_side == "left",
        "multiple": multiple,
        "shift": shift,
    }


def _padded(ids: np.ndarray, lengths: np.ndarray, value: int, left: bool, multiple: int | None):
    """The rows (`ids` one after another, `lengths` each) padded with `value` to the longest (rounded up to a
    multiple of `multiple`) on the right, or the `left`, as int64; and where the ids are (the attention mask)."""
    width = int(lengths.max())
    if multiple is not None and width % multiple:
        width += multiple - width % multiple
    columns = np.arange(width)
    mask = columns >= (width - lengths)[:, None] if left else columns < lengths[:, None]
    padded = np.full(mask.shape, value, dtype=np.int64)
    padded[mask] = ids  # row after row, each row's ids in order: the order `ids` holds them in
    return padded, mask


def collate_rows(rows: BatchRows, settings: dict[str, Any]) -> BatchEncoding:
    """The batch `DataCollatorForSeq2Seq` makes of `rows.features()` (the collator `_fast_settings` read `settings`
    from), tensor for tensor, padded from the arrays at once: `input_ids` and `attention_mask` as `tokenizer.pad`
    pads them, `labels` padded with the label padding, `decoder_input_ids` from the model's own
    `prepare_decoder_input_ids_from_labels`; all int64."""
    inputs, mask = _padded(
        rows.source_ids, rows.source_lengths, settings["pad"], settings["left"], settings["multiple"]
    )
    labels, _ = _padded(
        rows.target_ids, rows.target_lengths, settings["label_pad"], settings["left"], settings["multiple"]
    )
    batch = {
        "input_ids": torch.from_numpy(inputs),
        "attention_mask": torch.from_numpy(mask.astype(np.int64)),
        "labels": torch.from_numpy(labels),
    }
    if settings["shift"] is not None:
        batch["decoder_input_ids"] = settings["shift"](labels=batch["labels"])
    return BatchEncoding(batch)


@dataclass
class PackedBatch:
    """A collated batch's int64 tensors as one (`ids`), with each one's key and shape, as a loader worker hands it to
    the main process. Pickled by value (`__reduce__`: the ids' bytes go through the loader's pipe): a tensor would go
    through shared memory of its own (a file made and mapped, its descriptor sent over a socket the main process
    connects to), which cost the main process 1.5-3 ms a batch, more than the worker's whole batch; the bytes of a
    batch (tens of kilobytes) are read in tens of microseconds."""

    ids: torch.Tensor
    shapes: list[tuple[str, tuple[int, ...]]]

    def __reduce__(self):
        return _unpickled_batch, (self.ids.numpy(), self.shapes)

    @classmethod
    def of(cls, batch: BatchEncoding) -> PackedBatch | BatchEncoding:
        """`batch` packed, or as it is when a tensor is not int64 (another model's decoder inputs)."""
        if any(tensor.dtype != torch.int64 for tensor in batch.values()):
            return batch
        shapes = [(key, tuple(tensor.shape)) for key, tensor in batch.items()]
        return cls(torch.cat([tensor.reshape(-1) for tensor in batch.values()]), shapes)

    def unpacked(self) -> BatchEncoding:
        """The batch again: each tensor a contiguous view of `ids`, equal to the one packed."""
        batch, start = {}, 0
        for key, shape in self.shapes:
            size = math.prod(shape)
            batch[key], start = self.ids[start : start + size].view(shape), start + size
        return BatchEncoding(batch)


def _unpickled_batch(ids: np.ndarray, shapes: list[tuple[str, tuple[int, ...]]]) -> PackedBatch:
    """A `PackedBatch` from its pickled ids (a writable array: pickle gives a writable buffer back as a bytearray)."""
    return PackedBatch(torch.from_numpy(ids if ids.flags.writeable else ids.copy()), shapes)


class StreamCollator:
    """The loader's `collate_fn` of a stream: `(rows, position)` -> `(batch, position)`. The Trainer's
    `DataCollatorForSeq2Seq` spends as much CPU as the rest of the loader on per-pair Python (lists padded one by
    one, then turned into tensors); where `_fast_settings` says `collate_rows` makes the same batch, it is made from
    the arrays instead (`pack`: handed over as a `PackedBatch`, for a loader worker). Any other collator is called
    with the features as lists, as it would be without streaming."""

    def __init__(self, collator, pack: bool = False):
        self.collator, self.settings, self.pack = collator, _fast_settings(collator), pack

    def __call__(self, item: tuple[BatchRows, dict[str, Any]]):
        rows, position = item
        # a side with no ids at all: the collator's own tensors (torch makes float32 of empty lists)
        if self.settings is None or not (rows.source_lengths.max() and rows.target_lengths.max()):
            return self.collator(rows.features()), position
        batch = collate_rows(rows, self.settings)
        return (PackedBatch.of(batch) if self.pack else batch), position


def _start_worker(_: int) -> None:
    """A loader worker's start: what it inherited from the forked process is set apart from its garbage collections,
    which would otherwise walk (and so copy, page by page) the whole inherited heap: measured, a fifth of the CPU of
    two workers' pass over 20,000 pairs, and two thirds of their page faults."""
    gc.freeze()


class StreamLoader:
    """The training data loader of a streamed run: batches of `stream` from its `start`, collated (in one worker
    process with `num_workers=1`, in N with N readers); `position` is the stream's position after the last batch
    handed out. Not passed
    through `accelerate` (which would dispatch an iterable's batches from the main process) nor pinned: the Trainer
    moves each batch (a few kilobytes of ids) to the device."""

    def __init__(self, stream: StreamedPairs, collator, num_workers: int = 0):
        self.stream, self.collator, self.num_workers = stream, collator, num_workers
        self.position = stream.start
        if stream.workers > 1 and num_workers != stream.workers:
            raise ValueError(f"A stream of {stream.workers} readers needs {stream.workers} loader workers.")

    def __iter__(self):
        loader = DataLoader(
            self.stream.replace(start=self.position),
            batch_size=None,
            collate_fn=StreamCollator(self.collator, pack=self.num_workers > 0),
            num_workers=self.num_workers,
            worker_init_fn=_start_worker if self.num_workers > 0 else None,
            # its own generator: starting the loader draws a seed, which must not shift the global random state (a
            # resumed run restores it before the loader starts, the uninterrupted one started it at step 0)
            generator=torch.Generator(),
        )
        readers = self.stream.workers
        start = self.position or {}
        handed, positions = start.get("batches", 0), list(start.get("readers") or [None] * readers)
        for batch, position in loader:
            if isinstance(batch, PackedBatch):
                batch = batch.unpacked()
            if readers > 1:  # the position of every reader: each continues from its own on a resume
                positions[position["reader"]] = position["position"]
                handed += 1
                position = {"batches": handed, "next": handed % readers, "readers": list(positions)}
            self.position = self.stream.progress["position"] = position
            yield batch


class StreamPositionRecorder(TrainerCallback):
    """Write the stream position of every process into each checkpoint (`stream_state.json`); `DeepNMTTrainer`
    places it before its checksum recorder (`add_checkpoint_writer`), so the file is among the checkpoint's recorded
    files."""

    def __init__(self, loader: StreamLoader):
        self.loader = loader

    def on_save(self, args, state, control, **kwargs):
        position = self.loader.position
        expected = state.global_step * args.gradient_accumulation_steps
        handed = (position or {}).get("batches", 0)
        if handed != expected:
            raise RuntimeError(
                f"The stream handed {handed} batches to training but step {state.global_step} x "
                f"{args.gradient_accumulation_steps} accumulation means {expected}: its position cannot be recorded "
                "for this checkpoint."
            )
        positions = [position]
        if args.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            positions = [None] * args.world_size
            torch.distributed.all_gather_object(positions, position)
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        stream = self.loader.stream
        record = {
            "format": STREAM_STATE_FORMAT,
            "settings": stream.settings(),
            "source": stream.source.identity(),
            "source_sha256": stream.source.digests(),
            "processes": positions,
        }
        write_json_atomically(folder / STREAM_STATE_FILE, record)


def recorded_position(checkpoint: str | Path, stream: StreamedPairs) -> dict[str, Any]:
    """This process's stream position recorded in `checkpoint`, after checking that it still means the same place:
    `ValueError` naming the checkpoint and the reason when it has no record (not a streamed run's), when a setting the
    batches depend on changed (naming old and new values), or when the corpus changed."""
    checkpoint = Path(checkpoint)
    path = checkpoint / STREAM_STATE_FILE
    way_out = "keep the settings it was written with, or start afresh in another output_dir"
    if not path.is_file():
        raise ValueError(
            f"Checkpoint {str(checkpoint)!r} has no {STREAM_STATE_FILE}: it was not written by a streaming run "
            "(`streaming: true`), so where its training stopped in the corpus is unknown and streaming from it would "
            "replay or skip data. Resume it without `streaming`, or start afresh in another output_dir."
        )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        settings, identity, positions = record["settings"], record["source"], record["processes"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{str(path)!r} cannot be read ({error}); restore it, or start afresh.") from None
    current = stream.settings()
    changed = [
        f"{key}: {settings.get(key)!r} -> {current.get(key)!r}"
        for key in [*current, *(key for key in settings if key not in current)]
        if settings.get(key) != current.get(key)
    ]
    if changed:
        raise ValueError(
            f"Checkpoint {str(checkpoint)!r} recorded its stream position with other settings ({'; '.join(changed)}): "
            f"the batches after it would not be those of the interrupted run; {way_out}."
        )
    now = stream.source.identity()
    if identity != now:
        raise ValueError(
            f"Checkpoint {str(checkpoint)!r} recorded its stream position in another corpus ({identity} then, {now} "
            "now): the corpus changed, and the recorded position would not be the same place in it. Restore the "
            "corpus it was written with, or start afresh in another output_dir."
        )
    if not isinstance(positions, list) or len(positions) != stream.world_size:
        raise ValueError(f"{str(path)!r} does not hold one position per process ({stream.world_size}); {way_out}.")
    position = positions[stream.rank]
    readers = (position or {}).get("readers")
    for index, item in enumerate(readers or [position]):
        share = (stream.rank * stream.workers + index, stream.world_size * stream.workers) if readers else None
        if item is not None:
            where = f"Checkpoint {str(checkpoint)!r}"
            stream.source.check_position(item["reader"], where, share or (stream.rank, stream.world_size))
    stream.source.check_digests(record.get("source_sha256"), f"Checkpoint {str(checkpoint)!r}")
    return position


def streaming_dataloader(trainer, stream: StreamedPairs) -> StreamLoader:
    """The training loader of `stream` for a `DeepNMTTrainer`: the stream for this process (rank, world size, seed
    and budget from the Trainer's arguments), continued from the position recorded in the checkpoint the Trainer
    resumes from, with a `StreamPositionRecorder` among the checkpoint's writers (before the checksums)."""
    args = trainer.args
    stream = stream.replace(
        max_tokens=args.max_tokens,
        max_sentences=None if args.max_tokens is not None else args.per_device_train_batch_size,
        seed=args.data_seed if args.data_seed is not None else args.seed,
        rank=args.process_index,
        world_size=max(1, args.world_size),
        workers=max(1, args.dataloader_num_workers),
    )
    # the stream resumes from its recorded position; the Trainer must not also skip (read and drop) batches
    args.ignore_data_skip = True
    checkpoint = getattr(trainer, "resuming_from", None)
    if checkpoint is True or (isinstance(checkpoint, str) and checkpoint.lower() in ("true", "last")):
        checkpoint = get_last_checkpoint(args.output_dir)
    start = recorded_position(checkpoint, stream) if checkpoint else None
    if start is not None and "readers" in start:
        logger.warning(f"Streaming resumes {stream.workers} readers where each stopped ({start['batches']} batches).")
    elif start is not None:
        logger.warning(
            f"Streaming resumes at pass {start['pass'] + 1}, buffer {start['buffer'] + 1}, after {start['done']} of "
            f"its batches ({start['batches']} batches trained)."
        )
    loader = StreamLoader(stream.replace(start=start), trainer.data_collator, args.dataloader_num_workers)
    trainer.add_checkpoint_writer(StreamPositionRecorder(loader))
    return loader


# ---- preparing a streamed run ---------------------------------------------------------------------------------------


def stream_source(data_args, corpus: dict):
    """The corpus a streamed run reads: `dataset_name`'s train split, else `train_file` (the precedence of
    `hf_deep_nmt.data.corpus.load_parallel_dataset`; `corpus`: its files as the run's plan checked them)."""
    languages = (data_args.source_lang, data_args.target_lang)
    if data_args.dataset_name:
        return HubSource(data_args.dataset_name, data_args.dataset_config, *languages)
    return FileSource(data_args.train_file, *languages, corpus.get(data_args.train_file))


def read_validation(data_args, corpus: dict) -> datasets.Dataset | None:
    """The validation pairs (`source`/`target` columns), read whole as without streaming: `validation_file`, or
    `dataset_name`'s `dataset_validation_split` (streamed and kept, at most `max_eval_samples` rows)."""
    if data_args.dataset_name:
        name, split = data_args.dataset_name, data_args.dataset_validation_split
        splits = _split_names(name, data_args.dataset_config)
        if "train" not in splits:
            raise ValueError(f"Dataset {name!r} has no 'train' split; it has {sorted(splits)}.")
        if split not in splits:
            if split != "validation":
                raise ValueError(f"Dataset {name!r} has no {split!r} split; it has {sorted(splits)}.")
            logger.warning(f"Dataset {name!r} has no 'validation' split: there will be no evaluation.")
            return None
        streamed = load_named_dataset(name, data_args.dataset_config, split, streaming=True)
        rows = list(islice(streamed, data_args.max_eval_samples))
        return _translation_pairs(
            datasets.Dataset.from_list(rows, features=streamed.features),
            f"{name}[{split}]",
            data_args.source_lang,
            data_args.target_lang,
        )
    train_file, path = data_args.train_file, data_args.validation_file
    if path is None:
        return None
    warn_if_validation_is_training(train_file, path)
    files = corpus.get(path)
    pairs = read_parallel_file(path, data_args.source_lang, data_args.target_lang, files)
    check_read_pairs(path, "validation_file", pairs, data_args.source_lang, data_args.target_lang)
    return datasets.Dataset.from_dict(pairs)
