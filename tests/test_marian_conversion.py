"""`convert_marian` / `hf-deep-nmt convert-marian`: tiny random MarianMTModels (shared and separate vocabularies, tied
and untied output layers, swish and relu, a non-zero `final_logits_bias`) convert to models of this package that give
the same logits (fp32, within 1e-5) and the same greedy and 4-beam outputs, cached and uncached, before and after
saving (package and remote code); what cannot be converted is refused by name before anything is written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import package_free_environment
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    BartConfig,
    BartForConditionalGeneration,
    GenerationConfig,
    MarianConfig,
    MarianMTModel,
    PreTrainedTokenizerFast,
)

from hf_deep_nmt import DeepNMTForConditionalGeneration
from hf_deep_nmt.cli import main
from hf_deep_nmt.serving.translate import translate
from hf_deep_nmt.tools.marian import convert_marian, convert_marian_model

WORDS = ["</s>", "<unk>"] + [f"w{index}" for index in range(2, 59)] + ["<pad>"]  # Marian's layout: pad is the last id
PAD = len(WORDS) - 1
EOS = 0
SOURCE_VOCAB = len(WORDS)
TARGET_VOCAB = 47  # separate vocabularies: a smaller target side, pad again its last id
NEW_TOKENS = 10

# (name, share_encoder_decoder_embeddings, tie_word_embeddings, activation, scale_embedding, seed). Tiny random
# models tend to repeat one token; the seeds are ones whose outputs differ between the sentences of the batch.
VARIANTS = [
    ("shared-tied-swish", True, True, "swish", True, 0),
    ("shared-untied-relu", True, False, "relu", True, 1),
    ("separate-tied-relu-unscaled", False, True, "relu", False, 0),
    ("separate-untied-swish", False, False, "swish", True, 1),
]


def marian_config(share: bool, tie: bool, activation: str, **overrides) -> MarianConfig:
    pad = PAD if share else TARGET_VOCAB - 1
    settings = dict(
        vocab_size=SOURCE_VOCAB,
        decoder_vocab_size=None if share else TARGET_VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=48,
        decoder_ffn_dim=40,
        max_position_embeddings=64,
        activation_function=activation,
        scale_embedding=True,
        share_encoder_decoder_embeddings=share,
        tie_word_embeddings=tie,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=EOS,
        forced_eos_token_id=EOS,
        bos_token_id=None,
    )
    return MarianConfig(**{**settings, **overrides})


def noisy_marian(config: MarianConfig, seed: int = 0) -> MarianMTModel:
    """A MarianMTModel whose weights are moved off their initialisation (the position tables kept: Marian recomputes
    them), with a non-zero `final_logits_bias`."""
    torch.manual_seed(seed)
    model = MarianMTModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "embed_positions" not in name:  # large noise: outputs that differ from sentence to sentence
                parameter.add_(torch.randn_like(parameter) * (0.1 if "layer_norm" in name else 0.5))
        model.final_logits_bias.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        num_beams=4,
        length_penalty=0.8,
        max_length=40,
        bad_words_ids=[[config.pad_token_id]],
        decoder_start_token_id=config.decoder_start_token_id,
        pad_token_id=config.pad_token_id,
        eos_token_id=EOS,
        forced_eos_token_id=EOS,
        renormalize_logits=True,
    )
    return model


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with Marian's special-token layout (`</s>` 0, `<unk>` 1, `<pad>` last)."""
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def batch(share: bool = True) -> dict:
    torch.manual_seed(1)
    source = torch.randint(2, PAD, (3, 9))
    mask = torch.ones_like(source)
    source[2, 6:], mask[2, 6:] = PAD, 0
    vocab = PAD if share else TARGET_VOCAB - 1
    target = torch.randint(2, vocab, (3, 6))
    target[:, 0] = vocab
    return dict(input_ids=source, attention_mask=mask, decoder_input_ids=target)


@pytest.fixture(scope="module", params=VARIANTS, ids=[variant[0] for variant in VARIANTS])
def converted(request, tmp_path_factory):
    """(variant, Marian model, its folder, converted folder, converted model loaded from it)."""
    name, share, tie, activation, scale, seed = request.param
    marian = noisy_marian(marian_config(share, tie, activation, scale_embedding=scale), seed)
    folder = tmp_path_factory.mktemp(name)
    marian.save_pretrained(folder / "marian")
    word_tokenizer().save_pretrained(folder / "marian")
    out = convert_marian(folder / "marian", folder / "converted")
    model = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    return request.param, marian, folder / "marian", out, model


