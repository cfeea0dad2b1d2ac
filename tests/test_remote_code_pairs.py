"""Two or more remote-code models in one process (issue 19).

transformers keeps one registry of cache-layer types per process, filled when a modeling file defines its cache-layer
classes: the file imported last wins. Every copy of our modeling file (one per saved folder or Hub repository loaded
with `trust_remote_code`) registers the same type, so a model imported earlier decodes with the cache layers of
another module. These tests load every family from its own folder, in both orders, and check that each model's greedy,
beam-search and static-cache outputs (tokens and scores) stay those the installed package gives; also through
`Seq2SeqTrainer.predict`, and with the installed package and remote code in one process.
"""

import json
import shutil
import subprocess
import sys
from itertools import permutations
from pathlib import Path

import pytest
import torch
from conftest import package_free_environment
from datasets import Dataset
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, cache_utils
from transformers.dynamic_module_utils import get_class_from_dynamic_module

from hf_deep_nmt.modeling.configuration_deep_nmt import CACHE_LAYER_TYPE
from hf_deep_nmt.tools.doctor import FAMILIES, family_model, padded_batch

# One family per layout of the decoding state (keys and values; MAtt's running sums; the AAN's average with its FFN;
# relative keys; MSC's context states; Hyper-Connections' own module code), not every registered check: the clean
# process generates with every model loaded so far after each load, so its cost grows with the square of this list.
ORDER = ["prenorm", "dsinit-matt", "aan", "sdt-sparse-rpr", "msc", "mhc-2-dynamic"]
assert set(ORDER) <= set(FAMILIES), sorted(set(ORDER) - set(FAMILIES))
# round 0 loads them in this order, round 1 (fresh folders) in reverse
MAX_NEW_TOKENS = 8
MODES = {
    "greedy": dict(num_beams=1),
    "beam4": dict(num_beams=4, num_return_sequences=2),
    "static-greedy": dict(num_beams=1, cache_implementation="static"),
    "static-beam4": dict(num_beams=4, num_return_sequences=2, cache_implementation="static"),
}
PREDICT_FAMILY = "dsinit-matt"  # the MAtt model whose Seq2SeqTrainer.predict failed in the issue

SCRIPT = """
import sys
import traceback

sys.modules["hf_deep_nmt"] = None  # remote code only: the package must not be importable

import torch
from datasets import Dataset
from transformers import AutoModelForSeq2SeqLM, Seq2SeqTrainer, Seq2SeqTrainingArguments
from transformers import cache_utils
from transformers.utils import logging

logging.set_verbosity_error()
torch.set_num_threads(1)
plan = torch.load("plan.pt", weights_only=True)
CODE = {"modules": {}, "steps": {}, "errors": {}, "outputs": {}}


def generate_all(model):
    outputs = {}
    with torch.no_grad():
        for mode, kwargs in plan["modes"].items():
            out = model.generate(**plan["inputs"], **plan["common"], **kwargs)
            scores = out.sequences_scores if kwargs["num_beams"] > 1 else torch.stack(out.scores, dim=1)
            outputs[mode] = {"sequences": out.sequences, "scores": scores}
    return outputs


models = {}
for round_index, order in enumerate(plan["rounds"]):
    loaded = []
    for family, folder in order:
        step = f"{round_index}:{family}"
        try:
            model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
        except Exception:
            CODE["errors"][step] = traceback.format_exc()
            continue
        models[step] = model
        loaded.append(family)
        CODE["modules"][step] = type(model).__module__
        CODE["steps"][step] = {
            "dynamic": cache_utils.DYNAMIC_LAYER_TYPE_MAPPING[plan["layer_type"]].__module__,
            "static": cache_utils.STATIC_LAYER_TYPE_MAPPING[plan["layer_type"]].__module__,
        }
        # every model of this round loaded so far decodes now, under the cache-layer classes of the one just loaded
        for earlier in loaded:
            key = f"{step}:{earlier}"
            try:
                CODE["outputs"][key] = generate_all(models[f"{round_index}:{earlier}"])
            except Exception:
                CODE["errors"][key] = traceback.format_exc()

try:
    model = models[f"0:{plan['predict_family']}"]  # the first-loaded MAtt model, after every other load
    args = Seq2SeqTrainingArguments(
        output_dir="predict", per_device_eval_batch_size=2, predict_with_generate=True, report_to="none", use_cpu=True
    )
    result = Seq2SeqTrainer(model=model, args=args).predict(
        Dataset.from_dict(plan["predict_rows"]), max_new_tokens=plan["common"]["max_new_tokens"]
    )
    CODE["predict"] = {"predictions": torch.as_tensor(result.predictions), "loss": result.metrics["test_loss"]}
except Exception:
    CODE["errors"]["predict"] = traceback.format_exc()
torch.save(CODE, "results.pt")
"""


