"""Model behaviour: padding invariance, save/load, DLCL maths against hand computations, loss, embeddings, sizes."""

import copy
import inspect
import math

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForSeq2SeqLM

from hf_deep_nmt import (
    METHODS,
    MODEL_CLASSES,
    DeepNMTConfig,
    DeepNMTForConditionalGeneration,
    DlclConfig,
    DlclForConditionalGeneration,
    MscConfig,
)
from hf_deep_nmt.modeling.configuration_deep_nmt import DECODER_SELF_ATTENTIONS, LAYER_AGGREGATIONS
from hf_deep_nmt.modeling.modeling_deep_nmt import (
    DECODER_ATTENTION_CLASSES,
    LAYER_AGGREGATION_CLASSES,
    DeepNMTEncoderOutput,
    DeepNMTLinear,
    shift_tokens_right,
)

LOSS_KEYS = ("missing_keys", "unexpected_keys", "mismatched_keys")
# the named classes of the registered methods (`METHODS`), each with the config it takes
NAMED_MODEL_CLASSES = {
    method.model_class: method.config_class for method in METHODS.values() if method.config_class is not DeepNMTConfig
}


def model_inputs(batch: dict) -> dict:
    return {key: batch[key] for key in ("input_ids", "attention_mask", "labels", "decoder_attention_mask")}


def assert_loads_cleanly(info: dict) -> None:
    assert {key: set(info[key]) for key in LOSS_KEYS} == {key: set() for key in LOSS_KEYS}
    assert not info["error_msgs"]


# ---- padding ----------------------------------------------------------------------------------------------------


def test_padded_batch_matches_each_sentence_alone(architecture_config, random_model, padded_batch):
    model = random_model(architecture_config)
    with torch.no_grad():
        batched = model(**model_inputs(padded_batch))
        unmasked = model(input_ids=padded_batch["input_ids"], labels=padded_batch["labels"])
        weighted_loss = 0.0
        for row, (source_length, target_length) in enumerate(
            zip(padded_batch["source_lengths"], padded_batch["target_lengths"])
        ):
            alone = model(
                input_ids=padded_batch["input_ids"][row : row + 1, :source_length],
                labels=padded_batch["labels"][row : row + 1, :target_length],
            )
            torch.testing.assert_close(
                batched.encoder_last_hidden_state[row, :source_length], alone.encoder_last_hidden_state[0]
            )
            torch.testing.assert_close(batched.logits[row, :target_length], alone.logits[0])
            weighted_loss = weighted_loss + alone.loss * target_length
    # the loss is a mean over all target tokens of the batch
    torch.testing.assert_close(batched.loss, weighted_loss / sum(padded_batch["target_lengths"]))
    # the check has teeth: without the source mask the padded sentence reads its padding
    assert not torch.allclose(unmasked.logits[1, :2], batched.logits[1, :2], atol=1e-4)


# ---- save / load --------------------------------------------------------------------------------------------------


def test_save_and_load_give_identical_logits(architecture_config, random_model, padded_batch, tmp_path):
    model = random_model(architecture_config)
    with torch.no_grad():
        expected = model(**model_inputs(padded_batch)).logits
    model.save_pretrained(tmp_path)
    for loader in (type(model), AutoModelForSeq2SeqLM):
        loaded, info = loader.from_pretrained(tmp_path, output_loading_info=True)
        assert type(loaded) is type(model)
        assert_loads_cleanly(info)
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name
        with torch.no_grad():
            assert torch.equal(loaded.eval()(**model_inputs(padded_batch)).logits, expected)


@pytest.mark.parametrize("mode", ["average", "one"])
def test_fixed_dlcl_weights_are_saved_and_stay_frozen_after_loading(tiny_config, random_model, tmp_path, mode):
    model = random_model(tiny_config(DeepNMTConfig, layer_aggregation="dlcl", dlcl_weights=mode))
    with torch.no_grad():  # whether a parameter or a buffer, the saved weights must not be re-initialised
        for stack in (model.model.encoder, model.model.decoder):
            stack.history.weight.add_(torch.rand_like(stack.history.weight) + 0.1)
    model.save_pretrained(tmp_path)
    loaded = DeepNMTForConditionalGeneration.from_pretrained(tmp_path)
    for stack in ("encoder", "decoder"):
        weight = getattr(loaded.model, stack).history.weight
        assert torch.equal(weight, getattr(model.model, stack).history.weight)
        assert not weight.requires_grad


