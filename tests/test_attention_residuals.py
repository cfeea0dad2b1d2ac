"""Attention Residuals (`layer_aggregation="attnres"` / `"block_attnres"`): each layer's input a per-position softmax
over the embedding and the contributions (`layer(x) - x`) of the layers or blocks below it.

Cached == full decoding, static cache, beams, padding, save/load and remote code run through the shared
`ARCHITECTURES` (id `attnres`: full encoder, block decoder). Here: the layer inputs and the stack output against the
formula computed by hand, what the zero-query start is, the config refusals and the weights-file checks."""

import pytest
import torch

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration
from hf_deep_nmt.modeling.configuration_deep_nmt import DeepNormConfig
from hf_deep_nmt.modeling.modeling_deep_nmt import (
    DeepNMTAttentionResidualHistory,
    DeepNMTBlockAttentionResidualHistory,
    padding_mask_to_additive,
)
from hf_deep_nmt.modeling.sizes_deep_nmt import check_config_matches_weights, count_parameters
from hf_deep_nmt.serving.ctranslate2 import ctranslate2_blockers
from hf_deep_nmt.tools.diagnostics import combination_weights
from hf_deep_nmt.training.growing import grow_encoder

SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
MASK = (SOURCE != 1).long()


def hand_mix(values: list[torch.Tensor], query: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """sum_j softmax_j(q . g * v_j / rms(v_j)) v_j, one value at a time."""
    scores = []
    for value in values:
        rms = torch.sqrt((value * value).mean(dim=-1, keepdim=True) + eps)
        scores.append(((value / rms) * gain * query).sum(dim=-1))
    top = torch.stack(scores).max(dim=0).values
    exps = [torch.exp(score - top) for score in scores]
    total = sum(exps)
    return sum((exp / total).unsqueeze(-1) * value for exp, value in zip(exps, values))


def encoder_trace(model) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The inputs and outputs of every encoder layer, and the encoder's output, for `SOURCE`."""
    inputs, outputs = [], []
    hooks = []
    for layer in model.model.encoder.layers:
        hooks.append(layer.register_forward_pre_hook(lambda module, args: inputs.append(args[0])))
        hooks.append(layer.register_forward_hook(lambda module, args, output: outputs.append(output)))
    with torch.no_grad():
        final = model.model.encoder(input_ids=SOURCE, attention_mask=MASK).last_hidden_state
    for hook in hooks:
        hook.remove()
    return inputs, outputs, final


# For each encoder layer (and the stack output, last), the values it attends, as (kind, index): ("y0", 0) the
# embedding, ("layers", [a, b]) the sum of the contributions of layers a..b-1.
FULL_VALUES = [[("layers", [j, j + 1]) for j in range(i)] for i in range(5)]
BLOCK_VALUES = [  # blocks [0, 2, 4]
    [],
    [("layers", [0, 1])],  # the partial sum of block 1
    [("layers", [0, 2])],  # block 1 complete
    [("layers", [0, 2]), ("layers", [2, 3])],  # block 1, the partial sum of block 2
    [("layers", [0, 2]), ("layers", [2, 4])],  # the stack output: both blocks
]


@pytest.mark.parametrize(
    ("aggregation", "table"), [("attnres", FULL_VALUES), ("block_attnres", BLOCK_VALUES)], ids=["full", "block"]
)
def test_layer_inputs_and_stack_output_are_the_hand_softmax_mixtures(tiny_config, random_model, aggregation, table):
    boundaries = [0, 2, 4] if aggregation == "block_attnres" else None
    config = tiny_config(
        DeepNMTConfig, encoder_layers=4, encoder_layer_aggregation=aggregation, encoder_block_boundaries=boundaries
    )
    model = random_model(config)  # noisy queries and gains: the weights are far from uniform
    history = model.model.encoder.history
    inputs, outputs, final = encoder_trace(model)
    embedding = model.model.encoder.embed(SOURCE)
    torch.testing.assert_close(inputs[0], embedding)  # layer 0 attends the embedding alone
    contributions = [output - given for given, output in zip(inputs, outputs)]
    with torch.no_grad():
        for row, entries in enumerate(table):
            values = [embedding] + [sum(contributions[a:b]) for _, (a, b) in entries]
            expected = hand_mix(values, history.queries[row], history.key_gains[row], config.layer_norm_eps)
            if row < 4:
                torch.testing.assert_close(inputs[row], expected)
            else:
                torch.testing.assert_close(final, model.model.encoder.layer_norm(expected))
    scores = torch.stack([(history.queries[4] * value).sum(-1) for value in values])
    assert scores.std(dim=0).max() > 0.1  # the mixture is input-dependent, not a constant average


@pytest.mark.parametrize(
    ("aggregation", "boundaries", "counts"),
    [("attnres", None, [1, 2, 3, 4, 5]), ("block_attnres", [0, 2, 4], [1, 2, 2, 3, 3])],
    ids=["full", "block"],
)
def test_zero_queries_read_the_residual_stream_divided_by_the_number_of_values(
    tiny_config, random_model, aggregation, boundaries, counts
):
    """A fresh model has zero queries (uniform weights); with them each layer reads the plain residual stream
    h_i = y_0 + v_0 + ... + v_{i-1} divided by its number of values, and the stack returns LN(h_L / n)."""
    settings = dict(encoder_layers=4, encoder_layer_aggregation=aggregation, encoder_block_boundaries=boundaries)
    fresh = DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig, **settings))
    assert torch.equal(fresh.model.encoder.history.queries, torch.zeros(5, 16))
    assert torch.equal(fresh.model.encoder.history.key_gains, torch.ones(5, 16))
    model = random_model(tiny_config(DeepNMTConfig, **settings))
    with torch.no_grad():
        model.model.encoder.history.queries.zero_()
        encoder = model.model.encoder
        _, _, final = encoder_trace(model)
        additive = padding_mask_to_additive(MASK, torch.float32)
        stream = encoder.embed(SOURCE)
        for layer, count in zip(encoder.layers, counts):
            given = stream / count
            stream = stream + layer(given, additive) - given
        torch.testing.assert_close(final, encoder.layer_norm(stream / counts[-1]))


