"""`hf-deep-nmt train|train-staged|prepare|translate|serve|average|push|inspect|doctor|export-ctranslate2|
export-onnx|upgrade-code|convert-marian|grow`: thin command-line front ends over the library.

Every expected failure ends in one line on stderr naming the problem and the way out: exit code 2 for a mistake in
what was asked (a bad value, a missing or existing file), 1 for a run that failed (out of memory, a write error, no
network, a NaN in training). `hf-deep-nmt --debug COMMAND ...` or `HF_DEEP_NMT_DEBUG=1` adds the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import os
import re
import sys
import textwrap
import traceback
from pathlib import Path

DEBUG_VARIABLE = "HF_DEEP_NMT_DEBUG"


class UsageError(ValueError):
    """A command line that cannot be run as written (exit code 2)."""


def _deprecated(prog: str, old: str, new: str) -> None:
    """The one stderr line of an earlier spelling, kept for one release, naming the one that replaces it."""
    print(f"{prog}: {old} is deprecated and goes in the next release; write {new}.", file=sys.stderr)


class _Renamed(argparse.Action):
    """An earlier spelling of a flag: it sets the new flag's value and says so (`_deprecated`)."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        _deprecated(parser.prog, option_string, self.new)
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose mistakes are `UsageError`s, reported in one line like every other mistake; it keeps
    earlier spellings working for one release (`renamed`, `parse` with `positionals`)."""

    required_flags: tuple = ()  # checked by `parse`, after a previous spelling may have given them

    def error(self, message: str):
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def format_usage(self) -> str:
        return self._with_required_flags(super().format_usage)

    def format_help(self) -> str:
        return self._with_required_flags(super().format_help)

    def _with_required_flags(self, format_text) -> str:
        """`format_text()` with the `required_flags` shown as required, as argparse shows its own."""
        actions = [action for action in self._actions if set(action.option_strings) & set(self.required_flags)]
        for action in actions:
            action.required = True
        try:
            return format_text()
        finally:
            for action in actions:
                action.required = False

    def renamed(self, old: str, new: str, **kwargs) -> None:
        """Accept the flag `old` for `new` (hidden from --help)."""
        self.add_argument(old, dest=_dest(new), action=_Renamed, new=new, help=argparse.SUPPRESS, **kwargs)

    def parse(self, argv: list[str], positionals: tuple = (), required: tuple = ()) -> argparse.Namespace:
        """`argv` parsed. `positionals`: the (flag, METAVAR) pairs that were positional arguments, in their order
        (`grow MODEL OUT` is now `grow --model MODEL --output OUT`); `required`: the flags that must be given, one
        way or the other."""
        self.required_flags = required
        if positionals:
            metavar = " ".join(name for _, name in positionals)
            self.add_argument("previous_positionals", nargs="*", type=_path, metavar=metavar, help=argparse.SUPPRESS)
        args = self.parse_intermixed_args(argv)
        given = getattr(args, "previous_positionals", None) or []
        if len(given) > len(positionals):
            self.error(f"unrecognized arguments: {' '.join(given[len(positionals) :])}")
        pairs = positionals[: len(given)]
        for value, (flag, _) in zip(given, pairs):
            if getattr(args, _dest(flag)) is not None:
                self.error(f"{value!r} and {flag} both name the {flag[2:]}; give {flag} only")
            setattr(args, _dest(flag), value)
        if pairs:
            old = "the positional " + " ".join(metavar for _, metavar in pairs)
            _deprecated(self.prog, old, " ".join(f"{flag} {metavar}" for flag, metavar in pairs))
        missing = [flag for flag in required if getattr(args, _dest(flag)) is None]
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return args


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _path(text: str) -> str:
    """A path or Hub id argument: an empty one would be read as the current folder (`Path("")` is `.`)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a path, got {text!r}")
    return text


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


# The Trainer's settings (`Seq2SeqTrainingArguments`) that recipes set most, shown by `train --help` after the
# recipe's own; `--help-all` lists all of them, with transformers' own help (importing it takes seconds).
COMMON_TRAINER_SETTINGS = (
    ("output_dir", "TEXT", "folder of the run: checkpoints, results, curves (required)"),
    ("max_steps", "N", "optimizer steps to train (-1: train num_train_epochs)"),
    ("num_train_epochs", "X", "epochs to train when max_steps is -1"),
    ("learning_rate", "X", "the peak learning rate (see lr_schedule)"),
    ("warmup_steps", "N", "steps of the learning-rate warm-up"),
    ("per_device_train_batch_size", "N", "sentences per training batch and device (unless max_tokens is set)"),
    ("per_device_eval_batch_size", "N", "sentences per evaluation batch and device"),
    ("gradient_accumulation_steps", "N", "batches per optimizer step"),
    ("label_smoothing_factor", "X", "label smoothing of the loss, in [0, 1)"),
    ("weight_decay", "X", "AdamW weight decay"),
    ("adam_beta2", "X", "AdamW's second-moment decay (0.98 in the papers)"),
    ("max_grad_norm", "X", "gradient clipping norm (0: no clipping)"),
    ("eval_strategy", "no|steps|epoch", "when to evaluate during training"),
    ("eval_steps", "N", "steps between evaluations"),
    ("save_strategy", "no|steps|epoch", "when to save a checkpoint"),
    ("save_steps", "N", "steps between checkpoints"),
    ("save_total_limit", "N", "checkpoints kept (default: all)"),
    ("logging_steps", "N", "steps between log lines"),
    ("seed", "N", "seed of the run (also draws a new tokenizer's training pairs)"),
    ("bf16", "[true|false]", "train in bfloat16 mixed precision"),
    ("fp16", "[true|false]", "train in float16 mixed precision (a GPU only)"),
    ("use_cpu", "[true|false]", "train on the CPU even where a GPU is visible"),
    ("resume_from_checkpoint", "PATH|last", "continue from this checkpoint folder, or from the newest (last)"),
    ("report_to", "TEXT", "where to log besides the console: none, tensorboard, wandb, ..."),
)
# What `prepare` reads of a recipe: where the tokenizer comes from or how it is trained, the data, and the seed.
PREPARE_MODEL_SETTINGS = (
    "model_name_or_path",
    "tokenizer_name_or_path",
    "tokenizer_vocab_size",
    "tokenizer_model",
    "tokenizer_train_pairs",
)
PREPARE_SKIPPED_DATA_SETTINGS = ("streaming", "stream_buffer_pairs")  # a streamed corpus has nothing to prepare
RECIPE_USAGE = "hf-deep-nmt {command} RECIPE.json|yaml [--setting VALUE ...]"


