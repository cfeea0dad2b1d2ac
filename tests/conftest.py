"""Shared fixtures: tiny configs with characteristic sizes, an isolated offline Hugging Face home, seeding."""

import gc
import hashlib
import os
import shutil
import socket
import tempfile
from pathlib import Path

# Set before anything imports transformers / huggingface_hub, which read these paths once at import time.
_SESSION_HF_HOME = tempfile.mkdtemp(prefix="hf-deep-nmt-tests-")
os.environ["HF_HOME"] = _SESSION_HF_HOME
os.environ["HF_MODULES_CACHE"] = os.path.join(_SESSION_HF_HOME, "modules")
os.environ["HF_HUB_OFFLINE"] = "1"
for _variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
    os.environ.pop(_variable, None)

import pytest
import torch

from hf_deep_nmt import (
    MODEL_CLASSES,
    AttnResConfig,
    DeepNMTConfig,
    DeepNormConfig,
    DenseFormerConfig,
    DlclConfig,
    DsInitConfig,
    HyperConnectionsConfig,
    MixLnConfig,
    MscConfig,
    SdtConfig,
)

# Every size differs from every other one, so that a swapped axis or a transposed weight fails loudly.
TINY_SIZES = dict(
    vocab_size=37,
    d_model=16,
    encoder_layers=3,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=2,
    encoder_ffn_dim=24,
    decoder_ffn_dim=20,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)

PAD = 1

