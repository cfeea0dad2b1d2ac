"""Speed and memory of this package's models against Hugging Face's Marian and CTranslate2, measured in one run.

Contenders at equal sizes (base by default: d 512, FFN 2048, 8 heads, 6 + 6 layers, 32k vocabulary, random
weights):

* ``own_multi_head``: `DeepNMTForConditionalGeneration`, pre-norm, multi-head decoder self-attention;
* ``own_matt``: the same with merged attention (``decoder_self_attention="merged_average"``);
* ``hf_marian``: `MarianMTModel` built from the same sizes (post-norm, as Marian is);
* ``ctranslate2``: a CTranslate2 conversion of that Marian model (decoding only; skipped when the optional
  ``ctranslate2`` package is not installed: ``pip install -e ".[bench]"``).

Figures (every output is forced to the same length so that all contenders do equal work):

* training: target tokens/s of one step (forward + backward + Adam step) on batch x length tokens, and the FLOP/s
  of that step (counted once with `torch.utils.flop_counter`) against the machine's measured fp32 GEMM peak;
* decoding: target tokens/s of cached greedy and beam-4 search, batch 32, 24-token sources, 24 output tokens;
* peak memory: extra resident memory of one step / one beam-4 decoding, each in a fresh process;
* deep stacks: training step time of dense DLCL-48L against plain pre-norm 48L, and of plain 24L against 48L, and
  the bytes saved for backward of plain and DLCL stacks;
* operators: ATen operator calls and autograd nodes per training step of plain and DLCL stacks (counts);
* throughput: tokens/s, MFU and peak memory of own vs HF Marian training through `DeepNMTTrainer` with token-budget
  batches (bf16 on CUDA, fp32 on CPU), and of own with the plain loss on the whole logits (no chunks); on a CPU also
  profiled steps of own and of Marian on each budget's batch (medians): the seconds in matrix products and the rest,
  and the ceiling of own / Marian if own's step were its matrix products alone (Marian's step / own's products);
* compiled: decoding with the static cache and a compiled forward (what `translate --compile` does) against eager
  decoding with the dynamic cache, at batch 1 greedy and batch 64 beam 4, for multi-head and MAtt decoders, and
  compiled against eager training steps (pre-norm and DLCL); bf16 on CUDA (`--device cuda`), fp32 on CPU. The bytes
  a batch-1 decoding step reads (`decoding_step_bytes`) give the MAtt / multi-head target;
* matt: merged attention against multi-head decoder self-attention in otherwise identical post-norm models:
  generate() tokens/s at beam 4 and greedy, and the time of one cached step of the decoder stack alone (no output
  layer, no search) over batch x 4 rows, the part MAtt changes;
* msc: generate() tokens/s at beam 4 and greedy of a pre-norm baseline (as many encoder as decoder layers), a plain
  encoder as deep as the MSC one, and MSC (one block of `msc_block_layers` layers per decoder layer, GRU context,
  gated fusion): 6, 36 and 6 x 6 encoder layers at base size.

Contenders alternate (A, B, C, A, B, C, ...) after one warm-up each and medians are reported, since a shared
machine is noisy. One command prints the table and writes JSON:

    python benchmarks/perf.py                  # base sizes, writes benchmarks/results/perf.json
    python benchmarks/perf.py --smoke          # tiny sizes, one repeat: checks that it runs (CI); = --size smoke
    python benchmarks/perf.py --sections compiled --device cuda   # compiled decoding on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import MarianConfig, MarianMTModel

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration, MscConfig, MscForConditionalGeneration
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTEncoderOutput, decoding_state

SIZES = {
    "base": dict(
        d_model=512,
        ffn=2048,
        heads=8,
        layers=6,
        vocab=32000,
        train_batch=64,
        train_length=32,
        batch=32,
        source_length=24,
        new_tokens=24,
        deep_d_model=512,
        deep_ffn=2048,
        deep_heads=8,
        deep_batch=16,
        deep_length=32,
        deep_layers=(24, 48),
        repeats=3,
        gemm=2048,
        budgets=(8192, 16384, 32768),
        pair_length=32,
        deep_memory=dict(layers=24, d_model=128, batch=32, length=40),
        throughput_steps=3,
        compiled_beam_batch=64,
        msc_block_layers=6,
    ),
    "smoke": dict(
        d_model=32,
        ffn=64,
        heads=4,
        layers=2,
        vocab=200,
        train_batch=4,
        train_length=8,
        batch=4,
        source_length=6,
        new_tokens=5,
        deep_d_model=32,
        deep_ffn=64,
        deep_heads=4,
        deep_batch=2,
        deep_length=8,
        deep_layers=(2, 4),
        repeats=1,
        gemm=128,
        budgets=(64, 128),
        pair_length=8,
        deep_memory=dict(layers=4, d_model=32, batch=2, length=8),
        throughput_steps=2,
        compiled_beam_batch=4,
        msc_block_layers=2,
    ),
}
PAD, BOS, EOS = 1, 0, 2
DECODERS = ("own_multi_head", "own_matt", "hf_marian", "ctranslate2")


# ----------------------------------------------------------------------------------------------------- contenders
def own_model(
    size: dict,
    *,
    self_attention: str = "multi_head",
    layers: int | None = None,
    aggregation: str = "residual",
    pre_norm: bool = True,
    block_layers: int | None = None,
) -> DeepNMTForConditionalGeneration:
    """This package's model at `size`; `layers` encoder layers (default: as many as decoder layers), or with
    `block_layers` an MSC model whose encoder has one block of that many layers per decoder layer."""
    torch.manual_seed(0)
    config_class, model_class = (
        (MscConfig, MscForConditionalGeneration) if block_layers else (DeepNMTConfig, DeepNMTForConditionalGeneration)
    )
    extra = {"msc_block_layers": block_layers} if block_layers else {}
    config = config_class(
        vocab_size=size["vocab"],
        d_model=size["d_model"],
        encoder_ffn_dim=size["ffn"],
        decoder_ffn_dim=size["ffn"],
        encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"],
        encoder_layers=layers or size["layers"] * (block_layers or 1),
        decoder_layers=size["layers"],
        pre_norm=pre_norm,
        layer_aggregation=aggregation,
        decoder_self_attention=self_attention,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=BOS,
        **extra,
    )
    return model_class(config)


def marian_model(size: dict) -> MarianMTModel:
    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=size["vocab"],
        decoder_vocab_size=size["vocab"],
        d_model=size["d_model"],
        encoder_ffn_dim=size["ffn"],
        decoder_ffn_dim=size["ffn"],
        encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"],
        encoder_layers=size["layers"],
        decoder_layers=size["layers"],
        max_position_embeddings=max(256, size["source_length"] + size["new_tokens"] + 8),
        activation_function="relu",
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        # Marian's convention, which CTranslate2's converter expects: <pad> is the last id and starts the decoder.
        pad_token_id=size["vocab"] - 1,
        eos_token_id=EOS,
        bos_token_id=BOS,
        decoder_start_token_id=size["vocab"] - 1,
        forced_eos_token_id=None,
    )
    return MarianMTModel(config)


def decoding_model(kind: str, size: dict, workdir: Path):
    if kind == "own_multi_head":
        return own_model(size).eval()
    if kind == "own_matt":
        return own_model(size, self_attention="merged_average").eval()
    marian = marian_model(size).eval()
    if kind == "hf_marian":
        return marian
    return ctranslate2_translator(marian, size, workdir)


def ctranslate2_available() -> bool:
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return False
    return True


def ctranslate2_translator(marian: MarianMTModel, size: dict, workdir: Path):
    """Convert the Marian model to CTranslate2 (fp32). Token `i` of the vocabulary is the string `t{i}`; the last id
    is `<pad>`, which CTranslate2 drops (its decoder starts from a zero embedding, as Marian's does)."""
    import ctranslate2
    from ctranslate2.converters.transformers import TransformersConverter
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    source = workdir / "marian"
    output = workdir / "ctranslate2"
    if not (output / "model.bin").is_file():
        marian.save_pretrained(source)
        pad = size["vocab"] - 1
        vocab = {f"t{i}": i for i in range(pad) if i not in (BOS, EOS)}
        vocab.update({"<s>": BOS, "</s>": EOS, "<pad>": pad})
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t3")),
            bos_token="<s>",
            pad_token="<pad>",
            eos_token="</s>",
            unk_token="t3",
        )
        tokenizer.save_pretrained(source)
        TransformersConverter(str(source)).convert(str(output), quantization="float32", force=True)
    return ctranslate2.Translator(str(output), device="cpu", inter_threads=1, intra_threads=torch.get_num_threads())