def _show(text: str) -> None:
    """Print help on stdout; a reader that stops early (`| head`) ends it quietly, as it ends `git log`."""
    try:
        sys.stdout.write(text.rstrip("\n") + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit


def _recipe_groups(command: str) -> list[tuple[str, tuple]]:
    """The settings `command --help` lists, as (title, rows) with rows as in `cli_reference.RECIPE_SETTINGS`."""
    from hf_deep_nmt.cli_reference import RECIPE_SETTINGS as settings

    common = tuple((name, metavar, None, text) for name, metavar, text in COMMON_TRAINER_SETTINGS)
    if command == "prepare":
        model = tuple(row for row in settings["ModelArguments"] if row[0] in PREPARE_MODEL_SETTINGS)
        data = tuple(row for row in settings["DataArguments"] if row[0] not in PREPARE_SKIPPED_DATA_SETTINGS)
        return [("tokenizer", model), ("data", data), ("run", tuple(r for r in common if r[0] == "seed"))]
    groups = [
        ("model and tokenizer", settings["ModelArguments"]),
        ("data", settings["DataArguments"]),
        ("evaluation and export", settings["EvalExportArguments"]),
        ("training: this package's settings", settings["DeepNMTTrainingArguments"]),
    ]
    if command == "train-staged":
        groups.append(("stages", settings["StageArguments"]))
    return [*groups, (f"training: the Trainer's most used (all of them: hf-deep-nmt {command} --help-all)", common)]


def _recipe_help(command: str) -> str:
    """`command --help` for a recipe command, without importing transformers: the recipe's own settings, then the
    Trainer's most used."""
    if command == "prepare":
        what = (
            "Tokenize a recipe's data ahead of training (e.g. on a CPU node) into a prepared-data folder that `train` "
            "and `train-staged` of the same data and settings reuse. The recipe is read as `train` reads it; only the "
            "settings below are used, and no output folder is touched."
        )
    else:
        staged = " in stages of growing encoder depth (SDT)" if command == "train-staged" else ""
        what = (
            f"Train a model{staged} from a recipe, evaluate it (sacreBLEU), translate a few sentences and export a "
            f"Hub-ready folder. Below: the recipe's own settings, then the Trainer's most used; `hf-deep-nmt {command}"
            " --help-all` lists every setting of the Trainer (Seq2SeqTrainingArguments)."
        )
    parser = argparse.ArgumentParser(
        prog=f"hf-deep-nmt {command}",
        usage=RECIPE_USAGE.format(command=command),
        description=f"{what} A recipe is a JSON or YAML file of settings (keys in snake case: source_lang); a "
        "flag after it overrides one (--source-lang de).",
        add_help=False,
    )
    for title, rows in _recipe_groups(command):
        group = parser.add_argument_group(title)
        for name, metavar, default, text in rows:
            if default is not None and "default" not in text.lower():
                text = f"{text} (default: {default})"
            group.add_argument("--" + name.replace("_", "-"), metavar=metavar, help=text.replace("%", "%%"))
    return parser.format_help()


def _recipe_command(command: str, argv: list[str]) -> list[str] | None:
    """The command line of `train`, `train-staged` or `prepare` with its flags in kebab case; None when it asked for
    help, which is printed. The earlier snake case (--max_steps) still works for one release."""
    if "--help-all" in argv:
        from transformers import HfArgumentParser

        from hf_deep_nmt.training.arguments import ARGUMENT_CLASSES, StageArguments

        classes = ARGUMENT_CLASSES if command == "train" else (*ARGUMENT_CLASSES, StageArguments)
        parser = HfArgumentParser(classes, prog=f"hf-deep-nmt {command}", usage=RECIPE_USAGE.format(command=command))
        for action in parser._actions:  # each setting under its kebab-case flag alone, the spelling to use
            action.option_strings = [
                flag for flag in action.option_strings if "_" not in flag
            ] or action.option_strings
        _show(parser.format_help())
        return None
    if "-h" in argv or "--help" in argv:
        _show(_recipe_help(command))
        return None
    flags = []
    for item in argv:
        name, equals, value = item.partition("=")
        if item.startswith("--") and "_" in name:
            _deprecated(f"hf-deep-nmt {command}", name, name.replace("_", "-"))
            item = name.replace("_", "-") + equals + value
        flags.append(item)
    return flags


def _train(argv: list[str]) -> int:
    argv = _recipe_command("train", argv)
    if argv is None:
        return 0
    from hf_deep_nmt.training.recipes import recipe_path

    recipe_path(argv)  # a missing recipe file is refused before torch and transformers are imported
    from hf_deep_nmt.training.pipeline import run

    summary = run(argv)
    printable = {key: value for key, value in summary.items() if key != "examples"}
    print(json.dumps(printable, indent=2, ensure_ascii=False))
    return 0


def _train_staged(argv: list[str]) -> int:
    argv = _recipe_command("train-staged", argv)
    if argv is None:
        return 0
    from hf_deep_nmt.training.recipes import recipe_path

    recipe_path(argv)  # a missing recipe file is refused before torch and transformers are imported
    from hf_deep_nmt.training.staged import run_staged

    summary = run_staged(argv)
    printable = {key: value for key, value in summary.items() if key != "examples"}
    print(json.dumps(printable, indent=2, ensure_ascii=False))
    return 0


def _prepare(argv: list[str]) -> int:
    argv = _recipe_command("prepare", argv)
    if argv is None:
        return 0
    from hf_deep_nmt.training.pipeline import run_prepare

    summary = run_prepare(argv)
    print(f"Prepared data: {summary['folder']} ({'reused' if summary['reused'] else 'built'})")
    print(
        f"  pairs: {summary['pairs_read']} read, {summary['pairs_kept']} kept, {summary['pairs_dropped']} dropped "
        f"(over the length limits); validation: {summary['validation_pairs']}"
    )
    tokens = f"{summary['source_tokens']} source, {summary['target_tokens']} target"
    print(f"  tokens: {tokens} ({summary['id_dtype']} ids)")
    print(f"  bytes on disk: {summary['bytes_on_disk']}; seconds: {summary['seconds']}")
    print(json.dumps(summary, ensure_ascii=False))  # the last line: one JSON object, for scripts
    return 0


def _device(text: str | None) -> str:
    """The device to load the model on, checked before anything is loaded."""
    import torch

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {text!r} is not a device name; use cpu, cuda, cuda:N or mps.") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no GPU is visible"
            raise UsageError(f"--device {text}: CUDA is not available here ({build}); use --device cpu.")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {text}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}.")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {text}: MPS (Apple GPU) is not available here; use --device cpu.")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise UsageError(
            f"--device {text}: device type {device.type!r} is not supported; use cpu, cuda, cuda:N or mps."
        )
    return text


