"""The contract with transformers that decoding relies on: the decoding state under the name the installed release
uses (`past_key_values` up to 5.23, `cache` from 5.24), an error instead of a silently wrong translation when that
contract breaks (a simulated rename, a lost state), unknown forward arguments refused, the tested window declared
once and warned about outside it, and one output cap per generate() call."""

import re
import tomllib
from pathlib import Path

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import GenerationMixin

import hf_deep_nmt.modeling.contract_deep_nmt as modeling
from hf_deep_nmt import METHODS, DeepNMTConfig

ROOT = Path(__file__).resolve().parents[1]
SOURCE = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, 1, 1]])
INPUTS = dict(input_ids=SOURCE, attention_mask=SOURCE.ne(1).long())
INSTALLED = tuple(int(part) for part in transformers.__version__.split(".")[:2])


@pytest.fixture
def model(tiny_config, random_model):
    return random_model(tiny_config(DeepNMTConfig, pre_norm=False)).eval()


def test_the_output_carries_the_state_under_the_name_of_the_installed_release(model):
    expected = "cache" if INSTALLED >= (5, 24) else "past_key_values"
    assert modeling.CACHE_OUTPUT_NAME == expected
    with torch.no_grad():
        outputs = model(**INPUTS, decoder_input_ids=torch.zeros(2, 1, dtype=torch.long), use_cache=True)
    assert expected in type(outputs).__dataclass_fields__
    state = modeling.decoding_state(outputs)
    assert isinstance(state, EncoderDecoderCache) and state.get_seq_length() == 1
    assert getattr(outputs, expected) is state


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_the_state_is_taken_under_either_name(model, name):
    target = torch.tensor([[0, 6, 8], [0, 13, 4]])
    with torch.no_grad():
        full = model(**INPUTS, decoder_input_ids=target, use_cache=False).logits
        first = model(**INPUTS, decoder_input_ids=target[:, :2], use_cache=True)
        step = model(
            **INPUTS, decoder_input_ids=target[:, 2:], use_cache=True, **{name: modeling.decoding_state(first)}
        )
    torch.testing.assert_close(step.logits, full[:, 2:], rtol=0, atol=1e-5)


def test_the_state_given_twice_is_refused(model):
    one = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    other = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="given twice"):
        model(**INPUTS, decoder_input_ids=torch.zeros(2, 1, dtype=torch.long), cache=one, past_key_values=other)


def renaming(new_name):
    """`prepare_inputs_for_generation` of a release that passes the decoding state as `new_name` (None: drops it)."""
    original = GenerationMixin.prepare_inputs_for_generation

    def prepare(self, *args, **kwargs):
        inputs = original(self, *args, **kwargs)
        for name in ("cache", "past_key_values"):
            if name in inputs:
                state = inputs.pop(name)
                if new_name is not None:
                    inputs[new_name] = state
        return inputs

    return prepare


def test_a_simulated_rename_of_the_state_raises_instead_of_translating(model, monkeypatch):
    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", renaming("decoding_state"))
    with pytest.raises(TypeError) as error, torch.no_grad():
        model.generate(**INPUTS, max_new_tokens=4)
    message = str(error.value)
    assert "'decoding_state'" in message and f"transformers {transformers.__version__}" in message
    assert "tested with {} to {}".format(*modeling.TESTED_TRANSFORMERS) in message


@pytest.mark.parametrize("num_beams", [1, 4])
def test_a_lost_state_raises_at_the_second_step(model, monkeypatch, num_beams):
    monkeypatch.setattr(GenerationMixin, "prepare_inputs_for_generation", renaming(None))
    with pytest.raises(RuntimeError, match="past the first arrived without its decoding state") as error:
        with torch.no_grad():
            model.generate(**INPUTS, max_new_tokens=4, min_new_tokens=4, num_beams=num_beams)
    assert f"transformers {transformers.__version__}" in str(error.value)
    # uncached decoding does not depend on the state and still works under the same release
    with torch.no_grad():
        model.generate(**INPUTS, max_new_tokens=4, min_new_tokens=4, num_beams=num_beams, use_cache=False)


def test_a_step_past_the_first_without_state_is_refused(model):
    later_token = torch.tensor([[6], [13]])
    with torch.no_grad(), pytest.raises(RuntimeError, match="cache_position` starts at 3"):
        model(**INPUTS, decoder_input_ids=later_token, cache_position=torch.tensor([3]))
    with torch.no_grad(), pytest.raises(RuntimeError, match="not the start token"):
        model(**INPUTS, decoder_input_ids=later_token, use_cache=True)
    with torch.no_grad():  # the first step, or a one-token target scored without a cache, are fine
        model(**INPUTS, decoder_input_ids=torch.zeros(2, 1, dtype=torch.long), use_cache=True)
        model(**INPUTS, decoder_input_ids=later_token, use_cache=False)
        model(**INPUTS, decoder_input_ids=later_token, cache_position=torch.tensor([0]))


def test_a_release_without_a_known_output_name_raises(model, monkeypatch):
    monkeypatch.setattr(modeling, "CACHE_OUTPUT_NAME", None)
    with pytest.raises(RuntimeError, match="no field for the decoding state"), torch.no_grad():
        model.generate(**INPUTS, max_new_tokens=3)
    with torch.no_grad():  # without a cache nothing is returned under that name
        model.generate(**INPUTS, max_new_tokens=3, use_cache=False)


def test_the_tested_window_is_the_bound_of_the_package():
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (line,) = [line for line in requirements if re.match(r"transformers\b", line)]
    oldest, newest = modeling.TESTED_TRANSFORMERS
    major, minor = map(int, newest.split("."))
    assert line.replace(" ", "") == f"transformers>={oldest},<{major}.{minor + 1}"


