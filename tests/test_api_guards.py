"""The Python API and a Hub folder refuse what the commands refuse, from the model code itself: a config that does not
belong to its weights (read from the safetensors headers, before anything is built), a model that cannot fit the
memory (every parameter counted: relative-position tables and DLCL's (L+1)^2 history weights too), weights the file
lacks or holds beyond the model's, NaN weights (a warning), and `generate()` arguments that are not valid or a
decoding that cannot fit. Each through this package's registered classes in-process, and once more through a saved
folder loaded with `trust_remote_code` in a subprocess that cannot import this package; where memory is the point,
under an address-space limit (RLIMIT_AS), so that a regression fails instead of taking the machine's memory."""

import contextlib
import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ARCHITECTURES, TINY_SIZES, package_free_environment
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForSeq2SeqLM

from hf_deep_nmt import MODEL_CLASSES, DeepNMTConfig, DlclConfig
from hf_deep_nmt.memory import check_training_size, estimate_parameters
from hf_deep_nmt.modeling import contract_deep_nmt
from hf_deep_nmt.modeling.contract_deep_nmt import InsufficientMemoryError
from hf_deep_nmt.modeling.sizes_deep_nmt import count_parameters, decoding_memory, parameter_parts
from hf_deep_nmt.weights import saved_parameters

SOURCE = torch.tensor([[5, 9, 14, 3, 2]])
LONG_SOURCE = torch.tensor([[5, 9, 14, 3, 7, 11, 4, 6, 8, 10, 12, 13, 15, 16, 17, 18, 19, 20, 21, 2]])  # 20 tokens
LIMIT = 3 << 30  # address space of the subprocess: torch and a tiny model take under 1.5 GiB of it


def counted(model: torch.nn.Module) -> int:
    """Parameters and saved (persistent) buffers of a built model, each once."""
    total = sum(parameter.numel() for parameter in model.parameters())
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                total += buffer.numel()
    return total


def test_the_parameter_count_is_exact_for_every_architecture():
    extras = [
        (DeepNMTConfig, dict(tie_word_embeddings=False, output_bias=True)),
        (DeepNMTConfig, dict(share_embeddings=False, decoder_vocab_size=23, tie_word_embeddings=False)),
        (DeepNMTConfig, dict(layer_aggregation="dlcl", dlcl_weights="one", dlcl_history_norm=False)),
        (DeepNMTConfig, dict(msc_block_layers=[1, 2], msc_context="gru_per_block")),
    ]
    for config_class, overrides in [architecture.values[0] for architecture in ARCHITECTURES] + extras:
        if overrides.get("msc_block_layers") is not None:
            overrides = {**overrides, "encoder_layers": None}
        config = config_class(**{**TINY_SIZES, **overrides})
        with torch.device("meta"):
            model = MODEL_CLASSES[type(config)](config)
        assert count_parameters(config) == counted(model), overrides
        assert count_parameters(config, output_layer=False) == counted(model.model), overrides
        assert estimate_parameters(config) == count_parameters(config)


def test_the_relative_tables_and_the_dlcl_history_are_counted_by_hand():
    """d 16, 2 heads (head width 8): a window of 10^9 gives each self-attention 2 * 10^9 + 1 keys of width 8, in 3
    encoder and (multi-head) 2 decoder layers; 50,000 DLCL layers give a 50,001 x 50,001 weight matrix and 50,000
    LayerNorms of 2 * 16."""
    sizes = {**TINY_SIZES, "encoder_attention_heads": 2}
    parts = parameter_parts(DeepNMTConfig(**sizes, relative_position_window=10**9))
    assert parts["encoder relative position keys"] == 3 * (2 * 10**9 + 1) * 8
    assert parts["decoder relative position keys"] == 2 * (2 * 10**9 + 1) * 8
    parts = parameter_parts(DlclConfig(**{**sizes, "encoder_layers": 50_000}))
    assert parts["encoder layer-history weights"] == 50_001**2 + 50_000 * 32
    assert parts["decoder layer-history weights"] == 3**2 + 2 * 32


