"""The MSC context switches: `msc_context`, `msc_context_sides` and `msc_fusion`, and the five keys of version 0.1.0
they replace (`msc_context_attention`, `msc_contextual_collaboration`, `msc_context_cell`, `msc_share_gru`,
`msc_decoder_context`), read once on construction: every combination 0.1.0 accepted maps to the fields that say the
same, every one it refused is still an error naming the old keys, and a config saved now holds only the new fields.

The expected mapping is written out here, not taken from the package, so that a wrong mapping fails."""

import itertools
import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig

from hf_deep_nmt import DeepNMTConfig, MscConfig

FIXTURES = Path(__file__).parent / "fixtures" / "v0_1_0"

EARLIER_KEYS = (
    "msc_context_attention",
    "msc_contextual_collaboration",
    "msc_context_cell",
    "msc_share_gru",
    "msc_decoder_context",
)
# Every combination of the five keys that version 0.1.0 accepted (with any `msc_fusion` when the context is attended,
# only the default 'gate' when it is not), and the `msc_context`, `msc_context_sides` it stands for now.
ACCEPTED_BY_0_1_0 = {
    (True, True, "gru", True, True): ("gru", "encoder_and_decoder"),
    (True, True, "gru", True, False): ("gru", "encoder"),
    (True, True, "gru", False, True): ("gru_per_block", "encoder_and_decoder"),
    (True, True, "gru", False, False): ("gru_per_block", "encoder"),
    (True, True, "ffn", True, True): ("ffn", "encoder_and_decoder"),
    (True, True, "ffn", True, False): ("ffn", "encoder"),
    (True, True, "ffn", False, True): ("ffn_per_block", "encoder_and_decoder"),
    (True, True, "ffn", False, False): ("ffn_per_block", "encoder"),
    (True, False, "gru", True, True): ("block_output", "encoder_and_decoder"),
    (True, False, "gru", True, False): ("block_output", "encoder"),
    (False, True, "gru", True, True): ("none", "encoder_and_decoder"),
}
EVERY_0_1_0_COMBINATION = list(
    itertools.product([True, False], [True, False], ["gru", "ffn"], [True, False], [True, False], ["gate", "add"])
)
MSC = dict(msc_block_layers=[2, 1], decoder_layers=2, d_model=16, encoder_attention_heads=2, decoder_attention_heads=2)


def accepted_by_0_1_0(combination: tuple) -> bool:
    *keys, fusion = combination
    return tuple(keys) in ACCEPTED_BY_0_1_0 and (keys[0] or fusion == "gate")


def test_the_enumeration_holds_every_accepted_combination():
    assert sum(map(accepted_by_0_1_0, EVERY_0_1_0_COMBINATION)) == 21  # 10 attended x 2 fusions + 1 without context
    assert set(ACCEPTED_BY_0_1_0) <= {combination[:5] for combination in EVERY_0_1_0_COMBINATION}


@pytest.mark.parametrize(
    "combination", [c for c in EVERY_0_1_0_COMBINATION if accepted_by_0_1_0(c)], ids=lambda c: "-".join(map(str, c))
)
def test_every_combination_0_1_0_accepted_maps_to_the_new_fields(combination, caplog):
    *keys, fusion = combination
    with caplog.at_level("WARNING"):
        config = MscConfig(**MSC, **dict(zip(EARLIER_KEYS, keys)), msc_fusion=fusion)
    assert caplog.text == ""
    assert (config.msc_context, config.msc_context_sides, config.msc_fusion) == (
        *ACCEPTED_BY_0_1_0[tuple(keys)],
        fusion,
    )
    saved = config.to_dict()
    assert not set(EARLIER_KEYS) & set(saved)
    assert (saved["msc_context"], saved["msc_context_sides"]) == ACCEPTED_BY_0_1_0[tuple(keys)]


