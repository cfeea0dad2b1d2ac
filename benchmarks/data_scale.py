"""Preparing WMT-size corpora: this package's data path beside a lean `datasets` + `tokenizers` pipeline.

Synthetic WMT-like corpora (a Zipf vocabulary of ~50k word types per side, lognormal sentence lengths of ~25 words,
~274 bytes per pair; seeded, and each size a prefix of the larger ones) are written once as TSV into `--corpus-dir`.
For each size, every measured command runs in its own subprocess, one after another (at the `--smoke` size, a
fork of the driver that imported the children's modules once, so the smoke test pays one start-up, not four):

* `project` (needs `hf-deep-nmt prepare`): a first preparation with 1 and with 2 workers
  (`preprocessing_num_workers`), each into an empty prepared-data root; a second run of the same command; a resume
  (the in-process `hf_deep_nmt.training.pipeline.prepare()` that `train` calls, with a new `output_dir` and
  `resume_from_checkpoint` set); two ranks (`torchrun --nproc_per_node 2`, gloo, CPU) calling that same
  `prepare()` into an empty root.
* `inprocess`: the in-process `hf_deep_nmt.training.pipeline.prepare()` alone, which every version of the package has
  (the
  only path before `hf-deep-nmt prepare` existed): a first run, a second run, a resume, two ranks.
* `lean`: `datasets`' csv loader (memory-mapped Arrow in a cache folder), a `tokenizers` byte-level BPE trained on
  the same number of sampled pairs, `Dataset.map(batched=True, num_proc=N)` to uint16/int32 ids; first runs with 1
  and 2 workers, a second run over the same cache, two ranks (rank 0 prepares while rank 1 waits at a barrier, then
  loads the same cache).

Figures, per run: the CPU seconds of the whole process tree (`os.wait4` on the subprocess: it, its workers, under
`torchrun` both ranks) less the CPU its imports took, wall seconds of the same, and the peak resident memory above
imports: the process resets its high-water mark (`/proc/self/clear_refs` 5) once its imports are done and reports
`VmHWM` minus the `VmRSS` of that moment (per rank under `torchrun`; workers are separate processes, the largest
worker's peak resident set is given apart). Bytes per pair: the tokenized data on disk over the pairs kept.

    python benchmarks/data_scale.py                                  # 100k, 1M, 4M pairs; project and lean
    python benchmarks/data_scale.py --sizes 100000 --contenders inprocess lean
    /work/main/.venv/bin/python benchmarks/data_scale.py --contenders inprocess --sizes 100000 1000000 \\
        --json benchmarks/results/data_scale_before.json           # an older checkout's venv: its in-process path
    python benchmarks/data_scale.py --smoke                          # 2,000 pairs: tests/test_data_scale_smoke.py
    python benchmarks/data_scale.py --sampler --sizes 1000000 4000000   # one rank's batches (synthetic lengths)

The package measured is the one the running interpreter imports, so another venv's `python` measures another
checkout with this same script. Prints a Markdown table last; writes JSON to `--json`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results"
RUNS = ("second", "resume", "ranks")  # besides the first runs, which every other run starts from
CHUNK_PAIRS = 10_000  # the generator draws each chunk from its own seed, so a size is a prefix of every larger one
VALIDATION_PAIRS = 1_000
SMOKE_PAIRS = 2_000

# ---- the synthetic corpus ----------------------------------------------------------------------------------------

LETTERS = {"source": "etaoinshrdlcumwfgypbvkjxqz", "target": "enisratdhulcgmobwfkzvpüäößjyxq"}
ZIPF_EXPONENT = 1.0
MEAN_WORDS = 25.0
LENGTH_SIGMA = 0.5  # of log(words per sentence)
# frequency-weighted mean letters per word: with the umlauts (2 bytes) and the longer target side, ~274 bytes per pair
TARGET_WORD_BYTES = 4.18


def zipf_probabilities(types: int) -> np.ndarray:
    ranks = np.arange(1, types + 1, dtype=np.float64)
    weights = ranks**-ZIPF_EXPONENT
    return weights / weights.sum()


def word_lengths(types: int, probabilities: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Lengths growing with log rank (frequent words are short), shifted so that the frequency-weighted mean is
    `TARGET_WORD_BYTES`."""
    spread = rng.normal(0.0, 0.7, types)
    base = 0.55 * np.log(np.arange(1, types + 1)) + spread
    low, high = -5.0, 10.0
    for _ in range(40):  # bisection on the offset: the weighted mean of the rounded lengths rises with it
        offset = (low + high) / 2
        lengths = np.clip(np.rint(base + offset), 1, 18)
        if float(probabilities @ lengths) < TARGET_WORD_BYTES:
            low = offset
        else:
            high = offset
    return np.clip(np.rint(base + (low + high) / 2), 1, 18).astype(np.int64)