def test_padding_leaves_each_sentence_unchanged(tiny_config, random_model):
    model = random_model(
        tiny_config(DeepNMTConfig, layer_aggregation="block_attnres", encoder_block_boundaries=[0, 1, 3])
    )
    with torch.no_grad():
        batch = model.model.encoder(input_ids=SOURCE, attention_mask=MASK).last_hidden_state
        alone = model.model.encoder(input_ids=SOURCE[1:, :3]).last_hidden_state
    torch.testing.assert_close(batch[1:, :3], alone)


def test_saved_block_model_loads_with_its_blocks_and_logits(tiny_config, random_model, tmp_path):
    config = tiny_config(DeepNMTConfig, layer_aggregation="block_attnres", encoder_block_boundaries=[0, 1, 3])
    model = random_model(config)
    model.save_pretrained(tmp_path)
    loaded = DeepNMTForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert loaded.config.encoder_block_boundaries == [0, 1, 3]
    assert loaded.config.decoder_block_boundaries == [0, 2]
    assert type(loaded.model.decoder.history) is DeepNMTBlockAttentionResidualHistory
    target = torch.tensor([[2, 6, 8], [2, 13, 4]])
    with torch.no_grad():
        expected = model(input_ids=SOURCE, attention_mask=MASK, decoder_input_ids=target).logits
        got = loaded(input_ids=SOURCE, attention_mask=MASK, decoder_input_ids=target).logits
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    ("config_class", "overrides", "message"),
    [
        (
            DeepNMTConfig,
            dict(layer_aggregation="attnres", pre_norm=False),
            "needs `pre_norm=True`, got `pre_norm=False`",
        ),
        (
            DeepNormConfig,
            dict(decoder_layer_aggregation="block_attnres"),
            "`decoder_layer_aggregation='block_attnres'` needs `deepnorm=False`",
        ),
        (
            DeepNMTConfig,
            dict(decoder_layer_aggregation="attnres", decoder_post_norm_layers=1),
            "needs `decoder_post_norm_layers=0`, got 1",
        ),
        (
            DeepNMTConfig,
            dict(encoder_layer_aggregation="attnres", msc_block_layers=[2, 1]),
            "`encoder_layer_aggregation='attnres'` needs `msc_block_layers=None`, got [2, 1]",
        ),
        (
            DeepNMTConfig,
            dict(encoder_layer_aggregation="block_attnres", encoder_block_boundaries=[0, 2, 5]),
            "`encoder_block_boundaries` must be strictly increasing integers from 0 to `encoder_layers` (3)",
        ),
        (
            DeepNMTConfig,
            dict(encoder_layer_aggregation="attnres", encoder_block_boundaries=[0, 1, 3]),
            "only applies with `encoder_layer_aggregation='sparse'` or 'block_attnres', got 'attnres'",
        ),
        (DeepNMTConfig, dict(layer_aggregation="attnres", dlcl_history_norm=False), "only apply to DLCL"),
        (DeepNMTConfig, dict(layer_aggregation="attn_res"), "must be one of ("),
    ],
    ids=["post-norm", "deepnorm", "mix-ln", "msc-encoder", "bad-blocks", "blocks-of-full", "dlcl-setting", "typo"],
)
def test_bad_settings_are_refused_by_name(tiny_config, config_class, overrides, message):
    with pytest.raises(ValueError) as error:
        tiny_config(config_class, **overrides)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_sizes_and_weights_file_checks_know_the_pseudo_queries(tiny_config, tmp_path):
    config = tiny_config(DeepNMTConfig, encoder_layer_aggregation="attnres", decoder_layer_aggregation="block_attnres")
    model = DeepNMTForConditionalGeneration(config)
    assert type(model.model.encoder.history) is DeepNMTAttentionResidualHistory
    assert combination_weights(model) == {}  # input-dependent weights: no matrix for the diagnostics to read
    # a query and a key gain (d_model each) per layer and one pair for the stack output
    added = count_parameters(config) - count_parameters(tiny_config(DeepNMTConfig))
    assert added == 2 * (3 + 1) * 16 + 2 * (2 + 1) * 16
    model.save_pretrained(tmp_path / "attnres")
    weights = [str(tmp_path / "attnres" / "model.safetensors")]
    check_config_matches_weights(config, weights, "here")  # its own config passes
    residual = tiny_config(DeepNMTConfig, encoder_layer_aggregation="attnres")
    with pytest.raises(ValueError, match=r"decoder_layer_aggregation='residual' has no Attention Residuals, but the"):
        check_config_matches_weights(residual, weights, "here")
    wider = tiny_config(DeepNMTConfig, layer_aggregation="attnres", encoder_layers=4)
    with pytest.raises(ValueError, match=r"make encoder.history.queries \(5, 16\), but the file's is \(4, 16\)"):
        check_config_matches_weights(wider, weights, "here")
    DeepNMTForConditionalGeneration(tiny_config(DeepNMTConfig)).save_pretrained(tmp_path / "plain")
    plain = [str(tmp_path / "plain" / "model.safetensors")]
    with pytest.raises(ValueError, match=r"pseudo-queries encoder.history.queries \(4, 16\), but the file has none"):
        check_config_matches_weights(config, plain, "here")


def test_growing_and_the_ctranslate2_export_refuse_them_by_name(tiny_config):
    config = tiny_config(DeepNMTConfig, encoder_layer_aggregation="block_attnres", decoder_layer_aggregation="attnres")
    blockers = ctranslate2_blockers(config)
    assert any(line.startswith("`encoder_layer_aggregation='block_attnres'` (Block Attention") for line in blockers)
    assert any(line.startswith("`decoder_layer_aggregation='attnres'` (Attention Residuals") for line in blockers)
    with pytest.raises(
        ValueError, match=r"`decoder_layer_aggregation='attnres'` \(Attention Residuals: a pseudo-query"
    ):
        grow_encoder(DeepNMTForConditionalGeneration(config), 1)