@pytest.mark.parametrize(
    "combination",
    [c for c in EVERY_0_1_0_COMBINATION if not accepted_by_0_1_0(c)],
    ids=lambda c: "-".join(map(str, c)),
)
def test_every_combination_0_1_0_refused_still_raises_naming_the_old_keys(combination):
    *keys, fusion = combination
    with pytest.raises(ValueError, match=r"msc_context_attention=False|msc_contextual_collaboration=False") as error:
        MscConfig(**MSC, **dict(zip(EARLIER_KEYS, keys)), msc_fusion=fusion)
    assert "msc_context='none'" in str(error.value) or "msc_context='block_output'" in str(error.value)


@pytest.mark.parametrize(
    ("earlier", "named", "instead"),
    [
        # what the absent context made meaningless
        (dict(msc_context_attention=False, msc_fusion="add"), "`msc_fusion='add'`", "msc_context='none'"),
        (dict(msc_context_attention=False, msc_context_cell="ffn"), "`msc_context_cell='ffn'`", "msc_context='none'"),
        (dict(msc_context_attention=False, msc_share_gru=False), "`msc_share_gru=False`", "msc_context='none'"),
        (
            dict(msc_context_attention=False, msc_decoder_context=False),
            "`msc_decoder_context=False`",
            "msc_context='none'",
        ),
        (
            dict(msc_context_attention=False, msc_contextual_collaboration=False),
            "`msc_contextual_collaboration=False`",
            "msc_context='none'",
        ),
        # what the absent cell made meaningless
        (
            dict(msc_contextual_collaboration=False, msc_context_cell="ffn"),
            "`msc_context_cell='ffn'`",
            "msc_context='block_output'",
        ),
        (
            dict(msc_contextual_collaboration=False, msc_share_gru=False),
            "`msc_share_gru=False`",
            "msc_context='block_output'",
        ),
    ],
)
def test_each_kind_of_refused_combination_names_the_old_keys_and_what_to_set(earlier, named, instead):
    with pytest.raises(ValueError) as error:
        MscConfig(**MSC, **earlier)
    message = str(error.value)
    assert named in message and instead in message
    assert "`msc_context_attention=False`" in message or "`msc_contextual_collaboration=False`" in message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("msc_context_attention", "yes"),
        ("msc_contextual_collaboration", 1),
        ("msc_context_cell", "lstm"),
        ("msc_share_gru", None),
        ("msc_decoder_context", "false"),
    ],
)
def test_a_bad_value_of_an_old_key_raises_naming_it(key, value):
    with pytest.raises(ValueError, match=f"`{key}` must be .*got {value!r}"):
        MscConfig(**MSC, **{key: value})


@pytest.mark.parametrize(
    ("key", "value", "now"),
    [
        ("msc_context_attention", False, "msc_context='none'"),
        ("msc_contextual_collaboration", False, "msc_context='block_output'"),
        ("msc_context_cell", "ffn", "msc_context='ffn'"),
        ("msc_share_gru", False, "msc_context='gru_per_block'"),
        ("msc_decoder_context", False, "msc_context_sides='encoder'"),
    ],
)
def test_an_old_key_away_from_its_default_without_msc_raises_naming_it(key, value, now):
    with pytest.raises(ValueError, match=f"`{key}={value!r}` only applies to MSC: set `msc_block_layers`") as error:
        DeepNMTConfig(**{key: value})
    assert now in str(error.value)


def test_old_keys_at_their_defaults_without_msc_map_to_the_defaults_silently(caplog):
    defaults = dict(zip(EARLIER_KEYS, (True, True, "gru", True, True)))
    with caplog.at_level("WARNING"):
        config = DeepNMTConfig(**defaults)
    assert caplog.text == ""
    assert config.to_dict() == DeepNMTConfig().to_dict()


