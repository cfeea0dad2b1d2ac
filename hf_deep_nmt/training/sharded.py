"""Decoding a model that FSDP2 shards (`recipes/accelerate/fsdp2.yaml`): every rank holds a shard of each parameter,
and a module's parameters are gathered only by the forward hooks of its FSDP unit.

`generate()` calls the encoder directly, outside the root module's forward, so the parameters of the root unit (final
norms, DLCL's layer weights: everything not in a layer or the embedding group) would still be shards there. Within
`root_unsharded(model)` they are whole, and generation must run in step on every rank (`synced_gpus`: a rank whose
batch finished keeps taking part in the others' gathers). The final evaluation and the export run on the main process
alone, so they read a whole copy of the model that every rank helps gather (`whole_model`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _fsdp_module() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 (`fully_shard`) shards `model` as its root."""
    fsdp_module = _fsdp_module()
    return fsdp_module is not None and isinstance(model, fsdp_module)


@contextlib.contextmanager
def root_unsharded(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block the root unit of an FSDP2 `model` holds whole parameters (yields True: then generate with
    `synced_gpus=True` on every rank); any other model is left as it is (yields False)."""
    if not is_sharded(model):
        yield False
        return
    # FSDP finds its root on the first forward through it; before one (an evaluation ahead of any training step),
    # the embeddings' unit, which `generate` reaches first, would take itself for the root
    state = getattr(model, "_get_fsdp_state", lambda: None)()
    getattr(state, "_lazy_init", lambda: None)()
    model.unshard()
    try:
        yield True
    finally:
        model.reshard()


def whole_model(model: torch.nn.Module, main_process: bool) -> torch.nn.Module | None:
    """`model` itself, or for an FSDP2 `model` a whole copy on the main process (None on the others), on the device of
    its shards: called on every rank, which each send their shards."""
    if not is_sharded(model):
        return model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)  # a collective: every rank sends, the main one receives
    if not main_process:
        return None
    fsdp_module = _fsdp_module()
    plain = next(kind for kind in type(model).__mro__ if not issubclass(kind, fsdp_module))
    device = next(model.parameters()).device
    copy = plain(model.config)  # built whole on the CPU (not on `meta`: every buffer the model makes is there)
    copy.load_state_dict(state)
    copy.generation_config = model.generation_config
    return copy.to(device).eval()


def load_whole_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Load the whole `state` (given on the main process, None on the others) into `model`: into the main process's
    model alone for an unsharded one; for an FSDP2 one, each tensor is sent from the main process and every rank
    keeps its shard (a collective: call it on every rank). The shared embeddings are one parameter, loaded once."""
    if not is_sharded(model):
        if state is not None:
            model.load_state_dict(state)
        return
    import torch.distributed as distributed
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if state is not None:
                whole = state[name].to(device=local.device, dtype=local.dtype)
            else:
                whole = torch.empty(tensor.shape, device=local.device, dtype=local.dtype)
            distributed.broadcast(whole, src=0)
            if isinstance(tensor, DTensor):
                whole = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            local.copy_(whole)
