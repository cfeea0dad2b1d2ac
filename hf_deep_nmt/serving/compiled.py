"""Compiled decoding: `model.forward` compiled as one graph, with the static cache, for `generate()`'s greedy and beam
search alike (`translate(..., compile=True)`, `hf-deep-nmt translate --compile`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

# Static-cache lengths are rounded up to a multiple of this, so that batches with similar output caps share one
# compiled decoding step (`generate()` keeps the longest cache length it has seen).
STATIC_CACHE_BUCKET = 64


def own_forward(model: PreTrainedModel) -> Callable:
    """`model.forward` bound to a copy of its function with a code object of its own. torch.compile keeps compiled
    graphs, and counts recompilations against `torch._dynamo.config.recompile_limit` (8), per code object, and every
    model of this package (every transformers model, through its decorators) runs the same `forward` code: compiled
    as it is, the fifth model compiled in a process hit the limit after the first four's two graphs each and failed
    under `fullgraph=True` (ran eager without it). With its own code object each model's graphs are its own.
    A forward set on the instance that is not a method of the model (a hook's wrapper, say) is returned as it is."""
    bound = model.forward
    function = getattr(bound, "__func__", None)
    if getattr(bound, "__self__", None) is not model or not isinstance(function, types.FunctionType):
        return bound
    twin = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    twin.__kwdefaults__ = function.__kwdefaults__
    twin.__dict__.update(function.__dict__)  # `__wrapped__` among them: the signature generate() inspects
    twin.__qualname__, twin.__doc__, twin.__module__ = function.__qualname__, function.__doc__, function.__module__
    return types.MethodType(twin, model)


@contextlib.contextmanager
def compiled_decoding(model: PreTrainedModel, longest_output: int, backend: str = "inductor") -> Iterator[dict]:
    """Inside: `model.forward` compiled as one graph (CUDA graphs on CUDA through `mode="reduce-overhead"`, Inductor
    code elsewhere; another `backend`, e.g. "aot_eager", only for checks), compiled once per model and backend and
    kept; yields the `generate()` options that go with it, the static cache sized to a multiple of
    `STATIC_CACHE_BUCKET` slots above `longest_output`. Compiling the forward itself, rather than transformers'
    `compile_config` route, covers beam search, which that route leaves eager. The first decoding call of each batch
    (an empty cache) and each new shape compile once; the rest replays. Each model compiles its own graphs
    (`own_forward`), so any number of models, of any families, can be compiled in one process."""
    kept = model.__dict__.setdefault("_hf_deep_nmt_compiled_forward", {})
    compiled = kept.get(backend)
    if compiled is None:
        device = next(model.parameters()).device
        mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
        forward = own_forward(model)
        compiled = kept[backend] = torch.compile(forward, fullgraph=True, backend=backend, mode=mode)
    own = model.__dict__.get("forward")
    model.forward = compiled
    bucket = -(-(longest_output + 1) // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
    try:
        yield dict(cache_implementation="static", max_cache_len=bucket, disable_compile=True)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own
