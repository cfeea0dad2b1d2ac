"""Starting deep from a shallow Marian model: convert it exactly, grow its encoder, fine-tune, on this machine.

One run, on the bundled es-en sample (public-domain Bible text, 8000 training / 300 validation pairs):

1. a small `MarianMTModel` (post-norm, swish, sinusoidal positions, a shared vocabulary with a joint tokenizer trained
   on the sample) is trained for `--pretrain-steps` steps: the stand-in for a pretrained OPUS-MT model. With
   `--source` (a Hub id such as Helsinki-NLP/opus-mt-es-en, or a MarianMTModel folder) that model and its tokenizer
   are used instead, and nothing is pretrained;
2. it is converted (`convert_marian`); the converted model's logits must equal Marian's on validation batches;
3. the converted model's encoder is grown (`grow_encoder`, `--grow-strategy`, by `--new-layers` layers);
4. the converted model ("continued shallow") and the grown model are each fine-tuned for `--finetune-steps` steps
   with `hf-deep-nmt train` from their folders (`model_name_or_path`), the same recipe for both;
5. validation loss (cross-entropy in nats per target token, no label smoothing) and sacreBLEU / chrF (beam
   `--num-beams`) of the converted, continued shallow and grown models, as one table (printed as markdown, and
   written as JSON with the settings).

    OMP_NUM_THREADS=1 python benchmarks/marian_warm_start.py --threads 1   # about 10 minutes on one CPU core
    python benchmarks/marian_warm_start.py --source Helsinki-NLP/opus-mt-es-en   # needs the Hub and sentencepiece
    python benchmarks/marian_warm_start.py --smoke             # tiny, checks that it runs
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, MarianConfig, MarianMTModel

from hf_deep_nmt.data.corpus import load_parallel_dataset, sample_corpus_dir, tokenize_parallel
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.serving.translate import translate
from hf_deep_nmt.tools.marian import convert_marian
from hf_deep_nmt.training.evaluation import corpus_scores
from hf_deep_nmt.training.growing import GROWTH_STRATEGIES, grow_encoder
from hf_deep_nmt.training.pipeline import run as train_run
from hf_deep_nmt.training.schedules import inverse_sqrt_scheduler

# Largest difference between the converted model's and Marian's validation logits that the run accepts.
LOGITS_TOLERANCE = 1e-5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default=None, help="a MarianMTModel Hub id or folder instead of the built model")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3, help="encoder and decoder layers of the built Marian model")
    parser.add_argument("--vocab-size", type=int, default=4000, help="joint tokenizer of the built model")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--finetune-steps", type=int, default=120)
    parser.add_argument("--new-layers", type=int, default=None, help="default: as many as the encoder has")
    parser.add_argument("--grow-strategy", default="top", choices=GROWTH_STRATEGIES)
    parser.add_argument("--batch", type=int, default=64, help="sentence pairs per step (pretraining, fine-tuning)")
    parser.add_argument("--pretrain-lr", type=float, default=2e-3)
    parser.add_argument("--finetune-lr", type=float, default=5e-4)
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps of pretraining")
    parser.add_argument("--num-beams", type=int, default=4)
    parser.add_argument("--eval-pairs", type=int, default=300, help="validation pairs scored (of 300)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the models here (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="default: results/marian_warm_start[_smoke].json")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and steps, to check that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.d_model, args.layers, args.vocab_size, args.batch = 16, 1, 300, 8
        args.pretrain_steps, args.finetune_steps, args.warmup, args.num_beams, args.eval_pairs = 4, 2, 2, 2, 8
    name = "marian_warm_start_smoke.json" if args.smoke else "marian_warm_start.json"
    args.json = args.json or Path(__file__).parent / "results" / name
    return args


def build_marian(args, tokenizer) -> MarianMTModel:
    """A small OPUS-MT-like model: post-norm, swish, scaled embeddings, one vocabulary, tied output, decoding from the
    pad id (as Marian does)."""
    torch.manual_seed(args.seed)
    config = MarianConfig(
        vocab_size=len(tokenizer),
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=4 if args.d_model % 4 == 0 else 1,
        decoder_attention_heads=4 if args.d_model % 4 == 0 else 1,
        encoder_ffn_dim=4 * args.d_model,
        decoder_ffn_dim=4 * args.d_model,
        activation_function="swish",
        dropout=0.1,
        max_position_embeddings=512,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=tokenizer.eos_token_id,
    )
    model = MarianMTModel(config)
    model.generation_config.bad_words_ids = [[tokenizer.pad_token_id]]
    return model


def batches(dataset, collator, batch_size: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(dataset), generator=generator)
        for start in range(0, len(dataset) - batch_size + 1, batch_size):
            yield collator([dataset[int(index)] for index in order[start : start + batch_size]])


def pretrain(model, stream, args) -> list[float]:
    """Adam, inverse-sqrt schedule, the Marian model's own loss; returns the loss of every 50th step."""
    optimizer = torch.optim.Adam(model.parameters(), lr=args.pretrain_lr, betas=(0.9, 0.98))
    scheduler = inverse_sqrt_scheduler(optimizer, args.warmup)
    model.train()
    losses = []
    for step in range(1, args.pretrain_steps + 1):
        loss = model(**next(stream)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 50 == 0 or step == args.pretrain_steps:
            losses.append(round(loss.item(), 4))
    return losses


def validation_loss(model, validation: list[dict]) -> float:
    """Cross-entropy in nats per target token over the validation batches (labels -100 ignored)."""
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in validation:
            logits = model(**batch).logits
            labels = batch["labels"]
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
            ).item()
            tokens += int((labels != -100).sum())
    return total / tokens


