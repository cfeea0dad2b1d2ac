"""Figures of the papers' analyses, as PNG files (matplotlib on the file-only Agg backend; the optional `plots` extra:
`pip install "hf-deep-nmt[plots]"`).

* `plot_gradient_norms`: per-layer gradient norms, one panel per stack (DS-Init Fig. 1, MSC Fig. 5).
* `plot_combination_weights`: a DLCL / sparse combination matrix with the small entries masked as in DLCL Fig. 5
  (`mask_small_weights`).
* `plot_layer_similarity`: SDT Fig. 2, the three layer similarities.
* `load_pyplot` / `save_figure`: the backend and the PNG writer every figure of the package goes through.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

STACKS = ("encoder", "decoder")  # in the order the figures draw them


def mask_small_weights(weight: torch.Tensor, absolute: float = 0.1, relative: float = 0.05) -> torch.Tensor:
    """DLCL Fig. 5: a copy of the lower-triangular `weight` with NaN where an entry is above the diagonal or its
    absolute value is below `absolute` or below `relative` times the largest absolute value of its row."""
    if weight.dim() != 2 or weight.shape[0] != weight.shape[1]:
        raise ValueError(f"`weight` must be a square matrix, got shape {tuple(weight.shape)}.")
    weight = weight.detach().float()
    magnitude = weight.abs().tril()
    row_max = magnitude.max(dim=1, keepdim=True).values
    keep = (magnitude >= absolute) & (magnitude >= relative * row_max)
    keep &= torch.ones_like(keep).tril().bool()
    return weight.masked_fill(~keep, float("nan"))


def load_pyplot():
    """`matplotlib.pyplot` on the file-only Agg backend; `ImportError` saying which extra to install without it."""
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            'Plotting needs matplotlib: pip install "hf-deep-nmt[plots]" (or pip install matplotlib).'
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_ticks(axis, y: bool = False) -> None:
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if y:
        axis.yaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(figure, path: str | Path) -> Path:
    """Lay out `figure`, write it to `path` as PNG (creating its folder) and close it; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    load_pyplot().close(figure)
    return path


def plot_gradient_norms(
    curves: Mapping[str, Mapping[str, list[float]]], path: str | Path, title: str = "", dashed=()
) -> Path:
    """Per-layer gradient norms, one panel per stack (encoder top, decoder bottom, as DS-Init Fig. 1).

    `curves` maps a label (e.g. "post-norm 12L") to the output of `layer_gradient_norms`; the labels in `dashed` are
    drawn dashed (the paper's convention for its method)."""
    plt = load_pyplot()
    sides = [side for side in STACKS if any(side in norms for norms in curves.values())]
    figure, axes = plt.subplots(len(sides), 1, figsize=(6.4, 2.8 * len(sides)), squeeze=False)
    for axis, side in zip(axes[:, 0], sides):
        for label, norms in curves.items():
            if side in norms:
                values = norms[side]
                style = "--" if label in dashed else "-"
                axis.plot(range(1, len(values) + 1), values, style, marker=".", label=label)
        axis.set_xlabel(f"{side} layer")
        _integer_ticks(axis)
        axis.set_ylabel("gradient norm")
        axis.legend(fontsize=7)
    if title:
        axes[0, 0].set_title(title)
    return save_figure(figure, path)


def plot_combination_weights(
    weight: torch.Tensor, path: str | Path, title: str = "", absolute: float = 0.1, relative: float = 0.05
) -> Path:
    """Heatmap of a combination matrix with the small entries masked (`mask_small_weights`), as DLCL Fig. 5:
    x = the stored output j (0 = embedding), y = the layer / block whose input the row builds."""
    plt = load_pyplot()
    masked = mask_small_weights(weight, absolute, relative).numpy()
    size = masked.shape[0]
    figure, axis = plt.subplots(figsize=(3 + 0.18 * size, 2.6 + 0.16 * size))
    image = axis.imshow(masked, cmap="viridis", origin="upper")
    _integer_ticks(axis, y=True)
    figure.colorbar(image, ax=axis)
    axis.set_xlabel("stored output j (0 = embedding)")
    axis.set_ylabel("input of block r+1 (last row: stack output)")
    axis.set_title(title or f"combination weights (|w| < {absolute} or < {relative:.0%} of row max masked)")
    return save_figure(figure, path)


def plot_layer_similarity(curves: Mapping[str, Mapping[str, list[float]]], path: str | Path, title: str = "") -> Path:
    """SDT Fig. 2: (a) sim(i, 0), (b) sim(i, i-1), (c) inter-similarity, one line per model in `curves`."""
    plt = load_pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for label, sims in curves.items():
        layers = len(sims["to_embedding"])
        axes[0].plot(range(1, layers + 1), sims["to_embedding"], marker=".", label=label)
        axes[1].plot(range(1, layers + 1), sims["adjacent"], marker=".", label=label)
        axes[2].plot(range(0, layers + 1), sims["inter"], marker=".", label=label)
    for axis, name in zip(axes, ("(a) sim(i, 0)", "(b) sim(i, i-1)", "(c) inter-similarity")):
        axis.set_title(name)
        axis.set_xlabel("layer i (0 = embedding)")
        _integer_ticks(axis)
        axis.legend(fontsize=7)
    if title:
        figure.suptitle(title)
    return save_figure(figure, path)
