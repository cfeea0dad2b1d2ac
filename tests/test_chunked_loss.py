"""The training loss through the output layer in chunks (`DeepNMTChunkedLinearCrossEntropy`): the loss and gradients of
`F.cross_entropy` on the whole logits, with ignored tokens and label smoothing, in any chunking; the model's training
step uses it (no logits made or saved) and gives the plain path's loss and gradients; `DeepNMTTrainer` hands label
smoothing to the model and gets the library's smoothed loss."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.trainer_pt_utils import LabelSmoother

from hf_deep_nmt import DeepNMTForConditionalGeneration
from hf_deep_nmt.modeling import kernels_deep_nmt
from hf_deep_nmt.modeling.kernels_deep_nmt import chunked_linear_cross_entropy
from hf_deep_nmt.training.pipeline import DeepNMTTrainer, DeepNMTTrainingArguments

VOCABULARY = 37


def loss_inputs(dtype=torch.float64, tokens=11):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 8, generator=generator, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCABULARY, 8, generator=generator, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, VOCABULARY, (tokens,), generator=generator)
    labels[[2, 7]] = -100
    return hidden, weight, labels


def gradients(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("chunk_rows", [1, 3, 11, 64])
def test_equals_cross_entropy_of_the_whole_logits(monkeypatch, label_smoothing, chunk_rows):
    monkeypatch.setitem(kernels_deep_nmt.LOSS_CHUNK_VALUES, "cpu", chunk_rows * VOCABULARY)
    hidden, weight, labels = loss_inputs()
    expected = F.cross_entropy(hidden @ weight.T, labels, ignore_index=-100, label_smoothing=label_smoothing)
    loss = chunked_linear_cross_entropy(hidden, weight, labels, label_smoothing)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    # scaled by an upstream gradient, as the Trainer's gradient accumulation does
    for got, want in zip(gradients(loss * 0.25, hidden, weight), gradients(expected * 0.25, hidden, weight)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_ignored_tokens_get_no_gradient_and_all_ignored_gives_nan_as_cross_entropy():
    hidden, weight, labels = loss_inputs()
    (grad_hidden,) = gradients(chunked_linear_cross_entropy(hidden, weight, labels), hidden)
    assert grad_hidden[[2, 7]].abs().max() == 0 and grad_hidden[0].abs().max() > 0
    nothing = torch.full_like(labels, -100)
    assert torch.isnan(F.cross_entropy(hidden @ weight.T, nothing, ignore_index=-100))
    assert torch.isnan(chunked_linear_cross_entropy(hidden, weight, nothing))


def test_a_label_outside_the_vocabulary_is_an_error():
    hidden, weight, labels = loss_inputs()
    labels[0] = VOCABULARY
    with pytest.raises((RuntimeError, IndexError)):
        chunked_linear_cross_entropy(hidden, weight, labels)


def test_only_what_needs_a_gradient_gets_one():
    hidden, weight, labels = loss_inputs()
    frozen = weight.detach()
    loss = chunked_linear_cross_entropy(hidden, frozen, labels)
    (grad_hidden,) = gradients(loss, hidden)
    torch.testing.assert_close(grad_hidden, gradients(F.cross_entropy(hidden @ frozen.T, labels), hidden)[0])


def test_under_autocast_the_products_run_in_bfloat16_and_the_loss_in_float32():
    hidden, weight, labels = loss_inputs(torch.float32, tokens=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.cross_entropy(F.linear(hidden, weight).float(), labels)
        loss = chunked_linear_cross_entropy(hidden, weight, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-3, atol=1e-3)
    got, want = gradients(loss, hidden, weight), gradients(expected, hidden, weight)
    for grad, reference, tensor in zip(got, want, (hidden, weight)):
        assert grad.dtype == tensor.dtype == torch.float32
        torch.testing.assert_close(grad, reference, rtol=2e-2, atol=2e-3)


# ------------------------------------------------------------------------------------------------------------ model
@pytest.fixture
def tiny_model(tiny_config):
    def make(**overrides) -> DeepNMTForConditionalGeneration:
        torch.manual_seed(0)
        return DeepNMTForConditionalGeneration(tiny_config(**overrides))

    return make


def model_batch():
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(3, VOCABULARY, (3, 7), generator=generator)
    labels = torch.randint(3, VOCABULARY, (3, 5), generator=generator)
    attention_mask = torch.ones_like(source)
    attention_mask[0, 5:] = 0
    source[0, 5:] = 1
    labels[1, 3:] = -100
    return {"input_ids": source, "attention_mask": attention_mask, "labels": labels}


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("share_embeddings", [True, False])
def test_training_step_gives_the_plain_loss_and_gradients_without_logits(
    tiny_model, label_smoothing, share_embeddings
):
    model = tiny_model(share_embeddings=share_embeddings, encoder_l2_lambda=1e-3).train()
    batch = model_batch()
    chunked = model(**batch, label_smoothing=label_smoothing)
    assert chunked.logits is None
    plain = model(**batch, label_smoothing=label_smoothing, return_logits=True)
    assert plain.logits.shape == (3, 5, VOCABULARY)
    logits = plain.logits.reshape(-1, VOCABULARY)
    by_hand = F.cross_entropy(logits, batch["labels"].reshape(-1), label_smoothing=label_smoothing)
    torch.testing.assert_close(plain.loss, by_hand + 1e-3 * model.encoder_l2_penalty())
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-6, atol=1e-6)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for got, want in zip(gradients(chunked.loss, *parameters), gradients(plain.loss, *parameters)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_every_architecture_trains_on_the_chunked_loss_as_on_the_plain_one(architecture_config, random_model):
    model = random_model(architecture_config).train()
    batch = model_batch()
    chunked = model(**batch, label_smoothing=0.1)
    plain = model(**batch, label_smoothing=0.1, return_logits=True)
    assert chunked.logits is None and plain.logits is not None
    torch.testing.assert_close(chunked.loss, plain.loss, rtol=1e-6, atol=1e-6)
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for got, want in zip(gradients(chunked.loss, *parameters), gradients(plain.loss, *parameters)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_evaluation_and_no_grad_forwards_keep_their_logits(tiny_model):
    model = tiny_model()
    batch = model_batch()
    evaluated = model.eval()(**batch)
    assert evaluated.logits is not None and evaluated.loss is not None
    with torch.no_grad():
        assert model.train()(**batch).logits is not None
    assert model.train()(
        **{key: batch[key] for key in ("input_ids", "attention_mask")}, decoder_input_ids=batch["input_ids"]
    ).logits.shape == (3, 7, VOCABULARY)


def test_no_tokens_by_vocabulary_tensor_is_saved_for_the_backward(tiny_model):
    model = tiny_model().train()
    batch = model_batch()
    tokens = batch["labels"].numel()

    def saved_logit_sized(**extra) -> list[tuple[int, ...]]:
        shapes = []

        def pack(tensor):
            shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(**batch, **extra)
        return [shape for shape in shapes if shape and shape[-1] == VOCABULARY and math.prod(shape) >= tokens]

    assert (tokens, VOCABULARY) in saved_logit_sized(return_logits=True)  # the plain loss saves its log-softmax
    assert saved_logit_sized() == []


def test_a_hooked_output_layer_is_called_and_bad_smoothing_is_refused(tiny_model):
    model = tiny_model().train()
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    output = model(**model_batch())
    assert calls == [(3, 5, VOCABULARY)] and output.logits is not None
    with pytest.raises(ValueError, match=r"label_smoothing.*\[0, 1\].*1\.5"):
        model(**model_batch(), label_smoothing=1.5)


# ---------------------------------------------------------------------------------------------------------- trainer
def test_trainer_label_smoothing_is_the_library_smoother_loss(tiny_model, tmp_path):
    model = tiny_model().train()
    batch = model_batch()
    args = DeepNMTTrainingArguments(
        output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to="none", use_cpu=True, save_strategy="no"
    )
    trainer = DeepNMTTrainer(model=model, args=args)
    loss, outputs = trainer.compute_loss(model, dict(batch), return_outputs=True)
    assert outputs.logits is None  # the model smoothed its own loss, through the chunked path
    reference = LabelSmoother(epsilon=0.1)(model(**batch, return_logits=True), batch["labels"])
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    # an evaluation forward: the model's smoothed loss on its logits, as before
    model.eval()
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(model, dict(batch), return_outputs=True)
        reference = LabelSmoother(epsilon=0.1)(model(**batch), batch["labels"])
    assert outputs.logits is not None
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)


def test_the_trainer_refuses_a_smoothing_factor_outside_0_1(tiny_model, tmp_path):
    settings = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no")
    # refused where the arguments are made (before any work)...
    with pytest.raises(ValueError, match=r"`label_smoothing_factor` must be in \[0, 1\).*got 1\.5"):
        DeepNMTTrainingArguments(label_smoothing_factor=1.5, **settings)
    # ... and by the trainer, for arguments changed after they were checked
    args = DeepNMTTrainingArguments(**settings)
    for value in (1.5, 1.0):
        args.label_smoothing_factor = value
        with pytest.raises(ValueError, match=rf"`label_smoothing_factor` must be in \[0, 1\).*got {value}"):
            DeepNMTTrainer(model=tiny_model(), args=args)
