"""Parallel text -> `datasets` objects: local TSV / JSONL / two-file corpora and `datasets.load_dataset` names.

Malformed input stops with the file and line at fault; nothing is dropped silently (length filtering logs a count).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from importlib import resources
from pathlib import Path

import datasets
import huggingface_hub
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging

from hf_deep_nmt.folders import path_kind

logger = logging.get_logger(__name__)

SOURCE, TARGET = "source", "target"
NUL = b"\0"


def sample_corpus_dir() -> Path:
    """Folder of the bundled Spanish-English sample corpus (`train.tsv`, `valid.tsv`)."""
    return Path(str(resources.files("hf_deep_nmt") / "sample_data"))


def check_corpus_file(path: Path) -> None:
    """`FileNotFoundError` / `IsADirectoryError` / `ValueError` naming `path` when it is not a regular file that can be
    read: missing, a symbolic link to nothing or a loop of links, a folder, a FIFO or device, unreadable."""
    kind = path_kind(path)
    if kind == "missing":
        raise FileNotFoundError(f"Parallel text file not found: {path} (check the path in the recipe).")
    if kind == "loop":
        raise ValueError(
            f"Parallel text file {path} is a loop of symbolic links (it leads back to itself); point the link "
            "at the corpus file."
        )
    if kind == "dangling":
        raise FileNotFoundError(
            f"Parallel text file {path} is a symbolic link to {os.readlink(path)!r}, which does not exist; point "
            "the link at the corpus file, or name the file itself."
        )
    if kind == "folder":
        raise IsADirectoryError(
            f"Parallel text file {path} is a folder, not a file; name a .tsv or .jsonl file in it, or a two-file "
            "prefix."
        )
    if kind == "special":
        raise ValueError(
            f"Parallel text file {path} is not a regular file (a FIFO, socket or device); save its text to a "
            f"file first (`cat {path} > corpus{path.suffix}`) and name that file."
        )
    if not os.access(path, os.R_OK):
        raise PermissionError(f"Parallel text file {path} cannot be read by this user (permission denied).")


UTF16_MARKS = (b"\xff\xfe", b"\xfe\xff")


def _looks_utf16(raw: bytes) -> bool:
    """A UTF-16 byte-order mark, or ASCII text with a NUL after (or before) each letter."""
    if raw.startswith(UTF16_MARKS):
        return True
    pairs = raw[: len(raw) // 2 * 2]
    even, odd = set(pairs[0::2]), set(pairs[1::2])
    return len(pairs) >= 4 and ({0} in (even, odd)) and even != odd


def decode_line(path: Path, number: int, raw: bytes) -> str:
    """Line `number` of `path` as text: UTF-16 and a byte-order mark on line 1, NUL bytes and invalid UTF-8 are
    errors naming the file and line (one definition for the readers here and the streaming reader)."""
    if number == 1 and _looks_utf16(raw):
        raise ValueError(
            f"{path} is UTF-16 text, not UTF-8; convert it first, keeping every character: "
            f"`iconv -f UTF-16 -t UTF-8 {path} > {path.stem}.utf8{path.suffix}`."
        )
    if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    if NUL in raw:
        raise ValueError(
            f"{path}:{number}: NUL byte at column {raw.index(NUL) + 1}; a text corpus holds none (remove "
            "them, e.g. `tr -d '\\000'`, or fix the tool that wrote the file)."
        )
    try:
        text = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path}:{number}: not valid UTF-8 ({error.reason} at byte {error.start} of the line, "
            f"0x{raw[error.start]:02x}); find the file's encoding (`file -i {path}`) and convert it "
            f"(`iconv -f ENCODING -t UTF-8`)."
        ) from None
    check_line_breaks(path, number, text)
    return text


# Characters that some readers take for the end of a line and others do not (Python's `str.splitlines` and text
# files opened with universal newlines split on them, `wc -l`, this reader and most command-line tools only on \n):
# inside a sentence they would make readers disagree on where a pair ends and the two sides of a corpus drift apart,
# so a corpus line holding one is refused, naming it. (A CR right before the \n of a CRLF line ending is no such
# character: it is removed with the line ending.)
LINE_BREAKS = {
    "\r": "carriage return",
    "\x0b": "vertical tab",
    "\x0c": "form feed",
    "\x1c": "file separator",
    "\x1d": "group separator",
    "\x1e": "record separator",
    "\x85": "next line",
    "\u2028": "line separator",
    "\u2029": "paragraph separator",
}
_LINE_BREAK = re.compile(f"[{''.join(LINE_BREAKS)}]")


def check_line_breaks(path: Path, number: int, text: str) -> None:
    """`ValueError` naming `path`, line `number`, the character and its column when `text` (a line, or a sentence of
    it) holds one of `LINE_BREAKS`."""
    found = _LINE_BREAK.search(text)
    if found is not None:
        character = found.group()
        raise ValueError(
            f"{path}:{number}: a {LINE_BREAKS[character]} (U+{ord(character):04X}) at column {found.start() + 1} "
            "inside a sentence; some readers split lines on it and others do not, so the pairs would not line up. "
            "Replace it with a space, e.g. `perl -CSD -pi -e 's/[\\r\\x0b\\x0c\\x1c-\\x1e\\x85\\x{2028}\\x{2029}]"
            f"(?!\\n)/ /g' {path}`."
        )


def _lines(path: Path):
    """(line number, text) of a UTF-8 file (`decode_line`) that `check_corpus_file` accepted: the public readers check
    the path they are given, `iter_parallel_file` reads the files `parallel_files` (or a run's plan) checked."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            yield number, decode_line(path, number, raw)


def _content_lines(path: Path):
    """`_lines` without blank lines at the end of the file; a blank line followed by more text is an error (it would
    otherwise be a pair dropped without a word)."""
    blank = None
    for number, line in _lines(path):
        if not line.strip():
            blank = blank or number
            continue
        if blank is not None:
            raise ValueError(f"{path}:{blank}: empty line inside the file (only trailing blank lines are allowed).")
        yield number, line


def _check_pair(path: Path, number: int, source: str, target: str) -> None:
    if not source.strip() or not target.strip():
        side = "source" if not source.strip() else "target"
        raise ValueError(f"{path}:{number}: empty {side} side.")


def tsv_pair(path: Path, number: int, line: str) -> tuple[str, str]:
    """Line `number` of a `source<TAB>target` file as a checked pair: exactly one tab, no empty side."""
    fields = line.split("\t")
    if len(fields) != 2:
        way_out = (
            "no tab: separate source and target with one tab, or name a two-file corpus by its prefix"
            if len(fields) == 1
            else "a tab inside a sentence: replace it with a space"
        )
        raise ValueError(
            f"{path}:{number}: expected 2 tab-separated fields (source, target), got {len(fields)} ({way_out})."
        )
    _check_pair(path, number, *fields)
    return fields[0], fields[1]


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    record = dict(pairs)
    if len(record) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return record


def jsonl_pair(path: Path, number: int, line: str, source_key: str, target_key: str) -> tuple[str, str]:
    """Line `number` of a JSONL file as a checked pair: an object with `source_key` and `target_key` string fields (or
    a `translation` dict holding them), no empty side."""
    try:
        record = json.loads(line, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}:{number}: invalid JSON ({error.msg}).") from None
    except _DuplicateKey as error:
        raise ValueError(
            f"{path}:{number}: the key {error.args[0]!r} is given twice in one object (JSON readers differ on "
            "which one counts); keep one."
        ) from None
    record = record.get("translation", record) if isinstance(record, dict) else record
    if (
        not isinstance(record, dict)
        or not isinstance(record.get(source_key), str)
        or not isinstance(record.get(target_key), str)
    ):
        found = sorted(record) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise ValueError(
            f"{path}:{number}: expected string fields {source_key!r} and {target_key!r}, got {found}; each line "
            f"must be an object like {{{source_key!r}: ..., {target_key!r}: ...}} or "
            f"{{'translation': {{{source_key!r}: ..., {target_key!r}: ...}}}} (`source_lang` / `target_lang` "
            "name the keys)."
        )
    for side in (record[source_key], record[target_key]):  # a JSON string may hold an escaped line break
        check_line_breaks(path, number, side)
    _check_pair(path, number, record[source_key], record[target_key])
    return record[source_key], record[target_key]


def iter_tsv(path: str | Path):
    """(line number, source, target) of a `source<TAB>target` file, one line at a time; blank final lines are
    allowed, a line without exactly one tab is not."""
    path = Path(path)
    check_corpus_file(path)
    yield from _tsv_rows(path)


def iter_jsonl(path: str | Path, source_key: str, target_key: str):
    """(line number, source, target) of a file with one JSON object per line with `source_key` and `target_key`
    string fields (or a `translation` dict), one line at a time."""
    path = Path(path)
    check_corpus_file(path)
    yield from _jsonl_rows(path, source_key, target_key)


def iter_two_files(source_path: str | Path, target_path: str | Path):
    """(line number, source, target) of line-aligned source and target files, one line at a time. Their line counts
    must match; that is checked first, as when the files are read whole: an empty line is reported only once both
    files are read to their end with the same count, and no pair is yielded after it."""
    source_path, target_path = Path(source_path), Path(target_path)
    check_corpus_file(source_path)
    check_corpus_file(target_path)
    yield from _two_file_rows(source_path, target_path)


def _tsv_rows(path: Path):
    for number, line in _content_lines(path):
        yield number, *tsv_pair(path, number, line)


def _jsonl_rows(path: Path, source_key: str, target_key: str):
    for number, line in _content_lines(path):
        yield number, *jsonl_pair(path, number, line, source_key, target_key)


def _two_file_rows(source_path: Path, target_path: Path):
    empty, counts = None, [0, 0]
    for source, target in itertools.zip_longest(_lines(source_path), _lines(target_path)):
        if source is None or target is None:  # one file goes on: count its lines, then refuse
            counts = [counts[0] + (source is not None), counts[1] + (target is not None)]
            continue
        number, counts = source[0], [source[0], target[0]]
        if empty is None and (not source[1].strip() or not target[1].strip()):
            empty = (source_path if not source[1].strip() else target_path, number)
        if empty is None:
            yield number, source[1], target[1]
    if counts[0] != counts[1]:
        raise ValueError(
            f"{source_path} has {counts[0]} lines but {target_path} has {counts[1]}; parallel files must align."
        )
    if empty is not None:
        raise ValueError(f"{empty[0]}:{empty[1]}: empty line in a parallel file.")


def _as_lists(rows) -> dict[str, list[str]]:
    pairs: dict[str, list[str]] = {SOURCE: [], TARGET: []}
    for _, source, target in rows:
        pairs[SOURCE].append(source)
        pairs[TARGET].append(target)
    return pairs


def read_tsv(path: str | Path) -> dict[str, list[str]]:
    """`source<TAB>target` per line (`iter_tsv`), as lists."""
    return _as_lists(iter_tsv(path))


def read_jsonl(path: str | Path, source_key: str, target_key: str) -> dict[str, list[str]]:
    """One JSON object per line (`iter_jsonl`), as lists."""
    return _as_lists(iter_jsonl(path, source_key, target_key))


def read_two_files(source_path: str | Path, target_path: str | Path) -> dict[str, list[str]]:
    """Line-aligned source and target files (`iter_two_files`), as lists."""
    return _as_lists(iter_two_files(source_path, target_path))


def parallel_files(path: str | Path, source_lang: str = "src", target_lang: str = "tgt") -> list[Path]:
    """The files `read_parallel_file` reads for `path`, each checked (`check_corpus_file`) without reading it: cheap,
    for checking a recipe before any work."""
    path = Path(path)
    if path.suffix in (".tsv", ".jsonl", ".json"):
        files = [path]
    else:
        files = [Path(f"{path}.{source_lang}"), Path(f"{path}.{target_lang}")]
        if not any(os.path.lexists(file) for file in files):
            raise ValueError(
                f"Cannot read parallel text from {str(path)!r}: expected a .tsv or .jsonl file, or a prefix with "
                f"{files[0].name!r} and {files[1].name!r} beside it."
            )
    for file in files:
        check_corpus_file(file)
    return files


def iter_parallel_file(
    path: str | Path, source_lang: str = "src", target_lang: str = "tgt", files: list[Path] | tuple | None = None
):
    """(line number, source, target), one pair at a time, dispatching on the file name: `.tsv`, `.jsonl`, or a
    prefix with `{prefix}.{source_lang}` and `{prefix}.{target_lang}` beside it. `files`: what `parallel_files`
    returned for `path`, when a run's plan already checked them."""
    files = files or parallel_files(path, source_lang, target_lang)  # each file checked there, not again here
    if files[0].suffix == ".tsv" and len(files) == 1:
        return _tsv_rows(files[0])
    if len(files) == 1:
        return _jsonl_rows(files[0], source_lang, target_lang)
    return _two_file_rows(*files)


def read_parallel_file(
    path: str | Path, source_lang: str = "src", target_lang: str = "tgt", files: list[Path] | tuple | None = None
) -> dict[str, list[str]]:
    """`iter_parallel_file` as lists."""
    return _as_lists(iter_parallel_file(path, source_lang, target_lang, files))


def write_parallel_arrow(
    path: str | Path,
    destination: str | Path,
    name: str,
    source_lang: str = "src",
    target_lang: str = "tgt",
    files: list[Path] | tuple | None = None,
) -> datasets.Dataset:
    """The corpus `read_parallel_file` reads, written to the Arrow file `destination` in batches as it is read (each
    line checked the same way) and returned memory-mapped: memory stays bounded whatever the corpus size. `name` is
    the recipe field that named `path` (for the errors); `files`, as for `iter_parallel_file`."""
    from datasets.arrow_writer import ArrowWriter

    features = datasets.Features({SOURCE: datasets.Value("string"), TARGET: datasets.Value("string")})
    batch: dict[str, list[str]] = {SOURCE: [], TARGET: []}
    with ArrowWriter(features=features, path=str(destination)) as writer:
        for _, source, target in iter_parallel_file(path, source_lang, target_lang, files):
            batch[SOURCE].append(source)
            batch[TARGET].append(target)
            if len(batch[SOURCE]) == WRITE_BATCH:
                writer.write_batch(batch)
                batch = {SOURCE: [], TARGET: []}
        if batch[SOURCE]:
            writer.write_batch(batch)
        writer.finalize()
    dataset = datasets.Dataset.from_file(str(destination))
    check_read_pairs(path, name, dataset, source_lang, target_lang)
    return dataset


WRITE_BATCH = 10_000  # pairs held in memory at once by `write_parallel_arrow`


def check_read_pairs(path, name: str, pairs, source_lang: str, target_lang: str) -> None:
    """`ValueError` for a corpus without pairs or with only a header line; a warning for a first line that looks like
    a header. `pairs` is a `Dataset` or a dict of lists with `source` / `target`."""
    count = len(pairs) if isinstance(pairs, datasets.Dataset) else len(pairs[SOURCE])
    if not count:
        raise ValueError(f"`{name}` {str(path)!r} holds no sentence pairs; give a corpus with at least one.")
    first = (pairs[SOURCE][0], pairs[TARGET][0]) if isinstance(pairs, dict) else (pairs[0][SOURCE], pairs[0][TARGET])
    if _warn_on_header(path, first, count, source_lang, target_lang) and count == 1:
        raise ValueError(
            f"`{name}` {str(path)!r} holds only a header line ({first[0]!r} / {first[1]!r}) and "
            "no sentence pairs; give a corpus with at least one (a header line is not needed)."
        )


def _translation_pairs(dataset: datasets.Dataset, name: str, source_lang: str, target_lang: str) -> datasets.Dataset:
    """`translation: {lang: text}` rows (the Hub's translation datasets) -> `source`/`target` columns, in Arrow.
    Pairs with an empty side are dropped and counted in the log."""
    if "translation" not in dataset.column_names:
        raise ValueError(f"{name}: expected a 'translation' column of {{language: text}}, got {dataset.column_names}.")
    feature = dataset.features["translation"]
    # `datasets.Translation` lists its languages; a column read from JSON is a dict of string features
    languages = sorted(getattr(feature, "languages", None) or (feature if isinstance(feature, dict) else []))
    missing = [lang for lang in (source_lang, target_lang) if lang not in languages]
    if missing:
        raise ValueError(f"{name}: no {missing} text in its translations; it has {languages}.")

    def split_pairs(batch):
        return {
            SOURCE: [pair[source_lang] for pair in batch["translation"]],
            TARGET: [pair[target_lang] for pair in batch["translation"]],
        }

    pairs = dataset.map(split_pairs, batched=True, remove_columns=dataset.column_names, desc=f"Reading {name}")
    before = len(pairs)
    pairs = pairs.filter(lambda row: bool(row[SOURCE].strip()) and bool(row[TARGET].strip()), desc="Empty sides")
    if len(pairs) < before:
        logger.warning(f"{name}: dropped {before - len(pairs)} of {before} pairs with an empty side.")
    return pairs


def load_parallel_dataset(
    train_file: str | Path | None = None,
    validation_file: str | Path | None = None,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    source_lang: str = "src",
    target_lang: str = "tgt",
    validation_split: str = "validation",
) -> datasets.DatasetDict:
    """A `DatasetDict` with `source`/`target` string columns, from local files or a `datasets` name."""
    if dataset_name:
        raw = load_named_dataset(dataset_name, dataset_config)
        if "train" not in raw:
            raise ValueError(f"Dataset {dataset_name!r} has no 'train' split; it has {sorted(raw)}.")
        if validation_split not in raw:
            if validation_split != "validation":
                raise ValueError(f"Dataset {dataset_name!r} has no {validation_split!r} split; it has {sorted(raw)}.")
            logger.warning(f"Dataset {dataset_name!r} has no 'validation' split: there will be no evaluation.")
        splits = {}
        for split, name in (("train", "train"), ("validation", validation_split)):
            if name in raw:
                splits[split] = _translation_pairs(raw[name], f"{dataset_name}[{name}]", source_lang, target_lang)
        return datasets.DatasetDict(splits)
    if train_file is None:
        raise ValueError("Give `train_file` (a local corpus) or `dataset_name` (a `datasets.load_dataset` name).")
    if validation_file is not None:
        warn_if_validation_is_training(train_file, validation_file)
    splits = {}
    for split, name, path in (("train", "train_file", train_file), ("validation", "validation_file", validation_file)):
        if path is None:
            continue
        pairs = read_parallel_file(path, source_lang, target_lang)
        check_read_pairs(path, name, pairs, source_lang, target_lang)
        splits[split] = datasets.Dataset.from_dict(pairs)
    return datasets.DatasetDict(splits)


def warn_if_validation_is_training(train_file: str | Path, validation_file: str | Path) -> None:
    """A warning when the validation file is the training file: its scores say nothing of unseen text."""
    if Path(validation_file).resolve() == Path(train_file).resolve():
        logger.warning(
            f"The validation file is the training file ({train_file}): the scores will not tell how the model does "
            "on unseen text."
        )


HEADER_WORDS = {"source", "target", "src", "tgt", "source_text", "target_text", "input", "output"}


def _warn_on_header(path, first: tuple[str, str], count: int, source_lang: str, target_lang: str) -> bool:
    """Whether the first pair looks like a header (column names); warned about when the file holds more."""
    names = HEADER_WORDS | {source_lang.lower(), target_lang.lower()}
    header = first[0].strip().lower() in names and first[1].strip().lower() in names
    if header and count > 1:
        logger.warning(
            f"{path}:1 looks like a header ({first[0]!r} / {first[1]!r}) but is read as a sentence "
            "pair; remove it if it is not one."
        )
    return header


def load_named_dataset(name: str, config: str | None, split: str | None = None, streaming: bool = False):
    """`datasets.load_dataset(name, config, split=split, streaming=streaming)`, with a one-line error when the Hub
    cannot be reached (offline) and the dataset is not in the local cache (the one wrapper for every reader here
    and in `hf_deep_nmt.data.streaming`)."""
    offline = huggingface_hub.constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE
    try:
        return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except (ConnectionError, TimeoutError, OSError, ValueError) as error:
        if not offline and not isinstance(error, (ConnectionError, TimeoutError)):
            raise
        state = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        done, way_out = ("streamed", "Stream it") if streaming else ("loaded", "Download it once")
        raise ConnectionError(
            f"Dataset {name!r} cannot be {done}: {state} and it is not in the local datasets cache "
            f"({type(error).__name__}: {str(error)[:200]}). {way_out} with network access, or train on local files "
            "(`train_file`, `validation_file`)."
        ) from None


def tokenize_parallel(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_source_length: int = 128,
    max_target_length: int = 128,
    drop_long: bool = True,
) -> datasets.Dataset:
    """Tokenize both sides (`input_ids`, `attention_mask`, `labels`); pairs over the length limits are dropped
    (and counted in the log) when `drop_long`, otherwise truncated."""

    def encode(batch):
        truncate = not drop_long
        inputs = tokenizer(batch[SOURCE], truncation=truncate, max_length=max_source_length if truncate else None)
        targets = tokenizer(
            text_target=batch[TARGET], truncation=truncate, max_length=max_target_length if truncate else None
        )
        inputs["labels"] = targets["input_ids"]
        return inputs

    encoded = dataset.map(encode, batched=True, remove_columns=dataset.column_names, desc="Tokenizing")
    if drop_long:
        before = len(encoded)
        encoded = encoded.filter(
            lambda row: len(row["input_ids"]) <= max_source_length and len(row["labels"]) <= max_target_length,
            desc="Length filter",
        )
        if len(encoded) < before:
            logger.warning(
                f"Dropped {before - len(encoded)} of {before} pairs longer than {max_source_length} source / "
                f"{max_target_length} target tokens."
            )
    return encoded
