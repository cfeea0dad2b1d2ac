"""What `--help` says about names defined in modules that import torch and transformers (seconds): a copy, so that
every `hf-deep-nmt ... --help` answers at once.

`RECIPE_SETTINGS` holds each argument dataclass of a recipe as (name, metavar, default, help) rows; the other names
are the choices and limits that `grow`, `export-ctranslate2`, `doctor` and `serve` show and check.
tests/test_cli_help.py holds every value equal to the live one; after changing one of them, rewrite this file with
`python -m hf_deep_nmt.cli_reference` and format it with `ruff format`."""

# ruff: noqa: E501  (help texts copied whole, as the fields state them)

RECIPE_SETTINGS = {
    "ModelArguments": (
        (
            "model_type",
            "TEXT",
            None,
            "Named preset to start from, one of ('deep_nmt', 'deep_nmt_dlcl', 'deep_nmt_dsinit', 'deep_nmt_sdt', 'deep_nmt_msc', 'deep_nmt_deepnorm', 'deep_nmt_denseformer', 'deep_nmt_mixln', 'deep_nmt_attnres', 'deep_nmt_hyper_connections') (default deep_nmt_dlcl); with `model_name_or_path`, if given, it must be the saved model's.",
        ),
        (
            "model_overrides",
            "JSON",
            "{}",
            "Config fields that replace the preset's defaults (JSON object); with `model_name_or_path`, each must equal the saved model's value.",
        ),
        (
            "model_name_or_path",
            "TEXT",
            None,
            "Start from this saved model folder or Hub id (config, weights and tokenizer) instead of a fresh preset, e.g. a folder written by `convert-marian` and grown with `grow_encoder`.",
        ),
        (
            "tokenizer_name_or_path",
            "TEXT",
            None,
            "Saved tokenizer; default: the saved model's, or a joint one trained on the training data.",
        ),
        ("tokenizer_vocab_size", "N", None, "Size of a newly trained joint vocabulary (default 8000)."),
        ("tokenizer_model", "TEXT", None, "Subword model of a new tokenizer: bpe (default) or unigram."),
        (
            "tokenizer_train_pairs",
            "N",
            None,
            "A new tokenizer is trained on at most this many training pairs, drawn for the seed (default 1000000; a smaller corpus is used whole).",
        ),
    ),
    "DataArguments": (
        ("train_file", "TEXT", None, "Training corpus (.tsv, .jsonl or a two-file prefix); default: bundled sample."),
        ("validation_file", "TEXT", None, "Validation corpus; default: sample."),
        ("dataset_name", "TEXT", None, "A `datasets.load_dataset` name instead."),
        ("dataset_config", "TEXT", None, "Its configuration, e.g. de-en."),
        ("dataset_validation_split", "TEXT", "validation", "Split of `dataset_name` to evaluate on (e.g. test)."),
        ("source_lang", "TEXT", "es", "Source language code."),
        ("target_lang", "TEXT", "en", "Target language code."),
        ("max_source_length", "N", "128", "Longer source sentences are dropped (counted)."),
        ("max_target_length", "N", "128", "Longer target sentences are dropped (counted)."),
        ("max_eval_samples", "N", None, "Evaluate on the first N pairs only."),
        (
            "prepared_data_dir",
            "TEXT",
            None,
            "Folder of the prepared data (tokenizer + tokenized splits), built when missing; default: $HF_DEEP_NMT_PREPARED_DATA/<fingerprint> or <HF_HOME>/hf_deep_nmt/prepared/<fingerprint>.",
        ),
        ("preprocessing_num_workers", "N", None, "Processes that tokenize the corpus (default: the cores available)."),
        (
            "streaming",
            "[true|false]",
            "false",
            "Read the training corpus while training (larger than memory or disk cache): token-budget batches from a shuffling, length-bucketing buffer; needs max_steps. See docs/training.md, Streaming.",
        ),
        (
            "stream_buffer_pairs",
            "N",
            "100000",
            "With streaming: pairs per process read, sorted by length and cut into batches at a time.",
        ),
    ),
    "EvalExportArguments": (
        ("num_beams", "N", "4", "Beam size for evaluation and export."),
        ("length_penalty", "X", "1.0", "Length penalty alpha (see length_penalty_form)."),
        (
            "length_penalty_form",
            "TEXT",
            "fairseq",
            "fairseq: score / |Y|**alpha (generate()'s own); gnmt: score / ((5 + |Y|) / 6)**alpha.",
        ),
        ("max_length_a", "X", "1.5", "Output may be a * source_length + b tokens long."),
        ("max_length_b", "N", "10", "See max_length_a."),
        ("eval_max_tokens", "N", None, "Token budget of a translation batch in the final evaluation."),
        ("tokenized_bleu", "[true|false]", "false", "Also report tokenized BLEU (multi-bleu style)."),
        ("bleu_tokenize", "TEXT", "13a", "sacreBLEU tokenizer for the tokenized BLEU."),
        ("compound_split", "[true|false]", "false", "Split a-b as a ##AT##-##AT## b (En-De papers)."),
        ("bleu_lowercase", "[true|false]", "false", "Case-insensitive tokenized BLEU (IWSLT)."),
        (
            "average_checkpoints",
            "N",
            "0",
            "Evaluate and export the mean of the last N checkpoints (0: the final weights).",
        ),
        (
            "plot_curves",
            "[true|false]",
            "true",
            "Write training_curves.png (loss, validation BLEU); needs matplotlib.",
        ),
        ("translate_examples", "N", "5", "Validation sentences to translate and show."),
        ("export_dir", "TEXT", None, "Write a Hub-ready folder here after training."),
        ("overwrite_export", "[true|false]", "false", "Replace a non-empty export_dir."),
        ("repo_id", "TEXT", None, "Hub repository id named in the model card."),
    ),
    "DeepNMTTrainingArguments": (
        (
            "max_tokens",
            "N",
            None,
            "Token budget per training batch and process (padded size); replaces the sentence count.",
        ),
        (
            "lr_schedule",
            "TEXT",
            "trainer",
            "trainer: `lr_scheduler_type`; inverse_sqrt: fairseq (warm-up from warmup_init_lr to learning_rate); noam: learning_rate * d^-0.5 * min(n^-0.5, n * warmup^-1.5).",
        ),
        ("warmup_init_lr", "X", "1e-07", "Start of the fairseq inverse_sqrt warm-up."),
        (
            "max_consecutive_nonfinite_steps",
            "N",
            "5",
            "Optimizer steps with a NaN/inf loss or gradient are skipped (no update, schedule held); more than this many in a row stop the run with NonFiniteTrainingError (0: stop at the first).",
        ),
        (
            "overwrite_output_dir",
            "[true|false]",
            "false",
            "Start afresh in an output_dir holding another run: remove what runs of this package wrote there (checkpoints, results, curves, its record); other files are kept.",
        ),
    ),
    "StageArguments": (
        (
            "stage_depths",
            "N [N ...]",
            "[6, 12, 18, 24, 30, 36, 42, 48]",
            "Encoder depth of each stage, increasing; the first is trained from scratch.",
        ),
        ("stage_max_steps", "N", "5000", "Optimizer steps per stage."),
        ("growth_strategy", "TEXT", "top", "How to grow: one of ('top', 'top_only', 'double', 'interleave')."),
        (
            "reset_previous_block_norm",
            "[true|false]",
            "false",
            "Reset the old top block's LayerNorm after growing (the reference code).",
        ),
        ("schedule_warmup_steps", "N", "8000", "Warm-up of the inverse-sqrt schedule."),
        ("schedule_init_lr", "X", "1e-07", "Learning rate at step 0 of the warm-up."),
    ),
}
GROWTH_STRATEGIES = ("top", "top_only", "double", "interleave")
EXACT_AGGREGATIONS = ("dlcl", "sparse")
CTRANSLATE2_SERVABLE = "pre- or post-norm (DeepNorm included), residual layers in both stacks, multi-head decoder self-attention, no relative position keys, no MSC"
CTRANSLATE2_MIN_MAX_POSITIONS = 2
CTRANSLATE2_DEFAULT_MAX_POSITIONS = 1026
DOCTOR_FAMILIES = (
    "aan",
    "attnres-block",
    "deepnorm",
    "denseformer-2x2",
    "dlcl-postnorm",
    "dlcl-prenorm",
    "dsinit-matt",
    "mhc-2-dynamic",
    "mixln-1-1",
    "msc",
    "postnorm",
    "prenorm",
    "sdt-sparse-rpr",
)
SERVE_BACKENDS = ("ctranslate2", "onnxruntime", "torch")


