"""Prepared data (`hf_deep_nmt.data.prepared`): built once into a fingerprinted folder, reused by later runs and by
every rank, rebuilt on any change, refused when it does not match its record; corpora read in bounded memory."""

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fault_worker
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from two_ranks import Scenario

from hf_deep_nmt.cli import main
from hf_deep_nmt.data import prepared as prepared_data
from hf_deep_nmt.data.prepared import (
    RECORD,
    PreparedDataError,
    id_dtype,
    prepare_data,
    tokenize_split,
)
from hf_deep_nmt.training.arguments import DataArguments, ModelArguments

WORDS = [f"w{index}" for index in range(60)]


def write_corpus(path: Path, pairs: int = 150, seed: int = 0, long_pairs: int = 0) -> Path:
    """`pairs` short pairs (2-6 words a side), then `long_pairs` of 40 words a side."""
    generator = random.Random(seed)
    lines = []
    for index in range(pairs + long_pairs):
        length = 40 if index >= pairs else generator.randint(2, 6)
        source = " ".join(generator.choice(WORDS) for _ in range(length))
        target = " ".join(generator.choice(WORDS) for _ in range(length))
        lines.append(f"{source}\t{target}\n")
    path.write_text("".join(lines))
    return path


def settings(tmp_path, corpus: Path, **data):
    model_args = ModelArguments(model_type="deep_nmt", tokenizer_vocab_size=data.pop("vocab", 300))
    data_args = DataArguments(
        train_file=str(corpus),
        validation_file=str(corpus),
        max_source_length=data.pop("max_source_length", 32),
        max_target_length=32,
        max_eval_samples=5,
        preprocessing_num_workers=1,
        **data,
    )
    return model_args, data_args


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of the tokenizing and the tokenizer-training functions."""
    calls = {"tokenize": 0, "train": 0}
    tokenize, train = prepared_data.tokenize_split, prepared_data.train_joint_tokenizer

    def counted_tokenize(*args, **kwargs):
        calls["tokenize"] += 1
        return tokenize(*args, **kwargs)

    def counted_train(*args, **kwargs):
        calls["train"] += 1
        return train(*args, **kwargs)

    monkeypatch.setattr(prepared_data, "tokenize_split", counted_tokenize)
    monkeypatch.setattr(prepared_data, "train_joint_tokenizer", counted_train)
    return calls


@pytest.fixture(autouse=True)
def prepared_root(tmp_path, monkeypatch):
    monkeypatch.setenv(prepared_data.ENVIRONMENT_VARIABLE, str(tmp_path / "prepared"))
    return tmp_path / "prepared"


def test_the_second_preparation_reuses_the_folder_without_tokenizing_or_training(tmp_path, spy, prepared_root):
    corpus = write_corpus(tmp_path / "train.tsv")
    first = prepare_data(*settings(tmp_path, corpus), seed=3)
    assert not first.reused and spy == {"tokenize": 2, "train": 1}  # train and validation splits, one tokenizer
    assert first.folder.parent == prepared_root and first.folder.name == first.record["fingerprint"][:16]
    tokenizer_file = (first.folder / "tokenizer" / "tokenizer.json").read_bytes()
    second = prepare_data(*settings(tmp_path, corpus), seed=3)
    assert second.reused and second.folder == first.folder and spy == {"tokenize": 2, "train": 1}
    assert (second.folder / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer_file
    assert second.tokenizer.backend_tokenizer.to_str() == first.tokenizer.backend_tokenizer.to_str()
    assert second.train["labels"] == first.train["labels"] and len(second.train) == 150
    # the ids are the tokenizer's, the validation keeps its text (first `max_eval_samples` pairs), no attention mask
    lines = corpus.read_text().splitlines()
    source, target = lines[0].split("\t")
    assert second.train[0] == {
        "input_ids": second.tokenizer(source)["input_ids"],
        "labels": second.tokenizer(target)["input_ids"],
    }
    assert second.validation["source"] == [line.split("\t")[0] for line in lines[:5]]
    assert second.train.column_names == ["input_ids", "labels"]


@pytest.mark.parametrize("change", ["one corpus line", "vocabulary size", "length limit", "tokenizer sample"])
def test_any_change_builds_a_new_folder(tmp_path, spy, change):
    corpus = write_corpus(tmp_path / "train.tsv")
    first = prepare_data(*settings(tmp_path, corpus), seed=3)
    options = {}
    if change == "one corpus line":
        lines = corpus.read_text().splitlines(keepends=True)
        lines[70] = "w1 w2\tw3 w4\n"
        corpus.write_text("".join(lines))
    elif change == "vocabulary size":
        options["vocab"] = 280
    elif change == "length limit":
        options["max_source_length"] = 31
    model_args, data_args = settings(tmp_path, corpus, **options)
    if change == "tokenizer sample":
        model_args.tokenizer_train_pairs = 100
    second = prepare_data(model_args, data_args, seed=3)
    assert not second.reused and spy["tokenize"] == 4 and spy["train"] == 2
    assert second.record["fingerprint"] != first.record["fingerprint"] and second.folder != first.folder
    assert (first.folder / RECORD).is_file()  # the other data's folder is left as it was


def test_the_tokenizer_sample_is_bounded_and_seeded(tmp_path):
    corpus = write_corpus(tmp_path / "train.tsv", pairs=50)
    dataset = prepared_data.write_parallel_arrow(corpus, tmp_path / "pairs.arrow", "train_file")
    everything = list(prepared_data.tokenizer_sample(dataset, 50, seed=1))
    lines = corpus.read_text().splitlines()
    assert everything == [tuple(line.split("\t")) for line in lines]  # the whole corpus, in order
    drawn = list(prepared_data.tokenizer_sample(dataset, 20, seed=1))
    assert len(drawn) == 20 and drawn == list(prepared_data.tokenizer_sample(dataset, 20, seed=1))
    chosen = sorted(random.Random(1).sample(range(50), 20))
    assert drawn == [everything[index] for index in chosen]  # in corpus order
    assert drawn != list(prepared_data.tokenizer_sample(dataset, 20, seed=2))


def test_a_folder_that_does_not_match_its_record_or_the_recipe_is_refused_by_name(tmp_path):
    corpus = write_corpus(tmp_path / "train.tsv")
    named = tmp_path / "my-prepared"
    model_args, data_args = settings(tmp_path, corpus, prepared_data_dir=str(named))
    built = prepare_data(model_args, data_args, seed=3)
    assert built.folder == named and not built.reused
    # the same folder named for other settings: refused, naming the folder and the setting that differs
    _, other = settings(tmp_path, corpus, prepared_data_dir=str(named), max_source_length=20)
    with pytest.raises(PreparedDataError, match=rf"{named} does not match: fingerprint .*max_source_length: 32 -> 20"):
        prepare_data(model_args, other, seed=3)
    # a file removed, or one of another size
    shard = next((named / "train").glob("*.arrow"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    with pytest.raises(PreparedDataError, match=rf"{named} does not match: train/{shard.name} has \d+ bytes"):
        prepare_data(model_args, data_args, seed=3)
    shard.unlink()
    with pytest.raises(PreparedDataError, match=rf"train/{shard.name} is missing"):
        prepare_data(model_args, data_args, seed=3)
    shard.write_bytes(data)
    # a record whose fingerprint was changed
    record = json.loads((named / RECORD).read_text())
    (named / RECORD).write_text(json.dumps({**record, "fingerprint": "0" * 64}))
    with pytest.raises(PreparedDataError, match=rf"{named} does not match: fingerprint 0000000000000000"):
        prepare_data(model_args, data_args, seed=3)
    # a folder of other files, and a damaged record
    (named / RECORD).unlink()
    with pytest.raises(PreparedDataError, match=rf"{named} is not a prepared-data folder"):
        prepare_data(model_args, data_args, seed=3)
    (named / RECORD).write_text("{")
    with pytest.raises(PreparedDataError, match=rf"{named / RECORD} is damaged"):
        prepare_data(model_args, data_args, seed=3)


def test_ids_are_stored_in_the_smallest_type_that_holds_the_vocabulary(tmp_path):
    assert [id_dtype(size) for size in (300, 65_535, 65_536, 250_000)] == ["uint16", "uint16", "int32", "int32"]
    vocabulary = {f"v{index}": index for index in range(70_000)}
    vocabulary.update({"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3})
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    large = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    dataset = prepared_data.write_parallel_arrow(
        write_text(tmp_path / "big.tsv", "v5 v69999\tv65536 v7\n"), tmp_path / "big.arrow", "train_file"
    )
    encoded = tokenize_split(dataset, large, 8, 8, True, 1, tmp_path / "big-tokens.arrow")
    assert str(encoded.features["labels"].feature.dtype) == "int32"
    assert encoded[0] == {"input_ids": [5, 69_999], "labels": [65_536, 7]}
    small = prepare_data(*settings(tmp_path, write_corpus(tmp_path / "train.tsv")), seed=3)
    assert small.record["id_dtype"] == "uint16" and str(small.train.features["input_ids"].feature.dtype) == "uint16"


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_prepare_prints_its_counts_and_ends_with_one_json_line(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "train.tsv", pairs=100, long_pairs=3)
    recipe = tmp_path / "recipe.json"
    values = {"model_type": "deep_nmt", "tokenizer_vocab_size": 300, "train_file": str(corpus)}
    values.update(validation_file=str(corpus), max_source_length=24, max_target_length=24, output_dir="unused")
    recipe.write_text(json.dumps(values))
    assert main(["prepare", str(recipe), "--preprocessing-num-workers", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    record = json.loads((Path(report["folder"]) / RECORD).read_text())
    assert not report["reused"] and report["fingerprint"] == record["fingerprint"]
    # the three 40-word pairs are over the 24-token limits (at least one token a word, plus </s>)
    assert (report["pairs_read"], report["pairs_kept"], report["pairs_dropped"]) == (103, 100, 3)
    folder = prepared_data.check_prepared_folder(Path(report["folder"]))
    assert report["bytes_on_disk"] == sum(folder["files"].values()) > 0
    assert report["source_tokens"] == record["counts"]["train"]["source_tokens"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(report["folder"]) / "tokenizer")
    kept = [line.split("\t") for line in corpus.read_text().splitlines()[:100]]
    assert report["source_tokens"] == sum(len(tokenizer(source)["input_ids"]) for source, _ in kept)
    assert report["target_tokens"] == sum(len(tokenizer(target)["input_ids"]) for _, target in kept)
    assert {"seconds", "folder", "validation_pairs"} <= set(report) and report["validation_pairs"] == 103
    assert main(["prepare", str(recipe)]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["reused"] and again["folder"] == report["folder"]


def test_a_staged_run_reuses_the_prepared_data_with_the_tokenizer_it_saved(tmp_path, spy):
    """`train-staged` saves the tokenizer in its output folder; its resume finds it there and must not re-tokenize."""
    from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments
    from hf_deep_nmt.training.pipeline import prepare

    corpus = write_corpus(tmp_path / "train.tsv")
    model_args, data_args = settings(tmp_path, corpus)
    training_args = DeepNMTTrainingArguments(output_dir=str(tmp_path / "run"), seed=3, report_to="none")
    tokenizer_dir = tmp_path / "run" / "tokenizer"
    first = prepare(model_args, data_args, training_args, tokenizer_dir=tokenizer_dir)
    assert (tokenizer_dir / "tokenizer.json").is_file() and spy == {"tokenize": 2, "train": 1}
    second = prepare(model_args, data_args, training_args, tokenizer_dir=tokenizer_dir)
    assert second.data.reused and second.data.folder == first.data.folder and spy == {"tokenize": 2, "train": 1}
    assert second.references == first.references and len(second.eval_dataset) == 5


LIMITED_READ = """
import json, resource, sys
from hf_deep_nmt.data.corpus import read_parallel_file, write_parallel_arrow

