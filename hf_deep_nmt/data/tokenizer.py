"""Joint source/target subword tokenizer trained with `tokenizers`, wrapped as a `PreTrainedTokenizerFast`.

The special tokens take ids 0-3 in the order the model configs expect: `<s>`=0, `<pad>`=1, `</s>`=2, `<unk>`=3.
Every encoded sequence ends with `</s>`; the decoder starts from `<s>` (the config's `decoder_start_token_id`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
SUBWORD_MODELS = ("bpe", "unigram")


def _interleave(pairs: Iterable[tuple[str, str]]) -> Iterator[str]:
    for source, target in pairs:
        yield source
        yield target


# The sizes of a vocabulary `train_joint_tokenizer` trains: room for the special tokens, and at most a million tokens
# (four times the largest multilingual vocabularies; far larger sizes abort inside the tokenizers library).
MIN_VOCAB_SIZE = 16
MAX_VOCAB_SIZE = 1_000_000


def train_joint_tokenizer(
    pairs: Iterable[tuple[str, str]],
    vocab_size: int = 8000,
    model: str = "bpe",
    min_frequency: int = 2,
    model_max_length: int = 1024,
) -> PreTrainedTokenizerFast:
    """Train one subword vocabulary on both sides of `pairs` (the shared vocabulary of the papers' En-De systems)."""
    if model not in SUBWORD_MODELS:
        raise ValueError(f"`model` must be one of {SUBWORD_MODELS}, got {model!r}.")
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"`vocab_size` must be between {MIN_VOCAB_SIZE} and {MAX_VOCAB_SIZE:,}, got {vocab_size!r}.")
    specials = list(SPECIAL_TOKENS.values())
    if model == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    else:
        tokenizer = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            unk_token=SPECIAL_TOKENS["unk_token"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    tokenizer.normalizer = normalizers.NFKC()
    # Byte-level pieces: any input text, whatever its script or punctuation, has a spelling without `<unk>`.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)])
    tokenizer.train_from_iterator(_interleave(pairs), trainer=trainer)
    for token, expected in zip(specials, range(len(specials))):
        if tokenizer.token_to_id(token) != expected:
            raise RuntimeError(f"special token {token!r} got id {tokenizer.token_to_id(token)}, expected {expected}")
    eos = SPECIAL_TOKENS["eos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, tokenizer.token_to_id(eos))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length, **SPECIAL_TOKENS)
