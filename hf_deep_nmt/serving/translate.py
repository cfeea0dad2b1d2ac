r"""Batch translation through `generate()` (the transformers translation pipeline no longer exists).

Written here, over `generate()`: batches formed by a token budget (`hf_deep_nmt.data.batching`), an output cap relative
to each sentence's own source length (fairseq's `--max-len-a/b`, as a logits processor, so a sentence's translation
does not depend on the batch it lands in) under an absolute cap, the GNMT length penalty (by rescoring the final
beam), input order kept, empty lines passed through, a progress bar; and the file side: input split on `\n` alone,
translations streamed in input order as they are produced to a temporary file renamed into place when complete, no
file replaced unless asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hf_deep_nmt import registration  # noqa: F401  (models load through the Auto classes)
from hf_deep_nmt.data.batching import token_batches
from hf_deep_nmt.data.corpus import path_kind
from hf_deep_nmt.fingerprints import check_tokenizer_matches
from hf_deep_nmt.folders import atomic_file
from hf_deep_nmt.memory import check_memory, check_saved_model_size
from hf_deep_nmt.model_folders import check_saved_json_files
from hf_deep_nmt.serving.options import MAX_LENGTH_A, MAX_OUTPUT_TOKENS, MAX_SOURCE_TOKENS, DecodingOptions  # noqa: F401
from hf_deep_nmt.training.evaluation import length_penalty as penalty_divisor
from hf_deep_nmt.weights import check_finite_weights, check_missing_weights

# The caps (MAX_*) are `DecodingOptions`' (`hf_deep_nmt.serving.options`) and stay importable from here.

# Compiled decoding: static-cache lengths are rounded up to a multiple of this, so that batches with similar output
# caps share one compiled decoding step (`generate()` keeps the longest cache length it has seen).
STATIC_CACHE_BUCKET = 64


def own_forward(model: PreTrainedModel) -> Callable:
    """`model.forward` bound to a copy of its function with a code object of its own. torch.compile keeps compiled
    graphs, and counts recompilations against `torch._dynamo.config.recompile_limit` (8), per code object, and every
    model of this package (every transformers model, through its decorators) runs the same `forward` code: compiled
    as it is, the fifth model compiled in a process hit the limit after the first four's two graphs each and failed
    under `fullgraph=True` (ran eager without it). With its own code object each model's graphs are its own.
    A forward set on the instance that is not a method of the model (a hook's wrapper, say) is returned as it is."""
    bound = model.forward
    function = getattr(bound, "__func__", None)
    if getattr(bound, "__self__", None) is not model or not isinstance(function, types.FunctionType):
        return bound
    twin = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    twin.__kwdefaults__ = function.__kwdefaults__
    twin.__dict__.update(function.__dict__)  # `__wrapped__` among them: the signature generate() inspects
    twin.__qualname__, twin.__doc__, twin.__module__ = function.__qualname__, function.__doc__, function.__module__
    return types.MethodType(twin, model)


@contextlib.contextmanager
def compiled_decoding(model: PreTrainedModel, longest_output: int, backend: str = "inductor") -> Iterator[dict]:
    """Inside: `model.forward` compiled as one graph (CUDA graphs on CUDA through `mode="reduce-overhead"`, Inductor
    code elsewhere; another `backend`, e.g. "aot_eager", only for checks), compiled once per model and backend and
    kept; yields the `generate()` options that go with it, the static cache sized to a multiple of
    `STATIC_CACHE_BUCKET` slots above `longest_output`. Compiling the forward itself, rather than transformers'
    `compile_config` route, covers beam search, which that route leaves eager. The first decoding call of each batch
    (an empty cache) and each new shape compile once; the rest replays. Each model compiles its own graphs
    (`own_forward`), so any number of models, of any families, can be compiled in one process."""
    kept = model.__dict__.setdefault("_hf_deep_nmt_compiled_forward", {})
    compiled = kept.get(backend)
    if compiled is None:
        device = next(model.parameters()).device
        mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
        forward = own_forward(model)
        compiled = kept[backend] = torch.compile(forward, fullgraph=True, backend=backend, mode=mode)
    own = model.__dict__.get("forward")
    model.forward = compiled
    bucket = -(-(longest_output + 1) // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
    try:
        yield dict(cache_implementation="static", max_cache_len=bucket, disable_compile=True)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads() -> int:
    """The thread count `translate` uses unless told (`--threads`): `OMP_NUM_THREADS` when set; else the cores this
    process may use less the load average of the last minute (the runnable work already there), at least 1. On an
    idle machine that is every usable core; on a busy one it keeps torch's threads from waiting on each other for
    cores the other work holds (a 2-thread run on a loaded 2-core machine was measured burning 6x the CPU time of a
    1-thread one, issue 39)."""
    configured = os.environ.get("OMP_NUM_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    cores = usable_cores()
    try:
        busy = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        busy = 0.0
    return max(1, min(cores, cores - round(busy)))


def set_threads(threads: int | None = None) -> int:
    """Run torch's CPU operations on `threads` threads (`default_threads()` when None), intra-op and inter-op alike,
    and return the count. The inter-op pool can only be sized before its first use in the process; after that it is
    left as it is (`generate()` does not use it)."""
    if threads is None:
        threads = default_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"`threads` must be a positive integer, got {threads!r}.")
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != threads:
        with contextlib.suppress(
            RuntimeError
        ):  # "cannot set number of interop threads after parallel work has started"
            torch.set_num_interop_threads(threads)
    return threads


class SourceRelativeMaxLength(LogitsProcessor):
    """Force `</s>` once a hypothesis has `limits[i]` tokens, `i` being its source sentence (rows of a beam search
    are grouped by sentence, `num_beams` consecutive rows each)."""

    def __init__(self, limits: torch.Tensor, eos_token_id: int, prompt_length: int = 1):
        self.limits, self.eos_token_id, self.prompt_length = limits, eos_token_id, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows_per_sentence = input_ids.shape[0] // self.limits.shape[0]
        limits = self.limits.to(input_ids.device).repeat_interleave(rows_per_sentence)
        done = (input_ids.shape[1] - self.prompt_length) >= limits
        if done.any():
            scores = scores.clone()
            scores[done] = -float("inf")
            scores[done, self.eos_token_id] = 0.0
        return scores


def _output_length(tokens: torch.Tensor, eos_token_id: int) -> int:
    """Tokens up to and including the first `</s>` (all of them when there is none)."""
    positions = (tokens == eos_token_id).nonzero()
    return int(positions[0, 0]) + 1 if len(positions) else int(tokens.shape[0])


def load_model(model_name: str, device: str | torch.device = "cpu"):
    """(model on `device`, tokenizer) of a saved model folder or Hub id, as the commands load it: before anything is
    built, the config must not describe more parameters than the weights hold, and the model must fit `device`'s
    memory (`check_saved_model_size`); after loading, a weight the file lacks (initialised at random) and NaN or
    infinite weights are refused, naming them, as is a tokenizer that is not the model's (`check_tokenizer_matches`).
    """
    folder = Path(str(model_name)).expanduser()
    if folder.is_dir():
        check_saved_json_files(folder)
        check_saved_model_size(folder, device)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model, info = AutoModelForSeq2SeqLM.from_pretrained(model_name, output_loading_info=True)
    check_missing_weights(model, info, str(model_name))
    check_finite_weights(model, str(model_name))
    check_tokenizer_matches(model, tokenizer)
    return model.to(device), tokenizer


def decoding_memory(config, rows: int, source_tokens: int, output_tokens: int) -> int:
    """Bytes that beam search holds at its peak for `rows` hypotheses (sentences x beams) of `source_tokens` source
    and `output_tokens` output tokens, in float32: the decoder's self-attention keys and values and the cached
    cross-attention ones, the expanded encoder output, and three copies of the scores over the target vocabulary
    (logits, log-probabilities, processed scores). An estimate for refusing a decoding that cannot fit; the
    activations of one step are small beside these."""
    d = int(config.d_model)
    layers = int(config.decoder_layers)
    vocab = int(getattr(config, "decoder_vocab_size", None) or config.vocab_size)
    cache = 2 * layers * rows * (source_tokens + output_tokens) * d
    return 4 * (cache + rows * source_tokens * d + 3 * rows * vocab)


def check_decoding_memory(model: PreTrainedModel, sentences: int, num_beams: int, source: int, output: int) -> None:
    """`InsufficientMemoryError` stating the estimate (`decoding_memory`) when a batch of `sentences` decoded with
    `num_beams` beams cannot fit the memory of the model's device, before it is tried."""
    device = next(model.parameters()).device
    needed = decoding_memory(model.config, sentences * num_beams, source, output)
    check_memory(
        needed,
        f"Beam search over a batch of {sentences} sentence(s) x {num_beams} beam(s) = {sentences * num_beams} "
        f"hypotheses, up to {source} source and {output} output tokens",
        "lower --num-beams (`num_beams`), --batch-size or --max-tokens",
        device,
    )


def check_translation_options(*args, **settings) -> None:
    """`ValueError` naming the first decoding option out of its range (the options of `translate`, positional in the
    order of `DecodingOptions`' fields, or by name); nothing is replaced by a default. Cheap: call it before loading
    a model or training one. The checks are `DecodingOptions`' own."""
    names = [item.name for item in dataclasses.fields(DecodingOptions)]
    if len(args) > len(names):
        raise TypeError(f"check_translation_options takes at most {len(names)} options ({names}), got {len(args)}.")
    DecodingOptions.build(**dict(zip(names, args)), **settings)


def _check_sentences(sentences) -> None:
    if isinstance(sentences, str) or not all(isinstance(sentence, str) for sentence in sentences):
        raise TypeError("`sentences` must be a list of strings.")


def iter_translations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    options: DecodingOptions | None = None,
    *,
    progress: bool = False,
    compile: bool = False,
    **settings,
) -> Iterator[list[str]]:
    """The translations of `sentences` in input order, yielded in pieces as soon as they are known: after each batch,
    the translations that now follow, without a gap, those already yielded.

    The options (`options`, with single `settings` by name replacing its values: `DecodingOptions.build`) are
    checked, every sentence is tokenized and an overlong one refused (`ValueError` naming its line) when this
    function is called, before anything is translated, as is a decoding whose largest batch would not fit the memory
    of the model's device (`InsufficientMemoryError` stating the estimate, `check_decoding_memory`). Batches are
    formed within windows of `buffer_size` consecutive sentences (`None`: one window), sorted by length inside a
    window and run in the order of their first sentence, so a stopped run has produced a prefix of the input. See
    `translate` for the options.
    """
    _check_sentences(sentences)
    if not isinstance(compile, bool):
        raise ValueError(f"`compile` must be True or False, got {compile!r}.")
    options = DecodingOptions.build(options, **settings)
    if _is_onnx(model):
        _check_onnx_decoding(model, tokenizer, options, compile)
    else:
        check_tokenizer_matches(model, tokenizer)
    wanted = [index for index, sentence in enumerate(sentences) if sentence.strip()]
    # the length check is ours (below): no tokenizer warning about its own maximum
    encoded = {index: tokenizer(sentences[index], verbose=False)["input_ids"] for index in wanted}
    limit = options.max_source_tokens
    if limit is not None:
        overlong = [index for index in wanted if len(encoded[index]) > limit]
        if overlong:
            first = overlong[0]
            raise ValueError(
                f"{len(overlong)} input line(s) are longer than {limit} tokens (line {first + 1} has "
                f"{len(encoded[first])}); split them into sentences, or raise the limit (`max_source_tokens`, "
                "`--max-source-tokens`) knowing that the time grows with the square of the length."
            )
    size = options.buffer_size or max(len(wanted), 1)
    windows = [wanted[start : start + size] for start in range(0, len(wanted), size)]
    batches = [_window_batches(window, encoded, options.batch_size, options.max_tokens) for window in windows]
    if not _is_onnx(model):  # the estimate is of torch's decoding, from the model's config
        _check_batches_fit(model, batches, encoded, options)
    return _translated_pieces(model, tokenizer, len(sentences), batches, encoded, progress, options, compile)


def _is_onnx(model) -> bool:
    from hf_deep_nmt.serving.onnx import OnnxDecoder

    return isinstance(model, OnnxDecoder)


def _check_onnx_decoding(decoder, tokenizer, options: DecodingOptions, compile: bool) -> None:
    """Refuse, naming it, what the ONNX Runtime backend cannot do as asked, and a tokenizer whose padding or end id
    is not the graphs'."""
    if compile:
        raise ValueError(
            "`compile=True` (`--compile`) compiles the torch model; the ONNX Runtime backend runs its exported "
            "graphs: "
            "drop it."
        )
    if options.gnmt:
        raise ValueError(
            '`length_penalty_form="gnmt"` (`--length-penalty-form gnmt`) rescores every final beam, and the ONNX '
            "Runtime backend's beam search returns the best one only: use the fairseq form, or the torch backend."
        )
    ids = {"pad": (tokenizer.pad_token_id, decoder.pad), "end": (tokenizer.eos_token_id, decoder.eos)}
    for name, (tokenizer_id, graph_id) in ids.items():
        if tokenizer_id != graph_id:
            raise ValueError(
                f"The tokenizer's {name} id is {tokenizer_id}, the ONNX graphs' is {graph_id}: use the tokenizer "
                "saved with the graphs."
            )


def _window_batches(window: list[int], encoded, batch_size: int, max_tokens: int | None) -> list[list[int]]:
    """The batches (sentence indices) of one window, in the order they are run."""
    lengths = [len(encoded[index]) for index in window]
    # No token budget: `batch_size` sentences a batch. A sentence longer than the budget goes on its own.
    budget = max(max_tokens or batch_size * max(lengths), max(lengths))
    groups = sorted(token_batches(lengths, budget, max_sentences=batch_size), key=min)
    return [[window[position] for position in group] for group in groups]


def _check_batches_fit(model, batches, encoded, options: DecodingOptions) -> None:
    """Refuse, before the first batch, a decoding whose largest batch cannot fit (`check_decoding_memory`)."""
    largest = None
    for batch in (batch for window in batches for batch in window):
        source = max(len(encoded[index]) for index in batch)
        output = options.output_cap(source) + 2  # the start token and `</s>`
        needed = decoding_memory(model.config, len(batch) * options.num_beams, source, output)
        largest = max(largest or (needed, len(batch), source, output), (needed, len(batch), source, output))
    if largest is not None:
        check_decoding_memory(model, largest[1], options.num_beams, largest[2], largest[3])


def _translated_pieces(model, tokenizer, count, batches, encoded, progress, options, compile) -> Iterator[list[str]]:
    onnx = _is_onnx(model)
    if not onnx:
        model.eval()
    device = None if onnx else next(model.parameters()).device
    outputs: dict[int, str] = {index: "" for index in range(count) if index not in encoded}
    done = 0  # translations 0 .. done - 1 have been yielded

    def ready() -> list[str]:
        nonlocal done
        piece = []
        while done in outputs:
            piece.append(outputs.pop(done))
            done += 1
        return piece

    with tqdm(total=count, desc="Translating", unit="sent", disable=not progress, file=sys.stderr) as bar:
        bar.update(len(outputs))
        for window in batches:
            for indices in window:
                sources = [encoded[index] for index in indices]
                texts = _translate_batch(model, tokenizer, sources, device, options, compile)
                outputs.update(zip(indices, texts))
                bar.update(len(indices))
                if piece := ready():
                    yield piece
        if piece := ready():
            yield piece


def _translate_batch(model, tokenizer, sources, device, options: DecodingOptions, compile: bool) -> list[str]:
    if device is None:  # an `OnnxDecoder`
        from hf_deep_nmt.serving.onnx import translate_batch

        return translate_batch(model, tokenizer, sources, options)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    batch = tokenizer.pad({"input_ids": sources}, return_tensors="pt").to(device)
    limits = options.output_limits(batch["attention_mask"].sum(dim=1))
    longest = int(limits.max())
    decoding = compiled_decoding(model, longest + 1) if compile else contextlib.nullcontext({})
    with torch.inference_mode(), decoding as extra:
        generated = model.generate(
            **batch,
            **options.generate_kwargs(longest),
            logits_processor=LogitsProcessorList([SourceRelativeMaxLength(limits, eos)]),
            **extra,
        )
    sequences = generated.sequences
    if options.gnmt:
        beams = options.num_beams
        penalties = torch.tensor(
            [penalty_divisor(_output_length(row[1:], eos), options.length_penalty, "gnmt") for row in sequences],
            device=sequences.device,
        )
        best = (generated.sequences_scores / penalties).view(len(sources), beams).argmax(dim=1)
        sequences = sequences.view(len(sources), beams, -1)[torch.arange(len(sources)), best]
    return [text.strip() for text in tokenizer.batch_decode(sequences, skip_special_tokens=True)]


def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    options: DecodingOptions | None = None,
    *,
    progress: bool = False,
    compile: bool = False,
    **settings,
) -> list[str]:
    """Translate `sentences`; output order follows the input, an empty line gives an empty line.

    The decoding is `options` (a `DecodingOptions`; its defaults when None), with single settings given by name
    (`num_beams=2`, ...) replacing its values. Batches hold sentences of similar length: at most `batch_size`
    sentences and, with `max_tokens`, at most that many padded source tokens. Each sentence may produce at most
    `max_length_a * source_tokens + max_length_b` tokens before `</s>` (source tokens counting its `</s>`), so long
    inputs are never cut at the 20-token default of `generate()`, and never more than `max_output_tokens`
    (`MAX_OUTPUT_TOKENS`, 1024). A sentence of more than `max_source_tokens` tokens (`MAX_SOURCE_TOKENS`, 1024;
    `None`: no limit) is refused before anything is translated. `length_penalty_form="fairseq"` divides a
    hypothesis' log-probability by `|Y|^alpha` (what `generate()` does); `"gnmt"` by `((5 + |Y|) / 6)^alpha`, applied
    by rescoring the `num_beams` finished hypotheses that beam search (run without a penalty) returns. `buffer_size`
    sentences at a time are sorted into batches (`None`: all of them). Options out of range are refused (by
    `DecodingOptions`), as is a tokenizer whose vocabulary or padding / end ids do not match the model
    (`ValueError`). `compile=True` decodes with the static cache and a compiled decoding step (`compiled_decoding`):
    the same translations, faster once compiled where launches dominate (small batches on a GPU), at the price of a
    compilation per new shape. `model` may be an `OnnxDecoder` (`hf_deep_nmt.serving.onnx.load_onnx_model`): the
    same decoding on ONNX Runtime, greedy or beam search with the fairseq penalty (not `compile`, not the GNMT form).
    """
    pieces = iter_translations(model, tokenizer, sentences, options, progress=progress, compile=compile, **settings)
    return [text for piece in pieces for text in piece]