def mapped():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))

limit = mapped() + (int(sys.argv[2]) << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
result = {}
result["arrow"] = len(write_parallel_arrow(sys.argv[1], sys.argv[1] + ".arrow", "train_file"))
try:
    result["lists"] = len(read_parallel_file(sys.argv[1])["source"])
except MemoryError:
    result["lists"] = "MemoryError"
print(json.dumps(result))
"""


def test_a_corpus_whose_python_lists_would_not_fit_is_read_to_arrow_under_an_address_space_limit(tmp_path):
    """400,000 one-word pairs: as Python lists about 48 MB (two str objects of ~52 bytes and two list slots each),
    3 MB of text; read under a limit of 30 MiB above what the interpreter had mapped after its imports."""
    generator = random.Random(0)
    lines = [f"{generator.choice(WORDS)}\t{generator.choice(WORDS)}\n" for _ in range(400_000)]
    corpus = write_text(tmp_path / "big.tsv", "".join(lines))
    completed = subprocess.run(
        [sys.executable, "-c", LIMITED_READ, str(corpus), "30"],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == {"arrow": 400_000, "lists": "MemoryError"}


CONCURRENT = """
import json, sys
from hf_deep_nmt.training.arguments import DataArguments, ModelArguments
from hf_deep_nmt.data.prepared import prepare_data

corpus, folder = sys.argv[1], sys.argv[2]
model_args = ModelArguments(model_type="deep_nmt", tokenizer_vocab_size=300)
data_args = DataArguments(train_file=corpus, max_source_length=32, max_target_length=32, prepared_data_dir=folder,
                          preprocessing_num_workers=1)
data = prepare_data(model_args, data_args, seed=3)
tokenizer = data.tokenizer.backend_tokenizer.to_str()
print(json.dumps({"reused": data.reused, "folder": str(data.folder), "tokenizer": tokenizer}))
"""


def test_two_concurrent_preparers_build_once(tmp_path):
    """The test holds the folder's lock until both preparers wait on it; then one builds and the other reuses."""
    corpus = write_corpus(tmp_path / "train.tsv")
    folder = tmp_path / "shared"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"preparer{index}.log" for index in range(2)]
    outputs = [tmp_path / f"preparer{index}.out" for index in range(2)]
    with prepared_data._lock(folder):
        # two processes of their own, forked from fault_worker's fork server (the package imported once)
        processes = [
            fault_worker.start_script(CONCURRENT, [str(corpus), str(folder)], environment, output, error_log=log)
            for output, log in zip(outputs, logs)
        ]
        deadline = time.monotonic() + 120
        while not all("Another process is preparing" in log.read_text() for log in logs):
            assert time.monotonic() < deadline and all(process.exitcode is None for process in processes), [
                log.read_text()[-2000:] for log in logs
            ]
            time.sleep(0.2)
    results = []
    for process, output, log in zip(processes, outputs, logs):
        process.join(timeout=300)
        if process.exitcode is None:
            process.kill()
            process.join()
        assert process.exitcode == 0, log.read_text()[-3000:]
        results.append(json.loads(output.read_text().strip().splitlines()[-1]))
    assert sorted(result["reused"] for result in results) == [False, True]
    assert results[0]["folder"] == results[1]["folder"] == str(folder)
    assert results[0]["tokenizer"] == results[1]["tokenizer"]
    assert not list(tmp_path.glob(".shared.building-*"))  # nothing half-written left


