"""The ONNX road as guarded as the torch road: graphs are tied to the weights, config and tokenizer they were exported
from (digests in `onnx_layout.json`) and refused by name in a folder that holds others; every graph the layout names
is checked (there, its size, its digest, readable) and a damaged layout is named; the decoding-memory estimate and the
thread bound of the torch backend hold; a model path that names nothing says so before any Hub lookup; a Hub
repository without graphs gets advice that works; a command never writes its output into its model or corpus
folder. The graphs are conftest's `small_onnx_export` (a trained 1+1-layer model, fp32 and int8 graphs), which
tests/test_onnx_translate.py and test_onnx_decoding.py read too: one export for the session, in one test here (its
checks change copies); the other tests read a saved folder without graphs."""

import functools
import importlib.util
import json
import logging
import shutil

import pytest
import torch

from hf_deep_nmt.cli import main

ONNX_MISSING = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(ONNX_MISSING), reason=f"the onnx extra is not installed ({ONNX_MISSING})")


def _tiny_model(tiny_config, tokenizer, seed: int):
    from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration

    torch.manual_seed(seed)
    config = tiny_config(DeepNMTConfig, vocab_size=len(tokenizer), encoder_layers=1, decoder_layers=1)
    model = DeepNMTForConditionalGeneration(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_config):
    """`(saved model folder without graphs, the model, its tokenizer)`."""
    from conftest import EXPORT_PAIRS

    from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
    from hf_deep_nmt.hub import export_hub_folder

    tokenizer = train_joint_tokenizer(EXPORT_PAIRS * 20, vocab_size=120, min_frequency=1)
    model = _tiny_model(tiny_config, tokenizer, 0)
    folder = export_hub_folder(model, tokenizer, tmp_path_factory.mktemp("integrity") / "model", repo_id="org/tiny")
    return folder, model, tokenizer


def translate(model, tmp_path, capsys, *options) -> tuple[int, str]:
    source = tmp_path / "in.txt"
    source.write_text("el sol sale\nhola mundo\n", encoding="utf-8")
    target = tmp_path / "out.txt"
    target.unlink(missing_ok=True)
    command = ["translate", "--model", str(model), "--backend", "onnxruntime", "--input", str(source)]
    code = main([*command, "--output", str(target), "--no-progress", "--threads", "1", *options])
    return code, capsys.readouterr().err


def reexport(folder) -> str:
    return f"remove {folder / 'onnx'}, then run `hf-deep-nmt export-onnx --model {folder} --into-model`"


# ---- the graphs belong to the folder they sit in; every file is checked; the torch road's bounds --------------------


def test_the_graphs_prove_what_they_belong_to_and_have_the_torch_roads_guards(
    small_onnx_export, tmp_path, capsys, caplog, monkeypatch
):
    """One export, by `export-onnx --into-model --int8` (conftest's, shared); each check changes a copy of the folder
    with its graphs."""
    folder, model, _, export = small_onnx_export
    assert export["code"] == 0
    torch.manual_seed(1)
    type(model)(model.config).save_pretrained(tmp_path / "newer")  # other weights of the same shapes
    checks = (
        functools.partial(check_an_untouched_folder_translates_silently, caplog=caplog),
        functools.partial(check_replaced_weights_are_refused, newer=tmp_path / "newer" / "model.safetensors"),
        check_another_models_config_is_refused,
        check_the_config_saved_again_by_another_version_keeps_the_graphs,
        check_a_swapped_tokenizer_beside_the_graphs_is_refused,
        check_another_exports_graph_is_refused_by_its_digest,
        functools.partial(check_a_layout_without_digests_warns_once, caplog=caplog),
        check_missing_cut_off_and_unreadable_graphs_and_a_damaged_layout_are_named,
        functools.partial(check_beams_beyond_memory_are_refused_with_the_estimate, monkeypatch=monkeypatch),
    )
    for index, check in enumerate(checks):
        work = tmp_path / f"check-{index}"
        work.mkdir()
        check(shutil.copytree(folder, work / "model"), work, capsys)


def check_an_untouched_folder_translates_silently(copy, work, capsys, caplog):
    layout = json.loads((copy / "onnx" / "onnx_layout.json").read_text())
    assert set(layout["graphs"]) == {"start.onnx", "step.onnx", "start.int8.onnx", "step.int8.onnx"}
    assert set(layout["source"]) == {"tokenizer_fingerprint", "config", "weights"}
    assert set(layout["source"]["weights"]) == {"model.safetensors"}
    with caplog.at_level(logging.WARNING):
        code, error = translate(copy, work, capsys)
    assert code == 0, error
    assert not [record for record in caplog.records if "could not be checked" in record.getMessage()]


def check_replaced_weights_are_refused(copy, work, capsys, newer):
    shutil.copy(newer, copy / "model.safetensors")
    code, error = translate(copy, work, capsys)
    assert code == 2
    assert f"exported from other weights than {copy / 'model.safetensors'}" in error and reexport(copy) in error


