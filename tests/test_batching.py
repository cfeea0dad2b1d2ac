"""Token-budget batches: never over the budget, every pair once per epoch, disjoint equal shares for the ranks, and
plugged into the Trainer's training dataloader."""

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.data.batching import TokenBudgetBatchSampler, pair_lengths, token_batches
from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments
from hf_deep_nmt.training.trainer import DeepNMTTrainer


def random_lengths(count: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 60, (count,), generator=generator).tolist()


@pytest.mark.parametrize("max_tokens", [60, 97, 512])
def test_batches_stay_under_the_budget_and_cover_every_pair_once(max_tokens):
    lengths = random_lengths(1001)
    batches = token_batches(lengths, max_tokens, seed=3)
    for batch in batches:
        assert len(batch) * max(lengths[index] for index in batch) <= max_tokens
    assert sorted(index for batch in batches for index in batch) == list(range(1001))
    # length bucketing: batches are consecutive runs of the length-sorted pairs, so their ranges never overlap
    for batch, following in zip(batches, batches[1:]):
        assert max(lengths[i] for i in batch) <= min(lengths[i] for i in following)


def test_max_sentences_caps_the_rows_of_a_batch():
    batches = token_batches([2] * 50, max_tokens=1000, max_sentences=8)
    assert [len(batch) for batch in batches] == [8] * 6 + [2]


def test_a_pair_longer_than_the_budget_is_named():
    with pytest.raises(ValueError, match=r"longer than `max_tokens`=30 on their own \(row 2 has 40 tokens\)"):
        token_batches([5, 6, 40, 7], max_tokens=30)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_disjoint_equal_shares_that_cover_the_epoch(world_size):
    lengths = random_lengths(500, seed=1)
    samplers = [TokenBudgetBatchSampler(lengths, 200, world_size, rank, seed=7) for rank in range(world_size)]
    for epoch in (0, 1):
        shares = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        assert len({len(share) for share in shares}) == 1 and len(shares[0]) == len(samplers[0])
        seen = [index for share in shares for batch in share for index in batch]
        assert sorted(seen) == list(range(500))  # every pair exactly once, no rank repeats another's
        for share in shares:
            assert all(len(batch) * max(lengths[i] for i in batch) <= 200 for batch in share)
        if epoch == 0:
            first_epoch = shares
    assert shares != first_epoch  # the batch order is reshuffled between epochs


def test_batch_count_is_made_a_multiple_of_the_world_size_by_halving():
    lengths = [10] * 7  # budget 20 -> 4 batches (2, 2, 2, 1); 3 ranks need 6
    batches = token_batches(lengths, 20, multiple_of=3)
    assert len(batches) == 6 and sorted(i for batch in batches for i in batch) == list(range(7))
    with pytest.raises(ValueError, match="single-pair batches into 2 equal shares"):
        token_batches([10, 10, 10], 10, multiple_of=2)


def test_pair_lengths_take_the_longer_side_and_respect_selection():
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3], [1], [4, 5]], "labels": [[1], [2, 2, 2, 2], [3]]})
    assert pair_lengths(dataset) == [3, 4, 2]
    assert pair_lengths(dataset.select([2, 0])) == [2, 3]


def test_trainer_dataloader_yields_token_budget_batches(tmp_path):
    generator = torch.Generator().manual_seed(0)
    sources = [torch.randint(4, 40, (int(n),), generator=generator).tolist() + [2] for n in random_lengths(90)]
    targets = [torch.randint(4, 40, (int(n),), generator=generator).tolist() + [2] for n in random_lengths(90, 5)]
    dataset = Dataset.from_dict({"input_ids": sources, "attention_mask": [[1] * len(s) for s in sources]})
    dataset = dataset.add_column("labels", targets)
    config = DlclConfig(vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2)
    config.update(dict(decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16))
    model = DlclForConditionalGeneration(config)
    args = DeepNMTTrainingArguments(
        output_dir=str(tmp_path), max_tokens=300, use_cpu=True, report_to="none", per_device_train_batch_size=1
    )
    collator = DataCollatorForSeq2Seq(_Pad(), model=model, label_pad_token_id=-100)
    trainer = DeepNMTTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    loader = trainer.get_train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader)
    rows = 0
    for batch in batches:
        rows += batch["input_ids"].shape[0]
        assert batch["input_ids"].shape[0] * max(batch["input_ids"].shape[1], batch["labels"].shape[1]) <= 300
    assert rows == 90
    assert sorted(tuple(row[row != 1].tolist()) for b in batches for row in b["input_ids"]) == sorted(
        map(tuple, sources)
    )


