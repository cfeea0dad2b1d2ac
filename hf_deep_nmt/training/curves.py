"""Training curves: training loss and validation BLEU against the optimizer step, from the Trainer's `log_history`,
drawn with matplotlib (the optional `plots` extra) into `training_curves.png`. Without matplotlib the plot is skipped
with a logged message; training never fails for it."""

from __future__ import annotations

from pathlib import Path

from transformers.utils import logging

from hf_deep_nmt.plots import load_pyplot, save_figure

logger = logging.get_logger(__name__)

CURVES_FILE = "training_curves.png"


def curve_points(log_history: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """`(step, value)` pairs of the training loss, validation loss and validation BLEU found in `log_history`, and
    of the optimizer steps skipped for a non-finite loss or gradient (value: the running count)."""
    series = {"loss": "loss", "eval_loss": "eval_loss", "eval_bleu": "eval_bleu", "skipped": "nonfinite_steps_skipped"}
    points: dict[str, list[tuple[int, float]]] = {name: [] for name in series}
    for record in log_history:
        for name, key in series.items():
            if key in record and "step" in record:
                points[name].append((int(record["step"]), float(record[key])))
    return points


def plot_training_curves(log_history: list[dict], output_dir: str | Path) -> Path | None:
    """Write `output_dir/training_curves.png`: loss (training and validation) on the left, validation BLEU on the
    right. Returns its path, or None when there is nothing to plot or matplotlib is not installed."""
    points = curve_points(log_history)
    if not any(points.values()):
        logger.warning("No loss or BLEU was logged during training: no training curves to plot.")
        return None
    try:
        pyplot = load_pyplot()
    except ImportError:
        logger.warning(
            "matplotlib is not installed: training curves skipped (pip install 'hf-deep-nmt[plots]' to get them)."
        )
        return None
    figure, (loss_axis, bleu_axis) = pyplot.subplots(1, 2, figsize=(11, 4))
    for name, label in (("loss", "training loss"), ("eval_loss", "validation loss")):
        if points[name]:
            loss_axis.plot(*zip(*points[name]), marker="." if name == "eval_loss" else None, label=label)
    for number, (step, _) in enumerate(points["skipped"]):
        label = f"skipped step, non-finite ({len(points['skipped'])})" if number == 0 else None
        loss_axis.axvline(step, color="tab:red", alpha=0.4, linewidth=0.8, label=label)
    loss_axis.set(xlabel="step", ylabel="loss", title="Loss")
    loss_axis.legend()
    if points["eval_bleu"]:
        bleu_axis.plot(*zip(*points["eval_bleu"]), marker="o", color="tab:green")
    else:
        bleu_axis.text(0.5, 0.5, "no validation BLEU logged", ha="center", va="center", transform=bleu_axis.transAxes)
    bleu_axis.set(xlabel="step", ylabel="sacreBLEU", title="Validation BLEU")
    for axis in (loss_axis, bleu_axis):
        axis.grid(alpha=0.3)
    return save_figure(figure, Path(output_dir) / CURVES_FILE)
