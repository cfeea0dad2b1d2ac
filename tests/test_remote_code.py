"""The modeling files are self-contained Hub remote code: they load, with the package unimportable, from a saved folder
and from a Hub cache by repo id, and give the same logits as the package."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import method_families, package_free_environment

import hf_deep_nmt.modeling.configuration_deep_nmt
import hf_deep_nmt.modeling.contract_deep_nmt
import hf_deep_nmt.modeling.kernels_deep_nmt
import hf_deep_nmt.modeling.modeling_deep_nmt
import hf_deep_nmt.modeling.sizes_deep_nmt

MODELING_DIR = Path(__file__).resolve().parents[1] / "modeling"
CODE_FILES = (
    "configuration_deep_nmt.py",
    "modeling_deep_nmt.py",
    "kernels_deep_nmt.py",
    "contract_deep_nmt.py",
    "sizes_deep_nmt.py",
)
ALLOWED_PACKAGES = {"torch", "transformers", "__future__"}

LOAD_SCRIPT = """
import json
import sys

sys.modules["hf_deep_nmt"] = None  # an installed, registered package would win over the repository's code

import torch
from transformers import AutoModelForSeq2SeqLM

inputs = torch.load("inputs.pt", weights_only=True)
results = {}
for key, source, modes in json.load(open("jobs.json")):
    for mode in modes:
        kwargs = {} if mode == "default" else {"trust_remote_code": mode == "true"}
        try:
            model = AutoModelForSeq2SeqLM.from_pretrained(source, **kwargs)
        except ValueError as error:
            results.setdefault(key, {})[mode] = {"error": str(error)}
            continue
        with torch.no_grad():
            torch.save(model.eval()(**inputs).logits, f"logits-{key}-{mode}.pt")
            encoded = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
            beams = model.generate(**encoded, num_beams=4, num_return_sequences=2, max_new_tokens=6)
            torch.save(beams, f"beams-{key}-{mode}.pt")
        results.setdefault(key, {})[mode] = {"class": type(model).__name__, "module": type(model).__module__}
with open("results.json", "w") as handle:
    json.dump(results, handle)
