"""The depth family in one backbone (issue 41): residual pre-norm, DLCL, DenseFormer, Attention Residuals,
Hyper-Connections, DeepNorm and Mix-LN trained for the same token budget on the same real corpus.

Each run is the package's own training: the script writes a recipe (JSON) per run and starts `hf-deep-nmt train` on it
in a subprocess, on the Spanish-English Bible corpus of the shared data folder (`bible-es-en/train.tsv`,
`valid.tsv`), with one tokenizer and one prepared copy of the data for every run (`hf-deep-nmt prepare` first). The
systems: a 6-layer residual pre-norm baseline, then 12- and 24-layer encoders (6-layer decoder) of each method (the
settings are `METHODS` below), `--seeds` seeds each. Per run: validation loss (nats per target token, the whole
validation split, computed from the exported model), sacreBLEU and chrF on the held-out verses (the package's final
evaluation in `results.json`, `max_eval_samples` of them), training seconds per optimizer step (the package's
`train_seconds / train_steps`) and its ratio to the residual model of the same depth and seed, and greedy decoding
speed (target tokens per second of `hf_deep_nmt.serving.translate.translate` on held-out sources). Written to
`results/depth_family[_SIZE].json`; a markdown table (mean ± half the range over seeds) is printed.

Methods whose settings this checkout's config does not know are reported as "not available in this checkout".

Budget of `--size cpu` (d 64, FFN 256, 200 steps of 1024 target tokens): with `--jobs 2 --threads 1` the 30 runs took
29.6 minutes on the 2-core development machine while other work ran beside them (load about 2); a 24-layer-encoder
run trains at 0.4-0.7 CPU s a step (Hyper-Connections the most) and each run spends about 25 s besides (start, the
package's final evaluation of 100 verses, this script's evaluation). At one thread on the CPU the time ratios compare
each training's process CPU time per step (`train_cpu_seconds` in its results.json), which runs side by side inflate
far less than the wall time. `--size gpu` (d 256, FFN 1024, 300 steps of 8192 tokens, bf16, 200 verses scored with 4
beams) is sized for an H100/H200 with `--jobs 10 --threads 1`, runs sharing the GPU (so its time ratios compare runs
that shared it alike, not runs alone); a first run on an H200 finished 11 of its 30 runs in 300 s.

    python benchmarks/fidelity/depth_family.py --size cpu --jobs 2 --threads 1     # 2 cores, 30 minutes
    python benchmarks/fidelity/depth_family.py --size gpu --device cuda --jobs 10 --threads 1  # one H100/H200
    python benchmarks/fidelity/depth_family.py --size smoke --methods dlcl          # seconds
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_results  # noqa: E402

# The methods and their settings, for an encoder of `depth` layers (a 6-layer decoder): the only table to edit when a
# setting is renamed. Settings a checkout does not know make the method "not available in this checkout".
METHODS = {
    "residual": lambda depth: {},
    "dlcl": lambda depth: {"layer_aggregation": "dlcl"},
    "denseformer": lambda depth: {"layer_aggregation": "dlcl", "dlcl_init": "identity", "dlcl_history_norm": False},
    "attnres": lambda depth: {"layer_aggregation": "attnres"},
    "hyper-connections": lambda depth: {"hyper_connections": 2, "hyper_connections_dynamic": True},
    "deepnorm": lambda depth: {"pre_norm": False, "deepnorm": True},
    "mix-ln": lambda depth: {"encoder_post_norm_layers": depth // 4, "decoder_post_norm_layers": 1},
}
BASELINE = ("residual", 6)

# Model width and training budget per size. `steps` x `max_tokens` is the token budget of every run.
SIZES = {
    "smoke": dict(
        d_model=16, ffn=32, heads=2, depths=[2], decoder_layers=1, baseline_depth=1, steps=2, max_tokens=256,
        warmup=1, lr=1e-3, vocab=300, train_pairs=200, eval_pairs=4, speed_pairs=4, num_beams=1, max_length=32,
        bf16=False,
    ),
    "cpu": dict(
        d_model=64, ffn=256, heads=4, depths=[12, 24], decoder_layers=6, baseline_depth=6, steps=200,
        max_tokens=1024, warmup=50, lr=2e-3, vocab=4000, train_pairs=None, eval_pairs=100, speed_pairs=64,
        num_beams=1, max_length=64, bf16=False,
    ),
    "gpu": dict(
        d_model=256, ffn=1024, heads=4, depths=[12, 24], decoder_layers=6, baseline_depth=6, steps=300,
        max_tokens=8192, warmup=100, lr=1e-3, vocab=8000, train_pairs=None, eval_pairs=200, speed_pairs=200,
        num_beams=4, max_length=96, bf16=True,
    ),
}  # fmt: skip


def config_fields() -> set[str]:
    from hf_deep_nmt import DeepNMTConfig

    return set(DeepNMTConfig.__annotations__)


def availability(settings: dict, size: dict) -> str | None:
    """None when this checkout builds the settings; else why not (unknown names, or the config's own error)."""
    from hf_deep_nmt import DeepNMTConfig

    unknown = sorted(set(settings) - config_fields())
    if unknown:
        return f"not available in this checkout (no setting {', '.join(unknown)})"
    try:
        DeepNMTConfig(encoder_layers=max(size["depths"]), decoder_layers=size["decoder_layers"], **settings)
    except (ValueError, TypeError) as error:
        return f"not available in this checkout ({str(error).splitlines()[0]})"
    return None


def base_recipe(args: argparse.Namespace, size: dict) -> dict:
    data = Path(args.data) / "bible-es-en"
    recipe = {
        "model_type": "deep_nmt",
        "train_file": str(data / "train.tsv"),
        "validation_file": str(data / "valid.tsv"),
        "source_lang": "es",
        "target_lang": "en",
        "tokenizer_vocab_size": size["vocab"],
        "max_source_length": size["max_length"],
        "max_target_length": size["max_length"],
        "max_eval_samples": size["eval_pairs"],
        "prepared_data_dir": str(args.work_dir / "prepared"),
        "tokenizer_name_or_path": str(args.work_dir / "tokenizer" / "tokenizer"),
        "num_beams": size["num_beams"],
        "tokenized_bleu": False,
        "translate_examples": 0,
        "plot_curves": False,
        "average_checkpoints": 0,
        "save_strategy": "no",
        "eval_strategy": "no",
        "max_steps": size["steps"],
        "max_tokens": size["max_tokens"],
        "learning_rate": size["lr"],
        "lr_schedule": "inverse_sqrt",
        "warmup_steps": size["warmup"],
        "warmup_init_lr": 1e-7,
        "adam_beta1": 0.9,
        "adam_beta2": 0.98,
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "label_smoothing_factor": 0.1,
        "logging_steps": max(1, size["steps"] // 10),
        "report_to": "none",
        "dataloader_num_workers": 0,
        "preprocessing_num_workers": 1,
    }
    if size["train_pairs"] is not None:
        recipe["tokenizer_train_pairs"] = size["train_pairs"]
    if args.device == "cpu":
        recipe["use_cpu"] = True
    if size["bf16"] and args.device == "cuda":
        recipe["bf16"] = True
    return recipe


def run_recipe(args: argparse.Namespace, size: dict, name: str, depth: int, seed: int, settings: dict) -> dict:
    folder = args.work_dir / f"{name}-{depth}L-seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    write_recipe(folder / "recipe.json", make_recipe(args, size, folder, depth, seed, settings))
    cli(args, ["train", str(folder / "recipe.json")], folder / "train.log")
    return json.loads((folder / "run" / "results.json").read_text())


def make_recipe(args: argparse.Namespace, size: dict, folder: Path, depth: int, seed: int, settings: dict) -> dict:
    """The `hf-deep-nmt train` recipe of one run: the shared data and tokenizer, the size's model with `depth`
    encoder layers and the method's `settings`, output and export under `folder`."""
    return {
        **base_recipe(args, size),
        "model_overrides": {
            "d_model": size["d_model"],
            "encoder_layers": depth,
            "decoder_layers": size["decoder_layers"],
            "encoder_attention_heads": size["heads"],
            "decoder_attention_heads": size["heads"],
            "encoder_ffn_dim": size["ffn"],
            "decoder_ffn_dim": size["ffn"],
            "dropout": 0.1,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
            **settings,
        },
        "seed": seed,
        "output_dir": str(folder / "run"),
        "export_dir": str(folder / "export"),
        "overwrite_output_dir": True,
        "overwrite_export": True,
    }


def cli(args: argparse.Namespace, arguments: list[str], log: Path) -> None:
    """`hf-deep-nmt ARGUMENTS` in a subprocess (its output in `log`); a failure raises with the log's tail."""
    environment = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-c", "import sys, hf_deep_nmt_cli; sys.exit(hf_deep_nmt_cli.main())", *arguments]
    with open(log, "w") as stream:
        done = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, env=environment, check=False)
    if done.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"hf-deep-nmt {' '.join(arguments)} failed ({done.returncode}); log {log}:\n{tail}")


