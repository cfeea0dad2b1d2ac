"""DLCL Table 1 (Wang et al. 2019): training 20-layer encoders at the deep-model learning rate.

Claim: with the deep models' learning rate (2e-3, long warm-up), a post-norm Transformer with a 20-layer encoder
fails to train, while the pre-norm 20-layer Transformer and the post-norm model with the dynamic linear combination
of layers (DLCL) train.

Measured, scaled down to the sample corpus and 2 CPU cores: three models with a 20-layer encoder and a 3-layer decoder
at width 64 (FFN 256, 4 heads) -- post-norm, pre-norm, post-norm + DLCL (both stacks) -- trained from the same seed on
the same batches with Adam and the fairseq inverse-sqrt schedule peaking at 2e-3 (warm-up scaled down with the
number of steps, 16k of 50k in the paper). Dropout and Adam betas as in the DLCL recipes (post-norm: residual
dropout only, beta2 0.98; pre-norm: all dropouts 0.1, beta2 0.997). Reported: validation loss along training and at
the end, and the training loss of the last 50 steps (150 steps of 32 pairs, warm-up 50).

    python benchmarks/fidelity/dlcl_deep_training.py          # ~12 minutes on 2 CPU cores
    python benchmarks/fidelity/dlcl_deep_training.py --smoke  # tiny, seconds
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    Corpus,
    add_script_arguments,
    mean,
    script_settings,
    setup_threads,
    train,
    validation_loss,
    write_results,
)

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration  # noqa: E402
from hf_deep_nmt.tools.diagnostics import combination_weights, plot_combination_weights  # noqa: E402

SYSTEMS = {
    "post-norm": dict(pre_norm=False, layer_aggregation="residual"),
    "pre-norm": dict(pre_norm=True, layer_aggregation="residual", attention_dropout=0.1, activation_dropout=0.1),
    "post-norm DLCL": dict(pre_norm=False, layer_aggregation="dlcl"),
}


def plot(curves: dict, path: Path, title: str) -> Path:
    from hf_deep_nmt.tools.diagnostics import load_pyplot, save_figure

    plt = load_pyplot()
    figure, axis = plt.subplots(figsize=(6.4, 3.6))
    for label, curve in curves.items():
        axis.plot([p["step"] for p in curve], [p["loss"] for p in curve], marker=".", label=label)
    axis.set_xlabel("training step")
    axis.set_ylabel("validation loss (nats/token)")
    axis.set_title(title)
    axis.legend()
    return save_figure(figure, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder-layers", type=int, default=20)
    parser.add_argument("--decoder-layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=50, help="16k of 50k steps in the paper, scaled")
    parser.add_argument("--peak-lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=15)
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sizes = dict(d_model=64, encoder_ffn_dim=256, decoder_ffn_dim=256, encoder_attention_heads=4)
    sizes["decoder_attention_heads"] = 4
    if args.smoke:
        args.encoder_layers, args.decoder_layers, args.steps, args.warmup, args.batch, args.eval_every = (
            3,
            1,
            6,
            2,
            8,
            3,
        )
        sizes = dict(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4)
        sizes["decoder_attention_heads"] = 4
        corpus = Corpus(vocab_size=300, train_pairs=300)
        validation = corpus.validation_batches(20, limit=40)
    else:
        corpus = Corpus()
        validation = corpus.validation_batches(100)

    systems, curves = {}, {}
    for name, settings in SYSTEMS.items():
        label = f"{name} {args.encoder_layers}L"
        settings = {"dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0, **settings}
        torch.manual_seed(0)
        config = DeepNMTConfig(
            vocab_size=corpus.vocab_size,
            encoder_layers=args.encoder_layers,
            decoder_layers=args.decoder_layers,
            **sizes,
            **settings,
        )
        model = DeepNMTForConditionalGeneration(config)
        betas = (0.9, 0.997) if config.pre_norm else (0.9, 0.98)
        initial = validation_loss(model, validation)
        run = train(
            model,
            corpus.stream(args.batch, seed=0),
            args.steps,
            args.peak_lr,
            args.warmup,
            betas=betas,
            eval_every=args.eval_every,
            validation=validation,
        )
        curve = [{"step": 0, "loss": round(initial, 4)}] + run["valid_curve"]
        curves[label] = curve
        tail = [loss for loss in run["train_losses"][-50:] if not math.isnan(loss)]
        systems[label] = {
            "settings": settings,
            "adam_betas": list(betas),
            "final_validation_loss": curve[-1]["loss"],
            "best_validation_loss": min(p["loss"] for p in curve),
            "train_loss_last_50_steps": round(mean(tail), 4) if tail else None,
            "validation_curve": curve,
            "seconds": run["seconds"],
        }
        weights = combination_weights(model)
        if "encoder" in weights:
            weight = weights["encoder"]["weight"]
            heatmap = plot_combination_weights(
                weight, args.out_dir / "dlcl_weights_encoder.png", f"{label}: learned encoder weights (DLCL Fig. 5)"
            )
            systems[label]["encoder_combination_weights"] = [[round(w, 4) for w in row] for row in weight.tolist()]
            systems[label]["plots"] = [heatmap.name]
        print(f"{label:20s} validation loss {initial:.3f} -> {curve[-1]['loss']:.3f} ({run['seconds']} s)")

    path = plot(
        curves,
        args.out_dir / "dlcl_deep_training.png",
        f"{args.encoder_layers}-layer encoders at peak lr {args.peak_lr:g} (DLCL Table 1)",
    )
    results = {
        "claim": "DLCL Table 1: at the deep-model learning rate a post-norm 20-layer encoder fails; pre-norm 20L and "
        "post-norm DLCL train",
        "settings": script_settings(args, sizes=sizes, vocab_size=corpus.vocab_size),
        "systems": systems,
        "plot": path.name,
    }
    write_results("dlcl_deep_training", results, args.out_dir)
    return results


if __name__ == "__main__":
    main()
