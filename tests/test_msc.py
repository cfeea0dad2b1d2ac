"""MSC (Wei et al. 2020): configuration, routing of every memory, the equations of a layer and of the context cell by
hand, the ablation switches, the paper's parameter counts, the encoder L2 term, and `encoder_outputs` handling.

Cached == uncached decoding, padding invariance, beams and save -> load run for the MSC variants of the shared
architecture parametrization (tests/conftest.py)."""

import pytest
import torch
from torch.nn import functional as F
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from hf_deep_nmt import DeepNMTConfig, DeepNMTForConditionalGeneration, MscConfig, MscForConditionalGeneration
from hf_deep_nmt.training.growing import grow_encoder

SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
MASK = SOURCE.ne(1).long()
TARGET = torch.tensor([[0, 6, 8, 12], [0, 13, 4, 4]])


def capture_inputs(module, store: list) -> None:
    """Record `key_value_states` of every call of an attention module."""

    def hook(_module, args, kwargs):
        store.append(kwargs["key_value_states"])

    module.register_forward_pre_hook(hook, with_kwargs=True)


def capture_outputs(module, store: list) -> None:
    module.register_forward_hook(lambda _module, _args, output: store.append(output))


# --- configuration ---------------------------------------------------------------------------------------------------


def test_msc_config_defaults_are_the_wmt_base_system():
    config = MscConfig()
    assert config.model_type == "deep_nmt_msc"
    assert (config.msc_blocks, config.encoder_layers, config.decoder_layers) == ([6] * 6, 36, 6)
    assert config.pre_norm and (config.d_model, config.encoder_ffn_dim, config.encoder_attention_heads) == (
        512,
        2048,
        8,
    )
    assert config.msc_context == "gru" and config.msc_fusion == "gate"
    assert config.msc_block_boundaries() == [0, 6, 12, 18, 24, 30, 36]


@pytest.mark.parametrize(
    ("overrides", "layers", "boundaries"),
    [
        (dict(msc_block_layers=8), 48, [0, 8, 16, 24, 32, 40, 48]),
        (dict(msc_block_layers=[3, 1, 2], decoder_layers=3), 6, [0, 3, 4, 6]),
        (dict(msc_block_layers=2, decoder_layers=2, encoder_layers=4), 4, [0, 2, 4]),
    ],
)
def test_encoder_layers_follow_the_blocks(overrides, layers, boundaries):
    config = MscConfig(**overrides)
    assert config.encoder_layers == layers and config.msc_block_boundaries() == boundaries
    assert MscConfig.from_dict(config.to_dict()).msc_block_boundaries() == boundaries


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(msc_block_layers=[2, 2, 2]), "decoder_layers"),  # 3 blocks, 6 decoder layers
        (dict(msc_block_layers=2, encoder_layers=10), "encoder_layers"),  # 6 x 2 = 12
        (dict(msc_block_layers=0), "msc_block_layers"),
        (dict(msc_block_layers=[2, 0, 1, 1, 1, 1]), "msc_block_layers"),
        (dict(msc_block_layers=[]), "msc_block_layers"),
        (dict(msc_block_layers="6"), "msc_block_layers"),
        (dict(msc_block_layers=True), "msc_block_layers"),
        (dict(msc_fusion="concat"), "msc_fusion"),
        (dict(msc_context="lstm"), "msc_context"),
        (dict(msc_context_sides="yes"), "msc_context_sides"),
        (dict(encoder_l2_lambda=-1e-5), "encoder_l2_lambda"),
        (dict(encoder_l2_lambda=float("nan")), "encoder_l2_lambda"),
        (dict(encoder_layer_aggregation="dlcl"), "encoder_layer_aggregation"),
        (dict(decoder_self_attention="merged_average"), "decoder_self_attention"),
        (dict(msc_context="none", msc_fusion="add"), "msc_fusion"),
        (dict(msc_context="none", msc_context_sides="encoder"), "msc_context_sides"),
    ],
)
def test_bad_msc_settings_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        MscConfig(**overrides)