EVALUATION_LOCK = threading.Lock()
ROWS_LOCK = threading.Lock()


def evaluate_export(args: argparse.Namespace, size: dict, export: Path) -> dict:
    """Validation loss (token-weighted mean over the whole validation split) and greedy decoding speed of the
    exported model, in this process (one at a time)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from hf_deep_nmt.data.corpus import load_parallel_dataset
    from hf_deep_nmt.serving.translate import translate

    with EVALUATION_LOCK:
        device = torch.device(args.device)
        tokenizer = AutoTokenizer.from_pretrained(export)
        model = AutoModelForSeq2SeqLM.from_pretrained(export).to(device).eval()
        data = Path(args.data) / "bible-es-en"
        valid = load_parallel_dataset(data / "train.tsv", data / "valid.tsv")["validation"]
        sources, targets = valid["source"], valid["target"]
        total_loss, total_tokens = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(sources), 64):
                batch = tokenizer(
                    sources[start : start + 64],
                    text_target=targets[start : start + 64],
                    max_length=size["max_length"],
                    truncation=True,
                    padding=True,
                    return_tensors="pt",
                )
                batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
                tokens = int((batch["labels"] != -100).sum())
                loss = model(**{key: value.to(device) for key, value in batch.items()}).loss
                total_loss += loss.item() * tokens
                total_tokens += tokens
        held_out = sources[: size["speed_pairs"]]
        translate(model, tokenizer, held_out[:2], num_beams=1)  # warm-up
        # on the CPU this process's CPU time (one evaluation at a time, its other threads only wait on trainings),
        # which the trainings running beside it do not inflate; on a GPU the wall time
        clock = time.perf_counter if device.type == "cuda" else time.process_time
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = clock()
        hypotheses = translate(model, tokenizer, held_out, num_beams=1, batch_size=32)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = clock() - started
        produced = sum(len(ids) for ids in tokenizer(hypotheses)["input_ids"])
        return {"validation_loss": round(total_loss / total_tokens, 4), "decode_tokens_per_second": produced / seconds}


def one_run(args, size, name, depth, seed) -> dict:
    settings = METHODS[name](depth)
    summary = run_recipe(args, size, name, depth, seed, settings)
    measured = evaluate_export(args, size, args.work_dir / f"{name}-{depth}L-seed{seed}" / "export")
    row = {
        "method": name,
        "encoder_layers": depth,
        "seed": seed,
        "settings": settings,
        "train_steps": summary["train_steps"],
        "train_seconds": summary["train_seconds"],
        "seconds_per_step": summary["train_seconds"] / max(1, summary["train_steps"]),
        # one thread on the CPU: the training process's CPU time per step, which runs beside it do not inflate
        "cpu_seconds_per_step": (
            summary["train_cpu_seconds"] / max(1, summary["train_steps"])
            if summary.get("train_cpu_seconds") is not None
            else None
        ),
        "train_loss": summary["train_loss"],
        "bleu": summary.get("bleu"),
        "chrf": summary.get("chrf"),
        "eval_pairs": summary.get("eval_pairs"),
        **measured,
    }
    with ROWS_LOCK, open(args.out_dir / f"depth_family_{args.size}_rows.jsonl", "a", encoding="utf-8") as stream:
        stream.write(json.dumps(row) + "\n")  # each run as it ends: a run cut short keeps the finished ones
    print(
        f"  {name} {depth}L seed {seed}: valid loss {row['validation_loss']}, BLEU {row['bleu']}, chrF {row['chrf']}, "
        f"{row['seconds_per_step']:.3f} s/step ({row['cpu_seconds_per_step'] or 0:.3f} CPU s), "
        f"{row['decode_tokens_per_second']:.0f} tok/s",
        flush=True,
    )
    return row


def spread(values: list[float]) -> str:
    values = [value for value in values if value is not None]
    if not values:
        return "–"
    middle = statistics.fmean(values)
    half = (max(values) - min(values)) / 2
    digits = 3 if abs(middle) < 10 else 1
    return f"{middle:.{digits}f} ± {half:.{digits}f}"


def table(rows: list[dict], unavailable: dict[str, str]) -> str:
    lines = [
        "| method | encoder layers | validation loss | sacreBLEU | chrF | time/step vs residual "
        "| greedy decoding tokens/s (CPU: per CPU s) |",
        "|---|---|---|---|---|---|---|",
    ]
    systems = sorted({(row["encoder_layers"], row["method"]) for row in rows}, key=lambda key: key)
    for depth, name in systems:
        group = [row for row in rows if (row["method"], row["encoder_layers"]) == (name, depth)]
        cells = [spread([row[key] for row in group]) for key in ("validation_loss", "bleu", "chrf")]
        cells.append(spread([row.get("time_ratio") for row in group]))
        cells.append(spread([row["decode_tokens_per_second"] for row in group]))
        lines.append(f"| {name} | {depth} | " + " | ".join(cells) + " |")
    for name, reason in unavailable.items():
        lines.append(f"| {name} | – | {reason} | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    repository = Path(__file__).resolve().parents[2]
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--data", type=Path, default=repository.parent / "shared" / "data")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=list(METHODS))
    parser.add_argument("--depths", type=int, nargs="+", help="encoder depths (default: the size's)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the size's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--jobs", type=int, default=1, help="trainings run at once")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per training")
    parser.add_argument("--work-dir", type=Path, help="run folders (default: a folder under --out-dir)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    size = dict(SIZES[args.size])
    if args.depths:
        size["depths"] = args.depths
    if args.steps:
        size["steps"] = args.steps
    if not (Path(args.data) / "bible-es-en" / "train.tsv").is_file():
        parser.error(f"--data {args.data}: no bible-es-en/train.tsv there (the shared data folder holds it)")
    args.work_dir = (args.work_dir or args.out_dir / f"depth_family_runs_{args.size}").resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    unavailable = {}
    for name in args.methods:
        reason = availability(METHODS[name](max(size["depths"])), size)
        if reason is not None:
            unavailable[name] = reason
            print(f"{name}: {reason}", flush=True)
    runs = [(BASELINE[0], size["baseline_depth"], seed) for seed in range(1, args.seeds + 1)]
    names = [name for name in args.methods if name not in unavailable]
    runs += [(name, depth, seed) for depth in size["depths"] for name in names for seed in range(1, args.seeds + 1)]
    if "residual" not in names:  # the time ratios need the residual model of each depth
        runs += [("residual", depth, seed) for depth in size["depths"] for seed in range(1, args.seeds + 1)]

    started = time.perf_counter()
    # the tokenizer first (its sample is drawn by the recipe's seed), then the data every run reads, tokenized by it
    cli(args, ["prepare", str(write_base(args, size, tokenizer=True))], args.work_dir / "tokenizer.log")
    cli(args, ["prepare", str(write_base(args, size))], args.work_dir / "prepare.log")
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda run: one_run(args, size, *run), runs))
    # the time ratio compares CPU time per step where each training had one thread on the CPU (trainings run side by
    # side do not inflate it), else the wall time per step
    cost = "cpu_seconds_per_step" if args.device == "cpu" and args.threads == 1 else "seconds_per_step"
    for row in rows:
        reference = [
            other[cost]
            for other in rows
            if (other["method"], other["encoder_layers"], other["seed"])
            == ("residual", row["encoder_layers"], row["seed"])
        ]
        row["time_ratio"] = row[cost] / reference[0] if reference and row[cost] is not None else None
    markdown = table(rows, unavailable)
    print(markdown)
    results = {
        "claim": "issue 41: the depth family trained for the same token budget on the same corpus",
        "settings": {
            **{key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
            **{f"size_{key}": value for key, value in size.items()},
        },
        "unavailable": unavailable,
        "runs": rows,
        "table": markdown,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    results["settings"].pop("out_dir", None)
    results["settings"].pop("work_dir", None)
    name = "depth_family" if args.size == "cpu" else f"depth_family_{args.size}"
    write_results(name, results, args.out_dir)
    return results


def write_base(args: argparse.Namespace, size: dict, tokenizer: bool = False) -> Path:
    """The recipe `hf-deep-nmt prepare` reads: every run's data and tokenizer settings; with `tokenizer`, the
    preparation that trains the shared tokenizer (seed 1) into `tokenizer/tokenizer`."""
    path = args.work_dir / ("tokenizer.json" if tokenizer else "prepare.json")
    recipe = {**base_recipe(args, size), "output_dir": str(args.work_dir / "prepare-run"), "seed": 1}
    if tokenizer:
        recipe["prepared_data_dir"] = str(args.work_dir / "tokenizer")
        return write_recipe(path, recipe, given_tokenizer=False)
    return write_recipe(path, recipe)


def write_recipe(path: Path, recipe: dict, given_tokenizer: bool = True) -> Path:
    """`recipe` as JSON at `path`: with the shared tokenizer given (its training settings dropped), or without it."""
    if given_tokenizer:
        recipe = {
            key: value for key, value in recipe.items() if key not in ("tokenizer_vocab_size", "tokenizer_train_pairs")
        }
    else:
        recipe = {key: value for key, value in recipe.items() if key != "tokenizer_name_or_path"}
    path.write_text(json.dumps(recipe, indent=2) + "\n")
    return path


if __name__ == "__main__":
    main()