# ----------------------------------------------------------------------------------------------------- measures
def alternate(measures: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Warm every contender up once, then run them in turn `repeats` times; seconds per run."""
    for measure in measures.values():
        measure()
    timings: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(repeats):
        for name, measure in measures.items():
            timings[name].append(measure())
    return timings


def training_batch(size: dict, batch: int, length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(4, size["vocab"] - 1, (batch, length), generator=generator)
    labels = torch.randint(4, size["vocab"] - 1, (batch, length), generator=generator)
    return {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": labels}


def training_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Callable[[], float]:
    model.train()
    # fused, as the Trainer's default optimizer (`adamw_torch_fused` from torch 2.8) steps every recipe's model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step() -> float:
        started = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    return step


def forward_flops_parts(
    size: dict, batch: int, source_length: int, target_length: int, encoder_layers: int
) -> tuple[int, int]:
    """Matrix-product FLOPs of one forward pass of a multi-head encoder-decoder of these sizes (2 per
    multiply-add): (projections, FFN and output layer; the two products of every attention)."""
    d, f, v, decoder_layers = size["d_model"], size["ffn"], size["vocab"], size["layers"]
    source, target = batch * source_length, batch * target_length
    layer = 4 * d * d + 2 * d * f  # Q, K, V, O and the FFN
    linear = source * encoder_layers * layer + target * decoder_layers * (layer + 2 * d * d) + target * d * v
    linear += source * decoder_layers * 2 * d * d  # cross-attention K and V, on the encoder output
    attention = (
        2
        * batch
        * d
        * (encoder_layers * source_length**2 + decoder_layers * (target_length**2 + target_length * source_length))
    )
    return 2 * linear, 2 * attention


def forward_flops(size: dict, batch: int, source_length: int, target_length: int, encoder_layers: int) -> int:
    return sum(forward_flops_parts(size, batch, source_length, target_length, encoder_layers))


def training_flops(size: dict, batch: int, source_length: int, target_length: int, encoder_layers: int) -> int:
    """Forward + backward: the backward pass costs two forward passes (gradients of inputs and of weights)."""
    return 3 * forward_flops(size, batch, source_length, target_length, encoder_layers)


def counted_forward_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """FLOPs of one forward pass as `torch.utils.flop_counter` counts them, by operator (`"aten.mm"`, ...). Which
    operators the counter has a rule for depends on the torch release: torch 2.13 has none for the fused CPU attention
    kernel (so only the other matrix products are counted), later releases count that kernel too."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**batch)
    return {str(operator): flops for operator, flops in counter.get_flop_counts()["Global"].items()}


def gemm_peak(n: int, repeats: int) -> float:
    """Measured fp32 matrix-multiply FLOP/s (n x n by n x n), the best of `repeats` timed runs of 5 products."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(max(3, repeats)):
        started = time.perf_counter()
        for _ in range(5):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - started) / 5)
    return 2 * n**3 / best


def matmul_peak(n: int, repeats: int, device: torch.device, dtype: torch.dtype) -> float:
    """Measured matrix-multiply FLOP/s on `device` in `dtype`: `gemm_peak` on CPU, the best of timed runs of 20
    synchronised products on CUDA."""
    if device.type != "cuda":
        return gemm_peak(n, repeats)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(max(3, repeats)):
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b)
        torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - started) / 20)
    return 2 * n**3 / best


def operator_calls(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """ATen operator calls (every `aten::` event `torch.profiler` records, nested ones included) and autograd nodes
    of one training step (forward, backward, fused Adam step), counted after one step that creates Adam's state.
    Counts, not times: the same for every run of the same code."""
    from torch.profiler import ProfilerActivity, profile

    step = training_step(model, batch)
    step()
    loss = model(**batch).loss
    nodes, pending = set(), [loss.grad_fn]
    while pending:
        node = pending.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            pending.extend(next_node for next_node, _ in node.next_functions)
    del loss
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step()
    calls = sum(1 for event in profiler.events() if event.name.startswith("aten::"))
    return {"aten_calls": calls, "autograd_nodes": len(nodes)}


MATRIX_PRODUCTS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")


def step_anatomy(models: dict[str, torch.nn.Module], batch: dict[str, torch.Tensor], repeats: int) -> dict:
    """Seconds of profiled CPU training steps (forward, backward, fused Adam step; after one step that creates Adam's
    state), the models alternating `repeats` times, and the seconds of each spent in matrix products (the self CPU
    time of `MATRIX_PRODUCTS`); medians of both. On a CPU an operator's CPU time is its run time, so the rest is
    everything else: attention, norms, dropout, the loss's elementwise work, the optimizer, the framework. Both
    include the profiler's own overhead."""
    from torch.profiler import ProfilerActivity, profile

    products: dict[str, list[float]] = {name: [] for name in models}

    def profiled(name: str, step: Callable[[], float]) -> Callable[[], float]:
        def run() -> float:
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                seconds = step()
            events = profiler.events()
            products[name].append(sum(event.self_cpu_time_total for event in events if event.name in MATRIX_PRODUCTS))
            return seconds

        return run

    seconds = alternate({name: profiled(name, training_step(model, batch)) for name, model in models.items()}, repeats)
    return {  # `alternate`'s warm-up step is profiled too: its products are left out, as its seconds are
        name: {
            "seconds": statistics.median(seconds[name]),
            "matrix_product_seconds": statistics.median(products[name][1:]) / 1e6,
        }
        for name in models
    }


def saved_for_backward_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward in one training forward pass (each storage once,
    however many saved tensors view it)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch).loss
    del loss
    return sum(storages.values())


