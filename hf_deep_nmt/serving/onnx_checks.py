"""What `OnnxDecoder` checks before it decodes with a folder of graphs, because the graphs are found by where they sit
and nothing else says which model they are: the layout file readable and whole; every graph it names there, of the
size the export wrote, with the SHA-256 it recorded, and readable by ONNX Runtime; the tokenizer beside the graphs and,
for graphs in a model folder's `onnx/` subfolder, that folder's weights, config and tokenizer the ones the graphs
were exported from (`onnx_export.source_digests`). Each refusal names the file and the command that writes the
graphs again. A layout of an earlier version records no digests: it is read with a warning that nothing could be
checked. Hashing streams each file once per load (the weights and the two graphs loaded).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hf_deep_nmt.fingerprints import fingerprint_version, folder_tokenizer_fingerprint
from hf_deep_nmt.folders import written_file_record
from hf_deep_nmt.serving.onnx_layout import LAYOUT_FILE, ONNX_SUBFOLDER, config_digest, weight_files

# the standard library's logger: what transformers' `get_logger` returns for a name outside transformers, without
# importing transformers (these checks run at every start of the ONNX Runtime backend)
logger = logging.getLogger(__name__)

# What a layout of every version holds; a file without one of these is not a layout `OnnxDecoder` can read.
LAYOUT_KEYS = ("layout", "encoder_fields", "decoder_start_token_id", "eos_token_id", "pad_token_id")
# The smallest graph ONNX Runtime could read holds a header, an opset and a node: anything shorter is cut off.
MIN_GRAPH_BYTES = 64
_warned: set[str] = set()


def model_folder_of(folder: Path) -> Path | None:
    """The model folder whose graphs `folder` holds: its parent when `folder` is a saved model's `onnx/` subfolder."""
    folder = Path(folder)
    if folder.name == ONNX_SUBFOLDER and (folder.parent / "config.json").is_file():
        return folder.parent
    return None


def export_again(folder: Path, int8: bool = False) -> str:
    """The way to write the graphs of `folder` again, as a user types it."""
    folder = Path(folder)
    model = model_folder_of(folder)
    flags = " --int8" if int8 else ""
    if model is not None:
        return f"remove {folder}, then run `hf-deep-nmt export-onnx --model {model} --into-model{flags}`"
    return f"export the model again into a new folder: `hf-deep-nmt export-onnx --model MODEL --output NEW{flags}`"


def read_layout(folder: Path) -> dict:
    """The parsed layout file of `folder`; `FileNotFoundError` / `ValueError` naming it when it is missing, not
    JSON, or without what every layout holds."""
    path = Path(folder) / LAYOUT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {folder} is no folder of ONNX graphs; {export_again(folder)}.")
    try:
        info = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(
            f"{path} is damaged (not JSON: {' '.join(str(error).split())}); {export_again(folder)}."
        ) from None
    missing = [key for key in LAYOUT_KEYS if key not in info] if isinstance(info, dict) else list(LAYOUT_KEYS)
    if missing:
        raise ValueError(f"{path} is damaged (it lacks {', '.join(missing)}); {export_again(folder)}.")
    return info


def checked_graphs(folder: Path, info: dict, int8: bool) -> list[Path]:
    """The start and step graphs of `folder` (`int8`: the quantized ones), each there, of the size and SHA-256 the
    layout records (every graph of an earlier layout: there and not cut off)."""
    suffix = ".int8.onnx" if int8 else ".onnx"
    paths = [Path(folder) / f"{name}{suffix}" for name in ("start", "step")]
    recorded = info.get("graphs")
    if int8 and not paths[0].is_file() and (not isinstance(recorded, dict) or paths[0].name not in recorded):
        raise FileNotFoundError(f"{paths[0]} is missing; export with quantize=True (--int8) for int8 graphs.")
    for path in paths:
        entry = recorded.get(path.name) if isinstance(recorded, dict) else None
        if not path.is_file():
            raise FileNotFoundError(f"{path}, a graph of {LAYOUT_FILE}, is missing; {export_again(folder, int8)}.")
        size = path.stat().st_size
        expected = entry.get("size") if isinstance(entry, dict) else None
        if size < MIN_GRAPH_BYTES or (expected is not None and size != expected):
            wrote = f"the export wrote {expected:,}" if expected is not None else "too few for a graph"
            raise ValueError(
                f"{path} has {size:,} bytes, {wrote}: it is cut off or replaced; {export_again(folder, int8)}."
            )
        if isinstance(entry, dict) and written_file_record(folder, [path.name])[path.name]["sha256"] != entry.get(
            "sha256"
        ):
            raise ValueError(
                f"{path} is not the graph the export wrote (its SHA-256 differs from the one {LAYOUT_FILE} records): "
                f"another export's graph? {export_again(folder, int8)}."
            )
    return paths


