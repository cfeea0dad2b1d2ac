"""`hf-deep-nmt doctor`: check a machine before a long run on it.

Prints the versions that matter (torch, CUDA, cuDNN, transformers, accelerate, the GPU), which SDPA backend each
attention path of the model takes with and without a padding mask, runs the exactness and numerics checks per model
family on the device, a short `Seq2SeqTrainer` bf16 run with attention dropout, and a bf16 training of a base-width
model on the bundled sample; it ends with a pass/fail table. Without CUDA the device checks run on the CPU at tiny
size, and the bf16 Trainer run and the base-width training are reported as skipped.

The checks are plain functions (`CHECKS`) that raise `AssertionError` with the numbers when they fail; the CUDA test
module (`tests/test_cuda.py`) runs the same functions.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def families() -> dict[str, tuple[type, dict]]:
    """The variants checked, by name: each registered method's `checks` (the model code's `METHODS`), as its config
    class and the settings added to `TINY`."""
    from hf_deep_nmt.modeling.modeling_deep_nmt import METHODS

    return {
        name: (method.config_class, settings)
        for method in METHODS.values()
        for name, settings in method.checks.items()
    }


# The families tried on a GPU, as the package registers them at import (`families()` also has methods added later).
FAMILIES: dict[str, tuple[type, dict]] = families()
TINY = dict(
    vocab_size=61,
    d_model=32,
    encoder_layers=4,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=48,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)
PAD, BOS, EOS = 1, 0, 2
PADDED_LENGTHS = (64, 128, 192)  # the cuDNN bug shows at 64 mod 128


def family_config(family: str, **overrides):
    """A tiny config of the named family, of its method's config class (an MSC variant takes its encoder depth from
    its blocks)."""
    known = families()
    if family not in known:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(known)}.")
    config_class, settings = known[family]
    settings = {**TINY, **settings, **overrides}
    if settings.get("msc_block_layers") is not None:
        settings.pop("encoder_layers")
    return config_class(**settings)


def family_model(family: str, device: str, seed: int = 0, **overrides):
    from hf_deep_nmt import MODEL_CLASSES

    config = family_config(family, **overrides)
    torch.manual_seed(seed)
    model = MODEL_CLASSES[type(config)](config)
    with torch.no_grad():  # away from the initialisation, so that no check passes on symmetric weights
        generator = torch.Generator().manual_seed(seed)
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.to(device).eval()


def padded_batch(device: str, lengths: list[int], vocab: int, target_length: int = 7, seed: int = 0) -> dict:
    """Sources of the given lengths (the last token EOS), right-padded to the longest, and targets."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), PAD)
    for row, length in enumerate(lengths):
        input_ids[row, : length - 1] = torch.randint(3, vocab, (length - 1,), generator=generator)
        input_ids[row, length - 1] = EOS
    labels = torch.randint(3, vocab, (len(lengths), target_length), generator=generator)
    labels[:, -1] = EOS
    labels[0, -2:] = -100  # padded label rows too
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": input_ids.ne(PAD).long().to(device),
        "labels": labels.to(device),
    }


# ---- checks: each raises AssertionError with the numbers when it fails ----------------------------------------------


def check_cached_equals_uncached(family: str, device: str) -> str:
    """Greedy decoding with the cache == without it (tokens), and the cached step logits match a full forward."""
    from hf_deep_nmt.modeling.modeling_deep_nmt import decoding_state

    model = family_model(family, device)
    batch = padded_batch(device, [9, 6, 4], model.config.vocab_size)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    settings = dict(max_length=11, num_beams=1, do_sample=False, min_new_tokens=10)  # the start token + 10
    with torch.no_grad():
        cached = model.generate(**inputs, **settings, use_cache=True)
        uncached = model.generate(**inputs, **settings, use_cache=False)
        assert torch.equal(cached, uncached), f"greedy tokens differ: {cached.tolist()} vs {uncached.tolist()}"
        full = model(**inputs, decoder_input_ids=cached).logits
        encoder_outputs = model.get_encoder()(**inputs)
        cache, steps = None, []
        for position in range(cached.shape[1]):
            outputs = model(
                encoder_outputs=encoder_outputs,
                attention_mask=inputs["attention_mask"],
                decoder_input_ids=cached[:, position : position + 1],
                cache=cache,
                use_cache=True,
            )
            cache = decoding_state(outputs)
            steps.append(outputs.logits)
    difference = (torch.cat(steps, dim=1) - full).abs().max().item()
    assert difference <= 1e-4, f"cached step logits differ from the full forward by {difference:.2e} (> 1e-4)"
    return f"{cached.shape[1] - 1} tokens, max logit difference {difference:.1e}"


