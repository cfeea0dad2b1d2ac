"""Where the time goes: torch.profiler summaries of the contenders of benchmarks/perf.py, written as text.

    python benchmarks/profile_perf.py                      # base sizes, every case
    python benchmarks/profile_perf.py --cases beam4_own_multi_head train_own
    python benchmarks/profile_perf.py --smoke              # tiny sizes, checks that it runs (= --size smoke)

One file per case in benchmarks/results/profiles/ (profiles_smoke/ at smoke size, so that a smoke run leaves the
base-size profiles alone): operators by self CPU time, and by module scopes recorded with `record_function` around
every top-level module of the model.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("perf", HERE / "perf.py")
perf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(perf)

CASES = (
    "beam4_own_multi_head",
    "beam4_own_matt",
    "beam4_hf_marian",
    "greedy_own_multi_head",
    "train_own",
    "train_hf_marian",
    "deep_plain_48",
    "deep_dlcl_48",
)


def scoped(model: torch.nn.Module) -> None:
    """Name the time of the model's main parts in the profile: encoder, decoder, output layer."""
    for name, module in model.named_modules():
        if name.count(".") == 1 and name.split(".")[-1] in ("encoder", "decoder") or name == "lm_head":
            forward = module.forward

            def wrapped(*args, _forward=forward, _name=name, **kwargs):
                with record_function(f"## {_name}"):
                    return _forward(*args, **kwargs)

            module.forward = wrapped


def case_runner(case: str, size: dict):
    kind, _, rest = case.partition("_")
    if kind in ("beam4", "greedy"):
        model = perf.decoding_model(rest, size, Path("."))
        scoped(model)
        return perf.decode(rest, model, perf.decoding_source(size), 4 if kind == "beam4" else 1, size["new_tokens"])
    if kind == "train":
        model = perf.own_model(size) if rest == "own" else perf.marian_model(size)
        scoped(model)
        return perf.training_step(model, perf.training_batch(size, size["train_batch"], size["train_length"]))
    aggregation, layers = rest.split("_")
    deep_size = size | {"d_model": size["deep_d_model"], "ffn": size["deep_ffn"], "heads": size["deep_heads"]}
    layers = int(layers) if size["name"] == "base" else size["deep_layers"][1]
    model = perf.own_model(deep_size, layers=layers, aggregation="residual" if aggregation == "plain" else "dlcl")
    scoped(model)
    return perf.training_step(model, perf.training_batch(deep_size, size["deep_batch"], size["deep_length"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(perf.SIZES), default=None, help="default: base")
    parser.add_argument("--smoke", action="store_true", help="the same as --size smoke: tiny sizes")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None, help="default: results/profiles (profiles_smoke)")
    args = parser.parse_args()
    if args.smoke and args.size not in (None, "smoke"):
        parser.error(f"--smoke is --size smoke; it contradicts --size {args.size}")
    args.size = "smoke" if args.smoke else args.size or "base"
    args.out = args.out or HERE / "results" / ("profiles" if args.size == "base" else f"profiles_{args.size}")
    if args.threads:
        torch.set_num_threads(args.threads)
    size = dict(perf.SIZES[args.size]) | {"name": args.size}
    args.out.mkdir(parents=True, exist_ok=True)
    for case in args.cases:
        run = case_runner(case, size)
        run()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            seconds = run()
        averages = profiler.key_averages()
        scopes = [event for event in averages if event.key.startswith("## ")]
        lines = [
            f"case {case}, size {args.size}, torch threads {torch.get_num_threads()}, wall {seconds:.3f} s "
            "(under the profiler)",
            "",
            "model parts (CPU total, inclusive):",
        ]
        for event in sorted(scopes, key=lambda event: -event.cpu_time_total):
            lines.append(f"  {event.key[3:]:<36} {event.cpu_time_total / 1e6:8.3f} s  calls {event.count}")
        rest = seconds - sum(event.cpu_time_total for event in scopes) / 1e6
        lines.append(f"  {'outside (search/backward/optimizer)':<36} {rest:8.3f} s")
        lines += ["", averages.table(sort_by="self_cpu_time_total", row_limit=args.rows)]
        path = args.out / f"{case}.txt"
        path.write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:8]))
        print(f"-> {path}\n")


if __name__ == "__main__":
    main()
