"""Depth methods that are settings of the existing backbone (issue 41, first slice): Mix-LN (`{side}_post_norm_layers`)
and DenseFormer (DLCL with `dlcl_init="identity"` and no history LayerNorms).

Each is reached through the shared `ARCHITECTURES` matrix (ids `mixln` and `denseformer`), which runs cached ==
uncached decoding, the static cache, beams, padding invariance, save -> load and remote code on it. Here: what is
particular to each, the exact equivalences with the models they generalise and the refused combinations."""

import re

import pytest
import torch

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration

SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
TARGET = torch.tensor([[0, 6, 8, 12], [0, 13, 4, 1]])


def logits(model, source=SOURCE, target=TARGET):
    with torch.no_grad():
        return model(input_ids=source, attention_mask=source.ne(1).long(), decoder_input_ids=target).logits


def same_weights(model, reference, strict=True):
    """`model` with the weights of `reference` (names it has and `reference` lacks are reported, not loaded)."""
    return model.load_state_dict(reference.state_dict(), strict=strict)


# ---- Mix-LN ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def norm_models(tiny_config, random_model):
    """The pre-norm and the post-norm model of the tiny sizes (3 encoder, 2 decoder layers), random weights each."""
    return random_model(tiny_config()), random_model(tiny_config(pre_norm=False))


def test_mix_ln_boundary_zero_is_the_pre_norm_model(tiny_config, norm_models):
    pre_norm, _ = norm_models
    mixed = DeepNMTForConditionalGeneration(tiny_config(encoder_post_norm_layers=0, decoder_post_norm_layers=0))
    same_weights(mixed.eval(), pre_norm)
    assert torch.equal(logits(mixed), logits(pre_norm))


def test_mix_ln_boundary_at_the_top_is_the_post_norm_model(tiny_config, norm_models):
    """Every layer post-norm: no final LayerNorm on either stack (a strict load from the post-norm model holds that),
    and bit-equal outputs."""
    _, post_norm = norm_models
    mixed = DeepNMTForConditionalGeneration(tiny_config(encoder_post_norm_layers=3, decoder_post_norm_layers=2))
    same_weights(mixed.eval(), post_norm)
    assert mixed.model.encoder.layer_norm is None and mixed.model.decoder.layer_norm is None
    assert torch.equal(logits(mixed), logits(post_norm))


def test_mix_ln_runs_post_norm_layers_below_pre_norm_ones_and_keeps_the_final_layer_norm(tiny_config, norm_models):
    """Boundary 1 of 3 encoder layers and 1 of 2 decoder layers: the pre-norm model whose first layer on each stack is
    the post-norm model's first layer computes the same outputs (the final LayerNorms are the pre-norm model's)."""
    pre_norm, post_norm = norm_models
    mixed = DeepNMTForConditionalGeneration(tiny_config(encoder_post_norm_layers=1, decoder_post_norm_layers=1)).eval()
    assert mixed.model.encoder.layer_norm is not None and mixed.model.decoder.layer_norm is not None
    expected = DeepNMTForConditionalGeneration(tiny_config()).eval()
    same_weights(expected, pre_norm)
    for stack in ("encoder", "decoder"):
        getattr(expected.model, stack).layers[0] = getattr(post_norm.model, stack).layers[0]
    same_weights(mixed, expected)
    assert [layer.self_attn_layer_norm.pre_norm for layer in mixed.model.encoder.layers] == [False, True, True]
    assert [layer.final_layer_norm.pre_norm for layer in mixed.model.decoder.layers] == [False, True]
    assert torch.equal(logits(mixed), logits(expected))
    assert not torch.allclose(logits(mixed), logits(pre_norm))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(pre_norm=False, encoder_post_norm_layers=1), "need `pre_norm=True`"),
        (dict(pre_norm=False, deepnorm=True, decoder_post_norm_layers=1), "need `pre_norm=True`"),
        (dict(encoder_post_norm_layers=4), "`encoder_post_norm_layers` must be at most `encoder_layers` (3), got 4."),
        (dict(decoder_post_norm_layers=-1), "`decoder_post_norm_layers` must be a non-negative integer"),
        (dict(layer_aggregation="dlcl", decoder_post_norm_layers=1), "needs `decoder_layer_aggregation='residual'`"),
        (dict(msc_block_layers=[2, 1], encoder_post_norm_layers=1), "needs `msc_block_layers=None`, got [2, 1]"),
    ],
)
def test_mix_ln_refuses_what_it_cannot_mean(tiny_config, settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config(**settings)


# ---- DenseFormer ----------------------------------------------------------------------------------------------

DENSEFORMER = dict(layer_aggregation="dlcl", dlcl_init="identity", dlcl_history_norm=False)


def test_identity_initialisation_starts_each_row_at_its_newest_output(tiny_config):
    dense = DeepNMTForConditionalGeneration(tiny_config(**DENSEFORMER))
    assert torch.equal(dense.model.encoder.history.weight, torch.eye(4))
    uniform = DeepNMTForConditionalGeneration(tiny_config(layer_aggregation="dlcl"))  # DLCL's default: 1/(r+1)
    third = torch.ones(3) / 3
    expected = torch.stack([torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.5, 0.5, 0.0]), third])
    assert torch.equal(uniform.model.decoder.history.weight, expected)


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_identity_initialised_denseformer_is_the_residual_model_before_training(tiny_config, random_model, pre_norm):
    """Freshly built (identity weights), with the layer weights of a residual model: the same logits, and so the
    same greedy translations, bit for bit."""
    residual = random_model(tiny_config(pre_norm=pre_norm))
    dense = DeepNMTForConditionalGeneration(tiny_config(pre_norm=pre_norm, **DENSEFORMER)).eval()
    loaded = same_weights(dense, residual, strict=False)
    assert sorted(loaded.missing_keys) == ["model.decoder.history.weight", "model.encoder.history.weight"]
    assert loaded.unexpected_keys == []
    assert torch.equal(logits(dense), logits(residual))
    kwargs = dict(input_ids=SOURCE, attention_mask=SOURCE.ne(1).long(), max_new_tokens=6, do_sample=False)
    assert torch.equal(dense.generate(**kwargs, num_beams=2), residual.generate(**kwargs, num_beams=2))


