"""`hf-deep-nmt train|train-staged|translate|average|push|inspect|doctor`: thin command-line front ends over the
library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _train(argv: list[str]) -> int:
    from hf_deep_nmt.training import run

    summary = run(argv)
    printable = {key: value for key, value in summary.items() if key != "examples"}
    print(json.dumps(printable, indent=2, ensure_ascii=False))
    return 0


def _train_staged(argv: list[str]) -> int:
    from hf_deep_nmt.staged import run_staged

    summary = run_staged(argv)
    printable = {key: value for key, value in summary.items() if key != "examples"}
    print(json.dumps(printable, indent=2, ensure_ascii=False))
    return 0


def _translate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-deep-nmt translate", description="Translate lines of text.")
    parser.add_argument("--model", required=True, help="saved model folder or Hub repo id (with its tokenizer)")
    parser.add_argument("--input", default="-", help="text file, one sentence per line (default: stdin)")
    parser.add_argument("--output", default="-", help="where to write translations (default: stdout)")
    parser.add_argument("--num-beams", type=int, default=None, help="default: the model's generation config")
    parser.add_argument("--length-penalty", type=float, default=None, help="alpha; default: the generation config")
    parser.add_argument("--length-penalty-form", choices=("fairseq", "gnmt"), default="fairseq")
    parser.add_argument("--batch-size", type=int, default=64, help="most sentences in a batch")
    parser.add_argument("--max-tokens", type=int, default=4096, help="most padded source tokens in a batch")
    parser.add_argument("--max-length-a", type=float, default=1.5, help="output cap: a * source tokens + b")
    parser.add_argument("--max-length-b", type=int, default=10)
    parser.add_argument("--device", default=None, help="e.g. cuda, cpu (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import hf_deep_nmt  # noqa: F401  (registers the model classes with the Auto classes)
    from hf_deep_nmt.input_checks import check_local_path
    from hf_deep_nmt.translate import translate_file

    # what the user named is checked before the model is loaded
    if args.input != "-" and not Path(args.input).is_file():
        raise FileNotFoundError(f"input file not found: {args.input}")
    check_local_path(args.model, "Model folder")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model).to(device)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    generation = model.generation_config
    translate_file(
        model,
        tokenizer,
        args.input,
        args.output,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        num_beams=args.num_beams or generation.num_beams or 1,
        length_penalty=next(
            value for value in (args.length_penalty, generation.length_penalty, 1.0) if value is not None
        ),
        length_penalty_form=args.length_penalty_form,
        max_length_a=args.max_length_a,
        max_length_b=args.max_length_b,
        progress=not args.no_progress,
    )
    return 0


def _average(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-deep-nmt average", description="Average model checkpoints into one loadable model folder."
    )
    parser.add_argument("checkpoints", nargs="*", help="checkpoint folders (or use --output-dir with --last)")
    parser.add_argument("--output-dir", help="a Trainer output folder holding checkpoint-<step> folders")
    parser.add_argument("--last", type=int, help="average the newest N checkpoints of --output-dir")
    parser.add_argument("--save-to", required=True, help="folder for the averaged model")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --save-to")
    args = parser.parse_args(argv)

    from hf_deep_nmt.averaging import average_checkpoints

    average_checkpoints(
        args.checkpoints or None,
        output_dir=args.output_dir,
        last=args.last,
        save_to=args.save_to,
        overwrite=args.overwrite,
    )
    print(args.save_to)
    return 0


def _push(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hf-deep-nmt push", description="Upload an exported folder to the Hub.")
    parser.add_argument("folder", help="an exported folder (`export_dir` of a recipe)")
    parser.add_argument("repo_id", help="Hub repository, e.g. your-name/dlcl-es-en")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--overwrite", action="store_true", help="replace the files of an existing repository")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded, upload nothing")
    args = parser.parse_args(argv)

    from hf_deep_nmt.hub import push_to_hub, upload_operations

    if args.dry_run:
        for operation in upload_operations(args.folder):
            print(operation.path_in_repo)
        return 0
    info = push_to_hub(args.folder, args.repo_id, private=args.private, overwrite=args.overwrite)
    print(getattr(info, "commit_url", info))
    return 0


def _inspect(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-deep-nmt inspect",
        description="Per-layer gradient norms, layer similarities (SDT) and combination weights (DLCL) of a saved "
        "model on a batch of parallel text, as PNG plots and one JSON file.",
    )
    parser.add_argument("--model", required=True, help="saved model folder or Hub repo id (with its tokenizer)")
    parser.add_argument(
        "--data", default=None, help="parallel text (.tsv, .jsonl or a prefix); default: the bundled validation set"
    )
    parser.add_argument("--source-lang", default="src")
    parser.add_argument("--target-lang", default="tgt")
    parser.add_argument("--num-sentences", type=int, default=32, help="pairs of the batch (from the top of --data)")
    parser.add_argument("--max-length", type=int, default=128, help="longer sides are truncated")
    parser.add_argument(
        "--dropout", action="store_true", help="gradient norms in training mode (with dropout); default: without"
    )
    parser.add_argument("--output-dir", required=True, help="folder for inspect.json and the PNG plots")
    parser.add_argument("--overwrite", action="store_true", help="replace files of an earlier inspect run")
    args = parser.parse_args(argv)
    if args.num_sentences < 1:
        raise ValueError(f"--num-sentences must be a positive integer, got {args.num_sentences}.")

    from hf_deep_nmt.diagnostics import inspect_model

    summary = inspect_model(
        args.model,
        args.output_dir,
        data=args.data,
        source_lang=args.source_lang,
        target_lang=args.target_lang,
        num_sentences=args.num_sentences,
        max_length=args.max_length,
        dropout=args.dropout,
        overwrite=args.overwrite,
    )
    print(json.dumps({"output_dir": str(args.output_dir), "files": summary["files"]}, indent=2))
    return 0


def _doctor(argv: list[str]) -> int:
    from hf_deep_nmt.doctor import main as doctor

    return doctor(argv)


COMMANDS = {
    "train": _train,
    "train-staged": _train_staged,
    "translate": _translate,
    "average": _average,
    "push": _push,
    "inspect": _inspect,
    "doctor": _doctor,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"hf-deep-nmt: unknown command {argv[0]!r}; choose one of {sorted(COMMANDS)}.", file=sys.stderr)
        usage = (
            "usage: hf-deep-nmt {train | train-staged} CONFIG [--field value ...] | translate --model DIR [...] | "
            "average CHECKPOINT... --save-to DIR | push FOLDER REPO_ID [--dry-run] | "
            "inspect --model DIR --output-dir DIR | doctor [--device cuda]"
        )
        print(usage, file=sys.stderr)
        return 2 if argv and argv[0] not in ("-h", "--help") else 0
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as error:
        # Mistakes in what the user asked for: one clear line, no traceback.
        print(f"hf-deep-nmt {argv[0]}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