@pytest.mark.parametrize("field", ["msc_fusion", "msc_context_sides", "msc_context"])
def test_msc_switches_without_msc_raise(field):
    value = {"msc_fusion": "add", "msc_context_sides": "encoder", "msc_context": "gru_per_block"}[field]
    with pytest.raises(ValueError, match=f"{field}.*msc_block_layers"):
        DeepNMTConfig(**{field: value})


# --- parameter counts (Wei et al. 2020, Table 2, IWSLT) --------------------------------------------------------------

IWSLT = dict(
    vocab_size=10200,
    d_model=256,
    encoder_ffn_dim=512,
    decoder_ffn_dim=512,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
)


def parameters(config) -> int:
    with torch.device("meta"):
        model = (
            DeepNMTForConditionalGeneration(config)
            if type(config) is DeepNMTConfig
            else MscForConditionalGeneration(config)
        )
    return sum(parameter.numel() for parameter in model.parameters())


def test_parameter_counts_match_the_paper_table_2():
    baseline = parameters(DeepNMTConfig(**IWSLT))
    msc_6x1 = parameters(MscConfig(msc_block_layers=1, **IWSLT))
    msc_6x6 = parameters(MscConfig(msc_block_layers=6, **IWSLT))
    for measured, published in ((baseline, 10.5e6), (msc_6x1, 15.6e6), (msc_6x6, 43.3e6)):
        assert abs(measured - published) / published < 0.01, (measured, published)
    # independent of the vocabulary: 30 more layers with context attention and gate; the context parts of 6 + 6
    # layers, one GRU cell and 5 more block LayerNorms
    assert abs((msc_6x6 - msc_6x1) - 27.7e6) / 27.7e6 < 0.01
    assert abs((msc_6x1 - baseline) - 5.1e6) / 5.1e6 < 0.01
    d = 256
    attention, gate, gru = 4 * d * d + 4 * d, 2 * d * d + d, 6 * d * d + 6 * d
    assert msc_6x1 - baseline == 12 * (attention + gate) + gru + 5 * 2 * d


# --- routing ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def msc_model(tiny_config, random_model):
    # 3 encoder layers in blocks of 2 and 1, for the 2 decoder layers
    return random_model(tiny_config(MscConfig, msc_block_layers=[2, 1]))


def test_every_attention_reads_the_memory_of_its_block(msc_model):
    encoder, decoder = msc_model.model.encoder, msc_model.model.decoder
    layer_inputs, layer_outputs, block_norms, contexts = [], [], [[], []], []
    encoder.layers[0].register_forward_pre_hook(lambda _m, args: layer_inputs.append(args))
    for layer in encoder.layers:
        capture_outputs(layer, layer_outputs)
    for norm, store in zip(encoder.block_layer_norms, block_norms):
        capture_outputs(norm, store)
    capture_outputs(encoder.context, contexts)
    encoder_context_reads, decoder_block_reads, decoder_context_reads = [], [], []
    for layer in encoder.layers:
        capture_inputs(layer.context_attn, encoder_context_reads)
    for layer in decoder.layers:
        capture_inputs(layer.encoder_attn, decoder_block_reads)
        capture_inputs(layer.context_attn, decoder_context_reads)
    with torch.no_grad():
        msc_model(input_ids=SOURCE, attention_mask=MASK, decoder_input_ids=TARGET)

    embedding, _, first_context = layer_inputs[0]
    block_1, block_2 = block_norms[0][0], block_norms[1][0]
    context_1, context_2 = contexts
    # block outputs are the LayerNorm-ed outputs of the last layer of each block (layers 2 and 3)
    assert torch.equal(block_1, encoder.block_layer_norms[0](layer_outputs[1]))
    assert torch.equal(block_2, encoder.block_layer_norms[1](layer_outputs[2]))
    # C^0 is the encoder input; encoder block n reads C^{n-1}
    assert first_context is embedding
    assert [read is first_context for read in encoder_context_reads] == [True, True, False]
    assert encoder_context_reads[2] is context_1
    # decoder layer n reads block n and C^n
    # (slices of the batch-first stacks of the encoder output)
    assert torch.equal(decoder_block_reads[0], block_1) and torch.equal(decoder_block_reads[1], block_2)
    assert torch.equal(decoder_context_reads[0], context_1) and torch.equal(decoder_context_reads[1], context_2)
    assert not torch.equal(block_1, block_2) and not torch.equal(context_1, context_2)