@pytest.mark.parametrize(
    ("share_embeddings", "tie_word_embeddings"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_embedding_sharing_and_tying_survive_save_and_load(
    tiny_config, random_model, padded_batch, tmp_path, share_embeddings, tie_word_embeddings
):
    config = tiny_config(
        DeepNMTConfig,
        share_embeddings=share_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        decoder_vocab_size=37 if share_embeddings else 29,
    )
    model = random_model(config)
    with torch.no_grad():
        expected = model(**model_inputs(padded_batch)).logits
    assert expected.shape == (2, 4, config.decoder_vocab_size)
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, output_loading_info=True)
    assert_loads_cleanly(info)
    for candidate in (model, loaded):
        shared = candidate.model.shared.weight
        decoder_embedding = candidate.model.decoder.embed_tokens.weight
        assert candidate.model.encoder.embed_tokens.weight is shared
        assert (decoder_embedding is shared) == share_embeddings
        assert decoder_embedding.shape == (config.decoder_vocab_size, 16)
        assert (candidate.lm_head.weight is decoder_embedding) == tie_word_embeddings
    with torch.no_grad():
        assert torch.equal(loaded(**model_inputs(padded_batch)).logits, expected)


def test_resized_shared_embeddings_save_and_load(tiny_config, random_model, tmp_path):
    model = random_model(tiny_config(DeepNMTConfig))
    model.resize_token_embeddings(41, mean_resizing=False)
    assert model.lm_head.weight is model.model.shared.weight and model.lm_head.weight.shape == (41, 16)
    inputs = {"input_ids": torch.tensor([[5, 40, 2]]), "decoder_input_ids": torch.tensor([[0, 39]])}
    with torch.no_grad():
        expected = model(**inputs).logits
    assert expected.shape == (1, 2, 41)
    model.save_pretrained(tmp_path)
    loaded = DeepNMTForConditionalGeneration.from_pretrained(tmp_path)
    assert (loaded.config.vocab_size, loaded.config.decoder_vocab_size) == (41, 41)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, expected)