def check_beam_cache(family: str, device: str) -> str:
    """Beam search (4 beams) returns the same sequences and scores with and without the cache."""
    model = family_model(family, device)
    batch = padded_batch(device, [8, 5], model.config.vocab_size)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    settings = dict(max_length=9, num_beams=4, num_return_sequences=2, output_scores=True)  # the start token + 8
    settings.update(return_dict_in_generate=True, do_sample=False)
    with torch.no_grad():
        cached = model.generate(**inputs, **settings, use_cache=True)
        uncached = model.generate(**inputs, **settings, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences), (
        f"beam sequences differ: {cached.sequences.tolist()} vs {uncached.sequences.tolist()}"
    )
    difference = (cached.sequences_scores - uncached.sequences_scores).abs().max().item()
    assert difference <= 1e-4, f"beam scores differ by {difference:.2e}"
    return f"{cached.sequences.shape[0]} hypotheses equal, score difference {difference:.1e}"


def _autocast(device: str):
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def check_bf16_padded_lengths(family: str, device: str, **overrides) -> str:
    """bf16 autocast forward + backward with padding masks at padded lengths 64, 128, 192: loss and every gradient
    finite (`overrides`: config fields)."""
    model = family_model(family, device, **{"attention_dropout": 0.1, "dropout": 0.1, **overrides}).train()
    for width in PADDED_LENGTHS:
        batch = padded_batch(device, [width, width - 17, width // 2, 5], model.config.vocab_size, seed=width)
        model.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = model(**batch).loss
        loss.backward()
        assert torch.isfinite(loss).item(), f"bf16 loss {loss.item()} at padded length {width}"
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        assert not bad, f"non-finite gradients at padded length {width} in {bad[:5]}"
    return f"padded lengths {', '.join(map(str, PADDED_LENGTHS))}: finite"


# Unit roundoff of bfloat16 (8 significant bits): the relative error of one rounding.
BF16_UNIT_ROUNDOFF = 2.0**-8


@contextmanager
def bf16_math_attention():
    """The math SDPA backend computing in bf16 itself (`allow_fp16_bf16_reduction_math_sdp`): by default it upcasts
    bf16 inputs to fp32 inside the kernel, so its error understates what a correct bf16 kernel may do."""
    allowed = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(allowed)


def check_fused_matches_math(family: str, device: str) -> str:
    """Under bf16 autocast, the gradients with the backends SDPA picks (the model's restriction included) are about as
    close to fp32 math-backend gradients as those of a correct bf16 attention on the same device.

    The tolerance is measured on the device, not fixed: the bf16 error of the whole model's gradients (relative L2
    from fp32) is taken twice, with the math backend as it runs by default (attention upcast to fp32 inside the
    kernel) and with the math backend computing in bf16 (rounding where a fused kernel does, e.g. the probabilities
    before the product with the values). The fused path may be at most twice the larger of the two, plus 4 bf16
    unit roundoffs (4 * 2^-8): on this package's tiny models a correct path is 0.5 to 6e-2 from fp32, a dropped
    padding mask 0.3 to 0.7 and a missing 1/sqrt(d) scale 0.25 to 0.5 (measured on a CPU, torch 2.13)."""
    model = family_model(family, device).train()
    batch = padded_batch(device, [64, 40, 9], model.config.vocab_size, seed=3)

    def gradients(attention=None, bf16=True) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with attention or nullcontext(), _autocast(device) if bf16 else nullcontext():
            model(**batch).loss.backward()
        return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])

    def error(values: torch.Tensor) -> float:
        return ((values - reference).norm() / reference.norm()).item()

    reference = gradients(sdpa_kernel([SDPBackend.MATH]), bf16=False)
    fused_error = error(gradients())
    math_error = error(gradients(sdpa_kernel([SDPBackend.MATH])))
    bf16_math_error = error(gradients(bf16_math_attention()))
    tolerance = 2 * max(math_error, bf16_math_error) + 4 * BF16_UNIT_ROUNDOFF
    assert fused_error <= tolerance, (
        f"bf16 gradients of the fused path are {fused_error:.2e} from fp32 (relative L2), more than the tolerance "
        f"{tolerance:.2e} (twice the math path's {math_error:.2e} / in-bf16 math path's {bf16_math_error:.2e}, "
        f"+ 4 * 2^-8)"
    )
    return (
        f"relative L2 from fp32: fused {fused_error:.1e} <= {tolerance:.1e} "
        f"(math {math_error:.1e}, in-bf16 math {bf16_math_error:.1e})"
    )


