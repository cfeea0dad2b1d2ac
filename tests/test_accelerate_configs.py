"""The `accelerate launch` configs of `recipes/accelerate/` beyond one GPU: the CPU one really starts two processes
that train together over gloo (`accelerate launch --cpu --num_processes 2` alone starts one), the FSDP2 one wraps the
model's own layer classes, the DeepSpeed one is ZeRO stage 2 with the recipe filling every batch value, and the
accelerate the package admits carries the FSDP2 fix for tied embeddings."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from hf_deep_nmt.modeling import modeling_deep_nmt

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "accelerate"


def load(name: str):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(CONFIGS / f"{name}.yaml"))


def test_the_fsdp2_config_wraps_the_layer_classes_of_the_model():
    config = load("fsdp2")
    fsdp = config.fsdp_config
    assert config.distributed_type.value == "FSDP" and fsdp["fsdp_version"] == 2
    assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    names = fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",")
    # the classes every family builds its layers from, as the model tells transformers not to split them
    assert names == modeling_deep_nmt.DeepNMTPreTrainedModel._no_split_modules
    assert all(isinstance(getattr(modeling_deep_nmt, name), type) for name in names)
    assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"  # checkpoints averaging and export read as they are


def test_the_deepspeed_config_is_zero_2_with_the_recipe_filling_the_batch_values():
    config = load("deepspeed_zero2")
    assert config.distributed_type.value == "DEEPSPEED"
    settings = json.loads((ROOT / config.deepspeed_config["deepspeed_config_file"]).read_text())
    assert settings["zero_optimization"]["stage"] == 2
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
        assert settings[key] == "auto"


def test_the_admitted_accelerate_carries_the_fsdp2_fix_for_tied_embeddings():
    """accelerate 1.14 puts the embeddings and the output projection that shares their weight into two FSDP groups,
    which torch >= 2.13 refuses; 1.15 puts them into one."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bound = next(re.fullmatch(r"accelerate>=(\d+)\.(\d+)", item) for item in dependencies if item.startswith("acc"))
    assert bound is not None and tuple(map(int, bound.groups())) >= (1, 15)


WORKER = """
import json, os
import torch.distributed as dist
from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments, multi_process_launch_without_gpu
args = DeepNMTTrainingArguments(output_dir=os.environ["WORK"] + "/out", report_to="none",
                                use_cpu=multi_process_launch_without_gpu())
result = {"rank": args.process_index, "world": args.world_size, "backend": dist.get_backend(),
          "type": str(args.distributed_state.distributed_type)}
with open(os.environ["WORK"] + f"/rank{args.process_index}.json", "w") as handle:
    json.dump(result, handle)
"""
FINISH = """
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_launch(tmp_path_factory):
    """ONE `accelerate launch` of the CPU config whose two processes check both things below in turn: the process
    group the recipe's arguments form, then the FSDP2 sharding in that same gloo group (each launch costs two
    interpreters importing torch and the package). Returns the folder the ranks wrote their results into."""
    if sys.platform != "linux":
        pytest.skip("launches processes the Linux way")
    work = tmp_path_factory.mktemp("two-ranks")
    (work / "worker.py").write_text(textwrap.dedent(WORKER) + SHARDED + FINISH)
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", WORK=str(work))
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml")]
    completed = subprocess.run(
        [*launch, "--main_process_port", str(free_port()), str(work / "worker.py")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return work


def test_the_cpu_config_starts_two_processes_that_form_one_gloo_group(two_rank_launch):
    tmp_path = two_rank_launch
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, result in enumerate(results):
        assert result == {"rank": rank, "world": 2, "backend": "gloo", "type": "DistributedType.MULTI_CPU"}


SHARDED = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTDecoderLayer, DeepNMTEncoderLayer
from hf_deep_nmt.training.sharded import load_whole_state, root_unsharded, whole_model

torch.set_num_threads(1)
rank, work = dist.get_rank(), os.environ["WORK"]
config = DlclConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=1,
                    bos_token_id=0, eos_token_id=2, decoder_start_token_id=0)
torch.manual_seed(0)
model = DlclForConditionalGeneration(config).eval()
torch.manual_seed(1)
averaged = DlclForConditionalGeneration(config).state_dict()  # another set of weights, as an average would be
mesh = init_device_mesh("cpu", (2,))
for module in list(model.modules()):  # the units of recipes/accelerate/fsdp2.yaml, as accelerate makes them
    if isinstance(module, (DeepNMTEncoderLayer, DeepNMTDecoderLayer)):
        fully_shard(module, mesh=mesh)
fully_shard([model.get_input_embeddings(), model.get_output_embeddings()], mesh=mesh)
fully_shard(model, mesh=mesh)
sources = torch.randint(3, 64, (3, 6), generator=torch.Generator().manual_seed(2))
with torch.no_grad(), root_unsharded(model) as synced:  # before any forward, another batch size on each rank
    generated = model.generate(sources[: 2 + rank], max_length=7, num_beams=2, synced_gpus=synced)
load_whole_state(model, averaged if rank == 0 else None)
whole = whole_model(model, rank == 0)
shard = sum(parameter.to_local().numel() for parameter in model.parameters())
result = {"synced": synced, "generated": generated.tolist(), "shard": shard}
if rank == 0:
    result["whole_is_plain"] = type(whole).__name__ == "DlclForConditionalGeneration"
    result["tied"] = whole.get_input_embeddings().weight is whole.get_output_embeddings().weight
    result["averaged"] = all(torch.equal(whole.state_dict()[key], value) for key, value in averaged.items())
    result["full"] = sum(p.numel() for p in whole.parameters())
with open(f"{work}/sharded{rank}.json", "w") as handle:
    json.dump(result, handle)
"""


def test_an_fsdp2_model_generates_on_every_rank_and_is_gathered_whole_on_the_main_one(two_rank_launch):
    """Two gloo ranks shard a DLCL model with tied embeddings as `fsdp2.yaml` asks (FSDP2 shards on the CPU too):
    `generate` runs on both ranks with batches of different sizes and matches the unsharded model's output, an
    averaged state given on the main process reaches every shard, and the main process gathers a whole, tied copy."""
    import torch

    from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration

    main, other = (json.loads((two_rank_launch / f"sharded{rank}.json").read_text()) for rank in (0, 1))
    assert main["synced"] and other["synced"] and main["whole_is_plain"] and main["tied"] and main["averaged"]
    assert main["shard"] + other["shard"] == main["full"] and min(main["shard"], other["shard"]) > 0
    config = DlclConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    unsharded = DlclForConditionalGeneration(config).eval()
    sources = torch.randint(3, 64, (3, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = unsharded.generate(sources, max_length=7, num_beams=2).tolist()
    assert main["generated"] == expected[:2] and other["generated"] == expected
