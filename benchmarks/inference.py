"""Inference speed of every family on every backend, in one run (issue 39's table): tokens per CPU second.

Families (random weights, the same sizes): ``plain`` (pre-norm), ``dlcl`` (dense DLCL, both stacks), ``matt``
(DS-Init + merged attention), ``sdt_relative`` (sparse blocks, relative position keys), ``msc`` (one encoder layer per
decoder layer, GRU context, gated fusion), ``deepnorm``, ``denseformer`` (DLCL's history with the identity start and
no history norms), ``mixln`` (the first quarter of each stack post-norm, at least one layer), ``attnres`` (full
Attention Residuals), ``hyper_connections`` (dynamic, 2 streams) and ``mhc`` (the same with 20 Sinkhorn-Knopp
iterations: mHC's weight maps add their own operations to the graph).

Backends, each where it applies:

* ``torch``: `generate()` with the dynamic cache, eager, fp32;
* ``torch_int8``: the same after torchao's `quantize_(model, Int8DynamicActivationInt8WeightConfig())` (the route
  docs/serving.md gives), when torchao is installed;
* ``ct2_fp32`` / ``ct2_int8``: the model's CTranslate2 export (`export_ctranslate2`) loaded with compute type
  float32 / int8, for the families it expresses (plain and DeepNorm), when ctranslate2 is installed;
* ``ort_fp32`` / ``ort_int8``: `hf_deep_nmt.serving.onnx` (the start graph and the one-step graph with the cache
  as tensors, ONNX Runtime at one thread, its own vectorised greedy and beam search; int8: `quantize_dynamic`), every
  family; not at the quick size (each export costs several CPU seconds, and CI runs the quick size).

Every decoding is forced to `new_tokens` output tokens (`ForcedLength` / `min_decoding_length`), so every contender
does the same work; batch 32 decodes one batch of 24-token sources, batch 1 decodes `single_sentences` sentences one
at a time. Timings are process CPU time (`time.process_time`, every thread of the process) at one thread (torch and
CTranslate2 alike), which a shared machine's load distorts far less than wall time; wall time is reported beside it.
One warm-up, then the median of `repeats` runs.

The end-to-end row translates `lines` sentences of the sample corpus with `hf-deep-nmt translate` (in-process,
`--threads 1`, beam 4, batch 32, model loading included) and with the plain model's CTranslate2 export (tokenizer,
`translate_batch`, detokenisation, the same caps), and reports whether the two outputs are the same; beside them
`hf-deep-nmt translate --backend ctranslate2` on that export (in-process, and whether its output is the torch
backend's), and, except at the quick size, both backends' `translate` as whole processes (the CPU seconds of the
process tree, `RUSAGE_CHILDREN`: interpreter start, imports and model loading included, as a user pays them).

`--end-to-end MODEL --lines FILE` instead runs whole processes on real text, as users run them: `hf-deep-nmt
translate` on the torch backend and on ONNX Runtime fp32 and int8 (the graphs of `export-onnx --into-model --int8`),
and CTranslate2's `translate_batch` on the model's CTranslate2 export(s) in a process with no hf-deep-nmt code, at
fp32 and int8; beam 4, every output capped at 64 tokens, batches of 64 sentences, at each of `--threads`, every
contender once per round in turn, `--repeats` rounds. Each row: the process tree's CPU seconds (`RUSAGE_CHILDREN`),
the ratio to CTranslate2 at the same precision, the resident memory after the imports and that of the loaded decoder
after its beam-4 decodings above them (MB), the peak, and how many lines differ from the torch backend's. There is no
smoke size of it: each `translate` process costs seconds of imports before it decodes anything.

`--profile FAMILY` instead breaks one beam-4 batch-32 `generate()` of that family down (cProfile): the model's forward
against the search around it (top-k, finished beams, cache reordering, logits processors).

    python benchmarks/inference.py --size reduced   # d 256, 3 + 3 layers (benchmarks/README.md)
    python benchmarks/inference.py                  # base: d 512, 6 + 6, 32k vocabulary
    python benchmarks/inference.py --quick          # tiny, one repeat: checks that it runs (CI)
    python benchmarks/inference.py --profile plain --size reduced
    python benchmarks/inference.py --size reduced --backends ct2 ort   # the ONNX Runtime table against CTranslate2
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import math
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_deep_nmt import (
    MODEL_CLASSES,
    AttnResConfig,
    DeepNMTConfig,
    DeepNormConfig,
    DenseFormerConfig,
    DlclConfig,
    DsInitConfig,
    HyperConnectionsConfig,
    MixLnConfig,
    MscConfig,
    SdtConfig,
)
from hf_deep_nmt.serving.ctranslate2 import ctranslate2_blockers

SIZES = {
    "quick": dict(
        d_model=32, ffn=64, heads=4, layers=2, vocab=300, batch=4, source_length=8, new_tokens=4,
        single_sentences=1, lines=12, repeats=1, warm_up=False, tokenizer_pairs=400, whole_process=False,
    ),
    "reduced": dict(
        d_model=256, ffn=1024, heads=4, layers=3, vocab=8000, batch=32, source_length=24, new_tokens=24,
        single_sentences=4, lines=200, repeats=3, warm_up=True, tokenizer_pairs=None, whole_process=True,
    ),
    "base": dict(
        d_model=512, ffn=2048, heads=8, layers=6, vocab=32000, batch=32, source_length=24, new_tokens=24,
        single_sentences=4, lines=1000, repeats=3, warm_up=True, tokenizer_pairs=None, whole_process=True,
    ),
}  # fmt: skip
FAMILIES = (
    "plain", "dlcl", "matt", "sdt_relative", "msc", "deepnorm", "denseformer", "mixln", "attnres", "hyper_connections",
    "mhc",
)  # fmt: skip
BACKENDS = ("torch", "torch_int8", "ct2", "ort")  # ct2: fp32 and int8 rows; ort: fp32 and int8 rows
SEARCHES = {"greedy": 1, "beam4": 4}


def family_config(family: str, size: dict, vocab_size: int):
    layers = size["layers"]
    sizes = dict(
        vocab_size=vocab_size,
        d_model=size["d_model"],
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"],
        encoder_ffn_dim=size["ffn"],
        decoder_ffn_dim=size["ffn"],
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    if family == "plain":
        return DeepNMTConfig(**sizes)
    if family == "dlcl":
        return DlclConfig(**sizes)
    if family == "matt":
        return DsInitConfig(**sizes)
    if family == "sdt_relative":
        return SdtConfig(**sizes, sparse_block_size=max(1, layers // 2), relative_position_window=8)
    if family == "msc":
        return MscConfig(**{**sizes, "encoder_layers": None}, msc_block_layers=[1] * layers)
    if family == "deepnorm":
        return DeepNormConfig(**sizes)
    return later_family_config(family, sizes, layers)


def later_family_config(family: str, sizes: dict, layers: int):
    """The families added to the package after the table's first six, at the table's sizes (their presets' depths
    replaced by the size's)."""
    if family == "denseformer":
        return DenseFormerConfig(**sizes)
    if family == "mixln":
        post_norm = max(1, layers // 4)  # Mix-LN's ratio 0.25, at least one post-norm layer
        return MixLnConfig(**sizes, encoder_post_norm_layers=post_norm, decoder_post_norm_layers=post_norm)
    if family == "attnres":
        return AttnResConfig(**sizes)
    if family == "hyper_connections":
        return HyperConnectionsConfig(**sizes)
    if family == "mhc":
        return HyperConnectionsConfig(**sizes, hyper_connections_sinkhorn_iterations=20)
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}.")


def family_model(family: str, size: dict, vocab_size: int):
    torch.manual_seed(0)
    config = family_config(family, size, vocab_size)
    return MODEL_CLASSES[type(config)](config).eval()


def sample_lines(count: int) -> list[str]:
    """The source side of the first `count` pairs of the packaged sample corpus."""
    path = Path(__file__).resolve().parent.parent / "hf_deep_nmt" / "sample_data" / "train.tsv"
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.split("\t")[0] for line in lines[:count]]