def decode(
    kind: str, model, source: torch.Tensor, beams: int, new_tokens: int, backend: str | None = None
) -> Callable[[], float]:
    """One timed decoding of `source`, every output forced to `new_tokens`. PyTorch contenders: eager with the dynamic
    cache, or with `backend` the static cache and the compiled forward of `translate --compile`."""
    if kind == "ctranslate2":
        tokens = [[f"t{i}" for i in row[:-1]] for row in source.tolist()]  # CTranslate2 appends </s> itself

        def run() -> float:
            started = time.perf_counter()
            results = model.translate_batch(
                tokens,
                beam_size=beams,
                max_batch_size=len(tokens),
                min_decoding_length=new_tokens,
                max_decoding_length=new_tokens,
                return_scores=False,
            )
            elapsed = time.perf_counter() - started
            lengths = {len(result.hypotheses[0]) for result in results}
            if lengths != {new_tokens}:
                raise RuntimeError(f"CTranslate2 produced hypotheses of lengths {sorted(lengths)}, not {new_tokens}")
            return elapsed

        return run

    from hf_deep_nmt.serving.translate import compiled_decoding

    device = source.device

    def run() -> float:
        decoding = compiled_decoding(model, new_tokens + 1, backend) if backend else contextlib.nullcontext({})
        with torch.inference_mode(), decoding as extra:
            synchronize(device)
            started = time.perf_counter()
            output = model.generate(
                input_ids=source,
                attention_mask=torch.ones_like(source),
                num_beams=beams,
                min_new_tokens=new_tokens,
                max_length=new_tokens + 1,  # the start token + new_tokens
                do_sample=False,
                use_cache=True,
                **extra,
            )
            synchronize(device)
            elapsed = time.perf_counter() - started
        if output.shape != (source.shape[0], new_tokens + 1):
            raise RuntimeError(f"{kind}: expected {new_tokens} forced new tokens, got shape {tuple(output.shape)}")
        return elapsed

    return run


def decoding_source(size: dict) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    source = torch.randint(4, size["vocab"] - 1, (size["batch"], size["source_length"] - 1), generator=generator)
    return torch.cat([source, torch.full((size["batch"], 1), EOS)], dim=1)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_probe(task: str, kind: str, size: dict, workdir: Path) -> int:
    """Run in a fresh process: peak resident memory above the resident memory after warm-up inputs are built."""
    if task == "train":
        model = own_model(size) if kind == "own_multi_head" else marian_model(size)
        batch = training_batch(size, size["train_batch"], size["train_length"])
        run = training_step(model, batch)
    else:
        model = decoding_model(kind, size, workdir)
        run = decode(kind, model, decoding_source(size), 4, size["new_tokens"])
    before = rss_bytes()
    reset_peak_rss()
    run()
    return max(0, peak_rss_bytes() - before)


def reset_peak_rss() -> None:
    """Lower the kernel's resident-set high-water mark to the current resident set (Linux >= 4.0), so the peak
    counts only what follows; where that is not allowed the peak since exec counts, which is still this process's."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (VmHWM). Not `getrusage().ru_maxrss`: Linux carries that over
    from the parent across fork and exec, so a probe started by a large parent would report the parent's peak."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_memory(task: str, kind: str, args: argparse.Namespace, workdir: Path) -> int:
    command = [sys.executable, __file__, "--size", args.size, "--workdir", str(workdir), "--memory-probe", task, kind]
    if args.threads:
        command += ["--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe {task}/{kind} failed:\n{done.stderr[-2000:]}")
    return int(done.stdout.strip().splitlines()[-1])


def machine() -> dict[str, object]:
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


# ----------------------------------------------------------------------------------------------------- sections
def run_training(size: dict, repeats: int) -> dict:
    batch = training_batch(size, size["train_batch"], size["train_length"])
    models = {"own_pre_norm": own_model(size), "hf_marian": marian_model(size)}
    length = size["train_length"]
    flops = {name: training_flops(size, size["train_batch"], length, length, size["layers"]) for name in models}
    timings = alternate({name: training_step(model, batch) for name, model in models.items()}, repeats)
    tokens = size["train_batch"] * size["train_length"]
    medians = {name: statistics.median(values) for name, values in timings.items()}
    return {
        "seconds": timings,
        "median_seconds": medians,
        "tokens_per_second": {name: tokens / seconds for name, seconds in medians.items()},
        "flops_per_step": flops,
        "flops_per_second": {name: flops[name] / medians[name] for name in models},
    }


def run_generate(size: dict, repeats: int, models: dict, beams: tuple[int, ...] = (4, 1)) -> dict:
    """generate() of every model on the decoding source, outputs forced to `new_tokens`, contenders alternating;
    one entry per beam size, as `run_decoding` gives."""
    source = decoding_source(size)
    tokens = size["batch"] * size["new_tokens"]
    results = {}
    for beam in beams:
        measures = {name: decode(name, model, source, beam, size["new_tokens"]) for name, model in models.items()}
        timings = alternate(measures, repeats)
        medians = {name: statistics.median(values) for name, values in timings.items()}
        results[f"beams_{beam}"] = {
            "seconds": timings,
            "median_seconds": medians,
            "tokens_per_second": {name: tokens / seconds for name, seconds in medians.items()},
        }
    return results


def run_decoding(size: dict, repeats: int, workdir: Path, kinds: list[str]) -> dict:
    models = {kind: decoding_model(kind, size, workdir) for kind in kinds}
    return run_generate(size, repeats, models, beams=(1, 4))


def decoder_steps(model, source: torch.Tensor, rows: int, steps: int) -> Callable[[], float]:
    """One timed run of `steps` consecutive cached steps of the decoder stack alone (no output layer, no search) on
    `rows` sequences: the encoder output of `source` repeated to `rows`, random input tokens."""
    decoder = model.get_decoder()
    with torch.inference_mode():
        memory = model.get_encoder()(input_ids=source).last_hidden_state
        memory = DeepNMTEncoderOutput(last_hidden_state=memory.repeat_interleave(rows // source.shape[0], dim=0))
    tokens = torch.randint(4, model.config.vocab_size - 1, (rows, steps), generator=torch.Generator().manual_seed(4))

    def run() -> float:
        with torch.inference_mode():
            cache = None
            started = time.perf_counter()
            for step in range(steps):
                cache = decoding_state(
                    decoder(input_ids=tokens[:, step : step + 1], encoder_outputs=memory, cache=cache, use_cache=True)
                )
            return time.perf_counter() - started

    return run


def run_matt(size: dict, repeats: int) -> dict:
    """Merged attention against multi-head decoder self-attention in otherwise identical post-norm models: generate()
    at beam 4 and greedy, and the decoder stack alone for `new_tokens` cached steps on batch x 4 rows."""
    models = {
        "multi_head": own_model(size, pre_norm=False).eval(),
        "matt": own_model(size, self_attention="merged_average", pre_norm=False).eval(),
    }
    results: dict = {"pre_norm": False} | run_generate(size, repeats, models)
    rows, steps = size["batch"] * 4, size["new_tokens"]
    source = decoding_source(size)
    timings = alternate({name: decoder_steps(model, source, rows, steps) for name, model in models.items()}, repeats)
    results["decoder_steps"] = {
        "rows": rows,
        "steps": steps,
        "seconds": timings,
        "median_step_seconds": {name: statistics.median(values) / steps for name, values in timings.items()},
    }
    return results


def msc_names(size: dict) -> tuple[str, str, str]:
    """The MSC section's contenders: the baseline, a plain encoder as deep as the MSC one, and MSC."""
    blocks, block_layers = size["layers"], size["msc_block_layers"]
    return f"baseline_{blocks}", f"plain_{blocks * block_layers}", f"msc_{blocks}x{block_layers}"