def test_converted_logits_match_marian(converted):
    (_, share, tie, activation, scale, _), marian, _, _, model = converted
    assert isinstance(model, DeepNMTForConditionalGeneration)
    config = model.config
    assert (config.sinusoid_frequencies, config.output_bias, config.pre_norm) == ("marian", True, False)
    assert (config.activation_function, config.scale_embedding) == (activation, scale)
    # A shared vocabulary untied from the output layer: transformers 5 unties Marian's encoder and decoder embeddings
    # too, so the model computes with two embedding matrices, and converts to that.
    assert config.share_embeddings == (share and tie)
    assert config.tie_word_embeddings == tie
    inputs = batch(share)
    with torch.no_grad():
        expected = marian(**inputs).logits
        got = model(**inputs).logits
    assert got.dtype == expected.dtype == torch.float32
    assert (got - expected).abs().max().item() <= 1e-5


def test_greedy_and_beam_outputs_match_marian_cached_and_uncached(converted):
    (_, share, *_), marian, _, _, model = converted
    inputs = batch(share)
    source = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    for beams in (1, 4):
        with torch.no_grad():
            expected = marian.generate(**source, num_beams=beams, do_sample=False, max_new_tokens=NEW_TOKENS)
            cached = model.generate(**source, num_beams=beams, do_sample=False, max_new_tokens=NEW_TOKENS)
            uncached = model.generate(
                **source, num_beams=beams, do_sample=False, max_new_tokens=NEW_TOKENS, use_cache=False
            )
        assert cached.tolist() == expected.tolist()
        assert uncached.tolist() == expected.tolist()
        assert len({tuple(row) for row in expected.tolist()}) > 1  # the rows differ: a real check, not one token


def test_generation_defaults_and_special_ids_carried_over(converted):
    _, marian, _, _, model = converted
    ours, theirs = model.generation_config, marian.generation_config
    for field in (
        "num_beams",
        "length_penalty",
        "max_length",
        "bad_words_ids",
        "decoder_start_token_id",
        "pad_token_id",
        "eos_token_id",
        "forced_eos_token_id",
        "renormalize_logits",
    ):
        assert getattr(ours, field) == getattr(theirs, field), field
    for field in ("pad_token_id", "eos_token_id", "decoder_start_token_id"):
        assert getattr(model.config, field) == getattr(marian.config, field)
    # generate() without arguments uses them: 4 beams, length penalty 0.8, pad never produced
    inputs = batch(model.config.share_embeddings)
    source = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    with torch.no_grad():
        assert model.generate(**source).tolist() == marian.generate(**source).tolist()


def test_tokenizer_is_carried_over_and_translate_works(converted):
    (_, share, *_), marian, marian_folder, out, model = converted
    tokenizer = AutoTokenizer.from_pretrained(out)
    original = AutoTokenizer.from_pretrained(marian_folder)
    text = ["w5 w9 w14 w3", "w7 w11"]
    assert tokenizer(text)["input_ids"] == original(text)["input_ids"]
    if share:  # the word tokenizer's ids are target ids only with a shared vocabulary
        translations = translate(model, tokenizer, text, num_beams=1, max_length_a=0, max_length_b=NEW_TOKENS)
        encoded = original(text, return_tensors="pt", padding=True)
        with torch.no_grad():
            # translate's cap counts the words before `</s>`; max_new_tokens counts `</s>` too
            expected = marian.generate(**encoded, num_beams=1, max_new_tokens=NEW_TOKENS + 1)
        assert translations == original.batch_decode(expected, skip_special_tokens=True)


def test_save_and_load_give_the_same_model(converted, tmp_path):
    (_, share, *_), marian, _, _, model = converted
    in_memory = convert_marian_model(marian)
    inputs = batch(share)
    with torch.no_grad():
        assert torch.equal(in_memory(**inputs).logits, model(**inputs).logits)
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, model(**inputs).logits)


REMOTE_SCRIPT = """
import sys
from pathlib import Path

sys.modules["hf_deep_nmt"] = None  # the folder's own code must run, as on a machine without the package

import torch
from transformers import AutoModelForSeq2SeqLM

model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
inputs = torch.load(sys.argv[2], weights_only=True)
with torch.no_grad():
    logits = model(**inputs).logits
    source = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    beams = model.generate(**source, num_beams=4, max_new_tokens=int(sys.argv[4]))
torch.save({"logits": logits, "beams": beams, "module": type(model).__module__}, sys.argv[3])
"""


