"""The Hub-ready folder: its files, the rendered model card, refusal to overwrite, and loading it back."""

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.hub import export_hub_folder, files_not_written_by_us
from hf_deep_nmt.model_folders import CODE_FILES

MODELING_DIR = Path(__file__).resolve().parents[1] / "modeling"
PAIRS = [
    ("el sol sale", "the sun rises"),
    ("la mar no se llena", "the sea is not full"),
    ("hola mundo", "hello world"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_joint_tokenizer(PAIRS * 20, vocab_size=120, min_frequency=1)


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    config = DlclConfig(
        vocab_size=len(tokenizer),
        d_model=16,
        encoder_layers=3,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=20,
    )
    model = DlclForConditionalGeneration(config)
    model.generation_config.num_beams = 3
    model.config.use_cache = False  # what the Trainer leaves behind; the export must turn it back on
    return model


METRICS = {"bleu": 12.34, "chrf": 40.5, "bleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:x"}


def test_export_writes_every_file_a_hub_repo_needs(model, tokenizer, tmp_path):
    folder = export_hub_folder(model, tokenizer, tmp_path / "repo", metrics=METRICS, repo_id="org/dlcl-tiny")
    names = {path.name for path in folder.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "configuration_deep_nmt.py",
        "modeling_deep_nmt.py",
        "kernels_deep_nmt.py",
        "contract_deep_nmt.py",
        "sizes_deep_nmt.py",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= names
    assert not any(name.endswith((".bin", ".pt", ".pth")) for name in names)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_deep_nmt.DlclConfig",
        "AutoModel": "modeling_deep_nmt.DlclModel",
        "AutoModelForSeq2SeqLM": "modeling_deep_nmt.DlclForConditionalGeneration",
    }
    assert config["use_cache"] is True
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["num_beams"] == 3 and generation["decoder_start_token_id"] == 0
    for name in CODE_FILES:
        assert (folder / name).read_bytes() == (MODELING_DIR / name).read_bytes()
    assert files_not_written_by_us(folder) == []  # the marker lists every code file, the sibling included
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no staging folder left behind


def test_model_card_carries_metadata_and_results(model, tokenizer, tmp_path):
    folder = export_hub_folder(
        model, tokenizer, tmp_path / "repo", metrics=METRICS, repo_id="org/dlcl-tiny", languages=("es", "en")
    )
    card = ModelCard.load(folder / "README.md")
    assert card.data.language == ["es", "en"]
    assert card.data.pipeline_tag == "translation"
    assert "deep_nmt_dlcl" in card.data.tags
    results = {result.metric_type: result.metric_value for result in card.data.eval_results}
    assert results == {"bleu": 12.34, "chrf": 40.5}
    assert "AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True)" in card.text
    assert 'repo = "org/dlcl-tiny"' in card.text
    assert "Learning Deep Transformer Models for Machine Translation" in card.text  # the DLCL method section
    assert METRICS["bleu_signature"] in card.text


def test_export_refuses_a_non_empty_folder_and_leaves_it_untouched(model, tokenizer, tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes")
    with pytest.raises(FileExistsError, match=r"repo' exists and is not empty.*overwrite"):
        export_hub_folder(model, tokenizer, folder)
    assert [path.name for path in folder.iterdir()] == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "my notes"


def test_export_into_an_empty_folder_and_overwrite_on_request(model, tokenizer, tmp_path):
    folder = tmp_path / "repo"
    folder.mkdir()
    export_hub_folder(model, tokenizer, folder)  # an existing empty folder is fine
    export_hub_folder(model, tokenizer, folder, overwrite=True)  # every file in it is as the export wrote it
    assert (folder / "model.safetensors").is_file()
    (folder / "README.md").write_text("a card edited by hand")  # listed by the marker, but no longer what it wrote
    with pytest.raises(FileExistsError, match=r"\['README\.md'\] is listed by .* but changed since the export"):
        export_hub_folder(model, tokenizer, folder, overwrite=True)
    assert (folder / "README.md").read_text() == "a card edited by hand"
    (folder / "README.md").unlink()
    (folder / "stale.txt").write_text("a file of the user's")
    with pytest.raises(FileExistsError, match=r"holds files that no export or average of hf-deep-nmt wrote"):
        export_hub_folder(model, tokenizer, folder, overwrite=True)
    assert (folder / "stale.txt").read_text() == "a file of the user's"


def test_exported_folder_loads_and_translates_identically(model, tokenizer, tmp_path):
    folder = export_hub_folder(model, tokenizer, tmp_path / "repo")
    loaded = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    batch = tokenizer(["el sol sale", "hola mundo"], return_tensors="pt", padding=True)
    assert loaded_tokenizer(["el sol sale"])["input_ids"] == tokenizer(["el sol sale"])["input_ids"]
    with torch.no_grad():
        expected = model.generate(**batch, max_new_tokens=6)
        actual = loaded.generate(**batch, max_new_tokens=6)
    assert torch.equal(expected, actual)
    assert loaded.generation_config.num_beams == 3


def test_each_preset_gets_its_own_method_section_in_the_card(tokenizer):
    from hf_deep_nmt import DsInitConfig, DsInitForConditionalGeneration
    from hf_deep_nmt.hub import render_model_card

    config = DsInitConfig(
        vocab_size=len(tokenizer),
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=20,
    )
    card = render_model_card(DsInitForConditionalGeneration(config), "org/dsinit-tiny")
    assert "Depth-Scaled Initialization and Merged Attention" in card.text
    assert "| `decoder_self_attention` | merged_average |" in card.text and "| `init_scheme` | ds_init |" in card.text
    assert "deep_nmt_dsinit" in card.data.tags


def test_every_registered_method_has_a_method_card():
    from hf_deep_nmt import METHODS, MODEL_CLASSES

    assert {method.config_class for method in METHODS.values()} == set(MODEL_CLASSES)
    for method in METHODS.values():
        card = MODELING_DIR.parent / "model_cards" / "methods" / f"{method.card}.md"
        assert "<!-- citation -->" in card.read_text(encoding="utf-8")


def test_the_card_shows_every_setting_that_differs_from_the_base_architecture():
    from hf_deep_nmt import MscConfig, SdtConfig
    from hf_deep_nmt.hub import architecture_of

    shown = architecture_of(SdtConfig(encoder_layers=12, growth=[{"from_layers": 6}], dropout=0.3))
    assert shown["encoder_layers"] == 12 and shown["d_model"] == 512  # sizes always
    assert shown["encoder_layer_aggregation"] == "sparse" and shown["relative_position_window"] == 8
    assert "pre_norm" not in shown  # the base default
    assert not {"growth", "dropout", "pad_token_id", "transformers_version"} & set(shown)  # not architecture
    assert architecture_of(MscConfig())["msc_block_layers"] == 6  # as the config holds it (6 blocks of 6)
