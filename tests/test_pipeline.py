"""Tokenizer, data loading, Seq2SeqTrainer training/evaluation and translation on the bundled sample corpus."""

import json
import logging

import numpy as np
import pytest
import sacrebleu
import torch
from transformers import (
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    EvalPrediction,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

from hf_deep_nmt import DlclConfig, DlclForConditionalGeneration
from hf_deep_nmt.data import preparation
from hf_deep_nmt.data.corpus import (
    load_parallel_dataset,
    read_jsonl,
    read_parallel_file,
    read_tsv,
    read_two_files,
    sample_corpus_dir,
    tokenize_parallel,
)
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.serving.translate import translate
from hf_deep_nmt.training.arguments import parse_arguments
from hf_deep_nmt.training.evaluation import corpus_scores, decode_predictions, make_compute_metrics
from hf_deep_nmt.training.pipeline import build_model


@pytest.fixture(scope="module")
def sample():
    return load_parallel_dataset(
        train_file=sample_corpus_dir() / "train.tsv", validation_file=sample_corpus_dir() / "valid.tsv"
    )


@pytest.fixture(scope="module")
def tokenizer(sample):
    train = sample["train"].select(range(1500))
    return train_joint_tokenizer(zip(train["source"], train["target"]), vocab_size=400)


def tiny_model(tokenizer, **overrides):
    torch.manual_seed(0)
    settings = dict(
        vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=3,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=48,
        decoder_ffn_dim=40,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    settings.update(overrides)
    return DlclForConditionalGeneration(DlclConfig(**settings))


# ---- bundled corpus -------------------------------------------------------------------------------------------------


def test_sample_corpus_is_bundled_with_its_licence(sample):
    folder = sample_corpus_dir()
    assert len(sample["train"]) == 8000 and len(sample["validation"]) == 300
    assert (folder / "COPYRIGHT.sword-text-web").is_file() and (folder / "COPYRIGHT.sword-text-sparv").is_file()
    assert "public domain" in (folder / "README.md").read_text().lower()
    # validation verses come from held-out books: no verse appears on both sides
    assert not set(sample["validation"]["source"]) & set(sample["train"]["source"])


# ---- tokenizer ------------------------------------------------------------------------------------------------------


def test_tokenizer_special_ids_match_the_model_defaults(tokenizer):
    config = DlclConfig()
    assert tokenizer.convert_tokens_to_ids(["<s>", "<pad>", "</s>", "<unk>"]) == [0, 1, 2, 3]
    assert (tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id) == (
        config.bos_token_id,
        config.pad_token_id,
        config.eos_token_id,
    )


def test_tokenizer_text_target_gives_labels_ending_in_eos(tokenizer):
    batch = tokenizer(["Y dijo Dios."], text_target=["God said, “Let there be light.”"])
    assert batch["input_ids"][0][-1] == tokenizer.eos_token_id
    assert batch["labels"][0][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(batch["labels"][0], skip_special_tokens=True) == "God said, “Let there be light.”"


def test_tokenizer_never_produces_unknown_for_unseen_characters(tokenizer):
    text = 'Straight "quotes", ß, ñ and 日本'
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_reloads_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["¿Qué provecho tiene el hombre?", "The sun also rises."]
    assert reloaded(texts)["input_ids"] == tokenizer(texts)["input_ids"]
    assert reloaded.pad_token_id == 1 and reloaded.eos_token_id == 2 and len(reloaded) == len(tokenizer)


def test_tokenizer_rejects_unknown_subword_model():
    with pytest.raises(ValueError, match=r"`model` must be one of .*got 'wordpiece'"):
        train_joint_tokenizer([("a", "b")], model="wordpiece")


# ---- data loading errors name the file and line ---------------------------------------------------------------------


def test_tsv_with_a_ragged_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("hola\thello\nsolo una columna\nadiós\tbye\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.tsv:2: expected 2 tab-separated fields .* got 1"):
        read_tsv(path)


def test_tsv_with_an_empty_side_names_file_line_and_side(tmp_path):
    path = tmp_path / "empty.tsv"
    path.write_text("hola\thello\nadiós\t \n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty\.tsv:2: empty target side"):
        read_tsv(path)


def test_invalid_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.tsv"
    path.write_bytes(b"hola\thello\n" + "adiós\tbye\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.tsv:2: not valid UTF-8"):
        read_tsv(path)


def test_two_files_with_different_line_counts_are_rejected(tmp_path):
    (tmp_path / "corpus.es").write_text("uno\ndos\ntres\n", encoding="utf-8")
    (tmp_path / "corpus.en").write_text("one\ntwo\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"corpus\.es has 3 lines but .*corpus\.en has 2"):
        read_parallel_file(tmp_path / "corpus", "es", "en")
    (tmp_path / "corpus.en").write_text("one\ntwo\nthree\n", encoding="utf-8")
    assert read_two_files(tmp_path / "corpus.es", tmp_path / "corpus.en")["target"] == ["one", "two", "three"]


def test_jsonl_reads_flat_and_translation_records_and_rejects_missing_fields(tmp_path):
    path = tmp_path / "pairs.jsonl"
    records = [{"es": "uno", "en": "one"}, {"translation": {"es": "dos", "en": "two"}}]
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n", encoding="utf-8")
    assert read_jsonl(path, "es", "en") == {"source": ["uno", "dos"], "target": ["one", "two"]}
    path.write_text(json.dumps({"es": "tres"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"pairs\.jsonl:1: expected string fields 'es' and 'en'"):
        read_jsonl(path, "es", "en")


def test_missing_corpus_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.tsv"):
        read_tsv(tmp_path / "nowhere.tsv")


def test_length_filter_drops_long_pairs_and_logs_the_count(tokenizer, caplog):
    from datasets import Dataset

    dataset = Dataset.from_dict({"source": ["uno", "uno dos " * 30, "tres"], "target": ["one", "two", "three " * 30]})
    with caplog.at_level(logging.WARNING):
        kept = tokenize_parallel(dataset, tokenizer, max_source_length=10, max_target_length=10)
    assert len(kept) == 1
    assert tokenizer.decode(kept[0]["labels"], skip_special_tokens=True) == "one"
    assert "Dropped 2 of 3 pairs" in caplog.text
    truncated = tokenize_parallel(dataset, tokenizer, max_source_length=10, max_target_length=7, drop_long=False)
    assert len(truncated) == 3 and max(len(row["labels"]) for row in truncated) == 7


# ---- metrics --------------------------------------------------------------------------------------------------------


def test_corpus_bleu_matches_a_hand_computation():
    # hypothesis "a b c X e" vs reference "a b c d e": precisions 4/5, 2/4, 1/3 and 0/2, which sacreBLEU's "exp"
    # smoothing turns into 1/(2*2); brevity penalty 1.
    expected = 100 * (0.8 * 0.5 * (1 / 3) * 0.25) ** 0.25
    scores = corpus_scores(["a b c X e"], ["a b c d e"])
    assert scores["bleu"] == pytest.approx(expected, abs=0.01)
    assert corpus_scores(["the sun also rises today"], ["the sun also rises today"])["bleu"] == 100.0
    assert scores["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")


def test_corpus_scores_refuse_unpaired_lists():
    with pytest.raises(ValueError, match="2 hypotheses for 1 references"):
        corpus_scores(["a", "b"], ["a"])


def test_decode_predictions_treats_minus_100_as_padding(tokenizer):
    ids = tokenizer("The sun also rises.")["input_ids"]
    padded = np.array([[0, *ids, -100, -100], [0, *ids, 1, -100]])
    assert decode_predictions(padded, tokenizer) == ["The sun also rises."] * 2


def test_compute_metrics_drops_distributed_padding_samples(tokenizer):
    references = ["The sun also rises.", "All the rivers run into the sea."]
    rows = [tokenizer(text)["input_ids"] for text in references + [references[0]]]  # 3rd = DDP duplicate
    width = max(map(len, rows))
    predictions = np.array([row + [-100] * (width - len(row)) for row in rows])
    metrics = make_compute_metrics(tokenizer, references)(EvalPrediction(predictions=predictions, label_ids=None))
    assert metrics["bleu"] == 100.0


# ---- training and evaluation through Seq2SeqTrainer -----------------------------------------------------------------


def _held_out_loss(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).loss.item()


def test_trainer_steps_on_the_sample_lower_the_loss(sample, tokenizer, tmp_path):
    train = tokenize_parallel(sample["train"].select(range(256)), tokenizer, 48, 48)
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    probe = collator([train[i] for i in range(32)])
    model = tiny_model(tokenizer)
    before = _held_out_loss(model, probe)
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=40,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        warmup_steps=5,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )
    Seq2SeqTrainer(model=model, args=args, train_dataset=train, data_collator=collator).train()
    after = _held_out_loss(model, probe)
    assert after < before - 1.0, (before, after)


def test_evaluation_with_generate_scores_sacrebleu_beyond_20_tokens(sample, tokenizer, tmp_path):
    validation = sample["validation"].select(range(10))
    eval_dataset = tokenize_parallel(validation, tokenizer, 64, 64, drop_long=False)
    model = tiny_model(tokenizer)
    model.generation_config.max_new_tokens = 30
    model.generation_config.max_length = None
    model.generation_config.num_beams = 2
    # An untrained model never chooses </s>, so every output runs to the length limit.
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = -model.lm_head.weight[tokenizer.eos_token_id].abs()
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=3,  # uneven batches: the Trainer pads predictions/labels with -100
        predict_with_generate=True,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Seq2SeqTrainer(
        model=model,
        args=args,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
        compute_metrics=make_compute_metrics(tokenizer, validation["target"]),
    )
    metrics = trainer.evaluate()
    assert "eval_bleu" in metrics and "eval_chrf" in metrics
    predictions = trainer.predict(eval_dataset).predictions
    assert predictions.shape == (10, 31)  # start token + 30 new tokens, not the 20-token default
    hypotheses = decode_predictions(predictions, tokenizer)
    expected = sacrebleu.corpus_bleu(hypotheses, [validation["target"]]).score
    assert metrics["eval_bleu"] == pytest.approx(expected, abs=0.01)


def test_translate_keeps_input_order_and_matches_one_by_one_decoding(sample, tokenizer):
    # An untied output layer: a tied untrained model just repeats its last input token whatever the source.
    model = tiny_model(tokenizer, tie_word_embeddings=False)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
        model.lm_head.weight[:4] = 0.0  # special tokens score 0, below the best word: every output has words
        for layer in model.model.decoder.layers:
            # sharp cross-attention that lands on particular source words, so the source decides the output
            layer.encoder_attn.q_proj.weight.mul_(30.0)
            layer.encoder_attn.out_proj.weight.mul_(20.0)
    sentences = sample["validation"]["source"][:6]
    together = translate(model, tokenizer, sentences, batch_size=4, num_beams=1, max_length_a=0.0, max_length_b=12)
    alone = [translate(model, tokenizer, [s], num_beams=1, max_length_a=0.0, max_length_b=12)[0] for s in sentences]
    assert together == alone
    assert len(set(together)) > 1  # outputs differ, so a shuffled order would be caught


def test_translate_rejects_a_bare_string(tokenizer):
    with pytest.raises(TypeError, match="list of strings"):
        translate(tiny_model(tokenizer), tokenizer, "hola")


# ---- recipe arguments -----------------------------------------------------------------------------------------------


def test_recipe_config_with_unknown_key_is_rejected(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "num_train_epoch": 3}))
    with pytest.raises(ValueError, match=r"unknown keys \['num_train_epoch'\]"):
        parse_arguments([str(path)])


def test_command_line_flags_override_the_recipe_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(
        json.dumps({"output_dir": str(tmp_path), "num_train_epochs": 3, "model_overrides": {"d_model": 64}})
    )
    model_args, data_args, export_args, training_args = parse_arguments([str(path), "--num_train_epochs", "7"])
    assert training_args.num_train_epochs == 7
    assert model_args.model_overrides == {"d_model": 64}


def test_missing_recipe_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.json"):
        parse_arguments([str(tmp_path / "absent.json")])


def test_the_bundled_sample_recipe_parses(tmp_path):
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "sample.json"
    model_args, _, export_args, training_args = parse_arguments([str(recipe), "--output_dir", str(tmp_path)])
    assert model_args.model_type == "deep_nmt_dlcl" and training_args.max_tokens == 2048
    assert export_args.export_dir


def test_build_model_sizes_the_vocabulary_from_the_tokenizer_and_checks_overrides(tokenizer):
    from hf_deep_nmt.training.arguments import ModelArguments

    model = build_model(
        ModelArguments(
            model_overrides={
                "d_model": 16,
                "encoder_layers": 2,
                "decoder_layers": 1,
                "encoder_attention_heads": 2,
                "decoder_attention_heads": 2,
                "encoder_ffn_dim": 8,
                "decoder_ffn_dim": 8,
            }
        ),
        tokenizer,
    )
    assert model.config.vocab_size == len(tokenizer) and model.config.model_type == "deep_nmt_dlcl"
    with pytest.raises(ValueError, match=r"model_overrides.vocab_size=99.*disagrees"):
        build_model(ModelArguments(model_overrides={"vocab_size": 99}), tokenizer)
    with pytest.raises(ValueError, match=r"`model_type` must be one of .*got 'dlcl'"):
        build_model(ModelArguments(model_type="dlcl"), tokenizer)


def test_a_non_empty_export_folder_is_refused_before_training(tmp_path, monkeypatch):
    from hf_deep_nmt.training import pipeline as training

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "keep.txt").write_text("user data")
    config = tmp_path / "run.json"
    recipe = {"model_type": "deep_nmt", "output_dir": str(tmp_path / "run"), "export_dir": str(tmp_path / "export")}
    config.write_text(json.dumps(recipe))
    monkeypatch.setattr(preparation, "prepare_data", lambda *args, **kwargs: pytest.fail("data loaded before check"))
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        training.run([str(config)])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["export", "run.json"]
    assert [path.name for path in (tmp_path / "export").iterdir()] == ["keep.txt"]
    assert (tmp_path / "export" / "keep.txt").read_text() == "user data"


def test_overrides_of_a_saved_model_must_be_its_own_values(tokenizer, tmp_path):
    from hf_deep_nmt.training.arguments import ModelArguments

    tiny_model(tokenizer).save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")  # a saved model is used with the tokenizer saved there
    saved = str(tmp_path / "saved")
    with pytest.raises(ValueError, match=r"`model_overrides.d_model` is 8 but the saved model has 32"):
        build_model(ModelArguments(model_name_or_path=saved, model_overrides={"d_model": 8}), tokenizer)
    with pytest.raises(ValueError, match=r"`model_type` is 'deep_nmt_sdt' but the saved model's is 'deep_nmt_dlcl'"):
        build_model(ModelArguments(model_name_or_path=saved, model_type="deep_nmt_sdt"), tokenizer)
    same = ModelArguments(model_name_or_path=saved, model_type="deep_nmt_dlcl", model_overrides={"d_model": 32})
    assert build_model(same, tokenizer).config.d_model == 32


def test_cli_reports_a_refused_export_as_one_line_with_status_2(tmp_path, capsys):
    from hf_deep_nmt.cli import main

    export = tmp_path / "export"
    export.mkdir()
    (export / "weights.safetensors").write_text("user data")
    config = tmp_path / "run.json"
    recipe = {"model_type": "deep_nmt", "output_dir": str(tmp_path / "run"), "export_dir": str(export)}
    config.write_text(json.dumps(recipe))
    assert main(["train", str(config)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-deep-nmt train: error: Export folder") and "--overwrite-export true" in error
    assert (export / "weights.safetensors").read_text() == "user data"
    assert main(["translate-all"]) == 2


def test_multi_process_launch_without_gpu_defaults_to_use_cpu(monkeypatch):
    from hf_deep_nmt.training import arguments

    monkeypatch.setattr(arguments.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert arguments.multi_process_launch_without_gpu()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not arguments.multi_process_launch_without_gpu()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(arguments.torch.cuda, "is_available", lambda: True)
    assert not arguments.multi_process_launch_without_gpu()


def test_checks_and_preparation_leave_the_arguments_as_given(tmp_path):
    from hf_deep_nmt.training.pipeline import check_before_work, prepare
    from hf_deep_nmt.training.run_folder import run_recipe

    recipe = tmp_path / "recipe.json"
    settings = {"model_type": "deep_nmt", "tokenizer_vocab_size": 300, "max_eval_samples": 3}
    recipe.write_text(json.dumps({**settings, "output_dir": str(tmp_path / "run")}))
    model_args, data_args, export_args, training_args = arguments = parse_arguments([str(recipe)])
    given = run_recipe(*arguments)
    check_before_work(model_args, data_args, export_args, training_args)
    prepared = prepare(model_args, data_args, training_args)
    assert run_recipe(*arguments) == given and data_args.train_file is None  # the bundled sample was read
    assert prepared.train_pairs == 8000 and len(prepared.references) == 3


def test_a_misspelt_override_is_refused_before_the_corpus_is_read(tmp_path, monkeypatch):
    from hf_deep_nmt.training import pipeline as training

    recipe = tmp_path / "recipe.json"
    settings = {"model_type": "deep_nmt", "model_overrides": {"dropuot": 0.2}, "output_dir": str(tmp_path / "run")}
    recipe.write_text(json.dumps(settings))
    monkeypatch.setattr(preparation, "prepare_data", lambda *args, **kwargs: pytest.fail("data loaded before check"))
    with pytest.raises(ValueError, match=r"not DeepNMTConfig fields: 'dropuot' \(did you mean 'dropout'\?\)"):
        training.run([str(recipe)])
