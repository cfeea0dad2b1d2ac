"""The seats of the model code where a method plugs in, checked by what runs through them: the decoder's causal mask
goes to a self-attention class that says it takes one; MAtt's running sum reaches it as a named argument; the MSC
encoder's history comes from the aggregation table and runs the encoder's modules of the moment."""

import copy

import torch

from hf_deep_nmt import DeepNMTConfig, MscConfig
from hf_deep_nmt.modeling import modeling_deep_nmt
from hf_deep_nmt.modeling.modeling_deep_nmt import (
    LAYER_AGGREGATION_CLASSES,
    DeepNMTAttention,
    DeepNMTAverageAttention,
    DeepNMTMergedAttention,
    DeepNMTMultiscaleHistory,
    DeepNMTResidualHistory,
)

SOURCE = torch.tensor([[5, 6, 7, 2]])
TARGET = torch.tensor([[0, 8, 9]])
NEG = torch.finfo(torch.float32).min


def record_self_attention_masks(model) -> list:
    masks = []
    for layer in model.model.decoder.layers:
        layer.self_attn.register_forward_hook(
            lambda module, args, kwargs, output: masks.append(kwargs.get("attention_mask")), with_kwargs=True
        )
    return masks


def test_the_causal_mask_goes_to_a_self_attention_that_takes_one(tiny_config, random_model, monkeypatch):
    """A self-attention class that says it takes the causal mask gets it (here an AAN variant, which the stock AAN
    does not): the decoder decides by the class, not by the name of the config choice."""

    class MaskedAverage(DeepNMTAverageAttention):
        takes_causal_mask = True

    stock = random_model(tiny_config(DeepNMTConfig, decoder_self_attention="average"))
    stock_masks = record_self_attention_masks(stock)
    monkeypatch.setitem(modeling_deep_nmt.DECODER_ATTENTION_CLASSES, "average", (MaskedAverage, DeepNMTAttention))
    masked = random_model(tiny_config(DeepNMTConfig, decoder_self_attention="average"))
    masked_masks = record_self_attention_masks(masked)
    with torch.no_grad():
        stock(input_ids=SOURCE, decoder_input_ids=TARGET)
        masked(input_ids=SOURCE, decoder_input_ids=TARGET)

    assert stock_masks and all(mask is None for mask in stock_masks)
    assert len(masked_masks) == len(masked.model.decoder.layers)
    expected = torch.tensor([[0.0, NEG, NEG], [0.0, 0.0, NEG], [0.0, 0.0, 0.0]])
    for mask in masked_masks:
        assert mask.shape == (1, 1, 3, 3) and torch.equal(mask[0, 0], expected)


def test_merged_attention_gets_its_running_sum_as_a_named_argument(tiny_config, random_model):
    """Cached MAtt decoding: each merged sublayer gets the layer's cache layer of the self-attention half as
    `average_cache_layer`, and its running sum counts the decoded tokens."""
    model = random_model(tiny_config(DeepNMTConfig, decoder_self_attention="merged_average"))
    received = []
    for layer in model.model.decoder.layers:
        assert type(layer.encoder_attn) is DeepNMTMergedAttention
        layer.encoder_attn.register_forward_hook(
            lambda module, args, kwargs, output: received.append(kwargs["average_cache_layer"]), with_kwargs=True
        )
    with torch.no_grad():
        first = model(input_ids=SOURCE, decoder_input_ids=TARGET[:, :2], use_cache=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        model(input_ids=SOURCE, decoder_input_ids=TARGET[:, 2:], cache=cache, use_cache=True)
    layers = cache.self_attention_cache.layers
    count = len(model.model.decoder.layers)
    assert received[:count] == layers[:count] and received[count:] == layers[:count]
    assert all(layer.steps == 3 and layer.running_sum.shape == (1, 1, model.config.d_model) for layer in layers)


def test_the_msc_encoder_history_comes_from_the_aggregation_table(tiny_config):
    config = tiny_config(MscConfig, msc_block_layers=[2, 1])
    residual = LAYER_AGGREGATION_CLASSES[config.encoder_layer_aggregation]
    assert residual is DeepNMTResidualHistory
    assert type(residual.for_stack(config, "encoder")) is DeepNMTMultiscaleHistory
    assert type(residual.for_stack(config, "decoder")) is DeepNMTResidualHistory
    plain = tiny_config(DeepNMTConfig)
    assert type(residual.for_stack(plain, "encoder")) is DeepNMTResidualHistory


def test_the_msc_history_runs_the_modules_the_encoder_holds_now(tiny_config, random_model):
    """The history holds no module and no encoder: a context cell or block LayerNorm replaced on the encoder (as
    an adapter library replaces modules it trains) is the one that runs, and putting the old one back restores the
    output."""
    model = random_model(tiny_config(MscConfig, msc_block_layers=[2, 1]))
    encoder = model.model.encoder
    assert list(encoder.history.children()) == []
    assert encoder.layer_norm is None  # the top block's LayerNorm ends the encoder
    with torch.no_grad():
        before = model(input_ids=SOURCE, decoder_input_ids=TARGET).logits
        for name in ("context", "block_layer_norms"):
            original = getattr(encoder, name)
            replacement = copy.deepcopy(original)
            for parameter in replacement.parameters():
                parameter.mul_(2.0)
            setattr(encoder, name, replacement)
            changed = model(input_ids=SOURCE, decoder_input_ids=TARGET).logits
            setattr(encoder, name, original)
            assert not torch.allclose(changed, before), name
            assert torch.equal(model(input_ids=SOURCE, decoder_input_ids=TARGET).logits, before), name
