"""The sample recipe end to end, shrunk to a few steps: it trains with token-budget batches, evaluates during and after
training, averages its last checkpoints, plots its curves and exports a folder that loads by repo id from an offline
Hub cache in a process without hf_deep_nmt, with a model card whose metadata parses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import package_free_environment
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from hf_deep_nmt.serving.translate import translate
from hf_deep_nmt.training import pipeline as training

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "sample.json"

# The recipe's own keys; only sizes and lengths shrink, so that CI runs it in seconds.
TINY = {
    "model_overrides": {
        "d_model": 32,
        "encoder_layers": 3,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "dropout": 0.1,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
    },
    "tokenizer_vocab_size": 500,
    "max_source_length": 32,
    "max_target_length": 32,
    "max_eval_samples": 6,
    "translate_examples": 2,
    "num_train_epochs": 1,
    "max_steps": 6,
    "save_steps": 2,
    "eval_steps": 3,
    "logging_steps": 1,
    "max_tokens": 400,
    "warmup_steps": 2,
    "per_device_eval_batch_size": 4,
    "use_cpu": True,
    "disable_tqdm": True,
}

LOAD_SCRIPT = """
import json
import sys

sys.modules["hf_deep_nmt"] = None  # only what the repository ships may be used

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

repo, text = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
model = AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True).eval()
output = model.generate(**tokenizer([text], return_tensors="pt"), max_new_tokens=12, num_beams=1)
beams = model.generation_config.num_beams
print(json.dumps({"class": type(model).__module__, "ids": output[0].tolist(), "beams": beams}))
"""


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample-recipe")
    config = {**json.loads(RECIPE.read_text()), **TINY}
    config.update(output_dir=str(root / "run"), export_dir=str(root / "export"))
    unknown = set(TINY) - set(json.loads(RECIPE.read_text())) - {"max_eval_samples", "max_steps", "use_cpu"}
    assert unknown <= {"disable_tqdm"}, unknown  # the shrunk run uses the recipe's own settings
    path = root / "sample-tiny.json"
    path.write_text(json.dumps(config))
    summary = training.run([str(path)])
    return root, config, summary


def test_sample_recipe_trains_evaluates_averages_and_exports(sample_run):
    root, config, summary = sample_run
    run = root / "run"
    results = json.loads((run / "results.json").read_text())
    assert results["train_steps"] == 6 and results["eval_pairs"] == 6
    assert {"bleu", "chrf", "tok_bleu", "bleu_signature"} <= set(results)
    assert results["averaged_checkpoints"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    # the validation BLEU logged during training (steps 3 and 6) is what the curves plot
    logged = json.loads((run / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
    assert [record["step"] for record in logged if "eval_bleu" in record] == [3, 6]
    assert (run / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exported_weights_are_the_mean_of_the_last_checkpoints(sample_run):
    root, _, _ = sample_run
    exported = load_file(root / "export" / "model.safetensors")
    inputs = [load_file(root / "run" / f"checkpoint-{step}" / "model.safetensors") for step in (2, 4, 6)]
    assert set(exported) == set(inputs[0])
    for name, tensor in exported.items():
        expected = torch.stack([state[name] for state in inputs]).double().mean(dim=0).to(tensor.dtype)
        torch.testing.assert_close(tensor, expected, rtol=0, atol=1e-7, msg=name)
    assert not all(torch.equal(inputs[0][name], inputs[2][name]) for name in exported)  # training changed them


def test_export_carries_the_recipe_decoding_and_a_parsable_card(sample_run):
    root, config, summary = sample_run
    folder = root / "export"
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["num_beams"] == config["num_beams"] and generation["length_penalty"] == config["length_penalty"]
    card = ModelCard.load(folder / "README.md")
    assert card.data.language == ["es", "en"] and card.data.license == "apache-2.0"
    assert card.data.datasets == ["bible-es-en-sample"] and card.data.metrics == ["sacrebleu", "chrf", "bleu"]
    assert {"translation", "hf-deep-nmt", "deep_nmt_dlcl"} <= set(card.data.tags)
    values = {result.metric_type: result.metric_value for result in card.data.eval_results}
    assert values == {"bleu": summary["bleu"], "chrf": summary["chrf"], "tok_bleu": summary["tok_bleu"]}
    assert card.data.to_dict()["model-index"][0]["results"][0]["task"]["type"] == "translation"
    assert "trust_remote_code=True" in card.text


def test_export_loads_by_repo_id_offline_without_the_package(sample_run, tmp_path, hub_cache, clean_python):
    """Loaded in a process without the package, forked from the session's clean server (torch and transformers
    imported once, never this package): the repository is laid out in the session's Hub cache, where the server's
    huggingface_hub looks, under a name of this test's own."""
    from huggingface_hub import constants

    root, config, summary = sample_run
    folder = root / "export"
    hub_cache(folder, constants.HF_HUB_CACHE, "org/sample-recipe-dlcl")
    env = package_free_environment(os.environ["HF_HOME"], str(tmp_path / "modules"))
    text = summary["examples"][0]["source"]
    completed = clean_python.run(
        [sys.executable, "-c", LOAD_SCRIPT, "org/sample-recipe-dlcl", text],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    assert result["class"].startswith("transformers_modules.") and result["beams"] == config["num_beams"]
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        expected = model.generate(**tokenizer([text], return_tensors="pt"), max_new_tokens=12, num_beams=1)
    assert result["ids"] == expected[0].tolist()
    # the exported model is the one that was scored: its translations reproduce the reported examples
    again = translate(model, tokenizer, [text], num_beams=config["num_beams"], length_penalty=config["length_penalty"])
    assert again == [summary["examples"][0]["translation"]]