@pytest.mark.parametrize(
    ("earlier", "new"),
    [
        (dict(msc_share_gru=False), dict(msc_context="ffn")),
        (dict(msc_context_cell="ffn", msc_share_gru=False), dict(msc_context="ffn")),
        (dict(msc_context_attention=False), dict(msc_context="block_output")),
        (dict(msc_contextual_collaboration=False), dict(msc_context="none")),
        (dict(msc_decoder_context=True), dict(msc_context_sides="encoder")),
    ],
)
def test_old_and_new_keys_that_disagree_raise_naming_both(earlier, new):
    with pytest.raises(ValueError, match="disagrees") as error:
        MscConfig(**MSC, **earlier, **new)
    message = str(error.value)
    assert all(f"`{key}={value!r}`" in message for key, value in {**earlier, **new}.items())


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        # agreeing
        (dict(msc_share_gru=False, msc_context="gru_per_block"), ("gru_per_block", "encoder_and_decoder")),
        (dict(msc_decoder_context=False, msc_context_sides="encoder"), ("gru", "encoder")),
        # each new field about what the old keys do not say
        (dict(msc_decoder_context=False, msc_context="ffn"), ("ffn", "encoder")),
        (dict(msc_context_cell="ffn", msc_context_sides="encoder"), ("ffn", "encoder")),
        # a new field at its default is taken as not given: the old keys decide
        (
            dict(msc_context_cell="ffn", msc_share_gru=False, msc_context="gru"),
            ("ffn_per_block", "encoder_and_decoder"),
        ),
        (dict(msc_decoder_context=False, msc_context_sides="encoder_and_decoder"), ("gru", "encoder")),
    ],
)
def test_old_and_new_keys_that_do_not_disagree_are_accepted(given, expected):
    config = MscConfig(**MSC, **given)
    assert (config.msc_context, config.msc_context_sides) == expected


@pytest.mark.parametrize(
    "fields",
    [
        dict(msc_context="ffn_per_block", msc_fusion="add"),
        dict(msc_context="block_output", msc_context_sides="encoder"),
        dict(msc_context="none"),
        dict(msc_context="gru_per_block"),
    ],
)
def test_a_config_saved_with_the_new_keys_reloads_equal(fields, tmp_path, caplog):
    config = MscConfig(**MSC, **fields)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert not set(EARLIER_KEYS) & set(written)
    assert {key: written[key] for key in fields} == fields
    with caplog.at_level("WARNING"):
        again = AutoConfig.from_pretrained(tmp_path)
    assert caplog.text == ""
    assert type(again) is MscConfig
    assert {k: v for k, v in again.to_dict().items() if k != "_name_or_path"} == {
        k: v for k, v in config.to_dict().items() if k != "_name_or_path"
    }


@pytest.mark.parametrize(
    ("name", "context", "sides", "fusion"),
    [
        ("msc-ablations", "ffn_per_block", "encoder_and_decoder", "add"),
        ("msc-encoder-context-aan", "gru", "encoder", "gate"),
        ("msc-no-collaboration", "block_output", "encoder_and_decoder", "gate"),
        ("msc-no-context", "none", "encoder_and_decoder", "gate"),
    ],
)
def test_a_0_1_0_msc_ablation_config_loads_to_the_new_keys_without_a_warning(
    name, context, sides, fusion, tmp_path, caplog
):
    saved = json.loads((FIXTURES / "configs" / f"{name}.json").read_text())
    assert set(EARLIER_KEYS) <= set(saved)  # written by 0.1.0: the old keys, not the new ones
    assert not {"msc_context", "msc_context_sides"} & set(saved)
    shutil.copy(FIXTURES / "configs" / f"{name}.json", tmp_path / "config.json")
    with caplog.at_level("WARNING"):
        config = AutoConfig.from_pretrained(tmp_path)
    assert caplog.text == ""
    assert (config.msc_context, config.msc_context_sides, config.msc_fusion) == (context, sides, fusion)
    assert not set(EARLIER_KEYS) & set(config.to_dict())


def test_a_recipe_may_still_override_the_old_keys():
    # a recipe's `model_overrides` only refuses keys that the config would ignore; the old keys are read
    from hf_deep_nmt.training.arguments import check_config_overrides

    check_config_overrides(MscConfig, {"msc_share_gru": False, "msc_decoder_context": False})
    with pytest.raises(ValueError, match="not MscConfig fields: 'msc_share_gr'") as error:
        check_config_overrides(MscConfig, {"msc_share_gr": False})
    assert "msc_share_gru" not in str(error.value)  # a misspelling is pointed to a field, never to an old key