def check_another_models_config_is_refused(copy, work, capsys):
    config = json.loads((copy / "config.json").read_text())
    config["vocab_size"] += 300  # a bigger vocabulary's model (its weights gone: the config alone tells)
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "model.safetensors").unlink()
    code, error = translate(copy, work, capsys)
    assert code == 2
    assert f"{copy / 'config.json'} is not the config the ONNX graphs" in error and reexport(copy) in error


def check_the_config_saved_again_by_another_version_keeps_the_graphs(copy, work, capsys):
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "9.9.9"
    (copy / "config.json").write_text(json.dumps(config, indent=4))
    assert translate(copy, work, capsys)[0] == 0


def check_a_swapped_tokenizer_beside_the_graphs_is_refused(copy, work, capsys):
    path = copy / "onnx" / "tokenizer.json"
    tokenizer = json.loads(path.read_text(encoding="utf-8"))
    vocabulary = tokenizer["model"]["vocab"]
    vocabulary["a"], vocabulary["b"] = vocabulary["b"], vocabulary["a"]  # another tokenizer of the same size
    path.write_text(json.dumps(tokenizer), encoding="utf-8")
    code, error = translate(copy, work, capsys)
    assert code == 2 and f"{path} is not the tokenizer the ONNX graphs" in error


def check_another_exports_graph_is_refused_by_its_digest(copy, work, capsys):
    graph = copy / "onnx" / "step.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 1  # the same size, another byte
    graph.write_bytes(bytes(data))
    code, error = translate(copy, work, capsys)
    assert code == 2 and f"{graph} is not the graph the export wrote" in error and reexport(copy) in error


def check_a_layout_without_digests_warns_once(copy, work, capsys, caplog):
    from hf_deep_nmt.serving.onnx import OnnxDecoder

    path = copy / "onnx" / "onnx_layout.json"
    layout = json.loads(path.read_text())
    for key in ("format", "graphs", "source", "model_config"):
        del layout[key]
    path.write_text(json.dumps(layout))
    with caplog.at_level(logging.WARNING):
        OnnxDecoder(copy / "onnx")
        OnnxDecoder(copy / "onnx")
    warnings = [record.getMessage() for record in caplog.records if "could not be checked" in record.getMessage()]
    assert len(warnings) == 1 and str(copy / "onnx") in warnings[0] and "records no digests" in warnings[0]