def hand_gru(cell, inputs, hidden):
    """torch's GRU equations written out: r, z gates, candidate n, h' = (1 - z) n + z h."""
    gi = inputs @ cell.weight_ih.T + cell.bias_ih
    gh = hidden @ cell.weight_hh.T + cell.bias_hh
    (i_r, i_z, i_n), (h_r, h_z, h_n) = gi.chunk(3, -1), gh.chunk(3, -1)
    reset, update = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    candidate = torch.tanh(i_n + reset * h_n)
    return (1 - update) * candidate + update * hidden


def test_context_states_are_a_gru_run_position_wise_across_blocks(msc_model):
    encoder = msc_model.model.encoder
    with torch.no_grad():
        output = encoder(input_ids=SOURCE, attention_mask=MASK)
        embedding = encoder.embed(SOURCE)
        cell = encoder.context.cells[0]
        context_1 = hand_gru(cell, output.block_outputs[:, 0], embedding)
        context_2 = hand_gru(cell, output.block_outputs[:, 1], context_1)
    torch.testing.assert_close(output.context_states[:, 0], context_1, rtol=0, atol=1e-6)
    torch.testing.assert_close(output.context_states[:, 1], context_2, rtol=0, atol=1e-6)
    assert torch.equal(output.last_hidden_state, output.block_outputs[:, -1])
    assert len(encoder.context.cells) == 1


@pytest.mark.parametrize("fusion", ["gate", "add"])
def test_encoder_layer_matches_the_hand_equations(tiny_config, random_model, fusion):
    model = random_model(tiny_config(DeepNMTConfig, msc_block_layers=[2, 1], msc_fusion=fusion))
    layer = model.model.encoder.layers[1]
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 5, 16, generator=generator)
    context = torch.randn(2, 5, 16, generator=generator)
    mask = torch.zeros(2, 1, 1, 5)
    mask[1, ..., 3:] = torch.finfo(torch.float32).min
    with torch.no_grad():
        normed = layer.self_attn_layer_norm(hidden)
        own = layer.self_attn(normed, attention_mask=mask)
        other = layer.context_attn(normed, key_value_states=context, attention_mask=mask)
        if fusion == "gate":
            weight, bias = layer.fusion_gate.weight, layer.fusion_gate.bias
            gate = torch.sigmoid(own @ weight[:, :16].T + other @ weight[:, 16:].T + bias)
            fused = gate * own + (1 - gate) * other
        else:
            assert layer.fusion_gate is None
            fused = own + other
        middle = hidden + fused
        expected = middle + layer.fc2(F.relu(layer.fc1(layer.final_layer_norm(middle))))
        torch.testing.assert_close(layer(hidden, mask, context), expected, rtol=0, atol=1e-5)


def test_context_attention_ignores_padded_source_positions(msc_model):
    """Changing the context state at a padded position changes nothing (the source mask applies to it)."""
    with torch.no_grad():
        encoded = msc_model.get_encoder()(input_ids=SOURCE, attention_mask=MASK)
        logits = msc_model(encoder_outputs=encoded, attention_mask=MASK, decoder_input_ids=TARGET).logits
        changed = encoded.context_states.clone()
        changed[1, :, 3:] += 100.0
        blocks = encoded.block_outputs.clone()
        blocks[1, :, 3:] -= 50.0
        altered = (encoded.last_hidden_state, blocks, changed)
        other = msc_model(encoder_outputs=altered, attention_mask=MASK, decoder_input_ids=TARGET).logits
    assert torch.equal(logits, other)