@pytest.mark.parametrize(
    "version, expected",
    [("5.23.0", None), ("5.24.3", None), ("5.25.0.dev0", "newer than 5.24"), ("6.0.0", "newer"), ("5.22.1", "older")],
)
def test_one_warning_outside_the_tested_window(monkeypatch, caplog, version, expected):
    monkeypatch.setattr(modeling, "transformers_version", version)
    with caplog.at_level("WARNING"):
        text = modeling.check_transformers_window()
    if expected is None:
        assert text is None
    else:
        assert expected in text and f"transformers {version}" in text
        assert text in caplog.text


def test_max_new_tokens_alone_gives_one_cap_without_the_two_caps_warning(model, caplog):
    assert model.generation_config.max_length is not None  # the saved default cap
    with caplog.at_level("WARNING"), torch.no_grad():
        out = model.generate(**INPUTS, max_new_tokens=3, min_new_tokens=3)
    assert out.shape[1] == 4
    assert "seem to have been set" not in caplog.text
    with caplog.at_level("WARNING"), torch.no_grad():  # both given in one call: transformers' warning stays
        out = model.generate(**INPUTS, max_new_tokens=3, min_new_tokens=3, max_length=9)
    assert out.shape[1] == 4
    assert "seem to have been set" in caplog.text


def test_generate_hands_the_encoder_only_what_it_names(model):
    """`Seq2SeqTrainer` predictions call `generate(**batch)` with the batch's `labels`; generate() passes the encoder
    every model argument when its forward takes `**kwargs`, so the encoder names its arguments instead (and an
    unknown one is still a `TypeError`)."""
    labels = torch.tensor([[6, 8, 2], [13, 2, -100]])
    with torch.no_grad():
        plain = model.generate(**INPUTS, max_new_tokens=5, num_beams=2)
        with_labels = model.generate(**INPUTS, labels=labels, max_new_tokens=5, num_beams=2)
    assert torch.equal(plain, with_labels)
    with pytest.raises(TypeError, match="unexpected keyword argument 'labels'"):
        model.get_encoder()(**INPUTS, labels=labels)


def test_the_tests_left_out_of_the_contract_run_exist():
    """A renamed test in `NOT_TRANSFORMERS_CONTRACT` would silently join the contract run again (and one that lists a
    contract module's test by a stale name hides nothing): every name listed is a test of its module, and every
    `name[parameter]` one of that test's parameters."""
    import ast
    import importlib

    from conftest import NOT_TRANSFORMERS_CONTRACT, TRANSFORMERS_CONTRACT_MODULES

    for module, names in NOT_TRANSFORMERS_CONTRACT.items():
        assert module in TRANSFORMERS_CONTRACT_MODULES
        tree = ast.parse((Path(__file__).parent / module).read_text())
        tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        functions = {name.partition("[")[0] for name in names}
        assert functions <= tests, f"{module} has no {sorted(functions - tests)}"
        for name in names:
            function, _, parameter = name.partition("[")
            if parameter:
                marks = getattr(getattr(importlib.import_module(module[:-3]), function), "pytestmark", [])
                values = {str(value) for mark in marks if mark.name == "parametrize" for value in mark.args[1]}
                assert parameter.removesuffix("]") in values, f"{module}: {function} has no parameter {parameter}"


def test_the_contract_runs_architectures_exist_and_cover_every_method():
    """A renamed entry of the `ARCHITECTURES` matrix would silently leave the contract run: every id it takes is one
    of the matrix's, and every registered method's config class is among them."""
    from conftest import ARCHITECTURES, CONTRACT_ARCHITECTURES

    by_id = {param.id: param.values[0][0] for param in ARCHITECTURES}
    assert CONTRACT_ARCHITECTURES <= set(by_id), sorted(CONTRACT_ARCHITECTURES - set(by_id))
    taken = {by_id[name] for name in CONTRACT_ARCHITECTURES}
    assert {method.config_class for method in METHODS.values()} <= taken


def test_the_contract_runs_compiled_families_exist():
    """A renamed family would silently leave the contract run's compiled decoding checks: every family it names is one
    that test_compiled_decoding.py runs, and both checks it restricts still exist there."""
    import test_compiled_decoding
    from conftest import COMPILED_CHECKS, CONTRACT_COMPILED_FAMILIES

    assert CONTRACT_COMPILED_FAMILIES <= set(test_compiled_decoding.FAMILIES), sorted(
        CONTRACT_COMPILED_FAMILIES - set(test_compiled_decoding.FAMILIES)
    )
    assert all(callable(getattr(test_compiled_decoding, name, None)) for name in COMPILED_CHECKS)


def test_the_weight_files_are_found_with_public_arguments_only(model, tmp_path):
    """What a loading checks before it builds (`LoadingRequest.weight_files`) is found through `cached_file`'s public
    arguments, a lack caught as the `OSError` it raises: a folder's weights file, every shard of a sharded save, and
    nothing, without a download or an error, for a folder or a Hub id that holds none."""
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="5KB")

    def found(source) -> list[str]:
        return [Path(file).name for file in modeling.LoadingRequest(source=str(source), download={}).weight_files()]

    assert found(tmp_path / "single") == ["model.safetensors"]
    index = (tmp_path / "sharded" / "model.safetensors.index.json").read_text()
    shards = found(tmp_path / "sharded")
    assert len(shards) > 1 and all(f'"{shard}"' in index for shard in shards)
    assert found(tmp_path / "no-such-folder") == [] and found("org/not-in-any-cache") == []
    assert "_raise_exceptions" not in (ROOT / "modeling" / "contract_deep_nmt.py").read_text()
