"""Checkpoint averaging: the averaged model's weights are the mean of its inputs, tensor by tensor, and it loads."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.cli import main
from hf_deep_nmt.training.averaging import average_checkpoints, average_state_dicts, last_checkpoints, list_checkpoints


@pytest.fixture
def trainer_output(tmp_path, tiny_config):
    """A Trainer-style folder with checkpoint-5, -10, -20 and -100 (numeric, not text, order) of perturbed models,
    as `save_only_model` saves them (weights and trainer state)."""
    output = tmp_path / "run"
    for number, step in enumerate((5, 100, 20, 10)):
        torch.manual_seed(number)
        model = DlclForConditionalGeneration(tiny_config(DlclConfig))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter))
        model.save_pretrained(output / f"checkpoint-{step}")
        (output / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (output / "checkpoint-7").mkdir()  # no weights: not a checkpoint
    (output / "runs").mkdir()
    return output


def test_checkpoints_are_found_in_step_order(trainer_output):
    assert [path.name for path in list_checkpoints(trainer_output)] == [
        "checkpoint-5",
        "checkpoint-10",
        "checkpoint-20",
        "checkpoint-100",
    ]
    assert [path.name for path in last_checkpoints(trainer_output, 2)] == ["checkpoint-20", "checkpoint-100"]
    with pytest.raises(ValueError, match=r"last 5 checkpoints .* holds 4 .*save_total_limit"):
        last_checkpoints(trainer_output, 5)


def test_averaged_weights_are_the_mean_of_the_last_n(trainer_output, tmp_path):
    average_checkpoints(output_dir=trainer_output, last=3, save_to=tmp_path / "averaged")
    inputs = [load_file(trainer_output / f"checkpoint-{step}" / "model.safetensors") for step in (10, 20, 100)]
    averaged = load_file(tmp_path / "averaged" / "model.safetensors")
    assert set(averaged) == set(inputs[0])
    for name, tensor in averaged.items():
        expected = (inputs[0][name].double() + inputs[1][name].double() + inputs[2][name].double()) / 3
        torch.testing.assert_close(tensor, expected.float(), rtol=0, atol=2e-7, msg=name)
    # it is an ordinary model folder: it loads, ties its embeddings, and its config is the newest checkpoint's
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "averaged")
    assert torch.equal(model.lm_head.weight, averaged["model.shared.weight"])
    newest = json.loads((trainer_output / "checkpoint-100" / "config.json").read_text())
    assert json.loads((tmp_path / "averaged" / "config.json").read_text())["model_type"] == newest["model_type"]


def test_an_explicit_list_and_the_command_line(trainer_output, tmp_path):
    chosen = [trainer_output / "checkpoint-5", trainer_output / "checkpoint-100"]
    model = average_checkpoints(chosen)
    first, last = (load_file(path / "model.safetensors") for path in chosen)
    for name, tensor in model.state_dict().items():
        if name in first:
            torch.testing.assert_close(tensor, (first[name] + last[name]) / 2, rtol=0, atol=2e-7)
    target = tmp_path / "cli-average"
    assert main(["average", *map(str, chosen), "--output", str(target)]) == 0
    torch.testing.assert_close(
        load_file(target / "model.safetensors")["model.shared.weight"], model.model.shared.weight
    )
    # an existing result is not replaced without --overwrite
    assert main(["average", *map(str, chosen), "--output", str(target)]) == 2
    assert main(["average", str(chosen[0]), "--output", str(target), "--overwrite"]) == 0
    assert torch.equal(load_file(target / "model.safetensors")["model.shared.weight"], first["model.shared.weight"])


def test_mismatched_checkpoints_are_refused():
    with pytest.raises(ValueError, match=r"different shapes"):
        average_state_dicts([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}])
    with pytest.raises(ValueError, match=r"Checkpoint 2 has different tensors from checkpoint 1: \['v', 'w'\]"):
        average_state_dicts([{"w": torch.zeros(2)}, {"v": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"Integer tensor 'steps' differs"):
        average_state_dicts([{"steps": torch.tensor([1])}, {"steps": torch.tensor([2])}])
    averaged = average_state_dicts(
        [{"steps": torch.tensor([4]), "w": torch.ones(2)}, {"steps": torch.tensor([4]), "w": torch.zeros(2)}]
    )
    assert torch.equal(averaged["steps"], torch.tensor([4])) and torch.equal(averaged["w"], torch.full((2,), 0.5))
