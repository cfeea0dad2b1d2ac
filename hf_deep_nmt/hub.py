"""A Hub-ready folder: safetensors weights, config with `auto_map`, modeling files, tokenizer, generation config and a
model card rendered from `model_cards/`; and its upload through `huggingface_hub`. An existing non-empty folder, or a
Hub repository that already holds files, is never written over unless asked."""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, EvalResult, HfApi, ModelCard, ModelCardData
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hf_deep_nmt import registration  # noqa: F401  (an export writes the `auto_map` and model code of the registered classes)
from hf_deep_nmt.adapters import LORA_TARGET_MODULES
from hf_deep_nmt.fingerprints import record_tokenizer_fingerprint
from hf_deep_nmt.folders import (  # noqa: F401  (the folder-safety functions, imported from here by earlier code)
    EXPORT_FLAG,
    WRITTEN_MARKER,
    check_export_folder,
    check_writable_location,
    files_not_written_by_us,
    folder_entries,
    nearest_existing_parent,
    user_file_modes,
    write_marked_folder,
)
from hf_deep_nmt.modeling.configuration_deep_nmt import DEFAULT_MAX_OUTPUT_TOKENS, DeepNMTConfig
from hf_deep_nmt.modeling.modeling_deep_nmt import METHODS

CITATION_MARKER = "<!-- citation -->"
# Settings every card shows, whatever their value; the card adds every other setting that differs from the base
# architecture's default (`architecture_of`).
CARD_SIZES = (
    "model_type",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "encoder_ffn_dim",
    "vocab_size",
)
# Not architecture: how a model was made or is run, and transformers' own bookkeeping.
NOT_ARCHITECTURE = frozenset(
    (
        "converted_from",
        "growth",
        "tokenizer_fingerprint",
        "use_cache",
        "dropout",
        "attention_dropout",
        "activation_dropout",
        "sdpa_avoid_cudnn",
    )
)


def method_card(model_type: str) -> str:
    """The method description file (under `model_cards/methods/`) of a model type: its `METHODS` entry's `card`; a
    model type of no registered method gets the base architecture's."""
    method = METHODS.get(model_type)
    return method.card if method is not None else "deep_nmt"


def architecture_of(config) -> dict:
    """What a card shows of `config`: the sizes (`CARD_SIZES`), then every setting whose value differs from the base
    architecture's default (`DeepNMTConfig`), so a method's own settings and any new one appear without a list of
    them here. Token ids, transformers' bookkeeping and how the model was made or is run (`NOT_ARCHITECTURE`) are
    left out."""
    from transformers import PretrainedConfig

    values = config.to_dict()
    base = DeepNMTConfig().to_dict()
    generic = set(PretrainedConfig().to_dict()) | {"auto_map", "decoder_layer_types"}
    shown = {key: values[key] for key in CARD_SIZES if key in values}
    for key, value in values.items():
        if key in shown or key in generic or key in NOT_ARCHITECTURE or key.endswith("_token_id"):
            continue
        if key not in base or base[key] != value:
            shown[key] = value
    return shown


def _card_file(name: str) -> str:
    return (resources.files("hf_deep_nmt.model_cards") / name).read_text(encoding="utf-8")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


# The card's licence for a converted model whose source's card names none (a Hub licence identifier).
UNKNOWN_LICENCE = "unknown"
DEFAULT_LICENCE = "apache-2.0"


