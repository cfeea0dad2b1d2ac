"""Two CPU processes launched with `torchrun` really train together: world size 2 over gloo, the Trainer in
MULTI_CPU mode, each rank on its own token-budget batches, and identical parameters on both ranks afterwards. The
ranks run `SCRIPT` in the session's one launch of two ranks (tests/two_ranks.py), first of its scenarios: the
process group is the one the Trainer's arguments form."""

import json
from pathlib import Path

from datasets import load_from_disk
from two_ranks import Scenario

from hf_deep_nmt.data.corpus import load_parallel_dataset, sample_corpus_dir, tokenize_parallel
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer

SCRIPT = """
import json
import os
import sys

import torch
import torch.distributed as dist
from datasets import load_from_disk
from transformers import AutoTokenizer, DataCollatorForSeq2Seq

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments, multi_process_launch_without_gpu
from hf_deep_nmt.training.trainer import DeepNMTTrainer

torch.set_num_threads(1)
work = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(f"{work}/tokenizer")
dataset = load_from_disk(f"{work}/train")
torch.manual_seed(0)
config = DlclConfig(
    vocab_size=len(tokenizer), d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
)
model = DlclForConditionalGeneration(config)
initial = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
args = DeepNMTTrainingArguments(
    output_dir=f"{work}/out", max_steps=3, max_tokens=300, learning_rate=1e-2, lr_schedule="inverse_sqrt",
    warmup_steps=1, use_cpu=multi_process_launch_without_gpu(), report_to="none", save_strategy="no",
    disable_tqdm=True, ddp_find_unused_parameters=False, seed=0, label_smoothing_factor=0.1,
)
collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
trainer = DeepNMTTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
trainer.train()

final = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
gathered = [torch.zeros_like(final) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, final)
# what this rank's dataloader yields in one epoch: its examples' source ids, padding removed
loader = trainer.get_train_dataloader()
rows = [
    [int(token) for token in row[mask.bool()]]
    for batch in loader
    for row, mask in zip(batch["input_ids"], batch["attention_mask"])
]
shares = [None] * dist.get_world_size()
dist.all_gather_object(shares, rows)
result = {
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
    "backend": dist.get_backend(),
    "distributed_type": str(trainer.accelerator.distributed_type),
    "trainer_world_size": trainer.args.world_size,
    "steps": trainer.state.global_step,
    "identical": all(torch.equal(final, other) for other in gathered),
    "changed": not torch.equal(initial, final),
    "batches": len(loader),
    "shares": shares,
}
with open(f"{work}/rank{dist.get_rank()}.json", "w") as handle:
    json.dump(result, handle)
"""


def prepare(folder: Path) -> list[str]:
    raw = load_parallel_dataset(train_file=sample_corpus_dir() / "train.tsv")["train"].select(range(120))
    tokenizer = train_joint_tokenizer(zip(raw["source"], raw["target"]), vocab_size=300)
    tokenizer.save_pretrained(folder / "tokenizer")
    tokenize_parallel(raw, tokenizer, 48, 48).save_to_disk(str(folder / "train"))
    return []


SCENARIO = Scenario(SCRIPT, prepare)


def test_two_cpu_processes_train_together_under_torchrun(two_ranks):
    tmp_path = two_ranks("test_distributed")
    dataset = load_from_disk(str(tmp_path / "train"))
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, result in enumerate(results):
        assert (result["rank"], result["world_size"], result["backend"]) == (rank, 2, "gloo")
        assert result["distributed_type"] == "DistributedType.MULTI_CPU" and result["trainer_world_size"] == 2
        assert result["steps"] == 3 and result["changed"] and result["identical"]
    # each rank has its own batches: together they cover the epoch once, no example on both ranks
    shares = results[0]["shares"]
    assert len(shares[0]) + len(shares[1]) == len(dataset) and results[0]["batches"] == results[1]["batches"]
    everything = sorted(tuple(row) for row in dataset["input_ids"])
    assert sorted(tuple(row) for share in shares for row in share) == everything
    shared = {tuple(row) for row in shares[0]} & {tuple(row) for row in shares[1]}
    assert not shared - _duplicates(everything)


def _duplicates(rows: list[tuple]) -> set[tuple]:
    """Rows that occur more than once in the corpus (repeated verses), which may legitimately sit on both ranks."""
    return {row for row in rows if rows.count(row) > 1}