def generate_all(model, inputs: dict) -> dict:
    """Sequences and scores (greedy: the processed logits of every step; beam search: the sequence scores) per mode."""
    outputs = {}
    with torch.no_grad():
        for mode, kwargs in MODES.items():
            out = model.generate(**inputs, **common_kwargs(), **kwargs)
            scores = out.sequences_scores if kwargs["num_beams"] > 1 else torch.stack(out.scores, dim=1)
            outputs[mode] = {"sequences": out.sequences, "scores": scores}
    return outputs


def common_kwargs() -> dict:
    return dict(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True, output_scores=True)


def mismatches(got: dict, expected: dict) -> list[str]:
    """The modes whose tokens differ, or whose scores differ by more than float rounding (1e-5: a cache layer of the
    wrong module moves them by orders of magnitude more; the dynamic mHC family's greedy logits differed by 1.9e-6
    between the package and its clean-process remote code, tokens and beam scores equal)."""
    return [
        f"{mode} {part}"
        for mode in MODES
        for part in ("sequences", "scores")
        if not (
            torch.equal(got[mode][part], expected[mode][part])
            if part == "sequences"
            else torch.allclose(got[mode][part], expected[mode][part], rtol=0.0, atol=1e-5)
        )
    ]


def predict_rows(inputs: dict, labels: torch.Tensor) -> dict:
    return {
        "input_ids": inputs["input_ids"][:2].tolist(),
        "attention_mask": inputs["attention_mask"][:2].tolist(),
        "labels": labels[:2].tolist(),
    }