def test_the_converted_folder_loads_as_remote_code(tmp_path_factory, clean_python):
    marian = noisy_marian(marian_config(False, False, "swish"), seed=3)
    folder = tmp_path_factory.mktemp("remote")
    marian.save_pretrained(folder / "marian")
    out = convert_marian(folder / "marian", folder / "converted")
    inputs = batch(share=False)
    torch.save(inputs, folder / "inputs.pt")
    environment = package_free_environment(str(folder / "hf_home"), str(folder / "modules"))
    # forked from the session's clean server (torch and transformers imported, never this package): a process of
    # its own, as a fresh interpreter without the package, without paying the imports again
    completed = clean_python.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(out), str(folder / "inputs.pt"), str(folder / "result.pt"),
         str(NEW_TOKENS)],
        cwd=folder,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = torch.load(folder / "result.pt", weights_only=False)
    assert not result["module"].startswith("hf_deep_nmt")
    with torch.no_grad():
        expected = marian(**inputs).logits
        beams = marian.generate(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            num_beams=4,
            max_new_tokens=NEW_TOKENS,
        )
    assert (result["logits"] - expected).abs().max().item() <= 1e-5
    assert result["beams"].tolist() == beams.tolist()


# ---- refusals: named, and nothing written ---------------------------------------------------------------------------