def tokenizer_for(size: dict):
    from hf_deep_nmt.data.tokenizer import train_joint_tokenizer

    path = Path(__file__).resolve().parent.parent / "hf_deep_nmt" / "sample_data" / "train.tsv"
    lines = path.read_text(encoding="utf-8").splitlines()[: size["tokenizer_pairs"]]
    pairs = [tuple(line.split("\t")[:2]) for line in lines]
    return train_joint_tokenizer(pairs, vocab_size=size["vocab"], min_frequency=1)


def sources(size: dict, rows: int, vocab_size: int, eos: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab_size, (rows, size["source_length"]), generator=generator)
    ids[:, -1] = eos
    return ids


def cpu_and_wall(run: Callable[[], object], repeats: int, warm_up: bool = True) -> tuple[float, float]:
    """Median process CPU seconds and wall seconds of `run`, after one warm-up (unless not `warm_up`)."""
    if warm_up:
        run()
    cpu, wall = [], []
    for _ in range(repeats):
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        run()
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    return statistics.median(cpu), statistics.median(wall)


def torch_runs(
    model, size: dict, batches: dict[str, torch.Tensor], options: dict | None = None
) -> dict[str, Callable[[], object]]:
    """`search_batch` -> a decoding of the forced length: one batch, or the batch-1 sentences one by one."""
    new = size["new_tokens"]

    forced = LogitsProcessorList([ForcedLength(model.config.eos_token_id, 1, new)])

    def generate(ids: torch.Tensor, beams: int):
        with torch.no_grad():
            return model.generate(
                ids, attention_mask=torch.ones_like(ids), num_beams=beams, do_sample=False, max_new_tokens=new,
                logits_processor=forced, **(options or {}),
            )  # fmt: skip

    runs = {}
    for search, beams in SEARCHES.items():
        runs[f"{search}_b{size['batch']}"] = lambda beams=beams: generate(batches["batch"], beams)
        runs[f"{search}_b1"] = lambda beams=beams: [generate(row[None], beams) for row in batches["single"]]
    return runs


