"""BLEU and chrF as the papers report them, through `sacrebleu` (detokenized, with the metric signature)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import sacrebleu
from transformers import EvalPrediction, PreTrainedTokenizerBase


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float | str]:
    """Detokenized corpus sacreBLEU (13a, mixed case) and chrF, with their signatures."""
    if len(hypotheses) != len(references):
        raise ValueError(f"Got {len(hypotheses)} hypotheses for {len(references)} references; they must pair up.")
    bleu_metric, chrf_metric = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    bleu = bleu_metric.corpus_score(list(hypotheses), [list(references)])
    chrf = chrf_metric.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": round(bleu.score, 2),
        "chrf": round(chrf.score, 2),
        "bleu_signature": str(bleu_metric.get_signature()),
        "chrf_signature": str(chrf_metric.get_signature()),
    }


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
