"""A transient non-finite loss or gradient skips its optimizer step (fairseq's rule: the batch is consumed, no update,
the schedule held); persistent ones stop the run with `NonFiniteTrainingError`.

The reference for "exactly as if the batch had not been drawn" is a second run over the same data without that
batch: both runs see the same batches in the same order (sequential sampling, no dropout), so weights, optimizer state
and learning rate must be bit-identical at the end."""

import json

import pytest
import torch
from datasets import Dataset
from torch.utils.data import SequentialSampler
from transformers import TrainerCallback, default_data_collator
from two_ranks import Scenario

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments
from hf_deep_nmt.training.callbacks import NonFiniteTrainingError, nonfinite_steps_skipped
from hf_deep_nmt.training.trainer import DeepNMTTrainer

BATCH = 2


def rows(count: int = 16) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 37, (count, 6), generator=generator)
    return Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.flip(1).tolist()})


class SequentialTrainer(DeepNMTTrainer):
    """Batches in dataset order, so that a run without one batch sees every other batch at the same update."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def make_trainer(model, dataset, tmp_path, guard=None, **settings) -> SequentialTrainer:
    args = DeepNMTTrainingArguments(
        output_dir=str(tmp_path),
        **{
            "per_device_train_batch_size": BATCH,
            "learning_rate": 3e-3,
            "lr_schedule": "inverse_sqrt",
            "warmup_steps": 4,  # the learning rate changes at every update: a schedule that moved shows
            "weight_decay": 0.01,
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "use_cpu": True,
            "seed": 0,
            "remove_unused_columns": False,
            "logging_steps": 1,
            **settings,
        },
    )
    return SequentialTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        data_collator=default_data_collator,
        callbacks=[guard] if guard is not None else None,
    )


def fresh_model(tiny_config) -> DeepNMTForConditionalGeneration:
    torch.manual_seed(0)
    return DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig, layer_aggregation="dlcl"))


def poison_losses(model, calls: set[int]) -> None:
    """Multiply the training loss of the given forward passes (1-based) by NaN."""
    count = {"n": 0}

    def hook(module, inputs, outputs):
        if module.training:
            count["n"] += 1
            if count["n"] in calls:
                outputs.loss = outputs.loss * float("nan")
        return outputs

    model.register_forward_hook(hook)


def poison_gradients(model, calls: set[int]) -> None:
    """Make one weight's gradient infinite in the given backward passes (1-based), with a finite loss."""
    count = {"n": 0}

    def hook(gradient):
        count["n"] += 1
        return gradient * float("inf") if count["n"] in calls else gradient

    model.model.encoder.layers[1].fc1.weight.register_hook(hook)


def optimizer_state(trainer) -> dict:
    return trainer.optimizer.state_dict()["state"]


def assert_same_training_state(run, reference) -> None:
    for (name, mine), theirs in zip(run.model.state_dict().items(), reference.model.state_dict().values()):
        assert torch.equal(mine, theirs), name
    mine, theirs = optimizer_state(run), optimizer_state(reference)
    assert mine.keys() == theirs.keys()
    for index in mine:
        for key in mine[index]:
            assert torch.equal(mine[index][key], theirs[index][key]), (index, key)
    assert run.lr_scheduler.last_epoch == reference.lr_scheduler.last_epoch
    assert run.lr_scheduler.get_last_lr() == reference.lr_scheduler.get_last_lr()