def ct2_runs(translator, tokenizer, size: dict, batches: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    new = size["new_tokens"]
    tokens = {name: [tokenizer.convert_ids_to_tokens(row.tolist()) for row in ids] for name, ids in batches.items()}

    def translate(batch: list[list[str]], beams: int):
        return translator.translate_batch(
            batch, beam_size=beams, min_decoding_length=new, max_decoding_length=new, max_batch_size=len(batch),
        )  # fmt: skip

    runs = {}
    for search, beams in SEARCHES.items():
        runs[f"{search}_b{size['batch']}"] = lambda beams=beams: translate(tokens["batch"], beams)
        runs[f"{search}_b1"] = lambda beams=beams: [translate([row], beams) for row in tokens["single"]]
    return runs


def ort_runs(decoder, size: dict, batches: dict[str, torch.Tensor]) -> dict[str, Callable[[], object]]:
    new = size["new_tokens"]

    def decode(ids: torch.Tensor, beams: int):
        ids = ids.numpy()
        if beams == 1:
            return decoder.greedy(ids, np.ones_like(ids), max_new_tokens=new, min_new_tokens=new)
        return decoder.beam(ids, np.ones_like(ids), beams, max_new_tokens=new, min_new_tokens=new)

    runs = {}
    for search, beams in SEARCHES.items():
        runs[f"{search}_b{size['batch']}"] = lambda beams=beams: decode(batches["batch"], beams)
        runs[f"{search}_b1"] = lambda beams=beams: [decode(row[None], beams) for row in batches["single"]]
    return runs


def produced_tokens(size: dict) -> dict[str, int]:
    batch = f"b{size['batch']}"
    return {
        **{f"{search}_{batch}": size["batch"] * size["new_tokens"] for search in SEARCHES},
        **{f"{search}_b1": size["single_sentences"] * size["new_tokens"] for search in SEARCHES},
    }


def measure(runs: dict[str, Callable[[], object]], size: dict) -> dict[str, dict[str, float]]:
    tokens = produced_tokens(size)
    figures = {}
    for name, run in runs.items():
        cpu, wall = cpu_and_wall(run, size["repeats"], size["warm_up"])
        figures[name] = dict(cpu_seconds=cpu, wall_seconds=wall, tokens_per_cpu_second=tokens[name] / cpu)
    return figures


def torchao_int8(model):
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    return model


def translate_arguments(model: Path, source: Path, output: Path, new: int, backend: list[str]) -> list[str]:
    """The end-to-end rows' `hf-deep-nmt translate` arguments: 1 thread, beam 4, batch 32, `new` tokens at most."""
    arguments = ["translate", "--model", str(model), "--input", str(source), "--output", str(output)]
    options = ["--overwrite", "--threads", "1", "--no-progress", "--device", "cpu", "--num-beams", "4"]
    caps = ["--batch-size", "32", "--max-length-a", "0", "--max-length-b", str(new), "--length-penalty", "1"]
    return [*arguments, *options, *caps, *backend]


def process_seconds(arguments: list[str], repeats: int, warm_up: bool = True) -> tuple[float, float]:
    """Median CPU seconds of the whole process tree (user + system of the finished children, `RUSAGE_CHILDREN`: the
    interpreter's start, the imports, the model's loading and the decoding, as a user of the command pays them) and
    wall seconds of `hf-deep-nmt ARGUMENTS` run as a process of its own at one thread; one warm-up unless not
    `warm_up`."""
    command = [sys.executable, "-m", "hf_deep_nmt_cli", *arguments]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}

    def once() -> tuple[float, float]:
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(command, check=True, env=environment, stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
        return cpu, time.perf_counter() - start

    if warm_up:
        once()
    runs = [once() for _ in range(repeats)]
    return statistics.median(cpu for cpu, _ in runs), statistics.median(wall for _, wall in runs)


def ctranslate2_backend_figures(folder: Path, ct2_folder: Path, source: Path, size: dict, workdir: Path, ours: Path):
    """Whether `translate --backend ctranslate2` (its output in `e2e.ct2-backend`) gave the torch backend's lines
    (`ours`); where the size says `whole_process`, both backends' `translate` as processes of their own."""
    backend = workdir / "e2e.ct2-backend"
    figures = {
        "ctranslate2_backend_same_output": backend.read_text(encoding="utf-8") == ours.read_text(encoding="utf-8")
    }
    if size["whole_process"]:
        for name, flags, model in (("torch", [], folder), ("ctranslate2", ["--backend", "ctranslate2"], ct2_folder)):
            arguments = translate_arguments(model, source, workdir / f"e2e.process-{name}", size["new_tokens"], flags)
            cpu, wall = process_seconds(arguments, size["repeats"], size["warm_up"])
            figures[f"process_translate_{name}"] = dict(cpu_seconds=cpu, wall_seconds=wall)
    return figures


def end_to_end(folder: Path, ct2_folder: Path, size: dict, workdir: Path, onnx: bool = False) -> dict:
    """`hf-deep-nmt translate` against the CTranslate2 export on the same lines, both in this process at 1 thread,
    model loading included: CPU and wall seconds, and whether the outputs are the same. With `onnx` (the folder holds
    `onnx/`, `export-onnx --into-model`) also `translate --backend onnxruntime` in fp32 (against CTranslate2 fp32,
    same output expected) and int8 (against CTranslate2 int8). `translate --backend ctranslate2` on `ct2_folder`
    always; where the size says `whole_process`, the torch and CTranslate2 backends' commands as processes of their
    own (`process_seconds`)."""
    import ctranslate2
    from transformers import AutoTokenizer

    from hf_deep_nmt.cli import main as cli

    lines = sample_lines(size["lines"])
    source = workdir / "e2e.src"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ours, theirs = workdir / "e2e.ours", workdir / "e2e.ct2"
    new = size["new_tokens"]

    def translate_command(output: Path = ours, backend: list[str] = (), model: Path = folder):
        if cli(translate_arguments(model, source, output, new, list(backend))) != 0:
            raise RuntimeError(f"hf-deep-nmt translate {' '.join(backend)} failed")

    def translate_ct2(compute_type: str = "float32", output: Path = theirs):
        tokenizer = AutoTokenizer.from_pretrained(ct2_folder)
        translator = ctranslate2.Translator(
            str(ct2_folder), device="cpu", compute_type=compute_type, intra_threads=1, inter_threads=1
        )
        text = source.read_text(encoding="utf-8").split("\n")[:-1]
        encoded = [tokenizer.convert_ids_to_tokens(tokenizer(line)["input_ids"]) for line in text]
        results = translator.translate_batch(encoded, beam_size=4, max_decoding_length=new, max_batch_size=32)
        decoded = [
            tokenizer.decode(tokenizer.convert_tokens_to_ids(result.hypotheses[0]), skip_special_tokens=True)
            for result in results
        ]
        output.write_text("".join(line + "\n" for line in decoded), encoding="utf-8")

    backend_output = workdir / "e2e.ct2-backend"
    contenders = [
        ("hf_deep_nmt_translate", translate_command),
        ("ct2_fp32", translate_ct2),
        ("translate_ctranslate2", lambda: translate_command(backend_output, ["--backend", "ctranslate2"], ct2_folder)),
    ]
    onnx_fp32, onnx_int8, ct2_int8 = workdir / "e2e.onnx", workdir / "e2e.onnx-int8", workdir / "e2e.ct2-int8"
    if onnx:
        contenders += [
            ("translate_onnxruntime", lambda: translate_command(onnx_fp32, ["--backend", "onnxruntime"])),
            (
                "translate_onnxruntime_int8",
                lambda: translate_command(onnx_int8, ["--backend", "onnxruntime", "--int8"]),
            ),
            ("ct2_int8", lambda: translate_ct2("int8", ct2_int8)),
        ]
    figures = {}
    for name, run in contenders:
        cpu, wall = cpu_and_wall(run, size["repeats"], size["warm_up"])
        figures[name] = dict(cpu_seconds=cpu, wall_seconds=wall)
    figures["lines"] = len(lines)
    figures["same_output"] = ours.read_text(encoding="utf-8") == theirs.read_text(encoding="utf-8")
    figures["ratio_cpu"] = figures["hf_deep_nmt_translate"]["cpu_seconds"] / figures["ct2_fp32"]["cpu_seconds"]
    figures.update(ctranslate2_backend_figures(folder, ct2_folder, source, size, workdir, ours))
    if onnx:
        figures["onnxruntime_same_output"] = onnx_fp32.read_text(encoding="utf-8") == ours.read_text(encoding="utf-8")
        figures["onnxruntime_ratio_cpu"] = (
            figures["translate_onnxruntime"]["cpu_seconds"] / figures["ct2_fp32"]["cpu_seconds"]
        )
        figures["onnxruntime_int8_ratio_cpu"] = (
            figures["translate_onnxruntime_int8"]["cpu_seconds"] / figures["ct2_int8"]["cpu_seconds"]
        )
    return figures


def family_rows(family: str, size: dict, vocab_size: int, tokenizer, batches, workdir: Path, have: dict, skipped):
    """Row name -> its runs (`torch_runs` and the like) of one family on every backend `have` allows, at the
    precisions `have["precisions"]` names (torch's own rows are fp32 and always there); a family the CTranslate2
    exporter refuses goes to `skipped` with its reasons. Built here, timed by the caller."""
    model = family_model(family, size, vocab_size)
    rows, precisions = {}, have["precisions"]
    if have["torch"]:
        rows[f"{family} torch"] = torch_runs(model, size, batches)
    if have["ct2"] and not ctranslate2_blockers(model.config):
        import ctranslate2

        from hf_deep_nmt.serving.ctranslate2 import export_ctranslate2

        folder = export_ctranslate2(model, tokenizer, workdir / f"{family}-ct2", overwrite=True)
        for precision in precisions:
            compute_type = {"fp32": "float32", "int8": "int8"}[precision]
            translator = ctranslate2.Translator(
                str(folder), device="cpu", compute_type=compute_type, intra_threads=1, inter_threads=1
            )
            rows[f"{family} ct2_{precision}"] = ct2_runs(translator, tokenizer, size, batches)
    elif have["ct2"]:
        skipped.append(f"{family} ct2: {'; '.join(ctranslate2_blockers(model.config))}")
    if have["ort"]:
        from hf_deep_nmt.serving.onnx import OnnxDecoder, export_onnx

        folder = export_onnx(model, workdir / f"{family}-onnx", quantize=True)
        for precision in precisions:
            decoder = OnnxDecoder(folder, int8=precision == "int8", threads=1)
            rows[f"{family} ort_{precision}"] = ort_runs(decoder, size, batches)
    if have["torch_int8"] and "int8" in precisions:
        rows[f"{family} torch_int8"] = torch_runs(torchao_int8(model), size, batches)
    return rows


def measure_in_turn(contenders: dict[str, dict], size: dict, rounds: int) -> dict[str, dict[str, dict]]:
    """`measure`'s figures, the contenders taking turns: one warm-up each (as the size says), then `rounds` rounds
    in which every contender runs each of its searches once, so that a change in the machine's load falls on all of
    them alike; the median of the rounds, and every round's CPU seconds (`cpu_seconds_each`)."""
    tokens = produced_tokens(size)
    if size["warm_up"]:
        for runs in contenders.values():
            for run in runs.values():
                run()
    timings = {row: {column: [] for column in runs} for row, runs in contenders.items()}
    for _ in range(rounds):
        for row, runs in contenders.items():
            for column, run in runs.items():
                cpu_start, wall_start = time.process_time(), time.perf_counter()
                run()
                timings[row][column].append((time.process_time() - cpu_start, time.perf_counter() - wall_start))
    figures = {}
    for row, columns in timings.items():
        figures[row] = {}
        for column, pairs in columns.items():
            cpu = statistics.median(first for first, _ in pairs)
            wall = statistics.median(second for _, second in pairs)
            figures[row][column] = dict(
                cpu_seconds=cpu, wall_seconds=wall, tokens_per_cpu_second=tokens[column] / cpu,
                cpu_seconds_each=[first for first, _ in pairs],
            )  # fmt: skip
    return figures


def run(
    size_name: str,
    families: list[str],
    workdir: Path,
    backends: tuple[str, ...] = BACKENDS,
    choice: dict | None = None,
) -> dict:
    """Every row of `families` x `backends`; `choice` (`--precisions`, `--columns`, `--rounds`, all optional): only
    these precisions and searches, and with `rounds` every contender built first, then timed in turn, `rounds`
    times (`measure_in_turn`) instead of one after the other."""
    size, choice = SIZES[size_name], choice or {}
    torch.set_num_threads(1)
    tokenizer = tokenizer_for(size)
    vocab_size = len(tokenizer)
    batches = {
        "batch": sources(size, size["batch"], vocab_size, tokenizer.eos_token_id),
        "single": sources(size, size["single_sentences"], vocab_size, tokenizer.eos_token_id),
    }
    have_ct2 = "ct2" in backends and importlib.util.find_spec("ctranslate2") is not None
    have_torchao = "torch_int8" in backends and importlib.util.find_spec("torchao") is not None
    results = {
        "size": {"name": size_name, **size, "vocab_size": vocab_size},
        "load_average": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "backends": list(backends),
        "rows": {},
        "skipped": [],
    }
    if not have_torchao and "torch_int8" in backends:
        results["skipped"].append("torch_int8: torchao is not installed")
    if not have_ct2 and "ct2" in backends:
        results["skipped"].append("ct2: ctranslate2 is not installed (pip install -e '.[bench]')")
    have_ort = "ort" in backends and all(
        importlib.util.find_spec(name) is not None for name in ("onnx", "onnxscript", "onnxruntime")
    )
    if not have_ort and "ort" in backends:
        results["skipped"].append("ort: the onnx extra is not installed (pip install -e '.[onnx]')")
    elif size_name == "quick":
        have_ort = False
        results["skipped"].append("ort: not run at the quick size (each ONNX export costs several CPU seconds)")
    have = {"torch": "torch" in backends, "torch_int8": have_torchao, "ct2": have_ct2, "ort": have_ort}
    have["precisions"] = choice.get("precisions", ("fp32", "int8"))
    contenders = {}
    for family in families:
        rows = family_rows(family, size, vocab_size, tokenizer, batches, workdir, have, results["skipped"])
        for row, runs in rows.items():
            runs = {column: run for column, run in runs.items() if column in choice.get("columns", runs)}
            if choice.get("rounds"):
                contenders[row] = runs  # timed once every contender is built
            else:
                results["rows"][row] = measure(runs, size)
    if contenders:
        results["rows"] = measure_in_turn(contenders, size, choice["rounds"])
    if have_ct2 and "torch" in backends and "plain" in families:
        from hf_deep_nmt.serving.ctranslate2 import export_ctranslate2

        model = family_model("plain", size, vocab_size)
        model.save_pretrained(workdir / "plain")
        tokenizer.save_pretrained(workdir / "plain")
        export_ctranslate2(model, tokenizer, workdir / "plain-e2e-ct2", overwrite=True)
        if have_ort:
            from hf_deep_nmt.serving.onnx import export_into_model

            shutil.rmtree(workdir / "plain" / "onnx", ignore_errors=True)  # this run's scratch folder
            export_into_model(model, tokenizer, workdir / "plain", quantize=True)
        results["end_to_end"] = end_to_end(workdir / "plain", workdir / "plain-e2e-ct2", size, workdir, onnx=have_ort)
    results["load_average_at_end"] = os.getloadavg()
    return results


class ForcedLength(LogitsProcessor):
    """`</s>` barred until `new_tokens` tokens are out, in place on its column alone: transformers' min-length
    processors copy the whole scores matrix twice a step (`torch.where`), 15% of a beam-4 batch-32 decoding at the
    reduced size, work CTranslate2's `min_decoding_length` does not do; with this the forcing costs nothing."""

    def __init__(self, eos_token_id: int, prompt_length: int, new_tokens: int):
        self.eos_token_id, self.until = eos_token_id, prompt_length + new_tokens - 1

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] < self.until:
            scores[:, self.eos_token_id] = -math.inf
        return scores


