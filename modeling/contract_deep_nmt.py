"""The deep-NMT model code's contract with transformers: what it was tested with, and what it checks where it meets
transformers' generation and loading.

The model code runs under whatever transformers the user has (it ships inside every Hub repository), and generation
internals it relies on change between minor releases: 5.24 renamed the decoding state from `past_key_values` to
`cache` in model inputs and outputs. What it was tested with is written here (`TESTED_TRANSFORMERS`); a contract it
relies on that is not met raises an error (a translation decoded without its state is silently wrong), and a newer
release than the newest tested one gets one warning naming both. A model loaded by `from_pretrained` is looked at
once: weights holding NaN or infinite values are named in a warning (`warn_nonfinite_weights`).

`modeling_deep_nmt.py` holds the architecture and imports this file; it ships beside it inside every Hub repository
(transformers copies the relative import on `save_pretrained`), and imports only the standard library, torch,
transformers and `kernels_deep_nmt.py`.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from transformers import __version__ as transformers_version
from transformers.cache_utils import Cache
from transformers.configuration_utils import PretrainedConfig
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils import logging

from .kernels_deep_nmt import is_tracing

logger = logging.get_logger(__name__)

TESTED_TRANSFORMERS = ("5.23", "5.24")  # (oldest, newest) minor release this file was tested with


def _minor(version: str) -> tuple[int, int]:
    """`(major, minor)` of a version string such as `5.24.0` or `5.25.0.dev0`."""
    numbers = [int("".join(ch for ch in part if ch.isdigit()) or 0) for part in version.split(".")[:2]]
    return tuple((numbers + [0, 0])[:2])


def transformers_window_text() -> str:
    """The installed transformers against the releases this file was tested with, for error messages."""
    oldest, newest = TESTED_TRANSFORMERS
    return f"transformers {transformers_version} (this model code was tested with {oldest} to {newest})"


def check_transformers_window() -> str | None:
    """One warning when the installed transformers is outside `TESTED_TRANSFORMERS`; returns its text (None inside)."""
    oldest, newest = TESTED_TRANSFORMERS
    installed = _minor(transformers_version)
    if installed > _minor(newest):
        text = (
            f"hf-deep-nmt runs under transformers {transformers_version}, newer than {newest}, the newest release "
            "this model code was tested with: decoding checks its contract with transformers and raises an error "
            "where it is broken; `hf-deep-nmt doctor` checks cached decoding on this machine."
        )
    elif installed < _minor(oldest):
        text = (
            f"hf-deep-nmt runs under transformers {transformers_version}, older than {oldest}, the oldest release "
            "this model code was tested with; upgrade transformers, or check decoding with `hf-deep-nmt doctor`."
        )
    else:
        return None
    logger.warning_once(text)
    return text


# The name of the decoding state in model outputs: `cache` from transformers 5.24, `past_key_values` before (None if
# neither, a release this file does not know: returning a state then raises).
_OUTPUT_FIELDS = getattr(Seq2SeqLMOutput, "__dataclass_fields__", {})
CACHE_OUTPUT_NAME = next((name for name in ("cache", "past_key_values") if name in _OUTPUT_FIELDS), None)
# The names a forward takes the decoding state under (transformers passes one of them, by release).
CACHE_INPUT_NAMES = ("cache", "past_key_values")


def decoding_state(outputs) -> Cache | None:
    """The decoding state of a model output, whichever name the installed transformers gives it."""
    for name in CACHE_INPUT_NAMES:
        if name in getattr(type(outputs), "__dataclass_fields__", {}):
            return getattr(outputs, name)
    return None


def with_decoding_state(output_class, cache: Cache | None, **fields):
    """`output_class(**fields)` carrying `cache` under the name the installed transformers reads (`generate()` looks
    for it there); an error, not a model output without its state, when that name is unknown."""
    if cache is not None:
        if CACHE_OUTPUT_NAME is None:
            raise RuntimeError(
                f"{output_class.__name__} has no field for the decoding state (neither `cache` nor `past_key_values`) "
                f"under {transformers_window_text()}: generate() would decode every step without it. Install a "
                "tested transformers release, or decode with use_cache=False."
            )
        fields[CACHE_OUTPUT_NAME] = cache
    return output_class(**fields)


def take_decoding_state(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The decoding state given under either name (`cache` from transformers 5.24, `past_key_values` before)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("The decoding state was given twice, as `cache` and as `past_key_values`; give one of them.")
    return cache if cache is not None else past_key_values


def check_step_has_state(
    config: PretrainedConfig,
    decoder_input_ids: torch.Tensor | None,
    cache: Cache | None,
    use_cache: bool | None,
    cache_position: torch.Tensor | None,
) -> None:
    """Refuse a decoding step past the first that arrives without its state: decoded from its last token alone it
    gives a wrong translation and no error. Seen as `cache_position` beyond 0, or as an explicit `use_cache=True` with
    one decoder token that is not the start token; both without a cache."""
    if cache is not None or decoder_input_ids is None or is_tracing():
        return
    reason = None
    if cache_position is not None and cache_position.numel() and int(cache_position.reshape(-1)[0]) > 0:
        reason = f"`cache_position` starts at {int(cache_position.reshape(-1)[0])}"
    elif (
        use_cache is True
        and config.decoder_start_token_id is not None
        and decoder_input_ids.dim() == 2
        and decoder_input_ids.shape[1] == 1
        and bool((decoder_input_ids != config.decoder_start_token_id).any())
    ):
        reason = f"one decoder token that is not the start token ({config.decoder_start_token_id}) with use_cache=True"
    if reason is not None:
        raise RuntimeError(
            f"A decoding step past the first arrived without its decoding state ({reason}, and neither `cache` nor "
            f"`past_key_values`): decoded from its last token alone the translation would be wrong. Under "
            f"{transformers_window_text()}, generate() may pass the state under a name this code does not know; "
            "install a tested transformers release, or decode with use_cache=False. (To score a one-token target "
            "yourself, pass use_cache=False or the cache of the earlier steps.)"
        )


# Keyword arguments the forwards accept without using them (the generic output options of transformers' models):
# ignored with one warning when set. `cache_position` (taken through `**kwargs`: a forward that names it makes
# transformers build it, with a warning, for code loaded as remote code) only feeds `check_step_has_state`.
IGNORED_ARGUMENTS = frozenset(
    {"output_attentions", "output_hidden_states", "head_mask", "decoder_head_mask", "cross_attn_head_mask"}
)
# Inputs transformers' models take that this model cannot: accepted when None (as PEFT passes them), else refused.
UNSUPPORTED_INPUTS = frozenset({"inputs_embeds", "decoder_inputs_embeds", "position_ids", "decoder_position_ids"})


def check_extra_arguments(module: nn.Module, arguments: dict) -> None:
    """The keyword arguments of a forward beyond its own: `TypeError` for a name it does not know (as a plain Python
    function; naming the transformers release when the value is a decoding state under a new name), `ValueError` for
    an input this model cannot take, one warning for a set `IGNORED_ARGUMENTS` option. Unset or False values of the
    known names say nothing."""
    name = f"{type(module).__name__}.forward()"
    unknown = sorted(set(arguments) - IGNORED_ARGUMENTS - UNSUPPORTED_INPUTS - {"cache_position"})
    for argument in unknown:
        if isinstance(arguments[argument], Cache):
            raise TypeError(
                f"{name} got the decoding state under the name {argument!r}, which this model code does not know (it "
                f"takes `cache` or `past_key_values`): {transformers_window_text()}. Decoding without it would "
                "translate wrongly; install a tested transformers release, or decode with use_cache=False."
            )
    if unknown:
        raise TypeError(
            f"{name} got an unexpected keyword argument {unknown[0]!r}"
            + (f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else "")
            + f"; it ignores only {', '.join(sorted(IGNORED_ARGUMENTS))} (with a warning)."
        )
    given = sorted(argument for argument in UNSUPPORTED_INPUTS if arguments.get(argument) is not None)
    if given:
        raise ValueError(
            f"{name} cannot take {', '.join(given)}: this model embeds token ids itself, with sinusoidal positions "
            "counted from the decoding state; pass `input_ids` / `decoder_input_ids` instead."
        )
    ignored = sorted(
        argument
        for argument in IGNORED_ARGUMENTS
        if arguments.get(argument) is not None and arguments.get(argument) is not False
    )
    if ignored:
        logger.warning_once(
            f"{type(module).__name__}.forward ignores {', '.join(ignored)}: this model neither takes these inputs nor "
            "returns attention weights or per-layer hidden states."
        )


def nonfinite_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of `model` holding a NaN or an infinite value (tensors without data, on
    the meta device, are skipped)."""
    return [
        name
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())
        if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all())
    ]


def warn_nonfinite_weights(model: nn.Module, source: str) -> None:
    """A warning naming the non-finite weights of a model just loaded from `source` (what `from_pretrained` of these
    models does: the API warns, where hf-deep-nmt's commands refuse such a model)."""
    bad = nonfinite_parameters(model)
    if bad:
        logger.warning(
            f"The weights of {source!r} hold NaN or infinite values ({', '.join(bad[:5])}"
            + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            + "): its outputs will be NaN or empty."
        )