@pytest.fixture
def little_memory(monkeypatch):
    """What the model code (and the commands' estimate) finds available: 256 MiB on every device."""
    monkeypatch.setattr(contract_deep_nmt, "available_memory", lambda device="cpu": 256 << 20)
    monkeypatch.setattr("hf_deep_nmt.memory.available_memory", lambda device="cpu": 256 << 20)


# (settings, the largest part the refusal names): 4 encoder heads of width 4, 2 decoder heads of width 8
BEYOND_MEMORY = {
    "relative-window-1e9": (
        dict(relative_position_window=10**9),
        "decoder relative position keys (32,000,000,016 parameters: relative_position_window=1000000000, "
        "decoder_layers=2, d_model=16)",
    ),
    "dlcl-50000-layers": (
        dict(encoder_layer_aggregation="dlcl", encoder_layers=50_000),
        "encoder layer-history weights (2,501,700,001 parameters: encoder_layer_aggregation='dlcl', "
        "encoder_layers=50000)",
    ),
}


@pytest.mark.parametrize("case", list(BEYOND_MEMORY))
def test_a_model_beyond_the_memory_is_refused_before_it_is_built(case, little_memory):
    settings, named = BEYOND_MEMORY[case]
    config = DeepNMTConfig(**{**TINY_SIZES, **settings})
    with pytest.raises(InsufficientMemoryError, match=r"but only 256\.0 MiB is available on cpu; make the model") as e:
        MODEL_CLASSES[DeepNMTConfig](config)  # built, this would run for minutes (or die in the allocator)
    assert f"its largest part is the {named}" in str(e.value)
    with pytest.raises(InsufficientMemoryError, match="Building the model"):
        check_training_size(config, batch_tokens=64)  # the commands' estimate counts them too


def test_the_decoding_memory_by_hand(tiny_config):
    """d 16, 2 decoder layers, vocabulary 37; 10 hypotheses of 5 source tokens and 7 cached positions: encoder output
    10 * 5 * 16 = 800, cross keys and values 2 * 10 * 2 * 16 * 5 = 3200, self keys and values 2 * 10 * 2 * 16 * 7 =
    4480, in float32; scores 3 * 10 * 37 in float32. The AAN keeps no self-attention keys."""
    config = tiny_config()
    assert decoding_memory(config, 10, 5, 7) == 4 * (800 + 3200 + 4480) + 4 * 3 * 10 * 37
    assert decoding_memory(config, 10, 5, 7, torch.float16) == 2 * (800 + 3200 + 4480) + 4 * 3 * 10 * 37
    aan = tiny_config(decoder_self_attention="average")
    assert decoding_memory(aan, 10, 5, 7) == 4 * (800 + 3200) + 4 * 3 * 10 * 37


# ---- folders whose config or weights were changed ------------------------------------------------------------------