# The search around the model in transformers' beam search (generation/utils.py), by function: siblings called from
# `_beam_search`, so their cumulative times do not overlap.
SEARCH_PARTS = {
    "top-k over beams x vocabulary, beam bookkeeping": (
        "_get_top_k_continuations",
        "_get_running_beams_for_next_iteration",
        "_update_finished_beams",
        "_check_early_stop_heuristic",
        "_beam_search_has_unfinished_sequences",
    ),
    "log-softmax of the logits": ("log_softmax",),
    "cache reordering (every layer's keys and values, self- and cross-attention)": ("reorder_cache",),
    "logits processors": ("LogitsProcessorList.__call__",),
    "model inputs per step": ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation"),
    "the encoder (once)": ("_prepare_text_encoder_decoder_kwargs_for_generation",),
}


def profile(family: str, size_name: str) -> dict:
    """cProfile of one beam-4 `generate()` at the size's batch: the seconds in the model's forward and in each part
    of the search around it (`SEARCH_PARTS`), and `_beam_search`'s own lines."""
    size = SIZES[size_name]
    torch.set_num_threads(1)
    vocab_size = size["vocab"]
    model = family_model(family, size, vocab_size)
    ids = sources(size, size["batch"], vocab_size, model.config.eos_token_id)
    new = size["new_tokens"]
    forced = LogitsProcessorList([ForcedLength(model.config.eos_token_id, 1, new)])

    def decode():
        with torch.no_grad():
            model.generate(ids, num_beams=4, do_sample=False, max_new_tokens=new, logits_processor=forced)

    decode()
    profiler = cProfile.Profile()
    profiler.enable()
    decode()
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO()).stats

    def cumulative(name: str, where: str = "") -> float:
        times = [entry[3] for (file, _, function), entry in stats.items() if function == name and where in file]
        return max(times, default=0.0)

    total = cumulative("generate")
    forward = cumulative("forward", "modeling_deep_nmt")
    parts = {}
    for part, names in SEARCH_PARTS.items():
        seconds = 0.0
        for name in names:
            if name == "LogitsProcessorList.__call__":
                seconds += cumulative("__call__", "logits_process")
            elif name == "log_softmax":
                seconds += cumulative("log_softmax", "functional")
            else:
                seconds += cumulative(name)
        parts[part] = seconds
    own = [entry[2] for (file, _, function), entry in stats.items() if function == "_beam_search"]
    parts["_beam_search's own lines"] = max(own, default=0.0)
    parts["the rest (generate() set-up, stopping criteria)"] = total - forward - sum(parts.values())
    return dict(
        family=family,
        size=size_name,
        batch=size["batch"],
        total_seconds=total,
        forward_seconds=forward,
        parts=parts,
    )


