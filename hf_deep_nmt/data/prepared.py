"""Prepared data: the tokenizer and the tokenized corpus, built once and memory-mapped by every later run and rank.

A prepared-data folder holds

* `tokenizer/`: the tokenizer (trained on a bounded, seeded sample of the training pairs, or the one given);
* `train/` and `validation/`: `datasets.Dataset.save_to_disk` folders with `input_ids` and `labels` in the smallest id
  type that holds the vocabulary (uint16 under 65,536 entries, else int32; the collator pads them and derives the
  attention mask), the validation split with its `source` / `target` text as well (for scoring);
* `prepared.json`: the record: the fingerprint and what it was computed from, the counts (pairs read, kept, dropped,
  tokens per side), the bytes on disk, the seconds taken, the library versions, the size and the sha256 of every
  file.

The fingerprint (sha256) covers everything the contents depend on: the corpus files' bytes (or a Hub dataset's own
`datasets` fingerprint), the languages, the tokenizer (its training settings, or the given tokenizer's files), the
length limits, `max_eval_samples` and `FORMAT_VERSION`. The folder is `$HF_DEEP_NMT_PREPARED_DATA/<fingerprint[:16]>`
(default root: `<HF_HOME or ~/.cache/huggingface>/hf_deep_nmt/prepared`), or the recipe's `prepared_data_dir`.

A folder is built under a temporary name beside its final one (named by host and process id) and renamed when
complete, while holding the preparation lock (`hf_deep_nmt.data.prepared_lock`: an owner record with a lease, valid
across hosts): a second preparer of the same data waits for the first and then reuses its folder; a silent owner is
taken over; a half-written folder is never read. Each tokenized split is written once, straight into its place. A
folder whose record does not match (another fingerprint, a missing, resized or edited file, a record of another
shape) is refused, naming the folder and what differs.

Every use of a folder (`prepare` finding it, a run starting or resuming from it) hashes every file against the record:
a same-size edit of the tokenized ids or of the tokenizer would otherwise be trained on, and that tokenizer saved with
the model as its own. At about 1.4 GB per CPU-second (sha256 with the CPU's SHA instructions) this is under a
CPU-second for 4M pairs (about 1.1 GB); a record written before the digests were kept is checked by size, with a
warning. The counts and length limits the record states are checked against the opened data before they are printed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging

from hf_deep_nmt.data.corpus import (
    SOURCE,
    TARGET,
    load_parallel_dataset,
    parallel_files,
    warn_if_validation_is_training,
    write_parallel_arrow,
)
from hf_deep_nmt.data.prepared_lock import (
    PreparationLock,
    building_folder,
    cleaned_on_sigterm,
    remove_abandoned_building_folders,
)
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer

logger = logging.get_logger(__name__)

FORMAT_VERSION = 1
RECORD = "prepared.json"
ENVIRONMENT_VARIABLE = "HF_DEEP_NMT_PREPARED_DATA"
DEFAULT_TOKENIZER_TRAIN_PAIRS = 1_000_000
PAIRS_PER_WORKER = 5_000  # fewer pairs than this per worker are tokenized in fewer processes (starting one costs more)
ID_COLUMNS = ("input_ids", "labels")
SPLIT_DATA = "data.arrow"  # a tokenized split's rows, written where the prepared folder keeps them
# what `datasets.Dataset.save_to_disk` keeps of a dataset's state besides its files (`load_from_disk` reads them back)
STATE_KEYS = ("_fingerprint", "_format_columns", "_format_kwargs", "_format_type", "_output_all_columns")


class PreparedDataError(ValueError):
    """A prepared-data folder that cannot be used as it is (another fingerprint, files missing or changed)."""


@dataclass
class PreparedData:
    """A prepared-data folder, opened: the tokenizer, the memory-mapped splits and the record."""

    folder: Path
    reused: bool
    tokenizer: PreTrainedTokenizerBase
    train: datasets.Dataset
    validation: datasets.Dataset | None  # `source`, `target`, `input_ids`, `labels`
    record: dict[str, Any]
    seconds: float

    def summary(self) -> dict[str, Any]:
        """The one-line report of `hf-deep-nmt prepare` (train split counts)."""
        counts = self.record["counts"]["train"]
        return {
            "folder": str(self.folder),
            "reused": self.reused,
            "fingerprint": self.record["fingerprint"],
            **{key: counts[key] for key in ("pairs_read", "pairs_kept", "pairs_dropped")},
            **{key: counts[key] for key in ("source_tokens", "target_tokens")},
            "validation_pairs": self.record["counts"].get("validation", {}).get("pairs_kept", 0),
            "id_dtype": self.record["id_dtype"],
            "bytes_on_disk": self.record["bytes_on_disk"],
            "build_seconds": self.record["seconds"],
            "seconds": round(self.seconds, 2),
        }


# ---- what determines the folder ------------------------------------------------------------------------------------


def file_digest(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the files `save_pretrained` writes for `tokenizer` (names and bytes)."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
                digest.update(file_digest(path).encode())
    return digest.hexdigest()


def _corpus_inputs(path: str, source_lang: str, target_lang: str, corpus: dict | None = None) -> dict[str, Any]:
    files = corpus[path] if corpus and path in corpus else parallel_files(path, source_lang, target_lang)
    kind = "two files" if len(files) == 2 else files[0].suffix.lstrip(".")
    return {"kind": kind, "sha256": [file_digest(file) for file in files]}


def preparation_inputs(
    model_args,
    data_args,
    seed: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
    raw: datasets.DatasetDict | None = None,
    corpus: dict | None = None,
) -> dict[str, Any]:
    """What a prepared folder's contents depend on (its fingerprint is the sha256 of this, as sorted JSON): the
    corpus (file contents, or `raw`'s `datasets` fingerprints for a `dataset_name`), the languages, the tokenizer
    (`tokenizer`'s files when one is given, else the training settings), the length limits, `max_eval_samples`.
    `corpus`: the files each corpus path resolves to, as the run's plan found them
    (`hf_deep_nmt.training.plan.RunPlan`)."""
    if data_args.dataset_name:
        corpus: dict[str, Any] = {
            "dataset_name": data_args.dataset_name,
            "dataset_config": data_args.dataset_config,
            "validation_split": data_args.dataset_validation_split,
            "fingerprints": {split: raw[split]._fingerprint for split in sorted(raw)},
        }
    else:
        train_file, validation_file = data_args.corpus_paths()
        languages = (data_args.source_lang, data_args.target_lang)
        resolved = corpus
        corpus = {"train": _corpus_inputs(train_file, *languages, resolved)}
        if validation_file:
            corpus["validation"] = _corpus_inputs(validation_file, *languages, resolved)
    if tokenizer is not None:
        tokenizer_inputs: dict[str, Any] = {"given": tokenizer_digest(tokenizer)}
    else:
        tokenizer_inputs = {
            "vocab_size": model_args.tokenizer_vocab_size,
            "model": model_args.tokenizer_model,
            "train_pairs": tokenizer_train_pairs(model_args),
            "seed": seed,
        }
    return {
        "format": FORMAT_VERSION,
        "corpus": corpus,
        "languages": [data_args.source_lang, data_args.target_lang],
        "tokenizer": tokenizer_inputs,
        "max_source_length": data_args.max_source_length,
        "max_target_length": data_args.max_target_length,
        "drop_long": True,
        "max_eval_samples": data_args.max_eval_samples,
    }


def fingerprint(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def tokenizer_train_pairs(model_args) -> int:
    return getattr(model_args, "tokenizer_train_pairs", None) or DEFAULT_TOKENIZER_TRAIN_PAIRS


def default_root() -> Path:
    """`$HF_DEEP_NMT_PREPARED_DATA`, else `<HF_HOME or ~/.cache/huggingface>/hf_deep_nmt/prepared`."""
    if os.environ.get(ENVIRONMENT_VARIABLE):
        return Path(os.environ[ENVIRONMENT_VARIABLE]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.join("~", ".cache")), "huggingface"
    )
    return Path(home).expanduser() / "hf_deep_nmt" / "prepared"


def prepared_folder(data_args, fingerprint_: str) -> Path:
    """The recipe's `prepared_data_dir`, else `default_root() / fingerprint[:16]`."""
    named = getattr(data_args, "prepared_data_dir", None)
    return Path(named).expanduser() if named else default_root() / fingerprint_[:16]


def _relation(folder: Path, other: Path) -> str | None:
    """How `folder` stands to `other` ("is", "holds", "is inside"), or None when neither holds the other."""
    if folder == other:
        return "is"
    if folder in other.parents:
        return "holds"
    return "is inside" if other in folder.parents else None


def check_prepared_location(data_args, output_dir: str | None = None, export_dir: str | None = None) -> None:
    """`ValueError` naming the setting, before anything is read or trained, for a prepared-data folder that cannot be
    one: `HF_DEEP_NMT_PREPARED_DATA` naming a file, or a `prepared_data_dir` that is (or holds) the current folder,
    the run's `output_dir`, its `export_dir` or a corpus file's folder. A prepared folder is checked file by file
    against its record and rebuilt when it does not match, so it must be a folder of its own; and the advice to
    remove a folder that does not match must never be about one of these."""
    if getattr(data_args, "streaming", False):
        return
    named = getattr(data_args, "prepared_data_dir", None)
    if not named:
        root = default_root()
        if os.environ.get(ENVIRONMENT_VARIABLE) and os.path.lexists(root) and not root.is_dir():
            raise ValueError(
                f"{ENVIRONMENT_VARIABLE}={os.environ[ENVIRONMENT_VARIABLE]!r} is not a folder (a file is there): "
                "point it at a folder for the prepared data (created when missing), or unset it."
            )
        return
    folder = Path(named).expanduser().resolve()
    others = {"the current folder": Path.cwd().resolve()}
    for setting, path in (("output_dir", output_dir), ("export_dir", export_dir)):
        if path:
            others[f"the run's `{setting}` {path!r}"] = Path(path).expanduser().resolve()
    for corpus in data_args.corpus_files() if hasattr(data_args, "corpus_files") else ():
        others[f"the folder of the corpus file {corpus!r}"] = Path(corpus).expanduser().resolve().parent
    for what, other in others.items():
        relation = _relation(folder, other)
        if relation and not (relation == "is inside" and what.startswith(("the current", "the folder of"))):
            raise ValueError(
                f"`prepared_data_dir` {named!r} {relation} {what}: the prepared data needs a folder of its own (it "
                "must hold only what the preparation wrote); name a new or empty folder, e.g. 'prepared/'."
            )


def _make_root(folder: Path, data_args) -> None:
    """Create the folder that holds `folder`, or say which setting named a place where it cannot be."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        if getattr(data_args, "prepared_data_dir", None):
            setting = f"`prepared_data_dir` {data_args.prepared_data_dir!r}"
        elif os.environ.get(ENVIRONMENT_VARIABLE):
            setting = f"{ENVIRONMENT_VARIABLE}={os.environ[ENVIRONMENT_VARIABLE]!r}"
        else:
            setting = "the default prepared-data root (set HF_DEEP_NMT_PREPARED_DATA or `prepared_data_dir`)"
        raise PreparedDataError(
            f"Cannot create {folder.parent} for the prepared data, as {setting} asks: {error.strerror or error}; "
            "name a folder that can be created and written."
        ) from None


def preprocessing_workers(data_args) -> int:
    """The recipe's `preprocessing_num_workers`, else the cores this process may run on."""
    return getattr(data_args, "preprocessing_num_workers", None) or len(os.sched_getaffinity(0))


# ---- opening a folder ----------------------------------------------------------------------------------------------


def _files(folder: Path) -> dict[str, int]:
    return {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != RECORD
    }


def check_prepared_folder(folder: Path, expected: str | None = None) -> dict[str, Any]:
    """The record of a complete prepared folder, after checking its shape (`check_record`) and checking it against its
    files (every recorded file there with its size and sha256, none added) and, given `expected`, the fingerprint.
    `PreparedDataError` naming the folder and what differs otherwise."""
    record_path = folder / RECORD
    try:
        record = json.loads(record_path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise PreparedDataError(
            f"{folder} is not a prepared-data folder (it holds files but no {RECORD}); name a new or empty folder as "
            "`prepared_data_dir`, or move those files away."
        ) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise PreparedDataError(
            f"{record_path} is damaged ({type(error).__name__}: {error}); remove {folder} and prepare again."
        ) from None
    problems = []
    if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        problems.append(f"format {found!r}, this version reads {FORMAT_VERSION}")
    else:
        check_record(record, record_path)
        if expected is not None and record["fingerprint"] != expected:
            problems.append(f"fingerprint {record['fingerprint'][:16]}, the recipe's data is {expected[:16]}")
        elif fingerprint(record["inputs"]) != record["fingerprint"]:  # e.g. a length limit edited by hand
            problems.append("its `inputs` were edited (they do not give its `fingerprint`)")
        problems += _file_problems(folder, record)
    if problems:
        raise PreparedDataError(
            f"Prepared data folder {folder} does not match: {'; '.join(problems)}. Remove it (it is rebuilt) or "
            "name another `prepared_data_dir`."
        )
    return record


def _file_problems(folder: Path, record: dict[str, Any]) -> list[str]:
    """What differs between `folder`'s files and the record: missing, added, resized or (by sha256) edited files."""
    recorded_files, digests = record["files"], record.get("sha256")
    found, problems = _files(folder), []
    for name, size in recorded_files.items():
        if name not in found:
            problems.append(f"{name} is missing")
        elif found[name] != size:
            problems.append(f"{name} has {found[name]} bytes, {size} recorded")
        elif digests is not None and file_digest(folder / name) != digests[name]:
            problems.append(f"{name} was changed since it was prepared (its sha256 is not the recorded one)")
    added = sorted(set(found) - set(recorded_files))
    if added:
        problems.append(f"files not written by the preparation: {added[:3]}")
    if digests is None and not problems:
        logger.warning(
            f"{folder / RECORD} records no sha256 of its files (prepared by an earlier version): only their sizes "
            "could be checked. Remove the folder to have it prepared again with them."
        )
    return problems


# The shape of a record: each field's path and what it must hold (checked before any field is used).
_COUNT_FIELDS = ("pairs_read", "pairs_kept", "pairs_dropped", "source_tokens", "target_tokens")
_HEX64 = frozenset("0123456789abcdef")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_hex64(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _HEX64


def _is_relative_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and not name.startswith("/") and ".." not in name.split("/")


def _record_fields(record: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """(field, value, check, what it must be) for every field `check_record` checks, in order."""
    inputs, counts = record.get("inputs"), record.get("counts")
    fields = [
        ("fingerprint", record.get("fingerprint"), _is_hex64, "a sha256 (64 hex digits)"),
        ("inputs", inputs, lambda value: isinstance(value, dict), "an object"),
        ("counts", counts, lambda value: isinstance(value, dict) and "train" in value, "an object with `train`"),
        ("id_dtype", record.get("id_dtype"), lambda value: value in ("uint16", "int32"), '"uint16" or "int32"'),
        ("vocab_size", record.get("vocab_size"), lambda value: _is_count(value) and value > 0, "a positive integer"),
        ("bytes_on_disk", record.get("bytes_on_disk"), _is_count, "a non-negative integer"),
        ("files", record.get("files"), lambda value: isinstance(value, dict), "an object of file sizes"),
    ]
    if isinstance(inputs, dict):
        for key in ("max_source_length", "max_target_length"):
            fields.append((f"inputs.{key}", inputs.get(key), lambda v: _is_count(v) and v > 0, "a positive integer"))
    if isinstance(counts, dict):
        for split in [name for name in ("train", "validation") if name in counts]:
            fields.append((f"counts.{split}", counts[split], lambda value: isinstance(value, dict), "an object"))
            if isinstance(counts[split], dict):
                fields += [
                    (f"counts.{split}.{key}", counts[split].get(key), _is_count, "a count") for key in _COUNT_FIELDS
                ]
    return fields


def check_record(record: dict[str, Any], path: Path) -> None:
    """`PreparedDataError` naming `path` and the first field of the record that is missing or of another shape (a
    record edited by hand, or written by something else), before any of its values is used."""

    def refuse(field: str, value: Any, wanted: str) -> None:
        shown = "missing" if value is None else f"{json.dumps(value)[:60]}"
        raise PreparedDataError(f"{path}: `{field}` is {shown}, not {wanted}; remove {path.parent} and prepare again.")

    for field, value, check, wanted in _record_fields(record):
        if not check(value):
            refuse(field, value, wanted)
    for name, size in record["files"].items():
        if not _is_relative_name(name) or not _is_count(size):
            refuse(f"files.{name}", size, "a byte count of a file inside the folder")
    digests = record.get("sha256")
    if digests is not None:
        if not isinstance(digests, dict) or set(digests) != set(record["files"]):
            refuse("sha256", digests, "an object with a sha256 for each of `files`")
        for name, digest in digests.items():
            if not _is_hex64(digest):
                refuse(f"sha256.{name}", digest, "a sha256 (64 hex digits)")


def _mismatch(record: dict[str, Any], inputs: dict[str, Any]) -> str:
    """The top-level inputs that differ between a record and the recipe (e.g. 'max_source_length: 64 -> 128')."""
    recorded = record.get("inputs", {})
    keys = sorted(set(recorded) | set(inputs))
    return ", ".join(
        f"{key}: {json.dumps(recorded.get(key))[:80]} -> {json.dumps(inputs.get(key))[:80]}"
        for key in keys
        if recorded.get(key) != inputs.get(key)
    )


def open_prepared(folder: Path, expected: str, inputs: dict[str, Any], reused: bool, started: float) -> PreparedData:
    try:
        record = check_prepared_folder(folder, expected)
    except PreparedDataError as error:
        try:
            recorded = json.loads((folder / RECORD).read_text())
        except (OSError, ValueError):
            raise error from None
        if not isinstance(recorded, dict) or not isinstance(recorded.get("inputs"), dict):
            raise error from None
        differs = _mismatch(recorded, inputs) if recorded.get("fingerprint") != expected else ""
        raise PreparedDataError(f"{error}{f' Differs: {differs}.' if differs else ''}") from None
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    train = datasets.load_from_disk(str(folder / "train"))
    validation = datasets.load_from_disk(str(folder / "validation")) if (folder / "validation").is_dir() else None
    check_counts(folder, record, len(tokenizer), {"train": train, "validation": validation})
    return PreparedData(folder, reused, tokenizer, train, validation, record, time.perf_counter() - started)


def check_counts(folder: Path, record: dict[str, Any], vocabulary: int, splits: dict[str, Any]) -> None:
    """`PreparedDataError` when the opened data does not hold what the record states (the pairs and tokens counted,
    the length limits, the vocabulary and its id type), so what is printed from the record is what is trained on.
    Reads only the rows' lengths (the offsets of the memory-mapped columns)."""
    import pyarrow.compute as pc

    problems = []
    if record["vocab_size"] != vocabulary:
        problems.append(f"`vocab_size` {record['vocab_size']}, its tokenizer has {vocabulary}")
    limits = {"input_ids": record["inputs"]["max_source_length"], "labels": record["inputs"]["max_target_length"]}
    for split, dataset in splits.items():
        counts = record["counts"].get(split)
        if dataset is None or counts is None:
            if (dataset is None) != (counts is None):
                problems.append(f"`counts.{split}` {'without' if dataset is None else 'missing for'} its split")
            continue
        found = _token_counts(dataset, counts["pairs_read"])
        problems += [
            f"`counts.{split}.{key}` {counts[key]}, the data holds {found[key]}"
            for key in ("pairs_kept", "pairs_dropped", "source_tokens", "target_tokens")
            if counts[key] != found[key]
        ]
        table = dataset.with_format("arrow")[:]
        for column, limit in limits.items():
            dtype = str(dataset.features[column].feature.dtype)
            if dtype != record["id_dtype"]:
                problems.append(f"{split} `{column}` of type {dtype}, `id_dtype` {record['id_dtype']}")
            longest = pc.max(pc.list_value_length(table[column])).as_py() or 0
            if longest > limit:
                problems.append(f"{split} `{column}` rows of {longest} ids, over the recorded limit {limit}")
    if problems:
        raise PreparedDataError(
            f"{folder / RECORD} does not describe its data: {'; '.join(problems)}. Remove {folder} and prepare again."
        )


# ---- building one --------------------------------------------------------------------------------------------------


def _lock(folder: Path) -> PreparationLock:
    """The preparation lock of `folder` (`hf_deep_nmt.data.prepared_lock`: an owner record with a lease, valid
    across the hosts that share the root)."""
    return PreparationLock(folder)


def prepare_data(
    model_args,
    data_args,
    seed: int = 42,
    tokenizer: PreTrainedTokenizerBase | None = None,
    build: bool = True,
    corpus: dict | None = None,
) -> PreparedData | None:
    """The prepared folder of this recipe's data: opened when it exists (checked against its record), else built
    (else None, with `build=False`). `tokenizer`: a given tokenizer (a saved model's, `tokenizer_name_or_path`, an
    earlier run's); None trains one. `corpus`: the corpus files as the run's plan resolved them."""
    started = time.perf_counter()
    raw = None
    if data_args.dataset_name:
        raw = _named_pairs(data_args)
    inputs = preparation_inputs(model_args, data_args, seed, tokenizer, raw, corpus)
    expected = fingerprint(inputs)
    folder = prepared_folder(data_args, expected)
    if os.path.lexists(folder) and not (folder / RECORD).is_file() and not _is_empty_dir(folder):
        check_prepared_folder(folder, expected)  # refuses it, naming what is there
    if (folder / RECORD).is_file():
        return _log_use(open_prepared(folder, expected, inputs, True, started))
    if not build:
        return None
    _make_root(folder, data_args)
    with _lock(folder) as lock:
        if (folder / RECORD).is_file():  # built by another process while this one waited
            return _log_use(open_prepared(folder, expected, inputs, True, started))
        remove_abandoned_building_folders(folder, lock.taken_over)  # left by preparers that were killed
        building = building_folder(folder)  # named by host and pid: no other node's work is ever removed
        try:
            with cleaned_on_sigterm():  # a SIGTERM leaves no building folder behind
                _build(building, model_args, data_args, seed, tokenizer, raw, inputs, expected, started, corpus)
            if folder.is_dir():
                folder.rmdir()  # an empty folder named by `prepared_data_dir`
            os.rename(building, folder)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        return _log_use(open_prepared(folder, expected, inputs, False, started))


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def _log_use(prepared: PreparedData) -> PreparedData:
    counts = prepared.record["counts"]["train"]
    limits = prepared.record["inputs"]
    if counts["pairs_dropped"]:
        logger.warning(
            f"Dropped {counts['pairs_dropped']} of {counts['pairs_read']} pairs longer than "
            f"{limits['max_source_length']} source / {limits['max_target_length']} target tokens."
        )
    how = "reused" if prepared.reused else f"built in {prepared.record['seconds']} s"
    logger.warning(
        f"Prepared data {prepared.folder} ({how}): {counts['pairs_kept']} training pairs, "
        f"{counts['source_tokens']} + {counts['target_tokens']} tokens, {prepared.record['bytes_on_disk']} bytes."
    )
    return prepared


def _named_pairs(data_args) -> datasets.DatasetDict:
    raw = load_parallel_dataset(
        dataset_name=data_args.dataset_name,
        dataset_config=data_args.dataset_config,
        source_lang=data_args.source_lang,
        target_lang=data_args.target_lang,
        validation_split=data_args.dataset_validation_split,
    )
    return raw


def id_dtype(vocabulary: int) -> str:
    """The smallest id type for a vocabulary of `vocabulary` entries: uint16 under 65,536, else int32."""
    return "uint16" if vocabulary < 65_536 else "int32"


def tokenizer_sample(dataset: datasets.Dataset, pairs: int, seed: int):
    """(source, target) pairs to train the tokenizer on: all of them, in order, when there are at most `pairs`; else
    `pairs` of them drawn without replacement for `seed` (the same for the same seed), in corpus order."""
    if len(dataset) > pairs:
        dataset = dataset.select(sorted(random.Random(seed).sample(range(len(dataset)), pairs)))
    for batch in dataset.iter(batch_size=1000):
        yield from zip(batch[SOURCE], batch[TARGET])


def tokenize_split(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_source_length: int,
    max_target_length: int,
    drop_long: bool,
    workers: int,
    cache_file: Path,
    keep_text: bool = False,
) -> datasets.Dataset:
    """`input_ids` and `labels` in the smallest id type (`id_dtype`), tokenized in `workers` processes, written to
    `cache_file`; pairs over the length limits dropped (`drop_long`) or truncated. `keep_text` keeps the text."""
    ids = datasets.List(datasets.Value(id_dtype(len(tokenizer))))
    features = {SOURCE: datasets.Value("string"), TARGET: datasets.Value("string")} if keep_text else {}
    features = datasets.Features({**features, "input_ids": ids, "labels": ids})
    truncate = not drop_long

    def encode(batch):
        options = {"truncation": truncate, "return_attention_mask": False, "verbose": False}
        sources = tokenizer(batch[SOURCE], max_length=max_source_length if truncate else None, **options)
        targets = tokenizer(text_target=batch[TARGET], max_length=max_target_length if truncate else None, **options)
        sources, targets = sources["input_ids"], targets["input_ids"]
        keep = range(len(sources))
        if drop_long:
            keep = [i for i in keep if len(sources[i]) <= max_source_length and len(targets[i]) <= max_target_length]
        rows = {"input_ids": [sources[i] for i in keep], "labels": [targets[i] for i in keep]}
        if keep_text:
            rows = {SOURCE: [batch[SOURCE][i] for i in keep], TARGET: [batch[TARGET][i] for i in keep], **rows}
        return rows

    workers = max(1, min(workers, len(dataset) // PAIRS_PER_WORKER))
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    if workers > 1:  # each worker tokenizes on one thread (and `tokenizers` says nothing about the fork)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return dataset.map(
            encode,
            batched=True,
            batch_size=1000,
            remove_columns=dataset.column_names,
            features=features,
            num_proc=workers if workers > 1 else None,
            cache_file_name=str(cache_file),
            desc="Tokenizing",
        )
    finally:
        if workers > 1:
            if parallelism is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = parallelism


def _token_counts(dataset: datasets.Dataset, pairs_read: int) -> dict[str, int]:
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    tokens = {
        name: int(pc.sum(pc.list_value_length(table[column])).as_py() or 0)
        for name, column in (("source_tokens", "input_ids"), ("target_tokens", "labels"))
    }
    kept = len(dataset)
    return {"pairs_read": pairs_read, "pairs_kept": kept, "pairs_dropped": pairs_read - kept, **tokens}


def _build(
    building: Path,
    model_args,
    data_args,
    seed: int,
    tokenizer: PreTrainedTokenizerBase | None,
    raw: datasets.DatasetDict | None,
    inputs: dict[str, Any],
    expected: str,
    started: float,
    corpus: dict | None = None,
) -> None:
    """Write the prepared folder into `building`: the splits read (`raw`, or the corpus files), the tokenizer (given,
    or trained on a sample), the tokenized splits and the record."""
    work = building / "work"
    work.mkdir(parents=True)
    splits = _read_splits(work, data_args, raw, corpus or {})
    if tokenizer is None:
        tokenizer = _train_tokenizer(splits["train"], model_args, seed)
    tokenizer.save_pretrained(building / "tokenizer")
    workers = preprocessing_workers(data_args)
    counts = _tokenize_splits(building, splits, tokenizer, data_args, workers)
    del splits
    shutil.rmtree(work)
    files = _files(building)
    record = {
        "format": FORMAT_VERSION,
        "fingerprint": expected,
        "inputs": inputs,
        "counts": counts,
        "id_dtype": id_dtype(len(tokenizer)),
        "vocab_size": len(tokenizer),
        "bytes_on_disk": sum(files.values()),
        "seconds": round(time.perf_counter() - started, 2),
        "workers": workers,
        "versions": _versions(),
        "files": files,
        "sha256": {name: file_digest(building / name) for name in files},
    }
    (building / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def _read_splits(work: Path, data_args, raw: datasets.DatasetDict | None, corpus: dict) -> dict[str, datasets.Dataset]:
    """The text splits to tokenize: `raw`'s (a `dataset_name`), or the corpus files (their resolved `corpus` files)
    written to Arrow in `work`, in batches; the validation split cut to `max_eval_samples`."""
    if raw is None:  # local files: read to Arrow on disk, in batches
        train_file, validation_file = data_args.corpus_paths()
        languages = (data_args.source_lang, data_args.target_lang)
        train_files = corpus.get(train_file)
        splits = {
            "train": write_parallel_arrow(train_file, work / "train.arrow", "train_file", *languages, train_files)
        }
        if validation_file:
            warn_if_validation_is_training(train_file, validation_file)
            splits["validation"] = write_parallel_arrow(
                validation_file, work / "validation.arrow", "validation_file", *languages, corpus.get(validation_file)
            )
    else:
        splits = dict(raw)
    if len(splits["train"]) == 0:
        raise ValueError("The training data holds no sentence pairs; give a corpus with at least one.")
    if "validation" in splits and data_args.max_eval_samples:
        validation = splits["validation"]
        splits["validation"] = validation.select(range(min(data_args.max_eval_samples, len(validation))))
    return splits


def _train_tokenizer(train: datasets.Dataset, model_args, seed: int) -> PreTrainedTokenizerBase:
    """A joint tokenizer trained on a seeded sample of `tokenizer_train_pairs` training pairs."""
    sample = tokenizer_train_pairs(model_args)
    if len(train) > sample:
        logger.warning(f"Training the tokenizer on {sample} of {len(train)} pairs (seed {seed}).")
    return train_joint_tokenizer(
        tokenizer_sample(train, sample, seed),
        vocab_size=model_args.tokenizer_vocab_size,
        model=model_args.tokenizer_model,
    )


def _tokenize_splits(building: Path, splits, tokenizer, data_args, workers: int) -> dict[str, dict[str, int]]:
    """Tokenize the splits into `building` (`train/`: pairs over the length limits dropped; `validation/`: every
    pair, truncated, with its text); returns their counts."""
    limits = (data_args.max_source_length, data_args.max_target_length)
    (building / "train").mkdir()
    train = tokenize_split(splits["train"], tokenizer, *limits, True, workers, building / "train" / SPLIT_DATA)
    counts = {"train": _token_counts(train, len(splits["train"]))}
    if len(train) == 0:
        raise ValueError(
            f"No training pair is within `max_source_length={limits[0]}` / `max_target_length={limits[1]}` tokens "
            f"({len(splits['train'])} pairs read); raise them."
        )
    write_split_state(train, building / "train")
    if "validation" in splits:
        # Evaluation keeps every pair (truncating, never dropping), so BLEU is computed on the whole set.
        (building / "validation").mkdir()
        cache_file = building / "validation" / SPLIT_DATA
        validation = tokenize_split(splits["validation"], tokenizer, *limits, False, workers, cache_file, True)
        counts["validation"] = _token_counts(validation, len(splits["validation"]))
        write_split_state(validation, building / "validation")
    return counts


def write_split_state(dataset: datasets.Dataset, folder: Path) -> None:
    """Make `folder`, which holds the Arrow files `dataset` was just written to (`tokenize_split`'s cache files), a
    folder `datasets.load_from_disk` opens, as `save_to_disk` would leave it but without writing the rows a second
    time (peak disk: the text once and the tokens once). The state names the files in the dataset's order."""
    files = [Path(item["filename"]) for item in dataset.cache_files]
    if not files or any(path.parent.resolve() != folder.resolve() for path in files):
        raise RuntimeError(f"The tokenized split is not in {folder} alone ({[str(path) for path in files]}).")
    state = {key: dataset.__dict__[key] for key in STATE_KEYS}
    state["_split"] = str(dataset.split) if dataset.split is not None else None
    state["_data_files"] = [{"filename": path.name} for path in files]
    (folder / datasets.config.DATASET_STATE_JSON_FILENAME).write_text(json.dumps(state, indent=2, sort_keys=True))
    info = dataclasses.asdict(dataset.info)
    text = json.dumps({key: info[key] for key in sorted(info)}, indent=2)
    (folder / datasets.config.DATASET_INFO_FILENAME).write_text(text)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("hf-deep-nmt", "datasets", "tokenizers", "transformers", "pyarrow"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found