def predict(model, rows: dict, output_dir: Path) -> dict:
    args = Seq2SeqTrainingArguments(
        output_dir=str(output_dir),
        per_device_eval_batch_size=2,
        predict_with_generate=True,
        report_to="none",
        use_cpu=True,
    )
    result = Seq2SeqTrainer(model=model, args=args).predict(Dataset.from_dict(rows), max_new_tokens=MAX_NEW_TOKENS)
    return {"predictions": torch.as_tensor(result.predictions), "loss": result.metrics["test_loss"]}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Per family: the installed package's model (a tiny model, further perturbed so that decoding leaves the BOS/one-
    token loops), its folder saved with `save_pretrained` (modeling files and `auto_map`), a second copy of the folder
    under another name (another remote-code module), and its expected outputs on a fixed padded batch."""
    root = tmp_path_factory.mktemp("pairs")
    batch = padded_batch("cpu", [9, 6, 4], 61)
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask")}
    result = {"inputs": inputs, "labels": batch["labels"], "models": {}, "folders": {}, "expected": {}}
    for index, family in enumerate(ORDER):
        model = family_model(family, "cpu")
        generator = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
        # transformers names a folder's module by the folder's name and a hash of its code, and does not re-import a
        # module it holds: the second round needs copies under other names to import (and register) again
        first, second = root / f"first-{family}", root / f"second-{family}"
        model.save_pretrained(first)
        shutil.copytree(first, second)
        result["models"][family] = model
        result["folders"][family] = (first, second)
        result["expected"][family] = generate_all(model, inputs)
    predict_model = result["models"][PREDICT_FAMILY]
    result["expected_predict"] = predict(predict_model, predict_rows(inputs, batch["labels"]), root / "predict")
    return result


@pytest.fixture(scope="module")
def clean_process(families, tmp_path_factory, clean_python):
    """One process that cannot import hf_deep_nmt (cwd an empty folder, Hub offline), forked from the session's clean
    server (torch and transformers imported once, never this package; the folders are loaded by path, so the
    server's Hugging Face home is never read): round 0 loads the folders in ORDER, round 1 the copies in reverse;
    after each load, every model of the round loaded so far generates."""
    tmp_path = tmp_path_factory.mktemp("pairs-process")
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    plan = {
        "rounds": [
            [(family, str(families["folders"][family][0])) for family in ORDER],
            [(family, str(families["folders"][family][1])) for family in reversed(ORDER)],
        ],
        "modes": MODES,
        "common": common_kwargs(),
        "inputs": families["inputs"],
        "layer_type": CACHE_LAYER_TYPE,
        "predict_family": PREDICT_FAMILY,
        "predict_rows": predict_rows(families["inputs"], families["labels"]),
    }
    torch.save(plan, workdir / "plan.pt")
    env = package_free_environment(str(tmp_path / "hf_home"), str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    completed = clean_python.run(
        [sys.executable, "-c", SCRIPT],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return torch.load(workdir / "results.pt", weights_only=True)


# (first, second): `first` is loaded before `second` (in round 0 where ORDER has them so, else in round 1)
LOAD_ORDERS = [
    pytest.param(first, second, 0 if ORDER.index(first) < ORDER.index(second) else 1, id=f"{first}-then-{second}")
    for first, second in permutations(ORDER, 2)
]


@pytest.mark.parametrize(("first", "second", "round_index"), LOAD_ORDERS)
def test_two_remote_code_models_from_two_folders_generate_in_one_process(
    families, clean_process, first, second, round_index
):
    """Right after `second` is loaded, `first` decodes with `second`'s module's cache layers (registered last) and
    `second` with its own, after `first` was loaded and used: both give the package's outputs."""
    step = f"{round_index}:{second}"
    modules = clean_process["modules"]
    assert step in modules, clean_process["errors"].get(step)
    # the situation of the issue: two remote-code modules, the cache-layer type registered by the one loaded last
    assert modules[step].startswith("transformers_modules.") and modules[f"{round_index}:{first}"] != modules[step]
    assert clean_process["steps"][step] == {"dynamic": modules[step], "static": modules[step]}
    for family in (first, second):
        key = f"{step}:{family}"
        assert key not in clean_process["errors"], f"{family} after loading {second}:\n{clean_process['errors'][key]}"
        wrong = mismatches(clean_process["outputs"][key], families["expected"][family])
        assert not wrong, f"{family} (generating after {second} was loaded) differs from the package: {wrong}"


def test_every_load_and_generate_in_the_clean_process_succeeds(clean_process):
    assert not clean_process["errors"], "\n".join(f"{key}:\n{error}" for key, error in clean_process["errors"].items())
    assert len(set(clean_process["modules"].values())) == 2 * len(ORDER)  # one remote-code module per folder


def test_seq2seq_trainer_predict_with_the_first_loaded_matt_model_after_all_loads(families, clean_process):
    assert "predict" in clean_process, clean_process["errors"].get("predict")
    expected = families["expected_predict"]
    assert torch.equal(clean_process["predict"]["predictions"], expected["predictions"])
    assert clean_process["predict"]["loss"] == expected["loss"]


def load_remote_code(folder: Path):
    """The model of a saved folder from its own modeling files. With hf_deep_nmt imported, `AutoModelForSeq2SeqLM`
    gives the package's registered class even with `trust_remote_code=True` (registered code wins in transformers),
    so the class named by `auto_map` is imported from the folder as transformers does for remote code."""
    class_reference = json.loads((folder / "config.json").read_text())["auto_map"]["AutoModelForSeq2SeqLM"]
    model_class = get_class_from_dynamic_module(class_reference, str(folder))
    return model_class.from_pretrained(folder).eval()


def test_installed_package_and_remote_code_in_one_process(families, monkeypatch):
    """With hf_deep_nmt imported, the remote code of an MSC folder, then of a DS-Init/MAtt folder, is loaded; after
    each load, and once more with the package's cache layers registered again (as when the package is imported after
    the remote code), every installed-package model and every remote model loaded so far gives its expected outputs."""
    package_layers = {}
    for mapping in (cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, cache_utils.STATIC_LAYER_TYPE_MAPPING):
        package_layers[id(mapping)] = mapping[CACHE_LAYER_TYPE]
        assert mapping[CACHE_LAYER_TYPE].__module__ == "hf_deep_nmt.modeling.modeling_deep_nmt"
        # restored after the test: the rest of the session keeps the package's cache-layer classes registered
        monkeypatch.setitem(mapping, CACHE_LAYER_TYPE, mapping[CACHE_LAYER_TYPE])
    remote, failures = {}, []

    def check_all(situation: str) -> None:
        runs = [(f"installed {name}", name, model) for name, model in families["models"].items()]
        runs += [(f"remote {name}", name, model) for name, model in remote.items()]
        for label, name, model in runs:
            try:
                wrong = mismatches(generate_all(model, families["inputs"]), families["expected"][name])
            except Exception as error:  # reported with the others, by model
                wrong = [f"{type(error).__name__}: {error}"]
            if wrong:
                failures.append(f"{label} {situation}: {wrong}")

    for family in ("msc", "dsinit-matt"):
        remote[family] = load_remote_code(families["folders"][family][0])
        module = type(remote[family]).__module__
        assert module.startswith("transformers_modules.") and "hf_deep_nmt" not in module
        assert cache_utils.DYNAMIC_LAYER_TYPE_MAPPING[CACHE_LAYER_TYPE].__module__ == module
        assert cache_utils.STATIC_LAYER_TYPE_MAPPING[CACHE_LAYER_TYPE].__module__ == module
        check_all(f"after loading remote {family}")
    for mapping in (cache_utils.DYNAMIC_LAYER_TYPE_MAPPING, cache_utils.STATIC_LAYER_TYPE_MAPPING):
        mapping[CACHE_LAYER_TYPE] = package_layers[id(mapping)]
    check_all("with the package's cache layers registered last")
    assert not failures, "\n".join(failures)
