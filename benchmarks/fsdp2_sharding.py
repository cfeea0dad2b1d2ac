"""FSDP2 sharding of a DeepNMT model with tied embeddings: two processes, a few training steps, `generate()` on every
rank, and each rank's share of the parameters.

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp2_sharding.py      # or .device/fsdp2_sharding.sh

The units are those `recipes/accelerate/fsdp2.yaml` asks accelerate (>= 1.15) for: each encoder and decoder layer,
then the embeddings and the output projection that shares their weight in one group, then the root. On a machine with
a CUDA device per process it shards over NCCL on the GPUs; otherwise (one GPU for two processes, which NCCL refuses,
or none) over gloo on the CPU, which shards all the same.

`generate()` calls the encoder directly, outside the root's forward, so the parameters of the root group (the final
norms, DLCL's layer weights) would still be shards: the root is unsharded for the call
(`hf_deep_nmt.training.sharded.root_unsharded`, what the Trainer's evaluation does), and `synced_gpus=True` keeps the
ranks' collectives in step while their batches finish at different lengths. The main process then gathers a whole
copy (`whole_model`, what the final evaluation and the export read).

Expected output (torch 2.13, CPU or one H100/H200; the numbers are the model's, not the machine's):
    rank 0: device cpu, 4496 of 8989 parameters (50.0%), loss 5.0000, generated (1, 6)
    rank 1: device cpu, 4493 of 8989 parameters (50.0%), loss 5.0000, generated (2, 6)
    shards add up to the model: True; embeddings tied: True
(on GPUs: device cuda:0 / cuda:1 and the same counts).
"""

import json
import os

import torch
import torch.distributed as distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTDecoderLayer, DeepNMTEncoderLayer
from hf_deep_nmt.training.sharded import root_unsharded, whole_model


def main() -> None:
    world = int(os.environ["WORLD_SIZE"])
    on_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= world
    distributed.init_process_group("nccl" if on_gpus else "gloo")
    rank = distributed.get_rank()
    device = torch.device("cuda", rank) if on_gpus else torch.device("cpu")
    if on_gpus:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = DlclConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=0,
    )  # fmt: skip
    model = DlclForConditionalGeneration(config).to(device)
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    full = sum(parameter.numel() for parameter in model.parameters())
    mesh = init_device_mesh(device.type, (world,))
    for module in list(model.modules()):
        if isinstance(module, (DeepNMTEncoderLayer, DeepNMTDecoderLayer)):
            fully_shard(module, mesh=mesh)
    fully_shard([model.get_input_embeddings(), model.get_output_embeddings()], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    generator = torch.Generator().manual_seed(1)
    sources = torch.randint(3, 64, (2, 5), generator=generator).to(device)
    targets = torch.randint(3, 64, (2, 4), generator=generator).to(device)
    for _ in range(3):
        loss = model(input_ids=sources, labels=targets).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    local = sum(parameter.to_local().numel() for parameter in model.parameters())
    model.eval()
    with torch.no_grad(), root_unsharded(model) as synced:  # another batch size on each rank: they finish apart
        generated = model.generate(sources[: rank + 1], max_length=6, num_beams=2, synced_gpus=synced)
    whole = whole_model(model, rank == 0)
    shares = [None] * world
    distributed.all_gather_object(shares, local)
    print(
        f"rank {rank}: device {device}, {local} of {full} parameters ({100 * local / full:.1f}%), "
        f"loss {float(loss):.4f}, generated {tuple(generated.shape)}",
        flush=True,
    )
    distributed.barrier()
    if rank == 0:
        whole_tied = whole.get_input_embeddings().weight is whole.get_output_embeddings().weight
        print(
            f"shards add up to the model: {sum(shares) == full}; embeddings tied: {tied}; whole copy on rank 0: "
            f"{sum(parameter.numel() for parameter in whole.parameters())} parameters, tied: {whole_tied}",
            flush=True,
        )
        print(json.dumps({"shares": shares, "full": full, "tied": tied}), flush=True)
    distributed.barrier()
    distributed.destroy_process_group()


if __name__ == "__main__":
    main()