def print_table(results: dict) -> None:
    size = results["size"]
    batch = f"b{size['batch']}"
    columns = [f"greedy_{batch}", f"beam4_{batch}", "greedy_b1", "beam4_b1"]
    print(
        f"size {size['name']}: d {size['d_model']}, {size['layers']} + {size['layers']} layers, vocabulary "
        f"{size['vocab_size']}, {size['new_tokens']} forced output tokens; 1 thread; load average "
        f"{', '.join(f'{value:.2f}' for value in results['load_average'])} at the start, "
        f"{', '.join(f'{value:.2f}' for value in results['load_average_at_end'])} at the end, on "
        f"{results['cpu_count']} cores"
    )
    print("tokens per CPU second (wall-clock tokens per second in brackets)")
    print(f"| {'family / backend':26} | " + " | ".join(f"{column:>18}" for column in columns) + " |")
    print(f"|{'-' * 28}|" + "|".join("-" * 19 + ":" for _ in columns) + "|")
    tokens = produced_tokens(size)
    for row, figures in results["rows"].items():
        cells = []
        for column in columns:
            if column not in figures:
                cells.append("-")
                continue
            figure = figures[column]
            wall = tokens[column] / figure["wall_seconds"]
            cells.append(f"{figure['tokens_per_cpu_second']:>8.1f} ({wall:>7.1f})")
        print(f"| {row:26} | " + " | ".join(f"{cell:>18}" for cell in cells) + " |")
    e2e = results.get("end_to_end")
    if e2e:
        ours, ct2 = e2e["hf_deep_nmt_translate"], e2e["ct2_fp32"]
        print(
            f"end to end, {e2e['lines']} lines, beam 4, 1 thread: hf-deep-nmt translate "
            f"{ours['cpu_seconds']:.2f} CPU s "
            f"({ours['wall_seconds']:.2f} s wall), CTranslate2 fp32 {ct2['cpu_seconds']:.2f} CPU s "
            f"({ct2['wall_seconds']:.2f} s wall): {e2e['ratio_cpu']:.2f}x; same output: {e2e['same_output']}"
        )
        if "translate_onnxruntime" in e2e:
            fp32, int8, ct2_int8 = e2e["translate_onnxruntime"], e2e["translate_onnxruntime_int8"], e2e["ct2_int8"]
            print(
                f"end to end, translate --backend onnxruntime {fp32['cpu_seconds']:.2f} CPU s "
                f"({fp32['wall_seconds']:.2f} s wall): {e2e['onnxruntime_ratio_cpu']:.2f}x CTranslate2 fp32, same "
                f"output as the torch backend: {e2e['onnxruntime_same_output']}; "
                f"--int8 {int8['cpu_seconds']:.2f} CPU s "
                f"({int8['wall_seconds']:.2f} s wall) against CTranslate2 int8 {ct2_int8['cpu_seconds']:.2f} CPU s "
                f"({ct2_int8['wall_seconds']:.2f} s wall): {e2e['onnxruntime_int8_ratio_cpu']:.2f}x"
            )
        backend = e2e["translate_ctranslate2"]
        print(
            f"end to end, translate --backend ctranslate2 {backend['cpu_seconds']:.2f} CPU s "
            f"({backend['wall_seconds']:.2f} s wall), same output as the torch backend: "
            f"{e2e['ctranslate2_backend_same_output']}"
        )
        for name in ("torch", "ctranslate2"):
            if f"process_translate_{name}" in e2e:
                figure = e2e[f"process_translate_{name}"]
                print(
                    f"whole process, hf-deep-nmt translate --backend {name}: {figure['cpu_seconds']:.2f} CPU s of "
                    f"the process tree ({figure['wall_seconds']:.2f} s wall)"
                )
    for skipped in results["skipped"]:
        print(f"skipped: {skipped}")


