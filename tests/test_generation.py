"""Incremental decoding and generate(): cached == uncached, greedy == a hand loop, beam reordering, sampling."""

import pytest
import torch

from hf_deep_nmt import MODEL_CLASSES, DeepNMTConfig, DlclConfig

SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])  # 1 is padding
TARGET = torch.tensor([[0, 6, 8, 12], [0, 13, 4, 4]])
MAX_NEW_TOKENS = 8


def source_inputs() -> dict:
    return dict(input_ids=SOURCE, attention_mask=SOURCE.ne(1).long())


def source_dependent(model) -> bool:
    """Whether the model's greedy outputs depend on the source: the two sources are translated differently, with more
    than two distinct tokens (random weights tend to repeat one token for any source)."""
    with torch.no_grad():
        generated = model.eval().generate(**source_inputs(), max_new_tokens=MAX_NEW_TOKENS)
    model.train()
    return not torch.equal(generated[0], generated[1]) and len(set(generated[:, 1:].flatten().tolist())) > 2


@pytest.fixture(scope="module")
def copy_trained_model():
    """`copy_trained_model(config)`: a model trained to copy its source until its greedy outputs depend on the source
    (checked after 40, 60, 80 steps, at most 100 as before: most architectures get there by 40; fewer than 40 steps
    leave some beam searches without a reordered hypothesis), so that its outputs change from source to source and
    step to step. Trained once per config in this module."""
    trained = {}

    def make(config):
        key = config.to_json_string()
        if key not in trained:
            torch.manual_seed(0)
            model = MODEL_CLASSES[type(config)](config).train()
            data = torch.Generator().manual_seed(0)
            optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            for step in range(1, 101):
                source = torch.cat([torch.randint(3, 37, (32, 4), generator=data), torch.full((32, 1), 2)], dim=1)
                loss = model(input_ids=source, labels=source).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step >= 40 and step % 20 == 0 and source_dependent(model):
                    break
            trained[key] = model.eval()
        return trained[key]

    return make


def test_stepwise_cached_decoding_matches_full_forward(architecture_config, random_model):
    model = random_model(architecture_config)
    with torch.no_grad():
        full = model(**source_inputs(), decoder_input_ids=TARGET).logits
        encoder_outputs = model.get_encoder()(**source_inputs())
        cache, steps = None, []
        for position in range(TARGET.shape[1]):
            outputs = model(
                encoder_outputs=encoder_outputs,
                attention_mask=source_inputs()["attention_mask"],
                decoder_input_ids=TARGET[:, position : position + 1],
                past_key_values=cache,
                use_cache=True,
            )
            cache = outputs.past_key_values
            assert cache.get_seq_length() == position + 1
            steps.append(outputs.logits)
        # the check has teeth: the last token alone, without the cache, is decoded differently
        uncached_last = model(
            encoder_outputs=encoder_outputs,
            attention_mask=source_inputs()["attention_mask"],
            decoder_input_ids=TARGET[:, -1:],
            use_cache=False,
        ).logits
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert not torch.allclose(uncached_last, full[:, -1:], atol=1e-3)


def test_cached_decoding_in_chunks_matches_full_forward(architecture_config, random_model):
    model = random_model(architecture_config)
    with torch.no_grad():
        full = model(**source_inputs(), decoder_input_ids=TARGET).logits
        cache, chunks = None, []
        for start, end in ((0, 1), (1, 3), (3, 4)):  # a causal mask offset by the cached length
            outputs = model(
                **source_inputs(), decoder_input_ids=TARGET[:, start:end], past_key_values=cache, use_cache=True
            )
            cache = outputs.past_key_values
            chunks.append(outputs.logits)
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


