"""The performance harness (benchmarks/perf.py) at its smoke size: it runs, every contender does the same work, and
the ratios it reports are the ones its raw timings give. No speed is asserted here (speed lives in benchmarks/)."""

import importlib.util
import json
import re
import statistics
from pathlib import Path

import pytest
import torch

PERF = Path(__file__).resolve().parent.parent / "benchmarks" / "perf.py"


@pytest.fixture(scope="module")
def perf():
    spec = importlib.util.spec_from_file_location("perf", PERF)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke_run(perf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("perf")
    threads = torch.get_num_threads()
    try:
        results = perf.main(
            ["--smoke", "--sections", "training", "decoding", "deep", "operators", "throughput", "--json",
             str(folder / "perf.json"), "--workdir", str(folder), "--threads", "1"]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return results, folder


def test_smoke_run_writes_every_figure(perf, smoke_run):
    results, folder = smoke_run
    assert json.loads((folder / "perf.json").read_text())["ratios"] == results["ratios"]
    decoders = set(results["decoding"]["beams_4"]["tokens_per_second"])
    expected = {"own_multi_head", "own_matt", "hf_marian"}
    if perf.ctranslate2_available():
        expected.add("ctranslate2")
    else:
        assert any("ctranslate2" in skipped for skipped in results["skipped"])
    assert decoders == expected
    assert set(results["training"]["tokens_per_second"]) == {"own_pre_norm", "hf_marian"}
    assert set(results["deep"]["median_seconds"]) == {"plain_2", "plain_4", "dlcl_4"}
    assert set(results["deep"]["saved_for_backward"]) == {"plain_4", "dlcl_4"}
    assert set(results["operators"]["counts"]) == {"plain_2", "dlcl_2", "plain_4", "dlcl_4"}
    for figures in results["throughput"]["budgets"].values():
        assert set(figures["tokens_per_second"]) == {"own_pre_norm", "own_pre_norm_plain_loss", "hf_marian"}
    assert set(results["throughput"]["budgets"]) == {"64", "128"}
    figures = [row["figure"] for row in results["ratios"]]
    # two budgets: own / Marian, its ceiling from the profiled steps (CPU), chunked / plain loss
    assert len(figures) == (18 if "ctranslate2" in decoders else 16)


def test_reported_ratios_follow_from_raw_timings(smoke_run):
    results, _ = smoke_run
    size = results["size"]
    beam = results["decoding"]["beams_4"]["median_seconds"]
    ratios = {row["figure"]: row["measured"] for row in results["ratios"]}
    # tokens/s = batch * new tokens / median seconds, so the speed ratio is the inverse ratio of medians
    assert ratios["decoding beam 4: own MAtt / own multi-head"] == pytest.approx(
        beam["own_multi_head"] / beam["own_matt"]
    )
    training = results["training"]
    tokens = size["train_batch"] * size["train_length"]
    assert training["tokens_per_second"]["hf_marian"] == pytest.approx(
        tokens / training["median_seconds"]["hf_marian"]
    )
    deep = results["deep"]["median_seconds"]
    assert ratios["deep: DLCL-4L / plain-4L step time"] == pytest.approx(deep["dlcl_4"] / deep["plain_4"])
    budget = results["throughput"]["budgets"]["128"]
    # every budget batch holds 128 // 8 = 16 pairs of 8 target tokens, no padding; 2 timed steps
    assert budget["tokens"] == {"own_pre_norm": 256, "own_pre_norm_plain_loss": 256, "hf_marian": 256}
    own_speed = 256 / budget["seconds"]["own_pre_norm"][0]
    assert budget["tokens_per_second"]["own_pre_norm"] == pytest.approx(own_speed)
    parameters = results["throughput"]["parameters"]["own_pre_norm"]
    assert budget["mfu"]["own_pre_norm"] == pytest.approx(
        6 * parameters * own_speed / results["throughput"]["matmul_peak_flops"]
    )
    # profiled steps of each (medians) hold their matrix products; the ceiling is Marian's step over own's products
    anatomy = budget["anatomy"]
    assert set(anatomy) == {"own_pre_norm", "hf_marian"}
    for parts in anatomy.values():
        assert 0 < parts["matrix_product_seconds"] < parts["seconds"]
    assert ratios["throughput 128 tokens: ceiling of own / HF Marian (own's step = its matrix products)"] == (
        pytest.approx(anatomy["hf_marian"]["seconds"] / anatomy["own_pre_norm"]["matrix_product_seconds"])
    )
    seconds = budget["seconds"]
    assert ratios["throughput 128 tokens: own chunked loss / own plain loss tokens/s"] == pytest.approx(
        statistics.median(seconds["own_pre_norm_plain_loss"]) / statistics.median(seconds["own_pre_norm"])
    )


def test_matt_and_msc_sections_report_the_ratios_of_their_timings(perf, tmp_path):
    """The sections that replaced matt_speed.py and msc_speed.py: every contender runs, the JSON holds what main()
    returns, and each ratio is the inverse ratio of the contenders' median seconds."""
    threads = torch.get_num_threads()
    try:
        results = perf.main(
            ["--smoke", "--sections", "matt", "msc", "--json", str(tmp_path / "perf.json"), "--workdir",
             str(tmp_path), "--threads", "1"]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "perf.json").read_text()) == json.loads(json.dumps(results))  # tuples as lists
    assert results["size"]["name"] == "smoke"
    matt, msc = results["matt"], results["msc"]
    assert msc["contenders"] == ["baseline_2", "plain_4", "msc_2x2"]
    for beams in (4, 1):
        assert set(matt[f"beams_{beams}"]["tokens_per_second"]) == {"multi_head", "matt"}
        assert set(msc[f"beams_{beams}"]["tokens_per_second"]) == set(msc["contenders"])
    assert set(matt["decoder_steps"]["median_step_seconds"]) == {"multi_head", "matt"}
    assert matt["decoder_steps"]["rows"] == 4 * results["size"]["batch"]
    assert msc["parameters"]["baseline_2"] < msc["parameters"]["plain_4"] < msc["parameters"]["msc_2x2"]

    def speed_ratio(seconds: dict, first: str, second: str) -> float:
        """Speed of `first` / speed of `second`: the median time of `second` / the median time of `first`."""
        return statistics.median(seconds[second]) / statistics.median(seconds[first])

    expected = {}
    for beams, name in ((4, "beam 4"), (1, "greedy")):
        seconds = matt[f"beams_{beams}"]["seconds"]
        expected[f"matt {name}: MAtt / multi-head generate() speed (post-norm)"] = speed_ratio(
            seconds, "matt", "multi_head"
        )
        seconds = msc[f"beams_{beams}"]["seconds"]
        for first, second in (("plain_4", "baseline_2"), ("msc_2x2", "baseline_2"), ("msc_2x2", "plain_4")):
            expected[f"msc {name}: {first} / {second} generate() speed"] = speed_ratio(seconds, first, second)
    steps = matt["decoder_steps"]
    expected["matt: MAtt / multi-head decoder stack step speed"] = speed_ratio(steps["seconds"], "matt", "multi_head")
    assert steps["median_step_seconds"]["matt"] == pytest.approx(
        statistics.median(steps["seconds"]["matt"]) / steps["steps"]
    )
    ratios = {row["figure"]: row["measured"] for row in results["ratios"]}
    assert ratios == pytest.approx(expected)
    assert all(row["met"] is None for row in results["ratios"])


def test_operator_calls_grow_linearly_with_depth(perf):
    """A DLCL layer adds a fixed number of operator calls and autograd nodes to a training step, whatever its depth:
    at 2, 4 and 6 encoder layers the counts lie exactly on a line (second difference 0) for plain and DLCL stacks.
    One scaled addition per (row, stored output) pair, as the combination once was, adds a quadratic term."""
    counts = perf.run_operators(perf.SIZES["smoke"], (2, 4, 6))["counts"]
    for name in ("plain", "dlcl"):
        for figure in ("aten_calls", "autograd_nodes"):
            at = [counts[f"{name}_{layers}"][figure] for layers in (2, 4, 6)]
            assert at[2] - 2 * at[1] + at[0] == 0, (name, figure, at)
    extra = [counts[f"dlcl_{layers}"]["aten_calls"] - counts[f"plain_{layers}"]["aten_calls"] for layers in (2, 4, 6)]
    assert extra[0] > 0 and extra[2] - extra[1] == extra[1] - extra[0] > 0
    assert counts["dlcl_6"]["aten_calls"] <= 1.2 * counts["plain_6"]["aten_calls"]


def test_flop_formula_matches_torch_flop_counter(perf):
    """The harness's FLOP formula (used for FLOP/s against the GEMM peak): its matrix products against torch's own
    count of a forward pass of this package's model and of Marian (source 5, target 4 tokens), exactly, operator by
    operator; its attention products against a hand count, and against torch's count where the counter has a rule
    for the fused CPU attention kernel (torch 2.13 has none, later releases count it: 46,848 FLOPs here, exactly the
    hand count below). Comparing each part on its own keeps the check exact on every counter release."""
    size = perf.SIZES["smoke"]
    inputs = perf.training_batch(size, 3, 5)
    inputs["labels"] = inputs["labels"][:, :4].contiguous()
    linear, attention = perf.forward_flops_parts(size, 3, 5, 4, size["layers"])
    for model in (perf.own_model(size), perf.marian_model(size)):
        counted = perf.counted_forward_flops(model, inputs)
        fused = {operator for operator in counted if "scaled_dot_product" in operator}
        assert sum(flops for operator, flops in counted.items() if operator not in fused) == linear, counted
        assert sum(counted[operator] for operator in fused) in (0, attention), counted
    # QK^T and AV, 2 * batch * query_len * key_len * d each: 2 encoder self (5x5), 2 decoder self (4x4), 2 cross (4x5)
    assert attention == 2 * 2 * 3 * 32 * (2 * 25 + 2 * 16 + 2 * 20)
    assert perf.training_flops(size, 3, 5, 4, size["layers"]) == 3 * (linear + attention)


@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None, reason="ctranslate2 is an optional extra")
def test_ctranslate2_conversion_decodes_like_hf_marian(perf, tmp_path):
    """The converted copy is the same model: greedy outputs of the forced length agree token for token."""
    size = perf.SIZES["smoke"]
    marian = perf.marian_model(size).eval()
    translator = perf.ctranslate2_translator(marian, size, tmp_path)
    source = perf.decoding_source(size)
    with torch.inference_mode():
        output = marian.generate(input_ids=source, num_beams=1, do_sample=False, min_new_tokens=5, max_new_tokens=5)
    expected = output[:, 1:].tolist()
    tokens = [[f"t{i}" for i in row[:-1]] for row in source.tolist()]
    results = translator.translate_batch(tokens, beam_size=1, min_decoding_length=5, max_decoding_length=5)
    produced = [[int(token[1:]) for token in result.hypotheses[0]] for result in results]
    assert produced == expected