def _check_model_source(model: str) -> None:
    """A local model folder must hold a config and tokenizer files; a name that is no local path must be a Hub
    repository id, and in offline mode one in the local cache (`check_model_folder`)."""
    from hf_deep_nmt.model_folders import check_model_folder

    check_model_folder(model, "Model folder", tokenizer=True, check_hub_id=True)


def _load(model_name: str, device: str):
    from hf_deep_nmt.serving.translate import load_model

    try:
        return load_model(model_name, device)
    except OSError as error:
        if isinstance(error, PermissionError) or Path(model_name).expanduser().exists():
            raise
        reason = " ".join(str(error).split())
        raise FileNotFoundError(
            f"Model {model_name!r} is not a local folder (no such folder: {Path(model_name).absolute()}) and could "
            f"not be loaded as a Hub repository: {reason}"
        ) from error


def _add_decoding_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """One flag per field of `DecodingOptions` (`--batch-size` for `batch_size`, ...; only `names` when given), with
    its help and its command line default."""
    from hf_deep_nmt.serving.options import DecodingOptions

    for flag, item, default in DecodingOptions.command_line_flags():
        if names is not None and item.name not in names:
            continue
        if "choices" in item.metadata:
            kind = {"choices": item.metadata["choices"]}
        elif item.type in (float, "float"):
            kind = {"type": _finite}
        else:
            kind = {"type": _at_least(item.metadata.get("minimum", 1))}
        parser.add_argument(flag, default=default, help=item.metadata["help"], **kind)


def _check_standard_streams(source: str, target: str) -> None:
    """`UsageError` when the input is stdin or the output stdout and that stream was closed when the command started
    (`<&-`, `>&-`): Python then has no stream there at all, and the text would be read from or written to nothing."""
    if source == "-" and sys.stdin is None:
        raise UsageError("--input - reads stdin, but stdin is closed; name a file with --input, or pipe the text in.")
    if target == "-" and sys.stdout is None:
        raise UsageError(
            "--output - writes to stdout, but stdout is closed; name a file with --output, or redirect stdout."
        )


def _translate_parser() -> _Parser:
    parser = _Parser(prog="hf-deep-nmt translate", description="Translate lines of text.")
    parser.add_argument(
        "--model", type=_path, required=True, help="saved model folder or Hub repo id (with its tokenizer)"
    )
    parser.add_argument(
        "--input",
        type=_path,
        default="-",
        help="UTF-8 text file, one sentence per line (split on \\n alone; default: stdin)",
    )
    parser.add_argument(
        "--output", type=_path, default="-", help="file for the translations, streamed (default: stdout)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    _add_decoding_flags(parser)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode with the static cache and a compiled decoding step (CUDA graphs on a GPU); same output",
    )
    parser.add_argument(
        "--threads",
        type=_at_least(1),
        default=None,
        help="CPU threads for torch, for ONNX Runtime's sessions with --backend onnxruntime, and for CTranslate2 with "
        "--backend ctranslate2 (default: "
        "OMP_NUM_THREADS if set, else the usable cores less the 1-minute load average, at least 1, so that no thread "
        "waits for a core other work holds)",
    )
    parser.add_argument(
        "--backend",
        choices=("torch", "onnxruntime", "ctranslate2"),
        default="torch",
        help="torch: the model's generate(); onnxruntime: the graphs of `hf-deep-nmt export-onnx` (--model: that "
        "folder, or a model folder holding them in onnx/), same decoding, on the CPU; ctranslate2: the model of "
        "`hf-deep-nmt export-ctranslate2` (that folder, or a model folder holding it in ctranslate2/), same greedy "
        "decoding, its own beam search, on the CPU",
    )
    parser.add_argument(
        "--int8",
        action="store_true",
        help="with --backend onnxruntime: the int8 graphs; with --backend ctranslate2: int8 compute",
    )
    return parser


def _translate(argv: list[str]) -> int:
    args = _translate_parser().parse_args(argv)
    _check_standard_streams(args.input, args.output)
    from hf_deep_nmt.serving.options import DecodingOptions

    # Everything the user named is checked, and the input read, before the model is loaded; the decoding options
    # before torch and transformers are imported (with the translation code).
    try:
        DecodingOptions.from_arguments(args)
    except ValueError as error:
        flag = re.sub(r"`(\w+)`", lambda match: "--" + match.group(1).replace("_", "-"), str(error), count=1)
        raise UsageError(flag) from None
    from hf_deep_nmt.serving.backends import DECODERS
    from hf_deep_nmt.serving.translate import (
        check_output_path,
        check_threads,
        read_lines,
        set_threads,
        write_translations,
    )

    DECODERS[args.backend].check_settings(device=args.device, compile=args.compile, int8=args.int8)
    check_output_path(args.output, args.input, args.overwrite)
    # torch's threads are set for the torch backend, or where something imported torch already; the ONNX Runtime and
    # CTranslate2 backends run without it
    torch_runs = args.backend == "torch" or "torch" in sys.modules
    load = _locate_decoder(args, set_threads(args.threads) if torch_runs else check_threads(args.threads))
    lines = read_lines(args.input)
    decoder, tokenizer = load()
    options = DecodingOptions.from_arguments(args, decoder.generation_config)
    progress = not args.no_progress
    write_translations(decoder, tokenizer, lines, args.output, options, overwrite=args.overwrite, progress=progress)
    return 0