def run_msc(size: dict, repeats: int) -> dict:
    """Decoding cost of a deep MSC encoder (one block of `msc_block_layers` layers per decoder layer, GRU context,
    gated fusion on both sides): generate() of the baseline, of a plain encoder of the same depth and of MSC, all
    pre-norm with `layers` decoder layers."""
    baseline, plain, msc = msc_names(size)
    models = {
        baseline: own_model(size).eval(),
        plain: own_model(size, layers=size["layers"] * size["msc_block_layers"]).eval(),
        msc: own_model(size, block_layers=size["msc_block_layers"]).eval(),
    }
    parameters = {name: sum(parameter.numel() for parameter in model.parameters()) for name, model in models.items()}
    return {"contenders": [baseline, plain, msc], "parameters": parameters} | run_generate(size, repeats, models)


def run_deep(size: dict, repeats: int) -> dict:
    shallow, deep = size["deep_layers"]
    deep_size = size | {"d_model": size["deep_d_model"], "ffn": size["deep_ffn"], "heads": size["deep_heads"]}
    batch = training_batch(deep_size, size["deep_batch"], size["deep_length"])
    models = {
        f"plain_{shallow}": own_model(deep_size, layers=shallow),
        f"plain_{deep}": own_model(deep_size, layers=deep),
        f"dlcl_{deep}": own_model(deep_size, layers=deep, aggregation="dlcl"),
    }
    timings = alternate({name: training_step(model, batch) for name, model in models.items()}, repeats)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    return {"encoder_layers": [shallow, deep], "seconds": timings, "median_seconds": medians}


def deep_depth_model(size: dict, layers: int, aggregation: str, d_model: int | None = None):
    width = {"d_model": d_model, "ffn": 4 * d_model, "heads": 4} if d_model else {}
    deep_size = size | {"d_model": size["deep_d_model"], "ffn": size["deep_ffn"], "heads": size["deep_heads"]} | width
    return own_model(deep_size, layers=layers, aggregation=aggregation)


def run_operators(size: dict, depths: tuple[int, ...] | None = None) -> dict:
    """Operator calls per training step of plain and dense-DLCL encoders at the deep depths, at width 32 (the
    counts do not depend on the width), batch 2 x 8, 6-layer decoder."""
    depths = depths or size["deep_layers"]
    batch = training_batch(size, 2, 8)
    counts = {}
    for layers in depths:
        for aggregation, name in (("residual", "plain"), ("dlcl", "dlcl")):
            counts[f"{name}_{layers}"] = operator_calls(deep_depth_model(size, layers, aggregation, 32), batch)
    return {"encoder_layers": list(depths), "counts": counts}


def run_deep_memory(size: dict) -> dict:
    """Bytes saved for backward by plain and dense-DLCL encoders (`deep_memory`: 24 layers, d 128, FFN 4d, 32 x 40
    tokens at base size), one forward pass each."""
    setting = size["deep_memory"]
    batch = training_batch(size, setting["batch"], setting["length"])
    layers, d_model = setting["layers"], setting["d_model"]
    return {
        f"{name}_{layers}": saved_for_backward_bytes(deep_depth_model(size, layers, aggregation, d_model), batch)
        for aggregation, name in (("residual", "plain"), ("dlcl", "dlcl"))
    }