def vocabulary(side: str, types: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`types` distinct pseudo-words for one side (rank order) and their Zipf probabilities."""
    rng = np.random.default_rng([seed, 0 if side == "source" else 1])
    probabilities = zipf_probabilities(types)
    letters = LETTERS[side]
    # letter frequencies falling off like a language's, so byte-level BPE finds frequent pieces
    letter_weights = np.arange(1, len(letters) + 1, dtype=np.float64) ** -0.8
    letter_weights /= letter_weights.sum()
    words: list[str] = []
    seen: set[str] = set()
    for length in word_lengths(types, probabilities, rng):
        length = int(length)
        while True:
            word = "".join(letters[i] for i in rng.choice(len(letters), size=length, p=letter_weights))
            if word not in seen:
                break
            length += 1 if rng.random() < 0.3 else 0
        seen.add(word)
        words.append(word)
    return np.array(words, dtype=object), probabilities


def corpus_chunk(index: int, pairs: int, seed: int, vocabularies) -> str:
    """TSV text of `pairs` pairs drawn from chunk seed (`seed`, `index`)."""
    rng = np.random.default_rng([seed, 2, index])
    source_words = np.maximum(1, np.rint(rng.lognormal(np.log(MEAN_WORDS) - LENGTH_SIGMA**2 / 2, LENGTH_SIGMA, pairs)))
    target_words = np.maximum(1, np.rint(source_words * rng.lognormal(0.05, 0.12, pairs)))
    lengths = np.stack([source_words, target_words], axis=1).astype(np.int64).reshape(-1)  # src, tgt, src, tgt ...
    total = int(lengths.sum())
    is_target = np.repeat(np.tile([False, True], pairs), lengths)
    tokens = np.empty(total, dtype=object)
    for side, mask in (("source", ~is_target), ("target", is_target)):
        words, probabilities = vocabularies[side]
        ranks = np.searchsorted(np.cumsum(probabilities), rng.random(int(mask.sum())), side="right")
        tokens[mask] = words[np.minimum(ranks, len(words) - 1)]
    separators = np.full(total, " ", dtype=object)
    ends = np.cumsum(lengths) - 1
    separators[ends[0::2]] = ".\t"
    separators[ends[1::2]] = ".\n"
    text = np.empty(2 * total, dtype=object)
    text[0::2], text[1::2] = tokens, separators
    return "".join(text.tolist())


def make_corpus(folder: Path, pairs: int, seed: int, types: int) -> tuple[Path, Path]:
    """`train` of `pairs` pairs and a 1,000-pair `valid` (its own chunk seeds), written once into `folder`
    (to a temporary name, renamed when complete)."""
    folder.mkdir(parents=True, exist_ok=True)
    train = folder / f"wmtlike_{pairs}_types{types}_seed{seed}.tsv"
    valid = folder / f"wmtlike_valid_types{types}_seed{seed}.tsv"
    vocabularies = None
    for path, count, first_chunk in ((train, pairs, 0), (valid, VALIDATION_PAIRS, 10**9)):
        if path.is_file():
            continue
        if vocabularies is None:
            vocabularies = {side: vocabulary(side, types, seed) for side in ("source", "target")}
        started = time.perf_counter()
        partial = path.with_name(path.name + f".partial{os.getpid()}")
        with partial.open("w", encoding="utf-8") as handle:
            for index in range((count + CHUNK_PAIRS - 1) // CHUNK_PAIRS):
                handle.write(
                    corpus_chunk(
                        first_chunk + index, min(CHUNK_PAIRS, count - index * CHUNK_PAIRS), seed, vocabularies
                    )
                )
        partial.rename(path)
        print(
            f"wrote {path} ({count:,} pairs, {path.stat().st_size / count:.0f} bytes per pair, "
            f"{time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    return train, valid


# ---- what runs inside each measured subprocess -------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class Meter:
    """Started once the imports are done: resets the high-water mark and notes the resident set and CPU so far."""

    def __init__(self) -> None:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # VmHWM := VmRSS
        self.rss_kib = _status_kib("VmRSS")
        # VmHWM counts the pages of memory-mapped files too (Arrow files read through, reclaimable page cache); the
        # anonymous part (Python objects, buffers) has no high-water mark of its own, so a thread samples it
        self.anon_kib = self.anon_peak_kib = _status_kib("RssAnon")
        threading.Thread(target=self._sample_anon, daemon=True).start()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.import_cpu = usage.ru_utime + usage.ru_stime
        self.started = time.perf_counter()

    def _sample_anon(self) -> None:
        while True:
            self.anon_peak_kib = max(self.anon_peak_kib, _status_kib("RssAnon"))
            time.sleep(0.02)

    def report(self, **extra) -> dict:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.anon_peak_kib = max(self.anon_peak_kib, _status_kib("RssAnon"))
        return {
            "peak_above_imports_mb": (_status_kib("VmHWM") - self.rss_kib) / 1024,
            "anon_peak_above_imports_mb": (self.anon_peak_kib - self.anon_kib) / 1024,
            "rss_after_imports_mb": self.rss_kib / 1024,
            "import_cpu_s": self.import_cpu,
            "seconds_after_imports": time.perf_counter() - self.started,
            "largest_worker_peak_mb": children.ru_maxrss / 1024 if children.ru_maxrss else None,
            **extra,
        }


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_result(path: str, result: dict) -> None:
    target = Path(path)
    if "RANK" in os.environ:
        target = target.with_name(f"{target.stem}.rank{_rank()}{target.suffix}")
    target.write_text(json.dumps(result))


def _finish_distributed() -> None:
    """Leave together and skip the interpreter's teardown (gloo's threads can abort it; tests/test_distributed.py)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _disk_bytes(paths) -> int:
    total = 0
    for path in {Path(p) for p in paths}:
        if path.is_file():
            total += path.stat().st_size
        elif path.is_dir():
            total += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return total