def changed_folder(saved: Path, destination: Path, config: dict | None = None, weights=None) -> Path:
    """A copy of the saved folder `saved` with `config` merged into its config.json and `weights(tensors)` applied to
    its weights."""
    folder = Path(shutil.copytree(saved, destination))
    if config:
        values = json.loads((folder / "config.json").read_text())
        values.update(config)
        (folder / "config.json").write_text(json.dumps(values))
    if weights is not None:
        tensors = load_file(folder / "model.safetensors")
        weights(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def rename(old: str, new: str):
    return lambda tensors: tensors.__setitem__(new, tensors.pop(old))


def poison(name: str):
    return lambda tensors: tensors[name].view(-1).__setitem__(0, float("nan"))


DLCL_OVER_RESIDUAL = dict(encoder_layer_aggregation="dlcl", decoder_layer_aggregation="dlcl", layer_aggregation="dlcl")
# (config changes, weight changes, what the error says): the same cases through the package and through remote code
FOLDER_CASES = {
    "wide": (
        dict(d_model=16384),
        None,
        "vocab_size=37, d_model=16384 make shared.weight (37, 16384), but the file's is (37, 16)",
    ),
    "deep": (dict(encoder_layers=10**6), None, "encoder_layers=1000000, but the file holds 3 encoder layers"),
    "dlcl-over-residual": (
        DLCL_OVER_RESIDUAL,
        None,
        "encoder_layer_aggregation='dlcl' has layer-history weights encoder.history.weight (4, 4), but the file has "
        "none (its model has no layer history: a residual stack)",
    ),
    "residual-over-dlcl": (
        None,
        lambda tensors: tensors.update({"model.encoder.history.weight": torch.eye(4)}),
        "encoder_layer_aggregation='residual' has no layer-history weights, but the file holds encoder.history.weight "
        "(4, 4)",
    ),
    "renamed": (
        None,
        rename("model.encoder.layers.1.fc2.weight", "model.encoder.layers.1.fc3.weight"),
        "lack model.encoder.layers.1.fc2.weight: they would be initialised at random; and they hold "
        "model.encoder.layers.1.fc3.weight, which this model has no place for",
    ),
}


def base_model_text(expected: str) -> str:
    """What the error of a `FOLDER_CASES` case says when `AutoModel` loads the folder: its weights are named without
    the translation model's prefix, and those it has no place for as the file names them."""
    return expected.replace("lack model.", "lack ")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_config, random_model):
    """A tiny plain model saved, and the folders of `FOLDER_CASES` beside it."""
    root = tmp_path_factory.mktemp("guards")
    random_model(tiny_config()).save_pretrained(root / "plain")
    for name, (config, weights, _) in FOLDER_CASES.items():
        changed_folder(root / "plain", root / name, config, weights)
    changed_folder(root / "plain", root / "nan", weights=poison("model.decoder.layers.0.fc1.weight"))
    return root


def test_the_saved_weights_hold_exactly_the_counted_parameters(saved, tiny_config):
    assert saved_parameters(saved / "plain")[0] == count_parameters(tiny_config())