# --- ablation switches -----------------------------------------------------------------------------------------------


def test_without_contextual_collaboration_the_context_is_the_block_output(tiny_config, random_model):
    model = random_model(tiny_config(DeepNMTConfig, msc_block_layers=[2, 1], msc_context="block_output"))
    assert model.model.encoder.context.cells is None
    with torch.no_grad():
        output = model.get_encoder()(input_ids=SOURCE, attention_mask=MASK)
    assert torch.equal(output.context_states, output.block_outputs)


def test_without_context_attention_no_context_exists(tiny_config, random_model):
    model = random_model(tiny_config(DeepNMTConfig, msc_block_layers=[2, 1], msc_context="none"))
    assert model.model.encoder.context is None
    assert all(layer.context_attn is None and layer.fusion_gate is None for layer in model.model.encoder.layers)
    assert all(layer.context_attn is None for layer in model.model.decoder.layers)
    assert not any("context" in name or "fusion" in name for name, _ in model.named_parameters())
    with torch.no_grad():
        output = model.get_encoder()(input_ids=SOURCE, attention_mask=MASK)
    assert output.context_states is None and output.block_outputs.shape == (2, 2, 5, 16)
    assert model.config.decoder_layer_types == ["deep_nmt"] * model.config.decoder_layers


def test_encoder_side_context_only(tiny_config, random_model):
    model = random_model(tiny_config(DeepNMTConfig, msc_block_layers=[2, 1], msc_context_sides="encoder"))
    assert all(layer.context_attn is not None for layer in model.model.encoder.layers)
    assert all(layer.context_attn is None for layer in model.model.decoder.layers)
    with torch.no_grad():
        output = model.get_encoder()(input_ids=SOURCE, attention_mask=MASK)
    assert output.context_states is None


@pytest.mark.parametrize(
    ("context", "cell", "expected"), [("gru_per_block", "gru", 2), ("ffn", "ffn", 1), ("ffn_per_block", "ffn", 2)]
)
def test_context_cells(tiny_config, random_model, context, cell, expected):
    model = random_model(tiny_config(DeepNMTConfig, msc_block_layers=[2, 1], msc_context=context))
    cells = model.model.encoder.context.cells
    assert len(cells) == expected
    assert all(isinstance(c, torch.nn.GRUCell) == (cell == "gru") for c in cells)
    if cell == "ffn":
        encoder = model.model.encoder
        with torch.no_grad():
            output = encoder(input_ids=SOURCE, attention_mask=MASK)
            ffn = cells[-1]
            hidden = torch.cat([output.context_states[:, 0], output.block_outputs[:, 1]], dim=-1)
            expected_state = ffn.fc2(F.relu(ffn.fc1(hidden)))
        torch.testing.assert_close(output.context_states[:, 1], expected_state, rtol=0, atol=1e-6)


# --- encoder L2 ------------------------------------------------------------------------------------------------------


def test_encoder_l2_term_is_lambda_times_the_sum_of_squared_encoder_weight_matrices(tiny_config, random_model):
    batch = dict(input_ids=SOURCE, attention_mask=MASK, labels=torch.tensor([[6, 8, 12, 2], [13, 2, -100, -100]]))
    regularised = random_model(tiny_config(MscConfig, msc_block_layers=[2, 1], encoder_l2_lambda=0.25)).train()
    # by name: every 2-D encoder weight except the (shared) token embedding
    names = [
        name
        for name, parameter in regularised.model.encoder.named_parameters()
        if parameter.dim() == 2 and name != "embed_tokens.weight"
    ]
    assert any("context.cells.0.weight_hh" in name for name in names) and any("fusion_gate" in n for n in names)
    by_hand = sum(dict(regularised.model.encoder.named_parameters())[n].pow(2).sum() for n in names)
    assert torch.equal(regularised.encoder_l2_penalty(), by_hand)
    outputs = regularised(**batch, return_logits=True)
    cross_entropy = F.cross_entropy(outputs.logits.view(-1, 37), batch["labels"].view(-1))
    torch.testing.assert_close(outputs.loss, cross_entropy + 0.25 * by_hand, rtol=1e-6, atol=0)
    # the training step's chunked loss (no logits) adds it too
    torch.testing.assert_close(regularised(**batch).loss, cross_entropy + 0.25 * by_hand, rtol=1e-6, atol=0)
    # evaluation losses stay the plain cross-entropy
    assert torch.equal(regularised.eval()(**batch).loss, cross_entropy)
    # lambda = 0: nothing added
    regularised.train().config.encoder_l2_lambda = 0.0
    assert torch.equal(regularised(**batch, return_logits=True).loss, cross_entropy)


