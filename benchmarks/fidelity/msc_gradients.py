"""MSC Fig. 5 (Wei et al. 2020): per-layer gradient norms of a deep MSC encoder against a plain stack of equal depth.

Claim: with multiscale collaboration (encoder blocks, each decoder layer reading its own block, the GRU context) the
gradient norm of every encoder layer stays of the same order during training -- balanced between the bottom and the
top layers -- where a plain deep stack is not.

Measured, scaled down to the sample corpus and 2 CPU cores: a pre-norm 36-layer encoder (MSC: 6 blocks x 6 layers,
the paper's defaults otherwise) against a plain pre-norm 36-layer encoder, both with a 6-layer decoder, width 64
(FFN 256, 4 heads), trained from the same seed on the same batches (Adam, inverse-sqrt schedule, peak 1e-3). The
gradient norm of each encoder layer (L2 norm over its parameters, `hf_deep_nmt.tools.diagnostics`) is recorded at every
step and averaged over windows of steps, as in the paper's figure; step 0 is the initialisation. Reported per
window: layer 1 / layer 36 and the largest / smallest layer norm.

    python benchmarks/fidelity/msc_gradients.py          # ~10 minutes on 2 CPU cores
    python benchmarks/fidelity/msc_gradients.py --smoke  # tiny, seconds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Corpus, add_script_arguments, script_settings, setup_threads, train, write_results  # noqa: E402

import hf_deep_nmt  # noqa: E402
from hf_deep_nmt import DeepNMTConfig  # noqa: E402
from hf_deep_nmt.tools.diagnostics import layer_gradient_norms, load_pyplot, parameter_gradient_norms, save_figure  # noqa: E402


def summarise(norms: list[float]) -> dict:
    return {
        "bottom_top_ratio": norms[0] / norms[-1],
        "max_min_ratio": max(norms) / min(norms),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=6, help="encoder blocks = decoder layers")
    parser.add_argument("--block-layers", type=int, default=6, help="layers per encoder block")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--window", type=int, default=20, help="steps averaged per point")
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--peak-lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=16)
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    sizes = dict(d_model=64, encoder_ffn_dim=256, decoder_ffn_dim=256, encoder_attention_heads=4)
    sizes["decoder_attention_heads"] = 4
    if args.smoke:
        args.blocks, args.block_layers, args.steps, args.window, args.warmup, args.batch = 2, 2, 4, 2, 2, 8
        sizes = dict(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4)
        sizes["decoder_attention_heads"] = 4
        corpus = Corpus(vocab_size=300, train_pairs=300)
    else:
        corpus = Corpus()
    depth = args.blocks * args.block_layers
    common = dict(vocab_size=corpus.vocab_size, decoder_layers=args.blocks, pre_norm=True, **sizes)
    configs = {
        f"plain {depth}L": DeepNMTConfig(encoder_layers=depth, **common),
        f"MSC {args.blocks}x{args.block_layers}": hf_deep_nmt.MscConfig(msc_block_layers=args.block_layers, **common),
    }
    probe = corpus.batch_with_target_tokens(1000, split="valid")

    systems, curves = {}, {}
    for label, config in configs.items():
        torch.manual_seed(0)
        model = hf_deep_nmt.MODEL_CLASSES[type(config)](config)
        at_init = layer_gradient_norms(model.train(), probe, sides=("encoder",))["encoder"]
        window, points = [], [{"step": 0, "encoder": at_init, **summarise(at_init)}]

        def record(step, model, window=window, points=points):
            window.append(parameter_gradient_norms(model, sides=("encoder",))["encoder"])
            if len(window) == args.window:
                norms = [sum(column) / len(window) for column in zip(*window)]
                points.append({"step": step, "encoder": norms, **summarise(norms)})
                window.clear()

        run = train(model, corpus.stream(args.batch, 0), args.steps, args.peak_lr, args.warmup, on_step=record)
        systems[label] = {
            "encoder_layers": config.encoder_layers,
            "points": points,
            "seconds": run["seconds"],
            "train_loss_last_10_steps": sum(run["train_losses"][-10:]) / len(run["train_losses"][-10:]),
        }
        curves[label] = points
        print(
            f"{label:14s} layer1/layerL at init {points[0]['bottom_top_ratio']:.2f}, "
            f"over training {[round(p['bottom_top_ratio'], 2) for p in points[1:]]}; "
            f"max/min {[round(p['max_min_ratio'], 2) for p in points]}"
        )

    plt = load_pyplot()
    figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 3.6), squeeze=False, sharey=True)
    for axis, (label, points) in zip(axes[0], curves.items()):
        for point in points:
            axis.plot(range(1, depth + 1), point["encoder"], marker=".", label=f"step {point['step']}")
        axis.set_yscale("log")
        axis.set_title(label)
        axis.set_xlabel("encoder layer")
        axis.legend(fontsize=7)
    axes[0, 0].set_ylabel("gradient norm (window mean)")
    plot = save_figure(figure, args.out_dir / "msc_gradients.png")
    results = {
        "claim": "MSC Fig. 5: the per-layer gradient norms of a deep MSC encoder are balanced between bottom and top "
        "layers, compared with a plain stack of the same depth",
        "settings": script_settings(args, sizes=sizes, vocab_size=corpus.vocab_size),
        "systems": systems,
        "plot": plot.name,
    }
    write_results("msc_gradients", results, args.out_dir)
    return results


if __name__ == "__main__":
    main()
