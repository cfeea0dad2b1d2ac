"""Batch translation through `generate()` (the transformers translation pipeline no longer exists)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_deep_nmt.input_checks import check_tokenizer_matches


def translate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    sentences: Sequence[str],
    batch_size: int = 32,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    max_length_a: float = 1.5,
    max_length_b: int = 10,
) -> list[str]:
    """Translate `sentences`, batched by length; output order follows the input.

    Each batch may generate at most `max_length_a * longest_source + max_length_b` tokens, so long inputs are never cut
    at the 20-token default of `generate()`. An empty or blank sentence gives the empty string. A tokenizer whose
    vocabulary or padding / end ids do not match the model is refused (`ValueError`).
    """
    if isinstance(sentences, str) or not all(isinstance(sentence, str) for sentence in sentences):
        raise TypeError("`sentences` must be a list of strings.")
    if batch_size < 1 or num_beams < 1:
        raise ValueError(f"`batch_size` and `num_beams` must be >= 1, got {batch_size} and {num_beams}.")
    check_tokenizer_matches(model, tokenizer)
    encoded = [tokenizer(sentence)["input_ids"] for sentence in sentences]
    # an empty (or blank) source is translated as the empty string, without running the model
    order = sorted((i for i in range(len(encoded)) if sentences[i].strip()), key=lambda index: len(encoded[index]))
    outputs: list[str] = [""] * len(encoded)
    model.eval()
    device = next(model.parameters()).device
    for start in range(0, len(order), batch_size):
        indices = order[start : start + batch_size]
        batch = tokenizer.pad({"input_ids": [encoded[index] for index in indices]}, return_tensors="pt").to(device)
        longest = batch["input_ids"].shape[1]
        with torch.inference_mode():
            generated = model.generate(
                **batch,
                num_beams=num_beams,
                length_penalty=length_penalty,
                max_new_tokens=int(max_length_a * longest + max_length_b),
                do_sample=False,
            )
        for index, text in zip(indices, tokenizer.batch_decode(generated, skip_special_tokens=True)):
            outputs[index] = text.strip()
    return outputs
