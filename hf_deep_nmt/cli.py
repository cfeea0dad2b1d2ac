"""`hf-deep-nmt train|translate`: thin command-line front ends over the library."""

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
    parser.add_argument("--length-penalty", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length-a", type=float, default=1.5)
    parser.add_argument("--max-length-b", type=int, default=10)
    args = parser.parse_args(argv)

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import hf_deep_nmt  # noqa: F401  (registers the model classes with the Auto classes)
    from hf_deep_nmt.translate import translate

    model = AutoModelForSeq2SeqLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.input == "-":
        lines = sys.stdin.read().splitlines()
    else:
        path = Path(args.input)
        if not path.is_file():
            raise SystemExit(f"hf-deep-nmt translate: input file not found: {path}")
        lines = path.read_text(encoding="utf-8").splitlines()
    outputs = translate(
        model,
        tokenizer,
        lines,
        batch_size=args.batch_size,
        num_beams=args.num_beams or model.generation_config.num_beams or 1,
        length_penalty=args.length_penalty
        if args.length_penalty is not None
        else model.generation_config.length_penalty,
        max_length_a=args.max_length_a,
        max_length_b=args.max_length_b,
    )
    text = "\n".join(outputs) + ("\n" if outputs else "")
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
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


COMMANDS = {"train": _train, "train-staged": _train_staged, "translate": _translate, "inspect": _inspect}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"hf-deep-nmt: unknown command {argv[0]!r}; choose one of {sorted(COMMANDS)}.", file=sys.stderr)
        usage = "usage: hf-deep-nmt {train | train-staged} CONFIG [--field value ...] | translate --model DIR [...]"
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