# ONNX Runtime graph rewrites left out: the fusion of a residual Add into the LayerNormalization after it
# (SkipLayerNormalization, whose CPU kernel ran a post-norm model's step, DeepNorm's at the reduced size, int8, one
# thread, 8-12% slower than the Add and LayerNormalization it replaces; pre-norm models, fused once, run the same)
SLOW_FUSIONS = ["SkipLayerNormFusion"]


def open_session(path: Path, options, folder: Path, int8: bool, **settings):
    """An ONNX Runtime session of the graph `path`; a graph it cannot read is named, with the way to write it again.
    `settings`: InferenceSession's own (its rewrites left out: `SLOW_FUSIONS`, unless given)."""
    import onnxruntime

    settings.setdefault("disabled_optimizers", SLOW_FUSIONS)
    try:
        return onnxruntime.InferenceSession(str(path), options, **settings)
    except Exception as error:  # onnxruntime raises its own exception types (Fail, InvalidProtobuf, ...)
        reason = " ".join(str(error).split())[:300]
        raise ValueError(
            f"{path} is not a graph ONNX Runtime can read ({reason}); {export_again(folder, int8)}."
        ) from None


# initializers from this size up are written beside the rewritten graphs and shared (smaller ones: shapes, scales)
SHARED_INITIALIZER_BYTES = 4096


def open_sessions(paths: list[Path], make_options, folder: Path, int8: bool, prepack=()) -> tuple[list, dict]:
    """Sessions of the graphs `paths` (the start and step graphs) that hold one copy of the weights between them: the
    step graph's weights are the start graph's decoder weights, and each session would otherwise keep its own, and
    its own pre-packed copy of each (the loaded decoder at twice to three times the weights). Each graph is first
    rewritten by ONNX Runtime itself (`make_options()`' optimizations, then saved, its weights in a file beside it),
    then opened as rewritten with no further rewrite, every weight given as one array per content (`add_initializer`,
    used in place on the CPU); what runs is the graph a plain session runs. Only the graphs of `prepack` (paths) keep
    pre-packed copies of their weights (ONNX Runtime's matrix layout for its fp32 products; the step graph's saved
    10-13% of fp32 decoding's CPU time, the start graph's, run once a batch, nothing measurable). Returns the
    sessions and the arrays they use, which must outlive them. Without the onnx package (which reads the rewritten
    graphs), plain sessions, each with its own weights."""
    try:
        import onnx  # noqa: F401
    except ImportError:
        return [open_session(path, make_options(), folder, int8) for path in paths], {}
    try:
        sessions, weights = _shared_weight_sessions(paths, make_options, folder, int8, prepack)
    except (OSError, ValueError) as error:  # no room or no write access for the rewritten copies, say
        # opened plainly, each graph with its own weights; a damaged graph is named here, as without the rewriting
        sessions = [open_session(path, make_options(), folder, int8) for path in paths]
        logger.warning(
            "The ONNX graphs could not be rewritten into a temporary folder to share their weights (%s); each graph "
            "keeps its own copy (more memory, the same translations). TMPDIR names where they go.",
            " ".join(str(error).split())[:200],
        )
        return sessions, {}
    _release_freed_memory()
    return sessions, weights