def check_trainer_bf16(device: str, steps: int = 40) -> str:
    """A `Seq2SeqTrainer` bf16 run with attention dropout 0.1 under the guard does not stop."""
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    from hf_deep_nmt.data.corpus import SOURCE, TARGET, load_parallel_dataset, sample_corpus_dir, tokenize_parallel
    from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
    from hf_deep_nmt.training.callbacks import NonFiniteGuard, nonfinite_steps_skipped

    raw = load_parallel_dataset(train_file=sample_corpus_dir() / "train.tsv")["train"].select(range(1024))
    tokenizer = train_joint_tokenizer(zip(raw[SOURCE], raw[TARGET]), vocab_size=1000)
    data: Dataset = tokenize_parallel(raw, tokenizer, 64, 64)
    model = family_model("dlcl-prenorm", "cpu", vocab_size=len(tokenizer), attention_dropout=0.1, dropout=0.1)
    with tempfile.TemporaryDirectory() as folder:
        args = Seq2SeqTrainingArguments(
            output_dir=folder,
            max_steps=steps,
            per_device_train_batch_size=32,
            learning_rate=2e-3,
            warmup_steps=10,
            bf16=True,
            use_cpu=torch.device(device).type == "cpu",
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=10,
        )
        guard = NonFiniteGuard()
        trainer = Seq2SeqTrainer(
            model=model.train(),
            args=args,
            train_dataset=data,
            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
            callbacks=[guard],
        )
        result = trainer.train()
    skipped = nonfinite_steps_skipped(trainer)
    assert result.global_step == steps, f"stopped at step {result.global_step} of {steps}"
    return f"{steps} steps, loss {result.training_loss:.3f}, {skipped} non-finite step(s) skipped"


