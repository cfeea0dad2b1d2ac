"""Masked attention on CUDA stays off the cuDNN SDPA backend (NaN gradients, pytorch/pytorch#196678), checked without
a GPU: the backend flags that `F.scaled_dot_product_attention` sees at each call are recorded, with the restriction
pointed at the CPU device type so that it is taken here as it is on CUDA."""

import pytest
import torch
from conftest import method_families
from torch.nn import functional as F

from hf_deep_nmt import MODEL_CLASSES, DeepNMTConfig
from hf_deep_nmt.modeling import kernels_deep_nmt, modeling_deep_nmt

PAD = 1  # the tiny configs' padding id

# every registered method's tiny variants (`METHODS`): plain pre- and post-norm, the AAN, DLCL both ways, DS-Init
# with MAtt, SDT's sparse blocks with relative keys, MSC, DeepNorm
FAMILIES = [pytest.param(family, id=name) for name, family in method_families(every_check=True).items()]


def backend_flags() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "cudnn": cuda.cudnn_sdp_enabled(),
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


@pytest.fixture
def recorded_calls(monkeypatch):
    """Every SDPA call of the model as (mask passed?, backend flags active during the call)."""
    calls = []
    original = F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append((attn_mask is not None, backend_flags()))
        return original(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return calls


def padded_batch():
    input_ids = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD]])
    labels = torch.tensor([[11, 12, 13, 2], [14, 2, -100, -100]])
    return dict(input_ids=input_ids, attention_mask=(input_ids != PAD).long(), labels=labels)


def run_training_step(config) -> None:
    model = MODEL_CLASSES[type(config)](config).train()
    model(**padded_batch()).loss.backward()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_masked_attention_call_runs_with_the_cudnn_backend_switched_off(
    family, tiny_config, recorded_calls, monkeypatch
):
    monkeypatch.setattr(kernels_deep_nmt, "SDPA_RESTRICTED_DEVICE_TYPES", ("cpu",))
    config_class, overrides = family
    run_training_step(tiny_config(config_class, **overrides))
    masked = [flags for has_mask, flags in recorded_calls if has_mask]
    assert masked, "the padded batch and the causal decoder must produce masked calls"
    for flags in masked:
        assert flags == {"cudnn": False, "flash": True, "efficient": True, "math": True}
    # the restriction is scoped to the call: afterwards every backend is allowed again
    assert backend_flags() == {"cudnn": True, "flash": True, "efficient": True, "math": True}


def test_unmasked_calls_keep_every_backend(tiny_config, recorded_calls, monkeypatch):
    monkeypatch.setattr(kernels_deep_nmt, "SDPA_RESTRICTED_DEVICE_TYPES", ("cpu",))
    model = modeling_deep_nmt.DeepNMTForConditionalGeneration(tiny_config()).eval()
    # no mask given: the encoder's self-attention passes none (a given mask always goes in, whatever its values)
    model.get_encoder()(input_ids=torch.tensor([[5, 6, 7, 2]]))
    assert recorded_calls and all(not has_mask for has_mask, _ in recorded_calls)
    assert all(flags["cudnn"] for _, flags in recorded_calls)


def test_the_setting_switches_the_restriction_off(tiny_config, recorded_calls, monkeypatch):
    monkeypatch.setattr(kernels_deep_nmt, "SDPA_RESTRICTED_DEVICE_TYPES", ("cpu",))
    run_training_step(tiny_config(sdpa_avoid_cudnn=False))
    assert any(has_mask for has_mask, _ in recorded_calls)
    assert all(flags["cudnn"] for _, flags in recorded_calls)


def test_on_the_cpu_no_call_is_restricted(tiny_config, recorded_calls):
    run_training_step(tiny_config())
    assert any(has_mask for has_mask, _ in recorded_calls)
    assert all(flags["cudnn"] for _, flags in recorded_calls)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_setting_is_refused_by_name(tiny_config, value):
    with pytest.raises(ValueError, match=rf"`sdpa_avoid_cudnn` must be True or False, got {value!r}"):
        tiny_config(sdpa_avoid_cudnn=value)


def test_the_setting_is_saved_and_a_config_without_it_keeps_the_restriction(tiny_config, tmp_path):
    config = tiny_config(sdpa_avoid_cudnn=False)
    config.save_pretrained(tmp_path)
    assert DeepNMTConfig.from_pretrained(tmp_path).sdpa_avoid_cudnn is False
    saved = config.to_dict()
    del saved["sdpa_avoid_cudnn"]  # a folder written before the setting existed
    assert DeepNMTConfig.from_dict(saved).sdpa_avoid_cudnn is True


def test_the_restricted_attention_compiles_into_one_graph_with_the_eager_result(tiny_config, monkeypatch):
    """The backend restriction is a context manager that dynamo traces: no graph break (fullgraph), same output."""
    monkeypatch.setattr(kernels_deep_nmt, "SDPA_RESTRICTED_DEVICE_TYPES", ("cpu",))
    torch._dynamo.reset()
    model = modeling_deep_nmt.DeepNMTForConditionalGeneration(tiny_config(relative_position_window=2)).eval()
    batch = padded_batch()
    attention = model.model.encoder.layers[0].self_attn
    hidden = model.model.encoder.embed(batch["input_ids"])
    mask = modeling_deep_nmt.padding_mask_to_additive(batch["attention_mask"], hidden.dtype)
    compiled = torch.compile(attention, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(hidden, attention_mask=mask), attention(hidden, attention_mask=mask))
    torch._dynamo.reset()
