"""Diagnostics (hf_deep_nmt.tools.diagnostics and `hf-deep-nmt inspect`) checked against hand computations on tiny
models."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_deep_nmt import DeepNMTForConditionalGeneration, DlclConfig
from hf_deep_nmt.cli import main as cli_main
from hf_deep_nmt.data.corpus import load_parallel_dataset, sample_corpus_dir
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.tools.diagnostics import (
    GradientNormCallback,
    combination_weights,
    layer_gradient_norms,
    layer_outputs,
    layer_similarity,
    mask_small_weights,
    parameter_gradient_norms,
    similarity_from_states,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def make_batch(vocab=37, lengths=((5, 4), (3, 6)), pad=1, seed=0):
    """Two pairs with different source/target lengths, padded like DataCollatorForSeq2Seq (labels padded with -100)."""
    generator = torch.Generator().manual_seed(seed)
    source_len = max(s for s, _ in lengths)
    target_len = max(t for _, t in lengths)
    input_ids = torch.full((len(lengths), source_len), pad)
    attention_mask = torch.zeros((len(lengths), source_len), dtype=torch.long)
    labels = torch.full((len(lengths), target_len), -100)
    for row, (s, t) in enumerate(lengths):
        input_ids[row, :s] = torch.randint(4, vocab, (s,), generator=generator)
        attention_mask[row, :s] = 1
        labels[row, :t] = torch.randint(4, vocab, (t,), generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ---- gradient norms -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(pre_norm=False, layer_aggregation="dlcl"), dict(msc_block_layers=[2, 1])],
    ids=["pre", "dlcl", "msc"],
)
def test_parameter_gradient_norms_equal_the_norm_of_autograd_gradients_per_layer(tiny_config, random_model, overrides):
    model = random_model(tiny_config(**overrides))
    batch = make_batch()
    norms = layer_gradient_norms(model, batch)
    # independent route: torch.autograd.grad of the loss with respect to each layer's parameters
    loss = model(**batch).loss
    for side in ("encoder", "decoder"):
        layers = getattr(model.model, side).layers
        assert len(norms[side]) == len(layers)
        for layer, value in zip(layers, norms[side]):
            grads = torch.autograd.grad(loss, list(layer.parameters()), retain_graph=True)
            expected = math.sqrt(sum(float((g**2).sum()) for g in grads))
            assert value == pytest.approx(expected, rel=1e-5)
            assert value > 0


def test_gradient_norms_put_back_the_gradients_the_model_held(tiny_config, random_model):
    model = random_model(tiny_config())
    params = list(model.parameters())
    for index, p in enumerate(params):
        p.grad = torch.full_like(p, float(index))
    params[0].grad = None
    layer_gradient_norms(model, make_batch())
    assert params[0].grad is None
    assert all(torch.equal(p.grad, torch.full_like(p, float(i))) for i, p in enumerate(params) if i)


def test_parameter_gradient_norms_by_hand_from_constant_gradients(tiny_config):
    model = DeepNMTForConditionalGeneration(tiny_config())
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    norms = parameter_gradient_norms(model)
    for side in ("encoder", "decoder"):
        for layer, value in zip(getattr(model.model, side).layers, norms[side]):
            count = sum(p.numel() for p in layer.parameters())
            assert value == pytest.approx(3.0 * math.sqrt(count))
    # a layer without gradients counts as zero
    for p in model.model.encoder.layers[1].parameters():
        p.grad = None
    assert parameter_gradient_norms(model, sides="encoder")["encoder"][1] == 0.0


def test_output_gradient_norms_equal_autograd_gradients_of_the_layer_outputs(tiny_config, random_model):
    model = random_model(tiny_config(pre_norm=False))
    batch = make_batch()
    norms = layer_gradient_norms(model, batch, kind="outputs")
    captured = {"encoder": [], "decoder": []}
    handles = [
        layer.register_forward_hook(lambda m, a, out, side=side: captured[side].append(out))
        for side in captured
        for layer in getattr(model.model, side).layers
    ]
    loss = model(**batch).loss
    for handle in handles:
        handle.remove()
    for side, outputs in captured.items():
        grads = torch.autograd.grad(loss, outputs, retain_graph=True)
        assert norms[side] == pytest.approx([float(g.norm()) for g in grads], rel=1e-5)


def test_post_norm_top_decoder_layer_receives_larger_gradients_than_bottom(tiny_config):
    # DS-Init Fig. 1 in miniature: 6-layer post-norm decoder at init, default vs depth-scaled initialisation
    sizes = dict(encoder_layers=6, decoder_layers=6, pre_norm=False, d_model=32, encoder_ffn_dim=64)
    batch = make_batch(lengths=((9, 12), (11, 10), (7, 12)))
    torch.manual_seed(0)
    plain = layer_gradient_norms(DeepNMTForConditionalGeneration(tiny_config(**sizes)), batch)["decoder"]
    torch.manual_seed(0)
    scaled = layer_gradient_norms(DeepNMTForConditionalGeneration(tiny_config(**sizes, init_scheme="ds_init")), batch)[
        "decoder"
    ]
    assert plain[0] / plain[-1] < scaled[0] / scaled[-1]


def test_gradient_norm_errors_name_the_bad_value(tiny_config):
    model = DeepNMTForConditionalGeneration(tiny_config())
    batch = make_batch()
    with pytest.raises(ValueError, match="`kind` must be one of .*'weights'"):
        layer_gradient_norms(model, batch, kind="weights")
    with pytest.raises(ValueError, match="needs `labels`"):
        layer_gradient_norms(model, {k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(ValueError, match="'middle'"):
        layer_gradient_norms(model, batch, sides=("middle",))
    with pytest.raises(ValueError, match="`every` must be a positive integer, got 0"):
        GradientNormCallback(every=0)


def test_callback_averages_the_norms_over_each_window(tiny_config, tmp_path):
    model = DeepNMTForConditionalGeneration(tiny_config())
    log = tmp_path / "norms.jsonl"
    callback = GradientNormCallback(every=2, sides=("encoder",), output_file=log)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in model.model.encoder.layers]
    for step, value in enumerate([1.0, 3.0, 5.0, 5.0]):
        for p in model.parameters():
            p.grad = torch.full_like(p, value)
        callback.on_pre_optimizer_step(
            None, SimpleNamespace(global_step=step, is_world_process_zero=True), None, model
        )
    # window 1: mean of 1*sqrt(n) and 3*sqrt(n) = 2*sqrt(n); window 2: 5*sqrt(n)
    assert [record["step"] for record in callback.history] == [2, 4]
    assert callback.history[0]["encoder"] == pytest.approx([2.0 * math.sqrt(n) for n in counts])
    assert callback.history[1]["encoder"] == pytest.approx([5.0 * math.sqrt(n) for n in counts])
    assert "decoder" not in callback.history[0]
    assert [json.loads(line) for line in log.read_text().splitlines()] == callback.history


def test_callback_records_during_trainer_training(tiny_config, tmp_path):
    model = DeepNMTForConditionalGeneration(tiny_config())
    rows = [{k: v[i].tolist() for k, v in make_batch(seed=s).items()} for s in range(2) for i in range(2)]
    rows = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"], "labels": r["labels"]} for r in rows]
    callback = GradientNormCallback(every=1)
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "run"),
        per_device_train_batch_size=2,
        max_steps=2,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        remove_unused_columns=False,
    )

    def collate(items):
        return {key: torch.tensor([item[key] for item in items]) for key in items[0]}

    Seq2SeqTrainer(model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[callback]).train()
    assert [record["step"] for record in callback.history] == [1, 2]
    assert all(len(r["encoder"]) == 3 and len(r["decoder"]) == 2 for r in callback.history)
    assert all(value > 0 for r in callback.history for value in r["encoder"] + r["decoder"])


# ---- combination weights --------------------------------------------------------------------------------------------


def test_mask_small_weights_by_hand():
    weight = torch.tensor(
        [
            [1.0, 9.0, 9.0],
            [0.5, 0.02, 9.0],  # 0.02 < 0.1
            [4.0, 0.15, -0.3],  # 0.15 < 5% of 4 = 0.2; -0.3 kept (absolute value)
        ]
    )
    masked = mask_small_weights(weight)
    expected_kept = torch.tensor([[1, 0, 0], [1, 0, 0], [1, 0, 1]], dtype=torch.bool)
    assert torch.equal(~masked.isnan(), expected_kept)
    assert masked[2, 2] == -0.3 and masked[1, 0] == 0.5
    # thresholds are settings
    assert not mask_small_weights(weight, absolute=0.0, relative=0.0)[1, 1].isnan()
    with pytest.raises(ValueError, match="square matrix"):
        mask_small_weights(torch.ones(2, 3))


def test_combination_weights_read_the_learned_dlcl_and_sparse_matrices(tiny_config):
    model = DeepNMTForConditionalGeneration(
        tiny_config(
            encoder_layer_aggregation="sparse", encoder_block_boundaries=[0, 2, 3], decoder_layer_aggregation="dlcl"
        )
    )
    encoder_weight = torch.arange(9.0).view(3, 3)
    with torch.no_grad():
        model.model.encoder.history.weight.copy_(encoder_weight)
    weights = combination_weights(model)
    assert weights["encoder"]["boundaries"] == [0, 2, 3]
    assert torch.equal(weights["encoder"]["weight"], encoder_weight.tril())
    assert weights["decoder"]["boundaries"] == [0, 1, 2]
    # the DLCL initialisation: row r is the uniform average 1/(r+1) of outputs 0..r
    assert torch.allclose(weights["decoder"]["weight"], torch.tensor([[1, 0, 0], [1 / 2, 1 / 2, 0], [1 / 3] * 3]))
    assert combination_weights(DeepNMTForConditionalGeneration(tiny_config())) == {}


# ---- layer similarity -----------------------------------------------------------------------------------------------


def test_similarity_from_states_by_hand():
    # one sequence of 2 valid positions and one padded position (whose values must not count)
    y0 = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]])
    y1 = torch.tensor([[[1.0, 1.0], [0.0, 2.0], [-5.0, 5.0]]])
    y2 = torch.tensor([[[2.0, 0.0], [-1.0, 0.0], [7.0, 1.0]]])
    mask = torch.tensor([[1, 1, 0]])
    sims = similarity_from_states([y0, y1, y2], mask)
    r = 1 / math.sqrt(2)
    # sim(1,0): cos([1,1],[1,0]) = r, cos([0,2],[0,1]) = 1;  sim(2,0): 1 and 0;  sim(2,1): r and 0
    assert sims["to_embedding"] == pytest.approx([(r + 1) / 2, 0.5])
    assert sims["adjacent"] == pytest.approx([(r + 1) / 2, r / 2])
    # inter: mean of y0 = [.5,.5] -> cos r and r;  mean of y1 = [.5,1.5]: cos([1,1],.) and cos([0,2],.)
    m1 = torch.tensor([0.5, 1.5])
    inter1 = (float(torch.cosine_similarity(torch.tensor([1.0, 1.0]), m1, 0)) + float(m1[1] / m1.norm())) / 2
    # y2 mean = [.5, 0]: cos 1 and -1
    assert sims["inter"] == pytest.approx([r, inter1, 0.0])


def test_similarity_averages_sequences_not_positions():
    y0 = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [9.0, 9.0], [9.0, 9.0]]])
    y1 = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [9.0, 9.0], [9.0, 9.0]]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # sequence 1: 1.0 (three positions); sequence 2: 0.0 (one position) -> 0.5, not 3/4
    assert similarity_from_states([y0, y1], mask)["to_embedding"] == pytest.approx([0.5])


def test_layer_outputs_are_the_embedding_and_each_layer_output(tiny_config, random_model):
    model = random_model(tiny_config(pre_norm=True))
    batch = make_batch()
    states = layer_outputs(model, batch)
    encoder = model.model.encoder
    assert torch.allclose(states[0], encoder.embed(batch["input_ids"]))
    mask = torch.zeros(batch["attention_mask"].shape).masked_fill(batch["attention_mask"] == 0, torch.finfo().min)
    mask = mask[:, None, None, :]
    with torch.no_grad():
        for index, layer in enumerate(encoder.layers):
            assert torch.allclose(states[index + 1], layer(states[index], mask), atol=1e-6)
        assert torch.allclose(
            encoder.layer_norm(states[-1]),
            model.model.encoder(**{k: batch[k] for k in ("input_ids", "attention_mask")}).last_hidden_state,
            atol=1e-6,
        )


@pytest.mark.parametrize("side", ["encoder", "decoder"])
@pytest.mark.parametrize(
    "overrides", [dict(layer_aggregation="dlcl"), dict(msc_block_layers=[1, 2])], ids=["dlcl", "msc"]
)
def test_layer_similarity_ignores_padding(tiny_config, random_model, side, overrides):
    model = random_model(tiny_config(**overrides))
    short = make_batch(lengths=((4, 5),))
    padded = {key: value.clone() for key, value in make_batch(lengths=((4, 5), (8, 9))).items()}
    for key in short:
        width = short[key].shape[1]
        padded[key][0] = padded[key][0].fill_(-100 if key == "labels" else (0 if key == "attention_mask" else 1))
        padded[key][0, :width] = short[key][0]
    padded = {key: value[:1] for key, value in padded.items()}  # the short pair with extra padding
    expected, got = layer_similarity(model, short, side), layer_similarity(model, padded, side)
    for key in ("to_embedding", "adjacent", "inter"):
        assert got[key] == pytest.approx(expected[key], abs=1e-5)
    assert len(expected["to_embedding"]) == len(getattr(model.model, side).layers)
    assert len(expected["inter"]) == len(getattr(model.model, side).layers) + 1
    assert model.training is False


# ---- CLI ------------------------------------------------------------------------------------------------------------


def test_inspect_cli_writes_pngs_and_json(tmp_path, tiny_config):
    from PIL import Image

    raw = load_parallel_dataset(sample_corpus_dir() / "train.tsv")["train"].select(range(400))
    tokenizer = train_joint_tokenizer(zip(raw["source"], raw["target"]), vocab_size=300)
    torch.manual_seed(0)
    config = tiny_config(DlclConfig, vocab_size=len(tokenizer))
    from hf_deep_nmt import DlclForConditionalGeneration

    model_dir = tmp_path / "model"
    DlclForConditionalGeneration(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "inspect"
    argv = ["inspect", "--model", str(model_dir), "--num-sentences", "4", "--output", str(out)]
    assert cli_main(argv) == 0

    summary = json.loads((out / "inspect.json").read_text())
    assert {"gradient_norms", "output_gradient_norms", "layer_similarity", "combination_weights", "files"} <= set(
        summary
    )
    assert summary["num_sentences"] == 4 and summary["model_type"] == "deep_nmt_dlcl"
    assert [len(summary["gradient_norms"][s]) for s in ("encoder", "decoder")] == [3, 2]
    assert len(summary["layer_similarity"]["encoder"]["inter"]) == 4
    assert summary["combination_weights"]["encoder"]["boundaries"] == [0, 1, 2, 3]
    assert len(summary["combination_weights"]["decoder"]["weight"]) == 3
    pngs = ["gradient_norms.png", "layer_similarity.png", "combination_weights_encoder.png"]
    pngs.append("combination_weights_decoder.png")
    assert sorted(summary["files"]) == sorted(["inspect.json"] + pngs)
    for name in pngs:
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
        with Image.open(out / name) as image:
            assert image.format == "PNG" and image.size[0] > 200 and image.size[1] > 150

    # an earlier run's files are not replaced without --overwrite
    before = (out / "inspect.json").read_bytes()
    assert cli_main(argv) == 2
    assert (out / "inspect.json").read_bytes() == before
    assert cli_main(argv + ["--overwrite"]) == 0
    assert cli_main(argv[:-2] + ["--num-sentences", "0", "--output", str(tmp_path / "other")]) == 2


def test_inspect_refuses_a_model_of_another_package_naming_it(tmp_path):
    from transformers import MarianConfig, MarianMTModel

    from hf_deep_nmt.tools.inspection import inspect_model

    sizes = dict(d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=8, decoder_ffn_dim=8)
    marian = MarianMTModel(MarianConfig(vocab_size=37, pad_token_id=1, decoder_start_token_id=0, **sizes))
    with pytest.raises(
        ValueError, match=r"inspect measures models of this package .* got MarianMTModel \(model_type 'marian'\)"
    ):
        inspect_model(marian, tmp_path / "out", tokenizer=object())
    assert not (tmp_path / "out").exists()