def _release_freed_memory() -> None:
    """Hand back to the system the heap that the rewriting sessions freed (glibc keeps ~20 MB of it otherwise, in
    pieces too small to unmap one by one); nothing where the C library has no `malloc_trim`."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _shared_weight_sessions(paths: list[Path], make_options, folder: Path, int8: bool, prepack) -> tuple[list, dict]:
    """`open_sessions`' sessions over one copy of the weights."""
    import hashlib
    import tempfile

    import numpy as np
    import onnx
    import onnxruntime
    from onnx.helper import tensor_dtype_to_np_dtype

    weights, sessions = {}, []
    with tempfile.TemporaryDirectory(prefix="hf-deep-nmt-onnx-") as temporary:
        for path in paths:
            rewritten, options = Path(temporary) / path.name, make_options()
            options.optimized_model_filepath = str(rewritten)
            options.log_severity_level = 3  # not the warning that the rewritten graph is for this machine alone
            for key, value in (
                ("session.optimized_model_external_initializers_file_name", rewritten.stem + ".weights"),
                ("session.optimized_model_external_initializers_min_size_in_bytes", str(SHARED_INITIALIZER_BYTES)),
                ("session.disable_prepacking", "1"),
            ):
                options.add_session_config_entry(key, value)
            open_session(path, options, folder, int8)  # only writes the rewritten graph
            graph = onnx.load(str(rewritten), load_external_data=False).graph
            options = make_options()
            options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
            if path not in prepack:
                options.add_session_config_entry("session.disable_prepacking", "1")
            for initializer in graph.initializer:
                if initializer.data_location != onnx.TensorProto.EXTERNAL:
                    continue
                place = {entry.key: entry.value for entry in initializer.external_data}
                data = np.fromfile(
                    Path(temporary) / place["location"], np.uint8, int(place["length"]), offset=int(place["offset"])
                )
                key = (initializer.data_type, tuple(initializer.dims), hashlib.sha256(data).digest())
                if key not in weights:
                    array = data.view(tensor_dtype_to_np_dtype(initializer.data_type)).reshape(initializer.dims)
                    weights[key] = onnxruntime.OrtValue.ortvalue_from_numpy(array)
                options.add_initializer(initializer.name, weights[key])
            sessions.append(open_session(rewritten, options, folder, int8, disabled_optimizers=[]))
    return sessions, weights


def check_source(folder: Path, info: dict) -> None:
    """Refuse graphs whose folder holds another tokenizer, or (in a model folder's `onnx/`) whose model folder holds
    other weights, another config or another tokenizer than the ones they were exported from; warn once where the
    layout records nothing to compare."""
    folder = Path(folder)
    source = info.get("source") if isinstance(info.get("source"), dict) else None
    model = model_folder_of(folder)
    if source is None:
        _warn_once(
            folder,
            f"The ONNX graphs in {folder} were exported by an earlier version, whose {LAYOUT_FILE} records no "
            "digests: that they belong to the tokenizer beside them"
            + (f" and to the weights and config of {model}" if model is not None else "")
            + f" could not be checked; to have it checked, {export_again(folder)}.",
        )
        return
    recorded = source.get("tokenizer_fingerprint")
    for place in (folder, model):
        if place is not None and isinstance(recorded, str):
            _check_tokenizer(place, folder, recorded)
    if model is None:
        return
    if "config" not in source and "weights" not in source:
        _warn_once(
            folder,
            f"The ONNX graphs in {folder} were exported from a model object, not from a saved folder: that they were "
            f"made from the weights and config of {model} could not be checked; to have it checked, "
            f"{export_again(folder)}.",
        )
        return
    _check_config(model, folder, source.get("config"))
    _check_weights(model, folder, source.get("weights"))


def _check_tokenizer(place: Path, folder: Path, recorded: str) -> None:
    version = fingerprint_version(recorded)
    actual = folder_tokenizer_fingerprint(place, version) if version in (1, 2) else None
    if actual is not None and actual != recorded:
        raise ValueError(
            f"{place / 'tokenizer.json'} is not the tokenizer the ONNX graphs in {folder} were exported with (its "
            f"fingerprint is {actual[:19]}..., {LAYOUT_FILE} records {recorded[:19]}...): the same text would become "
            f"other ids. Restore the tokenizer saved with the graphs, or {export_again(folder)}."
        )


def _check_config(model: Path, folder: Path, recorded) -> None:
    if not isinstance(recorded, str):
        return
    path = model / "config.json"
    try:
        actual = config_digest(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError):
        actual = None  # a damaged config: not the one recorded
    if actual != recorded:
        raise ValueError(
            f"{path} is not the config the ONNX graphs in {folder} were exported from (its settings' SHA-256 "
            f"differs from the one {LAYOUT_FILE} records): the graphs compute another model than the folder "
            f"describes; {export_again(folder)}."
        )


def _check_weights(model: Path, folder: Path, recorded) -> None:
    files = weight_files(model)
    if not isinstance(recorded, dict) or not files:
        return  # nothing to compare: the graphs are the only model here
    actual = written_file_record(model, [path.name for path in files])
    for name in sorted(set(actual) | set(recorded)):
        if recorded.get(name) != actual.get(name, {}).get("sha256"):
            what = f"{model / name}" if name in actual else f"{model} (which has no {name})"
            raise ValueError(
                f"The ONNX graphs in {folder} were exported from other weights than {what} holds (the SHA-256 "
                f"{LAYOUT_FILE} records differs): the weights were replaced since, or the graphs are another model's; "
                f"the torch backend would translate with the new weights; {export_again(folder)}."
            )