def child_project_cli(options: dict) -> None:
    """`hf-deep-nmt prepare RECIPE FLAGS`, in this process, its stdout kept for the summary line."""
    import datasets  # noqa: F401  (the imports the command makes, before the meter starts)
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from hf_deep_nmt import cli  # noqa: F401

    meter = Meter()
    captured = io.StringIO()
    stdout, sys.stdout = sys.stdout, captured
    try:
        code = cli.main(["prepare", options["recipe"], *options["flags"]])
    finally:
        sys.stdout = stdout
    text = captured.getvalue()
    print(text, end="")
    lines = [line for line in text.splitlines() if line.strip()]
    summary = json.loads(lines[-1]) if code in (0, None) and lines else None
    if summary:  # the training split alone (the folder's total also holds the tokenizer and the validation text)
        summary["folder_bytes_on_disk"] = summary["bytes_on_disk"]
        summary["bytes_on_disk"] = _disk_bytes([Path(summary["folder"]) / "train"])
    _write_result(options["result"], meter.report(exit_code=code, summary=summary))


def child_inprocess(options: dict) -> None:
    """`hf_deep_nmt.training.pipeline.prepare(*parse_arguments(RECIPE FLAGS))`: the call `train` makes before the
    model."""
    import datasets  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from hf_deep_nmt.training import pipeline as training
    from hf_deep_nmt.training.arguments import parse_arguments

    meter = Meter()
    model_args, data_args, _export_args, training_args = parse_arguments([options["recipe"], *options["flags"]])
    prepared = training.prepare(model_args, data_args, training_args)
    train = prepared.train_dataset
    files = [entry["filename"] for entry in train.cache_files]
    disk = _disk_bytes(files)
    summary = {
        "pairs_kept": len(train),
        "in_memory": not files,
        "arrow_bytes": train.data.nbytes,
        "bytes_on_disk": disk,
        "id_types": {
            name: str(feature.feature.dtype)
            for name, feature in train.features.items()
            if hasattr(feature, "feature") and hasattr(feature.feature, "dtype")
        },
        "vocabulary": len(prepared.tokenizer),
    }
    _write_result(options["result"], meter.report(summary=summary))
    if "RANK" in os.environ:
        _finish_distributed()


