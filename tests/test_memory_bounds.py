"""Sizes are bounded before memory is allocated: a config that claims more than its weights, a model or a beam search
that cannot fit the machine, a CTranslate2 position table too large, each refused with its estimate. The end-to-end
checks run in a process of their own under an address-space limit (RLIMIT_AS), so that a regression fails instead of
taking the machine's memory."""

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import fault_worker
import pytest
import torch
from safetensors.torch import save_file

from hf_deep_nmt import MODEL_CLASSES, DeepNMTConfig, DlclConfig, DsInitConfig, MscConfig, SdtConfig
from hf_deep_nmt.memory import InsufficientMemoryError, check_saved_model_size, estimate_parameters
from hf_deep_nmt.serving.ctranslate2 import check_max_positions, export_ctranslate2
from hf_deep_nmt.serving.translate import decoding_memory, translate
from hf_deep_nmt.weights import saved_parameters

LIMIT = 3 << 30  # address space of the subprocesses: torch and a tiny model take under 1 GiB of it


def run_limited(*arguments: str) -> subprocess.CompletedProcess:
    """`hf-deep-nmt ARGUMENTS` in a process of its own that cannot map more than `LIMIT` bytes (forked from
    `fault_worker`'s fork server, which has the package's imports mapped as a fresh interpreter would)."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as folder:
        out, error = Path(folder) / "out", Path(folder) / "error"
        process = fault_worker.start(list(arguments), environment, out, error_log=error, limit=LIMIT)
        process.join(timeout=300)
        if process.exitcode is None:
            process.kill()
            process.join()
        return subprocess.CompletedProcess(arguments, process.exitcode, out.read_text(), error.read_text())


def test_the_parameter_estimate_is_exact_for_plain_stacks_and_a_lower_bound_otherwise():
    """By hand for d=4, vocabulary 10, one layer each, FFN 8, pre-norm, shared and tied embeddings:
    embeddings 10 * 4 = 40, final LayerNorms 2 * 2 * 4 = 16, encoder layer 4 * (16 + 4) (attention) + 2 * 4 * 8 + 8
    + 4 (FFN) + 2 * 8 (LayerNorms) = 172, decoder layer 2 * 80 + 76 + 3 * 8 = 260: 488."""
    config = DeepNMTConfig(
        vocab_size=10,
        d_model=4,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=8,
        decoder_ffn_dim=8,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    assert estimate_parameters(config) == 488

    def counted(config):
        with torch.device("meta"):
            return sum(parameter.numel() for parameter in MODEL_CLASSES[type(config)](config).parameters())

    assert counted(config) == 488
    plain = (DeepNMTConfig(), DeepNMTConfig(pre_norm=False), DsInitConfig(), DeepNMTConfig(share_embeddings=False))
    for exact in plain:
        assert estimate_parameters(exact) == counted(exact)
    for config in (DlclConfig(), SdtConfig(), MscConfig(), DeepNMTConfig(decoder_self_attention="average")):
        assert 0.6 * counted(config) < estimate_parameters(config) <= counted(config)


def test_saved_parameters_are_read_from_the_header_alone(tmp_path):
    tensors = {"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.float16)}
    save_file(tensors, tmp_path / "model.safetensors")
    assert saved_parameters(tmp_path) == (22, 3 * 5 * 4 + 7 * 2)
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "model.safetensors").read_bytes()[:20])
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a whole safetensors file"):
        saved_parameters(tmp_path)


@pytest.mark.parametrize(
    "change, shown",
    [({"d_model": 16384}, "d_model=16384"), ({"encoder_layers": 10**6}, "encoder_layers=1000000")],
)
def test_a_config_claiming_more_than_its_weights_is_refused_before_the_model_is_built(
    tiny_export, tmp_path, change, shown
):
    folder = shutil.copytree(tiny_export[0], tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    held = saved_parameters(folder)[0]
    pattern = rf"describes a model of at least [\d,]+ parameters \(.*{shown}.*hold {held:,}"
    with pytest.raises(ValueError, match=pattern):
        check_saved_model_size(folder)
    (tmp_path / "source.txt").write_text("hola mundo\n")
    result = run_limited("translate", "--model", str(folder), "--input", str(tmp_path / "source.txt"), "--no-progress")
    assert result.returncode == 2, result.stderr
    assert f"hold {held:,}: the config does not belong to these weights" in result.stderr


def test_a_million_beams_are_refused_with_the_estimate_under_a_memory_limit(tiny_export, tmp_path):
    source = tmp_path / "source.txt"
    source.write_text("el sol sale\n")
    result = run_limited("translate", "--model", str(tiny_export[0]), "--input", str(source), "--num-beams", "1000000")
    assert result.returncode == 2, result.stderr
    assert "Beam search over a batch of 1 sentence(s) x 1000000 beam(s) = 1000000 hypotheses" in result.stderr
    # what is left under the limit depends on what the process has mapped by then: shown in GiB or MiB
    assert "lower --num-beams" in result.stderr and re.search(r"[\d.]+ [GM]iB is available on cpu", result.stderr)


def test_the_beam_memory_estimate_by_hand(tiny_export):
    """d 16, 2 decoder layers, 260 target tokens; 10 hypotheses, 5 source and 7 output tokens: keys and values
    2 * 2 * 10 * (5 + 7) * 16 = 7680, encoder output 10 * 5 * 16 = 800, scores 3 * 10 * 260 = 7800; 4 bytes each."""
    config = tiny_export[1].config
    assert (config.d_model, config.decoder_layers, config.decoder_vocab_size or config.vocab_size) == (16, 2, 260)
    assert decoding_memory(config, 10, 5, 7) == 4 * (7680 + 800 + 7800)


def test_translate_refuses_a_batch_that_cannot_fit_before_translating(tiny_export, monkeypatch):
    _, model, tokenizer = tiny_export
    monkeypatch.setattr("hf_deep_nmt.memory.available_memory", lambda device="cpu": 10**6)
    monkeypatch.setattr(type(model), "generate", lambda *args, **kwargs: pytest.fail("decoding started"))
    sources = ["el sol sale", "hola mundo"]
    longest = max(len(tokenizer(text)["input_ids"]) for text in sources)
    output = int(1.5 * longest + 10) + 2  # the default cap, the start token and `</s>`
    needed = 4 * (2 * 2 * 100 * (longest + output) * 16 + 100 * longest * 16 + 3 * 100 * 260)
    with pytest.raises(
        InsufficientMemoryError,
        match=rf"2 sentence\(s\) x 50 beam\(s\) = 100 hypotheses, up to {longest} source and {output} output tokens "
        rf"needs about .* \({needed:,} bytes\), but only 976\.6 KiB is available on cpu",
    ):
        translate(model, tokenizer, sources, num_beams=50)


def test_a_position_table_beyond_memory_is_refused_with_its_size(tiny_export, tmp_path):
    _, model, tokenizer = tiny_export
    with pytest.raises(InsufficientMemoryError, match=r"--max-positions 100000000 \(x d_model 16, float32\) needs "):
        export_ctranslate2(model, tokenizer, tmp_path / "ct2", max_positions=10**8)
    assert not (tmp_path / "ct2").exists()
    check_max_positions(model.config, 1026)  # the default fits
    with pytest.raises(ValueError, match=r"`max_positions` must be an integer >= 2 \(a one-token source .*, got 0"):
        check_max_positions(model.config, 0)


def test_a_model_beyond_the_memory_is_refused_before_it_is_built(tiny_export, monkeypatch, capsys, tmp_path):
    folder = tiny_export[0]
    elements, _ = saved_parameters(folder)
    monkeypatch.setattr("hf_deep_nmt.memory.available_memory", lambda device="cpu": 4 * elements - 1)
    monkeypatch.setattr("transformers.AutoModelForSeq2SeqLM.from_pretrained", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(InsufficientMemoryError, match=rf"\({4 * elements:,} bytes\), but only .* available on cpu"):
        check_saved_model_size(folder)
    from hf_deep_nmt.cli import main

    (tmp_path / "source.txt").write_text("hola mundo\n")
    assert main(["translate", "--model", str(folder), "--input", str(tmp_path / "source.txt"), "--no-progress"]) == 2
    assert "parameters or more, float32) needs about" in capsys.readouterr().err


def test_a_recipe_of_a_million_layers_is_refused_before_anything_is_built(tmp_path):
    overrides = {"d_model": 16, "encoder_layers": 10**6, "decoder_layers": 1, "encoder_ffn_dim": 24}
    overrides.update(decoder_ffn_dim=24, encoder_attention_heads=2, decoder_attention_heads=2)
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"model_type": "deep_nmt", "model_overrides": overrides}))
    output = tmp_path / "out"
    result = run_limited("train", str(recipe), "--output-dir", str(output), "--use-cpu", "true", "--report-to", "none")
    assert result.returncode == 2, result.stderr
    assert "d_model=16, encoder_layers=1000000, decoder_layers=1" in result.stderr
    assert "needs about" in result.stderr and "`model_overrides`" in result.stderr
    assert not output.exists()  # refused before the run folder, the data or the model


def test_the_training_memory_estimate_by_hand():
    """d 4, FFN 8, one layer each, 488 parameters (see above), 10 tokens a batch: 4 * 488 for weights, gradients and
    moments, activations 10 * ((8 * 4 + 2 * 8) + (12 * 4 + 2 * 8)) = 1120; 4 bytes each."""
    from hf_deep_nmt.memory import training_memory

    config = DeepNMTConfig(
        vocab_size=10,
        d_model=4,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=8,
        decoder_ffn_dim=8,
    )
    assert training_memory(config, 10) == 4 * (4 * 488 + 1120)