def _warn_once(folder: Path, message: str) -> None:
    key = str(Path(folder).resolve())
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def decoding_config(folder: Path, info: dict):
    """What the decoding-memory estimate reads of the model the graphs compute: the layout's `model_config` (a config's
    `to_dict`) as values, which `decoding_bytes` reads without transformers and the model code; for an earlier layout,
    the config object of its model folder's config.json (which leaves out values at their class's defaults, so only
    the config class can say them); None when there is none to read."""
    values = info.get("model_config")
    if isinstance(values, dict):
        return values
    model = model_folder_of(folder)
    if model is None:
        return None
    try:
        values = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return _config_object(values) if isinstance(values, dict) else None


def _config_object(values: dict):
    """The registered config class's object of `values`; None where they name no registered model type."""
    from transformers import CONFIG_MAPPING

    from hf_deep_nmt import registration  # noqa: F401  (registers the config classes)

    if values.get("model_type") not in CONFIG_MAPPING:
        return None
    try:
        return CONFIG_MAPPING[values["model_type"]].from_dict(values)
    except (TypeError, ValueError, KeyError):
        return None


# What the model code's `decoding_memory` reads of a config, each a field that a config's `to_dict` always writes
# (the layout's `model_config`), but for the per-stack Hyper-Connections expansions, left out where they are all 0.
_ESTIMATE_FIELDS = (
    "d_model",
    "decoder_layers",
    "decoder_vocab_size",
    "decoder_self_attention",
    "decoder_layer_aggregation",
    "decoder_block_boundaries",
    "msc_block_layers",
    "msc_context",
    "msc_context_sides",
)
_ATTENTION_RESIDUALS = ("attnres", "block_attnres")  # the model code's `ATTENTION_RESIDUAL_AGGREGATIONS`


def decoding_bytes(values: dict, rows: int, source_tokens: int, cached_tokens: int) -> int | None:
    """The model code's `decoding_memory` (float32) of the config whose `to_dict` is `values`, worked out from the
    values alone (tests/test_onnx_imports.py holds the two equal for every family); None where `values` lacks what
    it reads, for the model code to say."""
    if any(key not in values for key in _ESTIMATE_FIELDS) or values.get("model_type") is None:
        return None
    get = values.__getitem__
    d, layers = get("d_model"), get("decoder_layers")
    if not all(isinstance(value, int) for value in (d, layers, get("decoder_vocab_size"))):
        return None
    attends = get("msc_block_layers") is not None and get("msc_context") != "none"
    cross = 2 * d * (2 if attends and get("msc_context_sides") == "encoder_and_decoder" else 1)
    own = 2 * d if get("decoder_self_attention") == "multi_head" else 0
    step = 0
    if get("decoder_layer_aggregation") in _ATTENTION_RESIDUALS:
        boundaries = get("decoder_block_boundaries")
        step += ((layers if get("decoder_layer_aggregation") == "attnres" else len(boundaries) - 1) + 1) * d
    streams = values.get("decoder_hyper_connections", 0)
    if streams is None or not isinstance(streams, int):
        return None
    step += 2 * streams * d
    states = rows * (source_tokens * d + layers * (cross * source_tokens + own * cached_tokens) + step)
    return states * 4 + 4 * 3 * rows * get("decoder_vocab_size")


def memory_estimate(config):
    """The decoding-memory estimate (rows, source tokens, cached tokens) -> bytes of `decoding_config`'s result:
    `decoding_bytes` of a layout's values where it can read them, else the model code's `decoding_memory` (imports
    torch, transformers and the model code); None where there is no config to estimate with."""
    if isinstance(config, dict):
        if decoding_bytes(config, 1, 1, 1) is not None:
            return lambda rows, source_tokens, cached_tokens: decoding_bytes(
                config, rows, source_tokens, cached_tokens
            )
        config = _config_object(config)
    if config is None:
        return None
    from hf_deep_nmt.modeling.sizes_deep_nmt import decoding_memory

    return lambda rows, source_tokens, cached_tokens: decoding_memory(config, rows, source_tokens, cached_tokens)


def clearly_available(needed: int) -> bool:
    """Whether the CPU plainly has `needed` bytes for this process: the kernel's MemAvailable and what the
    address-space limit (RLIMIT_AS) leaves both hold them, as the model code's `available_memory` reads them. Checked
    first, without torch; where it is not plain, `hf_deep_nmt.memory.check_memory` decides and words the refusal."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
            limits.append(max(soft - used, 0))
    except (ImportError, OSError, ValueError, IndexError):
        return False
    return bool(limits) and needed <= min(limits)