def test_a_folder_of_another_model_type_is_refused(tmp_path):
    sizes = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=16, decoder_ffn_dim=16)
    BartForConditionalGeneration(BartConfig(vocab_size=40, **sizes)).save_pretrained(tmp_path / "bart")
    with pytest.raises(ValueError, match=r"'bart' model, not a Marian one"):
        convert_marian(tmp_path / "bart", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_folder_without_a_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        convert_marian(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_marian(str(tmp_path / "missing"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_marian_model_without_its_translation_head_is_refused(tmp_path):
    config = marian_config(True, True, "relu", architectures=["MarianForCausalLM"])
    noisy_marian(config).save_pretrained(tmp_path / "causal")
    config_file = tmp_path / "causal" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "architectures": ["MarianForCausalLM"]}))
    with pytest.raises(ValueError, match=r"`architectures=\['MarianForCausalLM'\]`"):
        convert_marian(tmp_path / "causal", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_odd_width_is_refused_by_name(tmp_path):
    config = marian_config(True, True, "relu", d_model=15, encoder_attention_heads=3, decoder_attention_heads=3)
    noisy_marian(config).save_pretrained(tmp_path / "odd")
    with pytest.raises(ValueError, match="`d_model=15` is odd"):
        convert_marian(tmp_path / "odd", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_positions_other_than_marians_sinusoids_are_refused():
    marian = noisy_marian(marian_config(True, True, "relu"))
    with torch.no_grad():
        marian.model.encoder.embed_positions.weight[5] += 0.01
    with pytest.raises(ValueError, match=r"`model.encoder.embed_positions.weight` of the source is not Marian's"):
        convert_marian_model(marian)


def test_the_output_folder_is_protected(converted, tmp_path):
    _, _, marian_folder, out, _ = converted
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        convert_marian(marian_folder, out)
    assert convert_marian(marian_folder, out, overwrite=True) == out  # an earlier conversion may be replaced
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="no export or average of hf-deep-nmt wrote"):
        convert_marian(marian_folder, tmp_path / "user", overwrite=True)
    assert (tmp_path / "user" / "notes.txt").read_text() == "mine"


def test_the_command_line(converted, tmp_path, capsys):
    (_, share, *_), marian, marian_folder, _, _ = converted
    assert main(["convert-marian", "--model", str(marian_folder), "--output", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "cli").eval()
    inputs = batch(share)
    with torch.no_grad():
        assert (model(**inputs).logits - marian(**inputs).logits).abs().max().item() <= 1e-5
    assert (
        main(["convert-marian", "--model", str(marian_folder), "--output", str(tmp_path / "cli")]) == 2
    )  # exists: --overwrite needed
    assert "--overwrite" in capsys.readouterr().err
    assert (
        main(["convert-marian", "--model", str(marian_folder), "--output", str(tmp_path / "cli"), "--overwrite"]) == 0
    )
    assert main(["convert-marian", "--model", str(tmp_path / "nothing-here"), "--output", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- the backbone settings the conversion needs ---------------------------------------------------------------------


def test_the_new_settings_are_validated_and_written_only_when_set(tmp_path):
    from hf_deep_nmt import DeepNMTConfig

    with pytest.raises(ValueError, match=r"`sinusoid_frequencies` must be one of \('fairseq', 'marian'\), got 'bert'"):
        DeepNMTConfig(sinusoid_frequencies="bert")
    with pytest.raises(ValueError, match="`output_bias` must be True or False, got 1"):
        DeepNMTConfig(output_bias=1)
    with pytest.raises(ValueError, match="`sinusoid_frequencies='marian'` needs an even `d_model`"):
        DeepNMTConfig(sinusoid_frequencies="marian", d_model=15, encoder_attention_heads=3, decoder_attention_heads=3)
    DeepNMTConfig().save_pretrained(tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "sinusoid_frequencies" not in plain and "output_bias" not in plain  # no key for them, as 0.1.0 wrote it
    DeepNMTConfig(sinusoid_frequencies="marian", output_bias=True).save_pretrained(tmp_path / "set")
    written = json.loads((tmp_path / "set" / "config.json").read_text())
    assert (written["sinusoid_frequencies"], written["output_bias"]) == ("marian", True)


def test_a_converted_model_grows_deeper_and_still_loads(converted, tmp_path):
    from hf_deep_nmt.training.growing import grow_encoder

    (_, share, *_), _, _, out, model = converted
    grown = grow_encoder(out, num_new_layers=2, strategy="top").eval()
    config = grown.config
    assert config.encoder_layers == 4
    assert (config.sinusoid_frequencies, config.output_bias) == ("marian", True)
    assert torch.equal(grown.lm_head.bias, model.lm_head.bias)
    assert grown.generation_config.num_beams == model.generation_config.num_beams
    grown.save_pretrained(tmp_path / "grown")
    again = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "grown").eval()
    inputs = batch(share)
    source = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, grown(**inputs).logits)
        cached = again.generate(**source, num_beams=4, max_new_tokens=NEW_TOKENS)
        uncached = again.generate(**source, num_beams=4, max_new_tokens=NEW_TOKENS, use_cache=False)
    assert cached.tolist() == uncached.tolist()


# ---- convert -> grow -> train from the folder (`model_name_or_path`) -> export --------------------------------------


def word_corpus(folder, pairs: int, seed: int):
    """A tab-separated corpus of words the word tokenizer knows (target: the source's words, reversed)."""
    generator = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(pairs):
        ids = torch.randint(2, PAD, (int(torch.randint(3, 8, (1,), generator=generator)),), generator=generator)
        words = [WORDS[index] for index in ids.tolist()]
        lines.append(" ".join(words) + "\t" + " ".join(reversed(words)))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.tsv").write_text("\n".join(lines[4:]) + "\n", encoding="utf-8")
    (folder / "valid.tsv").write_text("\n".join(lines[:4]) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def grown_folder(tmp_path_factory):
    """A converted tiny Marian model (shared vocabulary, tied, swish) grown from 2 to 4 encoder layers, saved with its
    tokenizer: what a user hands `hf-deep-nmt train` as `model_name_or_path`."""
    from hf_deep_nmt.training.growing import grow_encoder

    folder = tmp_path_factory.mktemp("warm-start")
    noisy_marian(marian_config(True, True, "swish")).save_pretrained(folder / "marian")
    word_tokenizer().save_pretrained(folder / "marian")
    (folder / "marian" / "README.md").write_text(
        "---\nlicense: cc-by-4.0\nlanguage: [es, en]\n---\n# A Marian model\n"
    )
    converted = convert_marian(folder / "marian", folder / "converted")
    assert (
        main(
            [
                "grow",
                "--model",
                str(converted),
                "--output",
                str(folder / "grown"),
                "--layers",
                "2",
                "--strategy",
                "top",
            ]
        )
        == 0
    )
    # The command writes what the library function gives, with the tokenizer beside it.
    expected = grow_encoder(converted, num_new_layers=2, strategy="top").state_dict()
    grown = AutoModelForSeq2SeqLM.from_pretrained(folder / "grown").state_dict()
    assert expected.keys() == grown.keys() and all(torch.equal(expected[key], grown[key]) for key in expected)
    assert (folder / "grown" / "tokenizer.json").read_bytes() == (Path(converted) / "tokenizer.json").read_bytes()
    return folder


def test_the_grow_command_refuses_what_it_must_not_write(grown_folder, capsys):
    converted, grown = grown_folder / "converted", grown_folder / "grown"
    before = sorted(path.name for path in converted.iterdir())
    assert main(["grow", "--model", str(converted), "--output", str(grown), "--layers", "2"]) == 2  # exists
    assert "--overwrite" in capsys.readouterr().err
    assert (
        main(["grow", "--model", str(converted), "--output", str(converted), "--layers", "2", "--overwrite"]) == 2
    )  # its own source
    assert "is the model folder" in capsys.readouterr().err
    assert (
        main(
            [
                "grow",
                "--model",
                str(converted),
                "--output",
                str(grown_folder / "x"),
                "--layers",
                "2",
                "--strategy",
                "sideways",
            ]
        )
        == 2
    )
    assert "invalid choice: 'sideways'" in capsys.readouterr().err
    assert main(["grow", "--model", str(converted), "--output", str(grown_folder / "y"), "--layers", "0"]) == 2
    assert "--layers" in capsys.readouterr().err
    assert sorted(path.name for path in converted.iterdir()) == before
    assert not (grown_folder / "x").exists() and not (grown_folder / "y").exists()


def warm_start_arguments(folder, output: str, *extra: str) -> list[str]:
    corpus = word_corpus(folder / "corpus", pairs=36, seed=0)
    return [
        *("--model_name_or_path", str(folder / "grown")),
        *("--train_file", str(corpus / "train.tsv"), "--validation_file", str(corpus / "valid.tsv")),
        *("--max_steps", "3", "--per_device_train_batch_size", "8", "--learning_rate", "0.001"),
        *("--max_source_length", "16", "--max_target_length", "16", "--max_length_a", "0", "--max_length_b", "8"),
        *("--num_beams", "2", "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true"),
        *("--use_cpu", "true", "--seed", "0", "--translate_examples", "1", "--plot_curves", "false"),
        *("--output_dir", str(folder / output)),
        *extra,
    ]


def test_a_converted_grown_model_trains_from_its_folder_and_exports(grown_folder):
    from hf_deep_nmt.training.pipeline import run

    saved_tokenizer = json.loads((grown_folder / "grown" / "tokenizer.json").read_text())
    summary = run(warm_start_arguments(grown_folder, "run", "--export_dir", str(grown_folder / "export")))
    assert summary["train_steps"] == 3 and summary["export_dir"] == str(grown_folder / "export")
    export = grown_folder / "export"
    # the tokenizer is the folder's, not one trained on the corpus
    assert json.loads((export / "tokenizer.json").read_text())["model"] == saved_tokenizer["model"]
    model = AutoModelForSeq2SeqLM.from_pretrained(export).eval()
    assert isinstance(model, DeepNMTForConditionalGeneration)
    assert (model.config.encoder_layers, model.config.sinusoid_frequencies, model.config.output_bias) == (
        4,
        "marian",
        True,
    )
    assert model.generation_config.bad_words_ids == [[PAD]]  # the converted model's, kept through training
    grown = AutoModelForSeq2SeqLM.from_pretrained(grown_folder / "grown")
    assert not torch.equal(model.lm_head.bias, grown.lm_head.bias)  # trained
    inputs = batch(share=True)
    source = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    with torch.no_grad():
        for beams in (1, 4):
            cached = model.generate(**source, num_beams=beams, max_new_tokens=NEW_TOKENS)
            uncached = model.generate(**source, num_beams=beams, max_new_tokens=NEW_TOKENS, use_cache=False)
            assert cached.tolist() == uncached.tolist()
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert translate(model, tokenizer, ["w5 w9 w14"], num_beams=2, max_length_a=0, max_length_b=8)
    # the card names the origin, its licence and how the model was changed
    card = (export / "README.md").read_text()
    assert "license: cc-by-4.0" in card and "base_model" not in card  # a local source is no Hub base model
    origin = card.split("## Origin")[1].split("## Method")[0]
    assert "Converted from `marian`, a transformers `MarianMTModel`, with `hf-deep-nmt" in origin
    assert "as its model card states it: `cc-by-4.0`" in origin
    assert "grown from 2 to 4 layers with `grow_encoder` (strategy `top`)" in origin
    assert "then trained as described under Training data" in origin


@pytest.mark.parametrize(
    "extra, error, message",
    [
        (("--model_type", "deep_nmt_sdt"), ValueError, r"`model_type` is 'deep_nmt_sdt' but the saved model's is "),
        (("--tokenizer_vocab_size", "300"), ValueError, r"`tokenizer_vocab_size=300` would train a new tokenizer"),
    ],
    ids=["model_type", "tokenizer_vocab_size"],
)
def test_a_recipe_that_contradicts_the_saved_model_is_refused_before_work(
    grown_folder, extra, error, message, monkeypatch
):
    from hf_deep_nmt.training import pipeline as training

    monkeypatch.setattr(training, "prepare", lambda *args, **kwargs: pytest.fail("data read"))
    with pytest.raises(error, match=message):
        training.run(warm_start_arguments(grown_folder, f"refused-{extra[0][2:]}", *extra))


def test_model_overrides_must_be_the_saved_models_values(grown_folder, tmp_path, monkeypatch):
    from hf_deep_nmt.training import pipeline as training

    monkeypatch.setattr(training, "prepare", lambda *args, **kwargs: pytest.fail("data read"))
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"model_overrides": {"encoder_layers": 6, "d_model": 32}}))
    with pytest.raises(ValueError, match=r"`model_overrides.encoder_layers` is 6 but the saved model has 4"):
        training.run([str(recipe), *warm_start_arguments(grown_folder, "refused-overrides")])
    recipe.write_text(json.dumps({"model_overrides": {"encoder_layers": 4, "d_model": 32}}))  # the saved values

    def reached(*args, **kwargs):
        raise InterruptedError("the checks passed: the data would be read now")

    monkeypatch.setattr(training, "prepare", reached)
    with pytest.raises(InterruptedError, match="the checks passed"):
        training.run([str(recipe), *warm_start_arguments(grown_folder, "accepted-overrides")])


def test_a_folder_that_cannot_be_started_from_is_named_before_work(grown_folder, tmp_path, monkeypatch):
    from hf_deep_nmt.training import pipeline as training

    monkeypatch.setattr(training, "prepare", lambda *args, **kwargs: pytest.fail("data read"))
    run = training.run

    def arguments(model: str) -> list[str]:
        listed = warm_start_arguments(grown_folder, "refused-folder")
        listed[listed.index("--model_name_or_path") + 1] = model
        return listed

    missing = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=f"`model_name_or_path` '{missing}' does not exist"):
        run(arguments(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"'.*empty' has no config.json"):
        run(arguments(str(tmp_path / "empty")))
    AutoModelForSeq2SeqLM.from_pretrained(grown_folder / "grown").save_pretrained(tmp_path / "weights-only")
    with pytest.raises(FileNotFoundError, match=r"'.*weights-only' holds no tokenizer"):
        run(arguments(str(tmp_path / "weights-only")))
    with pytest.raises(ValueError, match=r"model_type 'marian'.*convert it first with `hf-deep-nmt convert-marian`"):
        run(arguments(str(grown_folder / "marian")))


def test_train_staged_refuses_a_saved_model_by_name(grown_folder):
    from hf_deep_nmt.training.staged import run_staged

    arguments = warm_start_arguments(grown_folder, "refused-staged", "--stage_depths", "4", "--stage_max_steps", "1")
    with pytest.raises(ValueError, match=r"cannot start from the saved model `model_name_or_path` '.*grown'"):
        run_staged(arguments)


def test_conversion_and_growth_are_recorded_in_the_config(grown_folder):
    converted = json.loads((grown_folder / "converted" / "config.json").read_text())
    record = converted["converted_from"]
    assert record["model"] == "marian" and record["location"] == "local folder"  # a folder's name, not its path
    assert (record["architecture"], record["license"]) == ("MarianMTModel", "cc-by-4.0")
    assert record["converter"].startswith("hf-deep-nmt ") and "growth" not in converted
    grown = json.loads((grown_folder / "grown" / "config.json").read_text())
    assert grown["converted_from"] == record
    assert grown["growth"] == [{"encoder_layers": [2, 4], "strategy": "top"}]
    with pytest.raises(ValueError, match="`growth` must be a list of mappings or None, got 'top'"):
        DeepNMTForConditionalGeneration.config_class(growth="top")


def test_the_card_of_a_hub_source_links_it_and_says_when_its_licence_is_unknown(grown_folder):
    from hf_deep_nmt.hub import render_model_card

    model = AutoModelForSeq2SeqLM.from_pretrained(grown_folder / "grown")
    model.config.converted_from = {
        "model": "Helsinki-NLP/opus-mt-xx-yy",
        "location": "hub",
        "revision": "0123abcd",
        "architecture": "MarianMTModel",
        "license": None,
        "converter": "hf-deep-nmt 0.2.0 convert-marian",
    }
    card = str(render_model_card(model, "someone/deep-xx-yy"))
    assert "base_model: Helsinki-NLP/opus-mt-xx-yy" in card and "license: unknown" in card
    origin = card.split("## Origin")[1].split("## Method")[0]
    assert (
        "[`Helsinki-NLP/opus-mt-xx-yy`](https://huggingface.co/Helsinki-NLP/opus-mt-xx-yy) (revision `0123abcd`)"
        in (origin)
    )
    assert "states no licence that could be read" in origin and "trained as described" not in origin
    assert "license: mit" in str(render_model_card(model, "someone/deep-xx-yy", license="mit"))  # the caller's wins
    model.config.converted_from, model.config.growth = None, None  # a model trained from scratch: no origin
    plain = str(render_model_card(model, "someone/deep-xx-yy"))
    assert "## Origin" not in plain and "license: apache-2.0" in plain


@pytest.mark.parametrize("aggregation", ["dlcl", "sparse"])
def test_a_converted_model_rewired_with_layer_connections_still_computes_what_marian_does(
    converted, aggregation, tmp_path
):
    from hf_deep_nmt.training.growing import with_layer_aggregation

    (_, share, *_), marian, _, _, model = converted
    rewired = with_layer_aggregation(model, aggregation).eval()
    assert (rewired.config.pre_norm, rewired.config.encoder_layer_aggregation) == (False, aggregation)
    inputs = batch(share)
    source = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    with torch.no_grad():
        expected, got = model(**inputs).logits, rewired(**inputs).logits
        assert (got - expected).abs().max().item() <= 1e-6
        assert (got - marian(**inputs).logits).abs().max().item() <= 1e-5
        for beams in (1, 4):
            options = dict(num_beams=beams, do_sample=False, max_new_tokens=NEW_TOKENS)
            assert rewired.generate(**source, **options).tolist() == marian.generate(**source, **options).tolist()
    rewired.save_pretrained(tmp_path / "rewired")
    again = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "rewired").eval()
    with torch.no_grad():
        assert torch.equal(again(**inputs).logits, got)


def test_the_grow_command_rewires_a_converted_model_before_growing(grown_folder, capsys):
    from hf_deep_nmt.hub import render_model_card
    from hf_deep_nmt.training.growing import grow_encoder

    converted, out = grown_folder / "converted", grown_folder / "grown-dlcl"
    assert (
        main(["grow", "--model", str(converted), "--output", str(out), "--layers", "2", "--aggregation", "dlcl"]) == 0
    )
    assert "2 -> 4 layers (top, dlcl aggregation)" in capsys.readouterr().out
    grown = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert (grown.config.encoder_layers, grown.config.encoder_layer_aggregation) == (4, "dlcl")
    assert grown.config.growth == [
        {"layer_aggregation": ["residual", "dlcl"], "stack": "encoder"},
        {"encoder_layers": [2, 4], "strategy": "top"},
    ]
    expected = grow_encoder(converted, 2, "top", aggregation="dlcl").state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in grown.state_dict().items())
    origin = str(render_model_card(grown, "someone/deep")).split("## Origin")[1].split("## Method")[0]
    assert "layer aggregation was changed from `residual` to `dlcl`" in origin and "from 2 to 4 layers" in origin
    source = batch()
    source.pop("decoder_input_ids")
    with torch.no_grad():
        cached = grown.generate(**source, num_beams=4, max_new_tokens=NEW_TOKENS)
        uncached = grown.generate(**source, num_beams=4, max_new_tokens=NEW_TOKENS, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    dlcl = grown_folder / "grown-dlcl-again"
    assert (
        main(["grow", "--model", str(out), "--output", str(dlcl), "--layers", "2", "--aggregation", "dlcl"]) == 2
    )  # already DLCL
    assert "the encoder already uses 'dlcl' aggregation" in capsys.readouterr().err and not dlcl.exists()
    assert (
        main(["grow", "--model", str(converted), "--output", str(dlcl), "--layers", "2", "--aggregation", "residual"])
        == 2
    )
    assert "invalid choice: 'residual'" in capsys.readouterr().err
