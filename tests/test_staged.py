"""Shallow-to-deep training in one command: a 2 -> 4 -> 6 layer run on a slice of the sample corpus, resuming an
interrupted stage from its checkpoint, and `average_checkpoints` exporting the mean of the last stage's newest
checkpoints."""

import json
import shutil

import torch
from safetensors.torch import load_file

from hf_deep_nmt.data.corpus import sample_corpus_dir
from hf_deep_nmt.training.averaging import average_state_dicts
from hf_deep_nmt.training.run_folder import RUN_RECORD
from hf_deep_nmt.training.staged import run_staged


def arguments(tmp_path, depths=("2", "4", "6")) -> list[str]:
    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:160]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (tmp_path / "valid.tsv").write_text("\n".join(lines[:4]) + "\n", encoding="utf-8")
    overrides = {
        "d_model": 32,
        "decoder_layers": 1,
        "encoder_attention_heads": 2,
        "decoder_attention_heads": 2,
        "encoder_ffn_dim": 48,
        "decoder_ffn_dim": 48,
        "sparse_block_size": 2,
        "relative_position_window": 4,
    }
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"model_type": "deep_nmt_sdt", "model_overrides": overrides}))
    return [
        str(recipe),
        "--train_file",
        str(tmp_path / "train.tsv"),
        "--validation_file",
        str(tmp_path / "valid.tsv"),
        "--tokenizer_vocab_size",
        "300",
        "--max_source_length",
        "48",
        "--max_target_length",
        "48",
        "--stage_depths",
        *depths,
        "--stage_max_steps",
        "6",
        "--schedule_warmup_steps",
        "4",
        "--learning_rate",
        "0.003",
        "--per_device_train_batch_size",
        "16",
        "--save_strategy",
        "steps",
        "--save_steps",
        "3",
        "--num_beams",
        "2",
        "--output_dir",
        str(tmp_path / "run"),
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--use_cpu",
        "true",
        "--seed",
        "0",
        "--dataloader_num_workers",
        "0",
    ]


def test_staged_run_grows_two_four_six_layers_with_restarts(tmp_path):
    summary = run_staged(arguments(tmp_path) + ["--export_dir", str(tmp_path / "export")])
    stages = summary["stages"]
    assert [stage["encoder_layers"] for stage in stages] == [2, 4, 6]
    assert [stage["steps"] for stage in stages] == [6, 6, 6]
    assert [stage["schedule_start"] for stage in stages] == [0, 4, 4]  # min(steps so far, warm-up)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["encoder_layers"] == 6 and config["encoder_block_boundaries"] == [0, 2, 4, 6]
    assert "bleu" in summary
    # stage 2 was grown from stage 1: its top block (layers 2-3) started as copies, then trained on
    grown = load_file(tmp_path / "run" / "stage-2-4-layers" / "model" / "model.safetensors")
    assert grown["model.encoder.layers.3.fc1.weight"].shape == (48, 32)


def test_an_interrupted_stage_resumes_from_its_checkpoint(tmp_path):
    uninterrupted = tmp_path / "a"
    uninterrupted.mkdir()
    run_staged(arguments(uninterrupted, depths=("2", "4")))
    expected = load_file(uninterrupted / "run" / "stage-2-4-layers" / "model" / "model.safetensors")

    interrupted = tmp_path / "b"
    interrupted.mkdir()
    run_staged(arguments(interrupted, depths=("2", "4")))
    stage_one = interrupted / "run" / "stage-1-2-layers" / "model" / "model.safetensors"
    stage_one_time = stage_one.stat().st_mtime_ns
    stage_two = interrupted / "run" / "stage-2-4-layers"
    # as if killed after the checkpoint at step 3 of stage 2: no later checkpoint, no final model, no stage record,
    # no results, and the run's record not marked finished
    shutil.rmtree(stage_two / "model")
    shutil.rmtree(stage_two / "checkpoint-6")
    (stage_two / "stage.json").unlink()
    (interrupted / "run" / "results.json").unlink()
    record = json.loads((interrupted / "run" / RUN_RECORD).read_text())
    (interrupted / "run" / RUN_RECORD).write_text(json.dumps({**record, "finished": False}))
    summary = run_staged(arguments(interrupted, depths=("2", "4")))
    assert stage_one.stat().st_mtime_ns == stage_one_time  # the finished stage is not trained again
    assert summary["stages"][1]["steps"] == 6
    resumed = load_file(stage_two / "model" / "model.safetensors")
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_average_checkpoints_exports_the_mean_of_the_last_stages_newest_checkpoints(tmp_path):
    argv = arguments(tmp_path, depths=("2", "4")) + ["--export_dir", str(tmp_path / "export")]
    argv[argv.index("--save_steps") + 1] = "2"  # checkpoints 2, 4 and 6 in every stage
    summary = run_staged(argv + ["--average_checkpoints", "3"])
    assert summary["averaged_checkpoints"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    last_stage = tmp_path / "run" / "stage-2-4-layers"
    by_hand = average_state_dicts(
        [load_file(last_stage / name / "model.safetensors") for name in summary["averaged_checkpoints"]]
    )
    exported = load_file(tmp_path / "export" / "model.safetensors")
    final = load_file(last_stage / "model" / "model.safetensors")
    assert set(exported) == set(by_hand)
    for name, tensor in by_hand.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
    # the average is not simply the last stage's final weights
    assert any(not torch.equal(exported[name], final[name]) for name in final)