# ---- DLCL ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_dlcl_with_residual_weights_computes_the_residual_network(tiny_config, random_model, padded_batch, pre_norm):
    residual = random_model(tiny_config(DeepNMTConfig, pre_norm=pre_norm))
    dlcl = DeepNMTForConditionalGeneration(
        tiny_config(DeepNMTConfig, pre_norm=pre_norm, layer_aggregation="dlcl", dlcl_history_norm=False)
    ).eval()
    result = dlcl.load_state_dict(residual.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert sorted(result.missing_keys) == ["model.decoder.history.weight", "model.encoder.history.weight"]
    with torch.no_grad():
        expected = residual(**model_inputs(padded_batch))
        averaged = dlcl(**model_inputs(padded_batch)).logits  # still the average initialisation
        for stack in (dlcl.model.encoder, dlcl.model.decoder):
            stack.history.weight.copy_(torch.eye(len(stack.layers) + 1))  # W[r][r] = 1, all others 0
        combined = dlcl(**model_inputs(padded_batch))
    assert not torch.allclose(averaged, expected.logits, atol=1e-3)
    torch.testing.assert_close(
        combined.encoder_last_hidden_state, expected.encoder_last_hidden_state, rtol=0, atol=1e-6
    )
    torch.testing.assert_close(combined.logits, expected.logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
@pytest.mark.parametrize("stack_name", ["encoder", "decoder"])
def test_dlcl_layer_input_is_the_hand_weighted_sum(tiny_config, pre_norm, stack_name):
    config = tiny_config(DeepNMTConfig, layer_aggregation="dlcl", pre_norm=pre_norm)
    history = getattr(DeepNMTForConditionalGeneration(config).model, stack_name).history
    num_layers = history.weight.shape[0] - 1
    with torch.no_grad():
        weight = torch.randn(num_layers + 1, num_layers + 1).tril()
        history.weight.copy_(weight.tril() + torch.full_like(weight, 1e3).triu(1))  # above the diagonal: unused
        for norm in history.layer_norms:
            norm.weight.copy_(torch.rand(16) + 0.5)
            norm.bias.copy_(torch.randn(16))
    outputs = [torch.randn(2, 5, 16) * 3 + 1 for _ in range(num_layers + 1)]  # y_0 (embedding) .. y_L

    def norm(index: int, tensor: torch.Tensor) -> torch.Tensor:
        layer_norm = history.layer_norms[index]
        return F.layer_norm(tensor, (16,), layer_norm.weight, layer_norm.bias, config.layer_norm_eps)

    with torch.no_grad():
        for row, output in enumerate(outputs):
            if row == 0:
                state = history.start(output)
            else:
                history.push(state, output, row - 1)  # y_row is the output of layer index row - 1
            if pre_norm:  # Eq. 8: y_k (k >= 1) through its own LayerNorm, never y_0
                terms = [outputs[0]] + [norm(k - 1, outputs[k]) for k in range(1, row + 1)]
                expected = sum(weight[row, k] * terms[k] for k in range(row + 1))
            else:  # Eq. 9: LayerNorm of row r >= 1 on the weighted sum
                expected = sum(weight[row, k] * outputs[k] for k in range(row + 1))
                expected = norm(row - 1, expected) if row >= 1 else expected
            actual = history.stack_output(state) if row == num_layers else history.layer_input(state, row)
            torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_dlcl_gradients_are_those_of_the_hand_weighted_sums(tiny_config, pre_norm):
    """Gradients through every row of the combination (one product per row, backward through a buffer) against
    autograd on the written-out sums: for the stored outputs, the weights (zero above the diagonal) and the
    LayerNorms. The stored outputs are independent leaves and the loss reads only rows 2 and 4: the history itself
    must reach y_0 and y_1 (read by rows 2 to 4) and order the rows in backward."""
    config = tiny_config(DeepNMTConfig, layer_aggregation="dlcl", pre_norm=pre_norm, encoder_layers=4)
    history = DeepNMTForConditionalGeneration(config).model.encoder.history
    torch.manual_seed(3)
    with torch.no_grad():
        history.weight.copy_(torch.randn(5, 5).tril() + torch.full((5, 5), 1e3).triu(1))  # above the diagonal: unused
        for norm in history.layer_norms:
            norm.weight.copy_(torch.rand(16) + 0.5)
            norm.bias.copy_(torch.randn(16))
    outputs = [(torch.randn(2, 3, 16) * 2 + 1).requires_grad_() for _ in range(5)]  # y_0 .. y_4
    probes = {2: torch.randn(2, 3, 16), 4: torch.randn(2, 3, 16)}
    norms = [parameter for norm in history.layer_norms for parameter in norm.parameters()]
    leaves = [*outputs, history.weight, *norms]

    state = history.start(outputs[0])
    rows = [history.layer_input(state, 0)]
    for row in range(1, 5):
        history.push(state, outputs[row], row - 1)
        rows.append(history.stack_output(state) if row == 4 else history.layer_input(state, row))
    actual = torch.autograd.grad((rows[2] * probes[2]).sum() + (rows[4] * probes[4]).sum(), leaves, allow_unused=True)

    terms = [outputs[0]] + [history.layer_norms[k - 1](outputs[k]) if pre_norm else outputs[k] for k in range(1, 5)]
    hand_rows = []
    for row in range(5):
        total = sum(history.weight[row, k] * terms[k] for k in range(row + 1))
        hand_rows.append(history.layer_norms[row - 1](total) if not pre_norm and row >= 1 else total)
    expected = torch.autograd.grad(
        (hand_rows[2] * probes[2]).sum() + (hand_rows[4] * probes[4]).sum(), leaves, allow_unused=True
    )
    for got, want in zip(actual, expected):  # post-norm: the LayerNorms of rows 1 and 3 are not read
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    read = torch.zeros(5, 5, dtype=torch.bool)
    read[2, :3] = read[4] = True  # the weights of the rows the loss reads
    assert torch.equal(actual[5] != 0, read)


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_dlcl_with_residual_weights_has_the_residual_networks_gradients(tiny_config, random_model, pre_norm):
    """Backward of the combination with W = I (each row reads only its newest output) is the residual network's
    backward, parameter for parameter (eval mode: no dropout); the weights get a gradient of their own."""
    residual = random_model(tiny_config(DeepNMTConfig, pre_norm=pre_norm))
    dlcl = DeepNMTForConditionalGeneration(
        tiny_config(DeepNMTConfig, pre_norm=pre_norm, layer_aggregation="dlcl", dlcl_history_norm=False)
    ).eval()
    dlcl.load_state_dict(residual.state_dict(), strict=False)
    with torch.no_grad():
        for stack in (dlcl.model.encoder, dlcl.model.decoder):
            stack.history.weight.copy_(torch.eye(len(stack.layers) + 1))
    inputs = {
        "input_ids": torch.tensor([[5, 6, 7, 2], [8, 9, 2, 1]]),
        "labels": torch.tensor([[5, 9, 2], [7, 2, -100]]),
    }
    residual(**inputs).loss.backward()
    dlcl(**inputs).loss.backward()
    for name, parameter in residual.named_parameters():
        torch.testing.assert_close(dlcl.get_parameter(name).grad, parameter.grad, rtol=1e-5, atol=1e-7)
    for stack in (dlcl.model.encoder, dlcl.model.decoder):
        assert torch.count_nonzero(stack.history.weight.grad.tril()) > 0


@pytest.mark.parametrize("mode", ["learned", "average", "one"])
def test_dlcl_weights_initialisation(tiny_config, mode):
    model = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig, layer_aggregation="dlcl", dlcl_weights=mode))
    for stack in (model.model.encoder, model.model.decoder):
        size = len(stack.layers) + 1
        expected = torch.zeros(size, size)
        for row in range(size):
            for column in range(row + 1):
                expected[row, column] = 1.0 if mode == "one" else 1.0 / (row + 1)
        torch.testing.assert_close(stack.history.weight.detach(), expected, rtol=0, atol=1e-7)
        assert stack.history.weight.requires_grad == (mode == "learned")