def train_sample(device: str, steps: int, output_dir: Path) -> str:
    """`hf-deep-nmt train` of the DLCL preset (pre-norm 30+6, d 512) on the bundled sample in bf16, max source
    length 64, 8k-token batches, dropout 0.1 everywhere."""
    from hf_deep_nmt.training.pipeline import run

    recipe = {
        "model_type": "deep_nmt_dlcl",
        "model_overrides": {"attention_dropout": 0.1, "activation_dropout": 0.1},
        "tokenizer_vocab_size": 8000,
        "max_source_length": 64,
        "max_target_length": 64,
        "max_eval_samples": 100,
        "output_dir": str(output_dir),
        "max_steps": steps,
        "max_tokens": 8192,
        "bf16": True,
        "learning_rate": 2e-3,
        "lr_schedule": "inverse_sqrt",
        "warmup_steps": min(4000, max(1, steps // 3)),
        "adam_beta2": 0.98,
        "label_smoothing_factor": 0.1,
        "save_strategy": "no",
        "logging_steps": 50,
        "report_to": "none",
        "plot_curves": False,
        "translate_examples": 0,
        "num_beams": 4,
        "per_device_eval_batch_size": 64,
    }
    path = output_dir.with_suffix(".json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe, indent=2))
    torch.cuda.reset_peak_memory_stats(device)
    summary = run([str(path)])
    assert summary["train_steps"] == steps, f"stopped at step {summary['train_steps']} of {steps}"
    return (
        f"{steps} steps, loss {summary['train_loss']}, sacreBLEU {summary.get('bleu')}, "
        f"{summary['nonfinite_steps_skipped']} skipped, {summary['train_seconds']} s, "
        f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
    )


# ---- attention backends ---------------------------------------------------------------------------------------------


ALL_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def _backend_choice(query, key, value, mask, dropout: float) -> str:
    """The backend SDPA dispatches these inputs to under the flags in effect (torch's own selection function)."""
    try:
        return SDPBackend(torch._fused_sdp_choice(query, key, value, mask, dropout, False)).name
    except (AttributeError, RuntimeError, TypeError, ValueError) as error:
        return f"unknown ({type(error).__name__})"


def attention_backends(device: str) -> list[tuple[str, str, str]]:
    """(attention path, backend SDPA takes as the model calls it, backend it would take without the model's cuDNN
    restriction) for every path of a DLCL model, with a padded and an unpadded source batch."""
    from hf_deep_nmt.modeling import modeling_deep_nmt

    model = family_model("dlcl-prenorm", device)
    labels, calls = {}, []
    for name, module in model.named_modules():
        if isinstance(module, modeling_deep_nmt.DeepNMTAttention):
            side = "encoder" if ".encoder." in f".{name}." else "decoder"
            kind = "cross-attention" if module.is_cross_attention else "self-attention"
            labels[module] = f"{side} {kind}"
    current = {"label": None}
    hooks = [m.register_forward_pre_hook(lambda m, a: current.update(label=labels[m])) for m in labels]
    original = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, dropout_p=0.0, **kwargs):
        with_mask = "masked" if attn_mask is not None else "no mask"
        chosen = _backend_choice(query, key, value, attn_mask, dropout_p)
        with sdpa_kernel(ALL_BACKENDS):
            free = _backend_choice(query, key, value, attn_mask, dropout_p)
        calls.append((f"{current['label']} ({with_mask})", chosen, free))
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, **kwargs)

    F.scaled_dot_product_attention = recording
    try:
        with torch.no_grad(), _autocast(device) if torch.device(device).type == "cuda" else nullcontext():
            for lengths in ([64, 40], [64, 64]):
                batch = padded_batch(device, lengths, model.config.vocab_size)
                if len(set(lengths)) == 1:  # an unpadded batch, passed without masks (a given mask always goes in)
                    batch = {key: value for key, value in batch.items() if "attention_mask" not in key}
                model(**batch)
    finally:
        F.scaled_dot_product_attention = original
        for hook in hooks:
            hook.remove()
    return sorted(set(calls))


# ---- the command ----------------------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str


def environment() -> list[tuple[str, str, str]]:
    """(component, installed version, versions tested) rows; the tested window where the package declares one."""
    import accelerate
    import transformers

    from hf_deep_nmt import TESTED_VERSIONS

    def tested(name: str, installed: str) -> str:
        if name not in TESTED_VERSIONS:
            return ""
        oldest, newest = TESTED_VERSIONS[name]
        window = oldest if oldest == newest else f"{oldest} to {newest}"
        minor = tuple(int(part) for part in installed.split("+")[0].split(".")[:2])
        inside = tuple(map(int, oldest.split("."))) <= minor <= tuple(map(int, newest.split(".")))
        return window if inside else f"{window} (OUTSIDE: untested here)"

    cuda = torch.cuda.is_available()
    rows = [
        ("python", platform.python_version(), ""),
        ("torch", torch.__version__, tested("torch", torch.__version__)),
        ("CUDA (torch build)", str(torch.version.cuda), ""),
        ("cuDNN", str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else "none", ""),
        ("transformers", transformers.__version__, tested("transformers", transformers.__version__)),
        ("accelerate", accelerate.__version__, ""),
        ("GPU", torch.cuda.get_device_name(0) if cuda else "none (CUDA not available)", ""),
    ]
    if cuda:
        rows.append(("bf16 supported", str(torch.cuda.is_bf16_supported()), ""))
    return rows


def run_checks(device: str, train_steps: int, output_dir: Path, families: list[str]) -> list[Result]:
    on_cuda = torch.device(device).type == "cuda"
    results: list[Result] = []

    def attempt(name: str, check: Callable[[], str]) -> None:
        started = time.perf_counter()
        try:
            detail = check()
            status = "PASS"
        except AssertionError as error:
            status, detail = "FAIL", str(error)
        except Exception as error:  # a crash is a failed check, reported with its cause
            status, detail = "FAIL", f"{type(error).__name__}: {error}"
            traceback.print_exc(file=sys.stderr)
        results.append(Result(name, status, f"{detail} [{time.perf_counter() - started:.1f} s]"))
        print(f"{status:4}  {name}: {detail}", file=sys.stderr, flush=True)

    for family in families:
        precision = "fp32"
        attempt(
            f"{family}: cached == uncached ({precision})", lambda f=family: check_cached_equals_uncached(f, device)
        )
        attempt(f"{family}: beam with == without cache", lambda f=family: check_beam_cache(f, device))
        attempt(f"{family}: bf16 fwd+bwd at padded 64/128/192", lambda f=family: check_bf16_padded_lengths(f, device))
        attempt(f"{family}: fused == math gradients (bf16)", lambda f=family: check_fused_matches_math(f, device))
    if on_cuda:
        attempt("Seq2SeqTrainer bf16, attention dropout 0.1", lambda: check_trainer_bf16(device))
        if train_steps > 0:
            attempt(
                f"train DLCL 30+6 (d 512) on the sample, bf16, {train_steps} steps",
                lambda: train_sample(device, train_steps, output_dir / "sample-run"),
            )
        else:
            results.append(Result("base-size bf16 training", "SKIP", "--train-steps 0"))
    else:
        results.append(Result("Seq2SeqTrainer bf16, attention dropout 0.1", "SKIP", "no CUDA device"))
        results.append(Result("base-size bf16 training on the sample", "SKIP", "no CUDA device"))
    return results


def print_table(rows: list[tuple[str, ...]], headers: tuple[str, ...]) -> None:
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    line = "  ".join(f"{{:<{width}}}" for width in widths)
    print(line.format(*headers))
    print(line.format(*("-" * width for width in widths)))
    for row in rows:
        print(line.format(*row))


def check_machine(
    requested_device: str | None = None,
    train_steps: int = 300,
    names: str | None = None,
    output_dir: str | None = None,
) -> int:
    """`hf-deep-nmt doctor` (whose flags `hf_deep_nmt.cli` parses without importing torch): print the checks of the
    comma-separated variant `names` (default: all) and return 1 when one failed, else 0."""
    device = requested_device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {requested_device!r}.")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine (torch {torch.__version__}).")
    if train_steps < 0:
        raise ValueError(f"--train-steps must be >= 0, got {train_steps}.")
    known = families()
    chosen = [name.strip() for name in (names or ",".join(known)).split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not chosen:
        raise ValueError(f"--families: unknown {unknown or chosen}; choose from {sorted(known)}.")

    print("== environment")
    print_table(environment(), ("component", "version", "tested"))
    print(f"\n== SDPA backend per attention path on {device}")
    print_table(attention_backends(device), ("attention path", "backend taken", "without the cuDNN restriction"))
    print(f"\n== checks on {device}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        results = run_checks(device, train_steps, Path(output_dir) if output_dir else Path(scratch), chosen)
    print_table([(r.status, r.name, r.detail) for r in results], ("result", "check", "detail"))
    failed = [r for r in results if r.status == "FAIL"]
    skipped = [r for r in results if r.status == "SKIP"]
    print(
        f"\n{len(results) - len(failed) - len(skipped)} passed, {len(failed)} failed, {len(skipped)} skipped"
        + (" (no CUDA device: the device checks ran on the CPU at tiny size)" if device == "cpu" else "")
    )
    return 1 if failed else 0
