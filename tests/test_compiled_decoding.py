"""One traceable forward: the static cache decodes exactly as the dynamic one, compiled decoding exactly as eager, the
training forward of every family is one graph, and the ONNX export computes what torch computes on padded batches."""

import importlib.util

import pytest
import torch
from conftest import method_families
from transformers import CompileConfig
from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache

from hf_deep_nmt.modeling.modeling_deep_nmt import DeepNMTDynamicCacheLayer, DeepNMTStaticCacheLayer
from hf_deep_nmt.tools import doctor

# One variant per registered method (its first check; `doctor.FAMILIES` holds every check), each costing several CPU
# seconds of tracing: the post-norm and AAN variants are left to the eager `ARCHITECTURES` matrix, `doctor` and
# the CUDA tests (DLCL post-norm keeps the whole-forward ONNX export below).
FAMILIES = sorted(method_families())
SOURCE = torch.tensor([[5, 9, 14, 3, 22, 2], [7, 11, 2, 1, 1, 1]])
MASK = SOURCE.ne(1)
MODES = {
    "greedy": dict(),
    "beam4": dict(num_beams=4, num_return_sequences=2),
    "sampling": dict(do_sample=True, top_k=0),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    return request.param, doctor.family_model(request.param, "cpu")


def generate(model, seed=0, **options):
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(SOURCE, attention_mask=MASK, max_new_tokens=12, min_new_tokens=12, **options)


# ---- the static cache -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_static_cache_decodes_exactly_as_the_dynamic_one(family_model, mode):
    _, model = family_model
    options = dict(MODES[mode], return_dict_in_generate=True, output_logits=True)
    dynamic = generate(model, **options)
    static = generate(model, cache_implementation="static", **options)
    assert torch.equal(static.sequences, dynamic.sequences)
    # the scores too, not only the choices they lead to
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), rtol=1e-5, atol=1e-5)


def test_generate_builds_the_static_layers_for_every_decoder_layer(family_model):
    _, model = family_model
    with torch.no_grad():
        out = model.generate(
            SOURCE, attention_mask=MASK, max_new_tokens=3, cache_implementation="static", return_dict_in_generate=True
        )
    cache = out.past_key_values
    for half in (cache.self_attention_cache, cache.cross_attention_cache):
        assert len(half.layers) == model.config.decoder_layers
        assert all(isinstance(layer, DeepNMTStaticCacheLayer) for layer in half.layers)


def step_logits(model, cache, steps: int, corrupt_unwritten: bool = False) -> list[torch.Tensor]:
    """Logits of `steps` greedy decoding steps, one token at a time through `cache`; optionally writing huge values
    into every static slot not yet written before each step."""
    encoder_outputs = model.get_encoder()(input_ids=SOURCE, attention_mask=MASK)
    tokens = torch.zeros(SOURCE.shape[0], 1, dtype=torch.long)
    logits = []
    with torch.no_grad():
        for step in range(steps):
            if corrupt_unwritten and step > 0:
                for layer in cache.self_attention_cache.layers:
                    if layer.keys is not None:
                        layer.keys[:, :, step:] = 1e4
                        layer.values[:, :, step:] = -1e4
            out = model(
                encoder_outputs=encoder_outputs,
                attention_mask=MASK,
                decoder_input_ids=tokens,
                past_key_values=cache,
                use_cache=True,
            )
            logits.append(out.logits[:, -1])
            tokens = out.logits[:, -1:].argmax(-1)
    return logits


