"""The serving seam: a decoder, chosen once when it is made.

`translate` (and the file functions beside it) runs one loop for every backend: it tokenizes, forms batches by a
token budget, restores the input order, caps outputs and writes text, and hands each batch of token ids to a
`Decoder`. What differs between backends lives behind this interface alone: which settings a backend cannot honour
(refused by name before anything is loaded), whether the batches fit its memory, and how a batch is decoded.
`hf_deep_nmt.serving.torch_decoder.TorchDecoder` runs the model's `generate()`; `hf_deep_nmt.serving.onnx.OnnxDecoder`
runs exported graphs on ONNX Runtime; `hf_deep_nmt.serving.backends.DECODERS` names them for the command line.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_deep_nmt.serving.options import DecodingOptions


class Decoder:
    """One way of decoding batches of token ids into text. Subclasses override `translate_batch`, and where they have
    something to say, `check_settings`, `check`, `check_fits` and `generation_config`."""

    @classmethod
    def check_settings(cls, *, device: str | None = None, compile: bool = False, int8: bool = False) -> None:
        """`ValueError` naming a setting of `hf-deep-nmt translate` this backend cannot honour, before anything is
        loaded: the device to decode on, a compiled decoding step, the int8 graphs."""
        if not isinstance(compile, bool):
            raise ValueError(f"`compile` must be True or False, got {compile!r}.")

    @classmethod
    def unavailable_reason(cls, model: str, *, int8: bool = False) -> str | None:
        """Why this backend cannot decode `model` (a model folder or Hub id) here, in a few words, or None when it can:
        cheap (nothing is loaded), so that `serve` can walk the backends from the fastest and take the first that
        runs (`hf_deep_nmt.serving.backends.choose_backend`)."""
        return None

    @classmethod
    def load(cls, model: str, *, int8: bool = False, threads: int | None = None, device: str | None = None):
        """(decoder, tokenizer) of `model` (a model folder or Hub id) for this backend, on `threads` CPU threads (None:
        `threads.default_threads()`) and `device` where the backend has a choice; what
        `hf_deep_nmt.serving.backends.make_decoder` calls for a backend named on the command line."""
        raise NotImplementedError(f"{cls.__name__} cannot be made by name: it defines no `load`.")

    def compiled(self) -> Decoder:
        """This decoder with a compiled decoding step, for a backend that has one (`check_settings` refuses
        `compile=True` for the others)."""
        raise NotImplementedError

    @property
    def generation_config(self):
        """The saved decoding defaults (beams, length penalty) of the model this decoder runs."""
        raise NotImplementedError

    def check(self, tokenizer, options: DecodingOptions) -> None:
        """`ValueError` naming what this decoder cannot do with `options`, or a `tokenizer` that is not its model's;
        called once, before anything is tokenized."""

    def check_fits(self, batches: Sequence[tuple[int, int]], options: DecodingOptions) -> None:
        """Refuse, before the first batch, a decoding whose largest batch cannot fit this decoder's memory; `batches`
        holds (sentences, longest source in tokens) of every batch. Nothing is refused where nothing is estimated."""

    def translate_batch(self, tokenizer, sources: list[list[int]], options: DecodingOptions) -> list[str]:
        """The translations of one batch of token ids (unpadded, each with its `</s>`), in the batch's order."""
        raise NotImplementedError
