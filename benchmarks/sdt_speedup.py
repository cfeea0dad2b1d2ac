"""Shallow-to-deep training against training the deep model from scratch: training time to reach the same validation
loss, measured in one run on the bundled sample corpus (the SDT paper reports 1.4x faster).

* from scratch: an SDT model of the target depth (sparse connections, relative keys), inverse-sqrt schedule;
* staged: the first depth trained for `--stage-steps`, grown by copying the top block (`grow_encoder`), the schedule
  restarted by the SDT rule with a fresh optimizer, ..., until the target depth, which trains on.

The target loss is the best validation loss the from-scratch run reaches within `--max-steps`; the figure is the
training time (evaluation excluded) each route needs to first reach it, and their ratio.

    python benchmarks/sdt_speedup.py                  # 12-layer target, about 10 minutes on 2 CPU cores
    python benchmarks/sdt_speedup.py --smoke          # tiny, checks that it runs; writes sdt_speedup_smoke.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import DataCollatorForSeq2Seq

from hf_deep_nmt import SdtConfig, SdtForConditionalGeneration
from hf_deep_nmt.data.corpus import load_parallel_dataset, sample_corpus_dir, tokenize_parallel
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.training.growing import grow_encoder
from hf_deep_nmt.training.schedules import inverse_sqrt_scheduler, stage_start_step


def batches(dataset, collator, batch_size: int, seed: int):
    """Endless shuffled batches; both routes draw the same sequence."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(dataset), generator=generator)
        for start in range(0, len(dataset) - batch_size + 1, batch_size):
            yield collator([dataset[int(i)] for i in order[start : start + batch_size]])


def validation_loss(model, validation: list[dict]) -> float:
    model.eval()
    with torch.no_grad():
        losses = [model(**batch).loss.item() for batch in validation]
    model.train()
    return sum(losses) / len(losses)


def train(model, stream, steps, start_step, args, validation, target=None, clock=0.0, curve=None):
    """Train `steps` steps (stopping early once `target` is reached); returns the training clock and the curve."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.peak_lr, betas=(0.9, 0.997))
    scheduler = inverse_sqrt_scheduler(optimizer, args.warmup, start_step=start_step)
    curve = [] if curve is None else curve
    model.train()
    for step in range(1, steps + 1):
        started = time.perf_counter()
        loss = model(**next(stream)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        clock += time.perf_counter() - started
        if step % args.eval_every == 0:
            value = validation_loss(model, validation)
            curve.append({"seconds": round(clock, 2), "layers": model.config.encoder_layers, "loss": round(value, 4)})
            if target is not None and value <= target:
                break
    return clock, curve


def first_time_at(curve: list[dict], target: float) -> float | None:
    return next((point["seconds"] for point in curve if point["loss"] <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--depths", type=int, nargs="+", default=[4, 8, 12], help="stage depths; the last is the target"
    )
    parser.add_argument("--stage-steps", type=int, default=80, help="steps of every stage but the last")
    parser.add_argument("--max-steps", type=int, default=400, help="steps of the from-scratch run and last stage")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--peak-lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=80)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="default: results/sdt_speedup[_smoke].json")
    parser.add_argument("--smoke", action="store_true", help="tiny depths and steps, to check that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.depths, args.stage_steps, args.max_steps, args.eval_every, args.warmup = [1, 2], 4, 8, 4, 4
    name = "sdt_speedup_smoke.json" if args.smoke else "sdt_speedup.json"
    args.json = args.json or Path(__file__).parent / "results" / name

    raw = load_parallel_dataset(sample_corpus_dir() / "train.tsv", sample_corpus_dir() / "valid.tsv")
    tokenizer = train_joint_tokenizer(zip(raw["train"]["source"], raw["train"]["target"]), vocab_size=4000)
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    train_set = tokenize_parallel(raw["train"], tokenizer, 64, 64)
    valid_set = tokenize_parallel(raw["validation"], tokenizer, 64, 64, drop_long=False)
    validation = [collator([valid_set[i] for i in range(s, min(s + 100, len(valid_set)))]) for s in range(0, 300, 100)]
    block = args.depths[1] - args.depths[0] if len(args.depths) > 1 else args.depths[0]
    sizes = dict(
        vocab_size=len(tokenizer),
        d_model=128,
        encoder_ffn_dim=512,
        decoder_ffn_dim=512,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        decoder_layers=3,
        sparse_block_size=block,
    )

    torch.manual_seed(0)
    scratch = SdtForConditionalGeneration(SdtConfig(**sizes, encoder_layers=args.depths[-1]))
    scratch_clock, scratch_curve = train(
        scratch, batches(train_set, collator, args.batch, 0), args.max_steps, 0, args, validation
    )
    target = min(point["loss"] for point in scratch_curve)

    torch.manual_seed(0)
    model = SdtForConditionalGeneration(SdtConfig(**sizes, encoder_layers=args.depths[0]))
    stream, clock, curve, done = batches(train_set, collator, args.batch, 0), 0.0, [], 0
    for number, depth in enumerate(args.depths):
        if number:
            model = grow_encoder(model, depth - args.depths[number - 1])
        last = number == len(args.depths) - 1
        start = stage_start_step(done, args.warmup) if number else 0
        steps = args.max_steps if last else args.stage_steps
        clock, curve = train(model, stream, steps, start, args, validation, target if last else None, clock, curve)
        done += steps

    scratch_time, staged_time = first_time_at(scratch_curve, target), first_time_at(curve, target)
    ratio = scratch_time / staged_time if staged_time else None
    results = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "target_validation_loss": target,
        "scratch": {"seconds_to_target": scratch_time, "curve": scratch_curve},
        "staged": {"seconds_to_target": staged_time, "curve": curve},
        "speedup": ratio,
    }
    print(f"target validation loss (best from scratch): {target:.4f}")
    print(f"from scratch: {scratch_time} s of training to reach it")
    print(f"staged {args.depths}: {staged_time} s" + ("" if staged_time else " (not reached within --max-steps)"))
    print(f"speed-up: {ratio:.2f}x" if ratio else "speed-up: n/a")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
