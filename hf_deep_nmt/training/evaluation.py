"""BLEU and chrF as the papers report them, through `sacrebleu`.

* Detokenized sacreBLEU (13a, mixed case) with its signature, and chrF: `corpus_scores`.
* Tokenized BLEU, what `multi-bleu.perl` reports on tokenized text: `tokenized_bleu` tokenizes with one of
  sacreBLEU's tokenizers, optionally splits hyphenated compounds the way the En-De papers do (`a-b` ->
  `a ##AT##-##AT## b`, the `get_ende_bleu.sh` / `compound_split_bleu.sh` rule), lowercases when asked, and scores
  the tokens with `tokenize="none"` and no smoothing (multi-bleu.perl does not smooth).
* Length penalties of beam search, in the two forms the papers use: fairseq/transformers (`score / |Y|^alpha`,
  DLCL, SDT) and GNMT (`score / ((5 + |Y|) / 6)^alpha`, DS-Init, MSC): `length_penalty`, defined with the
  decoding options (`hf_deep_nmt.serving.options`) that choose the form, and importable from here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np
import sacrebleu
from transformers import EvalPrediction, PreTrainedTokenizerBase

from hf_deep_nmt.serving.options import length_penalty  # noqa: F401  (decoding applies it; stated here too)


def corpus_scores(
    hypotheses: Sequence[str],
    references: Sequence[str],
    tokenized_bleu_options: dict | None = None,
) -> dict[str, float | str]:
    """Detokenized corpus sacreBLEU (13a, mixed case) and chrF, with their signatures; with
    `tokenized_bleu_options` (keyword arguments of `tokenized_bleu`), the tokenized BLEU as well."""
    if len(hypotheses) != len(references):
        raise ValueError(f"Got {len(hypotheses)} hypotheses for {len(references)} references; they must pair up.")
    bleu_metric, chrf_metric = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu = bleu_metric.corpus_score(list(hypotheses), [list(references)])
    chrf = chrf_metric.corpus_score(list(hypotheses), [list(references)])
    scores = {
        "bleu": round(bleu.score, 2),
        "chrf": round(chrf.score, 2),
        "bleu_signature": str(bleu_metric.get_signature()),
        "chrf_signature": str(chrf_metric.get_signature()),
    }
    if tokenized_bleu_options is not None:
        scores.update(tokenized_bleu(hypotheses, references, **tokenized_bleu_options))
    return scores


_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(text: str) -> str:
    """`Ein-Euro-Job` -> `Ein ##AT##-##AT## Euro ##AT##-##AT## Job`, applied as Perl's
    `s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g` (non-overlapping
    matches, so `a-b-c` keeps its second hyphen, exactly as the papers' Perl one-liner does)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def tokenized_bleu(
    hypotheses: Sequence[str],
    references: Sequence[str],
    tokenize: str = "13a",
    compound_split: bool = False,
    lowercase: bool = False,
) -> dict[str, float | str]:
    """Corpus BLEU on tokenized text, as `multi-bleu.perl` reports it.

    `tokenize` is any sacreBLEU tokenizer name (`13a`, `intl`, `none` for text that is already tokenized, ...);
    `compound_split` applies the En-De `##AT##-##AT##` rule after tokenizing; `lowercase` gives the case-insensitive
    score (IWSLT). Returns the score and a description of the steps taken.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"Got {len(hypotheses)} hypotheses for {len(references)} references; they must pair up.")
    if tokenize not in sacrebleu.metrics.BLEU.TOKENIZERS:
        raise ValueError(f"`tokenize` must be one of {sorted(sacrebleu.metrics.BLEU.TOKENIZERS)}, got {tokenize!r}.")
    tokenizer = sacrebleu.metrics.BLEU(tokenize=tokenize).tokenizer

    def prepare(text: str) -> str:
        text = tokenizer(text.rstrip())
        text = split_compounds(text) if compound_split else text
        return text.lower() if lowercase else text

    bleu = sacrebleu.metrics.BLEU(tokenize="none", smooth_method="none", force=True)
    score = bleu.corpus_score([prepare(h) for h in hypotheses], [[prepare(r) for r in references]])
    steps = f"tok:{tokenize}|compound-split:{'yes' if compound_split else 'no'}|case:{'lc' if lowercase else 'mixed'}"
    return {"tok_bleu": round(score.score, 2), "tok_bleu_steps": steps}


def decode_predictions(predictions: np.ndarray, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Token ids from `generate()` (padded with -100 by the Trainer across batches) -> text."""
    predictions = np.where(predictions < 0, tokenizer.pad_token_id, predictions)
    return [text.strip() for text in tokenizer.batch_decode(predictions, skip_special_tokens=True)]


def make_compute_metrics(
    tokenizer: PreTrainedTokenizerBase, references: Sequence[str]
) -> Callable[[EvalPrediction], dict[str, float]]:
    """`compute_metrics` for `Seq2SeqTrainer(predict_with_generate=True)` scoring against the raw reference text.

    Under distributed evaluation the Trainer pads the last batch with repeated samples: predictions beyond
    `len(references)` are dropped.
    """

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        predictions = (
            prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        )
        hypotheses = decode_predictions(np.asarray(predictions), tokenizer)[: len(references)]
        if len(hypotheses) < len(references):
            raise ValueError(f"Got {len(hypotheses)} predictions for {len(references)} evaluation references.")
        scores = corpus_scores(hypotheses, references)
        return {"bleu": scores["bleu"], "chrf": scores["chrf"]}

    return compute_metrics
