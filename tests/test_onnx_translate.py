"""`hf-deep-nmt translate --backend onnxruntime`: the graphs of a model folder's `onnx/` subfolder translate as the
torch backend does (greedy, beam search, the per-sentence output cap); what the backend cannot do is refused by
name; a missing export names the command that writes it; `push` carries the subfolder. The export is conftest's
`small_onnx_export` (a trained 1+1-layer model), which tests/test_onnx_integrity.py and test_onnx_decoding.py
read too (one export for the session, whichever pytest-xdist worker makes it)."""

import importlib.util
import logging
import shutil
import sys

import pytest

from hf_deep_nmt.cli import main
from hf_deep_nmt.serving.translate import translate

ONNX_MISSING = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]
pytestmark = pytest.mark.skipif(bool(ONNX_MISSING), reason=f"the onnx extra is not installed ({ONNX_MISSING})")


LINES = ["el sol sale", "", "la mar no se llena", "hola mundo", "el sol sale hola", "la mar"]


def test_onnx_backend_translates_as_torch_and_ships_with_the_model(small_onnx_export, tmp_path, capsys):
    from hf_deep_nmt.hub import upload_operations
    from hf_deep_nmt.serving.onnx import load_onnx_model

    shared, model, tokenizer, export = small_onnx_export
    folder = shutil.copytree(shared, tmp_path / "repo")
    # `export-onnx --into-model --int8` wrote the graphs, and logged no advice of the quantizer's
    assert export["code"] == 0
    assert not [message for message in export["warnings"] if "pre-processing" in message]
    source = tmp_path / "in.es"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    base = ["translate", "--model", str(folder), "--input", str(source), "--no-progress", "--backend", "onnxruntime"]

    def run(*options) -> list[str]:
        target = tmp_path / f"out{len(list(tmp_path.iterdir()))}.en"
        assert main([*base, "--output", str(target), "--threads", "1", *options]) == 0, capsys.readouterr().err
        return target.read_text(encoding="utf-8").split("\n")[:-1]

    # the model's generation config (2 beams), greedy, beam 4, and a cap that cuts most sentences (forced `</s>`)
    for options in ((), ("--num-beams", "1"), ("--num-beams", "4"), ("--num-beams", "4", "--max-length-a", "0.5")):
        settings = dict(zip(options[::2], options[1::2]))
        expected = translate(
            model,
            tokenizer,
            LINES,
            num_beams=int(settings.get("--num-beams", 2)),
            max_length_a=float(settings.get("--max-length-a", 1.5)),
        )
        assert run(*options, "--batch-size", "2") == expected, options
    assert len(set(expected)) > 3 and expected[1] == ""
    decoder, onnx_tokenizer = load_onnx_model(folder, threads=1)  # the Python API: the decoder in the model's place
    assert translate(decoder, onnx_tokenizer, LINES, num_beams=4, length_penalty=0.6) == translate(
        model, tokenizer, LINES, num_beams=4, length_penalty=0.6
    )
    assert len(run("--int8")) == len(LINES)

    # what the backend cannot do, named; the export is not redone over itself
    for options, named in (
        (("--compile",), "--compile"),
        (("--device", "cuda"), "--device cuda"),
        (("--num-beams", "2", "--length-penalty-form", "gnmt"), "--length-penalty-form gnmt"),
    ):
        assert main([*base, *options]) == 2
        assert named in capsys.readouterr().err
    assert main(["export-onnx", "--model", str(folder), "--into-model"]) == 2
    assert f"{folder / 'onnx'} exists" in capsys.readouterr().err

    uploaded = [operation.path_in_repo for operation in upload_operations(folder)]
    assert {"onnx/start.onnx", "onnx/step.int8.onnx", "onnx/onnx_layout.json", "config.json"} <= set(uploaded)


def test_onnx_backend_refusals_before_any_graph_is_read(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert main(["translate", "--model", str(folder), "--backend", "onnxruntime", "--no-progress"]) == 2
    assert f"`hf-deep-nmt export-onnx --model {folder} --into-model`" in capsys.readouterr().err
    assert main(["translate", "--model", str(folder), "--int8"]) == 2
    assert "--int8 picks the int8 graphs of --backend onnxruntime" in capsys.readouterr().err

    kept = tmp_path / "kept.txt"
    kept.write_text("saved\n")
    source = tmp_path / "in.txt"
    source.write_text("hola\n")
    command = ["translate", "--model", str(folder), "--backend", "onnxruntime", "--input", str(source)]
    assert main([*command, "--output", str(kept)]) == 2
    assert "exists" in capsys.readouterr().err and kept.read_text() == "saved\n"

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # not installed
    assert main([*command, "--output", str(tmp_path / "new.txt")]) == 1
    assert "pip install 'hf-deep-nmt[onnx]'" in capsys.readouterr().err


def test_only_the_quantizers_preprocessing_advice_is_silenced(caplog):
    from hf_deep_nmt.serving.onnx import PREPROCESSING_HINT, quiet_preprocessing_hint

    with caplog.at_level(logging.WARNING), quiet_preprocessing_hint():
        logging.warning(PREPROCESSING_HINT + ". Refer to example: ...")
        logging.warning("another warning")
    logging.warning(PREPROCESSING_HINT)
    assert [record.getMessage() for record in caplog.records] == ["another warning", PREPROCESSING_HINT]