def _metavar(annotation) -> str:
    """How a flag's value is written, from its dataclass field's type."""
    text = str(annotation)
    for kind, metavar in (("list", "N [N ...]"), ("dict", "JSON"), ("bool", "[true|false]")):
        if kind in text:
            return metavar
    if "int" in text:
        return "N"
    return "X" if "float" in text else "TEXT"


def _settings(cls, own_only: bool = False) -> tuple[tuple, ...]:
    """One row per field of the dataclass `cls` (with `own_only`, only those it declares itself, not its bases')."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    own = set(cls.__dict__.get("__annotations__", {}))
    rows = []
    for item in dataclasses.fields(cls):
        if own_only and item.name not in own:
            continue
        if item.default is not dataclasses.MISSING:
            default = item.default
        else:
            default = item.default_factory() if item.default_factory is not dataclasses.MISSING else None
        shown = None if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        rows.append((item.name, _metavar(hints[item.name]), shown, item.metadata.get("help", "")))
    return tuple(rows)


def live_values() -> dict:
    """The values this file copies, read from their modules (imports torch and transformers)."""
    from hf_deep_nmt.serving import backends
    from hf_deep_nmt.serving import ctranslate2 as ctranslate2_export
    from hf_deep_nmt.tools import doctor
    from hf_deep_nmt.training import arguments, growing

    return {
        "RECIPE_SETTINGS": {
            "ModelArguments": _settings(arguments.ModelArguments),
            "DataArguments": _settings(arguments.DataArguments),
            "EvalExportArguments": _settings(arguments.EvalExportArguments),
            "DeepNMTTrainingArguments": _settings(arguments.DeepNMTTrainingArguments, own_only=True),
            "StageArguments": _settings(arguments.StageArguments),
        },
        "GROWTH_STRATEGIES": tuple(growing.GROWTH_STRATEGIES),
        "EXACT_AGGREGATIONS": tuple(growing.EXACT_AGGREGATIONS),
        "CTRANSLATE2_SERVABLE": ctranslate2_export.SERVABLE,
        "CTRANSLATE2_MIN_MAX_POSITIONS": ctranslate2_export.MIN_MAX_POSITIONS,
        "CTRANSLATE2_DEFAULT_MAX_POSITIONS": ctranslate2_export.DEFAULT_MAX_POSITIONS,
        "DOCTOR_FAMILIES": tuple(sorted(doctor.families())),
        "SERVE_BACKENDS": backends.FASTEST_FIRST,
    }


def write() -> None:
    """Rewrite the values of this file from `live_values`, keeping its code."""
    from pathlib import Path

    path = Path(__file__)
    text = path.read_text(encoding="utf-8")
    head, code = text.split("\n\nRECIPE_SETTINGS = ", 1)
    code = code[code.index("\n\n\ndef _metavar") :]
    values = "\n".join(f"{name} = {value!r}" for name, value in live_values().items())
    path.write_text(f"{head}\n\n{values}{code}", encoding="utf-8")


if __name__ == "__main__":
    write()