def check_logits_equal(marian, converted, validation: list[dict]) -> float:
    """The largest difference between the two models' logits on the validation batches; over the tolerance, an
    error."""
    marian.eval()
    converted.eval()
    largest = 0.0
    with torch.no_grad():
        for batch in validation:
            inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "decoder_input_ids")}
            difference = (marian(**inputs).logits - converted(**inputs).logits).abs().max().item()
            largest = max(largest, difference)
    if not largest <= LOGITS_TOLERANCE:
        raise RuntimeError(f"converted logits differ from Marian's by {largest:.3g} (> {LOGITS_TOLERANCE:g})")
    return largest


def finetune(folder: Path, train_file: Path, out: Path, args) -> dict:
    """`hf-deep-nmt train` from the saved `folder` for `--finetune-steps` steps; returns its summary (the model is
    exported to `out`)."""
    recipe = {
        "model_name_or_path": str(folder),
        "train_file": str(train_file),
        "output_dir": str(out.with_name(out.name + "-run")),
        "export_dir": str(out),
        "max_steps": args.finetune_steps,
        "per_device_train_batch_size": args.batch,
        "learning_rate": args.finetune_lr,
        "lr_schedule": "inverse_sqrt",
        "warmup_steps": max(1, args.finetune_steps // 10),
        "adam_beta2": 0.98,
        "max_grad_norm": 1.0,
        "label_smoothing_factor": 0.1,
        "max_source_length": 64,
        "max_target_length": 64,
        "num_beams": args.num_beams,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "logging_steps": max(1, args.finetune_steps // 4),
        "seed": args.seed,
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "plot_curves": False,
        "translate_examples": 0,
    }
    path = out.with_name(out.name + "-recipe.json")
    path.write_text(json.dumps(recipe, indent=2))
    return train_run([str(path)])


def score(model, tokenizer, sources: list[str], references: list[str], validation, args) -> dict:
    started = time.perf_counter()
    hypotheses = translate(model.eval(), tokenizer, sources, num_beams=args.num_beams)
    scores = corpus_scores(hypotheses, references)
    return {
        "validation_loss": round(validation_loss(model, validation), 4),
        "sacrebleu": scores["bleu"],
        "chrf": scores["chrf"],
        "encoder_layers": model.config.encoder_layers,
        "decoder_layers": model.config.decoder_layers,
        "parameters": model.num_parameters(),
        "eval_seconds": round(time.perf_counter() - started, 1),
        "bleu_signature": scores["bleu_signature"],
    }


def tuned_folder_name(name: str) -> str:
    return "tuned-" + name.replace(" ", "-")


def markdown(rows: dict[str, dict], steps: int) -> str:
    lines = [
        "| model | encoder + decoder layers | parameters | fine-tuning steps | validation loss | sacreBLEU | chrF |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        tuned = 0 if name == "converted" else steps
        lines.append(
            f"| {name} | {row['encoder_layers']} + {row['decoder_layers']} | {row['parameters'] / 1e6:.2f}M | "
            f"{tuned} | {row['validation_loss']:.3f} | {row['sacrebleu']:.2f} | {row['chrf']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="marian-warm-start-"))
    workdir.mkdir(parents=True, exist_ok=True)
    raw = load_parallel_dataset(sample_corpus_dir() / "train.tsv", sample_corpus_dir() / "valid.tsv")
    valid = raw["validation"].select(range(min(args.eval_pairs, len(raw["validation"]))))
    sources, references = list(valid["source"]), list(valid["target"])
    timings = {}

    if args.source:
        marian_folder = args.source
        tokenizer = AutoTokenizer.from_pretrained(args.source)
        marian = MarianMTModel.from_pretrained(args.source, dtype=torch.float32).eval()
        pretrain_losses = None
    else:
        tokenizer = train_joint_tokenizer(zip(raw["train"]["source"], raw["train"]["target"]), args.vocab_size)
        marian = build_marian(args, tokenizer)
        collator = DataCollatorForSeq2Seq(tokenizer, model=marian, label_pad_token_id=-100)
        train_set = tokenize_parallel(raw["train"], tokenizer, 64, 64)
        clock = time.perf_counter()
        pretrain_losses = pretrain(marian, batches(train_set, collator, args.batch, args.seed), args)
        timings["pretrain_seconds"] = round(time.perf_counter() - clock, 1)
        marian_folder = workdir / "marian"
        marian.eval().save_pretrained(marian_folder)
        tokenizer.save_pretrained(marian_folder)

    collator = DataCollatorForSeq2Seq(tokenizer, model=marian, label_pad_token_id=-100)
    valid_set = tokenize_parallel(valid, tokenizer, 512, 512, drop_long=False)
    validation = [
        collator([valid_set[index] for index in range(start, min(start + 50, len(valid_set)))])
        for start in range(0, len(valid_set), 50)
    ]

    converted_folder = convert_marian(marian_folder, workdir / "converted", overwrite=True)
    converted = AutoModelForSeq2SeqLM.from_pretrained(converted_folder).eval()
    largest = check_logits_equal(marian, converted, validation)
    marian_loss = validation_loss(marian, validation)

    new_layers = args.new_layers or converted.config.encoder_layers
    grown_folder = workdir / "grown"
    shutil.rmtree(grown_folder, ignore_errors=True)
    grow_encoder(converted, new_layers, strategy=args.grow_strategy).save_pretrained(grown_folder)
    AutoTokenizer.from_pretrained(converted_folder).save_pretrained(grown_folder)

    train_file = workdir / "train.tsv"
    shutil.copyfile(sample_corpus_dir() / "train.tsv", train_file)
    summaries = {}
    for name, folder in (("continued shallow", converted_folder), ("grown", grown_folder)):
        out = workdir / tuned_folder_name(name)
        for stale in (out, out.with_name(out.name + "-run")):
            shutil.rmtree(stale, ignore_errors=True)
        summaries[name] = finetune(folder, train_file, out, args)

    rows = {"converted": score(converted, tokenizer, sources, references, validation, args)}
    rows["converted"]["marian_validation_loss"] = round(marian_loss, 4)
    for name in summaries:
        model = AutoModelForSeq2SeqLM.from_pretrained(workdir / tuned_folder_name(name))
        rows[name] = score(model, tokenizer, sources, references, validation, args)
        rows[name]["train_loss"] = summaries[name]["train_loss"]
        rows[name]["train_seconds"] = summaries[name]["train_seconds"]
    table = markdown(rows, args.finetune_steps)
    results = {
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "source": args.source or "built MarianMTModel, pretrained on the sample",
        "pretrain_losses_every_50_steps": pretrain_losses,
        "converted_logits_max_abs_difference": largest,
        "grown_encoder": {"from": converted.config.encoder_layers, "new_layers": new_layers},
        "models": rows,
        "timings": {**timings, "total_seconds": round(time.perf_counter() - started, 1)},
        "table": table,
    }
    print(f"converted logits vs Marian's, validation batches: max |difference| = {largest:.3g}")
    print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