def test_encoder_and_decoder_have_separate_history_weights(tiny_config):
    model = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig, layer_aggregation="dlcl"))
    encoder_history, decoder_history = model.model.encoder.history, model.model.decoder.history
    assert encoder_history.weight.shape == (4, 4)  # (encoder_layers + 1)^2
    assert decoder_history.weight.shape == (3, 3)  # (decoder_layers + 1)^2
    assert len(encoder_history.layer_norms) == 3 and len(decoder_history.layer_norms) == 2
    names = {name for name, _ in model.named_parameters()}
    assert {"model.encoder.history.weight", "model.decoder.history.weight"} <= names


@pytest.mark.parametrize(
    ("encoder", "decoder"), [("dlcl", "residual"), ("residual", "dlcl")], ids=["dlcl-encoder", "dlcl-decoder"]
)
def test_layer_aggregation_is_chosen_per_stack(tiny_config, encoder, decoder):
    model = DeepNMTForConditionalGeneration(
        tiny_config(DeepNMTConfig, encoder_layer_aggregation=encoder, decoder_layer_aggregation=decoder)
    )
    for stack, aggregation in ((model.model.encoder, encoder), (model.model.decoder, decoder)):
        assert type(stack.history) is LAYER_AGGREGATION_CLASSES[aggregation]
        assert any("history" in name for name, _ in stack.named_parameters()) == (aggregation == "dlcl")


def test_layer_aggregation_classes_cover_the_config_choices():
    assert set(LAYER_AGGREGATION_CLASSES) == set(LAYER_AGGREGATIONS)
    assert len(LAYER_AGGREGATION_CLASSES) == len(LAYER_AGGREGATIONS)


