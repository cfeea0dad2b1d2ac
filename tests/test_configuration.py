"""Config validation (every bad value is named in the error), the tables it is made of, warnings about settings
without effect, named-config defaults, serialisation round trips."""

import dataclasses

import pytest
from transformers import AutoConfig

from hf_deep_nmt import DeepNMTConfig, DlclConfig, MscConfig, SdtConfig
from hf_deep_nmt.modeling.configuration_deep_nmt import (
    ACTIVATIONS,
    DEPENDS_ON,
    DLCL_WEIGHTS,
    FIELD_KINDS,
    LAYER_AGGREGATIONS,
)

SIZE_FIELDS = (
    "vocab_size",
    "decoder_vocab_size",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
)
PROBABILITY_FIELDS = ("dropout", "attention_dropout", "activation_dropout")
BOOL_FIELDS = ("scale_embedding", "share_embeddings", "tie_word_embeddings", "pre_norm", "dlcl_history_norm")


def assert_names_field_and_value(error: pytest.ExceptionInfo, field: str, value: object) -> None:
    message = str(error.value)
    assert f"`{field}" in message, message
    shown = value[-1] if isinstance(value, list) else value  # a list of ids may name just the bad one (its last)
    assert repr(shown) in message, message


def invalid_settings():
    for field in ("layer_aggregation", "encoder_layer_aggregation", "decoder_layer_aggregation"):
        yield pytest.param(field, "dense", {}, id=f"{field}-unknown")
    yield pytest.param("dlcl_weights", "softmax", {"layer_aggregation": "dlcl"}, id="dlcl_weights-unknown")
    yield pytest.param("activation_function", "swishy", {}, id="activation_function-unknown")
    for field in SIZE_FIELDS:
        # decoder_vocab_size only differs from vocab_size with separate embeddings
        extra = {"share_embeddings": False} if field == "decoder_vocab_size" else {}
        for value in (0, -3, 16.0, "16", True):
            yield pytest.param(field, value, extra, id=f"{field}-{value!r}")
    for field in PROBABILITY_FIELDS:
        for value in (-0.1, 1.0, 1.5, "0.1", True):
            yield pytest.param(field, value, {}, id=f"{field}-{value!r}")
    for field in BOOL_FIELDS:
        for value in (1, "True", None):
            yield pytest.param(field, value, {"layer_aggregation": "dlcl"}, id=f"{field}-{value!r}")
    yield pytest.param("layer_norm_eps", 0.0, {}, id="layer_norm_eps-zero")
    yield pytest.param("layer_norm_eps", -1e-5, {}, id="layer_norm_eps-negative")
    yield pytest.param("decoder_vocab_size", 29, {"share_embeddings": True}, id="shared-embeddings-two-vocab-sizes")
    yield pytest.param("dlcl_weights", "average", {}, id="dlcl_weights-without-dlcl-stack")
    yield pytest.param("dlcl_weights", "one", {"layer_aggregation": "residual"}, id="dlcl_weights-one-without-dlcl")
    yield pytest.param("dlcl_history_norm", False, {}, id="dlcl_history_norm-without-dlcl-stack")
    for field in ("pad_token_id", "bos_token_id", "decoder_start_token_id", "eos_token_id"):
        for value in (37, 100, -1, 1.0):
            yield pytest.param(field, value, {}, id=f"{field}-{value!r}")
    yield pytest.param("eos_token_id", [2, 37], {}, id="eos_token_id-list-out-of-range")
    # target-side ids (and the padding id, used by both embeddings) index the target vocabulary
    for field in ("pad_token_id", "decoder_start_token_id", "eos_token_id"):
        yield pytest.param(
            field, 30, {"share_embeddings": False, "decoder_vocab_size": 29}, id=f"{field}-outside-decoder-vocab"
        )


@pytest.mark.parametrize(("field", "value", "extra"), list(invalid_settings()))
def test_invalid_setting_raises_value_error_naming_field_and_value(tiny_config, field, value, extra):
    with pytest.raises(ValueError) as error:
        tiny_config(DeepNMTConfig, **{**extra, field: value})
    assert_names_field_and_value(error, field, value)


