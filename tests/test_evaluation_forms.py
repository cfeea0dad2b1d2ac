"""Scoring and decoding as the papers report them, against hand computations: tokenized BLEU with the En-De compound
split, the fairseq and GNMT length penalties, output caps relative to each source, the Noam and fairseq schedules
inside the Trainer."""

import math

import pytest
import torch
from transformers import LogitsProcessorList, SuppressTokensLogitsProcessor

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.serving.translate import SourceRelativeMaxLength, translate
from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments
from hf_deep_nmt.training.evaluation import corpus_scores, length_penalty, split_compounds, tokenized_bleu
from hf_deep_nmt.training.schedules import noam_lr
from hf_deep_nmt.training.trainer import DeepNMTTrainer

# ---- tokenized BLEU -------------------------------------------------------------------------------------------------

HYPOTHESIS = "Er hat einen Euro-Job."
REFERENCE = "Er hat einen Ein-Euro-Job."


def test_compound_split_follows_the_perl_rule():
    assert split_compounds("Ein-Euro-Job") == "Ein ##AT##-##AT## Euro ##AT##-##AT## Job"
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"  # non-overlapping, like s{(\S)-(\S)}{...}g
    assert split_compounds("a - b, 3-4") == "a - b, 3 ##AT##-##AT## 4"


def test_tokenized_bleu_with_compound_split_matches_a_hand_count():
    # 13a tokens + split: hyp  Er hat einen Euro ##AT##-##AT## Job .          (7 tokens)
    #                     ref  Er hat einen Ein ##AT##-##AT## Euro ##AT##-##AT## Job .  (9 tokens)
    # matches: 1-grams 7/7, 2-grams 5/6 (not "einen Euro"), 3-grams 3/5, 4-grams 1/4 ("Euro ##AT## Job ."),
    # brevity penalty exp(1 - 9/7)
    expected = 100 * math.exp(1 - 9 / 7) * (1 * 5 / 6 * 3 / 5 * 1 / 4) ** 0.25
    scores = tokenized_bleu([HYPOTHESIS], [REFERENCE], tokenize="13a", compound_split=True)
    assert scores["tok_bleu"] == pytest.approx(expected, abs=0.005)
    assert scores["tok_bleu_steps"] == "tok:13a|compound-split:yes|case:mixed"
    # without the split, "Euro-Job" is one token and no 4-gram matches: multi-bleu.perl (no smoothing) gives 0
    assert tokenized_bleu([HYPOTHESIS], [REFERENCE], compound_split=False)["tok_bleu"] == 0.0


def test_tokenized_bleu_case_folding_and_pre_tokenized_input():
    lower = "er hat einen ein-euro-job ."
    assert tokenized_bleu([lower], [REFERENCE], lowercase=True)["tok_bleu"] == 100.0
    assert tokenized_bleu([lower], [REFERENCE])["tok_bleu"] < 100.0
    # tokenize="none" scores the given tokens: "a b c d" vs "a b c e": 3/4, 2/3, 1/2, 0/1 -> 0 without smoothing
    assert tokenized_bleu(["a b c d"], ["a b c e"], tokenize="none")["tok_bleu"] == 0.0
    # "a b c d e" vs "a b c d f": 4/5, 3/4, 2/3, 1/2, brevity penalty 1
    expected = 100 * (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25
    assert tokenized_bleu(["a b c d e"], ["a b c d f"], tokenize="none")["tok_bleu"] == pytest.approx(
        expected, abs=0.005
    )


def test_corpus_scores_add_tokenized_bleu_beside_sacrebleu():
    scores = corpus_scores([HYPOTHESIS], [REFERENCE], {"compound_split": True})
    assert scores["tok_bleu"] == tokenized_bleu([HYPOTHESIS], [REFERENCE], compound_split=True)["tok_bleu"]
    # detokenized sacreBLEU does not split compounds: 1-grams 4/5, 2-grams 2/4, 3-grams 1/3, 4-grams 0/2 with
    # "exp" smoothing 1/2 -> and brevity penalty 1 (5 tokens each)
    assert scores["bleu"] == pytest.approx(100 * (4 / 5 * 2 / 4 * 1 / 3 * 1 / 4) ** 0.25, abs=0.005)


def test_tokenized_bleu_rejects_an_unknown_tokenizer():
    with pytest.raises(ValueError, match=r"`tokenize` must be one of .*got 'moses'"):
        tokenized_bleu(["a"], ["a"], tokenize="moses")


# ---- length penalties -----------------------------------------------------------------------------------------------


def test_length_penalty_forms_match_their_formulas():
    assert length_penalty(7, 0.6, "fairseq") == pytest.approx(7**0.6)
    assert length_penalty(7, 0.6, "gnmt") == pytest.approx(2**0.6)  # ((5 + 7) / 6)^0.6
    assert length_penalty(1, 1.0, "gnmt") == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"one of \('fairseq', 'gnmt'\), got 'wu'"):
        length_penalty(3, 1.0, "wu")


PAIRS = [("el sol sale hoy", "the sun rises today"), ("la mar no se llena", "the sea is not full"), ("hola", "hi")]


@pytest.fixture(scope="module")
def tokenizer():
    return train_joint_tokenizer(PAIRS * 20, vocab_size=120, min_frequency=1)