@pytest.mark.parametrize("poison", [poison_losses, poison_gradients], ids=["nan-loss", "inf-gradient"])
def test_a_skipped_step_leaves_the_run_exactly_as_if_its_batch_had_not_been_drawn(poison, tiny_config, tmp_path):
    data = rows(16)
    skipped_batch = 3  # the third optimizer step's batch: rows 4 and 5
    run = make_trainer(fresh_model(tiny_config), data, tmp_path / "run", max_steps=8)
    poison(run.model, {skipped_batch})
    run.train()

    kept = [index for index in range(16) if index // BATCH != skipped_batch - 1]
    reference = make_trainer(fresh_model(tiny_config), data.select(kept), tmp_path / "reference", max_steps=7)
    reference.train()

    assert_same_training_state(run, reference)
    assert run.lr_scheduler.last_epoch == 7  # updates taken; the Trainer drew 8 batches
    assert run.state.global_step == 8 and nonfinite_steps_skipped(run) == 1
    assert {"nonfinite_steps_skipped": 1, "step": skipped_batch} in run.state.log_history
    # the step before the skipped one was a real update: the test would notice a run that skipped nothing
    assert not torch.equal(
        run.model.model.encoder.layers[1].fc1.weight, fresh_model(tiny_config).model.encoder.layers[1].fc1.weight
    )


def test_the_skipped_step_changes_nothing_and_is_logged_with_a_running_count(tiny_config, tmp_path, caplog):
    trainer = make_trainer(fresh_model(tiny_config), rows(16), tmp_path, max_steps=6)
    poison_losses(trainer.model, {2, 5})
    snapshots = {}

    class Snapshot(TrainerCallback):  # runs after the guard
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            snapshots[("begin", state.global_step + 1)] = [p.detach().clone() for p in model.parameters()]

        def on_step_end(self, args, state, control, model=None, **kwargs):
            snapshots[("end", state.global_step)] = [p.detach().clone() for p in model.parameters()]

    trainer.add_callback(Snapshot())
    with caplog.at_level("WARNING"):
        trainer.train()
    for step in (2, 5):
        before, after = snapshots[("begin", step)], snapshots[("end", step)]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), step
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[("begin", 3)], snapshots[("end", 3)]))
    assert "Skipped optimizer step 2: non-finite gradients" in caplog.text
    assert "1 step(s) skipped in this run, 1 in a row" in caplog.text
    assert "Skipped optimizer step 5:" in caplog.text and "2 step(s) skipped in this run, 1 in a row" in caplog.text
    entries = [entry for entry in trainer.state.log_history if "nonfinite_steps_skipped" in entry]
    assert entries == [{"nonfinite_steps_skipped": 1, "step": 2}, {"nonfinite_steps_skipped": 2, "step": 5}]


def test_persistent_non_finite_steps_stop_the_run_after_the_limit(tiny_config, tmp_path):
    trainer = make_trainer(
        fresh_model(tiny_config), rows(16), tmp_path, max_steps=8, max_consecutive_nonfinite_steps=2
    )
    poison_losses(trainer.model, {3, 5, 6, 7, 8})  # 3 alone is transient; 5, 6, 7 in a row are one too many
    with pytest.raises(NonFiniteTrainingError) as raised:
        trainer.train()
    message = str(raised.value)
    assert "at optimizer step 7; last checkpoint written: none in this run" in message
    assert (
        "3 optimizer steps in a row were non-finite, more than `max_consecutive_nonfinite_steps=2` allows" in message
    )
    assert "(3 skipped in this run)" in message  # steps 3, 5 and 6
    assert nonfinite_steps_skipped(trainer) == 3 and trainer.lr_scheduler.last_epoch == 3  # updates 1, 2 and 4


@pytest.mark.parametrize("value", [-1, 1.5, "5", True])
def test_a_bad_limit_is_refused_by_name(value, tmp_path):
    with pytest.raises(
        ValueError, match=rf"`max_consecutive_nonfinite_steps` must be an integer >= 0 .*got {value!r}"
    ):
        DeepNMTTrainingArguments(output_dir=str(tmp_path), max_consecutive_nonfinite_steps=value, use_cpu=True)


def test_the_count_is_saved_with_the_checkpoint_and_continues_after_a_resume(tiny_config, tmp_path):
    trainer = make_trainer(
        fresh_model(tiny_config), rows(16), tmp_path, max_steps=4, save_strategy="steps", save_steps=4
    )
    poison_losses(trainer.model, {2})
    trainer.train()
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["NonFiniteGuard"]["attributes"]["skipped"] == 1

    resumed = make_trainer(
        fresh_model(tiny_config), rows(16), tmp_path, max_steps=8, save_strategy="steps", save_steps=4
    )
    poison_losses(resumed.model, {3})  # the third batch after the resume: optimizer step 7
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert nonfinite_steps_skipped(resumed) == 2
    assert [e["step"] for e in resumed.state.log_history if "nonfinite_steps_skipped" in e] == [2, 7]


def test_the_main_job_reports_the_count_in_results_json(tmp_path, monkeypatch):
    from hf_deep_nmt.training import pipeline as training

    original = training.make_trainer

    def poisoned(model, *args, **kwargs):
        poison_losses(model, {2})
        return original(model, *args, **kwargs)

    monkeypatch.setattr(training, "make_trainer", poisoned)
    config = {
        "model_type": "deep_nmt",
        "model_overrides": dict(
            d_model=16,
            encoder_layers=2,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
        ),
        "tokenizer_vocab_size": 300,
        "max_eval_samples": 4,
        "output_dir": str(tmp_path / "run"),
        "max_steps": 4,
        "per_device_train_batch_size": 8,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "plot_curves": False,
        "translate_examples": 0,
        "num_beams": 1,
        "max_length_b": 2,
        "max_length_a": 0.0,
        "logging_steps": 1,
    }
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(config))
    summary = training.run([str(recipe)])
    assert summary["nonfinite_steps_skipped"] == 1
    assert json.loads((tmp_path / "run" / "results.json").read_text())["nonfinite_steps_skipped"] == 1


