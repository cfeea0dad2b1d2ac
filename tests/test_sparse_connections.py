"""SDT sparse block connections: equivalences with dense DLCL and the residual stack, the block combination against a
hand computation, boundaries in the config, and the SdtConfig preset.

Cached == full decoding, padding, save/load, beams and remote code run through the shared `ARCHITECTURES`."""

import inspect

import pytest
import torch
from torch.nn import functional as F

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration, SdtConfig, SdtForConditionalGeneration
from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTBlockHistory

SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
TARGET = torch.tensor([[0, 6, 8, 12], [0, 13, 4, 4]])


def config(**overrides) -> DeepNMTConfig:
    settings = dict(
        vocab_size=37,
        d_model=16,
        encoder_layers=4,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=20,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    settings.update(overrides)
    return DeepNMTConfig(**settings)


def logits(model: DeepNMTForConditionalGeneration) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=SOURCE, attention_mask=SOURCE.ne(1), decoder_input_ids=TARGET).logits


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(5)
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.add_(torch.randn_like(tensor) * 0.3)
    return model


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_one_block_per_layer_is_dense_dlcl(pre_norm):
    dense = perturb(DeepNMTForConditionalGeneration(config(layer_aggregation="dlcl", pre_norm=pre_norm)))
    sparse = DeepNMTForConditionalGeneration(
        config(layer_aggregation="sparse", sparse_block_size=1, pre_norm=pre_norm)
    )
    assert sparse.config.encoder_block_boundaries == [0, 1, 2, 3, 4]
    sparse.load_state_dict(dense.state_dict(), strict=True)  # same parameter names and shapes
    torch.testing.assert_close(logits(sparse), logits(dense), rtol=0, atol=0)


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_a_single_block_with_last_output_weights_is_the_residual_stack(pre_norm):
    residual = perturb(DeepNMTForConditionalGeneration(config(pre_norm=pre_norm)))
    sparse = DeepNMTForConditionalGeneration(
        config(
            layer_aggregation="sparse",
            encoder_block_boundaries=[0, 4],
            decoder_block_boundaries=[0, 3],
            dlcl_history_norm=False,
            pre_norm=pre_norm,
        )
    )
    result = sparse.load_state_dict(residual.state_dict(), strict=False)
    assert sorted(result.missing_keys) == ["model.decoder.history.weight", "model.encoder.history.weight"]
    with torch.no_grad():
        for stack in (sparse.model.encoder, sparse.model.decoder):
            stack.history.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))  # block reads y_0, output = y_L
    torch.testing.assert_close(logits(sparse), logits(residual), rtol=0, atol=0)


@pytest.mark.parametrize("pre_norm", [True, False], ids=["prenorm", "postnorm"])
def test_block_inputs_and_output_are_the_hand_weighted_sums(pre_norm):
    history = DeepNMTBlockHistory(config(pre_norm=pre_norm), num_layers=5, boundaries=[0, 2, 5])
    assert history.weight.shape == (3, 3) and len(history.layer_norms) == 2
    torch.manual_seed(0)
    with torch.no_grad():
        weight = torch.randn(3, 3)
        history.weight.copy_(weight.tril() + torch.full((3, 3), 1e3).triu(1))  # above the diagonal: unused
        for norm in history.layer_norms:
            norm.weight.copy_(torch.rand(16) + 0.5)
            norm.bias.copy_(torch.randn(16))
    y = [torch.randn(2, 3, 16) * 2 + 1 for _ in range(6)]  # y_0 (embedding) .. y_5

    def ln(index, tensor):
        norm = history.layer_norms[index]
        return F.layer_norm(tensor, (16,), norm.weight, norm.bias, 1e-5)

    def row(r, stored):  # stored: the un-normalised y_0 and block outputs
        if pre_norm:
            terms = [stored[0]] + [ln(j - 1, stored[j]) for j in range(1, r + 1)]
            return sum(weight[r, j] * terms[j] for j in range(r + 1))
        total = sum(weight[r, j] * stored[j] for j in range(r + 1))
        return ln(r - 1, total) if r >= 1 else total

    with torch.no_grad():
        state = history.start(y[0])
        expected_inputs = [row(0, [y[0]]), y[1], row(1, [y[0], y[2]]), y[3], y[4]]  # layers 0..4
        for index in range(5):
            torch.testing.assert_close(history.layer_input(state, index), expected_inputs[index])
            history.push(state, y[index + 1], index)
        torch.testing.assert_close(history.stack_output(state), row(2, [y[0], y[2], y[5]]))
        assert state.count == 3 and state.buffer.shape == (3, 2, 3, 16)  # only y_0 and the two block outputs


def test_block_weights_start_as_the_uniform_average():
    model = DeepNMTForConditionalGeneration(config(encoder_layer_aggregation="sparse", sparse_block_size=3))
    assert model.config.encoder_block_boundaries == [0, 3, 4]  # the last block is shorter
    expected = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(model.model.encoder.history.weight.detach(), expected)
    assert not [name for name, _ in model.named_parameters() if "decoder.history" in name]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"encoder_block_boundaries": [0, 2, 4]}, r"`encoder_block_boundaries=\[0, 2, 4\]` only applies with"),
        ({"layer_aggregation": "sparse", "encoder_block_boundaries": [0, 2, 5]}, r"from 0 to `encoder_layers` \(4\)"),
        ({"layer_aggregation": "sparse", "encoder_block_boundaries": [1, 4]}, r"got \[1, 4\]"),
        ({"layer_aggregation": "sparse", "decoder_block_boundaries": [0, 2, 2, 3]}, r"got \[0, 2, 2, 3\]"),
        ({"layer_aggregation": "sparse", "decoder_block_boundaries": [0, "3"]}, r"got \[0, '3'\]"),
        ({"layer_aggregation": "sparse", "sparse_block_size": 0}, r"`sparse_block_size` must be a positive integer"),
        (
            {"layer_aggregation": "blocks"},
            r"`layer_aggregation` must be one of \('residual', 'dlcl', 'sparse', 'attnres', 'block_attnres'",
        ),
    ],
)
def test_invalid_block_settings_name_field_and_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_sdt_config_defaults_are_the_paper_system():
    sdt = SdtConfig()
    assert sdt.model_type == "deep_nmt_sdt"
    assert (sdt.encoder_layers, sdt.decoder_layers, sdt.d_model, sdt.pre_norm) == (48, 6, 512, True)
    assert (sdt.encoder_layer_aggregation, sdt.decoder_layer_aggregation) == ("sparse", "residual")
    assert sdt.encoder_block_boundaries == list(range(0, 49, 6)) and sdt.decoder_block_boundaries is None
    assert sdt.relative_position_window == 8 and sdt.share_embeddings
    assert (sdt.dropout, sdt.attention_dropout, sdt.activation_dropout) == (0.1, 0.1, 0.1)
    own = {name for name, value in vars(SdtForConditionalGeneration).items() if inspect.isfunction(value)}
    assert own == set() and SdtForConditionalGeneration.config_class is SdtConfig
