"""Compiled CPU training graphs save no boolean tensor of activation size: the dropout and ReLU traced in a compiled
CPU training forward (`DeepNMTCompiledCpuDropout`, `DeepNMTCompiledCpuReLU`) compute what `F.dropout` and `F.relu`
compute, with the kept positions saved as uint8 and the ReLU gradient taken from the saved output; and
`DeepNMTTrainer` with `torch_compile=True` compiles the model without a graph break."""

import pytest
import torch
from torch.nn import functional as F

from hf_deep_nmt.modeling.kernels_deep_nmt import (
    DeepNMTCompiledCpuDropout,
    DeepNMTCompiledCpuReLU,
    DeepNMTReLU,
    activation_function,
    dropout,
)
from hf_deep_nmt.tools import doctor


def test_the_compiled_relu_has_relu_values_and_gradients():
    inputs = torch.tensor([-2.0, -0.0, 0.0, 1e-30, 0.5, 3.0, -1e-30]).repeat(3)
    inputs = torch.cat([inputs, torch.randn(1000, generator=torch.Generator().manual_seed(0))])
    grad_output = torch.randn(inputs.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for relu in (F.relu, DeepNMTCompiledCpuReLU.apply):
        leaf = inputs.clone().requires_grad_()
        output = relu(leaf)
        output.backward(grad_output)
        results.append((output.detach(), leaf.grad))
    (expected, expected_grad), (output, grad) = results
    assert torch.equal(output, expected)
    assert torch.equal(grad, expected_grad)  # -0.0 == 0.0 where the unit is off
    assert torch.equal(grad[inputs > 0], grad_output[inputs > 0]) and not grad[inputs <= 0].any()


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_the_compiled_dropout_keeps_one_minus_p_and_scales_by_its_inverse(p):
    inputs = torch.randn(400, 500, generator=torch.Generator().manual_seed(0)).requires_grad_()
    grad_output = torch.randn(inputs.shape, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    output = DeepNMTCompiledCpuDropout.apply(inputs, p)
    output.backward(grad_output)
    kept = output.detach() != 0
    scale = 1.0 / (1.0 - p)
    assert torch.equal(output.detach(), inputs.detach() * kept * scale)
    assert torch.equal(inputs.grad, grad_output * kept * scale)
    # 200,000 draws: the kept fraction's standard deviation is under 0.0011
    assert abs(kept.float().mean().item() - (1 - p)) < 0.01
    torch.manual_seed(2)
    assert torch.equal(DeepNMTCompiledCpuDropout.apply(inputs, p), output)  # seeded by torch's generator


def test_eager_code_keeps_torch_dropout_and_relu():
    """Outside a compiled graph nothing changes: the same draws as `F.dropout`, and `F.relu`."""
    inputs = torch.randn(64, 32, requires_grad=True)
    for training, p in ((True, 0.1), (False, 0.1), (True, 0.0), (True, 1.0)):
        torch.manual_seed(0)
        ours = dropout(inputs, p, training)
        torch.manual_seed(0)
        assert torch.equal(ours, F.dropout(inputs, p=p, training=training))
    assert isinstance(activation_function("relu"), DeepNMTReLU)
    assert torch.equal(activation_function("relu")(inputs), F.relu(inputs))
    assert type(activation_function("gelu")).__name__ == "GELUActivation"


def saved_tensors_of_a_compiled_training_forward(model, batch) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    torch._dynamo.reset()
    # Which tensors a training graph saves is settled before code generation, by Inductor's decompositions and its
    # min-cut partition of the forward and backward; `aot_eager_decomp_partition` runs exactly those and skips the C++
    # compile (measured: the same saved tensors as `inductor`, with and without this package's dropout and ReLU, in
    # 3.9 CPU s against 11-14 on an idle machine).
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager_decomp_partition")
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = compiled(**batch).loss
    loss.backward()
    return saved


def test_a_compiled_cpu_training_graph_saves_no_boolean_activation_mask():
    """With dropout everywhere and a ReLU feed-forward, Inductor's training graph (its decompositions and partition,
    `saved_tensors_of_a_compiled_training_forward`) saves the kept positions as uint8 and no boolean tensor as large as
    a layer's activations (those are slow to write on the CPU). One layer a stack: every layer traces the same dropout
    and ReLU, and the tracing time grows with the layers."""
    model = doctor.family_model(
        "dlcl-prenorm",
        "cpu",
        dropout=0.1,
        activation_dropout=0.1,
        activation_function="relu",
        encoder_layers=1,
        decoder_layers=1,
    ).train()
    batch = doctor.padded_batch("cpu", [9, 6], model.config.vocab_size)
    activations = min(batch["input_ids"].numel(), batch["labels"].numel()) * model.config.d_model
    saved = saved_tensors_of_a_compiled_training_forward(model, batch)
    model.eval()
    large = [tensor for tensor in saved if tensor.numel() >= activations]
    assert not [tuple(tensor.shape) for tensor in large if tensor.dtype == torch.bool]
    assert any(tensor.dtype == torch.uint8 for tensor in large)  # the dropout masks


def trainer_run(tmp_path, compile_model: bool, poison: bool = False, **arguments):
    from datasets import Dataset
    from transformers import default_data_collator

    from hf_deep_nmt.training.arguments import DeepNMTTrainingArguments
    from hf_deep_nmt.training.trainer import DeepNMTTrainer

    model = doctor.family_model("dlcl-prenorm", "cpu").train()
    if poison:  # a NaN training loss from the first step on

        def nan_loss(module, inputs, outputs):
            outputs.loss = outputs.loss * float("nan")
            return outputs

        model.register_forward_hook(nan_loss)
    tokens = torch.randint(3, 60, (16, 6), generator=torch.Generator().manual_seed(0))
    dataset = Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.flip(1).tolist()})
    args = DeepNMTTrainingArguments(
        output_dir=str(tmp_path / f"run-{compile_model}"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
        torch_compile=compile_model,
        torch_compile_backend="aot_eager" if compile_model else None,
        **arguments,
    )
    trainer = DeepNMTTrainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


def test_the_trainer_compiles_the_model_without_a_graph_break_and_trains_as_eager(tmp_path):
    """`torch_compile=True`: the non-finite loss check (a forward hook reading the loss on the host) runs after the
    compiled forward instead of breaking its graph, and the run is the eager run."""
    from torch._dynamo.utils import counters

    # plain SGD: Adam would turn the rounding noise of near-zero gradients (key biases) into full-size steps
    eager_losses, eager_weights = trainer_run(tmp_path, compile_model=False, optim="sgd")
    torch._dynamo.reset()
    counters.clear()
    compiled_losses, compiled_weights = trainer_run(tmp_path, compile_model=True, optim="sgd")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert len(compiled_losses) == 3
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-5, atol=1e-6)
    for name, weight in eager_weights.items():
        torch.testing.assert_close(compiled_weights[name], weight, rtol=1e-4, atol=1e-6, msg=name)


def test_a_compiled_trainer_still_stops_on_a_non_finite_loss(tmp_path):
    from hf_deep_nmt.training.callbacks import NonFiniteTrainingError

    torch._dynamo.reset()
    with pytest.raises(NonFiniteTrainingError, match="The training loss is nan at optimizer step 1"):
        trainer_run(tmp_path, compile_model=True, poison=True, max_consecutive_nonfinite_steps=0)