def test_the_compiled_section_runs_and_reports_its_ratios(perf, tmp_path):
    """At smoke size, with Dynamo's `eager` backend, which traces but neither generates code nor traces the backward
    (the figures mean nothing; the harness runs): 17 CPU s against 27 with `aot_eager`."""
    threads = torch.get_num_threads()
    try:
        results = perf.main(
            ["--smoke", "--sections", "compiled", "--compile-backend", "eager", "--device", "cpu",
             "--json", str(tmp_path / "perf.json"), "--threads", "1"]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    compiled = results["compiled"]
    expected = {f"{name}_{kind}" for name in ("multi_head", "matt") for kind in ("eager_dynamic", "compiled_static")}
    for setting in ("batch1_greedy", "beam4"):
        assert set(compiled["decoding"][setting]["tokens_per_second"]) == expected
    assert set(compiled["training_seconds"]) == {"pre_norm_eager", "pre_norm_compiled", "dlcl_eager", "dlcl_compiled"}
    figures = [row["figure"] for row in results["ratios"]]
    assert len(figures) == 7 and all(figure.startswith("compiled:") for figure in figures)
    # the bytes a base-size batch-1 step reads, by hand: 6 layers of weights and cached states, the 32k output layer
    d, ffn, vocab, source, step = 512, 2048, 32000, 24, 12
    multi_head = 6 * (6 * d * d + 2 * d * ffn + 2 * step * d + 2 * source * d) + vocab * d
    matt = 6 * (3 * d * d + 2 * d * ffn + 2 * source * d + d) + vocab * d
    assert compiled["bytes_per_step_base_32k"] == {"multi_head": 2 * multi_head, "matt": 2 * matt}


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--budgets", "64", "4"], r"--budgets 4 holds no pair: a budget must be at least 8 tokens at --size smoke"),
        (["--repeats", "0"], r"--repeats must be at least 1, got 0"),
    ],
)
def test_bad_budgets_and_repeats_are_refused_before_any_run(perf, capsys, arguments, message):
    with pytest.raises(SystemExit) as refused:
        perf.main(["--smoke", "--sections", "throughput", *arguments])
    assert refused.value.code == 2
    assert re.search(message, capsys.readouterr().err)