def test_training_resumed_from_a_checkpoint_ends_where_an_uninterrupted_run_ends(tmp_path):
    generator = torch.Generator().manual_seed(1)
    sources = [torch.randint(4, 40, (int(n),), generator=generator).tolist() + [2] for n in random_lengths(48, 2)]
    targets = [torch.randint(4, 40, (int(n),), generator=generator).tolist() + [2] for n in random_lengths(48, 3)]
    dataset = Dataset.from_dict({"input_ids": sources, "attention_mask": [[1] * len(s) for s in sources]})
    dataset = dataset.add_column("labels", targets)

    def trained(output_dir, resume=None, init_seed=0):
        torch.manual_seed(init_seed)
        config = DlclConfig(vocab_size=40, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2)
        config.update(dict(decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, dropout=0.0))
        model = DlclForConditionalGeneration(config)
        args = DeepNMTTrainingArguments(
            output_dir=str(output_dir),
            max_tokens=400,
            max_steps=9,  # more than one epoch of batches, so the resumed run also crosses an epoch boundary
            save_steps=4,
            learning_rate=1e-2,
            lr_schedule="inverse_sqrt",
            warmup_steps=2,
            use_cpu=True,
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        collator = DataCollatorForSeq2Seq(_Pad(), model=model, label_pad_token_id=-100)
        trainer = DeepNMTTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
        steps_per_epoch = len(trainer.get_train_dataloader())
        trainer.train(resume_from_checkpoint=resume)
        return trainer.model, steps_per_epoch

    uninterrupted, steps_per_epoch = trained(tmp_path / "a")
    assert 4 < steps_per_epoch < 9
    # other initial weights: only the checkpoint's weights, optimizer, schedule and data position can make them agree
    resumed, _ = trained(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-4"), init_seed=5)
    for (name, expected), actual in zip(uninterrupted.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(actual, expected, msg=name)


class _Pad:
    """What DataCollatorForSeq2Seq needs of a tokenizer (pad id 1, right padding)."""

    pad_token_id, padding_side, model_input_names = 1, "right", ["input_ids"]

    def pad(self, features, **kwargs):
        width = max(len(feature["input_ids"]) for feature in features)
        ids = [f["input_ids"] + [1] * (width - len(f["input_ids"])) for f in features]
        masks = [f["attention_mask"] + [0] * (width - len(f["input_ids"])) for f in features]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(masks)}

    def save_pretrained(self, directory, **kwargs):  # the Trainer saves the collator's tokenizer with checkpoints
        return ()


def test_the_trainer_takes_its_loader_from_the_training_data(tmp_path):
    """One seam for every source: a dataset that makes its own loader (as a stream does) is asked for it, a plain one
    is read as tokenized pairs (`hf_deep_nmt.data.training_data`); the Trainer never asks which it was given."""
    from hf_deep_nmt.data.training_data import TokenizedPairs, as_training_data

    class OwnLoader(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(())

        def train_dataloader(self, trainer):
            return ("the loader of", trainer)

    config = DlclConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2)
    config.update(dict(decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16))
    args = DeepNMTTrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none")
    trainer = DeepNMTTrainer(model=DlclForConditionalGeneration(config), args=args, train_dataset=OwnLoader())
    assert trainer.get_train_dataloader() == ("the loader of", trainer)
    rows = Dataset.from_dict({"input_ids": [[3, 2]], "labels": [[4, 2]]})
    assert isinstance(as_training_data(rows), TokenizedPairs) and len(as_training_data(rows)) == 1
    with pytest.raises(TypeError, match=r"`max_tokens` needs a tokenized `datasets.Dataset`, got <class 'list'>"):
        trainer.train_dataset, trainer.args.max_tokens = [{"input_ids": [3, 2]}], 100
        trainer.get_train_dataloader()


def reference_token_batches(lengths, max_tokens, seed=0, max_sentences=None, multiple_of=1):
    """The batching as first written (Python lists, one pair at a time), the reference the array version must match."""
    generator = torch.Generator().manual_seed(seed)
    shuffled = torch.randperm(len(lengths), generator=generator).tolist()
    order = sorted(shuffled, key=lambda index: lengths[index])
    batches, batch, longest = [], [], 0
    for index in order:
        candidate = max(longest, lengths[index])
        full = max_sentences is not None and len(batch) >= max_sentences
        if batch and (full or (len(batch) + 1) * candidate > max_tokens):
            batches.append(batch)
            batch, candidate = [], lengths[index]
        batch.append(index)
        longest = candidate
    if batch:
        batches.append(batch)
    while len(batches) % multiple_of:
        largest = max(range(len(batches)), key=lambda position: len(batches[position]))
        whole = batches.pop(largest)
        batches[largest:largest] = [whole[: len(whole) // 2], whole[len(whole) // 2 :]]
    return batches


@pytest.mark.parametrize("seed", [0, 11])
@pytest.mark.parametrize(("max_tokens", "max_sentences"), [(60, None), (97, 5), (512, None), (4096, 64)])
@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_the_array_plan_gives_the_batches_of_the_first_algorithm(seed, max_tokens, max_sentences, world_size):
    lengths = random_lengths(3000, seed) + [0, 0, 1]  # pairs with an empty side too
    expected = reference_token_batches(lengths, max_tokens, seed, max_sentences, world_size)
    assert token_batches(lengths, max_tokens, seed, max_sentences, world_size) == expected
    sampler = TokenBudgetBatchSampler(
        lengths, max_tokens, world_size, world_size - 1, seed, max_sentences=max_sentences
    )
    sampler.set_epoch(2)
    order = torch.randperm(len(expected), generator=torch.Generator().manual_seed(seed + 1_000_003 * 3)).tolist()
    assert list(sampler) == [expected[position] for position in order[world_size - 1 :: world_size]]


def test_a_stored_plan_is_read_memory_mapped_and_a_damaged_one_is_not(tmp_path):
    from hf_deep_nmt.data.batching import plan_batches, read_plan, write_plan

    lengths = random_lengths(700, seed=4)
    plan = plan_batches(lengths, 200, seed=3, multiple_of=2)
    write_plan(tmp_path / "plan", plan, {"seed": 3})
    write_plan(tmp_path / "plan", plan)  # a second writer of the same plan leaves one whole copy
    stored = read_plan(tmp_path / "plan", 700)
    assert isinstance(stored.indices, np.memmap) and stored.batches() == plan.batches()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["plan"]
    shares = [list(TokenBudgetBatchSampler(None, num_replicas=2, rank=rank, seed=3, plan=stored)) for rank in (0, 1)]
    assert shares == [list(TokenBudgetBatchSampler(lengths, 200, 2, rank, seed=3)) for rank in (0, 1)]
    assert read_plan(tmp_path / "plan", 699) is None  # another dataset's
    (tmp_path / "plan" / "offsets.npy").write_bytes(b"damaged")
    assert read_plan(tmp_path / "plan", 700) is None and read_plan(tmp_path / "absent", 700) is None


def test_the_trainer_stores_the_plan_beside_prepared_data_and_a_resume_reads_it(tmp_path, monkeypatch):
    import hf_deep_nmt.data.training_data as training_data

    lengths = random_lengths(300, seed=6)
    rows = Dataset.from_dict(
        {"input_ids": [[5] * n for n in lengths], "labels": [[6] * (n // 2 + 1) for n in lengths]}
    )
    rows.save_to_disk(str(tmp_path / "prepared" / "train"))
    (tmp_path / "prepared" / "prepared.json").write_text("{}")  # what marks a prepared-data folder
    config = DlclConfig(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2)
    config.update(dict(decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16))
    model = DlclForConditionalGeneration(config)

    def shares(dataset, output_dir):
        args = DeepNMTTrainingArguments(output_dir=str(output_dir), max_tokens=200, use_cpu=True, report_to="none")
        trainer = DeepNMTTrainer(model=model, args=args, train_dataset=dataset)
        return [batch for batch in as_training_sampler(trainer)]

    from datasets import load_from_disk

    mapped = load_from_disk(str(tmp_path / "prepared" / "train"))
    first = shares(mapped, tmp_path / "run")
    assert first == list(TokenBudgetBatchSampler(lengths, 200, seed=42))  # the Trainer's seed
    stored = list((tmp_path / "prepared.batch-plans").iterdir())
    assert len(stored) == 1 and not (tmp_path / "run" / "batch-plans").exists()
    monkeypatch.setattr(training_data, "plan_batches", _no_planning)
    assert shares(load_from_disk(str(tmp_path / "prepared" / "train")), tmp_path / "resumed") == first
    with pytest.raises(AssertionError, match="planned again"):  # another selection of rows is another plan
        shares(mapped.select(range(100)), tmp_path / "run")
    monkeypatch.undo()
    assert shares(rows, tmp_path / "memory") == first  # in memory: stored in the run folder
    assert len(list((tmp_path / "memory" / "batch-plans").iterdir())) == 1


def _no_planning(*args, **kwargs):
    raise AssertionError("planned again")


def as_training_sampler(trainer):
    loader = trainer.get_train_dataloader()
    sampler = loader.batch_sampler
    sampler = getattr(sampler, "batch_sampler", sampler)  # under accelerate's pass-through shard, or on its own
    assert isinstance(sampler, TokenBudgetBatchSampler)
    return list(sampler)