@pytest.mark.parametrize(
    ("side", "width", "encoder_heads", "decoder_heads"), [("encoder", 18, 4, 2), ("decoder", 16, 4, 3)]
)
def test_width_not_divisible_by_heads_names_width_and_heads(tiny_config, side, width, encoder_heads, decoder_heads):
    with pytest.raises(ValueError) as error:
        tiny_config(
            DeepNMTConfig, d_model=width, encoder_attention_heads=encoder_heads, decoder_attention_heads=decoder_heads
        )
    message = str(error.value)
    heads = encoder_heads if side == "encoder" else decoder_heads
    assert f"`d_model` ({width})" in message, message
    assert f"`{side}_attention_heads`, got {heads}" in message, message


@pytest.mark.parametrize("value", LAYER_AGGREGATIONS)
def test_every_layer_aggregation_choice_is_accepted_per_stack(tiny_config, value):
    config = tiny_config(DeepNMTConfig, decoder_layer_aggregation=value)
    assert (config.encoder_layer_aggregation, config.decoder_layer_aggregation) == ("residual", value)


@pytest.mark.parametrize("value", DLCL_WEIGHTS)
def test_every_dlcl_weight_mode_is_accepted_with_a_dlcl_stack(tiny_config, value):
    assert tiny_config(DeepNMTConfig, encoder_layer_aggregation="dlcl", dlcl_weights=value).dlcl_weights == value


def test_activation_choices_include_the_paper_activation():
    assert "relu" in ACTIVATIONS and "gelu" in ACTIVATIONS


def test_stack_aggregations_default_to_layer_aggregation_and_can_be_overridden():
    config = DeepNMTConfig(layer_aggregation="dlcl", decoder_layer_aggregation="residual")
    assert (config.encoder_layer_aggregation, config.decoder_layer_aggregation) == ("dlcl", "residual")
    config = DeepNMTConfig(layer_aggregation="dlcl")
    assert (config.encoder_layer_aggregation, config.decoder_layer_aggregation) == ("dlcl", "dlcl")


def test_decoder_vocab_size_defaults_to_vocab_size():
    assert DeepNMTConfig(vocab_size=37).decoder_vocab_size == 37
    assert DeepNMTConfig(vocab_size=37, share_embeddings=False, decoder_vocab_size=29).decoder_vocab_size == 29


def test_dlcl_config_defaults_are_the_paper_main_system():
    config = DlclConfig()
    assert config.model_type == "deep_nmt_dlcl"
    assert (config.encoder_layers, config.decoder_layers) == (30, 6)
    assert (config.d_model, config.encoder_ffn_dim, config.decoder_ffn_dim) == (512, 2048, 2048)
    assert (config.encoder_attention_heads, config.decoder_attention_heads) == (8, 8)
    assert config.pre_norm is True
    assert (config.encoder_layer_aggregation, config.decoder_layer_aggregation) == ("dlcl", "dlcl")
    assert (config.dlcl_weights, config.dlcl_history_norm) == ("learned", True)
    # the DLCL paper's pre-norm system uses residual, attention and ReLU dropout 0.1
    assert (config.dropout, config.attention_dropout, config.activation_dropout) == (0.1, 0.1, 0.1)
    assert config.share_embeddings and config.tie_word_embeddings
    assert (config.bos_token_id, config.pad_token_id, config.eos_token_id, config.decoder_start_token_id) == (
        0,
        1,
        2,
        0,
    )
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (512, 30, 8)


def test_base_config_defaults_are_a_plain_transformer_base():
    config = DeepNMTConfig()
    assert config.model_type == "deep_nmt"
    assert (config.encoder_layers, config.decoder_layers, config.d_model) == (6, 6, 512)
    assert (config.encoder_layer_aggregation, config.decoder_layer_aggregation) == ("residual", "residual")
    assert config.is_encoder_decoder


@pytest.mark.parametrize(
    ("config_class", "overrides"),
    [
        (DeepNMTConfig, {}),
        (DeepNMTConfig, {"encoder_layer_aggregation": "dlcl", "dlcl_weights": "one", "pre_norm": False}),
        (
            DlclConfig,
            {
                "decoder_layer_aggregation": "residual",
                "dlcl_history_norm": False,
                "share_embeddings": False,
                "decoder_vocab_size": 29,
                "tie_word_embeddings": False,
                "activation_function": "gelu",
            },
        ),
    ],
)
def test_config_round_trips_through_dict_and_json(tiny_config, tmp_path, config_class, overrides):
    config = tiny_config(config_class, **overrides)
    expected = config.to_dict()
    assert all(expected[key] == value for key, value in overrides.items())

    from_dict = config_class.from_dict(expected)
    assert type(from_dict) is config_class
    assert from_dict.to_dict() == expected

    config.save_pretrained(tmp_path)
    from_json = AutoConfig.from_pretrained(tmp_path)
    assert type(from_json) is config_class
    saved = from_json.to_dict()
    # the registered config class is written for remote code
    assert saved.pop("auto_map") == {"AutoConfig": f"configuration_deep_nmt.{config_class.__name__}"}
    assert {**saved, "_name_or_path": ""} == {**expected, "_name_or_path": ""}


