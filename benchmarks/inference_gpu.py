"""Issue 39, item 6: decoding speed of every family on one GPU, against CTranslate2 on the same GPU where it runs.

Families and sizes are `benchmarks/inference.py`'s (random weights, every output forced to `new_tokens` tokens, batch
32 of 24-token sources and `single_sentences` sentences one at a time). Contenders, each in wall time with the device
synchronised before every clock read, one warm-up, the median of `repeats`:

* ``eager_fp32`` / ``eager_bf16``: `generate()` with the dynamic cache, the model in float32 / bfloat16;
* ``compiled_bf16``: `hf_deep_nmt.serving.translate.compiled_decoding`, the bf16 model's forward compiled as one graph
  with
  CUDA graphs (`mode="reduce-overhead"`) over the static cache; its greedy tokens are compared with eager bf16's
  (``agree``: the fraction of equal output tokens; bf16 rounding can move a near tie);
* ``ct2_fp16`` / ``ct2_int8``: the CTranslate2 export (plain and DeepNorm families) on the GPU with compute type
  float16 / int8_float16, when ctranslate2 is installed and finds its CUDA libraries.

Compiling is the slow part (one graph per batch shape and family), so the compiled contender runs greedy at batch 1
and beam 4 at batch 32 only, family after family, until `--budget` seconds have passed since the start; whatever was
not reached is listed as skipped. The table is printed last.

    python benchmarks/inference_gpu.py --json results.json         # base size, every family
    python benchmarks/inference_gpu.py --size quick --device cpu   # checks that it runs (no CUDA graphs on a CPU)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from inference import FAMILIES, SEARCHES, SIZES, family_model, sources, tokenizer_for, torch_runs  # noqa: E402

from hf_deep_nmt.serving.ctranslate2 import ctranslate2_blockers  # noqa: E402
from hf_deep_nmt.serving.translate import compiled_decoding  # noqa: E402

COMPILED_RUNS = ("greedy_b1", "beam4_bBATCH")


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_median(run: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, object]:
    output = run()  # warm-up (and, compiled, the compilation)
    synchronise(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        output = run()
        synchronise(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), output


def produced(size: dict, name: str) -> int:
    return size["new_tokens"] * (size["single_sentences"] if name.endswith("_b1") else size["batch"])


def agreement(ours, reference) -> float:
    ours = ours if isinstance(ours, list) else [ours]
    reference = reference if isinstance(reference, list) else [reference]
    equal = sum(int((a == b).sum()) for a, b in zip(ours, reference, strict=True))
    return equal / sum(b.numel() for b in reference)


def ct2_rows(model, tokenizer, family: str, size: dict, batches: dict, workdir: Path, device: torch.device) -> dict:
    import ctranslate2

    from hf_deep_nmt.serving.ctranslate2 import export_ctranslate2

    folder = export_ctranslate2(model.float().cpu(), tokenizer, workdir / f"{family}-ct2", overwrite=True)
    tokens = {
        name: [tokenizer.convert_ids_to_tokens(row.tolist()) for row in ids.cpu()] for name, ids in batches.items()
    }
    new, rows = size["new_tokens"], {}
    for label, compute_type in (("ct2_fp16", "float16"), ("ct2_int8", "int8_float16")):
        translator = ctranslate2.Translator(str(folder), device=device.type, compute_type=compute_type)

        def translate(batch, beams, translator=translator):
            return translator.translate_batch(
                batch, beam_size=beams, min_decoding_length=new, max_decoding_length=new, max_batch_size=len(batch)
            )

        figures = {}
        for search, beams in SEARCHES.items():
            for name, run in (
                (f"{search}_b{size['batch']}", lambda beams=beams: translate(tokens["batch"], beams)),
                (f"{search}_b1", lambda beams=beams: [translate([row], beams) for row in tokens["single"]]),
            ):
                seconds, _ = wall_median(run, torch.device("cpu"), size["repeats"])  # CTranslate2 returns synchronised
                figures[name] = dict(seconds=seconds, tokens_per_second=produced(size, name) / seconds)
        rows[f"{family} {label}"] = figures
    return rows


def run(size_name: str, families: list[str], device: torch.device, budget: float, workdir: Path) -> dict:
    started = time.perf_counter()
    size = dict(SIZES[size_name])
    tokenizer = tokenizer_for(size)
    vocab_size = len(tokenizer)
    batches = {
        "batch": sources(size, size["batch"], vocab_size, tokenizer.eos_token_id).to(device),
        "single": sources(size, size["single_sentences"], vocab_size, tokenizer.eos_token_id).to(device),
    }
    results = {
        "size": {"name": size_name, **size, "vocab_size": vocab_size},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": {},
        "agree": {},
        "skipped": [],
    }
    have_ct2 = importlib.util.find_spec("ctranslate2") is not None
    if not have_ct2:
        results["skipped"].append("ct2: ctranslate2 is not installed")
    outputs = {}
    for family in families:
        model = family_model(family, size, vocab_size).to(device)
        for label, dtype in (("eager_fp32", torch.float32), ("eager_bf16", torch.bfloat16)):
            model = model.to(dtype)
            figures = {}
            for name, run_one in torch_runs(model, size, batches).items():
                seconds, output = wall_median(run_one, device, size["repeats"])
                figures[name] = dict(seconds=seconds, tokens_per_second=produced(size, name) / seconds)
                outputs[(family, label, name)] = output
            results["rows"][f"{family} {label}"] = figures
        if have_ct2 and not ctranslate2_blockers(model.config):
            try:
                results["rows"].update(ct2_rows(model, tokenizer, family, size, batches, workdir, device))
            except Exception as error:  # noqa: BLE001  (a CTranslate2 build without this CUDA: reported, not fatal)
                results["skipped"].append(f"{family} ct2: {type(error).__name__}: {str(error).splitlines()[0]}")
            model = model.to(device)
        elif have_ct2:
            results["skipped"].append(f"{family} ct2: {'; '.join(ctranslate2_blockers(model.config))}")
        del model
    for family in families:
        if time.perf_counter() - started > budget:
            results["skipped"].append(f"{family} compiled_bf16: the --budget of {budget:.0f} s was spent")
            continue
        model = family_model(family, size, vocab_size).to(device).to(torch.bfloat16)
        figures = {}
        with compiled_decoding(model, longest_output=size["new_tokens"] + 1) as options:
            runs = torch_runs(model, size, batches, options)
            for name in (run_name.replace("BATCH", str(size["batch"])) for run_name in COMPILED_RUNS):
                compile_start = time.perf_counter()
                seconds, output = wall_median(runs[name], device, size["repeats"])
                figures[name] = dict(
                    seconds=seconds,
                    tokens_per_second=produced(size, name) / seconds,
                    first_call_seconds=time.perf_counter() - compile_start - seconds * size["repeats"],
                )
                results["agree"][f"{family} {name}"] = agreement(output, outputs[(family, "eager_bf16", name)])
        results["rows"][f"{family} compiled_bf16"] = figures
        del model
    results["seconds"] = time.perf_counter() - started
    return results


def table(results: dict) -> str:
    batch = results["size"]["batch"]
    columns = [f"greedy_b{batch}", f"beam4_b{batch}", "greedy_b1", "beam4_b1"]
    lines = [
        f"tokens per second on {results['device']} (torch {results['torch']}, size {results['size']['name']})",
        "",
        "| family backend | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for row, figures in results["rows"].items():
        cells = [f"{figures[name]['tokens_per_second']:,.0f}" if name in figures else "-" for name in columns]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    if results["agree"]:
        lines += ["", "compiled bf16 tokens equal to eager bf16's: " + ", ".join(
            f"{name} {value:.3f}" for name, value in results["agree"].items()
        )]  # fmt: skip
    lines += [f"skipped: {reason}" for reason in results["skipped"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds after which no compiled family starts")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available (use --device cpu to check that the script runs).")
    with tempfile.TemporaryDirectory() as workdir:
        results = run(args.size, args.families, device, args.budget, Path(workdir))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