def _locate_decoder(args, threads: int):
    """What the decoder of `--backend` needs before the input is read, checked (the folder of graphs; the device);
    returns the function that loads (decoder, tokenizer) once it is read."""
    if args.backend == "onnxruntime":
        from hf_deep_nmt.serving.onnx import load_onnx_model, onnx_folder, require_onnxruntime

        require_onnxruntime()
        graphs = onnx_folder(args.model, args.int8)  # before stdin is read
        return lambda: load_onnx_model(graphs, args.int8, threads)
    if args.backend == "ctranslate2":
        from hf_deep_nmt.serving.ctranslate2_decoder import (
            PURPOSE,
            ctranslate2_folder,
            load_ctranslate2_model,
            require_ctranslate2,
        )

        require_ctranslate2(PURPOSE)
        found = ctranslate2_folder(args.model)  # before stdin is read
        return lambda: load_ctranslate2_model(found, args.int8, threads)
    device = _device(args.device)

    def load():
        from hf_deep_nmt.serving.torch_decoder import TorchDecoder

        _check_model_source(args.model)
        from transformers.utils import logging

        bars = logging.is_progress_bar_enabled()
        if args.no_progress:
            logging.disable_progress_bar()  # the loading bar too
        try:
            model, tokenizer = _load(args.model, device)
        finally:
            if bars:
                logging.enable_progress_bar()
        return TorchDecoder(model, compile=args.compile), tokenizer

    return load


# the decoding options a server sets for every request (a request may choose its beams and lower its output cap);
# batching is the server's own (--max-batch-tokens, --max-batch-sentences)
SERVE_DECODING = (
    "num_beams",
    "length_penalty",
    "length_penalty_form",
    "max_length_a",
    "max_length_b",
    "max_source_tokens",
    "max_output_tokens",
)


def _port(text: str) -> int:
    port = _at_least(0)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return port


def _serve_parser() -> _Parser:
    from hf_deep_nmt.cli_reference import SERVE_BACKENDS
    from hf_deep_nmt.serving.server.limits import ServerLimits

    parser = _Parser(
        prog="hf-deep-nmt serve",
        description="Serve a model over HTTP: LibreTranslate's POST /translate, batched across requests, with "
        "GET /health, GET /metrics (Prometheus) and a page at /. SIGTERM drains: every accepted request is answered.",
    )
    parser.add_argument("--model", type=_path, required=True, help="saved model folder or Hub repo id")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: this machine only; wider wants a key)"
    )
    parser.add_argument("--port", type=_port, default=5000, help="port to listen on (default: 5000)")
    parser.add_argument(
        "--backend",
        choices=SERVE_BACKENDS,
        default=None,
        help="default: the first of these that can decode the model here (the fastest first)",
    )
    parser.add_argument(
        "--int8", action="store_true", help="int8 decoding: ONNX Runtime's int8 graphs, CTranslate2's int8 compute"
    )
    parser.add_argument("--device", default=None, help="with --backend torch: cpu, cuda, cuda:N or mps")
    parser.add_argument("--threads", type=_at_least(1), default=None, help="CPU threads for decoding")
    parser.add_argument(
        "--api-key-file",
        type=_path,
        default=None,
        help="file holding the API key /translate and /metrics then want (`api_key`, or `Authorization: Bearer`)",
    )
    for side in ("source", "target"):
        parser.add_argument(f"--{side}-lang", default=None, help=f"{side} language served (default: the model card's)")
    parser.add_argument("--access-log", action="store_true", help="log every request")
    for item in dataclasses.fields(ServerLimits):
        kind = _at_least(1) if item.type in (int, "int") else _finite
        help = f"{item.metadata['help']} (default: {item.default:g})"
        parser.add_argument("--" + item.name.replace("_", "-"), type=kind, default=item.default, help=help)
    _add_decoding_flags(parser, SERVE_DECODING)
    parser.set_defaults(batch_size=1, max_tokens=None, buffer_size=None)  # no flags: the server batches
    return parser


def _as_flags(error: ValueError) -> UsageError:
    """A refusal of a setting named `name` in backticks, naming the flag `--name` instead."""
    return UsageError(re.sub(r"`(\w+)`", lambda match: "--" + match.group(1).replace("_", "-"), str(error), count=1))


def _serve_settings(args) -> tuple:
    """(limits, API key or None), every flag checked before anything is imported or loaded."""
    from hf_deep_nmt.serving.options import DecodingOptions
    from hf_deep_nmt.serving.server.limits import ServerLimits

    try:
        DecodingOptions.from_arguments(args)
        limits = ServerLimits(**{item.name: getattr(args, item.name) for item in dataclasses.fields(ServerLimits)})
    except ValueError as error:
        raise _as_flags(error) from None
    key = None
    if args.api_key_file is not None:
        key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        if not key:
            raise UsageError(f"--api-key-file {args.api_key_file} is empty; write the key into it.")
    if args.host not in ("127.0.0.1", "localhost", "::1") and key is None:
        print(f"hf-deep-nmt serve: listening on {args.host} without --api-key-file: anyone who reaches it may use it.")
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise UsageError(
            f"hf-deep-nmt serve needs the serve extra ({error.name} is missing): pip install 'hf-deep-nmt[serve]'"
        ) from None
    return limits, key


def _card_languages(model: str) -> tuple[str, str] | None:
    """(source, target): the first two languages of the model card's metadata, as `export_hub_folder` writes them."""
    from huggingface_hub import ModelCard

    folder = Path(model).expanduser()
    try:
        card = ModelCard.load(folder / "README.md" if folder.is_dir() else model)
    except Exception:  # no card, or none to be had: any language pair is taken
        return None
    languages = card.data.language
    if isinstance(languages, list) and len(languages) >= 2 and all(isinstance(code, str) for code in languages[:2]):
        return languages[0], languages[1]
    return None