def hand_greedy(model, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding by full forward passes: argmax of the last logits, padding after end of sentence."""
    config = model.config
    decoded = torch.full((SOURCE.shape[0], 1), config.decoder_start_token_id)
    finished = torch.zeros(SOURCE.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = model(**source_inputs(), decoder_input_ids=decoded, use_cache=False).logits[:, -1]
        next_tokens = torch.where(finished, config.pad_token_id, logits.argmax(dim=-1))
        decoded = torch.cat([decoded, next_tokens[:, None]], dim=1)
        finished |= next_tokens == config.eos_token_id
        if finished.all():
            break
    return decoded


def test_greedy_generate_matches_a_hand_greedy_loop(architecture_config, copy_trained_model):
    model = copy_trained_model(architecture_config)
    with torch.no_grad():
        generated = model.generate(**source_inputs(), max_new_tokens=MAX_NEW_TOKENS)
        expected = hand_greedy(model, MAX_NEW_TOKENS)
    assert torch.equal(generated, expected)
    # not a constant output: the two sources are translated differently, with more than one distinct token
    assert not torch.equal(generated[0], generated[1])
    assert len(set(generated[:, 1:].flatten().tolist())) > 2


def test_beam_search_with_and_without_cache_agree(architecture_config, copy_trained_model):
    model = copy_trained_model(architecture_config)
    settings = dict(
        max_new_tokens=MAX_NEW_TOKENS,
        num_beams=4,
        num_return_sequences=2,
        return_dict_in_generate=True,
        output_scores=True,
    )
    with torch.no_grad():
        cached = model.generate(**source_inputs(), use_cache=True, **settings)
        uncached = model.generate(**source_inputs(), use_cache=False, **settings)
    sequences = cached.sequences
    assert sequences.shape[0] == 4 and sequences.shape[1] <= 1 + MAX_NEW_TOKENS
    assert ((sequences >= 0) & (sequences < 37)).all() and (sequences[:, 0] == 0).all()
    assert torch.equal(sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores)
    # the two sources are translated differently, so their cross-attention caches must not be swapped either
    assert not torch.equal(sequences[:2], sequences[2:])
    # the cache was reordered: some hypothesis descends from a beam other than its own at an earlier step
    paths = cached.beam_indices[:, : sequences.shape[1] - 1]
    assert any(len(set(path[path >= 0].tolist())) > 1 for path in paths)


@pytest.mark.parametrize("config_class", [DeepNMTConfig, DlclConfig])
def test_sampling_is_seeded_and_returns_valid_ids(tiny_config, random_model, config_class):
    model = random_model(tiny_config(config_class), scale=0.5)
    settings = dict(do_sample=True, max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=3)
    with torch.no_grad():
        torch.manual_seed(7)
        first = model.generate(**source_inputs(), **settings)
        torch.manual_seed(7)
        again = model.generate(**source_inputs(), **settings)
        torch.manual_seed(8)
        other = model.generate(**source_inputs(), **settings)
    assert first.shape[0] == 6 and first.shape[1] <= 1 + MAX_NEW_TOKENS
    assert ((first >= 0) & (first < 37)).all() and (first[:, 0] == 0).all()
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_generation_config_takes_the_special_ids_of_the_model_config(tiny_config, random_model):
    model = random_model(tiny_config(DlclConfig, eos_token_id=3, pad_token_id=4, decoder_start_token_id=5))
    generation_config = model.generation_config
    assert (generation_config.eos_token_id, generation_config.pad_token_id) == (3, 4)
    assert generation_config.decoder_start_token_id == 5
    with torch.no_grad():
        generated = model.generate(input_ids=torch.tensor([[6, 9, 14, 7, 3]]), max_new_tokens=3)
    assert generated[0, 0] == 5


def test_seeded_sampling_with_and_without_cache_agree(architecture_config, copy_trained_model):
    model = copy_trained_model(architecture_config)
    settings = dict(do_sample=True, max_new_tokens=MAX_NEW_TOKENS, num_return_sequences=2, temperature=2.0)
    with torch.no_grad():
        torch.manual_seed(3)
        cached = model.generate(**source_inputs(), use_cache=True, **settings)
        torch.manual_seed(3)
        uncached = model.generate(**source_inputs(), use_cache=False, **settings)
        torch.manual_seed(3)
        greedy = model.generate(**source_inputs(), max_new_tokens=MAX_NEW_TOKENS)
    assert torch.equal(cached, uncached)
    # the check has teeth: at this temperature the samples are not the greedy outputs
    assert not torch.equal(cached[::2, : greedy.shape[1]], greedy)


def test_beam_search_moves_only_the_self_attention_half_of_the_cache(tiny_config, random_model, monkeypatch):
    """A sentence's beams hold identical encoder-side states, so beam search reorders the self-attention half only
    (the exactness across every architecture is `test_beam_search_with_and_without_cache_agree`); a direct
    `reorder_cache` call still moves both halves."""
    from transformers.cache_utils import EncoderDecoderCache

    model = random_model(tiny_config(DlclConfig))
    moved = []
    original = EncoderDecoderCache.reorder_cache

    def spy(cache, beam_idx):
        moved.append("both halves")
        return original(cache, beam_idx)

    monkeypatch.setattr(EncoderDecoderCache, "reorder_cache", spy)
    with torch.no_grad():
        outputs = model.generate(
            **source_inputs(), num_beams=3, max_new_tokens=4, return_dict_in_generate=True, use_cache=True
        )
    cache = outputs.past_key_values
    assert moved == []  # generate() never called the whole cache's reordering
    cross = cache.cross_attention_cache.layers[0]
    before = cross.keys.clone()
    flipped = torch.arange(before.shape[0] - 1, -1, -1)
    cache.reorder_cache(flipped)
    assert moved == ["both halves"] and torch.equal(cross.keys, before[flipped])
