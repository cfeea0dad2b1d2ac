"""The deep-NMT model code's contract with transformers: what it was tested with, and what it checks where it meets
transformers' generation and loading.

The model code runs under whatever transformers the user has (it ships inside every Hub repository), and generation
internals it relies on change between minor releases: 5.24 renamed the decoding state from `past_key_values` to
`cache` in model inputs and outputs. What it was tested with is written here (`TESTED_TRANSFORMERS`); a contract it
relies on that is not met raises an error (a translation decoded without its state is silently wrong), and a newer
release than the newest tested one gets one warning naming both. A model loaded by `from_pretrained` is looked at
once: weights holding NaN or infinite values are named in a warning (`warn_nonfinite_weights`), weights the file
lacks or holds beyond the model's are an error (`check_loaded_weights`).

What a model is given is checked here too, before anything is allocated for it, so that the package's classes and a
folder loaded with `trust_remote_code` (where this file is all there is) refuse the same things: the memory a model
or a decoding needs against what this process can allocate (`available_memory`, `check_fits`), and the tensors a
safetensors file holds, read from its header alone (`safetensors_header`).

`modeling_deep_nmt.py` holds the architecture and imports this file; it ships beside it inside every Hub repository
(transformers copies the relative import on `save_pretrained`), and imports only the standard library, torch,
transformers and `kernels_deep_nmt.py`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

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


def missing_and_unexpected_weights(model: nn.Module, loading_info: dict) -> tuple[list[str], list[str]]:
    """The weights `from_pretrained` did not find in the file (and so initialised at random; tied copies of loaded
    weights are not missing), and those the file holds that the model has no place for. A model without the output
    layer (`AutoModel`) takes the body of a translation model's file: that file's output layer (`lm_head.*`) is not
    unexpected, as transformers drops a task head when loading a base model."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    missing = sorted(set(loading_info.get("missing_keys", ())) - tied)
    unexpected = sorted(set(loading_info.get("unexpected_keys", ())))
    if getattr(model, "lm_head", None) is None:
        unexpected = [name for name in unexpected if not name.startswith("lm_head.")]
    return missing, unexpected


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def check_loaded_weights(model: nn.Module, loading_info: dict, source: str) -> None:
    """`ValueError` when the weights file of `source` lacks weights of `model` (initialised at random, they would
    translate into noise) or holds weights the model has no place for (thrown away: the config describes another
    model), naming them; a missing or unexpected layer-history weight names the layer aggregation the config sets.
    Weights of another shape are transformers' own error, or, with `ignore_mismatched_sizes=True`, what the caller
    asked for (transformers names them in its load report)."""
    missing, unexpected = missing_and_unexpected_weights(model, loading_info)
    if not missing and not unexpected:
        return
    config = getattr(model, "config", None)
    hints = []
    for side in ("encoder", "decoder"):
        aggregation = getattr(config, f"{side}_layer_aggregation", None)
        if any(f"{side}.history." in name for name in missing):
            hints.append(
                f"config.json sets `{side}_layer_aggregation={aggregation!r}`, whose layer-history weights "
                f"({side}.history.*) the file lacks: the weights are those of a model without them (a residual stack)"
            )
        if any(f"{side}.history." in name for name in unexpected):
            hints.append(
                f"the file holds layer-history weights ({side}.history.*) of a DLCL or SDT model, but config.json "
                f"sets `{side}_layer_aggregation={aggregation!r}`"
            )
    parts = []
    if missing:
        parts.append(f"lack {_shown(missing)}: they would be initialised at random")
    if unexpected:
        parts.append(f"hold {_shown(unexpected)}, which this model has no place for")
    raise ValueError(
        f"The weights of {source!r} {'; and they '.join(parts)}"
        + (f" ({'; '.join(hints)})" if hints else "")
        + ". The weight file does not belong to this config, or was damaged; restore the folder as it was saved."
    )


# ---- Memory and safetensors headers, read before anything is allocated ---------------------------------------------

GIB = 1 << 30


def describe_bytes(size: float) -> str:
    """`1.5 GiB`, `12.0 MiB`: a size for a message."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 1024:.1f} KiB"


def available_memory(device: str | torch.device = "cpu") -> int | None:
    """Bytes this process can still allocate on `device`: on a GPU what the driver reports free (plus what torch's
    cache holds unused); on the CPU the kernel's MemAvailable, lowered to what the address-space limit of this process
    (`ulimit -v`, RLIMIT_AS) leaves. None when it cannot be told (the meta device allocates nothing: None)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
            limits.append(max(soft - used, 0))
    except (ImportError, OSError, ValueError):
        pass
    return min(limits) if limits else None


class InsufficientMemoryError(ValueError):
    """What was asked needs more memory than the machine has: refused, with the estimate, before any allocation."""