def _serve(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    limits, key = _serve_settings(args)
    from hf_deep_nmt.model_folders import check_model_name

    # a model that names nothing is said so (not as each backend's reason to pass it over), before the seconds of
    # importing torch, transformers and the server
    check_model_name(args.model)
    from hf_deep_nmt.serving.backends import DECODERS, backend_choice, make_decoder
    from hf_deep_nmt.serving.options import DecodingOptions
    from hf_deep_nmt.serving.server.app import Service
    from hf_deep_nmt.serving.server.runner import run_server
    from hf_deep_nmt.serving.threads import check_threads, set_threads

    name, passed_over = backend_choice(args.model, int8=args.int8, backend=args.backend)
    device = _device(args.device) if name == "torch" else args.device
    DECODERS[name].check_settings(device=device, int8=args.int8)
    reasons = "".join(f"; {other} passed over: {reason.rstrip('.')}" for other, reason in passed_over.items())
    print(f"hf-deep-nmt serve: backend {name}{' int8' * args.int8} for {args.model}{reasons}", flush=True)
    if name == "torch":
        _check_model_source(args.model)
    # torch's threads are set where torch decodes or is imported already; the other backends run without it
    torch_runs = name == "torch" or "torch" in sys.modules
    threads = set_threads(args.threads) if torch_runs else check_threads(args.threads)
    decoder, tokenizer = make_decoder(name, args.model, int8=args.int8, threads=threads, device=device)
    options = DecodingOptions.from_arguments(args, decoder.generation_config)
    decoder.check(tokenizer, options)  # what this backend cannot do with the options, before listening
    card = _card_languages(args.model) or (None, None)
    source, target = args.source_lang or card[0], args.target_lang or card[1]
    languages = (source, target) if source and target else None
    service = Service(
        decoder, tokenizer, options, limits, backend=name, model=args.model, languages=languages, api_key=key
    )
    run_server(service, args.host, args.port, access_log=args.access_log)
    return 0


def _average(argv: list[str]) -> int:
    parser = _Parser(
        prog="hf-deep-nmt average", description="Average model checkpoints into one loadable model folder."
    )
    parser.add_argument("checkpoints", type=_path, nargs="*", help="checkpoint folders (or use --run with --last)")
    parser.add_argument(
        "--run", type=_path, help="a training run's folder (its output_dir), holding checkpoint-<step> folders"
    )
    parser.add_argument("--last", type=_at_least(1), help="average the newest N checkpoints of --run")
    parser.add_argument("--output", type=_path, help="folder for the averaged model")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    parser.renamed("--output-dir", "--run", type=_path)
    parser.renamed("--save-to", "--output", type=_path)
    args = parser.parse(argv, required=("--output",))

    from hf_deep_nmt.training.averaging import average_checkpoints

    average_checkpoints(
        args.checkpoints or None,
        output_dir=args.run,
        last=args.last,
        save_to=args.output,
        overwrite=args.overwrite,
    )
    print(args.output)
    return 0


def _push(argv: list[str]) -> int:
    parser = _Parser(prog="hf-deep-nmt push", description="Upload an exported folder to the Hub.")
    parser.add_argument("--model", type=_path, help="an exported model folder (`export_dir` of a recipe)")
    parser.add_argument("--repo-id", help="Hub repository to upload to, e.g. your-name/dlcl-es-en")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing repository")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded, upload nothing")
    args = parser.parse(argv, (("--model", "FOLDER"), ("--repo-id", "REPO_ID")), ("--model", "--repo-id"))

    from hf_deep_nmt.hub import push_to_hub, upload_operations

    _check_repo_id(args.repo_id)
    if args.dry_run:
        for operation in upload_operations(args.model):
            print(operation.path_in_repo)
        return 0
    info = push_to_hub(args.model, args.repo_id, private=args.private, overwrite=args.overwrite)
    print(getattr(info, "commit_url", info))
    return 0