RANKS = """
import json, os, sys
import torch.distributed as dist
from hf_deep_nmt.training.arguments import DataArguments, DeepNMTTrainingArguments, ModelArguments
from hf_deep_nmt.training.arguments import multi_process_launch_without_gpu
from hf_deep_nmt.data import prepared as prepared_data
from hf_deep_nmt.training.pipeline import prepare

work = sys.argv[1]
model_args = ModelArguments(model_type="deep_nmt", tokenizer_vocab_size=300)
data_args = DataArguments(train_file=f"{work}/train.tsv", validation_file=f"{work}/train.tsv", max_eval_samples=5,
                          max_source_length=32, max_target_length=32, preprocessing_num_workers=1)
args = DeepNMTTrainingArguments(output_dir=f"{work}/out", use_cpu=multi_process_launch_without_gpu(), seed=3,
                                report_to="none")
built = []
original = prepared_data._build
prepared_data._build = lambda *a, **k: (built.append(1), original(*a, **k))[1]
prepared = prepare(model_args, data_args, args)
result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "built": len(built),
          "reused": prepared.data.reused, "folder": str(prepared.data.folder),
          "tokenizer": prepared.tokenizer.backend_tokenizer.to_str(), "rows": len(prepared.train_dataset)}
with open(f"{work}/rank{dist.get_rank()}.json", "w") as handle:
    json.dump(result, handle)
prepared_data._build = original
"""