def check_fits(
    needed: int, what: str, way_out: str | Callable[[int], str], device: str | torch.device = "cpu"
) -> None:
    """`InsufficientMemoryError` stating that `what` needs about `needed` bytes when `device` has less available (see
    `available_memory`), before anything is allocated; `way_out` says what to change (a function of the bytes
    available: what would fit)."""
    available = available_memory(device)
    if available is not None and needed > available:
        way_out = way_out(available) if callable(way_out) else way_out
        raise InsufficientMemoryError(
            f"{what} needs about {describe_bytes(needed)} ({needed:,} bytes), but only {describe_bytes(available)} "
            f"is available on {device}; {way_out}."
        )


SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}
SAFETENSORS_DTYPE_BYTES.update({"I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1})


def safetensors_header(path: str | os.PathLike) -> dict:
    """The JSON header of the safetensors file `path` (tensor names to dtype, shape, offsets); only the header is
    read. `ValueError` naming the file when it is not a safetensors file."""
    path = Path(path)
    with path.open("rb") as handle:
        prefix = handle.read(8)
        size = path.stat().st_size
        header_size = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else size
        if header_size > size - 8:
            raise ValueError(
                f"{str(path)!r} is not a whole safetensors file (cut off, or not safetensors at all): its first 8 "
                f"bytes announce a header of {header_size} bytes in a file of {size}; save the model again, or "
                "restore the file from the exported folder."
            )
        try:
            header = json.loads(handle.read(header_size))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise ValueError(
            f"{str(path)!r} has an unreadable safetensors header (not a JSON object); save the model again, or "
            "restore the file from the exported folder."
        )
    header.pop("__metadata__", None)
    ends = [entry.get("data_offsets", [0, 0])[-1] for entry in header.values() if isinstance(entry, dict)]
    data_size = max([end for end in ends if isinstance(end, int)], default=0)
    if 8 + header_size + data_size > size:
        raise ValueError(
            f"{str(path)!r} is not a whole safetensors file (cut off): its header places tensor data up to byte "
            f"{8 + header_size + data_size} in a file of {size}; save the model again, or restore the file from the "
            "exported folder."
        )
    return header


def saved_tensor_shapes(files: list[str | os.PathLike]) -> tuple[dict[str, tuple[int, ...]], int]:
    """(name -> shape, bytes) of the tensors the safetensors `files` hold, from their headers alone."""
    shapes, size = {}, 0
    for path in files:
        for name, entry in safetensors_header(path).items():
            shape = tuple(int(length) for length in entry.get("shape", []))
            shapes[name] = shape
            size += math.prod(shape) * SAFETENSORS_DTYPE_BYTES.get(entry.get("dtype"), 4)
    return shapes, size


@dataclasses.dataclass
class LoadingRequest:
    """What `from_pretrained` was asked to load, for the model's `__init__` to check before it builds anything (by
    then transformers has read the config, with the caller's overrides, and fetched the weight files)."""

    source: str
    download: dict
    variant: str | None = None
    ignore_mismatched_sizes: bool = False
    device: torch.device | None = None  # where the weights are put; None: several places (a device map)
    checked: bool = False

    @classmethod
    def of_call(cls, source, kwargs: dict) -> LoadingRequest:
        download = {
            key: kwargs[key] for key in ("cache_dir", "proxies", "token", "revision", "subfolder") if key in kwargs
        }
        device_map = kwargs.get("device_map")
        if device_map is None:
            device = torch.device("cpu")
        elif isinstance(device_map, (str, torch.device, int)) and str(device_map) not in ("auto", "balanced"):
            try:
                device = torch.device(device_map)
            except (RuntimeError, TypeError):
                device = None
        else:
            device = None
        return cls(
            source=str(source),
            download=download,
            variant=kwargs.get("variant"),
            ignore_mismatched_sizes=bool(kwargs.get("ignore_mismatched_sizes", False)),
            device=device,
        )

    def weight_files(self) -> list[str]:
        """The safetensors files being loaded (one, or the shards of its index), looked up where transformers has
        just put them (a folder, or the Hub cache: no download); [] where there are none (a `.bin` checkpoint, a
        state dict) or they cannot be found."""
        from transformers.utils import cached_file

        if self.source == "None":  # weights given as a `state_dict` alone
            return []
        infix = f".{self.variant}" if self.variant else ""

        def find(name: str) -> str | None:
            # `cached_file`'s public form raises `OSError` for a file the source lacks (its switches to return None
            # instead are private): a lack is an answer here, so it is caught, for this one file
            try:
                return cached_file(self.source, name, **self.download, local_files_only=True)
            except OSError:
                return None

        try:
            single = find(f"model{infix}.safetensors")
            if single is not None:
                return [single]
            index = find(f"model{infix}.safetensors.index.json")
            if index is None:
                return []
            shards = sorted(set(json.loads(Path(index).read_text(encoding="utf-8")).get("weight_map", {}).values()))
            files = [find(shard) for shard in shards]
        except (OSError, ValueError, TypeError):
            return []  # transformers reports what it cannot find itself
        return files if all(files) else []


# The `from_pretrained` call in progress in this thread, if any (`DeepNMTPreTrainedModel.from_pretrained`).
LOADING: contextvars.ContextVar[LoadingRequest | None] = contextvars.ContextVar("deep_nmt_loading", default=None)