def print_ratios(results: dict) -> None:
    """Each ONNX Runtime row's tokens per CPU second over the plain model's at the same precision and over
    CTranslate2's at that precision (the family's own export where it has one, else the plain model's)."""
    rows = results["rows"]
    for precision in ("fp32", "int8"):
        plain_ort, plain_ct2 = rows.get(f"plain ort_{precision}"), rows.get(f"plain ct2_{precision}")
        if plain_ort is None or plain_ct2 is None:
            continue
        print(f"ONNX Runtime {precision}: / plain ORT {precision}, / CTranslate2 {precision} (own export in brackets)")
        for row, figures in rows.items():
            if not row.endswith(f" ort_{precision}"):
                continue
            family = row.split()[0]
            own = rows.get(f"{family} ct2_{precision}")
            cells = []
            for column, figure in figures.items():
                speed = figure["tokens_per_cpu_second"]
                cell = f"{column} {speed / plain_ort[column]['tokens_per_cpu_second']:.2f}"
                cell += f" / {speed / plain_ct2[column]['tokens_per_cpu_second']:.2f}"
                if own is not None and family != "plain":
                    cell += f" ({speed / own[column]['tokens_per_cpu_second']:.2f})"
                cells.append(cell)
            print(f"  {family:18} " + "; ".join(cells))


def print_profile(figures: dict) -> None:
    total, forward = figures["total_seconds"], figures["forward_seconds"]
    what = f"beam 4, batch {figures['batch']}, {figures['family']} ({figures['size']})"
    print(f"{what}: generate() {total:.3f} s under cProfile")
    print("| part | seconds | share of generate() |\n|---|---:|---:|")
    print(f"| model forward | {forward:.3f} | {forward / total:.1%} |")
    for part, seconds in sorted(figures["parts"].items(), key=lambda item: -item[1]):
        print(f"| {part} | {seconds:.3f} | {seconds / total:.1%} |")


# ---- whole processes: `hf-deep-nmt translate` on real lines, as a user runs it ------------------------------------

TRANSLATE_BACKENDS = {
    "torch": [],
    "ort_fp32": ["--backend", "onnxruntime"],
    "ort_int8": ["--backend", "onnxruntime", "--int8"],
}
# the CTranslate2 contenders of the end-to-end table: `translate_batch` on the model's CTranslate2 export, no
# hf-deep-nmt code in the process (`_CT2_CHILD`), by the compute type each loads the export with
CT2_COMPUTE_TYPES = {"ct2_fp32": "float32", "ct2_int8": "int8"}
# the runtime each `translate` contender imports before it loads its decoder: imported first in `_MEASURED_CHILD`, so
# that its libraries count with the imports and not with the loaded decoder, as `ctranslate2` does in `_CT2_CHILD`
_RUNTIMES = {"torch": "torch", "ort_fp32": "onnxruntime", "ort_int8": "onnxruntime"}
# the same precision's CTranslate2 contender, which the goal compares each `translate` contender with
_SAME_PRECISION = {"torch": "ct2_fp32", "ort_fp32": "ct2_fp32", "ort_int8": "ct2_int8"}
# resident and peak memory of the child reading it (MB, from /proc/self/status); both children define it
_MEMORY = """
def memory():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}
"""
# `hf-deep-nmt translate ARGS` as `python -m hf_deep_nmt_cli` runs it, with the resident memory recorded before and
# after its decoder is loaded and once the output is written, the decoder kept alive to then: the memory of a loaded
# decoder after its decodings, above the imports. The records are two reads of a small file: no measurable CPU.
_MEASURED_CHILD = (
    _MEMORY
    + """
import json, sys
record, runtime = sys.argv[1], sys.argv[2]
__import__(runtime)
import hf_deep_nmt_cli
from hf_deep_nmt import cli
marks, kept, locate = {}, [], cli._locate_decoder
def located(*args, **kwargs):
    load = locate(*args, **kwargs)
    def measured_load():
        marks["before_load"] = memory()
        kept.append(load())
        marks["loaded"] = memory()
        return kept[-1]
    return measured_load
cli._locate_decoder = located
sys.argv = ["hf-deep-nmt", *sys.argv[3:]]
code = hf_deep_nmt_cli.main()
marks["end"] = memory()
json.dump(marks, open(record, "w"))
sys.exit(code)
"""
)
# CTranslate2 as its own users run it: the `tokenizers` tokenizer of the export (its tokenizer.json: the same pieces
# and ids as the model's tokenizer), `translate_batch` with translate's settings (beam, cap, batches of the same
# number of sentences: both sort the lines by length first), the detokenized best hypotheses written out
_CT2_CHILD = (
    _MEMORY
    + """
import json, sys
import ctranslate2, tokenizers
record, folder, compute_type, threads, source, output, beams, cap, batch = sys.argv[1:]
marks = {"before_load": memory()}
tokenizer = tokenizers.Tokenizer.from_file(folder + "/tokenizer.json")
translator = ctranslate2.Translator(
    folder, device="cpu", compute_type=compute_type, intra_threads=int(threads), inter_threads=1
)
marks["loaded"] = memory()
lines = open(source, encoding="utf-8").read().splitlines()
pieces = [tokenizer.encode(line).tokens for line in lines]
results = translator.translate_batch(
    pieces, beam_size=int(beams), max_decoding_length=int(cap), max_batch_size=int(batch)
)
ids = [[tokenizer.token_to_id(piece) for piece in result.hypotheses[0]] for result in results]
text = [tokenizer.decode(row, skip_special_tokens=True) for row in ids]
open(output, "w", encoding="utf-8").write("".join(line + "\\n" for line in text))
marks["end"] = memory()
json.dump(marks, open(record, "w"))
"""
)
# the sentences of one batch: `translate`'s default `--batch-size`, and CTranslate2's `max_batch_size`
E2E_BATCH = 64
# what one whole-process profile adds up, by the functions its time is spent under (cumulative, not nested in another)
PROFILE_PARTS = {
    "imports (module code included)": [("", "_find_and_load")],
    "loading the graphs or the model": [("onnxruntime_inference_collection", "__init__"), ("", "from_pretrained")],
    "tokenization, batching, detokenization": [("translate.py", "iter_translations"), ("", "batch_decode")],
    "session runs (start and step graphs)": [
        ("onnxruntime_inference_collection", "run"),
        ("onnxruntime_inference_collection", "run_with_iobinding"),
    ],
    "cache handling (repeat, reorder, drop rows)": [
        ("~", "<method 'take' of 'numpy.ndarray' objects>"),
        ("~", "<method 'repeat' of 'numpy.ndarray' objects>"),
    ],
    "search bookkeeping (top-k, finished beams, log-softmax)": [
        ("onnx.py", "advance"),
        ("", "<built-in method torch.log_softmax>"),
    ],
    "torch generate() (the torch backend's decoding)": [("", "generate")],
}
_PROFILED_CHILD = """
import cProfile, sys, time
profile = cProfile.Profile()  # wall clock: a CPU-time timer is a system call per event, which swamps the profile
sys.argv = ["hf-deep-nmt", *sys.argv[2:]]
profile.enable()
from hf_deep_nmt_cli import main
code = main()
profile.disable()
profile.dump_stats(OUT)
sys.exit(code)
"""