@contextlib.contextmanager
def address_space_limit(extra: int = 1 << 30):
    """This process may map at most `extra` bytes more than it has mapped now (RLIMIT_AS), until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_a_folder_whose_config_does_not_match_its_weights_is_refused_by_the_api(saved, case):
    expected = FOLDER_CASES[case][2]
    for auto_class in (AutoModelForSeq2SeqLM, AutoModel):
        with address_space_limit(), pytest.raises(ValueError) as error:
            auto_class.from_pretrained(saved / case)
        assert (base_model_text(expected) if auto_class is AutoModel else expected) in str(error.value)


def test_a_base_model_takes_the_body_of_a_translation_model_with_its_own_output_layer(tmp_path, tiny_config):
    """transformers' semantics: `AutoModel` loads the encoder-decoder of a translation model's folder and drops its
    output layer (here an untied one, with a bias), which is not an unexpected weight; the translation model loads
    the folder whole."""
    config = tiny_config(tie_word_embeddings=False, output_bias=True)
    MODEL_CLASSES[type(config)](config).save_pretrained(tmp_path)
    base, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert type(base).__name__ == "DeepNMTModel" and set(info["unexpected_keys"]) <= {"lm_head.weight", "lm_head.bias"}
    AutoModelForSeq2SeqLM.from_pretrained(tmp_path)


def test_nan_weights_are_named_in_a_warning_by_the_api(saved, caplog):
    model = AutoModelForSeq2SeqLM.from_pretrained(saved / "nan")
    assert torch.isnan(model.get_parameter("model.decoder.layers.0.fc1.weight")).any()
    assert "hold NaN or infinite values (model.decoder.layers.0.fc1.weight)" in caplog.text


# ---- generate() -----------------------------------------------------------------------------------------------------

# (generate() arguments, what the error says): through the package and through remote code
GENERATE_CASES = {
    "zero-beams": (dict(num_beams=0), "`num_beams` must be a positive integer (1: greedy or sampling; 4 to 6 "),
    "float-beams": (dict(num_beams=2.0), "`num_beams` must be a positive integer (1: greedy or sampling; 4 to 6 "),
    "zero-sequences": (dict(num_return_sequences=0), "`num_return_sequences` must be a positive integer (1: "),
    "fraction-cap": (dict(max_new_tokens=2.5), "`max_new_tokens` must be a positive integer (None: the saved cap)"),
    "float-ids": (
        dict(floats="input_ids"),
        "`input_ids` must hold integer token ids (torch.long or torch.int32), got torch.float32",
    ),
    "float-decoder-ids": (
        dict(floats="decoder_input_ids"),
        "`decoder_input_ids` must hold integer token ids (torch.long or torch.int32), got torch.float32",
    ),
    "million-beams": (
        dict(num_beams=10**6),
        "generate() over 1 sentence(s) of 20 tokens x num_beams=1000000 = 1,000,000 hypotheses needs about",
    ),
    "static-cache-of-a-billion": (
        dict(max_new_tokens=10**9, cache_implementation="static"),
        "with a static cache of 1,000,000,000 positions, needs about",
    ),
}


def generate_arguments(arguments: dict, source: torch.Tensor) -> dict:
    """The arguments of a `GENERATE_CASES` case for `source`: `floats` names the ids given as floats."""
    arguments = {"input_ids": source, "max_new_tokens": 3, **arguments}
    floats = arguments.pop("floats", None)
    if floats is not None:
        arguments[floats] = source.float() if floats == "input_ids" else torch.zeros(1, 1)
    return arguments


@pytest.fixture(scope="module")
def plain_model(saved):
    return AutoModelForSeq2SeqLM.from_pretrained(saved / "plain")


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_refuses_what_it_cannot_do_before_it_starts(plain_model, case):
    with address_space_limit(), pytest.raises(ValueError) as error:
        plain_model.generate(**generate_arguments(GENERATE_CASES[case][0], LONG_SOURCE))
    assert GENERATE_CASES[case][1] in str(error.value)


def test_generate_says_what_would_fit(plain_model, little_memory):
    """256 MiB: per hypothesis of 20 source tokens 4 * (20 * 16 + 2 * 2 * 16 * 20) + 12 * 37 = 6,844 bytes, and 256
    for its one cached position (the first step of the dynamic cache), so 37,807 hypotheses fit; with the static cache
    each position of the 1,000 hypotheses adds 4 * 2 * 2 * 16 = 256 bytes per hypothesis beyond the 6,844,000 bytes
    of the rest."""
    per_row = 4 * (20 * 16 + 2 * 2 * 16 * 20) + 12 * 37
    assert decoding_memory(plain_model.config, 1, 20, 0) == per_row
    with pytest.raises(InsufficientMemoryError, match=rf"at most {(256 << 20) // (per_row + 256):,} hypotheses fit"):
        plain_model.generate(input_ids=LONG_SOURCE, num_beams=10**5, max_new_tokens=3)
    fitting = ((256 << 20) - 1000 * per_row) // (1000 * 256)
    with pytest.raises(InsufficientMemoryError, match=rf"at most {fitting:,} output positions fit the static cache"):
        plain_model.generate(
            input_ids=LONG_SOURCE, num_beams=1000, max_new_tokens=10**6, cache_implementation="static"
        )
    assert plain_model.generate(input_ids=SOURCE, num_beams=2, max_new_tokens=3).shape[0] == 1


def test_a_forward_with_float_ids_names_them(plain_model):
    with pytest.raises(ValueError, match=r"`input_ids` must hold integer token ids .* got torch\.float32"):
        plain_model(input_ids=SOURCE.float(), decoder_input_ids=SOURCE)
    with pytest.raises(ValueError, match=r"`decoder_input_ids` must hold integer token ids .* got torch\.float64"):
        plain_model(input_ids=SOURCE, decoder_input_ids=SOURCE.double())


# ---- the same through a saved folder, loaded as remote code without this package ------------------------------------

REMOTE_SCRIPT = """
import json
import logging
import resource
import sys

sys.modules["hf_deep_nmt"] = None  # an installed, registered package would win over the folder's code
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

import torch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