def test_the_new_settings_are_written_only_when_set(tiny_config):
    plain = tiny_config().to_dict()
    assert not {"dlcl_init", "encoder_post_norm_layers", "decoder_post_norm_layers"} & set(plain)
    settings = {**DENSEFORMER, "layer_aggregation": "residual", "decoder_layer_aggregation": "dlcl"}
    written = tiny_config(encoder_post_norm_layers=1, **settings).to_dict()
    assert (written["dlcl_init"], written["encoder_post_norm_layers"]) == ("identity", 1)
    assert DeepNMTConfig.from_dict(written).dlcl_init == "identity"


def test_identity_initialisation_needs_learned_weights(tiny_config):
    with pytest.raises(ValueError, match=r"`dlcl_init='identity'` needs learned DLCL weights .* got 'average'"):
        tiny_config(layer_aggregation="dlcl", dlcl_weights="average", dlcl_init="identity")


# ---- both: the static cache ----------------------------------------------------------------------------------------

BOTH = {"mixln": dict(encoder_post_norm_layers=2, decoder_post_norm_layers=1), "denseformer": DENSEFORMER}


@pytest.mark.parametrize("name", sorted(BOTH))
def test_static_cache_beams_decode_as_the_dynamic_cache(name, tiny_config, random_model):
    """Beam search with the static cache (the compiled decoding's) decodes as with the dynamic one."""
    model = random_model(tiny_config(**BOTH[name]))
    options = dict(input_ids=SOURCE, attention_mask=SOURCE.ne(1).long(), max_new_tokens=6, min_new_tokens=6)
    with torch.no_grad():
        dynamic = model.generate(**options, num_beams=3, return_dict_in_generate=True, output_logits=True)
        static = model.generate(
            **options, num_beams=3, return_dict_in_generate=True, output_logits=True, cache_implementation="static"
        )
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), rtol=1e-5, atol=1e-5)


# ---- DenseFormer's dilation k and period p -------------------------------------------------------------------------


def run_history(history, outputs):
    """Feed `history` the embedding `outputs[0]` and the layer outputs `outputs[1:]`; the input of every layer and the
    stack output, in order."""
    state = history.start(outputs[0])
    inputs = []
    for index, output in enumerate(outputs[1:]):
        inputs.append(history.layer_input(state, index))
        history.push(state, output, index)
    return inputs, history.stack_output(state)


def dense_history(tiny_config, weight, **settings):
    """The encoder history (3 layers, so 4 stored outputs) of a DenseFormer config, its weights set to `weight`."""
    model = DeepNMTForConditionalGeneration(tiny_config(**DENSEFORMER, **settings))
    history = model.model.encoder.history
    with torch.no_grad():
        history.weight.copy_(weight)
    return history


WEIGHT = torch.tensor([[2.0, 3, 5, 7], [11, 13, 17, 19], [23, 29, 31, 37], [41, 43, 47, 53]])


def test_dilation_two_weighs_every_second_earlier_output_by_hand(tiny_config):
    """k = 2: the input of the third layer (row 2) is `W[2,2] y_2 + W[2,0] y_0`, the stack output (row 3) is
    `W[3,3] y_3 + W[3,1] y_1`; the other weights, held out, are never read."""
    history = dense_history(tiny_config, WEIGHT, dlcl_dilation=2)
    y = [torch.full((1, 1, 16), float(value)) for value in (1, 10, 100, 1000)]
    inputs, output = run_history(history, y)
    assert torch.equal(inputs[2], torch.full((1, 1, 16), 31 * 100 + 23 * 1.0))
    assert torch.equal(inputs[1], torch.full((1, 1, 16), 13 * 10.0))  # row 1: y_1 only (lag 1 is odd)
    assert torch.equal(output, torch.full((1, 1, 16), 53 * 1000 + 43 * 10.0))
    held_out = torch.tensor([[0, 1, 1, 1], [1, 0, 1, 1], [0, 1, 0, 1], [1, 0, 1, 0]], dtype=torch.bool)
    assert torch.equal(history.weight_mask(), ~held_out)
    # initialised: identity on the kept weights; DLCL's uniform average over the kept weights of each row
    fresh = DeepNMTForConditionalGeneration(
        tiny_config(layer_aggregation="dlcl", dlcl_dilation=2, dlcl_history_norm=False)
    )
    expected = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [0.5, 0, 0.5, 0], [0, 0.5, 0, 0.5]])
    assert torch.equal(fresh.model.encoder.history.weight, expected)