def _origin_section(config, trained: bool) -> str:
    """The card's "Origin" section for a converted and/or grown model (`converted_from`, `growth` in its config):
    the source model, its licence, and each change made to it; empty for a model trained from scratch."""
    origin, growth = getattr(config, "converted_from", None), getattr(config, "growth", None) or []
    lines = []
    if origin:
        name = origin.get("model", "an unnamed model")
        shown = f"[`{name}`](https://huggingface.co/{name})" if origin.get("location") == "hub" else f"`{name}`"
        revision = f" (revision `{origin['revision']}`)" if origin.get("revision") else ""
        licence = origin.get("license")
        lines.append(
            f"Converted from {shown}{revision}, a transformers `{origin.get('architecture', 'model')}`, with "
            f"`{origin.get('converter', 'hf-deep-nmt convert-marian')}`: the converted model computes the same logits "
            "and translations as the source (post-norm layers, Marian's sinusoidal positions, its logits bias if any, "
            "special ids, generation config and tokenizer carried over; layer drop, which acts only in training, "
            "and the source's position limit are not)."
        )
        lines.append(
            f"Licence of the source model, as its model card states it: `{licence}`; this card's licence metadata "
            "repeats it, since this model is derived from those weights."
            if licence
            else "The source model's card states no licence that could be read; this card's licence metadata says "
            f"`{UNKNOWN_LICENCE}`. Check the source's terms before using or publishing this model."
        )
    for step in growth:
        if "layer_aggregation" in step:
            before, after = step["layer_aggregation"]
            lines.append(
                f"The {step.get('stack', 'encoder')}'s layer aggregation was changed from `{before}` to `{after}` "
                "with `with_layer_aggregation`: the combination weights set to the identity and no history "
                "LayerNorms (`dlcl_history_norm=False`), so the changed model computed exactly what it did before; "
                "training may then move the weights."
            )
            continue
        before, after = step.get("encoder_layers", ["?", "?"])
        reset = ", the previous top block's LayerNorm reset" if step.get("reset_previous_block_norm") else ""
        lines.append(
            f"The encoder was grown from {before} to {after} layers with `grow_encoder` (strategy "
            f"`{step.get('strategy')}`{reset}): the new layers start as copies of trained ones; the decoder, "
            "embeddings and output layer are unchanged by growing."
        )
    if lines and trained:
        lines.append("The weights were then trained as described under Training data.")
    return "\n\n".join(lines)


# The metrics a card reports (keys of `metrics`, in the card's order), each with the id the Hub's metadata knows it by.
CARD_METRICS = {"bleu": "sacrebleu", "chrf": "chrf", "tok_bleu": "bleu"}


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
    license: str | None = None,
    length_penalty_form: str = "fairseq",
    length_rule: tuple[float, int] | None = None,
) -> ModelCard:
    """Model card with Hub metadata (languages, tags, model-index with BLEU/chrF) from `model_cards/template.md`.
    `length_rule` is the recipe's output cap relative to each source, `(max_length_a, max_length_b)`.

    A converted or grown model's card names its origin (the source model, its licence, how it was changed: see
    `_origin_section`); `license` defaults to the source's licence for a converted model (`unknown` when its card
    stated none), else apache-2.0, and a source on the Hub becomes the card's `base_model`."""
    config = model.config
    metrics = metrics or {}
    results = {name: metrics[name] for name in CARD_METRICS if name in metrics}
    card_data = _card_data(
        config, repo_id, languages, metrics, results, dataset_name, eval_set, _licence(config, license)
    )
    method_text, _, citation = _card_file(f"methods/{method_card(config.model_type)}.md").partition(CITATION_MARKER)
    example_source = json.dumps(examples[0]["source"] if examples else "Hola.", ensure_ascii=False)
    return ModelCard.from_template(
        card_data,
        template_str=_card_file("template.md"),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        summary=f"A {config.encoder_layers}-layer-encoder / {config.decoder_layers}-layer-decoder "
        f"`{type(model).__name__}` translating {languages[0]} to {languages[1]}.",
        method_section=method_text.strip(),
        citation=citation.strip(),
        architecture=architecture_of(config),
        num_parameters=f"{model.num_parameters():,}",
        example_source=example_source,
        training_data=training_data or "Not recorded.",
        results=results,
        eval_set=f"{dataset_name} ({eval_set})",
        bleu_signature=metrics.get("bleu_signature"),
        **_decoding_fields(model.generation_config),
        length_penalty_form=length_penalty_form,
        length_rule=length_rule,
        examples=[{key: _cell(value) for key, value in example.items()} for example in (examples or [])],
        origin_section=_origin_section(config, trained=bool(training_data or results)),
        lora_targets=", ".join(f'"{name}"' for name in LORA_TARGET_MODULES),
    )