def child_lean(options: dict) -> None:
    """The lean pipeline: csv loader -> memory-mapped Arrow; a byte-level BPE on a seeded sample; `map` to ids."""
    import datasets
    import tokenizers  # noqa: F401
    import torch.distributed as dist
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    meter = Meter()
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        dist.init_process_group("gloo")
    work = Path(options["work"])
    if _rank() > 0:
        dist.barrier()  # rank 0 prepares; the others then open the same cache (the datasets fingerprints match)
    raw = datasets.load_dataset(
        "csv",
        data_files=options["train_file"],
        delimiter="\t",
        column_names=["source", "target"],
        quoting=3,
        keep_default_na=False,
        cache_dir=str(work / "cache"),
        split="train",
    )
    saved = work / "tokenizer.json"
    if saved.is_file():
        tokenizer = Tokenizer.from_file(str(saved))
    else:
        count = min(options["tokenizer_train_pairs"], len(raw))
        sample = raw.select(np.sort(np.random.default_rng(0).choice(len(raw), size=count, replace=False)))
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.normalizer = normalizers.NFKC()
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=options["vocab_size"],
            min_frequency=2,
            special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )

        def texts():
            for batch in sample.iter(batch_size=10_000):
                yield from batch["source"]
                yield from batch["target"]

        tokenizer.train_from_iterator(texts(), trainer=trainer)
        tokenizer.post_processor = processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", tokenizer.token_to_id("</s>"))]
        )
        tokenizer.save(str(saved))
    id_type = "uint16" if tokenizer.get_vocab_size() <= 65_536 else "int32"
    features = datasets.Features(
        {"input_ids": datasets.Sequence(datasets.Value(id_type)), "labels": datasets.Sequence(datasets.Value(id_type))}
    )
    limit = options["max_length"]

    def encode(batch):
        sources = [e.ids for e in tokenizer.encode_batch(batch["source"])]
        targets = [e.ids for e in tokenizer.encode_batch(batch["target"])]
        keep = [len(s) <= limit and len(t) <= limit for s, t in zip(sources, targets)]
        return {
            "input_ids": [s for s, k in zip(sources, keep) if k],
            "labels": [t for t, k in zip(targets, keep) if k],
        }

    workers = options["workers"]
    encoded = raw.map(
        encode,
        batched=True,
        batch_size=2_000,
        num_proc=workers if workers > 1 else None,
        remove_columns=raw.column_names,
        features=features,
        desc="lean tokenizing",
    )
    if _rank() == 0 and ranks > 1:
        dist.barrier()
    files = [entry["filename"] for entry in encoded.cache_files]
    summary = {
        "pairs_read": len(raw),
        "pairs_kept": len(encoded),
        "bytes_on_disk": _disk_bytes(files),
        "raw_arrow_bytes_on_disk": _disk_bytes(entry["filename"] for entry in raw.cache_files),
        "id_type": id_type,
        "vocabulary": tokenizer.get_vocab_size(),
    }
    _write_result(options["result"], meter.report(summary=summary))
    if ranks > 1:
        _finish_distributed()


def child_sampler(options: dict) -> None:
    """One rank's token-budget batches for an epoch, from a lengths file: `role` "rank" takes them as the package
    does at a start or resume (a stored plan when the package stores one, else every batch built from a Python list
    of lengths, as `pair_lengths` gave them); `role` "plan" is the main process computing and storing the plan."""
    from hf_deep_nmt.data import batching

    meter = Meter()
    world, rank, budget, seed = options["world"], options["rank"], options["max_tokens"], options["seed"]
    stored = hasattr(batching, "read_plan")
    if options["role"] == "plan":
        lengths = np.load(options["lengths"])  # int32: what `length_array` reads from Arrow
        plan = batching.plan_batches(lengths, budget, seed, multiple_of=world)
        del lengths
        batching.write_plan(options["plan"], plan)
        summary = {"batches": len(plan), "stored": True}
    else:
        if stored:
            plan = batching.read_plan(options["plan"], options["pairs"])
            sampler = batching.TokenBudgetBatchSampler(None, num_replicas=world, rank=rank, seed=seed, plan=plan)
        else:
            lengths = np.load(options["lengths"]).tolist()
            sampler = batching.TokenBudgetBatchSampler(lengths, budget, world, rank, seed)
            del lengths
        rows = sum(len(batch) for batch in sampler)  # the epoch's share, as the loader reads it
        summary = {"batches": len(sampler), "rows": rows, "stored": stored}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    summary["cpu_s"] = usage.ru_utime + usage.ru_stime - meter.import_cpu  # without the interpreter's teardown
    _write_result(options["result"], meter.report(summary=summary))


def sampler_rows(args) -> list[dict]:
    """`--sampler`: per size, synthetic lengths (lognormal around 30 tokens, 1 to `--max-length`), the main process
    storing the plan (when the package stores one) and one rank of `--world` taking its share, twice (a start, then a
    resume that finds the plan)."""
    work = Path(args.work_dir) / "sampler"
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for pairs in args.sizes:
        rng = np.random.default_rng(args.seed)
        lengths = np.clip(rng.lognormal(np.log(30), 0.5, pairs), 1, args.max_length).astype(np.int32)
        np.save(work / f"lengths-{pairs}.npy", lengths)
        plan = fresh(work / f"plan-{pairs}") / "plan"
        options = {"lengths": str(work / f"lengths-{pairs}.npy"), "plan": str(plan), "pairs": pairs}
        options.update(world=args.world, rank=args.world - 1, max_tokens=args.max_tokens, seed=args.seed)
        options["result"] = str(work / "result.json")
        runs = ["plan", "rank", "rank"] if stores_plans() else ["rank", "rank"]
        for number, role in enumerate(runs):
            run = role if role == "plan" else ("start" if number == runs.index("rank") else "resume")
            result = measure("sampler", {**options, "role": role}, dict(os.environ), work / "log.txt")
            row = {"pairs": pairs, "contender": "sampler", "run": run, "processes": f"rank of {args.world}"}
            result["cpu_s"] = result["summary"]["cpu_s"]  # the work alone: the tree's time includes the teardown
            rows.append({**row, **result, "bytes_per_pair_on_disk": None, "reused": None})
            print(
                f"{pairs:,} {run}: {result['cpu_s']:.2f} CPU s, {result['anon_peak_above_imports_mb']} MB", flush=True
            )
    return rows


