"""Decoding speed of the merged-attention (MAtt) decoder against the multi-head decoder, measured in one run.

Both contenders are the same `DeepNMTForConditionalGeneration` (base sizes by default: d 512, FFN 2048, 8 heads,
6 + 6 layers, 32k vocabulary, post-norm, random weights) and differ only in `decoder_self_attention`. Figures:

* generate(): cached beam search (and greedy) on batch 32, 24-token sources, every output forced to exactly 24 new
  tokens so that both do the same work; target tokens per second of the returned best hypotheses.
* decoder steps: the decoder stack alone (no output layer, no search), 24 consecutive cached steps on batch x beams
  rows, so the figure isolates what MAtt changes.

Contenders alternate (A, B, A, B, ...) and medians are reported, since a shared machine is noisy.

    python benchmarks/matt_speed.py                 # full run, writes benchmarks/results/matt_speed.json
    python benchmarks/matt_speed.py --quick         # tiny sizes, one repeat: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration

CONTENDERS = ("multi_head", "merged_average")


def build_model(kind: str, args: argparse.Namespace) -> DeepNMTForConditionalGeneration:
    torch.manual_seed(0)
    config = DeepNMTConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        encoder_ffn_dim=args.ffn,
        decoder_ffn_dim=args.ffn,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        pre_norm=False,
        decoder_self_attention=kind,
    )
    return DeepNMTForConditionalGeneration(config).eval()


def time_generate(model: DeepNMTForConditionalGeneration, source: torch.Tensor, beams: int, new_tokens: int) -> float:
    with torch.inference_mode():
        started = time.perf_counter()
        output = model.generate(
            input_ids=source,
            attention_mask=torch.ones_like(source),
            num_beams=beams,
            min_new_tokens=new_tokens,
            max_length=new_tokens + 1,  # the start token + new_tokens
            do_sample=False,
            use_cache=True,
        )
        elapsed = time.perf_counter() - started
    if output.shape != (source.shape[0], new_tokens + 1):
        raise RuntimeError(f"expected {new_tokens} forced new tokens, got output shape {tuple(output.shape)}")
    return elapsed


def time_decoder_steps(model: DeepNMTForConditionalGeneration, source: torch.Tensor, rows: int, steps: int) -> float:
    """Seconds for `steps` consecutive cached steps of the decoder stack on `rows` sequences."""
    decoder = model.model.decoder
    with torch.inference_mode():
        memory = model.get_encoder()(input_ids=source).last_hidden_state
        memory = memory.repeat_interleave(rows // source.shape[0], dim=0)
        tokens = torch.randint(4, model.config.vocab_size, (rows, steps))
        cache = None
        started = time.perf_counter()
        for step in range(steps):
            _, cache = decoder(
                input_ids=tokens[:, step : step + 1],
                encoder_hidden_states=memory,
                past_key_values=cache,
                use_cache=True,
            )
        return time.perf_counter() - started


def alternate(measure, models: dict, repeats: int) -> dict[str, list[float]]:
    """Warm each contender up once, then alternate them `repeats` times."""
    for model in models.values():
        measure(model)
    timings: dict[str, list[float]] = {kind: [] for kind in models}
    for _ in range(repeats):
        for kind, model in models.items():
            timings[kind].append(measure(model))
    return timings


def machine() -> dict[str, object]:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--source-length", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--beams", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "matt_speed.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one repeat, to check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.d_model, args.ffn, args.heads, args.layers, args.vocab, args.repeats = 64, 128, 4, 2, 1000, 1
    if args.threads:
        torch.set_num_threads(args.threads)

    models = {kind: build_model(kind, args) for kind in CONTENDERS}
    torch.manual_seed(1)
    source = torch.randint(4, args.vocab, (args.batch, args.source_length))
    target_tokens = args.batch * args.new_tokens
    results: dict[str, object] = {"settings": vars(args) | {"json": str(args.json)}, "machine": machine()}

    print("| decoder | beams | median s | target tokens/s | MAtt / multi-head |")
    print("|---|---:|---:|---:|---:|")
    for beams in args.beams:
        timings = alternate(
            lambda model, beams=beams: time_generate(model, source, beams, args.new_tokens), models, args.repeats
        )
        medians = {kind: statistics.median(values) for kind, values in timings.items()}
        speed = {kind: target_tokens / seconds for kind, seconds in medians.items()}
        ratio = speed["merged_average"] / speed["multi_head"]
        results[f"generate_beams_{beams}"] = {"seconds": timings, "tokens_per_second": speed, "ratio": ratio}
        for kind in CONTENDERS:
            shown = f"{ratio:.2f}x" if kind == "merged_average" else ""
            print(f"| {kind} | {beams} | {medians[kind]:.3f} | {speed[kind]:.1f} | {shown} |")

    rows = args.batch * max(args.beams)
    timings = alternate(lambda model: time_decoder_steps(model, source, rows, args.new_tokens), models, args.repeats)
    per_step = {kind: statistics.median(values) / args.new_tokens for kind, values in timings.items()}
    step_ratio = per_step["multi_head"] / per_step["merged_average"]
    results["decoder_steps"] = {"rows": rows, "seconds": timings, "median_step_seconds": per_step, "ratio": step_ratio}
    print()
    print(f"| decoder stack only ({rows} rows, {args.new_tokens} cached steps) | ms per step | MAtt speed-up |")
    print("|---|---:|---:|")
    for kind in CONTENDERS:
        shown = f"{step_ratio:.2f}x" if kind == "merged_average" else ""
        print(f"| {kind} | {per_step[kind] * 1e3:.2f} | {shown} |")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nmachine: {results['machine']}\nraw timings: {args.json}")


if __name__ == "__main__":
    main()