def test_decoder_attention_classes_cover_the_config_choices():
    assert set(DECODER_ATTENTION_CLASSES) == set(DECODER_SELF_ATTENTIONS)
    assert len(DECODER_ATTENTION_CLASSES) == len(DECODER_SELF_ATTENTIONS)


@pytest.mark.parametrize("choice", DECODER_SELF_ATTENTIONS)
def test_each_decoder_layer_holds_the_sublayers_its_choice_names(tiny_config, choice):
    model = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig, decoder_self_attention=choice))
    self_attention, cross_attention = DECODER_ATTENTION_CLASSES[choice]
    for layer in model.model.decoder.layers:
        if self_attention is None:
            assert layer.self_attn is None and layer.self_attn_layer_norm is None
        else:
            assert type(layer.self_attn) is self_attention and layer.self_attn_layer_norm is not None
        assert type(layer.encoder_attn) is cross_attention


def test_every_weight_matrix_but_the_output_layer_states_its_initialisation(tiny_config):
    """No matrix's initialisation hangs on attributes set after construction: each one below the output layer is a
    DeepNMTLinear whose fan and scale show in the model's repr."""
    model = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig, msc_block_layers=[1, 2], msc_context="ffn"))
    linears = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    ours = {name for name, module in model.named_modules() if isinstance(module, DeepNMTLinear)}
    assert linears - ours == {"lm_head"}
    assert "model.encoder.context.cells.0.fc1" in ours and "model.decoder.layers.0.fusion_gate" in ours
    width = model.config.d_model
    assert f"in_features={width}, out_features={width}, bias=True, glorot_fan={4 * width}, init_scale=1)" in repr(
        model.model.encoder.layers[0].self_attn.q_proj
    )


def test_the_encoder_output_routes_one_memory_to_every_decoder_layer():
    states, blocks, contexts = torch.randn(2, 5, 4), torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    plain = DeepNMTEncoderOutput(last_hidden_state=states)
    assert all(plain.layer_memory(index)[0] is states and plain.layer_memory(index)[1] is None for index in range(3))
    msc = DeepNMTEncoderOutput(last_hidden_state=blocks[:, -1], block_outputs=blocks, context_states=contexts)
    for index in range(3):
        memory, context = msc.layer_memory(index)
        assert torch.equal(memory, blocks[:, index]) and torch.equal(context, contexts[:, index])
    encoder_only = DeepNMTEncoderOutput(last_hidden_state=blocks[:, -1], block_outputs=blocks)
    assert encoder_only.layer_memory(1)[1] is None


def test_a_copied_msc_model_runs_its_own_encoder_modules(tiny_config, random_model):
    """The MSC history reads the block LayerNorms and the context cell from its encoder at each call: a deep copy runs
    the copy's modules, not the original's."""
    model = random_model(tiny_config(MscConfig, msc_block_layers=[2, 1])).eval()
    copied = copy.deepcopy(model)
    source, target = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[0, 8, 9]])
    with torch.no_grad():
        before = model(input_ids=source, decoder_input_ids=target).logits
        copied.model.encoder.block_layer_norms[0].weight.mul_(3.0)
        copied.model.encoder.context.cells[0].weight_hh.mul_(3.0)
        assert torch.equal(model(input_ids=source, decoder_input_ids=target).logits, before)
        assert not torch.allclose(copied(input_ids=source, decoder_input_ids=target).logits, before)


def test_the_decoder_returns_a_model_output(tiny_config, random_model):
    model = random_model(tiny_config(DeepNMTConfig)).eval()
    source, target = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[0, 8, 9]])
    with torch.no_grad():
        encoded = model.model.encoder(input_ids=source)
        decoded = model.model.decoder(input_ids=target, encoder_outputs=encoded, use_cache=True)
        full = model(input_ids=source, decoder_input_ids=target)
    assert decoded.last_hidden_state.shape == (1, 3, model.config.d_model)
    assert decoded.past_key_values.get_seq_length() == 3
    torch.testing.assert_close(model.lm_head(decoded.last_hidden_state), full.logits)