@pytest.mark.parametrize("family", ["prenorm", "sdt-sparse-rpr", "dsinit-matt"])
def test_unwritten_static_slots_are_masked(family):
    model = doctor.family_model(family, "cpu")
    dynamic = step_logits(
        model, EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config)), 5
    )
    static = EncoderDecoderCache(
        StaticCache(config=model.config, max_cache_len=16),
        StaticCache(config=model.config, max_cache_len=SOURCE.shape[1]),
    )
    corrupted = step_logits(model, static, 5, corrupt_unwritten=True)
    for expected, got in zip(dynamic, corrupted):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_static_layers_reorder_in_place_and_dynamic_layers_by_selection():
    static = DeepNMTStaticCacheLayer(max_cache_len=4)
    keys = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, 2).contiguous()
    static.update(keys, keys + 10)
    static.update_average(torch.arange(3.0)[:, None, None].expand(3, 1, 2))
    static.remember_context(lambda: (keys * 2, keys * 3))
    addresses = [tensor.data_ptr() for tensor in (static.keys, static.values, static.running_sum, static.context_keys)]
    static.reorder_cache(torch.tensor([2, 2, 0]))
    assert [tensor.data_ptr() for tensor in (static.keys, static.values, static.running_sum, static.context_keys)] == (
        addresses
    )  # a compiled step (a CUDA graph) keeps reading the same memory
    assert static.keys[:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0] and static.keys[:, 0, 1, 0].tolist() == [0.0] * 3
    assert static.running_sum[:, 0, 0].tolist() == [2.0, 2.0, 0.0]
    assert static.context_values[:, 0, 0, 0].tolist() == [6.0, 6.0, 0.0]
    dynamic = DeepNMTDynamicCacheLayer()
    dynamic.update(keys, keys + 10)
    dynamic.remember_context(lambda: (keys * 2, keys * 3))
    dynamic.reorder_cache(torch.tensor([1, 0, 0]))
    assert dynamic.keys[:, 0, 0, 0].tolist() == [1.0, 0.0, 0.0]
    assert dynamic.context_keys[:, 0, 0, 0].tolist() == [2.0, 0.0, 0.0]


def test_static_running_average_counts_steps_as_a_tensor():
    layer = DeepNMTStaticCacheLayer(max_cache_len=8)
    states = torch.randn(2, 5, 3)
    pieces = [
        layer.update_average(states[:, :2]),
        layer.update_average(states[:, 2:3]),
        layer.update_average(states[:, 3:]),
    ]
    expected = torch.cumsum(states, 1) / torch.arange(1, 6)[None, :, None]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected)
    assert isinstance(layer.get_seq_length(), torch.Tensor) and int(layer.get_seq_length()) == 5
    layer.reset()
    assert layer.get_seq_length() == 0


# ---- compiled decoding ----------------------------------------------------------------------------------------------


def graph_capture(backend: str = "eager") -> CompileConfig:
    """transformers' own route to a compiled decoding step, on the CPU too; `fullgraph=True` fails on any break."""
    config = CompileConfig(fullgraph=True, backend=backend, mode=None if backend != "inductor" else "default")
    config._compile_all_devices = True
    return config


def test_compiled_decoding_equals_eager_through_transformers_route(family_model):
    _, model = family_model
    eager = generate(model)
    torch._dynamo.reset()
    model.__dict__.pop("_compiled_call", None)
    compiled = generate(model, cache_implementation="static", compile_config=graph_capture())
    assert "_compiled_call" in model.__dict__  # the decoding steps went through torch.compile
    assert torch.equal(compiled, eager)


def test_compiled_forward_decoding_equals_eager(family_model):
    """Beam search never takes transformers' compiled route: compiling the forward covers it (what translate does).
    Greedy search is left out here: its step graph (one new token a row, the static cache, no reordering) is the
    forward that transformers' route above compiles for every family."""
    _, model = family_model
    eager = generate(model, **MODES["beam4"])
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)
    try:
        compiled = generate(model, cache_implementation="static", disable_compile=True, **MODES["beam4"])
    finally:
        del model.forward
    assert torch.equal(compiled, eager)


def test_inductor_compiled_decoding_equals_eager():
    model = doctor.family_model("dlcl-prenorm", "cpu")
    eager = generate(model)
    torch._dynamo.reset()
    compiled = generate(model, cache_implementation="static", compile_config=graph_capture("inductor"))
    again = generate(model, cache_implementation="static", compile_config=graph_capture("inductor"))
    assert torch.equal(compiled, eager) and torch.equal(again, eager)