def check_missing_cut_off_and_unreadable_graphs_and_a_damaged_layout_are_named(copy, work, capsys):
    graphs = copy / "onnx"
    step = graphs / "step.onnx"
    kept = step.read_bytes()
    step.write_bytes(kept[: len(kept) // 2])
    code, error = translate(copy, work, capsys)
    assert code == 2 and f"{step} has {len(kept) // 2:,} bytes, the export wrote {len(kept):,}" in error

    layout = graphs / "onnx_layout.json"
    values = json.loads(layout.read_text())
    del values["graphs"]  # an earlier layout: nothing recorded, ONNX Runtime's refusal is named with the file
    layout.write_text(json.dumps(values))
    code, error = translate(copy, work, capsys)
    assert code == 2 and f"{step} is not a graph ONNX Runtime can read" in error and reexport(copy) in error

    step.unlink()
    code, error = translate(copy, work, capsys)
    assert code == 2 and f"{step}, a graph of onnx_layout.json, is missing" in error

    layout.write_text(layout.read_text()[:40])
    code, error = translate(copy, work, capsys)
    assert code == 2 and f"{layout} is damaged (not JSON" in error and reexport(copy) in error


def check_beams_beyond_memory_are_refused_with_the_estimate(copy, work, capsys, monkeypatch):
    """On a machine with 64 MiB free (a million beams of this small model are estimated at tens of GB, and the
    decoding takes more: it must never start here)."""
    from hf_deep_nmt import memory
    from hf_deep_nmt.serving.onnx import OnnxDecoder

    monkeypatch.setattr(memory, "available_memory", lambda device: 64 << 20)
    monkeypatch.setattr(OnnxDecoder, "translate_batch", lambda *a: pytest.fail("decoding started"))
    code, error = translate(copy, work, capsys, "--num-beams", "1000000")
    assert code == 2, error
    assert "Beam search over a batch of 2 sentence(s) x 1000000 beam(s)" in error and "needs about" in error
    assert "lower --num-beams" in error


def test_the_python_functions_name_a_damaged_tokenizer_of_the_graphs(small_onnx_export, tmp_path):
    """`translate_lines`, the Python road over an export folder, checks the graphs' files (the tokenizer's among them)
    before transformers reads the tokenizer, whose own error names neither the file nor the way out."""
    from hf_deep_nmt.serving.onnx import translate_lines

    graphs = shutil.copytree(small_onnx_export[0] / "onnx", tmp_path / "onnx")
    text = (graphs / "tokenizer.json").read_text(encoding="utf-8")
    (graphs / "tokenizer.json").write_text(text[: len(text) // 2], encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer\.json' cannot be read \(.*\); restore the tokenizer saved with"):
        translate_lines(graphs, ["hola"])


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_a_million_threads_are_refused_on_both_backends(saved, backend, tmp_path, capsys):
    before = torch.get_num_threads()
    arguments = ["translate", "--model", str(saved[0]), "--backend", backend, "--threads", "1000000"]
    assert main([*arguments, "--input", str(tmp_path / "absent.txt")]) == 2
    error = capsys.readouterr().err
    assert "--threads" in error and "1000000" in error and "usable core" in error
    assert torch.get_num_threads() == before


# ---- names that name nothing, and the Hub ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["./absent", "runs/a/b"])
def test_a_model_path_that_does_not_exist_is_named_before_any_hub_lookup(name, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("looked up on the Hub"))
    for command in (
        ["translate", "--backend", "onnxruntime", "--model", name, "--input", "in.txt"],
        ["inspect", "--model", name, "--output", "figures"],
        ["convert-marian", "--model", name, "--output", "converted"],
    ):
        assert main(command) == 2, command
        error = capsys.readouterr().err
        assert f"{name!r} does not exist" in error or f"{name!r} is neither a local folder" in error, error
        assert "Repo id must" not in error


def test_a_hub_repository_without_graphs_gets_advice_that_works(saved, tmp_path, capsys, hub_cache, monkeypatch):
    from huggingface_hub import constants

    from hf_deep_nmt.serving import onnx_export

    plain = tmp_path / "plain"
    plain.mkdir()
    for file in saved[0].iterdir():
        if file.is_file():
            shutil.copy(file, plain / file.name)
    repo = "org/onnx-integrity-no-graphs"
    hub_cache(plain, constants.HF_HUB_CACHE, repo)
    code, error = translate(repo, tmp_path, capsys)
    assert code == 2
    advised = f"`hf-deep-nmt export-onnx --model {repo} --output NEW`, then translate with --model NEW"
    assert advised in error and "--into-model" not in error
    # the advised command reads the model from the Hub and writes its graphs to the new local folder
    written = []
    monkeypatch.setattr(onnx_export, "export_onnx", lambda model, folder, **kwargs: written.append(folder))
    monkeypatch.setattr(onnx_export.os, "rename", lambda *a: None)
    assert main(["export-onnx", "--model", repo, "--output", str(tmp_path / "NEW")]) == 0, capsys.readouterr().err
    assert len(written) == 1


# ---- outputs never inside their model or corpus folder --------------------------------------------------------------


def test_export_onnx_refuses_an_output_inside_its_model_folder(saved, tmp_path, capsys):
    from hf_deep_nmt.serving.onnx import export_for_serving

    folder, model, tokenizer = saved
    assert main(["export-onnx", "--model", str(folder), "--output", str(folder / "graphs")]) == 2
    assert f"is inside the model folder {str(folder)!r}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is inside the model folder"):
        export_for_serving(model, tokenizer, folder / "graphs", source=folder)
    loaded = type(model).from_pretrained(folder)  # the folder it was loaded from, when no source is named
    with pytest.raises(ValueError, match="is inside the model folder"):
        export_for_serving(loaded, tokenizer, folder / "graphs")
    assert not (folder / "graphs").exists()


def test_inspect_refuses_the_model_folder_its_inside_and_the_corpus_folder(saved, tmp_path, capsys):
    from hf_deep_nmt.tools.inspection import inspect_model

    folder = saved[0]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "pairs.tsv").write_text("el sol sale\tthe sun rises\n", encoding="utf-8")
    for output, named in (
        (folder, "is the model folder"),
        (folder / "figures", "is inside the model folder"),
        (corpus, "is the folder of the corpus"),
    ):
        command = ["inspect", "--model", str(folder), "--data", str(corpus / "pairs.tsv"), "--output", str(output)]
        assert main(command) == 2
        assert named in capsys.readouterr().err
    with pytest.raises(ValueError, match="is inside the model folder"):
        inspect_model(str(folder), folder / "figures")
    assert not (folder / "figures").exists() and sorted(p.name for p in corpus.iterdir()) == ["pairs.tsv"]


def test_average_and_convert_marian_refuse_an_output_inside_what_they_read(saved, tmp_path, capsys):
    from hf_deep_nmt.training.averaging import average_checkpoints

    first, second = (shutil.copytree(saved[0], tmp_path / name) for name in ("checkpoint-1", "checkpoint-2"))
    with pytest.raises(ValueError, match="is inside the checkpoint"):
        average_checkpoints([first, second], save_to=second / "averaged")
    marian = tmp_path / "opus-mt"
    marian.mkdir()
    (marian / "config.json").write_text("{}")
    assert main(["convert-marian", "--model", str(marian), "--output", str(marian / "converted")]) == 2
    assert f"is inside the Marian model folder {str(marian)!r}" in capsys.readouterr().err
    assert not (second / "averaged").exists() and not (marian / "converted").exists()