def test_period_two_chains_the_layers_between_combinations(tiny_config):
    """p = 2 over 3 layers: layer 0 reads row 0, layer 1 the output of layer 0 (row 1 is not a layer input), layer 2
    row 2 (every stored output so far), and the stack output is layer 2's output (3 stored outputs after the
    embedding: no combination after it)."""
    history = dense_history(tiny_config, WEIGHT, dlcl_period=2)
    y = [torch.full((1, 1, 16), float(value)) for value in (1, 10, 100, 1000)]
    inputs, output = run_history(history, y)
    assert [row.flatten()[0].item() for row in inputs] == [2.0, 10.0, 23 + 29 * 10 + 31 * 100]
    assert torch.equal(output, y[3])
    assert history.weight_mask().sum(dim=1).tolist() == [1, 0, 3, 0]


def test_dilation_and_period_one_are_dlcl(tiny_config):
    """The defaults read the weight matrix itself (no product with a mask), so DLCL computes what it did."""
    history = DeepNMTForConditionalGeneration(tiny_config(layer_aggregation="dlcl")).model.encoder.history
    assert not history.masked and history.mixing_weight() is history.weight
    assert torch.equal(history.weight_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_held_out_weights_get_no_gradient_and_stay_zero_through_training(tiny_config):
    """AdamW with weight decay, a few steps on both stacks (k = 2, p = 2): the held-out weights are exactly 0 after,
    their gradients exactly 0 at every step, and the kept weights moved; the eager kernel's gradients are those of
    the traced sum (the gradient of the mixing weights by autograd through plain sums)."""
    model = DeepNMTForConditionalGeneration(
        tiny_config(**{**DENSEFORMER, "dlcl_init": "uniform"}, dlcl_dilation=2, dlcl_period=2, decoder_layers=4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    histories = [model.model.encoder.history, model.model.decoder.history]
    start = [history.weight.detach().clone() for history in histories]
    for _ in range(3):
        optimizer.zero_grad()
        model(
            input_ids=SOURCE, attention_mask=SOURCE.ne(1).long(), decoder_input_ids=TARGET, labels=TARGET
        ).loss.backward()
        for history in histories:
            assert torch.equal(
                history.weight.grad[~history.weight_mask()], torch.zeros(int((~history.weight_mask()).sum()))
            )
        optimizer.step()
    for history, before in zip(histories, start):
        mask = history.weight_mask()
        assert torch.equal(history.weight[~mask], torch.zeros(int((~mask).sum())))
        assert not torch.equal(history.weight[mask], before[mask])


def test_eager_history_gradients_match_plain_autograd(tiny_config):
    """The kernel's weight and output gradients with k = 2, p = 2 against the same combination written as sums."""
    history = dense_history(tiny_config, WEIGHT / 50, dlcl_dilation=2, dlcl_period=2)
    outputs = [torch.randn(2, 3, 16, requires_grad=True) for _ in range(4)]
    inputs, output = run_history(history, outputs)
    torch.autograd.backward([inputs[2], output], [torch.ones(2, 3, 16), torch.full((2, 3, 16), 2.0)])
    eager = [history.weight.grad.clone(), *(tensor.grad.clone() for tensor in outputs)]
    history.weight.grad = None
    for tensor in outputs:
        tensor.grad = None
    weight = history.mixing_weight()
    row_two = sum(weight[2, j] * outputs[j] for j in range(3))
    torch.autograd.backward([row_two, outputs[3]], [torch.ones(2, 3, 16), torch.full((2, 3, 16), 2.0)])
    reference = [history.weight.grad, *(tensor.grad for tensor in outputs)]
    for got, want in zip(eager, reference):
        torch.testing.assert_close(got, want)


def test_dilation_and_period_are_written_only_when_set_and_checked(tiny_config):
    assert not {"dlcl_dilation", "dlcl_period"} & set(tiny_config(layer_aggregation="dlcl").to_dict())
    written = tiny_config(**DENSEFORMER, dlcl_dilation=2, dlcl_period=3).to_dict()
    assert (written["dlcl_dilation"], written["dlcl_period"]) == (2, 3)
    with pytest.raises(ValueError, match=r"`dlcl_dilation` must be a positive integer, got 0"):
        tiny_config(**DENSEFORMER, dlcl_dilation=0)
    with pytest.raises(ValueError, match=r"`dlcl_period=2` only apply to DLCL"):
        tiny_config(dlcl_period=2)
    with pytest.raises(ValueError, match=r"`dlcl_dilation=2` .* need `dlcl_history_norm=False`, got True"):
        tiny_config(layer_aggregation="dlcl", dlcl_dilation=2)