def add_sampler_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sampler", action="store_true", help="only the token-budget batches of one rank (seconds)")
    parser.add_argument("--world", type=int, default=8, help="--sampler: processes the batches are shared among")
    parser.add_argument("--max-tokens", type=int, default=4096, help="--sampler: the token budget")


def sampler_main(args) -> int:
    """`--sampler`: the rows of `sampler_rows`, printed and written to `--json`."""
    rows = sampler_rows(args)
    out = Path(args.json or RESULTS / "data_scale_sampler.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": vars(args), "machine": machine(), "rows": rows}, indent=1))
    print(f"\n{markdown(rows)}\n\nwrote {out}")
    return 0


def stores_plans() -> bool:
    """Whether the imported package stores batch plans (older versions build every batch in every rank)."""
    from hf_deep_nmt.data import batching

    return hasattr(batching, "read_plan")


CHILDREN = {
    "project_cli": child_project_cli,
    "inprocess": child_inprocess,
    "lean": child_lean,
    "sampler": child_sampler,
}


# ---- the driver ----------------------------------------------------------------------------------------------------


def forked_child(kind: str, options: dict, env: dict, handle) -> int:
    """Smoke size: run one child in a fork of this driver, which imported what the children import (`preload`), so
    each run is still a process of its own but pays no interpreter start-up or imports; returns the fork's pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
        os.environ.clear()
        os.environ.update(env)
        CHILDREN[kind](options)
        code = 0
    except BaseException:  # noqa: BLE001  (the log gets the traceback; the driver sees the exit code)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class DiskMeter:
    """The bytes a run adds under a folder (prepared data, caches, building folders), sampled about once a second
    by the driver while it waits: a preparation that writes its tokens twice peaks above what it leaves."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self.start = self.peak = self.now = _disk_bytes([folder]) if folder else 0
        self.last = 0.0

    def sample(self, force: bool = False) -> None:
        if self.folder is None or (not force and time.perf_counter() - self.last < 1.0):
            return
        try:
            self.now = _disk_bytes([self.folder])
        except OSError:  # a file removed between listing and stat: the next sample sees the folder settled
            return
        self.peak = max(self.peak, self.now)
        self.last = time.perf_counter()

    def report(self) -> dict:
        if self.folder is None:
            return {}
        self.sample(force=True)
        return {
            "disk_peak_added_mb": (self.peak - self.start) / 2**20,
            "disk_end_added_mb": (self.now - self.start) / 2**20,
        }


def measure(
    kind: str,
    options: dict,
    env: dict,
    log: Path,
    ranks: int = 1,
    timeout: float | None = None,
    fork: bool = False,
    disk_folder: Path | None = None,
) -> dict:
    """Run one child (under `torchrun` when `ranks` > 1; a fork of this driver when `fork`) and return its reports
    with the tree's CPU and wall time, and the bytes it added under `disk_folder` at their peak and at its end."""
    result = Path(options["result"])
    for stale in result.parent.glob(result.stem + "*"):
        stale.unlink()
    command = [sys.executable, str(HERE), "--child", kind, json.dumps(options)]
    if ranks > 1:
        torchrun = Path(sys.executable).parent / "torchrun"
        command = [str(torchrun), "--standalone", "--nproc_per_node", str(ranks), *command[1:]]
    disk = DiskMeter(Path(disk_folder) if disk_folder else None)
    started = time.perf_counter()
    with log.open("w") as handle:
        if fork and ranks == 1:
            child = forked_child(kind, options, env, handle)
        else:
            child = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT).pid
        deadline = None if timeout is None else started + timeout
        while True:
            pid, status, usage = os.wait4(child, os.WNOHANG)
            if pid:
                break
            if deadline is not None and time.perf_counter() > deadline:
                os.kill(child, signal.SIGKILL)
                pid, status, usage = os.wait4(child, 0)
                break
            disk.sample()
            time.sleep(0.05)
    returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - started
    if ranks > 1:
        files = sorted(result.parent.glob(result.stem + ".rank*" + result.suffix))
        reports = [json.loads(path.read_text()) for path in files]
    else:
        reports = [json.loads(result.read_text())] if result.is_file() else []
    if returncode != 0 or len(reports) != ranks:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{kind} ({' '.join(command[:4])} ...) exited {returncode}; log {log}:\n{tail}")
    imports = sum(report["import_cpu_s"] for report in reports)
    return {
        "cpu_s": usage.ru_utime + usage.ru_stime - imports,
        "cpu_with_imports_s": usage.ru_utime + usage.ru_stime,
        "wall_s": max(report["seconds_after_imports"] for report in reports),
        "wall_with_startup_s": wall,
        "peak_above_imports_mb": [report["peak_above_imports_mb"] for report in reports],
        "anon_peak_above_imports_mb": [report.get("anon_peak_above_imports_mb") for report in reports],
        "largest_worker_peak_mb": max((report["largest_worker_peak_mb"] or 0) for report in reports) or None,
        "summary": reports[0].get("summary"),
        "summaries": [report.get("summary") for report in reports],
        **disk.report(),
    }