def _check_repo_id(repo_id: str) -> None:
    """`UsageError` naming --repo-id when huggingface_hub's validator refuses it, before anything is read or
    listed."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        reason = _one_line(str(error).split(" Use `repo_type`")[0])  # the CLI has no repo_type to use
        raise UsageError(
            f"--repo-id {repo_id!r} is not a Hub repository id ({reason}); write it as 'your-name/model-name'."
        ) from None


def _inspect(argv: list[str]) -> int:
    parser = _Parser(
        prog="hf-deep-nmt inspect",
        description="Per-layer gradient norms, layer similarities (SDT) and combination weights (DLCL) of a saved "
        "model on a batch of parallel text, as PNG plots and one JSON file.",
    )
    parser.add_argument("--model", type=_path, help="saved model folder or Hub repo id, with its tokenizer")
    parser.add_argument(
        "--data",
        type=_path,
        default=None,
        help="parallel text (.tsv, .jsonl or a prefix); default: the bundled validation set",
    )
    parser.add_argument("--source-lang", default="src")
    parser.add_argument("--target-lang", default="tgt")
    parser.add_argument(
        "--num-sentences", type=_at_least(1), default=32, help="pairs of the batch (from the top of --data)"
    )
    parser.add_argument(
        "--max-length",
        type=_at_least(2),
        default=128,
        help="longer sides are truncated (at least 2: a token and </s>)",
    )
    parser.add_argument(
        "--dropout", action="store_true", help="gradient norms in training mode (with dropout); default: without"
    )
    parser.add_argument("--output", type=_path, help="folder for inspect.json and the PNG plots")
    parser.add_argument("--overwrite", action="store_true", help="replace files of an earlier inspect run")
    parser.renamed("--output-dir", "--output", type=_path)
    args = parser.parse(argv, required=("--model", "--output"))

    from hf_deep_nmt.tools.inspection import inspect_model

    summary = inspect_model(
        args.model,
        args.output,
        data=args.data,
        source_lang=args.source_lang,
        target_lang=args.target_lang,
        num_sentences=args.num_sentences,
        max_length=args.max_length,
        dropout=args.dropout,
        overwrite=args.overwrite,
    )
    print(json.dumps({"output_dir": str(args.output), "files": summary["files"]}, indent=2))
    return 0


def _doctor(argv: list[str]) -> int:
    from hf_deep_nmt.cli_reference import DOCTOR_FAMILIES

    parser = _Parser(
        prog="hf-deep-nmt doctor",
        description="Check this machine: versions, SDPA backends per attention path, exactness and bf16 numerics per "
        "model family, a bf16 Trainer run and a short base-size training on the bundled sample (CUDA only).",
    )
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--train-steps", type=int, default=300, help="steps of the base-size training (0: skip)")
    parser.add_argument(
        "--families", default=None, help=f"comma-separated, from {list(DOCTOR_FAMILIES)} (default: all)"
    )
    parser.add_argument(
        "--output", type=_path, default=None, help="folder for the training run (default: a temporary one)"
    )
    parser.renamed("--output-dir", "--output", type=_path)
    args = parser.parse(argv)

    from hf_deep_nmt.tools.doctor import check_machine

    return check_machine(args.device, args.train_steps, args.families, args.output)


def _export_ctranslate2(argv: list[str]) -> int:
    from hf_deep_nmt.cli_reference import (
        CTRANSLATE2_DEFAULT_MAX_POSITIONS,
        CTRANSLATE2_MIN_MAX_POSITIONS,
        CTRANSLATE2_SERVABLE,
    )

    parser = _Parser(
        prog="hf-deep-nmt export-ctranslate2",
        description=f"Write a model as a CTranslate2 model folder (C++ decoding), with its tokenizer. Models with "
        f"{CTRANSLATE2_SERVABLE} can be written; any other is refused, naming what CTranslate2 cannot express.",
    )
    parser.add_argument("--model", type=_path, help="saved model folder or Hub repo id, with its tokenizer")
    parser.add_argument(
        "--output",
        type=_path,
        help="folder for the CTranslate2 model; an existing non-empty one is refused (see --overwrite)",
    )
    parser.add_argument(
        "--into-model",
        action="store_true",
        help="write it into MODEL/ctranslate2/ (instead of --output), where `translate --backend ctranslate2 --model "
        "MODEL` finds it and `push` uploads it",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        help="stored weight type, one of CTranslate2's: int8, int8_float32, int8_float16, int8_bfloat16, int16, "
        "float16, bfloat16, float32 (default: the model's, float32)",
    )
    parser.add_argument(
        "--max-positions",
        type=_at_least(CTRANSLATE2_MIN_MAX_POSITIONS),
        default=CTRANSLATE2_DEFAULT_MAX_POSITIONS,
        help="rows of the position table: the longest source, and the most decoding steps (start token included); "
        f"at least {CTRANSLATE2_MIN_MAX_POSITIONS}",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --output when it holds an earlier export of hf-deep-nmt only"
    )
    args = parser.parse(argv, (("--model", "MODEL"), ("--output", "OUT")), ("--model",))
    protected = _check_ctranslate2_export(args)
    from hf_deep_nmt.serving.ctranslate2 import export_ctranslate2

    model, tokenizer = _load(args.model, "cpu")
    export_ctranslate2(
        model,
        tokenizer,
        args.output,
        quantization=args.quantization,
        max_positions=args.max_positions,
        overwrite=args.overwrite,
        flag="--overwrite",
        protected=protected,
    )
    print(args.output)
    return 0


def _check_ctranslate2_export(args: argparse.Namespace) -> dict[str, str]:
    """Everything `export-ctranslate2` was asked, checked before the model's weights are loaded: CTranslate2 there,
    the quantization, the output folder, the model source, and that CTranslate2 expresses the model. Returns the
    folders the export must not write into. `--into-model` becomes the model folder's `ctranslate2/` as `--output`."""
    from transformers import AutoConfig

    from hf_deep_nmt.folders import check_export_folder
    from hf_deep_nmt.serving.ctranslate2 import (
        CTRANSLATE2_SUBFOLDER,
        check_ctranslate2_support,
        check_max_positions,
        quantization_choices,
        require_ctranslate2,
    )

    if args.into_model == (args.output is not None):
        raise UsageError("give either --output (a folder for the CTranslate2 model) or --into-model, not both.")
    if args.into_model:
        if not Path(args.model).expanduser().is_dir():
            raise UsageError(f"--into-model writes into a local model folder; {args.model} is none.")
        args.output = str(Path(args.model) / CTRANSLATE2_SUBFOLDER)
    require_ctranslate2()
    if args.quantization is not None and args.quantization not in quantization_choices():
        raise UsageError(f"--quantization {args.quantization!r} is not one of {', '.join(quantization_choices())}.")
    protected = {"the model folder": args.model} if Path(args.model).expanduser().exists() else {}
    sources = {} if args.into_model else protected  # --into-model writes inside the model folder on purpose
    check_export_folder(args.output, args.overwrite, flag="--overwrite", protected=protected, sources=sources)
    _check_model_source(args.model)
    from hf_deep_nmt import registration  # noqa: F401  (registers the configs with AutoConfig)

    config = AutoConfig.from_pretrained(args.model)
    check_ctranslate2_support(config)
    check_max_positions(config, args.max_positions)
    return protected


