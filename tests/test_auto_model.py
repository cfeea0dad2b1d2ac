"""`AutoModel` loads the encoder-decoder without the output layer, with the package installed and as remote code."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import method_families, package_free_environment
from transformers import AutoModel

from hf_deep_nmt import BASE_MODEL_CLASSES

FAMILIES = method_families()  # one per registered method
INPUTS = dict(
    input_ids=torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]]),
    attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    decoder_input_ids=torch.tensor([[0, 6, 8, 12], [0, 13, 4, 4]]),
)

LOAD_SCRIPT = """
import json
import sys

sys.modules["hf_deep_nmt"] = None  # the repository's own code, not the package's

import torch
from transformers import AutoModel

inputs = torch.load("inputs.pt", weights_only=True)
results = {}
for folder in sys.argv[1:]:
    model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        torch.save(model(**inputs).last_hidden_state, f"{len(results)}.pt")
    results[folder] = {"class": type(model).__name__, "module": type(model).__module__, "file": f"{len(results)}.pt"}
with open("results.json", "w") as handle:
    json.dump(results, handle)
"""


@pytest.fixture(params=FAMILIES, scope="module")
def saved(request, tmp_path_factory, tiny_config, random_model):
    """A perturbed tiny translation model saved with save_pretrained, and the decoder states of its encoder-decoder."""
    config_class, overrides = FAMILIES[request.param]
    model = random_model(tiny_config(config_class, **overrides))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    with torch.no_grad():
        states = model.model(**INPUTS).last_hidden_state
    return folder, config_class, states


def test_auto_model_loads_the_encoder_decoder_of_a_saved_translation_model(saved):
    folder, config_class, states = saved
    model = AutoModel.from_pretrained(folder).eval()
    assert type(model) is BASE_MODEL_CLASSES[config_class]
    assert not hasattr(model, "lm_head")
    with torch.no_grad():
        assert torch.equal(model(**INPUTS).last_hidden_state, states)
    assert type(AutoModel.from_config(model.config)) is BASE_MODEL_CLASSES[config_class]


def test_saved_auto_map_names_the_encoder_decoder(saved):
    folder, config_class, _ = saved
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == f"modeling_deep_nmt.{BASE_MODEL_CLASSES[config_class].__name__}"
    assert auto_map["AutoModelForSeq2SeqLM"].startswith("modeling_deep_nmt.")


def test_auto_model_loads_saved_folders_as_remote_code_without_the_package(
    tiny_config, random_model, tmp_path, clean_python
):
    folders, expected = [], {}
    for family in ("dlcl-prenorm", "msc"):
        config_class, overrides = FAMILIES[family]
        model = random_model(tiny_config(config_class, **overrides))
        folder = tmp_path / family
        model.save_pretrained(folder)
        with torch.no_grad():
            states = model.model(**INPUTS).last_hidden_state
        expected[str(folder)] = (BASE_MODEL_CLASSES[config_class].__name__, states)
        folders.append(str(folder))
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    torch.save(INPUTS, workdir / "inputs.pt")
    env = package_free_environment(str(tmp_path / "hf_home"), str(tmp_path / "modules"))
    # forked from the session's clean server (torch and transformers imported, never this package): its own
    # working folder, environment and remote-code modules cache, as a fresh interpreter without the package
    completed = clean_python.run(
        [sys.executable, "-c", LOAD_SCRIPT, *folders],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((workdir / "results.json").read_text())
    for folder, (class_name, states) in expected.items():
        result = results[folder]
        assert result["class"] == class_name
        assert result["module"].startswith("transformers_modules.") and "hf_deep_nmt" not in result["module"]
        assert torch.equal(torch.load(workdir / result["file"], weights_only=True), states)
