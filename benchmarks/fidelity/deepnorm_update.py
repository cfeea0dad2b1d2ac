"""DeepNet (Wang et al. 2022), the analysis behind DeepNorm: the size of the model update early in training.

Claim: in a deep post-norm Transformer the model update ||F(x, theta_t) - F(x, theta_0)|| grows fast in the first
steps (the amplified update that drives the model into a bad region, after which LayerNorm's gradients vanish);
DeepNorm (skip weighted by alpha, value/output/FFN matrices drawn with gain beta) keeps it bounded, whatever the depth.

Measured: post-norm with the default Glorot initialisation, post-norm with DS-Init (alpha = 1) and DeepNorm, at
encoder = decoder depth 18 and 36, small width (d 64, FFN 256, 4 heads, no dropout), trained from the same seed on the
same batches of the sample corpus (Adam (0.9, 0.98), inverse-sqrt schedule, peak learning rate 1e-3 after a short
warm-up, so that the first steps move the model, as the paper's instability needs). F(x, theta) is the decoder's final
hidden state (what the output layer reads) on a fixed validation batch in eval mode; the update is its root mean
square difference per position from step 0, at each recorded step. Also recorded: the per-layer gradient norms at
step 0 (`hf_deep_nmt.tools.diagnostics.layer_gradient_norms`) and the training loss.

    python benchmarks/fidelity/deepnorm_update.py            # 12 minutes on one busy CPU thread
    python benchmarks/fidelity/deepnorm_update.py --smoke    # tiny, seconds
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Corpus, add_script_arguments, script_settings, setup_threads, train, write_results  # noqa: E402

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration  # noqa: E402
from hf_deep_nmt.modeling.modeling_deep_nmt import shift_tokens_right  # noqa: E402
from hf_deep_nmt.plots import load_pyplot, save_figure  # noqa: E402
from hf_deep_nmt.tools.diagnostics import layer_gradient_norms  # noqa: E402

SYSTEMS = {
    "post-norm": dict(pre_norm=False),
    "DS-Init": dict(pre_norm=False, init_scheme="ds_init"),
    "DeepNorm": dict(pre_norm=False, deepnorm=True),
}


def network_output(model, batch: dict) -> torch.Tensor:
    """The decoder's final hidden states on `batch` (eval mode, no gradient), padding positions zeroed."""
    was_training = model.training
    model.eval()
    config = model.config
    decoder_input_ids = shift_tokens_right(batch["labels"], config.pad_token_id, config.decoder_start_token_id)
    with torch.no_grad():
        hidden = model.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_input_ids
        ).last_hidden_state
    model.train(was_training)
    return hidden * (batch["labels"] != -100).unsqueeze(-1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[18, 36])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--record", type=int, nargs="+", default=[1, 2, 5, 10, 20, 40, 60])
    parser.add_argument("--peak-lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--name", default="deepnorm_update", help="name of the result files")
    add_script_arguments(parser)
    args = parser.parse_args(argv)
    setup_threads(args.threads)
    sizes = dict(d_model=64, encoder_ffn_dim=256, decoder_ffn_dim=256, encoder_attention_heads=4)
    sizes["decoder_attention_heads"] = 4
    if args.smoke:
        args.depths, args.steps, args.record, args.batch_size = [2, 3], 3, [1, 3], 4
        sizes = dict(d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32, encoder_attention_heads=2)
        sizes["decoder_attention_heads"] = 2
        corpus = Corpus(vocab_size=300, train_pairs=300)
    else:
        corpus = Corpus(vocab_size=2000)
    probe = corpus.validation_batches(size=32, limit=32)[0]
    positions = int((probe["labels"] != -100).sum())

    systems = {}
    for depth in args.depths:
        for name, settings in SYSTEMS.items():
            label = f"{name} {depth}L"
            torch.manual_seed(0)
            config = DeepNMTConfig(
                vocab_size=corpus.vocab_size,
                encoder_layers=depth,
                decoder_layers=depth,
                dropout=0.0,
                **sizes,
                **settings,
            )
            model = DeepNMTForConditionalGeneration(config).train()
            start = network_output(model, probe)
            gradients = layer_gradient_norms(model, probe)
            updates = {}

            def record(step, model, start=start, updates=updates):
                # called before the optimizer step: the output after `step - 1` updates; the last one comes below
                if step - 1 in args.record:
                    change = network_output(model, probe) - start
                    updates[step - 1] = float(change.norm() / positions**0.5)

            curve = train(
                model, corpus.stream(args.batch_size, seed=1), args.steps, args.peak_lr, args.warmup, on_step=record
            )
            if args.steps in args.record:
                updates[args.steps] = float((network_output(model, probe) - start).norm() / positions**0.5)
            alpha_beta = {side: config.deepnorm_constants(side) for side in ("encoder", "decoder")}
            systems[label] = {
                "depth": depth,
                "settings": settings,
                "deepnorm_constants": alpha_beta if config.deepnorm else None,
                "model_update": {str(step): round(value, 5) for step, value in sorted(updates.items())},
                "gradient_norms_at_init": {side: [round(v, 6) for v in norms] for side, norms in gradients.items()},
                "train_loss": [round(loss, 4) for loss in curve["train_losses"]],
            }
            shown = "  ".join(f"{step}:{value:.3g}" for step, value in sorted(updates.items()))
            print(f"{label:16s} update by step  {shown}", flush=True)

    plot = plot_updates(systems, args.out_dir / f"{args.name}.png")
    results = {
        "claim": "DeepNet Fig. 3: post-norm's early model update grows fast with training steps and depth; "
        "DeepNorm's stays bounded",
        "settings": script_settings(args, sizes=sizes, vocab_size=corpus.vocab_size, probe_positions=positions),
        "systems": systems,
        "plot": plot.name,
    }
    write_results(args.name, results, args.out_dir)
    return results


def plot_updates(systems: dict, path: Path) -> Path:
    plt = load_pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, system in systems.items():
        steps = [int(step) for step in system["model_update"]]
        values = [max(value, 1e-12) for value in system["model_update"].values()]
        style = "-" if label.startswith("DeepNorm") else ("--" if label.startswith("DS-Init") else ":")
        axis.plot(steps, values, style, marker="o", label=label)
    axis.set_xlabel("training step")
    axis.set_ylabel("||F(x, θ_t) − F(x, θ_0)|| per position")
    axis.set_yscale("log")
    axis.set_title("Model update early in training")
    axis.legend(fontsize=8)
    return save_figure(figure, path)


if __name__ == "__main__":
    main()
