"""Decoding speed of a deep MSC model against a 6-layer baseline (and a plain deep encoder), measured in one run.

Wei et al. (2020) report that their 72-layer MSC model decodes 26% slower than the 6-layer baseline. Contenders, base
width (d 512, FFN 2048, 8 heads, 32k shared vocabulary, pre-norm, random weights), 6 decoder layers each:

* `baseline-6L`: a plain 6-layer encoder;
* `plain-36L`: a plain 36-layer encoder, the cost of depth alone;
* `msc-6x6`: MSC with 6 blocks of 6 layers (36 layers), GRU context and gated fusion on both sides.

`generate()` on batch 32, 24-token sources, every output forced to exactly 24 new tokens; target tokens per second of
the returned hypotheses, greedy and beam 4. Contenders alternate and medians are reported.

    python benchmarks/msc_speed.py                # full run, writes benchmarks/results/msc_speed.json
    python benchmarks/msc_speed.py --quick        # tiny sizes, one repeat: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from matt_speed import alternate, machine, time_generate

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration, MscConfig, MscForConditionalGeneration

CONTENDERS = ("baseline-6L", "plain-36L", "msc-6x6")


def build_model(kind: str, args: argparse.Namespace) -> DeepNMTForConditionalGeneration:
    torch.manual_seed(0)
    sizes = dict(
        vocab_size=args.vocab,
        d_model=args.d_model,
        encoder_ffn_dim=args.ffn,
        decoder_ffn_dim=args.ffn,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        decoder_layers=args.blocks,
    )
    if kind == "msc-6x6":
        return MscForConditionalGeneration(MscConfig(msc_block_layers=args.block_layers, **sizes)).eval()
    layers = args.blocks if kind == "baseline-6L" else args.blocks * args.block_layers
    return DeepNMTForConditionalGeneration(DeepNMTConfig(encoder_layers=layers, **sizes)).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=6, help="encoder blocks = decoder layers")
    parser.add_argument("--block-layers", type=int, default=6, help="layers per MSC block")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--source-length", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--beams", type=int, nargs="+", default=[4, 1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "msc_speed.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and one repeat, to check that it runs")
    args = parser.parse_args()
    if args.quick:
        args.d_model, args.ffn, args.heads, args.vocab, args.repeats = 32, 64, 4, 500, 1
        args.blocks, args.block_layers, args.batch, args.new_tokens = 2, 2, 4, 5
    if args.threads:
        torch.set_num_threads(args.threads)

    models = {kind: build_model(kind, args) for kind in CONTENDERS}
    parameters = {kind: sum(p.numel() for p in model.parameters()) for kind, model in models.items()}
    torch.manual_seed(1)
    source = torch.randint(4, args.vocab, (args.batch, args.source_length))
    target_tokens = args.batch * args.new_tokens
    results: dict[str, object] = {
        "settings": vars(args) | {"json": str(args.json)},
        "machine": machine(),
        "parameters": parameters,
    }

    print("| model | parameters | beams | median s | target tokens/s | vs baseline-6L |")
    print("|---|---:|---:|---:|---:|---:|")
    for beams in args.beams:
        timings = alternate(
            lambda model, beams=beams: time_generate(model, source, beams, args.new_tokens), models, args.repeats
        )
        medians = {kind: statistics.median(values) for kind, values in timings.items()}
        speed = {kind: target_tokens / seconds for kind, seconds in medians.items()}
        ratios = {kind: speed[kind] / speed["baseline-6L"] for kind in CONTENDERS}
        results[f"generate_beams_{beams}"] = {"seconds": timings, "tokens_per_second": speed, "ratio": ratios}
        for kind in CONTENDERS:
            print(
                f"| {kind} | {parameters[kind] / 1e6:.1f}M | {beams} | {medians[kind]:.3f} | {speed[kind]:.1f} "
                f"| {ratios[kind]:.2f}x |"
            )

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nmachine: {results['machine']}\nraw timings: {args.json}")


if __name__ == "__main__":
    main()