def pair_dataset(size: dict, rows: int):
    """Random source/target pairs, all `pair_length` tokens (the last one EOS), so that every token-budget batch
    holds exactly `budget // pair_length` pairs and no padding."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(3)
    length = size["pair_length"]
    source = torch.randint(4, size["vocab"] - 1, (rows, length), generator=generator)
    target = torch.randint(4, size["vocab"] - 1, (rows, length), generator=generator)
    source[:, -1] = target[:, -1] = EOS
    return Dataset.from_dict(
        {"input_ids": source.tolist(), "attention_mask": [[1] * length] * rows, "labels": target.tolist()}
    )


def collate_pairs(features: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([feature[key] for feature in features]) for key in features[0]}


def trainer_throughput(model, size: dict, budget: int, steps: int, workdir: Path, device: torch.device) -> dict:
    """Tokens/s of `steps` training steps through `DeepNMTTrainer` with `max_tokens=budget` (after one warm-up
    step): bf16 autocast on CUDA, fp32 on CPU, the Trainer's default fused AdamW; wall time from the end of the
    warm-up step to the end of the last step (data loading included). Peak memory of those steps: CUDA's allocator
    peak, or the resident-set high-water mark above the resident set before them on CPU."""
    from transformers import PrinterCallback, TrainerCallback

    from hf_deep_nmt.training.pipeline import DeepNMTTrainer, DeepNMTTrainingArguments

    rows = budget // size["pair_length"]
    ends: list[float] = []
    memory_before = [0]

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ends.append(time.perf_counter())
            if len(ends) == 1:  # the warm-up step is done: memory counts from here
                if device.type == "cuda":
                    memory_before[0] = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                else:
                    memory_before[0] = rss_bytes()
                    reset_peak_rss()

    args = DeepNMTTrainingArguments(
        output_dir=str(workdir / "trainer"),
        max_tokens=budget,
        max_steps=steps + 1,
        learning_rate=1e-4,
        use_cpu=device.type != "cuda",
        bf16=device.type == "cuda",
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = DeepNMTTrainer(
        model=model,
        args=args,
        train_dataset=pair_dataset(size, rows * (steps + 1)),
        data_collator=collate_pairs,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(PrinterCallback)  # no metrics line per run
    trainer.train()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()
    if len(ends) != steps + 1:
        raise RuntimeError(f"expected {steps + 1} Trainer steps, saw {len(ends)}")
    return {
        "seconds": ends[-1] - ends[0],
        "tokens": rows * size["pair_length"] * steps,
        "peak_bytes": max(0, peak - memory_before[0]),
    }


def matrix_parameter_count(model: torch.nn.Module) -> int:
    """Weights of the linear layers (the output layer included), each tensor once: the N of 6 * N * tokens.
    Embedding tables are looked up, not multiplied (Marian's sinusoidal positions are such a table)."""
    weights = {id(module.weight): module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear)}
    return sum(weights.values())