"""

FAMILIES = method_families()  # one per registered method
SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
INPUTS = dict(
    input_ids=SOURCE,
    attention_mask=SOURCE.ne(1).long(),
    decoder_input_ids=torch.tensor([[0, 6, 8, 12], [0, 13, 4, 4]]),
)


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, tiny_config, random_model):
    """By family: a perturbed tiny model of each registered method (DS-Init with MAtt, MSC with its context cache
    layer, ...) saved with save_pretrained, the inputs used, its logits and its beam-search output."""
    saved = {}
    for family, (config_class, overrides) in FAMILIES.items():
        model = random_model(tiny_config(config_class, **overrides))
        with torch.no_grad():
            logits = model(**INPUTS).logits
            beams = model.generate(
                input_ids=SOURCE,
                attention_mask=INPUTS["attention_mask"],
                num_beams=4,
                num_return_sequences=2,
                max_new_tokens=6,
            )
        folder = tmp_path_factory.mktemp(f"saved-{family}")
        model.save_pretrained(folder)
        saved[family] = folder, INPUTS, logits, beams, type(model).__name__
    return saved


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture
def saved_model(saved_models, family):
    return saved_models[family]


def load_in_clean_process(tmp_path: Path, jobs: list[tuple[str, str, list[str]]], clean_python, inputs: dict) -> dict:
    """Run `jobs` (key, folder or repo id, load modes) in ONE process that cannot import hf_deep_nmt (cwd: an empty
    folder, Hub offline), the way a user's process loads several models: forked from the session's clean server
    (torch and transformers imported once, never this package), whose Hub cache is the session's."""
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    torch.save(inputs, workdir / "inputs.pt")
    env = package_free_environment(os.environ["HF_HOME"], str(tmp_path / "modules"))
    completed = clean_python.run(
        [sys.executable, "-c", LOAD_SCRIPT],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads((workdir / "results.json").read_text())
    for key, modes in results.items():
        for mode, result in modes.items():
            if "error" not in result:
                result["logits"] = torch.load(workdir / f"logits-{key}-{mode}.pt", weights_only=True)
                result["beams"] = torch.load(workdir / f"beams-{key}-{mode}.pt", weights_only=True)
    return results


def assert_remote_class_with_identical_outputs(result: dict, saved_model) -> None:
    _, _, logits, beams, class_name = saved_model
    assert "error" not in result, result.get("error")
    assert result["class"] == class_name
    assert result["module"].startswith("transformers_modules.") and "hf_deep_nmt" not in result["module"]
    assert torch.equal(result["logits"], logits)
    # beam search runs on the remote code's own cache classes (MAtt: its running-sum cache layer; MSC: context keys)
    assert torch.equal(result["beams"], beams)


@pytest.fixture(scope="module")
def clean_process_results(saved_models, tmp_path_factory, hub_cache, clean_python):
    """Every family loaded in a process without the package: from its saved folder (no flag, `trust_remote_code=False`
    and `True`) and by repo id from a Hub cache laid out on disk (the session's, under names of this module's own; no
    flag and `True`)."""
    from huggingface_hub import constants

    tmp_path = tmp_path_factory.mktemp("clean-process")
    jobs = []
    for family, (folder, *_) in saved_models.items():
        jobs.append((f"folder-{family}", str(folder), ["default", "false", "true"]))
        hub_cache(folder, constants.HF_HUB_CACHE, f"org/remote-code-{family}")
        jobs.append((f"hub-{family}", f"org/remote-code-{family}", ["default", "true"]))
    return load_in_clean_process(tmp_path, jobs, clean_python, INPUTS)


def test_saved_folder_loads_as_remote_code_with_identical_logits(saved_model, family, clean_process_results):
    assert_remote_class_with_identical_outputs(clean_process_results[f"folder-{family}"]["true"], saved_model)


@pytest.mark.parametrize("mode", ["default", "false"])
def test_saved_folder_needs_trust_remote_code_without_the_package(family, clean_process_results, mode):
    result = clean_process_results[f"folder-{family}"][mode]
    assert "error" in result
    assert "trust_remote_code=True" in result["error"]


def test_hub_cache_loads_by_repo_id_offline_with_identical_logits(saved_model, family, clean_process_results):
    results = clean_process_results[f"hub-{family}"]
    assert "trust_remote_code=True" in results["default"]["error"]
    assert_remote_class_with_identical_outputs(results["true"], saved_model)


def test_saved_code_files_are_byte_identical_to_modeling(saved_model):
    folder = saved_model[0]
    for name in CODE_FILES:
        assert (folder / name).read_bytes() == (MODELING_DIR / name).read_bytes(), name
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    model_class = saved_model[4]
    assert auto_map == {
        "AutoConfig": f"configuration_deep_nmt.{model_class.replace('ForConditionalGeneration', 'Config')}",
        "AutoModel": f"modeling_deep_nmt.{model_class.replace('ForConditionalGeneration', 'Model')}",
        "AutoModelForSeq2SeqLM": f"modeling_deep_nmt.{model_class}",
    }


def test_package_modeling_is_the_repository_modeling_folder():
    for module in (
        hf_deep_nmt.modeling.configuration_deep_nmt,
        hf_deep_nmt.modeling.modeling_deep_nmt,
        hf_deep_nmt.modeling.kernels_deep_nmt,
        hf_deep_nmt.modeling.contract_deep_nmt,
        hf_deep_nmt.modeling.sizes_deep_nmt,
    ):
        assert Path(module.__file__).resolve().parent == MODELING_DIR


@pytest.mark.parametrize("name", CODE_FILES)
def test_modeling_files_import_only_stdlib_torch_and_transformers(name):
    tree = ast.parse((MODELING_DIR / name).read_text())
    relative = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots = [node.module.split(".")[0]]
        elif isinstance(node, ast.ImportFrom):
            relative.append((node.level, node.module))
            continue
        else:
            continue
        for root in roots:
            assert root in ALLOWED_PACKAGES or root in sys.stdlib_module_names, f"{name} imports {root}"
    # the model file imports its four siblings, the contract the kernels' `is_tracing`, the size arithmetic the config
    # and the contract; nothing else is imported
    expected_relative = {
        "modeling_deep_nmt.py": [
            (1, "configuration_deep_nmt"),
            (1, "contract_deep_nmt"),
            (1, "kernels_deep_nmt"),
            (1, "sizes_deep_nmt"),
        ],
        "contract_deep_nmt.py": [(1, "kernels_deep_nmt")],
        "sizes_deep_nmt.py": [(1, "configuration_deep_nmt"), (1, "contract_deep_nmt")],
    }
    assert relative == expected_relative.get(name, [])


def test_modeling_package_marker_is_empty():
    assert (MODELING_DIR / "__init__.py").read_text().strip() == ""
