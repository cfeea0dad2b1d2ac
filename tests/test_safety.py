"""Safe loading and publishing: no pickle anywhere in the project's code, torch.load only with weights_only=True
(ours and the Trainer's on resume), exported folders hold safetensors weights and remote code that imports only the
standard library, torch and transformers; the suite runs offline with outgoing connections refused."""

import ast
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Seq2SeqTrainer, Seq2SeqTrainingArguments, default_data_collator

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration, MscConfig, MscForConditionalGeneration
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.hub import export_hub_folder

ROOT = Path(__file__).resolve().parents[1]
# every Python file the project ships or runs: the package, the remote code, recipes, benchmarks, model cards
PROJECT_CODE = sorted(
    path
    for folder in ("hf_deep_nmt", "modeling", "recipes", "benchmarks", "model_cards")
    for path in (ROOT / folder).rglob("*.py")
)
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
REMOTE_CODE_PACKAGES = {"torch", "transformers"}


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def unsafe_uses(source: str) -> list[str]:
    """Imports of pickle-like modules, `eval`/`exec`, `torch.load` without `weights_only=True`, numpy loads with
    `allow_pickle`, pandas `read_pickle`, by line."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            problems += [
                f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UNSAFE_MODULES:
            problems.append(f"{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            name = dotted(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            if name in ("eval", "exec"):
                problems.append(f"{node.lineno}: {name}()")
            elif name == "torch.load":
                safe = keywords.get("weights_only")
                if not (isinstance(safe, ast.Constant) and safe.value is True):
                    problems.append(f"{node.lineno}: torch.load() without weights_only=True")
            elif name in ("np.load", "numpy.load"):  # numpy refuses pickles unless allow_pickle=True
                allowed = keywords.get("allow_pickle")
                if allowed is not None and not (isinstance(allowed, ast.Constant) and allowed.value is False):
                    problems.append(f"{node.lineno}: {name}() with allow_pickle")
            elif name.endswith("read_pickle"):
                problems.append(f"{node.lineno}: {name}()")
    return problems


def test_the_scan_finds_every_kind_of_unsafe_use():
    source = "\n".join(
        [
            "import pickle",
            "from dill import loads",
            "import torch",
            "torch.load(path)",
            "torch.load(path, weights_only=False)",
            "torch.load(path, map_location='cpu', weights_only=True)",  # the safe one
            "numpy.load(path, allow_pickle=True)",
            "np.load(path, allow_pickle=False)",  # the safe one
            "eval(text)",
            "pd.read_pickle(path)",
        ]
    )
    assert [problem.split(":")[0] for problem in unsafe_uses(source)] == ["1", "2", "4", "5", "7", "9", "10"]


@pytest.mark.parametrize("path", PROJECT_CODE, ids=lambda path: str(path.relative_to(ROOT)))
def test_project_code_has_no_pickle_and_no_unsafe_torch_load(path):
    assert unsafe_uses(path.read_text(encoding="utf-8")) == []


def test_the_scan_covers_the_package_and_the_remote_code():
    names = {str(path.relative_to(ROOT)) for path in PROJECT_CODE}
    assert {
        "hf_deep_nmt/training/pipeline.py",
        "hf_deep_nmt/training/callbacks.py",
        "modeling/modeling_deep_nmt.py",
    } <= names


def imported_roots(source: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


# ---- what is published ----------------------------------------------------------------------------------------------

ZIP_MAGIC, PICKLE_PROTOCOL_MARK = b"PK\x03\x04", 0x80


@pytest.fixture(scope="module")
def tokenizer():
    pairs = [("hola mundo", "hello world"), ("buenos días", "good morning")] * 8
    return train_joint_tokenizer(pairs, vocab_size=60)


@pytest.mark.parametrize("preset", ["deep_nmt", "msc"])
def test_exported_folder_holds_safetensors_weights_and_code_importing_only_stdlib_torch_transformers(
    tokenizer, tmp_path, preset
):
    sizes = dict(vocab_size=len(tokenizer), d_model=8, decoder_layers=2, encoder_ffn_dim=8, decoder_ffn_dim=8)
    sizes.update(encoder_attention_heads=2, decoder_attention_heads=2)
    if preset == "msc":
        model = MscForConditionalGeneration(MscConfig(msc_block_layers=[1, 2], **sizes))
    else:
        model = DeepNMTForConditionalGeneration(DeepNMTConfig(encoder_layers=2, **sizes))
    folder = export_hub_folder(model, tokenizer, tmp_path / "repo")
    files = sorted(path for path in folder.rglob("*") if path.is_file())
    weights = [path.name for path in files if path.suffix in (".safetensors", ".bin", ".pt", ".pth", ".pkl", ".ckpt")]
    assert weights == ["model.safetensors"]
    for path in files:  # no torch.save / pickle payload under any name
        head = path.read_bytes()[:4]
        assert not head.startswith(ZIP_MAGIC) and (not head or head[0] != PICKLE_PROTOCOL_MARK), path.name
    code = [path for path in files if path.suffix == ".py"]
    assert {path.name for path in code} == {
        "configuration_deep_nmt.py",
        "contract_deep_nmt.py",
        "kernels_deep_nmt.py",
        "modeling_deep_nmt.py",
        "sizes_deep_nmt.py",
    }
    for path in code:
        source = path.read_text(encoding="utf-8")
        outside = {root for root in imported_roots(source) if root not in sys.stdlib_module_names}
        assert outside <= REMOTE_CODE_PACKAGES, (path.name, outside)
        assert unsafe_uses(source) == []
    # and it loads back from the folder alone
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == tokenizer.get_vocab()


def test_resuming_a_trainer_checkpoint_unpickles_only_with_weights_only(tiny_config, tmp_path, monkeypatch):
    """Trainer checkpoints hold torch.save files (optimizer, scheduler, RNG state); on resume every one of them must
    be read with weights_only=True, so a tampered checkpoint cannot run code."""
    model = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig))
    tokens = torch.randint(3, 37, (8, 5), generator=torch.Generator().manual_seed(0)).tolist()
    dataset = Dataset.from_dict({"input_ids": tokens, "labels": tokens})

    def trainer(max_steps):
        args = Seq2SeqTrainingArguments(
            output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4, save_strategy="steps",
            save_steps=2, report_to="none", disable_tqdm=True, use_cpu=True,
        )  # fmt: skip
        return Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator)

    trainer(2).train()
    calls = []
    original = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    trainer(4).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert len(calls) >= 3 and all(value is True for value in calls), calls


# ---- offline --------------------------------------------------------------------------------------------------------


def test_the_suite_runs_offline_with_outgoing_connections_refused():
    from huggingface_hub import constants

    assert os.environ["HF_HUB_OFFLINE"] == "1" and constants.HF_HUB_OFFLINE
    with pytest.raises(OSError, match="network access is disabled in the tests"):
        socket.create_connection(("huggingface.co", 443), timeout=2)
    with pytest.raises(OSError, match="network access is disabled in the tests"):
        socket.create_connection(("93.184.215.14", 80), timeout=2)
    # a Hub id that is not cached fails at once with an offline error instead of reaching for the network
    with pytest.raises(OSError, match=r"(?i)offline|cannot find|couldn't connect|local"):
        DeepNMTForConditionalGeneration.from_pretrained("no-such-org/no-such-model")