def _export_onnx(argv: list[str]) -> int:
    parser = _Parser(
        prog="hf-deep-nmt export-onnx",
        description="Write a model (any family) as ONNX graphs for ONNX Runtime decoding (hf_deep_nmt.serving.onnx): "
        "the encoder with the first decoder step, and one decoder step with the cache as tensors; with its tokenizer.",
    )
    parser.add_argument("--model", type=_path, help="saved model folder or Hub repo id, with its tokenizer")
    parser.add_argument("--output", type=_path, help="new folder for the ONNX graphs; an existing one is refused")
    parser.add_argument("--int8", action="store_true", help="also write int8 graphs (dynamic quantization)")
    parser.add_argument(
        "--into-model",
        action="store_true",
        help="write the graphs into MODEL/onnx/ (instead of --output), where `translate --backend onnxruntime --model "
        "MODEL` finds them and `push` uploads them; an existing MODEL/onnx/ is refused",
    )
    args = parser.parse(argv, (("--model", "MODEL"), ("--output", "OUT")), ("--model",))
    if args.into_model == (args.output is not None):
        raise UsageError("give either --output (a new folder for the graphs) or --into-model (MODEL/onnx/), not both.")
    if args.into_model:
        if not Path(args.model).expanduser().is_dir():
            raise UsageError(f"--into-model writes into a local model folder; {args.model} is none.")
        args.output = str(Path(args.model) / "onnx")
    if os.path.lexists(Path(args.output).expanduser()):
        raise UsageError(f"{args.output} exists; give a new folder for the ONNX export (nothing is overwritten).")
    _check_model_source(args.model)
    from hf_deep_nmt.serving.onnx import export_for_serving, require_onnxruntime
    from hf_deep_nmt.serving.onnx_export import check_onnx_output

    source = args.model if Path(args.model).expanduser().is_dir() else None  # a local folder: its digests recorded
    check_onnx_output(args.output, source)
    require_onnxruntime()
    model, tokenizer = _load(args.model, "cpu")
    export_for_serving(model, tokenizer, Path(args.output).expanduser(), quantize=args.int8, source=source)
    print(args.output)
    return 0


def _grow(argv: list[str]) -> int:
    from hf_deep_nmt.cli_reference import EXACT_AGGREGATIONS, GROWTH_STRATEGIES

    parser = _Parser(
        prog="hf-deep-nmt grow",
        description="Write a copy of a saved model with a deeper encoder (SDT growth by copying layers), with its "
        "tokenizer: a folder `hf-deep-nmt train` starts from with `model_name_or_path` (e.g. a converted Marian "
        "model). The source folder is not changed.",
    )
    parser.add_argument("--model", type=_path, help="saved model folder or Hub repo id, with its tokenizer")
    parser.add_argument(
        "--output",
        type=_path,
        help="folder for the grown model; an existing non-empty one is refused (see --overwrite)",
    )
    parser.add_argument(
        "--layers", type=_at_least(1), default=None, help="encoder layers to add (default: a sparse encoder's block)"
    )
    parser.add_argument(
        "--strategy", choices=GROWTH_STRATEGIES, default="top", help="which layers are copied (default: top)"
    )
    parser.add_argument(
        "--reset-previous-block-norm", action="store_true", help="sparse encoders: see grow_encoder's docstring"
    )
    parser.add_argument(
        "--aggregation",
        choices=EXACT_AGGREGATIONS,
        default=None,
        help="first turn a residual encoder into a DLCL or sparse one computing the same function "
        "(with_layer_aggregation), then grow it",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --output when it holds an earlier result of hf-deep-nmt only"
    )
    args = parser.parse(argv, (("--model", "MODEL"), ("--output", "OUT")), ("--model", "--output"))

    from hf_deep_nmt.fingerprints import record_tokenizer_fingerprint
    from hf_deep_nmt.folders import check_export_folder, write_marked_folder
    from hf_deep_nmt.training.growing import grow_encoder

    protected = {"the model folder": args.model} if Path(args.model).expanduser().exists() else {}
    check_export_folder(args.output, args.overwrite, flag="--overwrite", protected=protected, sources=protected)
    _check_model_source(args.model)
    model, tokenizer = _load(args.model, "cpu")
    before = model.config.encoder_layers
    grown = grow_encoder(
        model,
        args.layers,
        strategy=args.strategy,
        reset_previous_block_norm=args.reset_previous_block_norm,
        aggregation=args.aggregation,
    )

    def write(staging: Path) -> None:
        record_tokenizer_fingerprint(grown.config, tokenizer)
        grown.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    write_marked_folder(args.output, write, overwrite=args.overwrite, flag="--overwrite", protected=protected)
    wiring = f", {args.aggregation} aggregation" if args.aggregation else ""
    print(f"{args.output}: encoder {before} -> {grown.config.encoder_layers} layers ({args.strategy}{wiring})")
    return 0


def _upgrade_code(argv: list[str]) -> int:
    from hf_deep_nmt.tools.upgrade_code import DEFAULT_NUM_CHECKS

    parser = _Parser(
        prog="hf-deep-nmt upgrade-code",
        description="Rewrite the model code of an exported folder, or of a Hub repository, to the installed "
        "hf-deep-nmt's (config migrated; weights, tokenizer and card untouched), after checking in clean processes "
        "that it decodes a few inputs exactly as the old code does without its cache, with and without the cache. A "
        "folder is changed in place (the replaced files kept in a hidden backup folder); a repository gets one commit "
        "holding the changed code and config files. The check runs the folder's own model code (a dry run too): it "
        "runs only with --trust-remote-code.",
    )
    parser.add_argument(
        "--model",
        type=_path,
        help="an exported model folder, or a Hub repository id (e.g. your-name/dlcl-es-en)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check and report (the check runs the old code); write and push nothing"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the check to run the folder's or repository's own model code (as transformers' "
        "trust_remote_code=True); without it nothing runs",
    )
    parser.add_argument(
        "--num-checks", type=_at_least(1), default=DEFAULT_NUM_CHECKS, help="source inputs decoded for the check"
    )
    parser.add_argument("--revision", default=None, help="branch of the Hub repository (default: main)")
    args = parser.parse(argv, (("--model", "SOURCE"),), ("--model",))

    from hf_deep_nmt.model_folders import check_local_path
    from hf_deep_nmt.tools.upgrade_code import upgrade_folder, upgrade_repo

    check_local_path(args.model, "Model folder")
    path = Path(args.model).expanduser()
    if path.exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", args.model):
        if args.revision is not None:
            raise UsageError(f"--revision is for a Hub repository; {args.model!r} is a local path.")
        report = upgrade_folder(
            path, num_checks=args.num_checks, dry_run=args.dry_run, trust_remote_code=args.trust_remote_code
        )
    else:
        report = upgrade_repo(
            args.model,
            num_checks=args.num_checks,
            dry_run=args.dry_run,
            revision=args.revision,
            trust_remote_code=args.trust_remote_code,
        )
    print("\n".join(report.lines()))
    return 0


def _convert_marian(argv: list[str]) -> int:
    parser = _Parser(
        prog="hf-deep-nmt convert-marian",
        description="Write a model of this package that computes what a transformers MarianMTModel (an OPUS-MT model) "
        "computes: same logits, same generation defaults, its tokenizer. Settings this package cannot express are "
        "refused by name before anything is written.",
    )
    parser.add_argument(
        "--model", type=_path, help="a MarianMTModel folder or Hub id, e.g. Helsinki-NLP/opus-mt-en-de"
    )
    parser.add_argument("--output", type=_path, help="the folder to write")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --output when an earlier export or conversion wrote it"
    )
    args = parser.parse(argv, (("--model", "SOURCE"), ("--output", "OUT")), ("--model", "--output"))

    from hf_deep_nmt.model_folders import check_local_path
    from hf_deep_nmt.tools.marian import convert_marian

    check_local_path(args.model, "Model folder")
    print(convert_marian(args.model, args.output, overwrite=args.overwrite))
    return 0


