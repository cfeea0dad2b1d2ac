"""What the fidelity scripts share: the bundled sample corpus, a joint tokenizer, token-budget batches, a plain
training loop with the fairseq inverse-sqrt schedule, validation loss and result files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from transformers import DataCollatorForSeq2Seq

from hf_deep_nmt.data.corpus import load_parallel_dataset, sample_corpus_dir, tokenize_parallel
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.training.schedules import inverse_sqrt_scheduler

RESULTS = Path(__file__).parent / "results"


def add_script_arguments(parser: argparse.ArgumentParser, threads: int = 2) -> argparse.ArgumentParser:
    """The options every reproduction script takes: `--threads`, `--out-dir`, `--smoke`."""
    parser.add_argument("--threads", type=int, default=threads)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check that the script runs")
    return parser


def script_settings(args: argparse.Namespace, **extra) -> dict:
    """The command-line settings of a run for its result file (paths as text, the output folder left out), plus
    `extra`."""
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    settings.pop("out_dir", None)
    return {**settings, **extra}


def setup_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Corpus:
    """Tokenized sample corpus (8000 training / 300 validation es-en pairs) and its collator."""

    def __init__(self, vocab_size: int = 4000, max_length: int = 64, train_pairs: int | None = None):
        raw = load_parallel_dataset(sample_corpus_dir() / "train.tsv", sample_corpus_dir() / "valid.tsv")
        if train_pairs is not None:
            raw["train"] = raw["train"].select(range(min(train_pairs, len(raw["train"]))))
        self.tokenizer = train_joint_tokenizer(
            zip(raw["train"]["source"], raw["train"]["target"]), vocab_size=vocab_size
        )
        self.collator = DataCollatorForSeq2Seq(self.tokenizer, label_pad_token_id=-100)
        self.train = tokenize_parallel(raw["train"], self.tokenizer, max_length, max_length)
        self.valid = tokenize_parallel(raw["validation"], self.tokenizer, max_length, max_length, drop_long=False)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def batch_with_target_tokens(self, tokens: int, split: str = "valid", start: int = 0) -> dict:
        """Consecutive pairs from `start` until their target side holds at least `tokens` tokens."""
        data = self.valid if split == "valid" else self.train
        rows, count, index = [], 0, start
        while count < tokens and index < len(data):
            rows.append(data[index])
            count += len(data[index]["labels"])
            index += 1
        return self.collator(rows)

    def validation_batches(self, size: int = 100, limit: int | None = None) -> list[dict]:
        total = len(self.valid) if limit is None else min(limit, len(self.valid))
        return [self.collator([self.valid[i] for i in range(s, min(s + size, total))]) for s in range(0, total, size)]

    def stream(self, batch_size: int, seed: int) -> BatchStream:
        return BatchStream(self.train, self.collator, batch_size, seed)


class BatchStream:
    """Endless shuffled training batches (a new permutation per epoch); the same seed gives the same sequence to every
    model, and a `copy.deepcopy` continues from the same position."""

    def __init__(self, dataset, collator, batch_size: int, seed: int):
        self.dataset, self.collator, self.batch_size, self.seed = dataset, collator, batch_size, seed
        self.epoch, self.position, self.order = 0, 0, None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.order is None or self.position + self.batch_size > len(self.dataset):
            generator = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
            self.order = torch.randperm(len(self.dataset), generator=generator).tolist()
            self.epoch, self.position = self.epoch + 1, 0
        rows = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return self.collator([self.dataset[i] for i in rows])

    def __deepcopy__(self, memo):
        clone = BatchStream(self.dataset, self.collator, self.batch_size, self.seed)
        clone.epoch, clone.position, clone.order = self.epoch, self.position, list(self.order or []) or None
        return clone


def validation_loss(model, batches: list[dict]) -> float:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        losses = [model(**batch).loss.item() for batch in batches]
    model.train(was_training)
    return sum(losses) / len(losses)


def train(
    model,
    stream,
    steps: int,
    peak_lr: float,
    warmup: int,
    betas=(0.9, 0.98),
    start_step: int = 0,
    eval_every: int = 0,
    validation: list[dict] | None = None,
    on_step=None,
) -> dict:
    """Adam + inverse-sqrt schedule (warm-up from 1e-7), no clipping (as the papers). Returns the curve of training
    losses (every step), validation losses (every `eval_every`) and the wall time."""
    optimizer = torch.optim.Adam(model.parameters(), lr=peak_lr, betas=betas, eps=1e-8)
    scheduler = inverse_sqrt_scheduler(optimizer, warmup, start_step=start_step)
    model.train()
    train_losses, valid_curve, started = [], [], time.perf_counter()
    for step in range(1, steps + 1):
        loss = model(**next(stream)).loss
        optimizer.zero_grad()
        loss.backward()
        if on_step is not None:
            on_step(step, model)
        optimizer.step()
        scheduler.step()
        train_losses.append(loss.item() if torch.isfinite(loss) else float("nan"))
        if eval_every and step % eval_every == 0 and validation is not None:
            valid_curve.append({"step": step, "loss": round(validation_loss(model, validation), 4)})
            print(f"  step {start_step + step}: validation loss {valid_curve[-1]['loss']}", flush=True)
    return {"train_losses": train_losses, "valid_curve": valid_curve, "seconds": round(time.perf_counter() - started)}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def write_results(name: str, results: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        **results,
        "environment": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
        },
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path
