"""Post-norm against DeepNorm (and pre-norm) at 18 + 18 layers: loss curves of `hf-deep-nmt train` on the bundled
sample, base width, bf16 on a GPU (DeepNet's claim at translation scale: plain post-norm is unstable at this depth
with an aggressive schedule, DeepNorm trains like pre-norm).

Each system is the same recipe (`hf_deep_nmt.training.pipeline.run`, the code behind `hf-deep-nmt train`): d 512, FFN
2048, 8 heads, dropout 0.1, 8k-token batches, Adam (0.9, 0.98), inverse-sqrt schedule with a short warm-up, label
smoothing 0.1, the same seed and data order; only the residual placement differs. Writes the training-loss curve of
each (every `--log-every` steps), the step of the first non-finite loss, the skipped steps, the final loss, validation
sacreBLEU (greedy, 100 sentences), the wall time and the peak GPU memory to `--out` (JSON), and prints a table.

    python benchmarks/deepnorm_training.py --out benchmarks/results/deepnorm_training.json        # GPU, bf16
    python benchmarks/deepnorm_training.py --device cpu --steps 4 --layers 2 --d-model 32 --out /tmp/x.json  # smoke
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

SYSTEMS = {
    "post-norm": dict(model_type="deep_nmt", pre_norm=False),
    "DeepNorm": dict(model_type="deep_nmt_deepnorm", pre_norm=False, deepnorm=True),
    "pre-norm": dict(model_type="deep_nmt", pre_norm=True),
}


def recipe(system: dict, args: argparse.Namespace, output_dir: Path) -> dict:
    settings = {key: value for key, value in system.items() if key != "model_type"}
    width = args.d_model
    return {
        "model_type": system["model_type"],
        "model_overrides": {
            "encoder_layers": args.layers,
            "decoder_layers": args.layers,
            "d_model": width,
            "encoder_ffn_dim": 4 * width,
            "decoder_ffn_dim": 4 * width,
            "encoder_attention_heads": max(1, width // 64),
            "decoder_attention_heads": max(1, width // 64),
            "dropout": 0.1,
            **settings,
        },
        "tokenizer_vocab_size": 8000,
        "max_source_length": 64,
        "max_target_length": 64,
        "max_eval_samples": 100,
        "output_dir": str(output_dir),
        "max_steps": args.steps,
        "max_tokens": args.max_tokens,
        "bf16": args.device == "cuda",
        "use_cpu": args.device == "cpu",
        "learning_rate": args.learning_rate,
        "lr_schedule": "inverse_sqrt",
        "warmup_steps": args.warmup,
        "adam_beta2": 0.98,
        "label_smoothing_factor": 0.1,
        "save_strategy": "steps",
        "save_steps": args.steps,
        "save_total_limit": 1,
        "logging_steps": args.log_every,
        "report_to": "none",
        "plot_curves": False,
        "translate_examples": 0,
        "num_beams": 1,
        "per_device_eval_batch_size": 64,
        "seed": 1,
    }


def main(argv: list[str] | None = None) -> dict:
    from hf_deep_nmt.training.pipeline import run

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    results = {"settings": {key: value for key, value in vars(args).items() if key != "out"}, "systems": {}}
    if args.device == "cuda":
        results["settings"]["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.systems:
            output_dir = Path(scratch) / name.replace(" ", "-")
            path = output_dir.with_suffix(".json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(recipe(SYSTEMS[name], args, output_dir), indent=2))
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            try:
                summary, error = run([str(path)]), None
            except Exception as failure:  # a diverged run is a result here, reported with its cause
                summary, error = {}, f"{type(failure).__name__}: {failure}"
            seconds = time.perf_counter() - started
            state_file = output_dir / f"checkpoint-{args.steps}" / "trainer_state.json"
            history = json.loads(state_file.read_text())["log_history"] if state_file.is_file() else []
            curve = [(record["step"], record["loss"]) for record in history if "loss" in record]
            first_nonfinite = next((step for step, loss in curve if not math.isfinite(loss)), None)
            results["systems"][name] = {
                "loss_curve": curve,
                "final_loss": curve[-1][1] if curve else None,
                "first_nonfinite_step": first_nonfinite,
                "nonfinite_steps_skipped": summary.get("nonfinite_steps_skipped"),
                "bleu": summary.get("bleu"),
                "seconds": round(seconds, 1),
                "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                if args.device == "cuda"
                else None,
                "error": error,
            }
            print(f"{name}: {results['systems'][name]}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    marks = sorted({step for system in results["systems"].values() for step, _ in system["loss_curve"]})
    shown = [step for step in marks if step in (10, 50, 100, 200, 300, args.steps)]
    print("\nloss at step  " + "  ".join(f"{step:>7}" for step in shown) + "   skipped  BLEU   peak GiB")
    for name, system in results["systems"].items():
        losses = dict(system["loss_curve"])
        cells = "  ".join(f"{losses.get(step, float('nan')):7.3f}" for step in shown)
        print(
            f"{name:12s}  {cells}   {system['nonfinite_steps_skipped']!s:>7}  {system['bleu']!s:>5}  "
            f"{system['peak_gpu_memory_gib']!s:>6}"
        )
    return results


if __name__ == "__main__":
    main()