@pytest.mark.parametrize("argument", ["output_attentions", "output_hidden_states", "head_mask"])
def test_arguments_the_model_ignores_warn_instead_of_vanishing(tiny_config, random_model, caplog, argument):
    model = random_model(tiny_config(DeepNMTConfig)).eval()
    source, target = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[0, 8, 9]])
    value = torch.ones(model.config.encoder_attention_heads) if argument == "head_mask" else True
    with caplog.at_level("WARNING"), torch.no_grad():
        model(input_ids=source, decoder_input_ids=target, output_attentions=False)  # unset/False: nothing to say
        assert caplog.text == ""
        model(input_ids=source, decoder_input_ids=target, **{argument: value})
    assert f"ignores {argument}" in caplog.text


@pytest.mark.parametrize("argument", ["inputs_embeds", "decoder_inputs_embeds", "decoder_position_ids"])
def test_inputs_the_model_cannot_take_are_refused_when_set(tiny_config, random_model, argument):
    model = random_model(tiny_config(DeepNMTConfig)).eval()
    source, target = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[0, 8, 9]])
    with torch.no_grad():
        model(input_ids=source, decoder_input_ids=target, **{argument: None})  # None, as PEFT passes them: accepted
        with pytest.raises(ValueError, match=f"cannot take {argument}"):
            model(input_ids=source, decoder_input_ids=target, **{argument: torch.zeros(1, 3, model.config.d_model)})


@pytest.mark.parametrize("part", ["model", "base", "encoder"])
def test_an_unknown_forward_argument_raises_type_error(tiny_config, random_model, part):
    model = random_model(tiny_config(DeepNMTConfig)).eval()
    source, target = torch.tensor([[5, 6, 7, 2]]), torch.tensor([[0, 8, 9]])
    call = {
        "model": lambda **kw: model(input_ids=source, decoder_input_ids=target, **kw),
        "base": lambda **kw: model.model(input_ids=source, decoder_input_ids=target, **kw),
        "encoder": lambda **kw: model.get_encoder()(input_ids=source, **kw),
    }[part]
    with pytest.raises(TypeError, match="unexpected keyword argument 'decoder_atention_mask'"):
        call(decoder_atention_mask=torch.ones_like(target))


def test_every_named_model_class_is_checked_below():
    named = {model: config for config, model in MODEL_CLASSES.items() if config is not DeepNMTConfig}
    assert NAMED_MODEL_CLASSES == named


@pytest.mark.parametrize("model_class", NAMED_MODEL_CLASSES, ids=lambda cls: cls.__name__)
def test_named_model_classes_add_nothing_but_their_config(model_class):
    assert model_class.config_class is NAMED_MODEL_CLASSES[model_class]
    assert model_class.forward is DeepNMTForConditionalGeneration.forward
    own = [
        name
        for name, value in vars(model_class).items()
        if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod, property))
    ]
    assert own == []


def test_dlcl_paper_model_has_137m_parameters():
    config = DlclConfig(vocab_size=33000)
    with torch.device("meta"):
        model = DlclForConditionalGeneration(config)
    count = sum(parameter.numel() for parameter in model.parameters())  # unique parameters: tied counted once
    d, f, vocab = config.d_model, config.encoder_ffn_dim, config.vocab_size
    encoder_layer = 4 * d * d + 4 * d + 2 * d * f + d + f + 4 * d  # attention, FFN, 2 LayerNorms
    decoder_layer = 8 * d * d + 8 * d + 2 * d * f + d + f + 6 * d  # 2 attentions, FFN, 3 LayerNorms
    history = (30 + 1) ** 2 + 30 * 2 * d + (6 + 1) ** 2 + 6 * 2 * d  # weights + one LayerNorm per stored output
    final_layer_norms = 2 * 2 * d
    assert count == 30 * encoder_layer + 6 * decoder_layer + vocab * d + history + final_layer_norms
    assert abs(count - 137e6) / 137e6 < 0.01