WARM_START = Path(__file__).resolve().parent.parent / "benchmarks" / "marian_warm_start.py"


def test_marian_warm_start_smoke_run_reports_the_three_models(tmp_path):
    """benchmarks/marian_warm_start.py at its smoke size: a built Marian model converts with equal logits, grows, and
    the converted, continued shallow and grown models are fine-tuned through `hf-deep-nmt train` and scored."""
    spec = importlib.util.spec_from_file_location("marian_warm_start", WARM_START)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        results = module.main(
            ["--smoke", "--threads", "1", "--workdir", str(tmp_path), "--json", str(tmp_path / "r.json")]
        )
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "r.json").read_text())["models"] == results["models"]
    assert results["converted_logits_max_abs_difference"] <= module.LOGITS_TOLERANCE
    models = results["models"]
    assert list(models) == ["converted", "continued shallow", "grown"]
    assert models["grown"]["encoder_layers"] == 2 * models["converted"]["encoder_layers"]
    assert models["converted"]["validation_loss"] == pytest.approx(models["converted"]["marian_validation_loss"])
    for name in ("continued shallow", "grown"):
        assert models[name]["validation_loss"] != models["converted"]["validation_loss"]  # fine-tuned
    assert all(0.0 <= row["sacrebleu"] <= 100.0 for row in models.values())
    assert results["table"].count("\n") == 4  # header, rule, three rows
    # --source: a given MarianMTModel (here the one just built and saved) instead of building and pretraining one
    again = tmp_path / "again"
    try:
        given = module.main(
            ["--smoke", "--threads", "1", "--source", str(tmp_path / "marian"), "--workdir", str(again), "--json",
             str(again / "r.json")]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert given["pretrain_losses_every_50_steps"] is None
    assert given["models"]["converted"]["validation_loss"] == models["converted"]["validation_loss"]


def test_the_inference_table_covers_every_family_and_backend(tmp_path):
    """benchmarks/inference.py at its quick size: a torch row per family, CTranslate2 rows exactly for the families it
    expresses (plain, DeepNorm), each figure the forced token count over its CPU seconds, the end-to-end row with the
    same output on both sides; and the beam-search profile's parts do not overlap (the remainder is not negative)."""
    spec = importlib.util.spec_from_file_location("inference", PERF.parent / "inference.py")
    inference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inference)
    threads = torch.get_num_threads()
    results = inference.main(["--quick", "--json", str(tmp_path / "inference.json"), "--workdir", str(tmp_path)])
    assert torch.get_num_threads() == threads  # restored
    assert json.loads((tmp_path / "inference.json").read_text()) == json.loads(json.dumps(results))
    rows = set(results["rows"])
    expected = {f"{family} torch" for family in inference.FAMILIES}
    if importlib.util.find_spec("ctranslate2") is not None:
        expected |= {f"{family} {kind}" for family in ("plain", "deepnorm") for kind in ("ct2_fp32", "ct2_int8")}
        assert results["end_to_end"]["same_output"] is True and results["end_to_end"]["lines"] == 12
    if importlib.util.find_spec("torchao") is not None:
        expected |= {f"{family} torch_int8" for family in inference.FAMILIES}
    assert rows == expected
    size = results["size"]
    for figures in results["rows"].values():
        assert set(figures) == {f"{search}_b{size['batch']}" for search in ("greedy", "beam4")} | {
            "greedy_b1",
            "beam4_b1",
        }
        batch = figures[f"beam4_b{size['batch']}"]
        assert batch["tokens_per_cpu_second"] == pytest.approx(
            size["batch"] * size["new_tokens"] / batch["cpu_seconds"]
        )
        single = figures["greedy_b1"]
        assert single["tokens_per_cpu_second"] == pytest.approx(
            size["single_sentences"] * size["new_tokens"] / single["cpu_seconds"]
        )
    profile = inference.main(["--quick", "--profile", "deepnorm"])
    assert 0 < profile["forward_seconds"] < profile["total_seconds"]
    assert all(seconds >= 0 for seconds in profile["parts"].values()), profile["parts"]