# ---- resolve, then validate from tables --------------------------------------------------------------------------

# fields checked outside the two tables: the special ids (against the vocabularies), the derived cache-layer types and
# two fixed flags
OTHER_FIELDS = {
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "decoder_layer_types",
    "use_cache",
    "is_encoder_decoder",
}


def test_every_field_of_the_config_is_in_a_table_and_every_table_entry_is_a_field():
    fields = {item.name for item in dataclasses.fields(DeepNMTConfig)}
    own = set(DeepNMTConfig.__annotations__)
    in_tables = set(FIELD_KINDS) | {field for rule in DEPENDS_ON for field in rule.fields}
    assert own - in_tables - OTHER_FIELDS == set()
    assert in_tables <= fields and OTHER_FIELDS <= fields
    assert all(set(rule.shown) <= fields for rule in DEPENDS_ON)


@pytest.mark.parametrize(
    ("config_class", "overrides"),
    [
        (DeepNMTConfig, {}),
        (SdtConfig, {"sparse_block_size": 2}),
        (MscConfig, {"encoder_layers": None, "msc_block_layers": (2, 1)}),
        (DeepNMTConfig, {"decoder_self_attention": "average", "share_embeddings": False, "decoder_vocab_size": 29}),
    ],
)
def test_validation_changes_nothing(tiny_config, config_class, overrides):
    config = tiny_config(config_class, **overrides)
    resolved = config.to_dict()
    config._validate()
    assert config.to_dict() == resolved


def test_an_alias_is_checked_like_its_field():
    assert DeepNMTConfig(hidden_size=64).d_model == 64
    with pytest.raises(ValueError, match=r"`d_model` \(63\) must be divisible by `encoder_attention_heads`"):
        DeepNMTConfig(hidden_size=63)
    with pytest.raises(ValueError, match=r"`encoder_layers` \(10\) must equal the total of the MSC encoder blocks"):
        MscConfig(num_hidden_layers=10)


def test_an_unknown_key_is_warned_about_with_the_closest_field(caplog):
    with caplog.at_level("WARNING"):
        config = DeepNMTConfig(dropuot=0.3, num_beams=4)
    assert "DeepNMTConfig ignores 'dropuot' (did you mean 'dropout'?), 'num_beams'" in caplog.text
    assert "['num_beams'] belong in the model's `generation_config`" in caplog.text
    assert config.dropout == 0.1


def test_a_layer_aggregation_that_neither_stack_uses_is_warned_about(caplog):
    with caplog.at_level("WARNING"):
        config = SdtConfig(layer_aggregation="dlcl")
    assert "`layer_aggregation='dlcl'` has no effect" in caplog.text
    assert (config.encoder_layer_aggregation, config.decoder_layer_aggregation) == ("sparse", "residual")
    caplog.clear()
    with caplog.at_level("WARNING"):
        DeepNMTConfig(encoder_layer_aggregation="dlcl", decoder_layer_aggregation="sparse")  # the global is default
        SdtConfig(layer_aggregation="sparse")  # the encoder uses it
    assert "has no effect" not in caplog.text


def test_a_hand_set_decoder_layer_types_is_replaced_with_a_warning(caplog):
    with caplog.at_level("WARNING"):
        config = DeepNMTConfig(decoder_layers=2, decoder_layer_types=["full_attention"] * 2)
    assert "`decoder_layer_types` is derived" in caplog.text
    assert config.decoder_layer_types == ["deep_nmt"] * 2


def test_the_layer_types_0_1_0_saved_are_replaced_silently(caplog):
    with caplog.at_level("WARNING"):
        config = DeepNMTConfig(decoder_layers=2, decoder_layer_types=["deep_nmt_msc"] * 2)
    assert caplog.text == "" and config.decoder_layer_types == ["deep_nmt"] * 2
