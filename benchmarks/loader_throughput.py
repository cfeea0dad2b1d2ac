"""What the training loader delivers: real target tokens per CPU second, from the prepared data (memory-mapped Arrow,
uint16 ids, no stored attention mask) beside the in-memory tokenized dataset that `train` built before (int64 labels,
a stored attention mask), in one process at one thread; and the streamed path (`streaming: true`), which reads and
tokenizes the corpus while training: its batches of one pass over the same corpus, collated the same way, the
tokenizer at one thread.

Both go through what `hf-deep-nmt train` uses with `max_tokens`: `TokenBudgetBatchSampler` over `pair_lengths`, a
`DataLoader` with `DataCollatorForSeq2Seq` (padding, the attention mask, `decoder_input_ids` from the labels); the
streamed path goes through a streamed run's loader (`StreamLoader`, with 0, 1 and 2 loader workers: CPU seconds of
this process and the workers together, their start and end included, each row from a cold word memo) and collates
as a streamed run does (`StreamCollator`: the same tensors, padded from the worker's arrays at once instead of the
collator's per-pair lists, handed over by value). Wall seconds are reported too (they need idle cores to mean
anything; the load average at the end is printed). One more row says what the prepared path would reach with that
collation too (its features as lists turned into arrays, then `collate_rows`; `train` does not collate so). The
same corpus and the same tokenizer for both; the time of building the sampler (lengths read from Arrow) is reported
apart from the time of iterating the batches. Ratios, not absolute figures, are the result: `after / before`, and
`streamed / prepared`. "Cores per H100": the cores that loader needs to feed one GPU that trains on 300,000 target
tokens per second (a base model on an H100).

    python benchmarks/loader_throughput.py                     # 100,000 WMT-like pairs (data_scale's generator)
    python benchmarks/loader_throughput.py --pairs 5000 --smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the streamed path's tokenizer on one core too

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import DataCollatorForSeq2Seq  # noqa: E402

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration  # noqa: E402
from hf_deep_nmt.data import streaming  # noqa: E402
from hf_deep_nmt.data.batching import TokenBudgetBatchSampler, pair_lengths  # noqa: E402
from hf_deep_nmt.data.corpus import read_parallel_file, tokenize_parallel  # noqa: E402
from hf_deep_nmt.data.prepared import prepare_data  # noqa: E402
from hf_deep_nmt.data.streaming import (  # noqa: E402
    BatchRows,
    FileSource,
    StreamedPairs,
    StreamLoader,
    _fast_settings,
    collate_rows,
)
from hf_deep_nmt.training.arguments import DataArguments, ModelArguments  # noqa: E402

HERE = Path(__file__).resolve().parent
H100_TARGET_TOKENS_PER_S = 300_000


def corpus_generator():
    """`benchmarks/data_scale.py`'s WMT-like corpus generator (one definition of the synthetic corpus)."""
    spec = importlib.util.spec_from_file_location("data_scale", HERE / "data_scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def array_collation(collator):
    """`collator`'s batches made as a streamed run makes them (`collate_rows`), from features given as lists."""
    settings = _fast_settings(collator)

    def collate(features: list[dict]) -> dict:
        sources, targets = [row["input_ids"] for row in features], [row["labels"] for row in features]
        arrays = [
            array
            for side in (sources, targets)
            for array in (
                np.fromiter(chain.from_iterable(side), dtype=np.int32),
                np.fromiter(map(len, side), dtype=np.int64, count=len(side)),
            )
        ]
        return collate_rows(BatchRows(*arrays), settings)

    return collate


def iterate(dataset, tokenizer, model, max_tokens: int, seed: int, arrays: bool = False) -> dict:
    """Build the sampler, then collate every batch once (`arrays`: by `array_collation`); CPU seconds of each part and
    the real target tokens."""
    started = time.process_time()
    sampler = TokenBudgetBatchSampler(pair_lengths(dataset), max_tokens, seed=seed)
    sampler_seconds = time.process_time() - started
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    collate = array_collation(collator) if arrays else collator
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=0)
    tokens = padded = batches = 0
    started, wall = time.process_time(), time.perf_counter()
    for batch in loader:
        labels = batch["labels"]
        tokens += int(labels.ne(-100).sum())
        padded += labels.numel()
        batches += 1
    seconds, wall = time.process_time() - started, time.perf_counter() - wall
    return {
        "batches": batches,
        "target_tokens": tokens,
        "real_fraction": round(tokens / padded, 4),
        "sampler_cpu_s": round(sampler_seconds, 3),
        "iterate_cpu_s": round(seconds, 3),
        "tokens_per_cpu_s": round(tokens / seconds),
        "wall_s": round(wall, 3),
        "tokens_per_wall_s": round(tokens / wall),
    }


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have ended (the loader's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def loader_batches(loader: StreamLoader, workers: int):
    """(batch, position of the reader that read it) of a loader of `workers` readers (0 or 1: one), which takes their
    batches in turn from the first."""
    for batch in loader:
        position = loader.position
        yield batch, (position["readers"][(position["batches"] - 1) % workers] if workers > 1 else position)


def cold_piece_memo() -> None:
    """Forget the word-by-word encoder's memo (each process's, built at its first text), so that every streamed row
    starts as a run does, from nothing: a loader worker forked after an earlier row would inherit a warm one."""
    getattr(streaming, "_PIECE_ENCODERS", {}).clear()


def stream_pass(train: Path, tokenizer, model, args, workers: int, expected_tokens: int) -> dict:
    """The streamed path's batches of one pass over `train` (read, tokenized, batched, collated) through a streamed
    run's loader (`StreamLoader`) of `workers` loader workers (0: in this process), each reading its own pairs; CPU
    seconds of the whole (this process and the workers: their start, each batch handed over, their end) and wall
    seconds, up to the batch that completes the pass's `expected_tokens` target tokens (a reader that ends its pass
    first reads at most a buffer or two of the next)."""
    max_tokens, seed, buffer_pairs = args.max_tokens, args.seed, args.buffer_pairs
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    readers = {"workers": workers} if workers > 1 else {}  # (so that an older version measures its one reader)
    stream = StreamedPairs(
        FileSource(train, "en", "de"), tokenizer, buffer_pairs, 128, 128, max_tokens, seed=seed, **readers
    )
    cold_piece_memo()
    tokens = padded = count = 0
    started, wall = _cpu_seconds(), time.perf_counter()
    batches = loader_batches(StreamLoader(stream, collator, num_workers=workers), workers)
    for batch, position in batches:
        if position["pass"] > 0:  # this reader's pass has ended; the others are still reading theirs
            continue
        labels = batch["labels"]
        tokens += int(labels.ne(-100).sum())
        padded += labels.numel()
        count += 1
        if tokens >= expected_tokens:
            break
    del batches  # the loader's workers end here, and their CPU time is counted
    seconds, wall = _cpu_seconds() - started, time.perf_counter() - wall
    return {
        "batches": count,
        "target_tokens": tokens,
        "real_fraction": round(tokens / padded, 4),
        "sampler_cpu_s": 0.0,
        "iterate_cpu_s": round(seconds, 3),
        "tokens_per_cpu_s": round(tokens / seconds),
        "wall_s": round(wall, 3),
        "tokens_per_wall_s": round(tokens / wall),
    }


def tiny_model(tokenizer):
    """A one-layer model: the collator asks it for `decoder_input_ids`, nothing else of it runs."""
    config = DeepNMTConfig(
        vocab_size=len(tokenizer),
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
    )
    return DeepNMTForConditionalGeneration(config)


def print_table(rows: dict[str, dict]) -> None:
    """The Markdown table of the rows, each given its cores per H100."""
    print(
        "| loader | batches | real target tokens | real / padded | sampler CPU s | iterate CPU s | tokens / CPU s "
        "| cores per H100 | wall s | tokens / wall s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        row["cores_per_h100"] = round(H100_TARGET_TOKENS_PER_S / row["tokens_per_cpu_s"], 2)
        print(
            f"| {name} | {row['batches']} | {row['target_tokens']:,} | {row['real_fraction']:.1%} | "
            f"{row['sampler_cpu_s']} | {row['iterate_cpu_s']} | {row['tokens_per_cpu_s']:,} | "
            f"{row['cores_per_h100']} | {row['wall_s']} | {row['tokens_per_wall_s']:,} |"
        )


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--buffer-pairs", type=int, default=1_000, help="the streamed path's `stream_buffer_pairs`")
    parser.add_argument("--smoke", action="store_true", help="a tiny run: checks the script, measures nothing")
    parser.add_argument("--json", default=None, help="write the result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    generator = corpus_generator()
    with tempfile.TemporaryDirectory(prefix="loader-throughput-") as work:
        work = Path(work)
        train, _ = generator.make_corpus(work / "corpus", args.pairs, args.seed, 50_000)
        model_args = ModelArguments(tokenizer_vocab_size=args.vocab)
        data_args = DataArguments(train_file=str(train), prepared_data_dir=str(work / "prepared"))
        after = prepare_data(model_args, data_args, seed=args.seed)
        tokenizer = after.tokenizer
        # what `train` held before: the text read into lists, tokenized in memory (int64 labels, attention mask)
        before = tokenize_parallel(datasets.Dataset.from_dict(read_parallel_file(train)), tokenizer, 128, 128)
        before = datasets.Dataset.from_dict(before.to_dict())  # in memory, as `from_dict` + `map` kept it
        model = tiny_model(tokenizer)
        if len(before) != len(after.train):
            raise SystemExit(f"the two paths kept {len(before)} and {len(after.train)} pairs: not the same data")
        rows = {
            "before (in memory)": iterate(before, tokenizer, model, args.max_tokens, args.seed),
            "after (prepared, memory-mapped)": iterate(after.train, tokenizer, model, args.max_tokens, args.seed),
        }
        rows["prepared, array collation (not what train uses)"] = iterate(
            after.train, tokenizer, model, args.max_tokens, args.seed, arrays=True
        )
        expected = rows["after (prepared, memory-mapped)"]["target_tokens"]
        for workers in (0, 1, 2):
            name = f"streamed, {workers} loader worker{'s' if workers != 1 else ''}"
            rows[name] = stream_pass(train, tokenizer, model, args, workers, expected)
    first, second, arrays, streamed_zero, streamed, streamed_two = rows.values()
    for other in (first, arrays):
        if other["target_tokens"] != second["target_tokens"] or other["batches"] != second["batches"]:
            raise SystemExit(f"two loaders of the same data gave different batches: {other} vs {second}")
    result = {
        "pairs": args.pairs,
        "max_tokens": args.max_tokens,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "after_over_before": round(second["tokens_per_cpu_s"] / first["tokens_per_cpu_s"], 3),
        "streamed_over_prepared": round(streamed["tokens_per_cpu_s"] / second["tokens_per_cpu_s"], 3),
        "streamed_over_prepared_array_collation": round(streamed["tokens_per_cpu_s"] / arrays["tokens_per_cpu_s"], 3),
        "streamed_two_workers_over_prepared": round(streamed_two["tokens_per_cpu_s"] / second["tokens_per_cpu_s"], 3),
        "load_average": os.getloadavg(),
    }
    for row in (streamed_zero, streamed, streamed_two):
        if row["target_tokens"] != second["target_tokens"]:
            raise SystemExit(f"a pass of the stream gave other pairs than the prepared data: {row} vs {second}")
    print_table(rows)
    print(
        f"after / before: {result['after_over_before']}; streamed (1 loader worker) / prepared: "
        f"{result['streamed_over_prepared']}, 2 workers: {result['streamed_two_workers_over_prepared']} (/ prepared "
        f"with array collation: {result['streamed_over_prepared_array_collation']}); load average "
        f"{result['load_average'][0]:.1f}"
    )
    if args.json and not args.smoke:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
