"""What a CTranslate2 model folder is read by, shared by the exporter (`hf_deep_nmt.serving.ctranslate2`, which
imports torch and transformers) and the decoder (`hf_deep_nmt.serving.ctranslate2_decoder`), which must not:
translating with CTranslate2 needs neither torch nor transformers, as translating with ONNX Runtime does not.

Here: the folder's names, the `ctranslate2` package's import, which settings CTranslate2 can express
(`SETTINGS`, `ctranslate2_blockers`, `servable_by_plain_reading`), and the plain reading of the two files the decoder
takes its settings from, `IDENTITY_FILE` (`read_identity`) and `generation_config.json`
(`read_generation_config`). What the plain reading relies on and finds malformed is an error naming the file and
the field; a file holding a setting it does not reproduce is left to transformers (the caller's fallback), so that
no setting is read otherwise than transformers reads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_deep_nmt.serving.options import SavedGenerationConfig
from hf_deep_nmt.settings import SettingCheck, refusals

# Activations of this package's configs that CTranslate2 computes the same way (`common_spec.Activation` names).
ACTIVATIONS = {
    "relu": "RELU",
    "gelu": "GELU",
    "gelu_new": "GELUTanh",
    "gelu_pytorch_tanh": "GELUTanh",
    "silu": "SWISH",
    "swish": "SWISH",
    "tanh": "Tanh",
    "sigmoid": "Sigmoid",
}

CTRANSLATE2_SUBFOLDER = "ctranslate2"  # a model folder (and its Hub repository) carries its CTranslate2 model here
# Written beside the CTranslate2 model: what its decoder checks a tokenizer against (the fingerprint and special ids
# of the model it was made from), since CTranslate2's own config.json has no place for them.
IDENTITY_FILE = "hf_deep_nmt_model.json"


class MissingCTranslate2Error(RuntimeError):
    """The optional `ctranslate2` package is not installed."""


def require_ctranslate2(purpose: str = "exporting to CTranslate2"):
    try:
        import ctranslate2
    except ImportError:
        raise MissingCTranslate2Error(
            f"{purpose} needs the ctranslate2 package; install it with "
            "`pip install 'hf-deep-nmt[bench]'` (or `pip install ctranslate2`)."
        ) from None
    return ctranslate2


def _aggregation_problem(value) -> str | None:
    if value == "residual":
        return None
    what = {
        "dlcl": "DLCL layer history",
        "attnres": "Attention Residuals (a softmax over the earlier layers)",
        "block_attnres": "Block Attention Residuals (a softmax over the earlier blocks)",
    }.get(value, "sparse (SDT) block connections")
    return f"{what}: a CTranslate2 layer reads only the layer below"


def _self_attention_problem(value) -> str | None:
    if value == "multi_head":
        return None
    what = "merged attention, MAtt" if value == "merged_average" else "the average attention network, AAN"
    return f"{what}: CTranslate2 decoders have multi-head self-attention"


def _eos_problem(value) -> str | None:
    return "CTranslate2 stops at one end token" if isinstance(value, list) and len(value) > 1 else None


ANY = None  # a setting whose every value the exporter expresses (a size, or one that only matters with another)
# Every setting the exporter knows, with the check of its value (None when it can express the value, else why not).
# An allow-list: a setting missing here (a new method's, say) is refused by name until the exporter is taught it.
SETTINGS: dict[str, SettingCheck | None] = {
    **dict.fromkeys(
        (
            "vocab_size",
            "decoder_vocab_size",
            "d_model",
            "encoder_layers",
            "decoder_layers",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "layer_norm_eps",
            "scale_embedding",
            "share_embeddings",
            "tie_word_embeddings",
            "pre_norm",
            "sinusoid_frequencies",
            "output_bias",
            "pad_token_id",
            "bos_token_id",
            "decoder_start_token_id",
            "decoder_layer_types",
            "use_cache",
            "sdpa_avoid_cudnn",
            # training only
            "dropout",
            "attention_dropout",
            "activation_dropout",
            "encoder_l2_lambda",
            "init_scheme",
            "ds_init_alpha",
            "ds_init_mode",
            # how the model was made
            "converted_from",
            "tokenizer_fingerprint",
            "growth",
            # DeepNorm's skip weight alpha is folded into the weights and the epsilon (`deepnorm_scales`)
            "deepnorm",
            # settings of a feature refused through another setting (the layer histories, the AAN, MSC)
            "layer_aggregation",
            "dlcl_weights",
            "dlcl_history_norm",
            "sparse_block_size",
            "encoder_block_boundaries",
            "decoder_block_boundaries",
            "aan_ffn",
            "msc_context",
            "msc_context_sides",
            "msc_fusion",
            "hyper_connections_dynamic",
            "hyper_connections_sinkhorn_iterations",
        ),
        ANY,
    ),
    **dict.fromkeys(
        ("hyper_connections", "encoder_hyper_connections", "decoder_hyper_connections"),
        lambda value: (
            None
            if not value
            else "Hyper-Connections: several residual streams mixed by learned weights around every sublayer, where "
            "CTranslate2's Transformer has one residual stream"
        ),
    ),
    "encoder_layer_aggregation": _aggregation_problem,
    "decoder_layer_aggregation": _aggregation_problem,
    "decoder_self_attention": _self_attention_problem,
    "msc_block_layers": lambda value: (
        None
        if value is None
        else "MSC: block-wise cross-attention and the context states have no CTranslate2 counterpart"
    ),
    "relative_position_window": lambda value: (
        None
        if not value
        else "relative position keys: CTranslate2 uses them instead of the absolute sinusoidal positions, which these "
        "models add as well"
    ),
    "activation_function": lambda value: (
        None if value in ACTIVATIONS else f"CTranslate2 computes {sorted(ACTIVATIONS)}"
    ),
    "eos_token_id": _eos_problem,
}


def ctranslate2_blockers(config) -> list[str]:
    """Each setting of `config` that CTranslate2's Transformer cannot express, naming it and its value and saying
    why, and each setting the exporter does not know (`SETTINGS` is an allow-list); empty when the model can be
    exported."""
    return refusals(config, SETTINGS, "the CTranslate2 exporter")


# ---- the plain reading of a model's files ---------------------------------------------------------------------------

# The keys transformers' `PretrainedConfig.to_dict()` writes into every config (and `auto_map`), which
# `settings.model_settings` leaves out of what an allow-list judges (the same set as the installed transformers':
# a test holds it to it).
GENERIC_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "chunk_size_feed_forward",
        "dtype",
        "id2label",
        "is_encoder_decoder",
        "label2id",
        "model_type",
        "output_attentions",
        "output_hidden_states",
        "problem_type",
        "return_dict",
        "transformers_version",
    }
)
PACKAGE_MODEL_TYPES = "deep_nmt"  # this package's model types, each family's (`deep_nmt_deepnorm`, ...) too
# Settings whose null (or, for the Hyper-Connections ones, missing) value the config class fills in when it loads:
# the layer aggregation of each stack from `layer_aggregation`, each side's Hyper-Connections from
# `hyper_connections` (`to_dict` writes none of the three where all are off).
DERIVED_WHEN_NULL = ("encoder_layer_aggregation", "decoder_layer_aggregation")
HYPER_CONNECTION_SETTINGS = ("hyper_connections", "encoder_hyper_connections", "decoder_hyper_connections")


def servable_by_plain_reading(values: dict) -> bool:
    """Whether `values`, a parsed config.json, is a model CTranslate2 can express, told without transformers: True
    only where every key is one `SETTINGS` or `GENERIC_CONFIG_KEYS` names and every setting `SETTINGS` checks holds,
    as written, a value its check accepts. False wherever the answer needs the config class (a model type not this
    package's, an unknown key, a setting left for the class to fill in) or is a refusal: `ctranslate2_blockers` of
    the config that transformers loads then gives (and words) the answer."""
    model_type = values.get("model_type")
    if not isinstance(model_type, str) or not model_type.startswith(PACKAGE_MODEL_TYPES):
        return False
    if any(key not in SETTINGS and key not in GENERIC_CONFIG_KEYS for key in values):
        return False
    for field, check in SETTINGS.items():
        if check is None:
            continue
        if field in HYPER_CONNECTION_SETTINGS:
            if values.get(field):
                return False
        elif field not in values or (values[field] is None and field in DERIVED_WHEN_NULL):
            return False
        elif check(values[field]) is not None:
            return False
    return True


def _count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ids(value) -> bool:
    """A token id, or a non-empty list of them."""
    return _count(value) or (isinstance(value, list) and bool(value) and all(_count(item) for item in value))


# What the decoder reads of IDENTITY_FILE (`model_identity` writes it), and what each field must be; null, or a field
# left out (a folder exported before it was recorded), is not checked against.
IDENTITY_FIELDS = {
    "tokenizer_fingerprint": (lambda value: isinstance(value, str), "a string"),
    "vocab_size": (lambda value: _count(value, 1), "a positive integer"),
    "pad_token_id": (_ids, "a token id or a list of them"),
    "eos_token_id": (_ids, "a token id or a list of them"),
    "bos_token_id": (_ids, "a token id or a list of them"),
    "decoder_start_token_id": (_ids, "a token id or a list of them"),
    "model_type": (lambda value: isinstance(value, str), "a string"),
    "max_positions": (lambda value: _count(value, 2), "an integer >= 2"),
}
# What CTranslate2's decoding and the translate command read of a generation_config.json, and what each must be.
GENERATION_FIELDS = {
    "num_beams": (lambda value: _count(value, 1), "a positive integer"),
    "length_penalty": (_number, "a number"),
    "early_stopping": (lambda value: value is True or value is False or value == "never", 'true, false or "never"'),
    "repetition_penalty": (lambda value: _number(value) and value > 0, "a positive number"),
    "no_repeat_ngram_size": (_count, "an integer >= 0"),
    "min_length": (_count, "an integer >= 0"),
    "bad_words_ids": (
        lambda value: isinstance(value, list) and all(isinstance(ids, list) and _ids(ids) for ids in value),
        "a list of non-empty lists of token ids",
    ),
    "suppress_tokens": (lambda value: isinstance(value, list) and all(map(_count, value)), "a list of token ids"),
    "eos_token_id": (_ids, "a token id or a list of them"),
}
# Settings of a generation config that `generate()` applies while choosing tokens, and which CTranslate2's
# `translate_batch` has no option for: refused by name where a model sets them (`CTranslate2Decoder.check`), since the
# torch backend honours them.
UNSUPPORTED_GENERATION = (
    "forced_bos_token_id",
    "forced_eos_token_id",  # unless it is the end token, which `translate`'s output cap forces anyway
    "begin_suppress_tokens",
    "sequence_bias",
    "encoder_no_repeat_ngram_size",
    "exponential_decay_length_penalty",
    "min_new_tokens",
    "diversity_penalty",
)
# What an exported generation config holds that decoding with CTranslate2 never reads (bookkeeping, the ids
# `IDENTITY_FILE` and the tokenizer hold, the outputs `generate()` returns, its own length cap).
GENERATION_UNREAD = (
    "_from_model_config",
    "transformers_version",
    "bos_token_id",
    "decoder_start_token_id",
    "pad_token_id",
    "max_length",
    "output_attentions",
    "output_hidden_states",
    "use_cache",
)


def _checked_fields(path: Path, values, fields: dict, way_out: str) -> dict:
    """`values` (parsed from `path`), every field of `fields` it holds checked: `ValueError` naming the file, the
    field and what it must be."""
    if not isinstance(values, dict):
        raise ValueError(f"{path} holds {type(values).__name__}, not a JSON object; {way_out}.")
    for field, (accepts, what) in fields.items():
        if values.get(field) is not None and not accepts(values[field]):
            raise ValueError(f"{path}: `{field}` is {values[field]!r}, not {what}; {way_out}.")
    return values


def read_identity(folder: str | Path) -> dict:
    """The fields of the `IDENTITY_FILE` in `folder` (none where a folder exported before it was written has none),
    each it relies on checked (`IDENTITY_FIELDS`): `ValueError` naming the file and the field."""
    path = Path(folder) / IDENTITY_FILE
    if not path.is_file():
        return {}
    way_out = "write it again with `hf-deep-nmt export-ctranslate2`"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path} is not JSON ({error}); {way_out}.") from None
    return _checked_fields(path, values, IDENTITY_FIELDS, way_out)


def read_generation_config(folder: str | Path) -> SavedGenerationConfig | None:
    """The generation_config.json in `folder` read without transformers (`SavedGenerationConfig`; of no file, the
    defaults), what decoding reads of it checked (`GENERATION_FIELDS`: `ValueError` naming the file and the field).
    None where transformers must read it: a file that is not a JSON object (transformers names the fault), or one
    holding a setting not listed here (so that no setting is honoured, or passed over, otherwise than before)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return SavedGenerationConfig({})
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    known = (*GENERATION_FIELDS, *UNSUPPORTED_GENERATION, *GENERATION_UNREAD)
    if not isinstance(values, dict) or any(key not in known for key in values):
        return None
    way_out = "correct it, or write the export again with `hf-deep-nmt export-ctranslate2`"
    return SavedGenerationConfig(_checked_fields(path, values, GENERATION_FIELDS, way_out))