def code_facts(python: str) -> dict:
    """What the imported package offers: the `prepare` command, the new recipe fields."""
    probe = (
        "import json, dataclasses; from hf_deep_nmt import cli, arguments, __file__ as f\n"
        "fields = {x.name for c in arguments.ARGUMENT_CLASSES for x in dataclasses.fields(c)}\n"
        "print(json.dumps({'package': f, 'prepare_command': 'prepare' in open(cli.__file__).read(),"
        " 'fields': sorted(fields & {'prepared_data_dir', 'preprocessing_num_workers', 'tokenizer_train_pairs',"
        " 'streaming'})}))"
    )
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True, cwd=HERE.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_recipe(path: Path, train: Path, valid: Path, args, facts: dict) -> None:
    recipe = {
        "model_type": "deep_nmt",
        "train_file": str(train),
        "validation_file": str(valid),
        "tokenizer_vocab_size": args.vocab_size,
        "max_source_length": args.max_length,
        "max_target_length": args.max_length,
        "max_eval_samples": VALIDATION_PAIRS,
        "output_dir": str(path.parent / "run"),
        "report_to": "none",
        "seed": 1,
    }
    if "tokenizer_train_pairs" in facts["fields"]:
        recipe["tokenizer_train_pairs"] = args.tokenizer_train_pairs
    path.write_text(json.dumps(recipe, indent=1))


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def load_average() -> list[float]:
    with open("/proc/loadavg") as handle:
        return [float(x) for x in handle.read().split()[:3]]