@pytest.fixture
def model(tokenizer, tiny_config):
    torch.manual_seed(3)
    config = tiny_config(DlclConfig, vocab_size=len(tokenizer), tie_word_embeddings=False)
    model = DlclForConditionalGeneration(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    return model


def test_gnmt_form_picks_the_best_rescored_hypothesis(model, tokenizer):
    sentences = [source for source, _ in PAIRS]
    alpha, beams = 0.6, 4
    got = translate(model, tokenizer, sentences, num_beams=beams, length_penalty=alpha, length_penalty_form="gnmt")
    for sentence, translation in zip(sentences, got):
        batch = tokenizer([sentence], return_tensors="pt")
        limit = int(1.5 * batch["input_ids"].shape[1] + 10)
        with torch.no_grad():
            out = model.generate(
                **batch,
                num_beams=beams,
                num_return_sequences=beams,
                length_penalty=0.0,
                max_new_tokens=limit + 1,
                return_dict_in_generate=True,
                output_scores=True,
                logits_processor=LogitsProcessorList([SourceRelativeMaxLength(torch.tensor([limit]), 2)]),
            )
        rescored = []
        for row, score in zip(out.sequences, out.sequences_scores):
            tokens = row[1:].tolist()
            length = tokens.index(2) + 1 if 2 in tokens else len(tokens)
            rescored.append(float(score) / ((5 + length) / 6) ** alpha)
        best = out.sequences[max(range(beams), key=rescored.__getitem__)]
        assert translation == tokenizer.decode(best, skip_special_tokens=True).strip()


# ---- output caps relative to the source -----------------------------------------------------------------------------


def test_each_sentence_is_capped_at_a_times_its_own_length_plus_b(model):
    source = torch.tensor([[5, 9, 2, 1, 1, 1, 1], [7, 11, 12, 13, 14, 15, 2]])
    mask = source.ne(1).long()
    limits = (1.0 * mask.sum(1) + 2).long()  # 3 + 2 and 7 + 2 tokens
    # </s> suppressed before the cap, so every output runs to its own cap
    never_eos = SuppressTokensLogitsProcessor([2], device="cpu")
    for beams in (1, 3):
        out = model.generate(
            input_ids=source,
            attention_mask=mask,
            num_beams=beams,
            max_new_tokens=int(limits.max()) + 1,
            logits_processor=LogitsProcessorList([never_eos, SourceRelativeMaxLength(limits, eos_token_id=2)]),
        )
        generated = out[:, 1:].tolist()
        assert [row.index(2) for row in generated] == [5, 9]  # 5 and 9 tokens, then </s>


def test_translation_does_not_depend_on_the_batch(model, tokenizer):
    sentences = [source for source, _ in PAIRS] * 2
    together = translate(model, tokenizer, sentences, num_beams=2, max_tokens=40, max_length_a=1.0, max_length_b=3)
    alone = [translate(model, tokenizer, [s], num_beams=2, max_length_a=1.0, max_length_b=3)[0] for s in sentences]
    assert together == alone
    assert translate(model, tokenizer, ["", "hola", "  "], num_beams=1)[::2] == ["", ""]  # empty lines stay empty


# ---- schedules inside the Trainer -----------------------------------------------------------------------------------


def test_noam_matches_hand_values():
    # d 512, warm-up 4000 (DS-Init base): peak at update 4000 = 512^-0.5 * 4000^-0.5 = 6.9877e-4
    assert noam_lr(3999, 512, 4000) == pytest.approx(6.98771e-4, rel=1e-5)
    assert noam_lr(0, 512, 4000) == pytest.approx(512**-0.5 * 4000**-1.5)
    assert noam_lr(15999, 512, 4000) == pytest.approx(6.98771e-4 / 2, rel=1e-5)  # 4x the warm-up: half the peak
    with pytest.raises(ValueError, match=r"`warmup_steps` must be >= 1, got 0"):
        noam_lr(1, 512, 0)


def used_rates(trainer: DeepNMTTrainer, steps: int) -> list[float]:
    trainer.create_optimizer_and_scheduler(num_training_steps=100)
    rates = []
    for _ in range(steps):
        rates.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", ["noam", "inverse_sqrt"])
def test_trainer_uses_the_configured_schedule(schedule, model, tmp_path):
    # d_model 16, warm-up 4 -> Noam: 1/4 * min(n^-0.5, n / 8): n=1 1/32, n=4 1/8, n=16 1/16
    # fairseq: 1e-7 + step * (2e-3 - 1e-7) / 4 during warm-up, then 2e-3 * sqrt(4 / step)
    learning_rate = 1.0 if schedule == "noam" else 2e-3
    args = DeepNMTTrainingArguments(
        output_dir=str(tmp_path), lr_schedule=schedule, learning_rate=learning_rate, warmup_steps=4, use_cpu=True
    )
    rates = used_rates(DeepNMTTrainer(model=model, args=args), 17)
    if schedule == "noam":
        assert rates[0] == pytest.approx(1 / 32) and rates[3] == pytest.approx(1 / 8)
        assert rates[15] == pytest.approx(1 / 16)
    else:
        assert rates[0] == pytest.approx(1e-7) and rates[2] == pytest.approx(1e-7 + 2 * (2e-3 - 1e-7) / 4)
        assert rates[4] == pytest.approx(2e-3) and rates[16] == pytest.approx(1e-3)


def test_unknown_schedule_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"`lr_schedule` must be one of .*got 'cosine_noam'"):
        DeepNMTTrainingArguments(output_dir=str(tmp_path), lr_schedule="cosine_noam")