def _licence(config, license: str | None) -> str:
    """The card's licence: the caller's; else a converted model's source licence (`unknown` when its card stated
    none), since the model is derived from those weights; else the package's default."""
    if license is not None:
        return license
    origin = getattr(config, "converted_from", None) or {}
    return (origin.get("license") or UNKNOWN_LICENCE) if origin else DEFAULT_LICENCE


def _card_data(
    config,
    repo_id: str,
    languages: tuple[str, str],
    metrics: dict[str, Any],
    results: dict[str, Any],
    dataset_name: str,
    eval_set: str,
    license: str,
) -> ModelCardData:
    """The card's Hub metadata: languages, licence, tags, the metrics and their model-index, and a converted model's
    source on the Hub as `base_model`."""
    origin = getattr(config, "converted_from", None) or {}
    return ModelCardData(
        language=list(languages),
        license=license,
        library_name="transformers",
        pipeline_tag="translation",
        tags=["translation", "hf-deep-nmt", config.model_type],
        datasets=[dataset_name],
        metrics=[CARD_METRICS[name] for name in results] or None,
        model_name=repo_id.split("/")[-1],
        eval_results=_eval_results(languages, metrics, results, dataset_name, eval_set) or None,
        base_model=origin.get("model") if origin.get("location") == "hub" else None,
    )


def _eval_results(
    languages: tuple[str, str], metrics: dict[str, Any], results: dict[str, Any], dataset_name: str, eval_set: str
) -> list[EvalResult]:
    """One model-index entry per metric of `results`; tokenized BLEU is named with its tokenization steps."""
    tokenized = f"tokenized BLEU ({metrics.get('tok_bleu_steps')})"
    metric_names = {"bleu": "sacreBLEU", "chrf": "chrF", "tok_bleu": tokenized}
    return [
        EvalResult(
            task_type="translation",
            task_name=f"Translation {languages[0]}-{languages[1]}",
            dataset_type=dataset_name,
            dataset_name=dataset_name,
            dataset_split=eval_set,
            metric_type=name,
            metric_name=metric_names[name],
            metric_value=value,
        )
        for name, value in results.items()
    ]


def _decoding_fields(generation: GenerationConfig) -> dict[str, Any]:
    """What the card says of decoding: the beam, the length penalty and the most tokens `generate()` produces."""
    if generation.max_new_tokens is not None:
        generate_cap = generation.max_new_tokens
    else:  # the decoder start token is counted in `max_length`
        generate_cap = (generation.max_length or DEFAULT_MAX_OUTPUT_TOKENS + 2) - 1
    return {
        "num_beams": generation.num_beams or 1,
        "length_penalty": generation.length_penalty if generation.length_penalty is not None else 1.0,
        "generate_cap": generate_cap,
    }


def settle_output_cap(generation_config: GenerationConfig) -> GenerationConfig:
    """Leave one honest output cap in `generation_config` before it is saved: `max_new_tokens` when set, without a
    `max_length` beside it (generate() gives `max_new_tokens` precedence, so that one is a stray, e.g. the 20 that
    `Seq2SeqTrainer` evaluation fills in); else `max_length`; else, when neither is set (a folder saved before models
    had a cap), `DEFAULT_MAX_OUTPUT_TOKENS` tokens and `</s>` rather than transformers' 20."""
    if generation_config.max_new_tokens is not None:
        generation_config.max_length = None
    elif generation_config.max_length is None:
        generation_config.max_length = DEFAULT_MAX_OUTPUT_TOKENS + 2  # counts the decoder start token and `</s>`
    return generation_config


def export_hub_folder(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: str | Path,
    *,
    overwrite: bool = False,
    repo_id: str | None = None,
    protected: dict[str, str | Path] | None = None,
    **card_kwargs: Any,
) -> Path:
    """Write everything a Hub repository needs into `folder` (files with the user's normal mode).

    Refuses (`FileExistsError`) when `folder` exists and is not empty, unless `overwrite=True`, and even then when it
    holds files an earlier export did not write (see `check_export_folder`, which also refuses the `protected`
    folders). The folder is written beside its final place and swapped in at the end, so a failure never leaves a
    half-written or half-deleted folder.
    """
    folder = Path(folder)

    def write(staging: Path) -> None:
        model.config.use_cache = True
        model.generation_config.use_cache = True
        settle_output_cap(model.generation_config)
        record_tokenizer_fingerprint(model.config, tokenizer)  # checked wherever the two meet again
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        card = render_model_card(model, repo_id or f"your-name/{folder.name}", **card_kwargs)
        card.save(staging / "README.md")

    return write_marked_folder(folder, write, overwrite=overwrite, protected=protected)