def write_ranks_corpus(folder: Path) -> list[str]:
    write_corpus(folder / "train.tsv")
    return []


# run in the session's one launch of two ranks (tests/two_ranks.py)
SCENARIO = Scenario(textwrap.dedent(RANKS), write_ranks_corpus)


def test_two_gloo_ranks_prepare_once_and_share_the_tokenizer(two_ranks):
    tmp_path = two_ranks("test_prepared_data")
    main_rank, other = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert (main_rank["world"], main_rank["built"], main_rank["reused"]) == (2, 1, False)
    assert (other["built"], other["reused"]) == (0, True)
    assert main_rank["folder"] == other["folder"] and main_rank["tokenizer"] == other["tokenizer"]
    assert main_rank["rows"] == other["rows"] == 150


def hub_style_dataset(folder: Path, train_rows: list[tuple[str, str]]) -> str:
    """A local folder `datasets.load_dataset` reads by name, with `{"translation": {"de": ..., "en": ...}}` rows."""
    folder.mkdir(exist_ok=True)
    for split, rows in (("train", train_rows), ("validation", train_rows[:4])):
        lines = [json.dumps({"translation": {"de": de, "en": en}}) for de, en in rows]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return str(folder)


def test_a_named_dataset_is_prepared_once_and_fingerprinted_by_its_datasets_fingerprint(tmp_path, spy):
    generator = random.Random(0)
    rows = [(f"{generator.choice(WORDS)} {generator.choice(WORDS)}", generator.choice(WORDS)) for _ in range(80)]
    name = hub_style_dataset(tmp_path / "wmt-like", rows)
    model_args = ModelArguments(model_type="deep_nmt", tokenizer_vocab_size=300)
    data_args = DataArguments(dataset_name=name, source_lang="en", target_lang="de", preprocessing_num_workers=1)
    first = prepare_data(model_args, data_args, seed=3)
    assert not first.reused and spy == {"tokenize": 2, "train": 1}
    assert set(first.record["inputs"]["corpus"]["fingerprints"]) == {"train", "validation"}
    assert (first.folder / "tokenizer" / "tokenizer.json").is_file() and len(first.train) == 80
    second = prepare_data(model_args, data_args, seed=3)
    assert second.reused and second.folder == first.folder and spy == {"tokenize": 2, "train": 1}
    hub_style_dataset(tmp_path / "wmt-like", [("eins zwei", "one two"), *rows[1:]])
    changed = prepare_data(model_args, data_args, seed=3)
    assert not changed.reused and changed.folder != first.folder and changed.train[0] != first.train[0]


def test_two_tokenizing_workers_give_the_rows_of_one(tmp_path, monkeypatch):
    monkeypatch.setattr(prepared_data, "PAIRS_PER_WORKER", 50)  # 150 pairs: two processes
    built = prepare_data(*settings(tmp_path, write_corpus(tmp_path / "train.tsv", long_pairs=2)), seed=3)
    dataset = prepared_data.write_parallel_arrow(tmp_path / "train.tsv", tmp_path / "pairs.arrow", "train_file")
    two = tokenize_split(dataset, built.tokenizer, 32, 32, True, 2, tmp_path / "two.arrow")
    assert len(list(tmp_path.glob("two_*.arrow"))) == 2  # written by two processes
    assert two["input_ids"] == built.train["input_ids"] and two["labels"] == built.train["labels"]
    assert len(two) == 150  # the two long pairs dropped in whichever process tokenized them