def whole_process_arguments(
    model: Path, lines: Path, output: Path, backend: str, beams: int, cap: int, threads: int = 1
) -> list[str]:
    """`hf-deep-nmt translate`'s arguments for one whole-process run: `threads` threads, beam `beams`, every output
    capped at `cap` tokens whatever its source's length (CTranslate2's `max_decoding_length`: the same cap on both
    sides), the batches of its defaults."""
    return [
        "translate", "--model", str(model), "--input", str(lines), "--output", str(output), "--overwrite",
        "--threads", str(threads), "--no-progress", "--num-beams", str(beams), "--max-length-a", "0",
        "--max-length-b", str(cap), "--max-output-tokens", str(cap), "--batch-size", str(E2E_BATCH),
        *TRANSLATE_BACKENDS[backend],
    ]  # fmt: skip


def child_seconds(command: list[str], env: dict) -> dict:
    """User and system CPU seconds of `command` and every process it starts (the waited-for process tree:
    `RUSAGE_CHILDREN`), and its wall seconds."""
    import resource
    import subprocess

    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - start
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    return dict(cpu_seconds=user + system, user_seconds=user, system_seconds=system, wall_seconds=wall)


def contender_command(contender: str, setting: dict, output: Path, record: Path) -> list[str]:
    """The command line of one whole-process run: `contender` is `LABEL BACKEND` of a `translate` contender (under
    `setting["codes"][LABEL]`) or a key of `CT2_COMPUTE_TYPES`; the child writes its memory marks to `record`."""
    if contender in CT2_COMPUTE_TYPES:
        folder = setting["ct2"][contender]
        values = [folder, CT2_COMPUTE_TYPES[contender], setting["threads"], setting["lines"], output]
        values += [setting["beams"], setting["cap"], E2E_BATCH]
        return [sys.executable, "-P", "-c", _CT2_CHILD, str(record), *map(str, values)]
    backend = contender.split()[-1]
    arguments = whole_process_arguments(
        setting["model"], setting["lines"], output, backend, setting["beams"], setting["cap"], setting["threads"]
    )
    # -P: the working folder stays off the child's import path, which would otherwise come before PYTHONPATH and run
    # the checkout the benchmark is started from under every label (`--before` measured this code twice)
    return [sys.executable, "-P", "-c", _MEASURED_CHILD, str(record), _RUNTIMES[backend], *arguments]


def run_contender(contender: str, setting: dict, workdir: Path) -> dict:
    """One whole-process run of `contender` at `setting["threads"]` threads (OMP_NUM_THREADS too): its process
    tree's CPU seconds (`child_seconds`) and its memory marks (MB: resident after the imports, after loading, at the
    end with the decoder still alive; the peak)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(setting["threads"])}
    label = contender.split()[0]
    code = setting["codes"].get(label)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    name = contender.replace(" ", ".")
    output, record = workdir / f"{name}.t{setting['threads']}.txt", workdir / f"{name}.t{setting['threads']}.json"
    seconds = child_seconds(contender_command(contender, setting, output, record), env)
    marks = json.loads(record.read_text())
    imports = marks["before_load"]["VmRSS"]
    memory = dict(
        imports_mb=imports,
        loaded_mb=marks["loaded"]["VmRSS"] - imports,
        after_decoding_mb=marks["end"]["VmRSS"] - imports,
        peak_mb=marks["end"]["VmHWM"],
    )
    return {**seconds, **memory}


def differing_lines(output: Path, reference: Path) -> int:
    """How many lines of `output` differ from `reference`'s (both the same number of lines)."""
    ours, theirs = output.read_text(encoding="utf-8").splitlines(), reference.read_text(encoding="utf-8").splitlines()
    return sum(a != b for a, b in zip(ours, theirs, strict=True))


def whole_process(model: Path, lines: Path, workdir: Path, setting: dict, repeats: int) -> dict:
    """Every backend of `TRANSLATE_BACKENDS` under every code tree of `setting["codes"]` (label -> a checkout put
    first on PYTHONPATH, or None: the installed package) as whole `hf-deep-nmt translate` processes, and each
    CTranslate2 export of `setting["ct2"]` (contender -> folder) through `translate_batch`, at each thread count of
    `setting["threads"]`, `repeats` rounds, every contender once per round in turn (alternating: a change of the
    machine's load falls on all alike; `setting["only"]`: these kinds only, in this order); median seconds and memory
    per contender and thread count, how many of its lines differ from the first contender's (torch's), and each
    `translate` contender's ratio to the same precision's CTranslate2 (`_SAME_PRECISION`)."""
    contenders = [f"{label} {backend}" for backend in TRANSLATE_BACKENDS for label in setting["codes"]]
    contenders += list(setting["ct2"])
    if "only" in setting:
        contenders = [name for kind in setting["only"] for name in contenders if name.split()[-1] == kind]
    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(repeats):
        for threads in setting["threads"]:
            for contender in contenders:
                figures = run_contender(contender, {**setting, "model": model, "threads": threads}, workdir)
                runs.setdefault((contender, threads), []).append(figures)
                print(f"{contender} at {threads} threads: {json.dumps(figures)}", flush=True)
    return whole_process_figures(lines, workdir, setting, contenders, runs)


def whole_process_figures(lines: Path, workdir: Path, setting: dict, contenders: list[str], runs: dict) -> dict:
    """`whole_process`'s result from its `runs` ((contender, threads) -> the figures of each run)."""
    figures = {"lines": sum(1 for _ in lines.open(encoding="utf-8")), "beams": setting["beams"], "cap": setting["cap"]}
    figures["load_average"], figures["rows"] = os.getloadavg(), {}
    reference = contenders[0].replace(" ", ".")
    for (contender, threads), measured in runs.items():
        median = {key: statistics.median(run[key] for run in measured) for key in measured[0]}
        output = workdir / f"{contender.replace(' ', '.')}.t{threads}.txt"
        differing = differing_lines(output, workdir / f"{reference}.t{threads}.txt")
        row = {**median, "cpu_seconds_each": [run["cpu_seconds"] for run in measured], "lines_differing": differing}
        figures["rows"][f"{contender} t{threads}"] = {"contender": contender, "threads": threads, **row}
    for row in figures["rows"].values():
        same = _SAME_PRECISION.get(row["contender"].split()[-1])
        baseline = figures["rows"].get(f"{same} t{row['threads']}")
        if baseline is not None:
            row["ratio_to_ct2"] = row["cpu_seconds"] / baseline["cpu_seconds"]
    return figures


