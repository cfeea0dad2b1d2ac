"""`hf-deep-nmt inspect` in one call: every analysis of `hf_deep_nmt.tools.diagnostics` on a saved model and a batch of
parallel text, written as `inspect.json` and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq

from hf_deep_nmt import MODEL_CLASSES  # its first use registers the model classes
from hf_deep_nmt.data.corpus import read_parallel_file, sample_corpus_dir
from hf_deep_nmt.folders import check_apart
from hf_deep_nmt.model_folders import check_model_name, check_saved_json_files
from hf_deep_nmt.plots import plot_combination_weights, plot_gradient_norms, plot_layer_similarity
from hf_deep_nmt.tools.diagnostics import STACKS, combination_weights, layer_gradient_norms, layer_similarity
from hf_deep_nmt.weights import safetensors_header, saved_weight_files

INSPECT_JSON = "inspect.json"
MODEL_TYPES = {config_class.model_type for config_class in MODEL_CLASSES}


def inspect_model(
    model,
    output_dir: str | Path,
    data: str | Path | None = None,
    tokenizer=None,
    source_lang: str = "src",
    target_lang: str = "tgt",
    num_sentences: int = 32,
    max_length: int = 128,
    dropout: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Gradient norms (parameters and layer outputs), layer similarities of both stacks and the combination weights
    of `model` (a model or a saved folder / Hub id, whose tokenizer is loaded with it) on the first `num_sentences`
    pairs of `data` (default: the bundled validation set). Writes `inspect.json` and PNG plots to `output_dir`;
    refuses to replace files of an earlier run unless `overwrite`. Returns what the JSON holds."""
    if isinstance(num_sentences, bool) or not isinstance(num_sentences, int) or num_sentences < 1:
        raise ValueError(f"`num_sentences` must be a positive integer, got {num_sentences!r}.")
    name = str(model) if isinstance(model, (str, Path)) else type(model).__name__
    output_dir = Path(output_dir)
    _check_output_dir(output_dir, model, data)
    model, tokenizer = _model_and_tokenizer(model, tokenizer)
    _check_earlier_files(output_dir, model, overwrite)
    batch = _first_pairs(tokenizer, data, source_lang, target_lang, num_sentences, max_length)

    was_training = model.training
    model.train(dropout)
    try:
        gradients = layer_gradient_norms(model, batch, "parameters")
        output_gradients = layer_gradient_norms(model, batch, "outputs")
    finally:
        model.train(was_training)
    similarity = {side: layer_similarity(model, batch, side) for side in STACKS}
    weights = combination_weights(model)

    output_dir.mkdir(parents=True, exist_ok=True)
    files = [
        plot_gradient_norms({"parameters": gradients}, output_dir / "gradient_norms.png", f"{name}").name,
        plot_layer_similarity(similarity, output_dir / "layer_similarity.png", f"{name}").name,
    ]
    for side, entry in weights.items():
        path = plot_combination_weights(entry["weight"], output_dir / f"combination_weights_{side}.png", f"{side}")
        files.append(path.name)
    summary = {
        "model": name,
        "model_type": model.config.model_type,
        "num_sentences": len(batch["input_ids"]),
        "target_tokens": int((batch["labels"] != -100).sum()),
        "dropout": dropout,
        "gradient_norms": gradients,
        "output_gradient_norms": output_gradients,
        "layer_similarity": similarity,
        "combination_weights": {
            side: {"weight": entry["weight"].tolist(), "boundaries": entry["boundaries"]}
            for side, entry in weights.items()
        },
        "files": [INSPECT_JSON] + files,
    }
    (output_dir / INSPECT_JSON).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary


def _check_output_dir(output_dir: Path, model, data) -> None:
    """`ValueError`, before the model is loaded, when the figures would land in the model folder or inside it (and be
    uploaded with it by `push`), or in the corpus's folder; a model named by a path that does not exist is named as
    such here, before any Hub lookup."""
    folder = check_model_name(model, "Model folder") if isinstance(model, (str, Path)) else None
    corpus = Path(data).expanduser().absolute().parent if data is not None else sample_corpus_dir()
    if folder is not None and output_dir.resolve() == folder.resolve():
        beside = folder.resolve().parent / (folder.resolve().name + "-inspect")
        raise ValueError(
            f"The output folder (--output) {str(output_dir)!r} is the model folder: the figures would be uploaded "
            f"with the model by `push`; write them beside it, e.g. {str(beside)!r}."
        )
    if folder is not None:
        check_apart(output_dir, {"the model folder": folder})
    if output_dir.resolve() == corpus.resolve():
        raise ValueError(
            f"The output folder (--output) {str(output_dir)!r} is the folder of the corpus ({str(corpus)!r}); write "
            "the figures to a "
            "folder of their own."
        )


def _model_and_tokenizer(model, tokenizer):
    """A model object with the tokenizer given; a saved folder / Hub id with its own tokenizer."""
    if isinstance(model, (str, Path)):
        check_saved_json_files(model)  # damaged files named here, not deep inside transformers
        for path in saved_weight_files(Path(str(model)).expanduser()):
            safetensors_header(path)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
        model = AutoModelForSeq2SeqLM.from_pretrained(model)
    if tokenizer is None:
        raise ValueError("Give `tokenizer` with a model object (a saved folder brings its own).")
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"inspect measures models of this package (model_type one of {sorted(MODEL_TYPES)}), got "
            f"{type(model).__name__} (model_type {model_type!r})."
        )
    return model, tokenizer


def _check_earlier_files(output_dir: Path, model, overwrite: bool) -> None:
    planned = [INSPECT_JSON, "gradient_norms.png", "layer_similarity.png"] + [
        f"combination_weights_{side}.png" for side in combination_weights(model)
    ]
    existing = [file for file in planned if (output_dir / file).exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{output_dir} already holds {', '.join(existing)} from an earlier run; choose another output folder or "
            "pass overwrite=True (--overwrite)."
        )


def _first_pairs(tokenizer, data, source_lang: str, target_lang: str, num_sentences: int, max_length: int) -> dict:
    """The first `num_sentences` pairs of `data` as one padded batch, labels padded with -100."""
    pairs = read_parallel_file(data or sample_corpus_dir() / "valid.tsv", source_lang, target_lang)
    sources, targets = pairs["source"][:num_sentences], pairs["target"][:num_sentences]
    encoded = tokenizer(sources, text_target=targets, truncation=True, max_length=max_length)
    rows = [
        {"input_ids": i, "attention_mask": m, "labels": t}
        for i, m, t in zip(encoded["input_ids"], encoded["attention_mask"], encoded["labels"])
    ]
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)(rows)