# The families whose training step is compiled and checked against eager by
# `test_a_compiled_training_step_gives_eager_loss_and_gradients`: that test's fullgraph trace of the training forward
# is also their case of `test_the_training_forward_of_every_family_is_one_graph` (a second trace costs seconds each).
# SDT's sparse history is DLCL's class (`DeepNMTBlockHistory`; DLCL's every layer a block): its check is the dense
# history's too, and DLCL pre-norm's own compiled training (aot_eager, losses and weights against eager, no graph
# break) is tests/test_compiled_cpu_training.py's Trainer run; its forward is traced as one graph below (2 of the 5
# CPU s its training step here cost).
TRAINING_STEP_FAMILIES = ["sdt-sparse-rpr", "msc"]


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in TRAINING_STEP_FAMILIES])
def test_the_training_forward_of_every_family_is_one_graph(family):
    """Every family's training forward; those of `TRAINING_STEP_FAMILIES` are traced, as one graph, by the compiled
    training step's test."""
    model = doctor.family_model(family, "cpu")
    batch = doctor.padded_batch("cpu", [9, 6], model.config.vocab_size)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.train())(**batch)
    model.eval()
    assert explanation.graph_break_count == 0, [str(reason.reason)[:200] for reason in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("family", TRAINING_STEP_FAMILIES)
def test_a_compiled_training_step_gives_eager_loss_and_gradients(family):
    """The traced layer history (plain scaled sums) against the eager one (a custom autograd function). The trace is
    also this family's check of `test_the_training_forward_of_every_family_is_one_graph`: under `fullgraph=True` a
    graph break fails the compile, and the training forward is one graph."""
    from torch._dynamo.utils import counters

    model = doctor.family_model(family, "cpu").train()
    batch = doctor.padded_batch("cpu", [9, 6], model.config.vocab_size)

    def loss_and_gradients(forward):
        model.zero_grad()
        loss = forward(**batch).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = loss_and_gradients(model)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    compiled_loss, compiled_grads = loss_and_gradients(torch.compile(model, backend="aot_eager", fullgraph=True))
    model.eval()
    assert counters["stats"]["unique_graphs"] - graphs == 1  # the training forward is one graph
    torch.testing.assert_close(compiled_loss, eager_loss)
    assert compiled_grads.keys() == eager_grads.keys()
    for name in eager_grads:
        torch.testing.assert_close(compiled_grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    history = [name for name in eager_grads if name.endswith("history.weight")]
    assert history or family == "msc"  # the DLCL / sparse weights get their gradient through the traced path too


def test_out_of_vocabulary_ids_are_still_refused_eagerly():
    model = doctor.family_model("prenorm", "cpu")
    with pytest.raises(ValueError, match="Token id 99 is out of range"):
        model.generate(torch.tensor([[5, 99, 2]]), max_new_tokens=2, cache_implementation="static")


# ---- ONNX -----------------------------------------------------------------------------------------------------------

ONNX_MISSING = [name for name in ("onnx", "onnxscript", "onnxruntime") if importlib.util.find_spec(name) is None]


class LogitsOnly(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids, use_cache=False
        ).logits


# The whole cache-less forward, for the family whose code tests/test_onnx_decoding.py does not export (that file
# exports SDT with relative keys, MAtt, MSC, DeepNorm with DLCL connections and a trained plain post-norm model as
# decoding graphs, every family's cache slots through one code path): the Hyper-Connections' streams. Tracing costs
# per graph op, so the model is as deep as the streams need: two encoder layers (streams carried from one layer to
# the next) and one decoder layer (streams expanded from the embedding and merged into the output).
ONNX_FORWARD_FAMILIES = {"mhc-2-dynamic": dict(encoder_layers=2, decoder_layers=1)}


@pytest.mark.skipif(bool(ONNX_MISSING), reason=f"the onnx extra is not installed ({', '.join(ONNX_MISSING)})")
@pytest.mark.parametrize("family", ONNX_FORWARD_FAMILIES)
def test_the_onnx_export_computes_what_torch_computes_on_a_padded_batch(family, tmp_path):
    import onnxruntime

    model = doctor.family_model(family, "cpu", **ONNX_FORWARD_FAMILIES[family])
    wrapped = LogitsOnly(model).eval()
    example = (SOURCE, MASK.long(), torch.tensor([[0, 5, 7, 9], [0, 8, 2, 1]]))
    axes = {"input_ids": {0: "batch", 1: "source"}, "attention_mask": {0: "batch", 1: "source"}}
    program = torch.onnx.export(
        wrapped,
        example,
        dynamo=True,
        input_names=["input_ids", "attention_mask", "decoder_input_ids"],
        output_names=["logits"],
        dynamic_shapes={**axes, "decoder_input_ids": {0: "batch", 1: "target"}},
        verbose=False,
        # the graph as traced, without onnxscript's generic rewrites (3 of the export's 16 CPU s): what is checked here
        # is the trace of the streams; the rewrites run, and are checked, in tests/test_onnx_decoding.py's exports
        optimize=False,
    )
    program.save(tmp_path / f"{family}.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / f"{family}.onnx"))
    # another batch size and lengths than the example, padded rows included
    source = torch.tensor([[5, 9, 14, 3, 2, 1, 1], [7, 11, 12, 13, 14, 15, 2], [4, 2, 1, 1, 1, 1, 1]])
    mask, target = source.ne(1).long(), torch.tensor([[0, 5, 7], [0, 8, 2], [0, 3, 3]])
    feeds = {"input_ids": source.numpy(), "attention_mask": mask.numpy(), "decoder_input_ids": target.numpy()}
    (logits,) = session.run(None, feeds)
    with torch.no_grad():
        expected = wrapped(source, mask, target)
    torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-4, atol=1e-4)
    # the mask is in the graph: changing it changes the padded rows
    feeds["attention_mask"] = torch.ones_like(mask).numpy()
    assert not torch.allclose(torch.from_numpy(session.run(None, feeds)[0][0]), expected[0], atol=1e-3)


# ---- translate --compile --------------------------------------------------------------------------------------------


def test_translate_with_compiled_decoding_gives_the_same_translations(tiny_export, tmp_path, monkeypatch):
    """The route of `translate(compile=True)` and `--compile`, traced by Dynamo without Inductor's code generation:
    that Inductor's step decodes as eager is `test_inductor_compiled_decoding_equals_eager`'s (and doctor's) check."""
    from functools import partial

    from hf_deep_nmt.cli import main
    from hf_deep_nmt.serving import compiled, torch_decoder
    from hf_deep_nmt.serving.translate import translate

    monkeypatch.setattr(torch_decoder, "compiled_decoding", partial(compiled.compiled_decoding, backend="eager"))
    folder, model, tokenizer = tiny_export
    lines = ["el sol sale", "", "la mar no se llena hola", "hola mundo", "el sol"]
    eager = translate(model, tokenizer, lines, num_beams=2, batch_size=2)
    torch._dynamo.reset()
    model.__dict__.pop("_hf_deep_nmt_compiled_forward", None)
    assert translate(model, tokenizer, lines, num_beams=2, batch_size=2, compile=True) == eager
    assert "_hf_deep_nmt_compiled_forward" in model.__dict__  # decoding went through the compiled forward
    assert "forward" not in model.__dict__  # and the model's own forward is back
    assert any(eager)  # something was translated, so the comparison means something
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    arguments = ["translate", "--model", str(folder), "--input", str(tmp_path / "in.txt"), "--output", str(out)]
    options = ["--num-beams", "2", "--batch-size", "2", "--no-progress", "--compile", "--device", "cpu"]
    assert main(arguments + options) == 0
    assert out.read_text().split("\n")[:-1] == eager


def test_translate_refuses_a_compile_setting_that_is_not_a_bool(tiny_export):
    from hf_deep_nmt.serving.translate import translate

    _, model, tokenizer = tiny_export
    with pytest.raises(ValueError, match=r"`compile` must be True or False, got 'yes'"):
        translate(model, tokenizer, ["el sol"], compile="yes")


def test_models_of_several_families_compile_in_one_process_each_its_own_graphs():
    """Every model runs the same `forward` code, and torch.compile counts recompilations per code object: compiled as
    it is, the fifth model in a process failed under fullgraph (the recompile limit, 8, spent by four models' two
    graphs each). `compiled_decoding` gives each model a code object of its own; with the limit lowered to one
    model's two graphs, two families in a row still compile, each into two new graphs, and decode as eager."""
    from torch._dynamo.utils import counters

    from hf_deep_nmt.serving.translate import compiled_decoding

    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=2):
        for family in ("dsinit-matt", "prenorm"):
            model = doctor.family_model(family, "cpu", encoder_layers=1, decoder_layers=1)  # cheap to trace
            eager = generate(model)
            graphs = counters["stats"]["unique_graphs"]
            with compiled_decoding(model, 12, backend="eager") as options:
                assert torch.equal(generate(model, **options), eager), family
            assert counters["stats"]["unique_graphs"] - graphs == 2, family