# Every combination of pre/post-norm and layer aggregation per stack, plus the named DLCL config.
ARCHITECTURES = [
    pytest.param(
        (DeepNMTConfig, dict(encoder_layer_aggregation=enc, decoder_layer_aggregation=dec, pre_norm=pre_norm)),
        id=f"enc_{enc}-dec_{dec}-{'prenorm' if pre_norm else 'postnorm'}",
    )
    for enc in ("residual", "dlcl")
    for dec in ("residual", "dlcl")
    for pre_norm in (True, False)
] + [
    pytest.param((DlclConfig, {}), id="DlclConfig"),
    pytest.param((DsInitConfig, {}), id="DsInitConfig"),
    # DS-Init + MAtt + the gated AAN across norm placement and aggregation (not the full cross product)
    pytest.param((DeepNMTConfig, dict(decoder_self_attention="merged_average")), id="matt-prenorm"),
    pytest.param(
        (DeepNMTConfig, dict(decoder_self_attention="merged_average", pre_norm=False, layer_aggregation="dlcl")),
        id="matt-postnorm-dlcl",
    ),
    pytest.param(
        (
            DeepNMTConfig,
            dict(decoder_self_attention="merged_average", layer_aggregation="dlcl", init_scheme="ds_init"),
        ),
        id="dsinit-dlcl-matt-prenorm",
    ),
    pytest.param((DeepNMTConfig, dict(decoder_self_attention="average")), id="aan-prenorm"),
    # sparse block connections (SDT): blocks [0, 2, 3] in the encoder, [0, 1, 2] (= dense) in the decoder
    pytest.param(
        (DeepNMTConfig, dict(layer_aggregation="sparse", encoder_block_boundaries=[0, 2, 3], sparse_block_size=1)),
        id="sparse-prenorm",
    ),
    pytest.param(
        (DeepNMTConfig, dict(encoder_layer_aggregation="sparse", sparse_block_size=2, pre_norm=False)),
        id="sparse-postnorm-encoder",
    ),
    pytest.param((SdtConfig, dict(sparse_block_size=2, relative_position_window=2)), id="SdtConfig"),
    # Attention Residuals: full over the 3 encoder layers, one block of both decoder layers (its partial sum attended)
    pytest.param(
        (AttnResConfig, dict(encoder_layer_aggregation="attnres", decoder_layer_aggregation="block_attnres")),
        id="attnres",
    ),
    # relative position keys with a window (2) shorter than the test sequences, so clipping is exercised
    pytest.param((DeepNMTConfig, dict(relative_position_window=2)), id="relative-keys-prenorm"),
    pytest.param(
        (DeepNMTConfig, dict(relative_position_window=2, pre_norm=False, layer_aggregation="dlcl")),
        id="relative-keys-postnorm-dlcl",
    ),
    pytest.param(
        (DeepNMTConfig, dict(decoder_self_attention="average", aan_ffn=True, pre_norm=False)), id="aan-ffn-postnorm"
    ),
    pytest.param(
        (DeepNMTConfig, dict(decoder_self_attention="average", aan_ffn=True, decoder_layer_aggregation="dlcl")),
        id="aan-ffn-prenorm-dlcl-decoder",
    ),
    # MSC: encoder blocks of 2 and 1 layers for the 2 decoder layers, across the ablation switches
    pytest.param((MscConfig, dict(msc_block_layers=[2, 1])), id="MscConfig"),
    # DeepNorm: post-norm with the skip weighted by alpha; with DLCL and MAtt, and with the AAN and relative keys
    pytest.param((DeepNormConfig, {}), id="DeepNormConfig"),
    pytest.param(
        (DeepNormConfig, dict(layer_aggregation="dlcl", decoder_self_attention="merged_average")),
        id="deepnorm-dlcl-matt",
    ),
    pytest.param(
        (DeepNormConfig, dict(decoder_self_attention="average", aan_ffn=True, relative_position_window=2)),
        id="deepnorm-aan-ffn-relative-keys",
    ),
    pytest.param(
        (DeepNMTConfig, dict(msc_block_layers=[1, 2], pre_norm=False, msc_context="ffn_per_block", msc_fusion="add")),
        id="msc-postnorm-ffn-cell-add-fusion",
    ),
    pytest.param(
        (
            DeepNMTConfig,
            dict(
                msc_block_layers=[2, 1],
                msc_context_sides="encoder",
                decoder_self_attention="average",
                relative_position_window=2,
            ),
        ),
        id="msc-encoder-context-only-aan-relative-keys",
    ),
    pytest.param(
        (DeepNMTConfig, dict(msc_block_layers=[2, 1], msc_context="none", decoder_layer_aggregation="dlcl")),
        id="msc-no-context-dlcl-decoder",
    ),
    pytest.param(
        (DeepNMTConfig, dict(msc_block_layers=[1, 2], msc_context="block_output", init_scheme="ds_init")),
        id="msc-no-collaboration-dsinit",
    ),
    # Mix-LN: the first 2 of 3 encoder layers and the first of 2 decoder layers post-norm, pre-norm above
    pytest.param((MixLnConfig, dict(encoder_post_norm_layers=2, decoder_post_norm_layers=1)), id="mixln"),
    # DenseFormer: DLCL with identity-initialised weights and no history LayerNorms (the tiny models perturb every
    # weight, so the histories mix)
    pytest.param(
        (DenseFormerConfig, dict(layer_aggregation="dlcl", dlcl_init="identity", dlcl_history_norm=False)),
        id="denseformer",
    ),
    # Hyper-Connections, dynamic, with mHC's Sinkhorn-constrained stream mixing: 2 streams in both stacks
    pytest.param(
        (HyperConnectionsConfig, dict(hyper_connections_sinkhorn_iterations=3)),
        id="hyper",
    ),
    # DenseFormer's k x p variant: every second earlier output, an average after every second layer (post-norm)
    pytest.param(
        (DenseFormerConfig, dict(dlcl_dilation=2, dlcl_period=2, pre_norm=False)),
        id="denseformer-dilation2-period2-postnorm",
    ),
]


def method_families(every_check: bool = False) -> dict[str, tuple[type, dict]]:
    """The registered methods (`METHODS` in the model code) as tiny families for the tests that run every method, by
    check name: each method's first `checks` variant (every variant with `every_check=True`), as its config class
    and the settings to add to `TINY_SIZES` (`tiny_config(config_class, **settings)`; an MSC variant takes its
    encoder depth from its blocks). A method added to `METHODS` joins every such test without a new line; the
    exhaustive matrix of settings across methods is `ARCHITECTURES` above."""
    from hf_deep_nmt import METHODS

    families = {}
    for method in METHODS.values():
        for name, settings in method.checks.items():
            if settings.get("msc_block_layers") is not None:
                settings = {**settings, "encoder_layers": None}
            families[name] = (method.config_class, dict(settings))
            if not every_check:
                break
    return families


