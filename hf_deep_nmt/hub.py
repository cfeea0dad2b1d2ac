"""A Hub-ready folder: safetensors weights, config with `auto_map`, modeling files, tokenizer, generation config and a
model card rendered from `model_cards/`. An existing non-empty folder is never written over unless asked."""

from __future__ import annotations

import json
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers import PreTrainedModel, PreTrainedTokenizerBase

CITATION_MARKER = "<!-- citation -->"
METHOD_CARDS = {
    "deep_nmt": "deep_nmt",
    "deep_nmt_dlcl": "dlcl",
    "deep_nmt_dsinit": "dsinit",
    "deep_nmt_sdt": "sdt",
    "deep_nmt_msc": "msc",
}


def _card_file(name: str) -> str:
    return (resources.files("hf_deep_nmt.model_cards") / name).read_text(encoding="utf-8")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_model_card(
    model: PreTrainedModel,
    repo_id: str,
    *,
    languages: tuple[str, str] = ("es", "en"),
    metrics: dict[str, Any] | None = None,
    dataset_name: str = "sample",
    eval_set: str = "validation",
    training_data: str = "",
    examples: list[dict[str, str]] | None = None,
    license: str = "apache-2.0",
) -> ModelCard:
    """Model card with Hub metadata (languages, tags, model-index with BLEU/chrF) from `model_cards/template.md`."""
    config = model.config
    method = _card_file(f"methods/{METHOD_CARDS.get(config.model_type, 'deep_nmt')}.md")
    method_text, _, citation = method.partition(CITATION_MARKER)
    metrics = metrics or {}
    results = {name: metrics[name] for name in ("bleu", "chrf") if name in metrics}
    eval_results = [
        EvalResult(
            task_type="translation",
            task_name=f"Translation {languages[0]}-{languages[1]}",
            dataset_type=dataset_name,
            dataset_name=dataset_name,
            dataset_split=eval_set,
            metric_type=name,
            metric_name={"bleu": "sacreBLEU", "chrf": "chrF"}[name],
            metric_value=value,
        )
        for name, value in results.items()
    ]
    card_data = ModelCardData(
        language=list(languages),
        license=license,
        library_name="transformers",
        pipeline_tag="translation",
        tags=["translation", "hf-deep-nmt", config.model_type],
        model_name=repo_id.split("/")[-1],
        eval_results=eval_results or None,
    )
    architecture = {
        key: getattr(config, key)
        for key in (
            "model_type",
            "d_model",
            "encoder_layers",
            "decoder_layers",
            "encoder_attention_heads",
            "encoder_ffn_dim",
            "pre_norm",
            "encoder_layer_aggregation",
            "decoder_layer_aggregation",
            "decoder_self_attention",
            "init_scheme",
            "relative_position_window",
            "vocab_size",
            "share_embeddings",
        )
    }
    generation = model.generation_config
    example_source = json.dumps(examples[0]["source"] if examples else "Hola.", ensure_ascii=False)
    examples = [{key: _cell(value) for key, value in example.items()} for example in (examples or [])]
    return ModelCard.from_template(
        card_data,
        template_str=_card_file("template.md"),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        summary=f"A {config.encoder_layers}-layer-encoder / {config.decoder_layers}-layer-decoder "
        f"`{type(model).__name__}` translating {languages[0]} to {languages[1]}.",
        method_section=method_text.strip(),
        citation=citation.strip(),
        architecture=architecture,
        num_parameters=f"{model.num_parameters():,}",
        example_source=example_source,
        training_data=training_data or "Not recorded.",
        results=results,
        eval_set=f"{dataset_name} ({eval_set})",
        bleu_signature=metrics.get("bleu_signature"),
        num_beams=generation.num_beams or 1,
        length_penalty=generation.length_penalty if generation.length_penalty is not None else 1.0,
        examples=examples,
    )


def check_export_folder(folder: str | Path, overwrite: bool = False) -> None:
    """Raise `FileExistsError` when `folder` exists and is not empty, unless `overwrite`."""
    folder = Path(folder)
    if not overwrite and folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(
            f"Export folder {str(folder)!r} exists and is not empty; choose another folder, or ask to replace it "
            "(`overwrite=True`, or `--overwrite_export true` on the command line)."
        )


def export_hub_folder(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: str | Path,
    *,
    overwrite: bool = False,
    repo_id: str | None = None,
    **card_kwargs: Any,
) -> Path:
    """Write everything a Hub repository needs into `folder`.

    Refuses (`FileExistsError`) when `folder` exists and is not empty, unless `overwrite=True`. The folder is written
    beside its final place and swapped in at the end, so a failure never leaves a half-written or half-deleted folder.
    """
    folder = Path(folder)
    check_export_folder(folder, overwrite)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model.config.use_cache = True
        model.generation_config.use_cache = True
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        card = render_model_card(model, repo_id or f"your-name/{folder.name}", **card_kwargs)
        card.save(staging / "README.md")
        if folder.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            folder.rename(retired / folder.name)
            staging.rename(folder)
            shutil.rmtree(retired)
        else:
            staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return folder