def run_throughput(size: dict, repeats: int, workdir: Path, budgets: tuple[int, ...]) -> dict:
    """Own pre-norm 6+6 against HF Marian at equal sizes through the Trainer at each token budget, alternating, and
    own with the plain loss (whole logits, `F.cross_entropy`) to show what the chunked loss gives.
    MFU = 6 * N * target tokens/s over the measured matrix-multiply peak (bf16 on CUDA, fp32 on CPU), N the
    linear layers' weights: sources are as long as targets, so every weight meets that many tokens per step."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = matmul_peak(size["gemm"] if device.type == "cpu" else 8192, repeats, device, dtype)
    plain_loss = own_model(size)
    plain_loss.chunks_training_loss = lambda: False  # the whole logits and `F.cross_entropy`, as before the chunks
    models = {"own_pre_norm": own_model(size), "own_pre_norm_plain_loss": plain_loss, "hf_marian": marian_model(size)}
    parameters = {name: matrix_parameter_count(model) for name, model in models.items()}
    results = {}
    for budget in budgets:
        runs: dict[str, list[dict]] = {name: [] for name in models}
        for _ in range(repeats):
            for name, model in models.items():
                runs[name].append(trainer_throughput(model, size, budget, size["throughput_steps"], workdir, device))
        seconds = {name: [run["seconds"] for run in values] for name, values in runs.items()}
        tokens = {name: values[0]["tokens"] for name, values in runs.items()}
        speed = {name: tokens[name] / statistics.median(seconds[name]) for name in models}
        anatomy = {}
        if device.type == "cpu":  # profiled steps of each on the budget's batch (no padding: rows x pair_length)
            batch = training_batch(size, budget // size["pair_length"], size["pair_length"])
            anatomy = step_anatomy({name: models[name] for name in ("own_pre_norm", "hf_marian")}, batch, repeats)
        results[str(budget)] = {
            "anatomy": anatomy,
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_second": speed,
            "mfu": {name: 6 * parameters[name] * speed[name] / peak for name in models},
            "peak_bytes": {name: max(run["peak_bytes"] for run in values) for name, values in runs.items()},
        }
    return {
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "matmul_peak_flops": peak,
        "parameters": parameters,
        "budgets": results,
    }


# ------------------------------------------------------------------------------------------------ compiled decoding
def decoding_step_bytes(size: dict, self_attention: str, source_length: int, step: int, bytes_per_value: int) -> int:
    """Bytes one batch-1 decoding step reads: every decoder weight it multiplies by (the cross-attention keys/values
    of the source are projected once, before the steps) and the output layer, plus the cached states it attends (keys
    and values of `step` earlier tokens for multi-head self-attention, one running sum for MAtt, the source keys and
    values for cross-attention). Embedding rows, biases and LayerNorms are negligible and left out."""
    d, ffn, vocab = size["d_model"], size["ffn"], size["vocab"]
    if self_attention == "merged_average":
        # MAtt: query and output maps of the cross-attention, its value map applied to the decoder input as well
        weights = 3 * d * d + 2 * d * ffn
        states = 2 * source_length * d + d
    else:
        weights = 4 * d * d + 2 * d * d + 2 * d * ffn  # self-attention Q/K/V/O, cross-attention Q/O, FFN
        states = 2 * step * d + 2 * source_length * d
    return (size["layers"] * (weights + states) + vocab * d) * bytes_per_value


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_compiled(size: dict, repeats: int, device: torch.device, backend: str) -> dict:
    """Compiled + static against eager + dynamic decoding, and compiled against eager training steps (see the module
    docstring). `backend` other than "inductor" (e.g. "aot_eager") only checks that the section runs."""
    import torch._dynamo

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models = {
        "multi_head": own_model(size).to(device=device, dtype=dtype).eval(),
        "matt": own_model(size, self_attention="merged_average").to(device=device, dtype=dtype).eval(),
    }
    results: dict = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "decoding": {}}
    generator = torch.Generator().manual_seed(3)
    for setting, (batch, beams) in {"batch1_greedy": (1, 1), "beam4": (size["compiled_beam_batch"], 4)}.items():
        source = torch.randint(4, size["vocab"] - 1, (batch, size["source_length"] - 1), generator=generator)
        source = torch.cat([source, torch.full((batch, 1), EOS)], dim=1).to(device)
        measures = {}
        for name, model in models.items():
            for compiled in (False, True):
                label = f"{name}_{'compiled_static' if compiled else 'eager_dynamic'}"
                chosen = backend if compiled else None
                measures[label] = decode(label, model, source, beams, size["new_tokens"], chosen)
        timings = alternate(measures, repeats)
        medians = {name: statistics.median(values) for name, values in timings.items()}
        tokens = batch * size["new_tokens"]
        results["decoding"][setting] = {
            "batch": batch,
            "beams": beams,
            "seconds": timings,
            "tokens_per_second": {name: tokens / seconds for name, seconds in medians.items()},
        }
    bytes_per_value = 2 if dtype == torch.bfloat16 else 4
    step = size["new_tokens"] // 2
    results["bytes_per_step"] = {
        name: decoding_step_bytes(size, attention, size["source_length"], step, bytes_per_value)
        for name, attention in (("multi_head", "multi_head"), ("matt", "merged_average"))
    }
    results["bytes_per_step_base_32k"] = {
        name: decoding_step_bytes(SIZES["base"], attention, 24, 12, 2)
        for name, attention in (("multi_head", "multi_head"), ("matt", "merged_average"))
    }
    batch = training_batch(size, size["train_batch"], size["train_length"])
    batch = {key: value.to(device) for key, value in batch.items()}
    steps = {}
    for name, aggregation in (("pre_norm", "residual"), ("dlcl", "dlcl")):
        model = own_model(size, aggregation=aggregation).to(device)
        eager = own_model(size, aggregation=aggregation).to(device)
        eager.load_state_dict(model.state_dict())
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        steps[f"{name}_eager"] = timed_step(training_step(eager, batch), device)
        steps[f"{name}_compiled"] = timed_step(training_step(compiled, batch), device)
    results["training_seconds"] = alternate(steps, repeats)
    return results


def timed_step(step: Callable[[], float], device: torch.device) -> Callable[[], float]:
    def run() -> float:
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        with autocast:
            synchronize(device)
            started = time.perf_counter()
            step()
            synchronize(device)
            return time.perf_counter() - started

    return run


def ratio_rows(results: dict) -> list[tuple[str, float, float, str, bool | None]]:
    """(figure, ratio of medians, ratio of fastest runs, target, met by the medians) for every target measured, and
    the ratios that have no target (met None).

    On a shared machine the fastest run of each contender is the one least disturbed by others, so its ratio is
    reported next to the ratio of medians."""
    rows = []

    def add(figure: str, seconds: dict, numerator: str, denominator: str, target: str, met) -> None:
        median = statistics.median(seconds[numerator]) / statistics.median(seconds[denominator])
        fastest = min(seconds[numerator]) / min(seconds[denominator])
        rows.append((figure, median, fastest, target, met(median)))

    decoding = results.get("decoding")
    if decoding:
        for beams in (1, 4):
            seconds = decoding[f"beams_{beams}"]["seconds"]
            name = "greedy" if beams == 1 else "beam 4"
            # speed ratio A / B = time(B) / time(A)
            add(f"decoding {name}: own multi-head / HF Marian", seconds, "hf_marian", "own_multi_head", ">= 1.20",
                lambda value: value >= 1.2)  # fmt: skip
            add(f"decoding {name}: own MAtt / own multi-head", seconds, "own_multi_head", "own_matt", ">= 1.50",
                lambda value: value >= 1.5)  # fmt: skip
            if "ctranslate2" in seconds:
                target = ">= 1.00" if beams == 4 else "(no target)"
                add(f"decoding {name}: own MAtt / CTranslate2", seconds, "ctranslate2", "own_matt", target,
                    lambda value: value >= 1.0)  # fmt: skip
    training = results.get("training")
    if training:
        add("training: own pre-norm / HF Marian tokens/s", training["seconds"], "hf_marian", "own_pre_norm",
            ">= 1.10", lambda value: value >= 1.1)  # fmt: skip
        flops = training["flops_per_step"]["own_pre_norm"]
        median = flops / statistics.median(training["seconds"]["own_pre_norm"]) / results["gemm_peak_flops"]
        fastest = flops / min(training["seconds"]["own_pre_norm"]) / results["gemm_peak_flops"]
        rows.append(("training: own pre-norm FLOP/s / fp32 GEMM peak", median, fastest, ">= 0.75", median >= 0.75))
    deep = results.get("deep")
    if deep:
        shallow, depth = deep["encoder_layers"]
        add(f"deep: DLCL-{depth}L / plain-{depth}L step time", deep["seconds"], f"dlcl_{depth}", f"plain_{depth}",
            "<= 1.10", lambda value: value <= 1.1)  # fmt: skip
        limit = 1.05 * depth / shallow  # 2.10 for 48 against 24 layers
        add(f"deep: plain-{depth}L / plain-{shallow}L step time", deep["seconds"], f"plain_{depth}",
            f"plain_{shallow}", f"<= {limit:.2f}", lambda value: value <= limit)  # fmt: skip
    operators = results.get("operators")
    if operators:
        shallow, depth = operators["encoder_layers"][:2]
        counts = {name: count["aten_calls"] for name, count in operators["counts"].items()}
        ratio = counts[f"dlcl_{depth}"] / counts[f"plain_{depth}"]
        figure = f"operators: DLCL-{depth}L / plain-{depth}L ATen calls per step"
        rows.append((figure, ratio, ratio, "<= 1.20", ratio <= 1.2))
        growth = (counts[f"dlcl_{depth}"] - counts[f"plain_{depth}"]) / (
            counts[f"dlcl_{shallow}"] - counts[f"plain_{shallow}"]
        )
        target = f"<= {depth / shallow:.2f} (O(L))"
        figure = f"operators: DLCL extra calls at {depth}L / at {shallow}L"
        rows.append((figure, growth, growth, target, growth <= depth / shallow))
    compiled = results.get("compiled")
    if compiled:
        on_gpu = compiled["device"] == "cuda"
        for setting, label, goal in (("batch1_greedy", "batch-1 greedy", 3.0), ("beam4", "beam 4", 1.5)):
            seconds = compiled["decoding"][setting]["seconds"]
            batch = compiled["decoding"][setting]["batch"]
            for name in ("multi_head", "matt"):
                target = f">= {goal:.2f}" if on_gpu else "(GPU target)"
                add(f"compiled: {name} {label} (batch {batch}) compiled+static / eager+dynamic", seconds,
                    f"{name}_eager_dynamic", f"{name}_compiled_static", target,
                    lambda value, goal=goal: value >= goal)  # fmt: skip
        bytes_ratio = compiled["bytes_per_step"]["multi_head"] / compiled["bytes_per_step"]["matt"]
        add("compiled: MAtt / multi-head batch-1 greedy", compiled["decoding"]["batch1_greedy"]["seconds"],
            "multi_head_compiled_static", "matt_compiled_static", f">= {bytes_ratio:.2f} (bytes read per step)",
            lambda value: value >= bytes_ratio)  # fmt: skip
        for name in ("pre_norm", "dlcl"):
            add(f"compiled: {name} training step compiled / eager speed", compiled["training_seconds"],
                f"{name}_eager", f"{name}_compiled", ">= 1.00", lambda value: value >= 1.0)  # fmt: skip
    matt = results.get("matt")
    if matt:
        for beams in (4, 1):
            name = "greedy" if beams == 1 else "beam 4"
            add(f"matt {name}: MAtt / multi-head generate() speed (post-norm)", matt[f"beams_{beams}"]["seconds"],
                "multi_head", "matt", "(no target)", lambda value: None)  # fmt: skip
        add("matt: MAtt / multi-head decoder stack step speed", matt["decoder_steps"]["seconds"], "multi_head",
            "matt", "(no target)", lambda value: None)  # fmt: skip
    msc = results.get("msc")
    if msc:
        baseline, plain, deep = msc["contenders"]
        for beams in (4, 1):
            name = "greedy" if beams == 1 else "beam 4"
            seconds = msc[f"beams_{beams}"]["seconds"]
            for slower, faster in ((plain, baseline), (deep, baseline), (deep, plain)):
                add(f"msc {name}: {slower} / {faster} generate() speed", seconds, faster, slower, "(no target)",
                    lambda value: None)  # fmt: skip
    throughput = results.get("throughput")
    if throughput:
        for budget, figures in throughput["budgets"].items():
            add(f"throughput {budget} tokens: own pre-norm / HF Marian tokens/s", figures["seconds"], "hf_marian",
                "own_pre_norm", ">= 1.10", lambda value: value >= 1.1)  # fmt: skip
            anatomy = figures.get("anatomy")
            if anatomy:
                # what own / Marian would be if own's step were its matrix products alone: the most that work outside
                # them can give, the products being the same in both models
                ceiling = anatomy["hf_marian"]["seconds"] / anatomy["own_pre_norm"]["matrix_product_seconds"]
                figure = f"throughput {budget} tokens: ceiling of own / HF Marian (own's step = its matrix products)"
                rows.append((figure, ceiling, ceiling, "(no target)", None))
            if "own_pre_norm_plain_loss" in figures["seconds"]:
                add(f"throughput {budget} tokens: own chunked loss / own plain loss tokens/s", figures["seconds"],
                    "own_pre_norm_plain_loss", "own_pre_norm", "(no target)", lambda value: None)  # fmt: skip
    return rows


def print_tables(results: dict) -> None:
    decoding = results.get("decoding")
    if decoding:
        heading = "| decoding (batch {batch}, {source_length} source, {new_tokens} output tokens) "
        print(heading.format(**results["size"]) + "| greedy tok/s | beam 4 tok/s | peak MB (beam 4) |")
        print("|---|---:|---:|---:|")
        memory = results.get("memory", {}).get("decoding_beam_4", {})
        for kind in decoding["beams_1"]["tokens_per_second"]:
            greedy = decoding["beams_1"]["tokens_per_second"][kind]
            beam = decoding["beams_4"]["tokens_per_second"][kind]
            shown = f"{memory[kind] / 2**20:.0f}" if kind in memory else ""
            print(f"| {kind} | {greedy:.1f} | {beam:.1f} | {shown} |")
        print()
    training = results.get("training")
    if training:
        size = results["size"]
        print(f"| training ({size['train_batch']}x{size['train_length']} target tokens, Adam) | median s | "
              "target tok/s | GFLOP/s | of GEMM peak | peak MB |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|")
        memory = results.get("memory", {}).get("training", {})
        for name in training["median_seconds"]:
            flops = training["flops_per_second"][name]
            shown = f"{memory[name] / 2**20:.0f}" if name in memory else ""
            print(
                f"| {name} | {training['median_seconds'][name]:.3f} | {training['tokens_per_second'][name]:.1f} | "
                f"{flops / 1e9:.1f} | {flops / results['gemm_peak_flops']:.0%} | {shown} |"
            )
        print(f"\nmeasured fp32 GEMM peak: {results['gemm_peak_flops'] / 1e9:.1f} GFLOP/s\n")
    deep = results.get("deep")
    if deep:
        print(f"| deep stacks (training step, batch {results['size']['deep_batch']}x{results['size']['deep_length']},"
              " 6-layer decoder) | median s |")  # fmt: skip
        print("|---|---:|")
        for name, seconds in deep["median_seconds"].items():
            print(f"| {name} encoder layers | {seconds:.3f} |")
        print()
    if deep and "saved_for_backward" in deep:
        print("| saved for backward (one training forward) | MB |")
        print("|---|---:|")
        for name, saved in deep["saved_for_backward"].items():
            print(f"| {name} | {saved / 2**20:.1f} |")
        print()
    operators = results.get("operators")
    if operators:
        print("| operators per training step (width 32, batch 2 x 8, 6-layer decoder) | ATen calls | autograd nodes |")
        print("|---|---:|---:|")
        for name, count in operators["counts"].items():
            print(f"| {name} encoder layers | {count['aten_calls']} | {count['autograd_nodes']} |")
        print()
    throughput = results.get("throughput")
    if throughput:
        print(f"| Trainer throughput ({throughput['device']}, {throughput['dtype']}) | token budget | median s | "
              "target tok/s | MFU | peak MB |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|")
        for budget, figures in throughput["budgets"].items():
            for name, speed in figures["tokens_per_second"].items():
                seconds = statistics.median(figures["seconds"][name])
                print(f"| {name} | {budget} | {seconds:.3f} | {speed:.1f} | {figures['mfu'][name]:.1%} | "
                      f"{figures['peak_bytes'][name] / 2**20:.0f} |")  # fmt: skip
        print(f"\nmeasured {throughput['dtype']} matmul peak: {throughput['matmul_peak_flops'] / 1e9:.1f} GFLOP/s; "
              f"parameters {throughput['parameters']}\n")  # fmt: skip
        anatomies = {
            budget: figures["anatomy"] for budget, figures in throughput["budgets"].items() if figures.get("anatomy")
        }
        if anatomies:
            print("| profiled training step (CPU, median) | budget | step s | matrix products s | share | rest s |")
            print("|---|---:|---:|---:|---:|---:|")
            for budget, anatomy in anatomies.items():
                for name, parts in anatomy.items():
                    products = parts["matrix_product_seconds"]
                    print(f"| {name} | {budget} | {parts['seconds']:.3f} | {products:.3f} | "
                          f"{products / parts['seconds']:.0%} | {parts['seconds'] - products:.3f} |")  # fmt: skip
            print()
    compiled = results.get("compiled")
    if compiled:
        print(f"| compiled decoding ({compiled['device']}, {compiled['dtype']}) | setting | target tok/s |")
        print("|---|---|---:|")
        for figures in compiled["decoding"].values():
            for name, speed in figures["tokens_per_second"].items():
                print(f"| {name} | batch {figures['batch']}, {figures['beams']} beam(s) | {speed:.1f} |")
        print("\n| training step (compiled section) | median s |\n|---|---:|")
        for name, seconds in compiled["training_seconds"].items():
            print(f"| {name} | {statistics.median(seconds):.3f} |")
        base = compiled["bytes_per_step_base_32k"]
        print(f"\nbytes read per batch-1 decoding step, base size, 32k vocabulary, bf16, 24-token source, step 12: "
              f"multi-head {base['multi_head'] / 2**20:.1f} MiB, MAtt {base['matt'] / 2**20:.1f} MiB, ratio "
              f"{base['multi_head'] / base['matt']:.2f}\n")  # fmt: skip
    matt = results.get("matt")
    if matt:
        size = results["size"]
        print(f"| MAtt against multi-head, post-norm (batch {size['batch']}, {size['source_length']} source, "
              f"{size['new_tokens']} output tokens) | beams | median s | target tok/s |")  # fmt: skip
        print("|---|---:|---:|---:|")
        for beams in (4, 1):
            figures = matt[f"beams_{beams}"]
            for name, speed in figures["tokens_per_second"].items():
                print(f"| {name} | {beams} | {figures['median_seconds'][name]:.3f} | {speed:.1f} |")
        steps = matt["decoder_steps"]
        print(f"\n| decoder stack only ({steps['rows']} rows, {steps['steps']} cached steps) | ms per step |")
        print("|---|---:|")
        for name, seconds in steps["median_step_seconds"].items():
            print(f"| {name} | {seconds * 1e3:.2f} |")
        print()
    msc = results.get("msc")
    if msc:
        size = results["size"]
        print(f"| MSC decoding (batch {size['batch']}, {size['source_length']} source, {size['new_tokens']} output "
              "tokens) | parameters | beams | median s | target tok/s |")  # fmt: skip
        print("|---|---:|---:|---:|---:|")
        for beams in (4, 1):
            figures = msc[f"beams_{beams}"]
            for name in msc["contenders"]:
                seconds, speed = figures["median_seconds"][name], figures["tokens_per_second"][name]
                print(f"| {name} | {msc['parameters'][name]:,} | {beams} | {seconds:.3f} | {speed:.1f} |")
        print()
    memory = results.get("memory")
    if memory and not (decoding or training):
        print("| peak memory above the loaded model | MB |")
        print("|---|---:|")
        for task, by_kind in memory.items():
            for kind, peak in by_kind.items():
                print(f"| {task}: {kind} | {peak / 2**20:.0f} |")
        print()
    print("| target | ratio of medians | ratio of fastest runs | target | met (medians) |")
    print("|---|---:|---:|---:|:---:|")
    for figure, median, fastest, target, met in ratio_rows(results):
        shown = "" if met is None else "yes" if met else "no"
        print(f"| {figure} | {median:.2f} | {fastest:.2f} | {target} | {shown} |")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="model and batch sizes (default: base)")
    parser.add_argument("--smoke", action="store_true", help="the same as --size smoke: tiny sizes, one repeat")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per contender (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for every contender")
    sections = ("training", "decoding", "deep", "operators", "throughput", "memory", "compiled", "matt", "msc")
    parser.add_argument("--sections", nargs="+", choices=sections, default=list(sections))
    parser.add_argument("--device", default=None, help="compiled section: cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--compile-backend", default="inductor", help="compiled section; another backend only checks that it runs"
    )
    parser.add_argument("--budgets", nargs="+", type=int, default=None, help="throughput token budgets")
    parser.add_argument("--json", type=Path, default=None, help="default: benchmarks/results/perf[_SIZE].json")
    parser.add_argument("--workdir", type=Path, default=None, help="where the CTranslate2 conversion is kept")
    parser.add_argument("--report", type=Path, default=None, help="print the tables of a results JSON and exit")
    parser.add_argument("--memory-probe", nargs=2, metavar=("TASK", "KIND"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke and args.size not in (None, "smoke"):
        parser.error(f"--smoke is --size smoke; it contradicts --size {args.size}")
    args.size = "smoke" if args.smoke else args.size or "base"
    if args.report:
        results = json.loads(args.report.read_text())
        print_tables(results)
        return results
    if args.threads:
        torch.set_num_threads(args.threads)
    size = dict(SIZES[args.size])
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    too_small = [budget for budget in args.budgets or () if budget < size["pair_length"]]
    if too_small:  # a budget batch holds whole pairs of `pair_length` target tokens
        parser.error(
            f"--budgets {too_small[0]} holds no pair: a budget must be at least {size['pair_length']} tokens at "
            f"--size {args.size} (one pair)"
        )
    repeats = args.repeats or size["repeats"]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        if args.memory_probe:
            print(memory_probe(*args.memory_probe, size, workdir))
            return {}
        kinds = [kind for kind in DECODERS if kind != "ctranslate2" or ctranslate2_available()]
        results: dict = {"size": size | {"name": args.size}, "repeats": repeats, "machine": machine()}
        if "ctranslate2" not in kinds:
            results["skipped"] = ["ctranslate2 (not installed: pip install -e '.[bench]')"]
        results["gemm_peak_flops"] = gemm_peak(size["gemm"], repeats)
        if "training" in args.sections:
            results["training"] = run_training(size, repeats)
        if "decoding" in args.sections:
            results["decoding"] = run_decoding(size, repeats, workdir, kinds)
        if "deep" in args.sections:
            results["deep"] = run_deep(size, repeats)
            results["deep"]["saved_for_backward"] = run_deep_memory(size)
        if "operators" in args.sections:
            results["operators"] = run_operators(size)
        if "throughput" in args.sections:
            budgets = tuple(args.budgets or size["budgets"])
            results["throughput"] = run_throughput(size, repeats, workdir, budgets)
        if "matt" in args.sections:
            results["matt"] = run_matt(size, repeats)
        if "msc" in args.sections:
            results["msc"] = run_msc(size, repeats)
        if "compiled" in args.sections:
            device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            results["compiled"] = run_compiled(size, repeats, device, args.compile_backend)
        if "memory" in args.sections:
            results["memory"] = {
                "training": {kind: measure_memory("train", kind, args, workdir) for kind in ("own_multi_head",)},
                "decoding_beam_4": {kind: measure_memory("decode", kind, args, workdir) for kind in kinds},
            }
            results["memory"]["training"]["own_pre_norm"] = results["memory"]["training"].pop("own_multi_head")
            results["memory"]["training"]["hf_marian"] = measure_memory("train", "hf_marian", args, workdir)
    results["ratios"] = [
        {"figure": figure, "measured": median, "fastest_runs": fastest, "target": target, "met": met}
        for figure, median, fastest, target, met in ratio_rows(results)
    ]
    print_tables(results)
    name = "perf.json" if args.size == "base" else f"perf_{args.size}.json"
    path = args.json or Path(__file__).parent / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nmachine: {results['machine']}\nraw timings: {path}")
    return results


if __name__ == "__main__":
    main()