def child_settings(work: Path) -> dict:
    """The environment every measured run gets (some of it read when `datasets`, `huggingface_hub` are imported)."""
    return {
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "HF_DATASETS_CACHE": str(work / "hf_datasets_cache"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def preload(work: Path) -> dict:
    """Smoke size: take the children's settings and imports into this driver once, for the runs to fork from (their
    import-time settings then hold), and read the code's facts here instead of in a probe process."""
    os.environ.update(child_settings(work))
    import dataclasses

    import datasets  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from hf_deep_nmt import __file__ as package
    from hf_deep_nmt import arguments, cli

    fields = {x.name for c in arguments.ARGUMENT_CLASSES for x in dataclasses.fields(c)}
    wanted = {"prepared_data_dir", "preprocessing_num_workers", "tokenizer_train_pairs", "streaming"}
    with open(cli.__file__) as handle:
        prepare_command = "prepare" in handle.read()
    return {"package": package, "prepare_command": prepare_command, "fields": sorted(fields & wanted)}


def run_size(pairs: int, args, facts: dict, work: Path, rows: list[dict], save) -> None:
    """Measure every run asked for at this size; each row is appended to `rows` and saved (`save()`) when done, so
    an interrupted run keeps what it measured."""
    train, valid = make_corpus(Path(args.corpus_dir), pairs, args.seed, args.types)
    corpus_bytes = train.stat().st_size
    work = fresh(work / f"pairs{pairs}")
    recipe = work / "recipe.json"
    write_recipe(recipe, train, valid, args, facts)
    base_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    base_env.update(child_settings(work))

    def record(contender: str, run: str, processes: str, kind: str, options: dict, env: dict, ranks: int = 1) -> dict:
        name = f"{contender}-{run}".replace(" ", "_").replace(",", "")
        options = {**options, "result": str(work / f"{name}.json")}
        print(f"[{pairs:,} pairs] {contender}: {run} ...", flush=True)
        figures = measure(kind, options, env, work / f"{name}.log", ranks, args.timeout, args.smoke, work)
        row = {"pairs": pairs, "contender": contender, "run": run, "processes": processes, **figures}
        summary = figures["summary"] or {}
        kept = summary.get("pairs_kept")
        disk = summary.get("bytes_on_disk")
        row["bytes_per_pair_on_disk"] = disk / kept if disk and kept else None
        row["reused"] = summary.get("reused")
        row["corpus_bytes_per_pair"] = corpus_bytes / pairs
        row["load_average"] = load_average()
        rows.append(row)
        save()
        print(
            f"    cpu {row['cpu_s']:.1f} s, wall {row['wall_s']:.1f} s, peak above imports "
            f"{', '.join(f'{mb:.0f}' for mb in row['peak_above_imports_mb'])} MB, "
            f"bytes/pair {row['bytes_per_pair_on_disk'] or 0:.0f}, reused {row['reused']}, disk added "
            f"{row.get('disk_peak_added_mb', 0):.0f} MB at peak, {row.get('disk_end_added_mb', 0):.0f} MB at the end",
            flush=True,
        )
        return row

    def env_with(root: Path | None) -> dict:
        env = dict(base_env)
        if root is not None:
            env["HF_DEEP_NMT_PREPARED_DATA"] = str(root)
        return env

    run_flags = ["--output_dir", str(work / "run")]
    ranks_here = "ranks" in args.runs and (args.ranks_up_to is None or pairs <= args.ranks_up_to)
    repeat_here = args.repeat_up_to is None or pairs <= args.repeat_up_to
    if "project" in args.contenders:
        if not facts["prepare_command"]:
            raise SystemExit(
                f"`project` needs `hf-deep-nmt prepare`, which {facts['package']} does not have; "
                "measure `inprocess` there."
            )
        for workers in args.workers:
            root = fresh(work / f"prepared_w{workers}")
            flags = [*run_flags, "--preprocessing_num_workers", str(workers)]
            record(
                "project",
                f"first, {workers} worker{'s' * (workers > 1)}",
                str(workers),
                "project_cli",
                {"recipe": str(recipe), "flags": flags},
                env_with(root),
            )
        flags = [*run_flags, "--preprocessing_num_workers", str(args.workers[-1])]
        if "second" in args.runs:
            record(
                "project",
                "second run",
                str(args.workers[-1]),
                "project_cli",
                {"recipe": str(recipe), "flags": flags},
                env_with(root),
            )
        resume_flags = [
            "--output_dir",
            str(work / "run_resumed"),
            "--resume_from_checkpoint",
            "true",
            "--preprocessing_num_workers",
            str(args.workers[-1]),
        ]
        if "resume" in args.runs:
            record(
                "project",
                "resume (train's prepare())",
                str(args.workers[-1]),
                "inprocess",
                {"recipe": str(recipe), "flags": resume_flags},
                env_with(root),
            )
        if ranks_here:
            root = fresh(work / "prepared_ranks")
            record(
                "project",
                "2 ranks, first (train's prepare())",
                f"2 ranks x {args.workers[-1]}",
                "inprocess",
                {"recipe": str(recipe), "flags": flags},
                env_with(root),
                ranks=2,
            )
    if "inprocess" in args.contenders:
        extra = ["--preprocessing_num_workers", "1"] if "preprocessing_num_workers" in facts["fields"] else []
        root = fresh(work / "prepared_inprocess")
        options = {"recipe": str(recipe), "flags": [*run_flags, *extra]}
        record("inprocess", "first", "1", "inprocess", options, env_with(root))
        if repeat_here and "second" in args.runs:
            record("inprocess", "second run", "1", "inprocess", options, env_with(root))
        if repeat_here and "resume" in args.runs:
            resume = {
                "recipe": str(recipe),
                "flags": ["--output_dir", str(work / "run_resumed"), "--resume_from_checkpoint", "true", *extra],
            }
            record("inprocess", "resume", "1", "inprocess", resume, env_with(root))
        if ranks_here:
            root = fresh(work / "prepared_inprocess_ranks")
            record("inprocess", "2 ranks, first", "2 ranks x 1", "inprocess", options, env_with(root), ranks=2)
    if "lean" in args.contenders:
        lean = {
            "train_file": str(train),
            "vocab_size": args.vocab_size,
            "max_length": args.max_length,
            "tokenizer_train_pairs": args.tokenizer_train_pairs,
        }
        for workers in args.workers:
            options = {**lean, "workers": workers, "work": str(fresh(work / f"lean_w{workers}"))}
            record("lean", f"first, {workers} worker{'s' * (workers > 1)}", str(workers), "lean", options, base_env)
        if repeat_here and "second" in args.runs:
            record("lean", "second run", str(workers), "lean", options, base_env)
        if ranks_here:
            options = {**lean, "workers": args.workers[-1], "work": str(fresh(work / "lean_ranks"))}
            record("lean", "2 ranks, first", f"2 ranks x {args.workers[-1]}", "lean", options, base_env, ranks=2)
    if not args.keep:
        for folder in work.glob("*"):
            if folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| pairs | contender | run | processes | CPU s | wall s | peak MB above imports (per rank) "
        "| of it anonymous | largest worker MB | bytes/pair on disk | pairs kept | reused |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        summary = row["summary"] or {}
        peaks = " + ".join(f"{mb:,.0f}" for mb in row["peak_above_imports_mb"])
        anon = " + ".join(f"{mb:,.0f}" for mb in row.get("anon_peak_above_imports_mb") or [] if mb is not None)
        worker = f"{row['largest_worker_peak_mb']:,.0f}" if row["largest_worker_peak_mb"] else ""
        disk = (
            f"{row['bytes_per_pair_on_disk']:.0f}"
            if row["bytes_per_pair_on_disk"]
            else (f"in RAM ({summary['arrow_bytes'] / summary['pairs_kept']:.0f})" if summary.get("in_memory") else "")
        )
        kept = summary.get("pairs_kept")
        reused = "" if row["reused"] is None else str(row["reused"]).lower()
        lines.append(
            f"| {row['pairs']:,} | {row['contender']} | {row['run']} | {row['processes']} | {row['cpu_s']:.1f} | "
            f"{row['wall_s']:.1f} | {peaks} | {anon} | {worker} | {disk} | {kept:,} | {reused} |"
            if kept is not None
            else f"| {row['pairs']:,} | {row['contender']} | {row['run']} | {row['processes']} | {row['cpu_s']:.1f} | "
            f"{row['wall_s']:.1f} | {peaks} | {anon} | {worker} | {disk} | | {reused} |"
        )
    return "\n".join(lines)


def machine() -> dict:
    import datasets
    import tokenizers

    try:
        import hf_deep_nmt

        package = str(Path(hf_deep_nmt.__file__).parent)
    except ImportError:
        package = None
    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": load_average(),
        "datasets": datasets.__version__,
        "tokenizers": tokenizers.__version__,
        "package": package,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("options", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_PAIRS:,} pairs, a 2k vocabulary: seconds")
    parser.add_argument(
        "--contenders", nargs="+", choices=("project", "inprocess", "lean"), default=["project", "lean"]
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="first runs with each count")
    parser.add_argument(
        "--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which runs (the first runs always happen)"
    )
    parser.add_argument("--ranks-up-to", type=int, help="2-rank runs only for sizes up to this (default: all)")
    parser.add_argument("--repeat-up-to", type=int, help="inprocess, lean: repeat runs only up to this size")
    parser.add_argument(
        "--corpus-dir",
        default=str(HERE.parent / ".data_scale_corpora"),
        help="where the generated corpora are kept, so each size is written once",
    )
    parser.add_argument("--work-dir", default=str(HERE.parent / ".data_scale_work"))
    parser.add_argument("--keep", action="store_true", help="keep the prepared folders and caches of each size")
    parser.add_argument("--types", type=int, default=50_000, help="word types per side")
    parser.add_argument("--vocab-size", type=int, default=32_000, help="joint BPE vocabulary")
    parser.add_argument("--tokenizer-train-pairs", type=int, default=1_000_000, help="BPE sample (both contenders)")
    parser.add_argument("--max-length", type=int, default=128, help="source and target token limits")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, help="seconds for one measured command")
    parser.add_argument("--json", help="default benchmarks/results/data_scale.json (data_scale_smoke.json)")
    add_sampler_arguments(parser)
    args = parser.parse_args(argv)
    if args.child:
        CHILDREN[args.child](json.loads(args.options))
        return 0
    if args.sampler:  # the token-budget batches alone
        return sampler_main(args)
    if args.smoke:
        args.sizes, args.types, args.vocab_size = [SMOKE_PAIRS], 5_000, 2_000
        args.work_dir = args.work_dir + "_smoke"
    facts = preload(Path(args.work_dir) / f"pairs{SMOKE_PAIRS}") if args.smoke else code_facts(sys.executable)
    about = machine()
    print(
        f"package {facts['package']}; prepare command: {facts['prepare_command']}; fields {facts['fields']}; "
        f"load average {about['load_average']}",
        flush=True,
    )
    started = time.perf_counter()
    rows: list[dict] = []
    out = Path(args.json or RESULTS / ("data_scale_smoke.json" if args.smoke else "data_scale.json"))
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(complete: bool = False) -> None:
        result = {
            "settings": {key: value for key, value in vars(args).items() if key not in ("child", "options")},
            "code": facts,
            "machine": about,
            "load_average_now": load_average(),
            "seconds": time.perf_counter() - started,
            "complete": complete,
            "rows": rows,
        }
        out.write_text(json.dumps(result, indent=1))

    for pairs in args.sizes:
        run_size(pairs, args, facts, Path(args.work_dir), rows, save)
    save(complete=True)
    print(f"\n{markdown(rows)}\n\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
