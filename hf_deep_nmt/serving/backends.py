"""The decoders `hf-deep-nmt translate --backend` and `hf-deep-nmt serve --backend` choose from, by name: one is made
per run, and the translate loop (or the server's batching queue) sees only its `Decoder` interface.

`serve` without `--backend` takes the fastest backend that can run the model here: `FASTEST_FIRST` walked in order,
each asked `unavailable_reason` (cheap: nothing is loaded), torch last because it runs every model.

A decoder's module is imported when its name is first looked up in `DECODERS`, so that `translate` imports only its
own backend (the torch decoder brings the model code and its registration, which ONNX Runtime and CTranslate2 never
need)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from hf_deep_nmt.serving.decoder import Decoder

_PLACES = {
    "torch": ("hf_deep_nmt.serving.torch_decoder", "TorchDecoder"),
    "onnxruntime": ("hf_deep_nmt.serving.onnx", "OnnxDecoder"),
    "ctranslate2": ("hf_deep_nmt.serving.ctranslate2_decoder", "CTranslate2Decoder"),  # imports ctranslate2 when made
}


class _Decoders(Mapping):
    """The decoder classes by backend name, each module imported at the first lookup of its name."""

    def __getitem__(self, name: str) -> type[Decoder]:
        module, attribute = _PLACES[name]
        return getattr(importlib.import_module(module), attribute)

    def __contains__(self, name: object) -> bool:
        return name in _PLACES  # without importing the decoder

    def __iter__(self) -> Iterator[str]:
        return iter(_PLACES)

    def __len__(self) -> int:
        return len(_PLACES)


DECODERS: Mapping[str, type[Decoder]] = _Decoders()
# fastest first on the CPU at batch 32 (benchmarks/README.md, `inference.py`: CTranslate2, then ONNX Runtime, then
# torch, for every family each runs); a name with no decoder in `DECODERS` is passed over
FASTEST_FIRST = ("ctranslate2", "onnxruntime", "torch")


def backend_choice(model: str, *, int8: bool = False, backend: str | None = None) -> tuple[str, dict[str, str]]:
    """(the backend `choose_backend` picks, {faster backend passed over: why}), so that a server can say why."""
    if backend is not None:
        if backend not in DECODERS:
            raise ValueError(f"--backend {backend}: no such backend here; the backends are {sorted(DECODERS)}.")
        reason = DECODERS[backend].unavailable_reason(model, int8=int8)
        if reason is not None:
            raise ValueError(f"--backend {backend} cannot decode {model}: {reason}.")
        return backend, {}
    skipped = {}
    for name in FASTEST_FIRST:
        if name not in DECODERS:
            continue
        reason = DECODERS[name].unavailable_reason(model, int8=int8)
        if reason is None:
            return name, skipped
        skipped[name] = reason
    reasons = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
    raise ValueError(f"No backend can decode {model} here ({reasons}).")


def choose_backend(model: str, *, int8: bool = False, backend: str | None = None) -> str:
    """The name of the fastest backend in `FASTEST_FIRST` that can decode `model` (a model folder or Hub id) here,
    with the int8 graphs where `int8`; with `backend`, that one, or `ValueError` naming why it cannot."""
    return backend_choice(model, int8=int8, backend=backend)[0]


def make_decoder(
    name: str, model: str, *, int8: bool = False, threads: int | None = None, device: str | None = None
) -> tuple[Decoder, object]:
    """(decoder, tokenizer) of the backend `name` for `model`: its class's `Decoder.load`."""
    if name not in DECODERS:
        raise ValueError(f"No backend {name!r}; the backends are {sorted(DECODERS)}.")
    return DECODERS[name].load(model, int8=int8, threads=threads, device=device)
