"""`hf-deep-nmt export-ctranslate2`: what CTranslate2 can express is exported and decodes as this package does (greedy
tokens, per-token log-probabilities); everything else is refused by name before any work; nothing a user saved is
written over; `translate --backend ctranslate2` decodes the export as the torch backend does (greedy exactly, beam
search on most lines) and names what it cannot do. The parity tests need the optional `ctranslate2` package (`pip
install -e ".[bench]"`) and are skipped without it."""

import ast
import copy
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from hf_deep_nmt import MODEL_CLASSES, DeepNMTConfig, DeepNormConfig, DlclConfig, DsInitConfig, MscConfig, SdtConfig
from hf_deep_nmt.cli import main
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.hub import WRITTEN_MARKER
from hf_deep_nmt.serving.ctranslate2 import ctranslate2_blockers

needs_ctranslate2 = pytest.mark.skipif(
    importlib.util.find_spec("ctranslate2") is None, reason='ctranslate2 is in the optional "bench" extra'
)

PAIRS = [
    ("hola mundo", "hello world"),
    ("buenos días", "good morning"),
    ("gracias", "thank you"),
    ("la casa es grande", "the house is big"),
    ("el perro come", "the dog eats"),
    ("buenas noches mundo", "good night world"),
]
SIZES = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=2,
    encoder_ffn_dim=48,
    decoder_ffn_dim=40,
    dropout=0.0,
)
# What CTranslate2 can express, across every switch that changes the network it runs.
SERVABLE = {
    "prenorm-shared-tied-relu": (DeepNMTConfig, {}),
    "postnorm-separate-untied-unscaled-gelu": (
        DeepNMTConfig,
        dict(
            pre_norm=False,
            share_embeddings=False,
            tie_word_embeddings=False,
            scale_embedding=False,
            activation_function="gelu",
        ),
    ),
    "dsinit-multihead-separate-tied-silu": (
        DsInitConfig,
        dict(decoder_self_attention="multi_head", activation_function="silu", layer_norm_eps=1e-6),
    ),
}


def assert_scores_match(model, tokenizer, translator, encoded, source_tokens, targets) -> None:
    """CTranslate2's per-token log-probabilities of `targets` (`</s>` included) are the model's, within 1e-4."""
    scores = translator.score_batch(source_tokens, [tokenizer.convert_ids_to_tokens(t) for t in targets])
    for ids, target, score in zip(encoded, targets, scores):
        decoder_input = torch.tensor([[model.config.decoder_start_token_id, *target]])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), decoder_input_ids=decoder_input).logits[0]
        labels = torch.tensor([*target, tokenizer.eos_token_id])
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(score.log_probs), log_probs, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def tokenizer():
    return train_joint_tokenizer(PAIRS * 10, vocab_size=300, min_frequency=1)


_TRAINED = {}  # (config class, overrides, tokenizer) -> model: the tests only read these, so they share them


def trained(config_class, overrides, tokenizer):
    """A tiny model trained until it translates the pairs, so that its greedy outputs differ from sentence to
    sentence and end with `</s>` (trained once per config and tokenizer)."""
    key = (config_class, json.dumps(overrides, sort_keys=True), id(tokenizer))
    if key not in _TRAINED:
        _TRAINED[key] = _train(config_class, overrides, tokenizer), tokenizer  # the tokenizer kept: its id stays its
    return _TRAINED[key][0]


def _train(config_class, overrides, tokenizer):
    torch.manual_seed(0)
    model = MODEL_CLASSES[config_class](config_class(**{**SIZES, "vocab_size": len(tokenizer), **overrides}))
    batch = tokenizer([s for s, _ in PAIRS], text_target=[t for _, t in PAIRS], padding=True, return_tensors="pt")
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(60):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


# ---- what is refused ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (DlclConfig(), "`encoder_layer_aggregation='dlcl'`"),
        (DeepNMTConfig(decoder_layer_aggregation="dlcl"), "`decoder_layer_aggregation='dlcl'`"),
        (SdtConfig(relative_position_window=0), "`encoder_layer_aggregation='sparse'`"),
        (DsInitConfig(), "`decoder_self_attention='merged_average'` (merged attention, MAtt"),
        (DeepNMTConfig(decoder_self_attention="average"), "`decoder_self_attention='average'` (the average attention"),
        (MscConfig(), "`msc_block_layers=6` (MSC"),
        (DeepNMTConfig(relative_position_window=8), "`relative_position_window=8` (relative position keys"),
        (DeepNMTConfig(activation_function="mish"), "`activation_function='mish'`"),
    ],
    ids=["dlcl", "dlcl-decoder", "sparse", "matt", "aan", "msc", "relative-keys", "activation"],
)
def test_every_feature_ctranslate2_cannot_express_is_named(config, named):
    assert any(blocker.startswith(named) for blocker in ctranslate2_blockers(config)), ctranslate2_blockers(config)