# ---- norms ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", LAYER_AGGREGATIONS)
def test_only_pre_norm_stacks_end_with_a_layer_norm(tiny_config, aggregation):
    pre = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig, pre_norm=True, layer_aggregation=aggregation))
    for stack in ("encoder", "decoder"):
        assert isinstance(getattr(pre.model, stack).layer_norm, torch.nn.LayerNorm)
    if aggregation in ("attnres", "block_attnres"):
        return  # pre-norm only (refused with post-norm layers: tests/test_attention_residuals.py)
    post = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig, pre_norm=False, layer_aggregation=aggregation))
    for stack in ("encoder", "decoder"):
        assert getattr(post.model, stack).layer_norm is None


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_encoder_layer_matches_hand_sublayer_order(tiny_config, random_model, pre_norm):
    layer = random_model(tiny_config(DeepNMTConfig, pre_norm=pre_norm)).model.encoder.layers[0]
    hidden = torch.randn(2, 5, 16)
    with torch.no_grad():

        def feed_forward(x):
            return layer.fc2(torch.relu(layer.fc1(x)))

        if pre_norm:  # x + F(LN(x))
            middle = hidden + layer.self_attn(layer.self_attn_layer_norm(hidden))
            expected = middle + feed_forward(layer.final_layer_norm(middle))
        else:  # LN(x + F(x))
            middle = layer.self_attn_layer_norm(hidden + layer.self_attn(hidden))
            expected = layer.final_layer_norm(middle + feed_forward(middle))
        torch.testing.assert_close(layer(hidden), expected)


# ---- loss and teacher forcing ---------------------------------------------------------------------------------------


def test_loss_ignores_minus_100_labels_like_a_hand_cross_entropy(tiny_config, random_model, padded_batch):
    model = random_model(tiny_config(DlclConfig))
    labels = padded_batch["labels"]
    with torch.no_grad():
        outputs = model(**model_inputs(padded_batch))
    log_probs = outputs.logits.log_softmax(dim=-1)
    terms = [
        -log_probs[row, position, labels[row, position]]
        for row in range(labels.shape[0])
        for position in range(labels.shape[1])
        if labels[row, position] != -100
    ]
    assert len(terms) == 6
    torch.testing.assert_close(outputs.loss, torch.stack(terms).mean())


def test_decoder_inputs_are_labels_shifted_right_behind_the_start_token(tiny_config, random_model, padded_batch):
    model = random_model(tiny_config(DeepNMTConfig, decoder_start_token_id=3))
    labels = padded_batch["labels"]  # [[6, 8, 12, 2], [13, 2, -100, -100]]
    expected = torch.tensor([[3, 6, 8, 12], [3, 13, 2, 1]])
    assert torch.equal(model.prepare_decoder_input_ids_from_labels(labels), expected)
    assert torch.equal(shift_tokens_right(labels, 1, 3), expected)
    with torch.no_grad():
        from_labels = model(
            input_ids=padded_batch["input_ids"], attention_mask=padded_batch["attention_mask"], labels=labels
        )
        explicit = model(
            input_ids=padded_batch["input_ids"],
            attention_mask=padded_batch["attention_mask"],
            decoder_input_ids=expected,
        )
    assert torch.equal(from_labels.logits, explicit.logits)


@pytest.mark.parametrize(
    ("side", "bad_id", "decoder_vocab_size"),
    [("source", 41, 37), ("source", -5, 37), ("target", 40, 37), ("target", -100, 37), ("target", 33, 29)],
)
def test_out_of_range_token_id_raises_value_error_naming_it(
    tiny_config, random_model, side, bad_id, decoder_vocab_size
):
    config = tiny_config(
        DeepNMTConfig, decoder_vocab_size=decoder_vocab_size, share_embeddings=decoder_vocab_size == 37
    )
    model = random_model(config)
    source = torch.tensor([[5, 9, 14, 3, 2]])
    target = torch.tensor([[0, 6, 8, 12]])
    if side == "source":
        source[0, 2] = bad_id
    else:
        target[0, 3] = bad_id
    with pytest.raises(ValueError, match=rf"(?<![\d-]){bad_id}(?!\d)"):
        model(input_ids=source, decoder_input_ids=target)


# ---- embeddings and positions -------------------------------------------------------------------------------------


