"""A training step leaves nothing behind. Each step's activations must be freed by reference counting as soon as
the step's loss and outputs go: an autograd node that keeps a tensor of its own graph (through `ctx`) is a cycle
Python's collector cannot free, so memory grows with every step until a GPU runs out (this happened to the DLCL
history: a 30+6 model at d 512 filled 139 GiB of an H200 within about 200 steps of 8k-token batches)."""

import gc
import weakref

import torch
from conftest import ARCHITECTURES

from hf_deep_nmt import MODEL_CLASSES
from hf_deep_nmt.modeling import modeling_deep_nmt


def _training_step(model, batch) -> None:
    outputs = model(**batch)
    outputs.loss.backward()


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for item in gc.get_objects() if isinstance(item, torch.Tensor))


def _grows(models, batch, steps: int = 3) -> bool:
    """Whether the live tensors grow in each of two rounds of `steps` training steps of every model: a leak adds
    tensors at every step, whereas something the process allocates once (a lazily built cache of torch or of
    another test in the same process) shows in one round only."""
    counts = [_live_tensors()]
    for _ in range(2):
        for model in models:
            for _ in range(steps):
                _training_step(model, batch)
        counts.append(_live_tensors())
    return counts[2] > counts[1] > counts[0]


def test_training_steps_do_not_accumulate_tensors(tiny_config, padded_batch):
    """Every architecture of the shared matrix (`ARCHITECTURES`), counted together: the heap is scanned three times
    for all of them rather than per architecture (a scan of a whole test session's heap takes seconds); a failure
    scans again per architecture to name the ones whose steps left tensors behind."""
    batch = {key: padded_batch[key] for key in ("input_ids", "attention_mask", "labels", "decoder_attention_mask")}
    models = {}
    for param in ARCHITECTURES:
        config_class, overrides = param.values[0]
        model = MODEL_CLASSES[config_class](tiny_config(config_class, **overrides)).train()
        _training_step(model, batch)  # the first step creates the .grad tensors
        models[param.id] = model
    if _grows(models.values(), batch):
        leaking = [name for name, model in models.items() if _grows([model], batch)]
        raise AssertionError(f"training steps left tensors behind: {leaking}")


def test_the_history_buffer_is_freed_without_the_cycle_collector(tiny_config, padded_batch, monkeypatch):
    """Stricter than counting after `gc.collect()`: with the collector off, the stored-output buffer of a DLCL
    stack dies with the step's loss, i.e. nothing in the autograd graph refers back to the graph itself."""
    buffers = []
    start = modeling_deep_nmt.DeepNMTBlockHistory.start

    def recording_start(self, embedding):
        state = start(self, embedding)
        buffers.append(weakref.ref(state.buffer))
        return state

    monkeypatch.setattr(modeling_deep_nmt.DeepNMTBlockHistory, "start", recording_start)
    model = MODEL_CLASSES[type(config := tiny_config(layer_aggregation="dlcl"))](config).train()
    batch = {key: padded_batch[key] for key in ("input_ids", "attention_mask", "labels")}
    gc.disable()
    try:
        outputs = model(**batch)
        outputs.loss.backward()
        assert len(buffers) == 2 and all(ref() is not None for ref in buffers)  # encoder and decoder histories
        del outputs
        assert [ref() is None for ref in buffers] == [True, True]
    finally:
        gc.enable()