# ---- files ----------------------------------------------------------------------------------------------------------


def split_lines(text: str) -> list[str]:
    r"""Lines of `text` split on `\n` alone, so U+0085, U+2028, U+2029, form feed or `\x1c`-`\x1e` inside a line keep
    it one line (`str.splitlines` would split there). A final `\n` ends the last line rather than starting an empty
    one, and one `\r` before each `\n` (or at the very end) is dropped, so a CRLF file gives the same lines as its LF
    copy; a `\r` elsewhere stays in its line."""
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def decode_lines(data: bytes, name: str) -> list[str]:
    """`split_lines` of UTF-8 `data` (a leading byte-order mark dropped); `ValueError` naming `name`, the line and
    the byte offset of the first byte that is not UTF-8."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(
            f"{name} is UTF-16 text (it starts with a UTF-16 byte-order mark), not UTF-8; convert it first, keeping "
            "every character: `iconv -f UTF-16 -t UTF-8`."
        )
    if b"\0" in data:
        at = data.index(b"\0")
        line = data.count(b"\n", 0, at) + 1
        raise ValueError(
            f"{name} holds NUL bytes (the first at byte {at}, line {line}): UTF-16 text "
            "without a byte-order mark, or not text at all; convert UTF-16 to UTF-8 first (`iconv -f UTF-16LE -t "
            "UTF-8`, or UTF-16BE), or remove the NUL bytes (`tr -d '\\000'`)."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{name} is not valid UTF-8: byte {error.start} (line {line}) is 0x{data[error.start]:02x} "
            f"({error.reason}); find its encoding (`file -i`) and convert it to UTF-8 first "
            "(`iconv -f ENCODING -t UTF-8`)."
        ) from None
    return split_lines(text.removeprefix("\ufeff"))


def read_lines(source: str | Path = "-") -> list[str]:
    """The lines of a UTF-8 text file (`-`: stdin), split as `split_lines` does. A missing path, a folder or
    anything but a regular file (a FIFO, a device) is refused naming it, as are bytes that are not UTF-8."""
    if str(source) == "-":
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream put in place of stdin
            return split_lines(sys.stdin.read().removeprefix("\ufeff"))
        return decode_lines(stream.read(), "stdin")
    path = Path(source)
    kind = path_kind(path)
    if kind == "missing":
        raise FileNotFoundError(f"input file not found: {source}")
    if kind == "loop":
        raise ValueError(
            f"input {source} is a loop of symbolic links (it leads back to itself); point the link at the text file."
        )
    if kind == "dangling":
        raise FileNotFoundError(f"input file not found: {source} is a symbolic link to a missing file")
    if kind == "folder":
        raise IsADirectoryError(f"input {source} is a folder, not a text file; name a file in it.")
    if kind == "special":
        raise ValueError(
            f"input {source} is not a regular file (a FIFO, socket or device); pass its text on stdin instead "
            f"(`--input -` and `< {source}`)."
        )
    try:
        data = path.read_bytes()
    except PermissionError:
        raise PermissionError(f"cannot read the input file {source}: permission denied.") from None
    return decode_lines(data, str(source))


def _same_file(first: Path, second: Path) -> bool:
    try:
        return os.path.samefile(first, second)
    except OSError:
        return first.resolve() == second.resolve()


def _stdin_is(path: Path) -> bool:
    """Whether stdin is the regular file `path` (`< path` on the command line): compared by device and inode, so that
    any name of the file counts."""
    try:
        stdin = os.fstat(sys.stdin.fileno())
        output = os.stat(path)
    except (OSError, AttributeError, ValueError):  # no stdin, a text stream put in its place, no such file
        return False
    return stat.S_ISREG(stdin.st_mode) and (stdin.st_dev, stdin.st_ino) == (output.st_dev, output.st_ino)


def check_output_path(target: str | Path, source: str | Path = "-", overwrite: bool = False) -> None:
    """Refuse an output path before any work: the input file itself (by any name: symbolic or hard link, relative
    path; the file stdin is read from when the input is `-`; even with `overwrite`), an existing file unless
    `overwrite`, a folder, a missing or unwritable folder. Devices and FIFOs (`/dev/null`) hold nothing that could be
    lost and are accepted."""
    if str(target) == "-":
        return
    path = Path(target)
    if str(source) != "-" and os.path.lexists(path) and _same_file(path, Path(source)):
        raise ValueError(
            f"output {target} is the input file {source}: the translations would replace the text being translated; "
            "write them to another file."
        )
    if str(source) == "-" and _stdin_is(path):
        raise ValueError(
            f"output {target} is the file stdin is read from (`< {target}`): the translations would replace the text "
            "being translated; write them to another file."
        )
    if path.is_dir():
        raise IsADirectoryError(f"output {target} is a folder; name a file (e.g. {path / 'translations.txt'}).")
    if os.path.lexists(path):
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):
            return
        if not overwrite:
            raise FileExistsError(
                f"output file {target} exists; choose another name, or pass --overwrite (`overwrite=True`) to "
                "replace it."
            )
        if not os.access(path, os.W_OK):
            raise PermissionError(f"cannot write the output file {target}: permission denied.")
        return
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"the folder of output {target} does not exist ({folder}); create it first.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create the output file {target}: the folder {folder} is not writable.")


class _OutputFile:
    """Opened at the first write, so that a run failing before its first translation creates no file. A file is
    written under a temporary name beside it and renamed into place once every line is written (`atomic_file`): an
    interrupted run never leaves a truncated file where a good one was, and a file being read meanwhile (`cat F |
    ... --output F --overwrite`) keeps its text until the end. Without `overwrite` the rename never replaces a file
    that appeared meanwhile. stdout, devices and FIFOs (`/dev/null`) are written directly."""

    def __init__(self, target: str | Path, overwrite: bool):
        self.target, self.overwrite, self.stream, self.lines = target, overwrite, None, 0
        self._file: contextlib.ExitStack | None = None

    @property
    def partial(self) -> str | None:
        """The temporary file being written (None for stdout, a device or a FIFO)."""
        return self.stream.name if self._file is not None else None

    def write(self, lines: list[str]) -> None:
        if self.stream is None:
            if str(self.target) == "-":
                self.stream = sys.stdout
            elif os.path.exists(self.target) and not os.path.isfile(self.target):  # /dev/null, a FIFO
                self.stream = open(self.target, "w", encoding="utf-8", newline="\n")
            else:
                self._file = contextlib.ExitStack()
                output = atomic_file(
                    self.target, replace=self.overwrite, keep_on_error=True, encoding="utf-8", newline="\n"
                )
                self.stream = self._file.enter_context(output)
        # a translation never holds a line break: every output line stays opposite its input line
        self.stream.write("".join(line.replace("\r", " ").replace("\n", " ") + "\n" for line in lines))
        self.stream.flush()
        self.lines += len(lines)

    def close(self, error: BaseException | None = None) -> None:
        """Put the file in place (no `error`), or keep the temporary file with the lines written so far."""
        if self._file is not None:
            if error is None:
                self._file.close()
            else:
                self._file.__exit__(type(error), error, error.__traceback__)
        elif self.stream is not None and self.stream is not sys.stdout:
            self.stream.close()


def write_translations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    lines: Sequence[str],
    target: str | Path = "-",
    options: DecodingOptions | None = None,
    *,
    overwrite: bool = False,
    **settings,
) -> int:
    """Translate `lines` into `target` (`-`: stdout), one line each, streamed in input order and flushed after every
    batch. A file is written under a temporary name beside it and renamed to `target` once complete, so a stopped run
    never leaves a truncated `target` (nor destroys the one it replaces); an error after the first translation keeps
    the temporary file with the lines written and names it (an exception note). Nothing is written before the first
    translation.
    `options` and `settings` are those of `translate` (`progress`, `compile` too); without `options`, 1000 lines at
    a time are sorted into batches unless `buffer_size` says otherwise. Returns the number of lines."""
    check_output_path(target, overwrite=overwrite)
    if options is None:
        settings.setdefault("buffer_size", 1000)
    pieces = iter_translations(model, tokenizer, lines, options, **settings)
    output = _OutputFile(target, overwrite)
    try:
        for piece in pieces:
            output.write(piece)
        if output.stream is None:
            output.write([])
    except BaseException as error:
        output.close(error)
        if output.lines and output.partial is not None:
            error.add_note(
                f"the first {output.lines} of {len(lines)} translations are in {output.partial} ({target} was not "
                "changed)"
            )
        elif output.lines and str(target) != "-":
            error.add_note(f"the first {output.lines} of {len(lines)} translations were written to {target}")
        raise
    output.close()
    return len(lines)


def translate_file(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    source: str | Path = "-",
    target: str | Path = "-",
    options: DecodingOptions | None = None,
    *,
    overwrite: bool = False,
    **settings,
) -> int:
    r"""Translate a UTF-8 text file (`-`: stdin), one sentence per `\n` line (`read_lines`), into `target` (`-`:
    stdout), line for line (`write_translations`). The output may not be the input file, nor an existing file
    unless `overwrite`. Returns the number of lines. `options` and `settings` are those of `write_translations`."""
    check_output_path(target, source, overwrite)
    lines = read_lines(source)
    return write_translations(model, tokenizer, lines, target, options, overwrite=overwrite, **settings)