def hand_sinusoids(positions: list[int], d_model: int) -> torch.Tensor:
    half = d_model // 2
    rows = []
    for position in positions:
        frequencies = [math.exp(-i * math.log(10000.0) / (half - 1)) for i in range(half)]
        rows.append([math.sin(position * w) for w in frequencies] + [math.cos(position * w) for w in frequencies])
    return torch.tensor(rows)


@pytest.mark.parametrize("scale_embedding", [True, False])
def test_embedding_is_scaled_tokens_plus_sinusoids(tiny_config, random_model, scale_embedding):
    model = random_model(tiny_config(DeepNMTConfig, scale_embedding=scale_embedding))
    ids = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
    scale = 4.0 if scale_embedding else 1.0  # sqrt(16)
    expected = model.model.shared.weight[ids] * scale + hand_sinusoids(list(range(5)), 16)
    with torch.no_grad():
        torch.testing.assert_close(model.model.encoder.embed(ids), expected)
        # decoder positions continue after the cached ones
        torch.testing.assert_close(
            model.model.decoder.embed(ids[:, :2], past_length=7),
            model.model.shared.weight[ids[:, :2]] * scale + hand_sinusoids([7, 8], 16),
        )


def test_a_source_longer_than_1000_tokens_is_not_truncated(tiny_config, random_model):
    model = random_model(tiny_config(DeepNMTConfig))
    positions = model.model.encoder.embed_positions(torch.tensor([0, 50, 1050]))
    torch.testing.assert_close(positions, hand_sinusoids([0, 50, 1050], 16), rtol=0, atol=1e-4)
    assert not torch.allclose(positions[1], positions[2], atol=1e-2)
    source = torch.randint(3, 37, (1, 1100))
    with torch.no_grad():
        outputs = model(input_ids=source, decoder_input_ids=torch.tensor([[0, 6]]))
    assert outputs.encoder_last_hidden_state.shape == (1, 1100, 16)
    assert torch.isfinite(outputs.encoder_last_hidden_state).all() and torch.isfinite(outputs.logits).all()


def test_tied_output_projection_is_the_shared_embedding(tiny_config):
    model = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig))
    assert model.lm_head.weight is model.model.shared.weight
    assert model.model.decoder.embed_tokens.weight is model.model.shared.weight
    assert model.get_output_embeddings() is model.lm_head and model.get_input_embeddings() is model.model.shared


# ---- training -----------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("enable", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
@pytest.mark.parametrize(
    ("config_class", "overrides"), [(DlclConfig, {}), (MscConfig, {"msc_block_layers": [2, 1]})], ids=["dlcl", "msc"]
)
def test_gradient_checkpointing_gives_the_same_gradients(
    tiny_config, random_model, padded_batch, pre_norm, enable, config_class, overrides
):
    model = random_model(tiny_config(config_class, pre_norm=pre_norm, **overrides)).train()
    checkpointed = copy.deepcopy(model)
    getattr(checkpointed, enable)()  # the Trainer calls activation_checkpointing_enable in transformers 5.x
    calls = []
    layers = [*checkpointed.model.encoder.layers, *checkpointed.model.decoder.layers]
    for layer in layers:
        assert layer.gradient_checkpointing
        checkpoint = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *args, _f=checkpoint, **kwargs: (
            calls.append(1) or _f(*args, **kwargs)
        )

    model(**model_inputs(padded_batch)).loss.backward()
    checkpointed(**model_inputs(padded_batch)).loss.backward()
    assert len(calls) == len(layers)
    gradients = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    if config_class is DlclConfig:
        assert "model.encoder.history.weight" in gradients and "model.decoder.history.weight" in gradients
    else:  # the MSC context cell and gates, outside and inside the checkpointed layers
        assert "model.encoder.context.cells.0.weight_hh" in gradients
        assert "model.decoder.layers.1.fusion_gate.weight" in gradients
    checkpointed_gradients = {name: p.grad for name, p in checkpointed.named_parameters() if p.grad is not None}
    assert gradients.keys() == checkpointed_gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(checkpointed_gradients[name], gradient, msg=name)