# A method without an entry in `ARCHITECTURES` joins the matrix through its first tiny variant in `METHODS` (a new
# named preset needs no line here; an entry there is for settings worth crossing with the method's).
_COVERED = {param.values[0][0] for param in ARCHITECTURES}
ARCHITECTURES += [
    pytest.param(family, id=name) for name, family in method_families().items() if family[0] not in _COVERED
]


def package_free_environment(hf_home, modules, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that loads models the way a user without this package does: no Hugging Face
    variable of this session, no PYTHONPATH (run it from an empty folder, so the checkout is not importable either),
    the Hub offline, its own `HF_HOME` and remote-code modules cache; plus `extra`."""
    environment = {
        key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))
    }
    environment.pop("PYTHONPATH", None)
    environment.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home), HF_MODULES_CACHE=str(modules), **extra)
    return environment


@pytest.fixture(scope="session")
def sample_slice(tmp_path_factory):
    """`sample_slice(pairs, vocab_size)`: a folder holding the bundled sample's first `pairs` pairs (`train.tsv`), the
    first two again as `valid.tsv`, and a joint tokenizer trained on them (`tokenizer/`), for the tests that run
    whole training commands; built once per size in a session. Read it, never write into it (copy it first)."""
    from hf_deep_nmt.data.corpus import sample_corpus_dir
    from hf_deep_nmt.data.tokenizer import train_joint_tokenizer

    built = {}

    def make(pairs: int = 48, vocab_size: int = 300) -> Path:
        if (pairs, vocab_size) not in built:
            folder = tmp_path_factory.mktemp(f"sample-{pairs}-{vocab_size}")
            lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()[:pairs]
            (folder / "train.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
            (folder / "valid.tsv").write_text("\n".join(lines[:2]) + "\n", encoding="utf-8")
            tokenizer = train_joint_tokenizer([line.split("\t") for line in lines], vocab_size=vocab_size)
            tokenizer.save_pretrained(folder / "tokenizer")
            built[pairs, vocab_size] = folder
        return built[pairs, vocab_size]

    return make


# No test may reach the network: connections to anything but this machine are refused (subprocesses get
# HF_HUB_OFFLINE=1 from the environment above).
_LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "", None}
_connect, _getaddrinfo = socket.socket.connect, socket.getaddrinfo


def _is_local(host) -> bool:
    return host in _LOCAL_HOSTS or (isinstance(host, str) and host.startswith("127."))


def _refuse_remote_connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
        raise OSError(f"network access is disabled in the tests (connect to {address!r})")
    return _connect(self, address)


def _refuse_remote_lookup(host, *args, **kwargs):
    if not _is_local(host):
        raise OSError(f"network access is disabled in the tests (lookup of {host!r})")
    return _getaddrinfo(host, *args, **kwargs)


socket.socket.connect = _refuse_remote_connect
socket.getaddrinfo = _refuse_remote_lookup

# Tiny models gain nothing from intra-op threads, and spinning OpenMP threads slow them down many times over when the
# cores are busy with another job.
torch.set_num_threads(1)


# The test modules that touch transformers' contracts (generation and caches, remote code, saved folders, the Trainer,
# compiled decoding): CI runs them (`-m transformers_contract`) against the oldest transformers the package admits as
# well as against the newest, which runs every test.
TRANSFORMERS_CONTRACT_MODULES = {
    "test_auto_model.py",
    "test_compiled_decoding.py",
    "test_doctor.py",
    "test_generation.py",
    "test_generation_length.py",
    "test_hub.py",
    "test_lora.py",
    "test_marian_conversion.py",
    "test_modeling.py",
    "test_msc.py",
    "test_pipeline.py",
    "test_remote_code.py",
    "test_remote_code_pairs.py",
    "test_running_average.py",
    "test_sample_recipe.py",
    "test_saved_folders.py",
    "test_transformers_contract.py",
    "test_translate.py",
    "test_upgrade_code.py",
}


# Tests in those modules that check what does not change with transformers' version, left out of the contract run (the
# README run, on the newest transformers, runs them), by name (every parameter) or by `name[parameter]`:
# - torch's ONNX exporter and Inductor's code against eager torch (the static cache and compiled `generate()` route
#   are checked per family with a backend that skips code generation);
# - torch's tracing of the training forward and step (Dynamo on this package's code; the decoding graphs above are
#   the ones that go through transformers' cache and generation code);
# - `upgrade-code`'s own command logic and Hub commit, and its upgrade of the DS-Init and DLCL post-norm folders: the
#   decoding check is the same code for every family, and MSC's (its cache is the one with the most parts) runs.
NOT_TRANSFORMERS_CONTRACT = {
    "test_compiled_decoding.py": {
        "test_the_onnx_export_computes_what_torch_computes_on_a_padded_batch",
        "test_inductor_compiled_decoding_equals_eager",
        "test_translate_with_compiled_decoding_gives_the_same_translations",
        "test_the_training_forward_of_every_family_is_one_graph",
        "test_a_compiled_training_step_gives_eager_loss_and_gradients",
    },
    "test_upgrade_code.py": {
        "test_the_folders_code_runs_only_with_consent_and_a_dry_run_writes_nothing",
        "test_a_comparison_that_could_not_run_is_a_failure_never_a_pass",
        "test_a_failing_check_writes_nothing",
        "test_a_hub_repository_gets_one_code_only_commit_on_top_of_the_checked_one",
        "test_the_command_line_reports_the_upgrade",
        "test_a_folder_with_the_0_1_0_code_is_upgraded_and_decodes_the_same_cached_and_uncached[dsinit]",
        "test_a_folder_with_the_0_1_0_code_is_upgraded_and_decodes_the_same_cached_and_uncached[dlcl-postnorm]",
    },
}


# The contract run takes, of the `ARCHITECTURES` matrix, one entry per way the models meet transformers' cache,
# generation and saving code: the plain stack, DLCL histories (the named config, and post-norm), DS-Init, MAtt's
# merged cache, the AAN's running-average cache, SDT's sparse histories with relative keys, each newer method, MSC
# with and without its decoder-side context, and DeepNorm with DLCL and MAtt. The other entries cross our own
# switches (pre/post-norm per stack, ablations) on the same transformers paths; the README run, on the newest
# transformers, runs them all.
CONTRACT_ARCHITECTURES = {
    "enc_residual-dec_residual-prenorm",
    "enc_dlcl-dec_dlcl-postnorm",
    "DlclConfig",
    "DsInitConfig",
    "matt-postnorm-dlcl",
    "aan-ffn-prenorm-dlcl-decoder",
    "SdtConfig",
    "attnres",
    "MscConfig",
    "msc-encoder-context-only-aan-relative-keys",
    "deepnorm-dlcl-matt",
    "mixln",
    "denseformer-dilation2-period2-postnorm",
    "hyper",
}


# Compiled decoding (test_compiled_decoding.py's two compiled checks, the costliest of the contract run): Dynamo traces
# each family's own layers the same way whatever transformers' version; what meets transformers' code is the static
# cache and the generation route, once per kind of decoding state: the plain stack's keys and values, MAtt's running
# sum (DS-Init's check), SDT's relative keys and MSC's context. The other families' compiled checks run in the README
# run, on the newest transformers.
CONTRACT_COMPILED_FAMILIES = {"prenorm", "dsinit-matt", "sdt-sparse-rpr", "msc"}
COMPILED_CHECKS = {
    "test_compiled_decoding_equals_eager_through_transformers_route",
    "test_compiled_forward_decoding_equals_eager",
}


def _in_the_contract_run(item) -> bool:
    if item.path.name not in TRANSFORMERS_CONTRACT_MODULES:
        return False
    if {item.originalname, item.name} & NOT_TRANSFORMERS_CONTRACT.get(item.path.name, set()):
        return False
    callspec = getattr(item, "callspec", None)
    if item.path.name == "test_compiled_decoding.py" and item.originalname in COMPILED_CHECKS:
        return callspec.params["family_model"] in CONTRACT_COMPILED_FAMILIES
    if callspec is not None and "architecture_config" in callspec.indices:
        return ARCHITECTURES[callspec.indices["architecture_config"]].id in CONTRACT_ARCHITECTURES
    return True


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _in_the_contract_run(item):
            item.add_marker(pytest.mark.transformers_contract)


def pytest_collection_finish(session):
    # What the imports and the collection made lives to the end of the session: out of the garbage collector's sight
    # (`gc.freeze`), so that a full collection (one in every Trainer's `train()`, more in transformers and accelerate)
    # walks what the tests made, not the 450,000 objects of torch, transformers and the test modules (0.2 CPU s each)
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def _isolated_hf_home():
    yield _SESSION_HF_HOME
    shutil.rmtree(_SESSION_HF_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def two_ranks(request, tmp_path_factory):
    """`two_ranks(name)`: the folder where two gloo ranks ran the scenario of test module `name`, all of them in ONE
    `torchrun` launch for the session (tests/two_ranks.py)."""
    from two_ranks import shared_launch

    return shared_launch(request, lambda name, build: shared_session_folder(tmp_path_factory, name, build))


@pytest.fixture(scope="session")
def clean_python(tmp_path_factory):
    """`clean_python.run(...)` for `subprocess.run([sys.executable, "-c", SCRIPT, ...], ...)`: a process without this
    package forked from a server that imported torch and transformers once (tests/clean_python.py), for the scripts
    whose point is loading remote code without the package, not an interpreter's start."""
    from clean_python import CleanPython

    server = CleanPython(tmp_path_factory.mktemp("clean-python"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def tiny_config():
    """`tiny_config(config_class=DeepNMTConfig, **overrides)` -> a config with the tiny characteristic sizes."""

    def make(config_class=DeepNMTConfig, **overrides):
        return config_class(**{**TINY_SIZES, **overrides})

    return make


@pytest.fixture(scope="session")
def random_model():
    """`random_model(config, scale=0.3)` -> the config's model class in eval mode, with noise added to every parameter
    (LayerNorms, DLCL weights and padding rows included), so that none keeps a value that re-initialisation, a missing
    LayerNorm or an identity combination would reproduce."""

    def make(config, scale: float = 0.3):
        model = MODEL_CLASSES[type(config)](config)
        generator = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                if tensor.is_floating_point():
                    tensor.add_(torch.randn(tensor.shape, generator=generator) * scale)
        return model.eval()

    return make


@pytest.fixture(params=ARCHITECTURES)
def architecture_config(request, tiny_config):
    config_class, overrides = request.param
    return tiny_config(config_class, **overrides)


@pytest.fixture
def padded_batch():
    """Source right-padded with id 1 (lengths 5 and 3); targets of lengths 4 and 2, labels padded with -100."""
    source = torch.tensor([[5, 9, 14, 3, 2], [7, 11, 2, PAD, PAD]])
    labels = torch.tensor([[6, 8, 12, 2], [13, 2, -100, -100]])
    return dict(
        input_ids=source,
        attention_mask=source.ne(PAD).long(),
        labels=labels,
        decoder_attention_mask=labels.ne(-100).long(),
        source_lengths=[5, 3],
        target_lengths=[4, 2],
    )


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="session")
def hub_cache():
    """`hub_cache(folder, cache_dir, repo_id)` lays `folder` out as the Hub cache does it,
    `cache_dir/models--org--name/{blobs, refs/main, snapshots/<commit>}` with the snapshot files linked to their
    blobs, so that `from_pretrained(repo_id)` finds it offline; returns the snapshot folder."""

    def lay_out(folder: Path, cache_dir: Path, repo_id: str, commit: str = HUB_COMMIT) -> Path:
        repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / commit
        (repo / "blobs").mkdir(parents=True)
        (repo / "refs").mkdir()
        snapshot.mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        for file in sorted(Path(folder).iterdir()):
            content = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
            blob.write_bytes(content)
            (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
        return snapshot

    return lay_out


EXPORT_PAIRS = [("el sol sale", "the sun rises"), ("la mar no se llena", "the sea is not full"), ("hola mundo", "hi")]


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory, tiny_config):
    """`(folder, model, tokenizer)`: a tiny DLCL model with noisy weights and 2 beams, exported with its tokenizer."""
    from hf_deep_nmt import DlclForConditionalGeneration
    from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
    from hf_deep_nmt.hub import export_hub_folder

    tokenizer = train_joint_tokenizer(EXPORT_PAIRS * 20, vocab_size=120, min_frequency=1)
    torch.manual_seed(0)
    model = DlclForConditionalGeneration(tiny_config(DlclConfig, vocab_size=len(tokenizer), tie_word_embeddings=False))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    model.generation_config.num_beams = 2
    folder = export_hub_folder(model, tokenizer, tmp_path_factory.mktemp("export") / "repo", repo_id="org/tiny")
    return folder, model.eval(), tokenizer


def shared_session_folder(tmp_path_factory, name: str, build) -> Path:
    """The folder `name`, written once per test session by `build(folder)` and read by every pytest-xdist worker (the
    documented pattern: a folder beside the workers' own temporary folders, built under a file lock by the first
    worker that needs it; the others wait for it, then read it). For what costs seconds of CPU and is the same in every
    worker; a build that failed is tried again by the next test that asks. Read it, never write into it."""
    from filelock import FileLock  # a dependency of torch and huggingface_hub

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's folder, which holds each worker's own
    folder, complete = root / name, root / f"{name}.complete"
    with FileLock(str(root / f"{name}.lock")):
        if not complete.exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            complete.touch()
    return folder


def _train_small_model(tokenizer):
    """A plain post-norm model (d 64, one encoder and one decoder layer) trained 120 steps on the bundled sample's
    first 160 pairs, in eval mode: trained weights leave no symmetry to hide a slip in an export, and its
    translations mean something (the int8 test's chrF bound)."""
    from hf_deep_nmt import MODEL_CLASSES
    from hf_deep_nmt.data.corpus import sample_corpus_dir

    lines = (sample_corpus_dir() / "train.tsv").read_text(encoding="utf-8").splitlines()
    train = [line.split("\t")[:2] for line in lines[:160]]
    torch.manual_seed(0)
    config = DeepNMTConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = MODEL_CLASSES[DeepNMTConfig](config)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    for step in range(120):
        batch = [train[(step * 16 + i) % len(train)] for i in range(16)]
        encoded = tokenizer(
            [s for s, _ in batch], text_target=[t for _, t in batch], padding=True, return_tensors="pt"
        )
        encoded["labels"][encoded["labels"] == tokenizer.pad_token_id] = -100
        loss = model(**encoded).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _export_small_model(folder: Path, tokenizer_folder: Path) -> None:
    """`_train_small_model` with the tokenizer of `tokenizer_folder` and 2 beams, saved to `folder/repo` with its
    tokenizer, whose graphs `export-onnx --into-model --int8` writes; the command's exit code and the warnings it
    logged, in `folder/export.json`."""
    import json
    import logging

    from transformers import AutoTokenizer

    from hf_deep_nmt.cli import main
    from hf_deep_nmt.hub import export_hub_folder

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    model = _train_small_model(tokenizer)
    model.generation_config.num_beams = 2
    repo = export_hub_folder(model, tokenizer, folder / "repo", repo_id="org/small")
    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # what caplog.at_level(logging.WARNING) sets
    try:
        code = main(["export-onnx", "--model", str(repo), "--into-model", "--int8"])
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    (folder / "export.json").write_text(json.dumps({"code": code, "warnings": logged}))


@pytest.fixture(scope="session")
def small_onnx_export(tmp_path_factory, sample_slice):
    """`(folder, model, tokenizer, export)`: `_train_small_model` (a trained plain post-norm model, 1+1 layers,
    2 beams) saved to `folder` with the tokenizer of `sample_slice(160, 300)`, and its graphs in `folder/onnx` (fp32
    and int8, with the tokenizer), written by `export-onnx --into-model --int8`; `export` holds that command's exit
    code (`code`) and the warnings it logged (`warnings`); the model and tokenizer are read back from `folder`.
    Shared by the whole session, every pytest-xdist worker included (`shared_session_folder`): an ONNX export costs
    8-16 CPU s, almost all in torch's exporter, and the training 6 more, and tests/test_onnx_decoding.py (int8 and
    the plain post-norm model's exactness), test_onnx_translate.py and test_onnx_integrity.py each need such a model
    exported. Read it, never write into it (copy it first)."""
    import json

    from transformers import AutoTokenizer

    from hf_deep_nmt import DeepNMTForConditionalGeneration

    def build(folder):
        _export_small_model(folder, sample_slice(160, 300) / "tokenizer")

    shared = shared_session_folder(tmp_path_factory, "small-onnx-export", build)
    folder = shared / "repo"
    model = DeepNMTForConditionalGeneration.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return folder, model, tokenizer, json.loads((shared / "export.json").read_text())