def upload_operations(folder: str | Path) -> list[CommitOperationAdd]:
    """One `CommitOperationAdd` per file of an exported folder (hidden files and folders left out), sorted by path:
    exactly what `push_to_hub` uploads. A symbolic link leading out of the folder (or nowhere), or to a folder, is
    refused (`ValueError` naming it): an upload never carries files from elsewhere on the machine."""
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not (folder / "README.md").is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} is not an exported model folder (no config.json and README.md); export it first."
        )
    root = folder.resolve()
    files = []
    for parent, folders, names in os.walk(folder):
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        for name in [*folders, *names]:
            path = Path(parent) / name
            if name.startswith(".") or not path.is_symlink():
                continue
            target = path.resolve()
            if not target.is_relative_to(root) or not target.exists():
                raise ValueError(
                    f"{path} is a symbolic link to {os.readlink(path)!r}, outside the export folder {str(folder)!r} "
                    "(or missing): nothing from elsewhere is uploaded; replace the link by a copy of the file, or "
                    "remove it."
                )
            if target.is_dir():
                raise ValueError(
                    f"{path} is a symbolic link to a folder; replace it by a copy of the folder, or remove it."
                )
        files += [Path(parent) / name for name in names if not name.startswith(".")]
    return [
        CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
        for path in sorted(files, key=lambda path: path.relative_to(folder).as_posix())
    ]


def _is_network_error(error: BaseException) -> bool:
    """A failure to reach the Hub, whichever HTTP library `huggingface_hub` uses."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(error, (ConnectionError, TimeoutError, OfflineModeIsEnabled)):
        return True
    return any(
        cls.__name__ in ("TransportError", "ConnectionError", "Timeout")
        and cls.__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")
        for cls in type(error).__mro__
    )


def push_to_hub(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    overwrite: bool = False,
    commit_message: str = "Upload hf-deep-nmt model",
    token: str | None = None,
    api: HfApi | None = None,
):
    """Upload an exported folder to the Hub repository `repo_id` in one commit (created if missing).

    A repository that already holds model files is refused (`FileExistsError`, naming them) unless `overwrite=True`;
    then the same commit also deletes its files that the folder does not have, so no stale file survives.
    Offline mode (`HF_HUB_OFFLINE=1`) and a Hub that cannot be reached stop with a `ConnectionError` saying so,
    before anything is sent. Returns the `CommitInfo` of `HfApi.create_commit`.
    """
    from huggingface_hub import constants

    operations: list = upload_operations(folder)
    if api is None and constants.is_offline_mode():
        raise ConnectionError(
            "pushing needs the Hugging Face Hub, but offline mode is on (HF_HUB_OFFLINE is set); unset "
            "HF_HUB_OFFLINE and push again, or list the files with --dry-run."
        )
    api = api or HfApi(token=token)
    try:
        exists = api.repo_exists(repo_id, repo_type="model")
        existing = api.list_repo_files(repo_id, repo_type="model") if exists else []
    except Exception as error:
        if not _is_network_error(error):
            raise
        raise ConnectionError(
            f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({type(error).__name__}: {error}); nothing "
            "was uploaded. Check the network connection (and proxy settings), then push again."
        ) from error
    existing = [name for name in existing if name != ".gitattributes"]
    if exists:
        if existing and not overwrite:
            raise FileExistsError(
                f"Hub repository {repo_id!r} already holds {len(existing)} file(s) ({existing[:5]}); pass "
                "`overwrite=True` (`--overwrite` on the command line) to replace them."
            )
        uploaded = {operation.path_in_repo for operation in operations}
        operations += [CommitOperationDelete(path_in_repo=name) for name in existing if name not in uploaded]
    else:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    return api.create_commit(repo_id, operations=operations, commit_message=commit_message, repo_type="model")