# ---- two processes ----------------------------------------------------------------------------------------------

SCRIPT = """
import json
import os
import sys

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import default_data_collator

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.training.callbacks import NonFiniteTrainingError, nonfinite_steps_skipped
from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments, multi_process_launch_without_gpu
from hf_deep_nmt.training.trainer import DeepNMTTrainer

torch.set_num_threads(1)
generator = torch.Generator().manual_seed(0)
tokens = torch.randint(3, 37, (32, 6), generator=generator)
dataset = Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.flip(1).tolist()})


def train(name, poisoned_calls, limit):
    torch.manual_seed(0)
    config = DeepNMTConfig(
        vocab_size=37, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24, dropout=0.0, layer_aggregation="dlcl",
    )
    model = DeepNMTForConditionalGeneration(config)
    calls = {"n": 0}

    def poison(module, inputs, outputs):
        # a NaN loss on rank 1 only: rank 0's own loss and batch are fine
        if module.training:
            calls["n"] += 1
            if dist.get_rank() == 1 and calls["n"] in poisoned_calls:
                outputs.loss = outputs.loss * float("nan")
        return outputs

    model.register_forward_hook(poison)
    args = DeepNMTTrainingArguments(
        output_dir=f"{work}/{name}", max_steps=6, per_device_train_batch_size=2, learning_rate=3e-3,
        lr_schedule="inverse_sqrt", warmup_steps=4, use_cpu=multi_process_launch_without_gpu(), report_to="none",
        save_strategy="no", disable_tqdm=True, ddp_find_unused_parameters=False, seed=0, remove_unused_columns=False,
        max_consecutive_nonfinite_steps=limit,
    )
    trainer = DeepNMTTrainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator)
    result = {"rank": dist.get_rank()}
    try:
        trainer.train()
    except NonFiniteTrainingError as error:
        result["error"] = str(error)
    final = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    gathered = [torch.zeros_like(final) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, final)
    adam_steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    result.update(
        identical=all(torch.equal(final, other) for other in gathered),
        skipped=nonfinite_steps_skipped(trainer),
        skipped_steps=[e["step"] for e in trainer.state.log_history if "nonfinite_steps_skipped" in e],
        adam_steps=sorted(adam_steps),
        schedule_steps=trainer.lr_scheduler.last_epoch,
        finite=bool(torch.isfinite(final).all()),
    )
    with open(f"{work}/{name}-rank{dist.get_rank()}.json", "w") as handle:
        json.dump(result, handle)


# one launch, one run after the other (each from its own seeded model and Trainer): `name:poisoned calls:limit`
work = sys.argv[1]
for run in sys.argv[2:]:
    name, poisoned_calls, limit = run.split(":")
    train(name, {int(call) for call in poisoned_calls.split(",")}, int(limit))
"""


# The runs of the tests below, by name: the NaN losses of rank 1 (by training forward call) and the limit of
# consecutive skipped steps. They run in the session's one launch of two ranks (tests/two_ranks.py), one after the
# other (each launch pays three interpreters' imports).
TWO_PROCESS_RUNS = {"transient": ("3", 5), "persistent": ("2,3,4,5,6", 1)}
SCENARIO = Scenario(
    SCRIPT, lambda folder: [f"{name}:{calls}:{limit}" for name, (calls, limit) in TWO_PROCESS_RUNS.items()]
)


@pytest.fixture(scope="module")
def two_process_results(two_ranks) -> dict[str, list[dict]]:
    work = two_ranks("test_nonfinite_skipping")
    return {
        name: [json.loads((work / f"{name}-rank{rank}.json").read_text()) for rank in (0, 1)]
        for name in TWO_PROCESS_RUNS
    }


def test_under_torchrun_every_process_skips_the_step_one_process_found_non_finite(two_process_results):
    for result in two_process_results["transient"]:
        assert "error" not in result
        assert result["identical"] and result["finite"]
        assert result["skipped"] == 1 and result["skipped_steps"] == [3]
        assert result["adam_steps"] == [5] and result["schedule_steps"] == 5  # 6 batches drawn, 5 updates


def test_under_torchrun_persistent_non_finite_steps_stop_every_process_at_the_same_step(two_process_results):
    for result in two_process_results["persistent"]:
        assert "at optimizer step 3" in result["error"]
        assert "more than `max_consecutive_nonfinite_steps=1` allows" in result["error"]
        assert result["identical"] and result["skipped"] == 1 and result["adam_steps"] == [1]
