"""The torch decoder: a transformers model's own `generate()`, with `translate`'s per-sentence output caps, the GNMT
length penalty by rescoring the final beam, optional compiled decoding, and the model's own decoding-memory estimate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
)

from hf_deep_nmt import registration  # noqa: F401  (models load through the Auto classes)
from hf_deep_nmt.fingerprints import check_tokenizer_matches
from hf_deep_nmt.memory import check_memory, check_saved_model_size
from hf_deep_nmt.model_folders import check_saved_json_files
from hf_deep_nmt.modeling.sizes_deep_nmt import decoding_memory
from hf_deep_nmt.serving.compiled import compiled_decoding
from hf_deep_nmt.serving.decoder import Decoder
from hf_deep_nmt.serving.options import DecodingOptions, length_penalty
from hf_deep_nmt.serving.threads import set_threads
from hf_deep_nmt.weights import check_finite_weights, check_missing_weights


def load_model(model_name: str, device: str | torch.device = "cpu"):
    """(model on `device`, tokenizer) of a saved model folder or Hub id, as the commands load it: before anything is
    built, the config must not describe more parameters than the weights hold, and the model must fit `device`'s
    memory (`check_saved_model_size`); after loading, a weight the file lacks (initialised at random) and NaN or
    infinite weights are refused, naming them, as is a tokenizer that is not the model's (`check_tokenizer_matches`).
    """
    folder = Path(str(model_name)).expanduser()
    if folder.is_dir():
        check_saved_json_files(folder)
        check_saved_model_size(folder, device)
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model, info = AutoModelForSeq2SeqLM.from_pretrained(model_name, output_loading_info=True)
    check_missing_weights(model, info, str(model_name))
    check_finite_weights(model, str(model_name))
    check_tokenizer_matches(model, tokenizer)
    return model.to(device), tokenizer


def check_decoding_memory(model: PreTrainedModel, sentences: int, num_beams: int, source: int, output: int) -> None:
    """`InsufficientMemoryError` stating the estimate when a batch of `sentences` decoded with `num_beams` beams, up
    to `source` source and `output` output tokens, cannot fit the memory of the model's device, before it is tried.
    The estimate is the model code's own `decoding_memory`, the one its `generate()` checks with."""
    needed = decoding_memory(model.config, sentences * num_beams, source, output, model.dtype)
    check_memory(
        needed,
        f"Beam search over a batch of {sentences} sentence(s) x {num_beams} beam(s) = {sentences * num_beams} "
        f"hypotheses, up to {source} source and {output} output tokens",
        "lower --num-beams (`num_beams`), --batch-size or --max-tokens",
        model.device,
    )


class SourceRelativeMaxLength(LogitsProcessor):
    """Force `</s>` once a hypothesis has `limits[i]` tokens, `i` being its source sentence (rows of a beam search
    are grouped by sentence, `num_beams` consecutive rows each)."""

    def __init__(self, limits: torch.Tensor, eos_token_id: int, prompt_length: int = 1):
        self.limits, self.eos_token_id, self.prompt_length = limits, eos_token_id, prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        rows_per_sentence = input_ids.shape[0] // self.limits.shape[0]
        limits = self.limits.to(input_ids.device).repeat_interleave(rows_per_sentence)
        done = (input_ids.shape[1] - self.prompt_length) >= limits
        if done.any():
            scores = scores.clone()
            scores[done] = -float("inf")
            scores[done, self.eos_token_id] = 0.0
        return scores


def _output_length(tokens: torch.Tensor, eos_token_id: int) -> int:
    """Tokens up to and including the first `</s>` (all of them when there is none)."""
    positions = (tokens == eos_token_id).nonzero()
    return int(positions[0, 0]) + 1 if len(positions) else int(tokens.shape[0])


class TorchDecoder(Decoder):
    """`model.generate()` on the model's device (`compile=True`: the compiled decoding step, `compiled_decoding`)."""

    def __init__(self, model: PreTrainedModel, compile: bool = False):
        self.check_settings(compile=compile)
        self.model, self.compile = model, compile

    @classmethod
    def check_settings(cls, *, device: str | None = None, compile: bool = False, int8: bool = False) -> None:
        super().check_settings(device=device, compile=compile, int8=int8)
        if int8:
            raise ValueError(
                "--int8 picks the int8 graphs of --backend onnxruntime (int8 compute with --backend ctranslate2); add "
                "one, or drop --int8."
            )

    @classmethod
    def unavailable_reason(cls, model: str, *, int8: bool = False) -> str | None:
        """None: torch runs every model, but in fp32 only (--int8 is another backend's)."""
        return "it decodes in fp32 only (--int8 is another backend's)" if int8 else None

    @classmethod
    def load(cls, model: str, *, int8: bool = False, threads: int | None = None, device: str | None = None):
        """`load_model` on `device` (default: the CPU), torch on `threads` threads (`set_threads`)."""
        cls.check_settings(device=device, int8=int8)
        set_threads(threads)
        loaded, tokenizer = load_model(model, device or "cpu")
        return cls(loaded), tokenizer

    def compiled(self) -> TorchDecoder:
        return TorchDecoder(self.model, compile=True)

    @property
    def generation_config(self):
        return self.model.generation_config

    def check(self, tokenizer, options: DecodingOptions) -> None:
        check_tokenizer_matches(self.model, tokenizer)

    def check_fits(self, batches: Sequence[tuple[int, int]], options: DecodingOptions) -> None:
        """The largest batch by the model's own estimate (`check_decoding_memory`)."""
        largest = None
        for sentences, source in batches:
            output = options.output_cap(source) + 2  # the start token and `</s>`
            rows = sentences * options.num_beams
            needed = decoding_memory(self.model.config, rows, source, output, self.model.dtype)
            largest = max(largest or (needed, sentences, source, output), (needed, sentences, source, output))
        if largest is not None:
            check_decoding_memory(self.model, largest[1], options.num_beams, largest[2], largest[3])

    def translate_batch(self, tokenizer, sources: list[list[int]], options: DecodingOptions) -> list[str]:
        model = self.model.eval()
        eos = model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        batch = tokenizer.pad({"input_ids": sources}, return_tensors="pt").to(model.device)
        limits = options.output_limits(batch["attention_mask"].sum(dim=1))
        longest = int(limits.max())
        decoding = compiled_decoding(model, longest + 1) if self.compile else contextlib.nullcontext({})
        with torch.inference_mode(), decoding as extra:
            generated = model.generate(
                **batch,
                **options.generate_kwargs(longest),
                logits_processor=LogitsProcessorList([SourceRelativeMaxLength(limits, eos)]),
                **extra,
            )
        sequences = generated.sequences
        if options.gnmt:
            sequences = self._rescored(generated, len(sources), eos, options)
        return [text.strip() for text in tokenizer.batch_decode(sequences, skip_special_tokens=True)]

    @staticmethod
    def _rescored(generated, sentences: int, eos: int, options: DecodingOptions) -> torch.Tensor:
        """The best of each sentence's `num_beams` finished hypotheses under the GNMT length penalty."""
        sequences = generated.sequences
        penalties = torch.tensor(
            [length_penalty(_output_length(row[1:], eos), options.length_penalty, "gnmt") for row in sequences],
            device=sequences.device,
        )
        best = (generated.sequences_scores / penalties).view(sentences, options.num_beams).argmax(dim=1)
        return sequences.view(sentences, options.num_beams, -1)[torch.arange(sentences), best]
