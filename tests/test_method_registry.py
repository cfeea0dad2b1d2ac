"""Each method is named once (`METHODS` in the model code) and everything else derives from it. A throw-away method
added in this process must reach the package's class maps and auto classes, `doctor`'s families, the model card;
the exporters and growing, which use allow-lists of the settings they can express, must refuse its new setting by
name rather than carry it along unread."""

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

import hf_deep_nmt
from hf_deep_nmt import (
    BASE_MODEL_CLASSES,
    METHODS,
    MODEL_CLASSES,
    DeepNMTConfig,
    DeepNMTForConditionalGeneration,
    DeepNMTMethod,
    DeepNMTModel,
    register_method,
)
from hf_deep_nmt.hub import architecture_of, method_card, render_model_card
from hf_deep_nmt.serving.ctranslate2 import ctranslate2_blockers
from hf_deep_nmt.tools import doctor
from hf_deep_nmt.training.growing import grow_encoder


class ThrowawayConfig(DeepNMTConfig):
    model_type = "deep_nmt_throwaway"

    throwaway_gain: float = 1.0


class ThrowawayForConditionalGeneration(DeepNMTForConditionalGeneration):
    config_class = ThrowawayConfig


class ThrowawayModel(DeepNMTModel):
    config_class = ThrowawayConfig


@pytest.fixture
def throwaway():
    method = DeepNMTMethod(
        ThrowawayConfig,
        ThrowawayForConditionalGeneration,
        ThrowawayModel,
        card="deep_nmt",
        checks={"throwaway": dict(throwaway_gain=2.0)},
    )
    register_method(method)
    yield method
    METHODS.pop(method.model_type)
    MODEL_CLASSES.pop(ThrowawayConfig)
    BASE_MODEL_CLASSES.pop(ThrowawayConfig)


def test_the_built_in_methods_fill_every_derived_table():
    assert len(METHODS) >= 6 and "deep_nmt" in METHODS
    assert MODEL_CLASSES == {method.config_class: method.model_class for method in METHODS.values()}
    assert BASE_MODEL_CLASSES == {method.config_class: method.base_model_class for method in METHODS.values()}
    assert set(doctor.FAMILIES) == {name for method in METHODS.values() for name in method.checks}
    for method in METHODS.values():  # the naming the config's `auto_map` relies on for `AutoModel`
        assert method.base_model_class.__name__ == method.model_class.__name__.replace(
            "ForConditionalGeneration", "Model"
        )


def test_a_method_registered_later_reaches_the_auto_classes_doctor_and_the_card(throwaway, tmp_path):
    assert MODEL_CLASSES[ThrowawayConfig] is ThrowawayForConditionalGeneration
    config = doctor.family_config("throwaway")
    assert type(config) is ThrowawayConfig and config.throwaway_gain == 2.0
    assert type(AutoModelForSeq2SeqLM.from_config(config)) is ThrowawayForConditionalGeneration
    assert type(AutoModel.from_config(config)) is ThrowawayModel
    assert AutoConfig.for_model("deep_nmt_throwaway").throwaway_gain == 1.0

    assert "throwaway" in doctor.families()
    doctor.check_cached_equals_uncached("throwaway", "cpu")  # raises with the numbers when it fails

    model = ThrowawayForConditionalGeneration(config)
    assert architecture_of(config)["throwaway_gain"] == 2.0  # a new setting, not in any list of the card's
    assert method_card("deep_nmt_throwaway") == "deep_nmt"
    card = render_model_card(model, "org/throwaway-tiny")
    assert "| `throwaway_gain` | 2.0 |" in card.text and "deep_nmt_throwaway" in card.data.tags

    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "saved")
    assert type(reloaded) is ThrowawayForConditionalGeneration and reloaded.config.throwaway_gain == 2.0
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_the_exporters_and_growing_refuse_a_setting_they_do_not_know(throwaway):
    config = doctor.family_config("throwaway")
    assert ctranslate2_blockers(config) == [
        "`throwaway_gain=2.0` (a setting the CTranslate2 exporter does not know; it handles the settings it lists)"
    ]
    assert ctranslate2_blockers(doctor.family_config("prenorm")) == []  # the same model without it exports
    with pytest.raises(
        ValueError,
        match=r"grow_encoder does not apply to this deep_nmt_throwaway model: "
        r"`throwaway_gain=2.0` \(a setting grow_encoder does not know",
    ):
        grow_encoder(ThrowawayForConditionalGeneration(config), 1)


def test_a_model_type_or_check_name_cannot_be_taken_twice(throwaway):
    class Other(ThrowawayConfig):
        pass

    with pytest.raises(ValueError, match="'deep_nmt_throwaway' is already the method of ThrowawayConfig"):
        register_method(DeepNMTMethod(Other, ThrowawayForConditionalGeneration, ThrowawayModel, "deep_nmt", {}))
    Other.model_type = "deep_nmt_other"
    with pytest.raises(ValueError, match="check name 'prenorm' is already taken by DeepNMTConfig"):
        register_method(
            DeepNMTMethod(Other, ThrowawayForConditionalGeneration, ThrowawayModel, "deep_nmt", {"prenorm": {}})
        )
    assert "deep_nmt_other" not in METHODS
    assert hf_deep_nmt.METHODS is METHODS


def test_every_method_runs_through_the_architecture_tests():
    from conftest import ARCHITECTURES

    covered = {param.values[0][0] for param in ARCHITECTURES}
    assert {method.config_class for method in METHODS.values()} <= covered


def test_adding_a_method_in_the_docs_names_every_table_a_method_touches():
    """docs/methods.md's "Adding a method" names every table a new method may have to join: the config module's
    tables of fields by name (found here, not listed: `LATER_SETTINGS` was once missed), its rules, the model's
    tables of classes, `METHODS`, the exporters' and growing's allow-lists and the test matrix. Tables of one method's
    own switches (`MSC_...`) are that method's business."""
    from hf_deep_nmt.modeling import configuration_deep_nmt, modeling_deep_nmt

    text = (Path(__file__).resolve().parent.parent / "docs" / "methods.md").read_text()
    section = text[text.index("## Adding a method") :]
    section = section[: section.find("\n## ", 1) if "\n## " in section[1:] else None]
    fields = set(DeepNMTConfig.__annotations__)
    field_tables = [
        name
        for name, value in vars(configuration_deep_nmt).items()
        if name.isupper()
        and not name.startswith(("_", "MSC_"))
        and isinstance(value, (dict, tuple, list, frozenset))
        and any(isinstance(key, str) and key in fields for key in value)
    ]
    assert {"FIELD_KINDS", "LATER_SETTINGS"} <= set(field_tables)
    class_tables = [name for name in vars(modeling_deep_nmt) if name.isupper() and name.endswith("_CLASSES")]
    assert class_tables
    expected = [*field_tables, "DEPENDS_ON", "STRUCTURAL_RULES", *class_tables, "METHODS", "SETTINGS", "GROWABLE"]
    expected += ["ARCHITECTURES", "valid_configs"]
    assert [name for name in expected if f"`{name}`" not in section] == []
