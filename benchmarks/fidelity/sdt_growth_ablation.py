"""SDT Table 2 (Li et al. 2020): growing with copied top layers and a learning-rate restart against random new layers
and/or a continued schedule, at equal training steps; and SDT Fig. 2's layer similarities of the grown models.

Claim (Table 2, BLEU of SDT-RPR-48L): copy + restart 30.21 > copy only 29.93 > restart only 27.98 > neither 27.33.
Copying the top block is what matters most; the restart adds a little.

Measured, scaled down to the sample corpus and 2 CPU cores: an SDT model (pre-norm, sparse connections, relative
keys k = 8, width 64, FFN 256, 4 heads, 3-layer decoder) trained at 2 encoder layers, then grown twice by a block of
2 (2 -> 4 -> 6 layers). The first stage is shared; each of the four variants then grows and trains the same number of
steps on the same batches:
  * copy: the new block copies the top 2 layers (`grow_encoder`, the paper's method); random: the new layers are
    freshly initialised (the combination weights and block LayerNorm are grown the same way in both);
  * restart: each stage restarts the inverse-sqrt schedule by the SDT rule (`stage_start_step`: back to the peak once
    the warm-up is over); continued: the schedule goes on from the step reached. A fresh Adam in every stage.
Reported: validation loss at the end (lower is better), and sim(i, 0), sim(i, i-1), inter-similarity of the final
encoders on the validation set (`hf_deep_nmt.tools.diagnostics.layer_similarity`).

    python benchmarks/fidelity/sdt_growth_ablation.py          # ~12 minutes on 2 CPU cores
    python benchmarks/fidelity/sdt_growth_ablation.py --smoke  # tiny, seconds
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Corpus, add_script_arguments, script_settings, setup_threads, train, validation_loss, write_results  # noqa: E402

from hf_deep_nmt import SdtConfig, SdtForConditionalGeneration  # noqa: E402
from hf_deep_nmt.tools.diagnostics import layer_similarity, load_pyplot, plot_layer_similarity, save_figure  # noqa: E402
from hf_deep_nmt.training.growing import grow_encoder  # noqa: E402
from hf_deep_nmt.training.schedules import stage_start_step  # noqa: E402

VARIANTS = {
    "copy + restart": (True, True),
    "copy, no restart": (True, False),
    "random + restart": (False, True),
    "random, no restart": (False, False),
}
PAPER_BLEU = {
    "copy + restart": 30.21,
    "copy, no restart": 29.93,
    "random + restart": 27.98,
    "random, no restart": 27.33,
}


def grow(model, block: int, copy_layers: bool, seed: int):
    grown = grow_encoder(model, block)
    if not copy_layers:
        torch.manual_seed(seed)
        fresh = SdtForConditionalGeneration(grown.config)
        for index in range(model.config.encoder_layers, grown.config.encoder_layers):
            grown.model.encoder.layers[index].load_state_dict(fresh.model.encoder.layers[index].state_dict())
    return grown


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=2, help="layers per block (= first depth = growth step)")
    parser.add_argument("--stages", type=int, default=3, help="number of stages (depth block * stages at the end)")
    parser.add_argument("--stage-steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--peak-lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=20)
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    sizes = dict(d_model=64, encoder_ffn_dim=256, decoder_ffn_dim=256, encoder_attention_heads=4)
    sizes.update(decoder_attention_heads=4, decoder_layers=3)
    if args.smoke:
        args.block, args.stages, args.stage_steps, args.warmup, args.batch, args.eval_every = 1, 2, 4, 2, 8, 2
        sizes = dict(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4)
        sizes.update(decoder_attention_heads=4, decoder_layers=1)
        corpus = Corpus(vocab_size=300, train_pairs=300)
        validation = corpus.validation_batches(20, limit=40)
    else:
        corpus = Corpus()
        validation = corpus.validation_batches(100)
    betas = (0.9, 0.997)

    def config(depth):
        return SdtConfig(vocab_size=corpus.vocab_size, encoder_layers=depth, sparse_block_size=args.block, **sizes)

    torch.manual_seed(0)
    first = SdtForConditionalGeneration(config(args.block))
    stream = corpus.stream(args.batch, seed=0)
    run = train(first, stream, args.stage_steps, args.peak_lr, args.warmup, betas, 0, args.eval_every, validation)
    shared_curve = run["valid_curve"]
    # Every variant continues from the same model and the same position of the same batch stream.
    stream_state = copy.deepcopy(stream)
    first_stage = {"curve": shared_curve, "seconds": run["seconds"]}
    print(f"stage 1 ({args.block} layers): validation loss {shared_curve[-1]['loss']:.3f} ({run['seconds']} s)")

    variants, similarities, curves = {}, {}, {}
    for label, (copy_layers, restart) in VARIANTS.items():
        model, batches, done = copy.deepcopy(first), copy.deepcopy(stream_state), args.stage_steps
        curve, seconds = list(shared_curve), run["seconds"]
        for stage in range(1, args.stages):
            model = grow(model, args.block, copy_layers, seed=stage)
            start = stage_start_step(done, args.warmup) if restart else done
            part = train(
                model, batches, args.stage_steps, args.peak_lr, args.warmup, betas, start, args.eval_every, validation
            )
            curve += [{"step": done + p["step"], "loss": p["loss"]} for p in part["valid_curve"]]
            done += args.stage_steps
            seconds += part["seconds"]
        final = validation_loss(model, validation)
        curves[label] = curve
        similarities[label] = layer_similarity(model, validation[0])
        variants[label] = {
            "copy_top_layers": copy_layers,
            "restart_lr": restart,
            "final_encoder_layers": model.config.encoder_layers,
            "final_validation_loss": round(final, 4),
            "paper_bleu": PAPER_BLEU[label],
            "validation_curve": curve,
            "layer_similarity": similarities[label],
            "seconds": seconds,
        }
        print(f"{label:20s} final validation loss {final:.4f}")

    plt = load_pyplot()
    figure, axis = plt.subplots(figsize=(6.4, 3.6))
    for label, curve in curves.items():
        axis.plot([p["step"] for p in curve], [p["loss"] for p in curve], marker=".", label=label)
    for stage in range(1, args.stages):
        axis.axvline(stage * args.stage_steps, color="grey", linewidth=0.5)
    axis.set_xlabel("training step (grey: growth by one block)")
    axis.set_ylabel("validation loss (nats/token)")
    axis.set_title("SDT growth ablation (Table 2)")
    axis.legend()
    loss_plot = save_figure(figure, args.out_dir / "sdt_growth_ablation.png")
    sim_plot = plot_layer_similarity(
        similarities, args.out_dir / "sdt_layer_similarity.png", "Encoder layer similarity of the grown models"
    )
    ranking = sorted(variants, key=lambda k: variants[k]["final_validation_loss"])
    results = {
        "claim": "SDT Table 2: growing with copied top layers and LR restart beats random new layers at equal steps",
        "settings": script_settings(args, sizes=sizes, vocab_size=corpus.vocab_size),
        "first_stage": first_stage,
        "variants": variants,
        "ranking_by_validation_loss": ranking,
        "paper_ranking_by_bleu": sorted(PAPER_BLEU, key=lambda k: -PAPER_BLEU[k]),
        "plots": [loss_plot.name, sim_plot.name],
    }
    write_results("sdt_growth_ablation", results, args.out_dir)
    return results


if __name__ == "__main__":
    main()