def test_the_paper_presets_name_all_their_blockers():
    assert len(ctranslate2_blockers(SdtConfig())) == 2  # sparse encoder, relative keys
    assert len(ctranslate2_blockers(DlclConfig())) == 2  # both stacks


@pytest.mark.parametrize("name", SERVABLE)
def test_servable_configs_have_no_blockers(name):
    config_class, overrides = SERVABLE[name]
    assert ctranslate2_blockers(config_class(**overrides)) == []


def test_without_ctranslate2_the_command_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # `import ctranslate2` raises ImportError
    assert main(["export-ctranslate2", "--model", str(tmp_path / "model"), "--output", str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "pip install 'hf-deep-nmt[bench]'" in error
    assert not (tmp_path / "out").exists()


# ---- parity -------------------------------------------------------------------------------------------------------


@needs_ctranslate2
@pytest.mark.parametrize("name", SERVABLE)
def test_ctranslate2_decodes_and_scores_as_this_package(name, tokenizer, tmp_path):
    import ctranslate2

    from hf_deep_nmt.serving.ctranslate2 import export_ctranslate2

    config_class, overrides = SERVABLE[name]
    model = trained(config_class, overrides, tokenizer)
    export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    sentences = [source for source, _ in PAIRS] + ["el mundo es grande", "gracias perro", "noches"]
    encoded = [tokenizer(sentence)["input_ids"] for sentence in sentences]  # each ends with </s>

    batch = tokenizer.pad({"input_ids": encoded}, return_tensors="pt")
    with torch.no_grad():
        ours = model.generate(**batch, num_beams=1, do_sample=False, max_length=31)
    expected = []
    for row in ours[:, 1:].tolist():
        expected.append(row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row)
    source_tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in encoded]
    results = translator.translate_batch(source_tokens, beam_size=1, max_decoding_length=30)
    produced = [tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results]
    assert produced == expected
    assert len({tuple(row) for row in expected}) > 3  # real translations, not one repeated output
    assert sum(len(row) < 30 for row in expected) > 3  # most end with </s> before the cap

    # per-token log-probabilities of arbitrary targets, </s> included
    generator = torch.Generator().manual_seed(0)
    targets = [torch.randint(4, len(tokenizer), (length,), generator=generator).tolist() for length in (3, 9, 14)]
    assert_scores_match(model, tokenizer, translator, encoded, source_tokens[:3], targets)


@pytest.fixture(scope="module")
def deepnorm_export(tokenizer, tmp_path_factory):
    """A trained DeepNorm model (its encoder's alpha 1.006, the decoder's 1.565: the export scales the encoder's
    residual stream by their ratio) and its CTranslate2 translator."""
    import ctranslate2

    from hf_deep_nmt.serving.ctranslate2 import export_ctranslate2

    model = trained(DeepNormConfig, {}, tokenizer)
    folder = tmp_path_factory.mktemp("deepnorm") / "ct2"
    export_ctranslate2(model, tokenizer, folder)
    return model, ctranslate2.Translator(str(folder), device="cpu", intra_threads=1), folder


@needs_ctranslate2
@pytest.mark.parametrize("num_beams", [1, 4])
def test_deepnorm_exports_as_a_plain_post_norm_model_decoding_the_same_tokens(deepnorm_export, tokenizer, num_beams):
    model, translator, folder = deepnorm_export
    alpha = model.config.deepnorm_constants("decoder")[0]
    assert json.loads((folder / "config.json").read_text())["layer_norm_epsilon"] == pytest.approx(1e-5 / alpha**2)
    sentences = [source for source, _ in PAIRS] + ["el mundo es grande", "gracias perro", "noches"]
    encoded = [tokenizer(sentence)["input_ids"] for sentence in sentences]
    batch = tokenizer.pad({"input_ids": encoded}, return_tensors="pt")
    with torch.no_grad():
        ours = model.generate(**batch, num_beams=num_beams, do_sample=False, max_length=31)
    expected = []
    for row in ours[:, 1:].tolist():
        expected.append(row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row)
    source_tokens = [tokenizer.convert_ids_to_tokens(ids) for ids in encoded]
    results = translator.translate_batch(source_tokens, beam_size=num_beams, max_decoding_length=30)
    assert [tokenizer.convert_tokens_to_ids(result.hypotheses[0]) for result in results] == expected
    assert len({tuple(row) for row in expected}) > 3

    # the log-probabilities of arbitrary targets agree as closely as a plain model's do
    targets = [
        torch.randint(4, len(tokenizer), (9,), generator=torch.Generator().manual_seed(i)).tolist() for i in (0, 1)
    ]
    assert_scores_match(model, tokenizer, translator, encoded, source_tokens[:2], targets)


@needs_ctranslate2
def test_a_source_beyond_the_position_table_is_refused_by_ctranslate2(tokenizer, tmp_path):
    import ctranslate2

    from hf_deep_nmt.serving.ctranslate2 import export_ctranslate2

    model = MODEL_CLASSES[DeepNMTConfig](DeepNMTConfig(**SIZES, vocab_size=len(tokenizer))).eval()
    export_ctranslate2(model, tokenizer, tmp_path / "ct2", max_positions=8)
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    assert translator.translate_batch([["▁a"] * 7 + ["</s>"]], max_decoding_length=4)  # 8 positions: fine
    with pytest.raises(RuntimeError, match="No position encodings are defined for positions >= 8"):
        translator.translate_batch([["▁a"] * 8 + ["</s>"]], max_decoding_length=4)


# ---- the command --------------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tokenizer, tmp_path):
    """A saved model folder (weights, config, tokenizer) CTranslate2 can express."""
    model = MODEL_CLASSES[DeepNMTConfig](DeepNMTConfig(**SIZES, vocab_size=len(tokenizer)))
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@needs_ctranslate2
def test_the_command_writes_a_folder_ctranslate2_and_transformers_load(saved, tmp_path, capsys):
    import ctranslate2

    out = tmp_path / "ct2"
    capsys.readouterr()
    assert main(["export-ctranslate2", "--model", str(saved), "--output", str(out), "--quantization", "int8"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    names = {path.name for path in out.iterdir()}
    assert {"model.bin", "config.json", "shared_vocabulary.json", "tokenizer.json", WRITTEN_MARKER} <= names
    config = json.loads((out / "config.json").read_text())
    assert (config["decoder_start_token"], config["eos_token"], config["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert config["add_source_eos"] is False and config["layer_norm_epsilon"] == 1e-5
    translator = ctranslate2.Translator(str(out), device="cpu", compute_type="int8")
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("hola mundo")["input_ids"])
    assert translator.translate_batch([tokens], max_decoding_length=5)[0].hypotheses[0]


@needs_ctranslate2
def test_the_command_never_writes_over_what_it_did_not_write(saved, tmp_path, capsys):
    out = tmp_path / "ct2"
    assert main(["export-ctranslate2", "--model", str(saved), "--output", str(out)]) == 0
    capsys.readouterr()
    assert main(["export-ctranslate2", "--model", str(saved), "--output", str(out)]) == 2  # not empty
    assert "--overwrite" in capsys.readouterr().err
    assert (
        main(["export-ctranslate2", "--model", str(saved), "--output", str(out), "--overwrite"]) == 0
    )  # its own earlier export
    (out / "notes.txt").write_text("mine")
    assert main(["export-ctranslate2", "--model", str(saved), "--output", str(out), "--overwrite"]) == 2
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"
    before = sorted(path.name for path in saved.iterdir())
    assert (
        main(["export-ctranslate2", "--model", str(saved), "--output", str(saved), "--overwrite"]) == 2
    )  # the model folder itself
    assert "the model folder" in capsys.readouterr().err
    assert sorted(path.name for path in saved.iterdir()) == before


@needs_ctranslate2
def test_the_command_refuses_an_unsupported_model_naming_the_feature_before_loading(tokenizer, tmp_path, capsys):
    model = MODEL_CLASSES[DlclConfig](DlclConfig(**SIZES, vocab_size=len(tokenizer)))
    model.save_pretrained(tmp_path / "dlcl")
    tokenizer.save_pretrained(tmp_path / "dlcl")
    capsys.readouterr()
    assert main(["export-ctranslate2", "--model", str(tmp_path / "dlcl"), "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "`encoder_layer_aggregation='dlcl'`" in error
    assert "pre- or post-norm" in error and not (tmp_path / "out").exists()


@needs_ctranslate2
@pytest.mark.parametrize(
    ("arguments", "named"),
    [(["--quantization", "int4"], "--quantization 'int4'"), (["--max-positions", "0"], "--max-positions")],
)
def test_the_command_refuses_bad_options_naming_them(saved, tmp_path, capsys, arguments, named):
    assert main(["export-ctranslate2", "--model", str(saved), "--output", str(tmp_path / "out"), *arguments]) == 2
    assert named in capsys.readouterr().err and not (tmp_path / "out").exists()


# ---- translating with it: `hf-deep-nmt translate --backend ctranslate2` ------------------------------------------


@pytest.fixture(scope="module")
def served(tokenizer, tmp_path_factory):
    """`(folder, model)`: a trained model saved as a model folder (with a README, so that `push` takes it), and its
    CTranslate2 model in `folder/ctranslate2/`, written by the command. Its tests that need it are one test, so that
    pytest-xdist builds it once."""
    model = trained(DeepNMTConfig, {}, tokenizer)
    folder = tmp_path_factory.mktemp("served") / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text("a tiny model\n")
    assert main(["export-ctranslate2", "--model", str(folder), "--into-model"]) == 0
    return folder, model


LINES = [source for source, _ in PAIRS] + ["el mundo es grande", "", "gracias perro", "noches", "la casa come perro"]


def assert_generation_settings_are_honoured_or_refused(model, tokenizer, export, tmp_path) -> None:
    """A saved generation setting CTranslate2 has no counterpart for is refused by name; those it has are decoded
    as the torch backend decodes them."""
    from hf_deep_nmt.serving.ctranslate2_decoder import CTranslate2Decoder
    from hf_deep_nmt.serving.options import DecodingOptions
    from hf_deep_nmt.serving.translate import translate

    forced = tmp_path / "forced"
    shutil.copytree(export, forced)
    settings = json.loads((forced / "generation_config.json").read_text())
    (forced / "generation_config.json").write_text(json.dumps({**settings, "forced_bos_token_id": 5}))
    with pytest.raises(ValueError, match=r"sets forced_bos_token_id=5, which CTranslate2's decoding has no"):
        CTranslate2Decoder(forced).check(tokenizer, DecodingOptions())
    # what converted Marian models set: a banned token (their padding) and the end token forced at the cap
    with torch.no_grad():
        banned = int(model.generate(**tokenizer(LINES[:1], return_tensors="pt"), max_length=4)[0, 1])
    marian_like = copy.deepcopy(model)
    marian_like.generation_config.update(bad_words_ids=[[banned]], forced_eos_token_id=tokenizer.eos_token_id)
    shutil.copytree(export, tmp_path / "banned")
    marian_like.generation_config.save_pretrained(tmp_path / "banned")  # in the export's place
    expected = translate(marian_like, tokenizer, LINES, num_beams=1)
    assert expected != translate(model, tokenizer, LINES, num_beams=1)
    assert translate(CTranslate2Decoder(tmp_path / "banned"), tokenizer, LINES, num_beams=1) == expected


@needs_ctranslate2
def test_ctranslate2_backend_translates_as_torch_and_ships_with_the_model(served, tokenizer, tmp_path, capsys):
    from hf_deep_nmt.hub import upload_operations
    from hf_deep_nmt.serving.ctranslate2 import IDENTITY_FILE
    from hf_deep_nmt.serving.ctranslate2_decoder import CTranslate2Decoder, load_ctranslate2_model
    from hf_deep_nmt.serving.options import DecodingOptions
    from hf_deep_nmt.serving.translate import translate

    folder, model = served
    source = tmp_path / "in.es"
    source.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    base = ["translate", "--model", str(folder), "--input", str(source), "--no-progress", "--backend", "ctranslate2"]

    def run(*options) -> list[str]:
        target = tmp_path / f"out{len(list(tmp_path.iterdir()))}.en"
        assert main([*base, "--output", str(target), "--threads", "1", *options]) == 0, capsys.readouterr().err
        return target.read_text(encoding="utf-8").split("\n")[:-1]

    # greedy: the torch backend's lines exactly (float32), with a cap that cuts most sentences as well
    for options in (("--num-beams", "1"), ("--num-beams", "1", "--max-length-a", "0.3", "--max-length-b", "1")):
        settings = dict(zip(options[::2], options[1::2]))
        expected = translate(
            model,
            tokenizer,
            LINES,
            num_beams=1,
            max_length_a=float(settings.get("--max-length-a", 1.5)),
            max_length_b=int(settings.get("--max-length-b", 10)),
        )
        assert run(*options, "--batch-size", "3") == expected, options
    assert len(set(expected)) > 3 and expected[len(PAIRS) + 1] == ""
    # beam search: CTranslate2's own, agreeing on most lines (on all of these)
    for penalty in ("1.0", "0.6"):
        expected = translate(model, tokenizer, LINES, num_beams=4, length_penalty=float(penalty))
        produced = run("--num-beams", "4", "--length-penalty", penalty)
        assert sum(ours == theirs for ours, theirs in zip(expected, produced)) >= len(LINES) - 1, produced
    decoder, ct2_tokenizer = load_ctranslate2_model(folder, threads=1)  # the Python API: in the model's place
    assert translate(decoder, ct2_tokenizer, LINES, num_beams=1) == translate(model, tokenizer, LINES, num_beams=1)
    assert len(run("--int8")) == len(LINES)  # int8 compute, converted as the model loads
    assert CTranslate2Decoder.unavailable_reason(folder) is None
    assert CTranslate2Decoder.unavailable_reason(folder / "ctranslate2", int8=True) is None

    # what the model folder's tokenizer cannot be, what the backend cannot do, named before anything is decoded
    other = train_joint_tokenizer([("uno dos", "one two")] * 10, vocab_size=len(tokenizer), min_frequency=1)
    with pytest.raises(ValueError, match="The tokenizer is not the one this model was exported with"):
        decoder.check(other, DecodingOptions())
    decoder.check_fits([(3, 20), (1, 600)], DecodingOptions())  # 600 source rows; 910 tokens + 2 decoding rows
    with pytest.raises(ValueError, match=r"A batch needs 1100 positions \(its longest source\), and .* 1026 rows"):
        decoder.check_fits([(3, 20), (1, 1100)], DecodingOptions(max_output_tokens=100))
    for options, named in (
        (("--compile",), "--compile"),
        (("--device", "cuda"), "--device cuda is for --backend torch"),
        (("--num-beams", "2", "--length-penalty-form", "gnmt"), "--length-penalty-form gnmt"),
    ):
        assert main([*base, *options]) == 2
        assert named in capsys.readouterr().err
    assert json.loads((folder / "ctranslate2" / IDENTITY_FILE).read_text())["eos_token_id"] == tokenizer.eos_token_id
    assert_generation_settings_are_honoured_or_refused(model, tokenizer, folder / "ctranslate2", tmp_path)

    uploaded = {operation.path_in_repo for operation in upload_operations(folder)}
    assert {"ctranslate2/model.bin", "ctranslate2/tokenizer.json", f"ctranslate2/{IDENTITY_FILE}"} <= uploaded


def test_ctranslate2_backend_names_why_it_cannot_run_a_model(tokenizer, tmp_path, capsys, monkeypatch):
    from hf_deep_nmt.serving import ctranslate2_decoder
    from hf_deep_nmt.serving.ctranslate2_decoder import CTranslate2Decoder

    # naming the backend (`DECODERS`) imports no ctranslate2: only making a decoder does
    tree = ast.parse(Path(ctranslate2_decoder.__file__).read_text(encoding="utf-8"))
    imported = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.split(".")[0] == "ctranslate2"], imported

    for settings, named in ((dict(compile=True), "`compile=True` (`--compile`)"), (dict(device="cuda"), "cuda")):
        with pytest.raises(ValueError, match=re.escape(named)):
            CTranslate2Decoder.check_settings(**settings)
    CTranslate2Decoder.check_settings(device="cpu", int8=True)

    plain, dlcl = tmp_path / "plain", tmp_path / "dlcl"
    DeepNMTConfig(**SIZES, vocab_size=len(tokenizer)).save_pretrained(plain)
    DlclConfig(**SIZES, vocab_size=len(tokenizer)).save_pretrained(dlcl)
    command = f"`hf-deep-nmt export-ctranslate2 --model {plain} --into-model`"
    for arguments, named in (
        (["--model", str(plain)], "give either --output (a folder for the CTranslate2 model) or --into-model"),
        (["--model", str(plain), "--into-model", "--output", str(tmp_path / "out")], "or --into-model, not both"),
        (["--model", "org/hub-model", "--into-model"], "--into-model writes into a local model folder"),
    ):
        assert main(["export-ctranslate2", *arguments]) == 2
        assert named in capsys.readouterr().err
    if importlib.util.find_spec("ctranslate2") is not None:
        assert command in CTranslate2Decoder.unavailable_reason(plain)
        assert "`encoder_layer_aggregation='dlcl'`" in CTranslate2Decoder.unavailable_reason(dlcl)
        assert main(["translate", "--model", str(plain), "--backend", "ctranslate2", "--no-progress"]) == 2
        assert command in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # not installed
    assert "pip install ctranslate2" in CTranslate2Decoder.unavailable_reason(plain)
    assert main(["translate", "--model", str(plain), "--backend", "ctranslate2", "--no-progress"]) == 1
    assert "pip install 'hf-deep-nmt[bench]'" in capsys.readouterr().err