def profile_translate(model: Path, lines: Path, workdir: Path, backend: str, beams: int = 4, cap: int = 64) -> dict:
    """One whole `hf-deep-nmt translate` process profiled (cProfile), its seconds scaled to the process's CPU
    seconds (a CPU-bound process on a shared machine waits in proportion to the time it runs) and summed into
    `PROFILE_PARTS` (for each name of a part, the largest cumulative time among the functions of that name, so that
    one under another is not counted twice); the rest, and system time from rusage, beside. The profiler's own cost
    falls mostly on the imports (many small calls): time them alone too."""
    stats_file = workdir / f"translate-{backend}.prof"
    child = _PROFILED_CHILD.replace("OUT", repr(str(stats_file)))
    arguments = whole_process_arguments(model, lines, workdir / f"profiled.{backend}.txt", backend, beams, cap)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    measured = child_seconds([sys.executable, "-P", "-c", child, "hf-deep-nmt", *arguments], env)
    stats = pstats.Stats(str(stats_file)).stats
    parts = {}
    for part, functions in PROFILE_PARTS.items():
        parts[part] = sum(
            max((value[3] for key, value in stats.items() if where in key[0] and key[2] == name), default=0.0)
            for where, name in functions
        )
    scale = measured["cpu_seconds"] / sum(value[2] for value in stats.values())
    parts = {part: seconds * scale for part, seconds in parts.items()}
    return {"backend": backend, "profiled_seconds": measured["cpu_seconds"], "parts": parts, "process": measured}


def print_whole_process(figures: dict) -> None:
    print(f"\n{figures['lines']} lines, beam {figures['beams']}, cap {figures['cap']}, whole process")
    print(f"load average at the end: {', '.join(f'{value:.2f}' for value in figures['load_average'])}")
    print(
        "| contender | threads | CPU s (median; each run) | user s | system s | wall s | / CT2 same precision | "
        "imports MB | decoder after decoding MB | peak MB | lines differing from the first contender's |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in figures["rows"].values():
        each = ", ".join(f"{seconds:.2f}" for seconds in row["cpu_seconds_each"])
        ratio = f"{row['ratio_to_ct2']:.2f}x" if "ratio_to_ct2" in row else ""
        print(
            f"| {row['contender']} | {row['threads']} | {row['cpu_seconds']:.2f} ({each}) | {row['user_seconds']:.2f}"
            f" | {row['system_seconds']:.2f} | {row['wall_seconds']:.1f} | {ratio} | {row['imports_mb']:.0f} | "
            f"{row['after_decoding_mb']:.0f} | {row['peak_mb']:.0f} | {row['lines_differing']} |"
        )


def print_translate_profile(figures: dict) -> None:
    total = figures["profiled_seconds"]
    print(f"\n`translate` ({figures['backend']}), profiled CPU seconds {total:.2f}; process: {figures['process']}")
    print("| part | CPU s | share |")
    print("|---|---:|---:|")
    for part, seconds in figures["parts"].items():
        print(f"| {part} | {seconds:.2f} | {seconds / total:.0%} |")
    rest = total - sum(figures["parts"].values())
    print(f"| the rest | {rest:.2f} | {rest / total:.0%} |")


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--quick", action="store_true", help="the same as --size quick: tiny, one repeat (CI)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument(
        "--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="measure only these (default: all)"
    )
    parser.add_argument("--profile", choices=FAMILIES, default=None, help="profile one family's beam search instead")
    parser.add_argument(
        "--precisions", nargs="+", choices=("fp32", "int8"), default=None, help="only these rows (default: both)"
    )
    parser.add_argument(
        "--columns", nargs="+", default=None, help="only these searches (greedy_b32, beam4_b32, greedy_b1, beam4_b1)"
    )
    parser.add_argument(
        "--rounds", type=int, default=0, help="build every contender, then time them in turn this many rounds"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    parser.add_argument("--workdir", type=Path, default=None, help="where the exports are written (default: a temp)")
    parser.add_argument("--end-to-end", type=Path, default=None, metavar="MODEL", help="whole translate processes")
    parser.add_argument("--profile-translate", type=Path, default=None, metavar="MODEL", help="profile one of them")
    parser.add_argument(
        "--lines", type=Path, default=None, help="the source lines of --end-to-end/--profile-translate"
    )
    parser.add_argument("--before", type=Path, default=None, help="--end-to-end: also this checkout's code")
    parser.add_argument("--backend", choices=sorted(TRANSLATE_BACKENDS), default="ort_fp32")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="--end-to-end: at each of these")
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=[*TRANSLATE_BACKENDS, *CT2_COMPUTE_TYPES],
        default=None,
        help="--end-to-end: only these, in this order (default: every one)",
    )
    parser.add_argument(
        "--ct2", type=Path, default=None, help="--end-to-end: the CTranslate2 export (default: MODEL/ctranslate2)"
    )
    parser.add_argument(
        "--ct2-int8", type=Path, default=None, help="--end-to-end: the int8 one, loaded as int8 (default: --ct2's)"
    )
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = arguments().parse_args(argv)
    if args.end_to_end or args.profile_translate:
        return whole_process_main(args)
    size = "quick" if args.quick else args.size
    threads = torch.get_num_threads()
    try:
        if args.profile:
            results = profile(args.profile, size)
            print_profile(results)
        else:
            with contextlib.ExitStack() as stack:
                workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
                choice = {"rounds": args.rounds}
                choice.update({key: value for key in ("precisions", "columns") if (value := getattr(args, key))})
                results = run(size, args.families, workdir, tuple(args.backends), choice)
            print_table(results)
            print_ratios(results)
    finally:
        torch.set_num_threads(threads)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


def ct2_folders(args) -> dict[str, Path]:
    """The CTranslate2 contenders of `--end-to-end` and their exports: `--ct2` (or MODEL/ctranslate2, where
    `export-ctranslate2 --into-model` writes it) loaded as float32, `--ct2-int8` (or the same) as int8; none
    without an export or without ctranslate2."""
    fp32 = args.ct2 or args.end_to_end / "ctranslate2"
    if not (fp32 / "model.bin").is_file() or importlib.util.find_spec("ctranslate2") is None:
        return {}
    return {"ct2_fp32": fp32, "ct2_int8": args.ct2_int8 or fp32}


def whole_process_main(args) -> dict:
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        workdir.mkdir(parents=True, exist_ok=True)
        if args.profile_translate:
            results = profile_translate(args.profile_translate, args.lines, workdir, args.backend)
            print_translate_profile(results)
        else:
            codes = {"before": args.before, "after": None} if args.before else {"this": None}
            setting = dict(codes=codes, ct2=ct2_folders(args), threads=args.threads, lines=args.lines, beams=4, cap=64)
            if args.contenders:
                setting["only"] = args.contenders
            results = whole_process(args.end_to_end, args.lines, workdir, setting, args.repeats)
            print_whole_process(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