COMMANDS = {
    "train": _train,
    "train-staged": _train_staged,
    "prepare": _prepare,
    "translate": _translate,
    "serve": _serve,
    "average": _average,
    "push": _push,
    "inspect": _inspect,
    "doctor": _doctor,
    "export-ctranslate2": _export_ctranslate2,
    "export-onnx": _export_onnx,
    "upgrade-code": _upgrade_code,
    "convert-marian": _convert_marian,
    "grow": _grow,
}


# One line per command for `hf-deep-nmt --help`.
SUMMARIES = {
    "train": "train a model from a recipe (JSON or YAML), evaluate it and export a Hub-ready folder",
    "train-staged": "train from a recipe in stages of growing encoder depth (SDT)",
    "prepare": "tokenize a recipe's data ahead of training (e.g. on a CPU node), for train to reuse",
    "translate": "translate lines of text with a saved model (torch or ONNX Runtime)",
    "serve": "serve a model over HTTP (LibreTranslate's /translate), batching sentences across requests",
    "average": "average checkpoints into one loadable model folder",
    "push": "upload an exported model folder to the Hugging Face Hub",
    "inspect": "plot a model's per-layer gradient norms, layer similarities and combination weights",
    "doctor": "check this machine: versions, attention backends, numerics per model family, a short training",
    "export-ctranslate2": "write a model as a CTranslate2 model folder (C++ decoding)",
    "export-onnx": "write a model as ONNX graphs for ONNX Runtime decoding",
    "upgrade-code": "rewrite the model code of an exported folder or Hub repository to this version's",
    "convert-marian": "write a transformers MarianMTModel (OPUS-MT) as a model of this package",
    "grow": "write a copy of a model with a deeper encoder (SDT growth)",
}
USAGE = "usage: hf-deep-nmt [--debug] COMMAND [ARGUMENTS ...]"


def overview() -> str:
    """`hf-deep-nmt --help`: one line per command, and the words every command shares."""
    width = max(map(len, COMMANDS)) + 2
    commands = "\n".join(f"  {name:<{width}}{SUMMARIES.get(name, '')}" for name in COMMANDS)
    words = textwrap.fill(
        "`hf-deep-nmt COMMAND --help` shows a command's arguments. Every command names the model it reads with "
        "--model (a saved model folder or a Hub id) and what it writes with --output; train, train-staged and "
        "prepare read a recipe, whose settings are also flags (--max-steps 100; the run's folder is --output-dir, "
        "the recipe's output_dir). --debug (or HF_DEEP_NMT_DEBUG=1) adds the traceback to an error.",
        width=100,
        break_on_hyphens=False,
    )
    return f"{USAGE}\n\ncommands:\n{commands}\n\n{words}\n"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def describe_error(error: BaseException) -> tuple[int, str]:
    """The exit code (2: a mistake in what was asked, 1: a run that failed) and the one line reporting `error`."""
    notes = "; ".join(getattr(error, "__notes__", ()))
    message = str(error) or type(error).__name__
    # What the checks raise for a bad value or path. A TypeError is a programming error here (the command line and
    # recipes hand in checked values), so it falls through to "unexpected" with the way to its traceback.
    usage = (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)
    if isinstance(error, usage):
        code = 2
    elif type(error).__name__ == "OutOfMemoryError" or "out of memory" in message.lower():
        code = 1
        message = (
            f"out of memory ({message.splitlines()[0]}); use smaller batches (translate: --batch-size, --max-tokens; "
            "train: per_device_train_batch_size, max_tokens) or a smaller model."
        )
    elif isinstance(error, PermissionError):
        code, message = 1, f"{message} (check the permissions of that path)"
    elif isinstance(error, OSError) and error.errno == errno.ENOSPC:
        code, message = 1, f"no space left on the device: {message}; free some space and run again."
    elif isinstance(error, OSError) or type(error).__module__.startswith("hf_deep_nmt"):
        code = 1
    else:
        code, message = 1, f"{type(error).__name__}: {message} (unexpected; rerun with --debug for the traceback)"
    return code, _one_line(f"{message} ({notes})" if notes else message)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")
    while argv and argv[0] == "--debug":
        debug = True
        argv.pop(0)
    if argv and argv[0] in ("-h", "--help"):
        _show(overview())
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"hf-deep-nmt: unknown command {argv[0]!r}; choose one of {sorted(COMMANDS)}.", file=sys.stderr)
        else:
            print("hf-deep-nmt: error: a command is required (see `hf-deep-nmt --help`).", file=sys.stderr)
        print(f"{USAGE} (`hf-deep-nmt --help` lists the commands)", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except KeyboardInterrupt as error:
        failure = error
        notes = "; ".join(getattr(error, "__notes__", ()))
        code, message = 130, f"interrupted ({notes})" if notes else "interrupted"
    except Exception as error:  # the CLI's edge: each failure becomes one line
        failure = error
        code, message = describe_error(error)
    if debug:
        traceback.print_exception(failure)
    print(f"hf-deep-nmt {argv[0]}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