root, cases = sys.argv[1], json.loads(open("cases.json").read())
warnings = []


class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())


logging.getLogger().addHandler(Keep(logging.WARNING))
results = {}


def attempt(name, action):
    try:
        action()
        results[name] = "ok"
    except Exception as error:  # the test compares the message
        results[name] = f"{type(error).__name__}: {error}"


for case in cases["folders"]:
    for auto in (AutoModelForSeq2SeqLM, AutoModel):
        attempt(f"{case}-{auto.__name__}", lambda: auto.from_pretrained(f"{root}/{case}", trust_remote_code=True))


def build(**settings):
    config = AutoConfig.from_pretrained(f"{root}/plain", trust_remote_code=True, **settings)
    AutoModelForSeq2SeqLM.from_config(config, trust_remote_code=True)


for case, settings in cases["beyond_memory"].items():
    attempt(case, lambda: build(**settings))
nan = AutoModelForSeq2SeqLM.from_pretrained(f"{root}/nan", trust_remote_code=True)
results["nan-warning"] = [text for text in warnings if "NaN" in text]
model = AutoModelForSeq2SeqLM.from_pretrained(f"{root}/plain", trust_remote_code=True)
results["module"] = type(model).__module__
source = torch.tensor(cases["source"])
for case, arguments in cases["generate"].items():
    arguments = {"input_ids": source, "max_new_tokens": 3, **arguments}
    floats = arguments.pop("floats", None)
    if floats is not None:
        arguments[floats] = source.float() if floats == "input_ids" else torch.zeros(1, 1)
    attempt(case, lambda: model.generate(**arguments))
with open("results.json", "w") as handle:
    json.dump(results, handle)
"""


@pytest.fixture(scope="module")
def remote_results(saved, tmp_path_factory, clean_python):
    """Every case above, run once in a process that cannot import this package, under `LIMIT` of address space:
    forked from the session's clean server (torch and transformers imported once, never this package), whose imports
    are the ones the script makes before it loads a folder, so the limit leaves the cases the same room."""
    workdir = tmp_path_factory.mktemp("remote")
    generate = {case: arguments for case, (arguments, _) in GENERATE_CASES.items()}
    beyond_memory = {case: settings for case, (settings, _) in BEYOND_MEMORY.items()}
    cases = {"folders": list(FOLDER_CASES), "generate": generate, "source": LONG_SOURCE.tolist()}
    cases["beyond_memory"] = beyond_memory
    (workdir / "cases.json").write_text(json.dumps(cases))
    environment = package_free_environment(str(workdir / "hf_home"), str(workdir / "modules"), OMP_NUM_THREADS="1")
    completed = clean_python.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(saved), str(LIMIT)],
        cwd=workdir,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads((workdir / "results.json").read_text())


def test_the_folder_code_is_what_ran(remote_results):
    assert (
        remote_results["module"].startswith("transformers_modules.") and "hf_deep_nmt" not in remote_results["module"]
    )


@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_a_folder_whose_config_does_not_match_its_weights_is_refused_by_its_own_code(remote_results, case):
    expected = FOLDER_CASES[case][2]
    assert expected in remote_results[f"{case}-AutoModelForSeq2SeqLM"]
    assert base_model_text(expected) in remote_results[f"{case}-AutoModel"]


@pytest.mark.parametrize("case", list(BEYOND_MEMORY))
def test_a_model_beyond_the_memory_is_refused_by_the_folder_code(remote_results, case):
    assert remote_results[case].startswith("InsufficientMemoryError: Building DeepNMTForConditionalGeneration")
    assert f"its largest part is the {BEYOND_MEMORY[case][1]}" in remote_results[case]


def test_nan_weights_are_named_in_a_warning_by_the_folder_code(remote_results):
    assert any(
        "hold NaN or infinite values (model.decoder.layers.0.fc1.weight)" in text
        for text in remote_results["nan-warning"]
    )


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_of_the_folder_code_refuses_the_same(remote_results, case):
    assert GENERATE_CASES[case][1] in remote_results[case]
