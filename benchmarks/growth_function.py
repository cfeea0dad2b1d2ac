"""Which ways of growing an encoder keep the model's function at the start, measured: for each growth strategy x
encoder aggregation (residual; DLCL and sparse made exact from it by `with_layer_aggregation`) x pre-/post-norm, the
largest |difference| of the output log-probabilities between a tiny random model (moved off its initialisation, as a
trained one would be) and the same model grown by `grow_encoder`, on one fixed padded batch.

One more row per aggregation is not a `grow_encoder` option: the grown combination's output row set by hand to pick
the old top output alone (new layers still run but the stack output ignores them), to show what that choice would keep.

    OMP_NUM_THREADS=1 python benchmarks/growth_function.py [--json out.json]

Runs in a few seconds on one CPU thread; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.training.growing import GROWTH_STRATEGIES, grow_encoder, with_layer_aggregation

LAYERS = 4
NEW_LAYERS = {"top": 2, "top_only": 2, "double": LAYERS, "interleave": LAYERS}
SIZES = dict(
    vocab_size=61,
    d_model=32,
    encoder_layers=LAYERS,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
)


def random_model(pre_norm: bool, seed: int = 0) -> DeepNMTForConditionalGeneration:
    torch.manual_seed(seed)
    model = DeepNMTForConditionalGeneration(DeepNMTConfig(**SIZES, pre_norm=pre_norm))
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(torch.randn_like(tensor) * 0.3)
    return model.eval()


def fixed_batch() -> dict:
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(4, SIZES["vocab_size"], (4, 11), generator=generator)
    mask = torch.ones_like(source)
    source[2, 7:], mask[2, 7:] = 1, 0  # one padded sentence
    source[:, -1] = torch.where(mask[:, -1].bool(), 2, 1)
    target = torch.randint(4, SIZES["vocab_size"], (4, 8), generator=generator)
    target[:, 0] = 0
    return dict(input_ids=source, attention_mask=mask, decoder_input_ids=target)


def log_probs(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(**batch).logits.float(), dim=-1)


def keep_output_row(grown, old_top: int) -> None:
    """Set the grown encoder's output row to the old top stored output alone (index `old_top` of the stored
    outputs): the new layers run but the stack output does not read them."""
    weight = grown.model.encoder.history.weight
    with torch.no_grad():
        weight[-1].zero_()
        weight[-1, old_top] = 1.0


def measure() -> list[dict]:
    batch, rows = fixed_batch(), []
    for pre_norm in (True, False):
        base = random_model(pre_norm)
        reference = log_probs(base, batch)
        for aggregation in ("residual", "dlcl", "sparse"):
            model = base if aggregation == "residual" else with_layer_aggregation(base, aggregation)
            exact = (log_probs(model, batch) - reference).abs().max().item()
            for strategy in GROWTH_STRATEGIES:
                row = dict(norm="pre" if pre_norm else "post", aggregation=aggregation, strategy=strategy)
                try:
                    grown = grow_encoder(model, NEW_LAYERS[strategy], strategy)
                except ValueError as error:
                    rows.append({**row, "difference": None, "note": str(error).split(";")[0]})
                    continue
                difference = (log_probs(grown, batch) - reference).abs().max().item()
                rows.append(
                    {**row, "difference": difference, "rewiring": exact, "layers": grown.config.encoder_layers}
                )
                if aggregation != "residual" and strategy in ("top", "double"):
                    old_top = LAYERS if aggregation == "dlcl" else 1  # y_h in DLCL, the old block's output in sparse
                    keep_output_row(grown, old_top)
                    kept = (log_probs(grown, batch) - reference).abs().max().item()
                    rows.append({**row, "strategy": f"{strategy}, output row by hand", "difference": kept})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| norm | encoder | strategy | layers | max abs log-prob difference |",
        "|---|---|---|---:|---:|",
    ]
    for row in rows:
        value = "refused" if row["difference"] is None else f"{row['difference']:.3g}"
        layers = row.get("layers", "")
        lines.append(f"| {row['norm']} | {row['aggregation']} | {row['strategy']} | {layers} | {value} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure()
    rewiring = max(row.get("rewiring", 0.0) for row in rows)
    print(f"rewiring residual -> dlcl / sparse before growing: max abs log-prob difference {rewiring:.3g}")
    print(markdown(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)
    return rows


if __name__ == "__main__":
    main()
