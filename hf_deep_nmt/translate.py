"""Batch translation through `generate()` (the transformers translation pipeline no longer exists).

Written here, over `generate()`: batches formed by a token budget (`hf_deep_nmt.batching`), an output cap relative to
each sentence's own source length (fairseq's `--max-len-a/b`, as a logits processor, so a sentence's translation
does not depend on the batch it lands in), the GNMT length penalty (by rescoring the final beam), input order kept,
empty lines passed through, a progress bar.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from hf_deep_nmt.batching import token_batches
from hf_deep_nmt.evaluation import LENGTH_PENALTY_FORMS
from hf_deep_nmt.evaluation import length_penalty as penalty_divisor
from hf_deep_nmt.input_checks import check_tokenizer_matches


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


def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    batch_size: int = 32,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    max_length_a: float = 1.5,
    max_length_b: int = 10,
    max_tokens: int | None = None,
    length_penalty_form: str = "fairseq",
    progress: bool = False,
) -> list[str]:
    """Translate `sentences`; output order follows the input, an empty line gives an empty line.

    Batches hold sentences of similar length: at most `batch_size` sentences and, with `max_tokens`, at most that
    many padded source tokens. Each sentence may produce at most `max_length_a * source_tokens + max_length_b`
    tokens before `</s>` (source tokens counting its `</s>`), so long inputs are never cut at the 20-token default
    of `generate()`. `length_penalty_form="fairseq"` divides a hypothesis' log-probability by `|Y|^alpha`
    (what `generate()` does); `"gnmt"` by `((5 + |Y|) / 6)^alpha`, applied by rescoring the `num_beams` finished
    hypotheses that beam search (run without a penalty) returns.
    A tokenizer whose vocabulary or padding / end ids do not match the model is refused (`ValueError`).
    """
    if isinstance(sentences, str) or not all(isinstance(sentence, str) for sentence in sentences):
        raise TypeError("`sentences` must be a list of strings.")
    if batch_size < 1 or num_beams < 1:
        raise ValueError(f"`batch_size` and `num_beams` must be >= 1, got {batch_size} and {num_beams}.")
    if length_penalty_form not in LENGTH_PENALTY_FORMS:
        raise ValueError(f"`length_penalty_form` must be one of {LENGTH_PENALTY_FORMS}, got {length_penalty_form!r}.")
    if max_length_a < 0 or max_length_b < 0 or (max_length_a == 0 and max_length_b < 1):
        raise ValueError(
            "The output cap `max_length_a * source_length + max_length_b` must allow >= 1 token; got "
            f"a={max_length_a}, b={max_length_b}."
        )
    check_tokenizer_matches(model, tokenizer)
    outputs: list[str] = [""] * len(sentences)
    wanted = [index for index, sentence in enumerate(sentences) if sentence.strip()]
    encoded = {index: tokenizer(sentences[index])["input_ids"] for index in wanted}
    lengths = [len(encoded[index]) for index in wanted]
    # No token budget: `batch_size` sentences a batch. A sentence longer than the budget is translated on its own.
    budget = max(max_tokens or batch_size * max(lengths, default=1), max(lengths, default=1))
    groups = token_batches(lengths, budget, max_sentences=batch_size) if wanted else []
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    gnmt = length_penalty_form == "gnmt" and num_beams > 1
    model.eval()
    device = next(model.parameters()).device
    bar = tqdm(total=len(sentences), desc="Translating", unit="sent", disable=not progress, file=sys.stderr)
    bar.update(len(sentences) - len(wanted))
    for group in groups:
        indices = [wanted[position] for position in group]
        batch = tokenizer.pad({"input_ids": [encoded[index] for index in indices]}, return_tensors="pt").to(device)
        source_lengths = batch["attention_mask"].sum(dim=1)
        limits = (max_length_a * source_lengths + max_length_b).long().clamp(min=1)
        with torch.inference_mode():
            generated = model.generate(
                **batch,
                num_beams=num_beams,
                num_return_sequences=num_beams if gnmt else 1,
                length_penalty=0.0 if gnmt else length_penalty,
                max_new_tokens=int(limits.max()) + 1,
                logits_processor=LogitsProcessorList([SourceRelativeMaxLength(limits, eos)]),
                do_sample=False,
                return_dict_in_generate=True,
                output_scores=gnmt,
            )
        sequences = generated.sequences
        if gnmt:
            penalties = torch.tensor(
                [penalty_divisor(_output_length(row[1:], eos), length_penalty, "gnmt") for row in sequences],
                device=sequences.device,
            )
            best = (generated.sequences_scores / penalties).view(len(indices), num_beams).argmax(dim=1)
            sequences = sequences.view(len(indices), num_beams, -1)[torch.arange(len(indices)), best]
        for index, text in zip(indices, tokenizer.batch_decode(sequences, skip_special_tokens=True)):
            outputs[index] = text.strip()
        bar.update(len(indices))
    bar.close()
    return outputs


def translate_file(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    source: str | Path = "-",
    target: str | Path = "-",
    **options,
) -> int:
    """Translate a text file (`-`: stdin), one sentence per line, into `target` (`-`: stdout), line for line.
    Returns the number of lines. `options` are those of `translate`."""
    if str(source) == "-":
        lines = sys.stdin.read().splitlines()
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"Input file not found: {path}")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: not valid UTF-8 ({error.reason} at byte {error.start}).") from None
    translations = translate(model, tokenizer, lines, **options)
    text = "".join(line + "\n" for line in translations)
    if str(target) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(target).write_text(text, encoding="utf-8")
    return len(lines)
