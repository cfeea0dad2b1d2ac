"""DS-Init Fig. 1 (Zhang, Titov, Sennrich 2019): per-layer gradient norms at initialisation.

Claim: in a plain post-norm Transformer the gradient norm shrinks from the top layers to the bottom ones (worse in the
decoder), more so as depth grows (12, 18 layers); with depth-scaled initialisation (DS-Init) the bottom/top ratio
stays near 1.

Measured: post-norm base-width models (d 512, FFN 2048, 8 heads, encoder = decoder depth 6 / 12 / 18), default
Glorot initialisation against DS-Init (alpha = 1, the paper's formula), one forward/backward pass in training mode
(dropout 0.1) on a batch of ~3k target tokens of the sample corpus, as in the paper; the gradient norm of a layer is
the L2 norm of the loss gradient over all the layer's parameters
(`hf_deep_nmt.tools.diagnostics.layer_gradient_norms`), averaged over 2 initialisation seeds. The figure of merit is
the ratio layer 1 / layer L per stack.

    python benchmarks/fidelity/dsinit_gradients.py            # ~15 minutes on 2 busy CPU cores
    python benchmarks/fidelity/dsinit_gradients.py --smoke    # tiny, seconds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Corpus, add_script_arguments, mean, setup_threads, write_results  # noqa: E402

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration  # noqa: E402
from hf_deep_nmt.tools.diagnostics import layer_gradient_norms, plot_gradient_norms  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[6, 12, 18])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--target-tokens", type=int, default=3000)
    parser.add_argument(
        "--ds-init-modes",
        nargs="+",
        default=["paper"],
        choices=["paper", "code"],
        help="DS-Init variants to compare with the default initialisation: the paper's alpha/sqrt(l) bound factor "
        "and/or the reference code's sqrt(alpha) * l^(-1/4)",
    )
    parser.add_argument(
        "--kind",
        default="parameters",
        choices=["parameters", "outputs"],
        help="gradient of the layer's parameters (Fig. 1) or of its output (the error signal of Table 1)",
    )
    parser.add_argument("--name", default="dsinit_gradients", help="name of the result files")
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    sizes = dict(d_model=512, encoder_ffn_dim=2048, decoder_ffn_dim=2048, encoder_attention_heads=8)
    sizes["decoder_attention_heads"] = 8
    if args.smoke:
        args.depths, args.seeds, args.target_tokens = [2, 4], 1, 200
        sizes = dict(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4)
        sizes["decoder_attention_heads"] = 4
        corpus = Corpus(vocab_size=300, train_pairs=300)
    else:
        corpus = Corpus()
    batch = corpus.batch_with_target_tokens(args.target_tokens, split="train")
    target_tokens = int((batch["labels"] != -100).sum())

    systems, curves = {}, {}
    for depth in args.depths:
        for scheme in ["default"] + [f"ds_init:{mode}" for mode in args.ds_init_modes]:
            mode = scheme.split(":")[1] if ":" in scheme else None
            name = "post-norm" if mode is None else ("DS-Init" if mode == "paper" else "DS-Init (code)")
            label = f"{name} {depth}L"
            runs = []
            for seed in range(args.seeds):
                torch.manual_seed(seed)
                config = DeepNMTConfig(
                    vocab_size=corpus.vocab_size,
                    encoder_layers=depth,
                    decoder_layers=depth,
                    pre_norm=False,
                    init_scheme="default" if mode is None else "ds_init",
                    ds_init_mode=mode or "paper",
                    dropout=0.1,
                    attention_dropout=0.1,
                    activation_dropout=0.1,
                    **sizes,
                )
                model = DeepNMTForConditionalGeneration(config).train()
                runs.append(layer_gradient_norms(model, batch, kind=args.kind))
            norms = {side: [mean(run[side][i] for run in runs) for i in range(depth)] for side in runs[0]}
            curves[label] = norms
            systems[label] = {
                "depth": depth,
                "init_scheme": "default" if mode is None else "ds_init",
                "ds_init_mode": mode,
                "gradient_norms": norms,
                "bottom_top_ratio": {side: norms[side][0] / norms[side][-1] for side in norms},
            }
            ratio = systems[label]["bottom_top_ratio"]
            print(f"{label:16s} layer1/layerL  encoder {ratio['encoder']:.3f}  decoder {ratio['decoder']:.3f}")

    what = "Gradient norm" if args.kind == "parameters" else "Error-signal norm (output gradient)"
    plot = plot_gradient_norms(
        curves,
        args.out_dir / f"{args.name}.png",
        f"{what} per layer at initialisation",
        dashed=[label for label in curves if label.startswith("DS-Init")],
    )
    results = {
        "claim": "DS-Init Fig. 1: plain post-norm models show vanishing gradients toward the bottom layers, worse in "
        "the decoder and with depth; DS-Init keeps the bottom/top ratio near 1",
        "settings": {
            "depths": args.depths,
            "kind": args.kind,
            "ds_init_modes": args.ds_init_modes,
            "seeds": args.seeds,
            "target_tokens": target_tokens,
            "sizes": sizes,
            "vocab_size": corpus.vocab_size,
            "smoke": args.smoke,
        },
        "systems": systems,
        "plot": plot.name,
    }
    write_results(args.name, results, args.out_dir)
    return results


if __name__ == "__main__":
    main()