def test_encoder_l2_gradient_reaches_encoder_weights_only(tiny_config, random_model):
    model = random_model(tiny_config(DeepNMTConfig, msc_block_layers=[2, 1], encoder_l2_lambda=1.0)).train()
    model.encoder_l2_penalty().backward()
    for name, parameter in model.named_parameters():
        touched = parameter.grad is not None and bool(parameter.grad.abs().sum())
        expected = name.startswith("model.encoder.layers") and name.endswith("weight") and parameter.dim() == 2
        expected = expected or name.startswith("model.encoder.context.cells.0.weight_")
        assert touched == expected, name


# --- encoder outputs and caches --------------------------------------------------------------------------------------


def test_encoder_outputs_may_be_passed_as_a_tuple(msc_model):
    with torch.no_grad():
        encoded = msc_model.get_encoder()(input_ids=SOURCE, attention_mask=MASK)
        reference = msc_model(input_ids=SOURCE, attention_mask=MASK, decoder_input_ids=TARGET).logits
        as_tuple = msc_model(encoder_outputs=encoded.to_tuple(), attention_mask=MASK, decoder_input_ids=TARGET).logits
    assert torch.equal(reference, as_tuple)


def test_encoder_outputs_without_blocks_raise(msc_model):
    encoded = msc_model.get_encoder()(input_ids=SOURCE, attention_mask=MASK)
    with pytest.raises(ValueError, match=r"block_outputs.*\(batch, 2, source_length, 16\)"):
        msc_model(
            encoder_outputs=BaseModelOutput(last_hidden_state=encoded.last_hidden_state), decoder_input_ids=TARGET
        )
    with pytest.raises(ValueError, match="context_states"):
        msc_model(encoder_outputs=(encoded.last_hidden_state, encoded.block_outputs), decoder_input_ids=TARGET)


def test_a_cache_built_without_the_config_holds_the_context_keys_too(msc_model):
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with torch.no_grad():
        first = msc_model(
            input_ids=SOURCE, attention_mask=MASK, decoder_input_ids=TARGET, past_key_values=cache, use_cache=True
        ).logits
        second = msc_model(input_ids=SOURCE, attention_mask=MASK, decoder_input_ids=TARGET, use_cache=True).logits
    assert torch.equal(first, second)
    layers = cache.cross_attention_cache.layers
    assert len(layers) == msc_model.config.decoder_layers
    assert all(layer.context_keys is not None and layer.keys is not None for layer in layers)


def test_beam_search_reorders_the_context_keys(msc_model):
    """Beams (4, 2 returned) with the cache equal those without, with a padded source."""
    kwargs = dict(input_ids=SOURCE, attention_mask=MASK, num_beams=4, num_return_sequences=2, max_new_tokens=7)
    with torch.no_grad():
        cached = msc_model.generate(**kwargs, use_cache=True)
        uncached = msc_model.generate(**kwargs, use_cache=False)
    assert torch.equal(cached, uncached)


def test_growing_an_msc_encoder_is_refused_with_the_reason(msc_model):
    with pytest.raises(ValueError, match=r"MSC models \(msc_block_layers=\[2, 1\]\).*decoder layer"):
        grow_encoder(msc_model, 2)
