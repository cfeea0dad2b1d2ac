"""`hf-deep-nmt upgrade-code`: a folder (or Hub repository) published with the 0.1.0 model code is brought to the
installed code, checked in clean processes before anything is written, weights and tokenizer untouched, the replaced
files kept; a check that fails writes nothing; a repository gets one code-only commit."""

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from huggingface_hub import constants

from hf_deep_nmt import DlclConfig, DsInitConfig, MscConfig, __version__
from hf_deep_nmt.cli import main
from hf_deep_nmt.data.tokenizer import train_joint_tokenizer
from hf_deep_nmt.hub import WRITTEN_MARKER, export_hub_folder, files_not_written_by_us
from hf_deep_nmt.tools import upgrade_code
from hf_deep_nmt.tools.upgrade_code import (
    BACKUP_FOLDER,
    CODE_FILES,
    RemoteCodeNotTrusted,
    UpgradeCheckFailed,
    UpgradeReport,
    check_inputs,
    compare,
    decode_in_clean_process,
    installed_code_folder,
    upgrade_folder,
    upgrade_repo,
)

PUBLISHED_0_1_0 = Path(__file__).parent / "fixtures" / "published_code_0_1_0"  # modeling/ at the 0.1.0 release
INSTALLED = tuple(int(part) for part in transformers.__version__.split(".")[:2])
PAIRS = [("el sol sale", "the sun rises"), ("la mar no se llena", "the sea is not full"), ("hola mundo", "hi")]


def contents(folder: Path) -> dict[str, bytes]:
    return {
        path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()
    }


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def forked_checks(clean_python, monkeypatch):
    """The check's clean processes forked from a server that imported torch and transformers (never this package):
    the same script, arguments, working folder and environment, without an interpreter's start each (17 of them in
    this file, 3 CPU s each). `decode_in_clean_process` in a fresh interpreter, as the library starts it, stays checked
    once, in the MSC case below."""
    monkeypatch.setattr(upgrade_code, "subprocess", SimpleNamespace(run=clean_python.run, DEVNULL=subprocess.DEVNULL))


@pytest.fixture(scope="module")
def tokenizer():
    return train_joint_tokenizer(PAIRS * 20, vocab_size=60, min_frequency=1)


# Not a table of today's methods: models that the 0.1.0 code can run (it had no SDT relative keys, no DeepNorm), one
# per kind of layer it shipped (MAtt, MSC's context cache, DLCL post-norm under its 0.1.0 key)
FAMILIES = {
    "dsinit": (DsInitConfig, {}),
    "msc": (MscConfig, {"msc_block_layers": [2, 1]}),
    "dlcl-postnorm": (DlclConfig, {"normalize_before": False}),
}


@pytest.fixture
def publish(tmp_path, tiny_config, random_model, tokenizer):
    """`publish(family)`: an export whose model code is the 0.1.0 release's, as every folder pushed with 0.1.0 holds
    it."""

    def make(family: str) -> Path:
        config_class, overrides = FAMILIES[family]
        model = random_model(tiny_config(config_class, vocab_size=len(tokenizer), **overrides), scale=0.5)
        folder = export_hub_folder(model, tokenizer, tmp_path / f"published-{family}")
        for name in CODE_FILES:  # 0.1.0 shipped two of today's code files, and its marker listed those only
            if (PUBLISHED_0_1_0 / name).is_file():
                shutil.copyfile(PUBLISHED_0_1_0 / name, folder / name)
            else:
                (folder / name).unlink()
        marker = json.loads((folder / WRITTEN_MARKER).read_text())
        marker["files"] = [name for name in marker["files"] if (folder / name).exists()]
        (folder / WRITTEN_MARKER).write_text(json.dumps(marker))
        return folder

    return make


@pytest.fixture
def published(publish):
    return publish("dsinit")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_folder_with_the_0_1_0_code_is_upgraded_and_decodes_the_same_cached_and_uncached(
    family, publish, tmp_path, monkeypatch
):
    published = publish(family)
    weights, tokenizer_file = digest(published / "model.safetensors"), digest(published / "tokenizer.json")
    card = (published / "README.md").read_bytes()
    report = upgrade_folder(published, num_checks=4, trust_remote_code=True)

    assert report.old_version == "0.1.0 or earlier" and report.new_version == __version__
    assert "modeling_deep_nmt.py" in report.changed and report.written
    assert {"kernels_deep_nmt.py", "contract_deep_nmt.py", "sizes_deep_nmt.py"} <= set(report.changed)  # 0.1.0 lacked
    for name in CODE_FILES:
        assert (published / name).read_bytes() == (installed_code_folder() / name).read_bytes()
    assert (
        digest(published / "model.safetensors") == weights and digest(published / "tokenizer.json") == tokenizer_file
    )
    assert (published / "README.md").read_bytes() == card
    # The replaced files are kept, listed by the marker: a later export may still replace the folder.
    backup = Path(report.backup)
    assert backup.parent == published / BACKUP_FOLDER
    assert (backup / "modeling_deep_nmt.py").read_bytes() == (PUBLISHED_0_1_0 / "modeling_deep_nmt.py").read_bytes()
    assert files_not_written_by_us(published) == []
    # What the 0.1.0 code got wrong with the cache under this transformers: 5.24 passes the state as `cache`, which
    # that code ignored (beam search then decodes from the last token alone); 5.23 still passed `past_key_values`.
    if INSTALLED >= (5, 24):
        assert report.old_cached_wrong["beam4"] > 0
    else:
        assert report.old_cached_wrong == {"greedy": 0, "beam4": 0}

    again = upgrade_folder(published)  # nothing to change: no check, so no code runs and no consent is needed
    assert again.changed == [] and not again.written and again.old_version == __version__
    if family != "msc":
        return  # the command's check is the same code for every family: checked independently once, on MSC's cache
    # Checked again here, independently of the command's own check: the upgraded folder, as remote code, in a fresh
    # interpreter started as the library starts it.
    monkeypatch.setattr(upgrade_code, "subprocess", subprocess)
    inputs = tmp_path / "inputs.pt"
    torch.save(check_inputs(json.loads((published / "config.json").read_text()), 3, seed=7), inputs)
    work = tmp_path / "work"
    work.mkdir()
    decoded = decode_in_clean_process(published, inputs, work, "after")
    assert decoded["greedy-cached"] == decoded["greedy-uncached"]
    assert decoded["beam4-cached"] == decoded["beam4-uncached"]


def test_the_folders_code_runs_only_with_consent_and_a_dry_run_writes_nothing(published, tmp_path, monkeypatch):
    """A line added to the folder's model code writes a file when that code runs: without `trust_remote_code` the
    upgrade (a dry run too) is refused before anything runs; with it, a dry run named by a relative path (the check's
    processes run elsewhere: the path must still name this folder, not a Hub id) runs it and writes nothing."""
    ran = tmp_path / "the-folders-code-ran"
    with open(published / "modeling_deep_nmt.py", "a", encoding="utf-8") as handle:
        handle.write(f"\nopen({str(ran)!r}, 'a').close()\n")
    before = contents(published)
    for dry_run in (True, False):
        with pytest.raises(RemoteCodeNotTrusted) as refused:
            upgrade_folder(published, dry_run=dry_run, num_checks=2)
        assert str(refused.value) == (
            f"Checking the upgrade of {published} runs its own model code (configuration_deep_nmt.py, "
            "modeling_deep_nmt.py: 0.1.0 or earlier) in a separate process, to compare its translations with "
            "the new code's; a dry run runs it too. Allow it only for a model you trust: add --trust-remote-code "
            "(trust_remote_code=True from Python). Nothing ran and nothing was written."
        )
    assert not ran.exists() and contents(published) == before

    monkeypatch.chdir(published.parent)
    report = upgrade_folder(published.name, dry_run=True, num_checks=2, trust_remote_code=True)
    assert ran.exists()  # the old code ran, in the check, because it was allowed to
    assert "modeling_deep_nmt.py" in report.changed and not report.written
    assert contents(published) == before
    assert "dry run: nothing written or pushed" in report.lines()
    assert report.old_cached_wrong.keys() == {"greedy", "beam4"}  # compared with the old code's decoding


def test_a_comparison_that_could_not_run_is_a_failure_never_a_pass():
    """What the relative path once gave: the old code's process could not load the folder (it read the path as a Hub
    id, offline), and the check reported a pass. Neither a load that failed nor an uncached decoding that failed
    leaves anything to compare with."""
    decoded = [[2, 5, 6, 2]]
    new = {f"{name}-{kind}": decoded for name in ("greedy", "beam4") for kind in ("cached", "uncached")}
    report = UpgradeReport(source="up/v010-dsinit", old_version="0.1.0 or earlier", new_version=__version__)
    not_loaded = {"error": "loading failed: OSError: up/v010-dsinit is not a local folder"}
    with pytest.raises(
        UpgradeCheckFailed,
        match=r"^the check could not compare the new code with the old code of up/v010-dsinit, which failed here "
        r"\(loading failed: OSError: up/v010-dsinit is not a local folder\); nothing was written\. If that code",
    ):
        compare(not_loaded, new, report)
    beam_failed = {**new, "beam4-uncached": "RuntimeError: shapes"}
    with pytest.raises(UpgradeCheckFailed, match=r"which failed here \(beam4 uncached: RuntimeError: shapes\)"):
        compare(beam_failed, new, report)
    assert report.old_cached_wrong == {}
    compare({**new, "beam4-cached": "TypeError: cache"}, new, report)  # the cached one may fail: it is what is mended
    assert report.old_cached_wrong == {"greedy": 0, "beam4": 1}


def test_a_failing_check_writes_nothing(published, tmp_path, monkeypatch):
    """New code that decodes differently (here: token 7 forced at every step) is refused; the folder is untouched."""
    broken = tmp_path / "broken_code"
    broken.mkdir()
    for name in CODE_FILES:
        shutil.copyfile(installed_code_folder() / name, broken / name)
    with open(broken / "modeling_deep_nmt.py", "a", encoding="utf-8") as handle:
        handle.write(
            "\n\ndef _force_token(module, args, output):\n"
            "    output.logits[..., 7] += 1000.0\n"
            "    return output\n\n\n"
            "_init = DeepNMTForConditionalGeneration.__init__\n\n\n"
            "def _init_forcing(self, *args, **kwargs):\n"
            "    _init(self, *args, **kwargs)\n"
            "    self.register_forward_hook(_force_token)\n\n\n"
            "DeepNMTForConditionalGeneration.__init__ = _init_forcing\n"
        )
    monkeypatch.setattr("hf_deep_nmt.tools.upgrade_code.installed_code_folder", lambda: broken)
    before = contents(published)
    with pytest.raises(
        UpgradeCheckFailed, match="decodes 2 inputs differently from the old code.*nothing was written"
    ):
        upgrade_folder(published, num_checks=2, trust_remote_code=True)
    assert contents(published) == before


def test_bad_sources_are_named(tmp_path, tiny_config, random_model):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        upgrade_folder(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        upgrade_folder(tmp_path / "file")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text(json.dumps({"model_type": "marian"}))
    with pytest.raises(ValueError, match="model_type 'marian', not one of hf-deep-nmt's .*deep_nmt"):
        upgrade_folder(foreign)
    (foreign / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        upgrade_folder(foreign)
    without_code = tmp_path / "without_code"
    random_model(tiny_config(DlclConfig)).save_pretrained(without_code)
    for name in CODE_FILES:
        (without_code / name).unlink()
    with pytest.raises(ValueError, match="holds no model code .*modeling_deep_nmt.py"):
        upgrade_folder(without_code)


class RecordingApi:
    def __init__(self):
        self.commits = []

    def create_commit(self, repo_id, **kwargs):
        self.commits.append((repo_id, kwargs))
        return SimpleNamespace(commit_url=f"https://hub.example/{repo_id}/commit/1")


def test_a_hub_repository_gets_one_code_only_commit_on_top_of_the_checked_one(published, hub_cache):
    repo_id = f"org/upgrade-{published.parent.name}"
    snapshot = hub_cache(published, constants.HF_HUB_CACHE, repo_id)
    api = RecordingApi()

    with pytest.raises(ConnectionError, match="offline mode is on"):  # without a Hub, only a dry run
        upgrade_repo(repo_id, num_checks=2, trust_remote_code=True)
    assert api.commits == []
    with pytest.raises(RemoteCodeNotTrusted, match=f"^Checking the upgrade of {repo_id} runs its own model code"):
        upgrade_repo(repo_id, num_checks=2, dry_run=True, api=api)
    dry = upgrade_repo(repo_id, num_checks=2, dry_run=True, api=api, trust_remote_code=True)
    assert api.commits == [] and "modeling_deep_nmt.py" in dry.changed

    report = upgrade_repo(repo_id, num_checks=2, api=api, trust_remote_code=True)
    [(pushed_to, commit)] = api.commits
    assert pushed_to == repo_id and commit["parent_commit"] == snapshot.name and commit["repo_type"] == "model"
    uploaded = {operation.path_in_repo: operation.path_or_fileobj for operation in commit["operations"]}
    assert set(uploaded) == set(report.changed) and "model.safetensors" not in uploaded
    assert uploaded["modeling_deep_nmt.py"] == (installed_code_folder() / "modeling_deep_nmt.py").read_bytes()
    assert report.commit == f"https://hub.example/{repo_id}/commit/1"
    assert (snapshot / "modeling_deep_nmt.py").read_bytes() == (PUBLISHED_0_1_0 / "modeling_deep_nmt.py").read_bytes()


def test_the_command_line_reports_the_upgrade(published, capsys):
    assert main(["upgrade-code", "--model", str(published), "--dry-run", "--num-checks", "2"]) == 2
    error = capsys.readouterr().err
    assert "runs its own model code" in error and "add --trust-remote-code" in error and "Nothing ran" in error
    assert (
        main(["upgrade-code", "--model", str(published), "--dry-run", "--num-checks", "2", "--trust-remote-code"]) == 0
    )
    out = capsys.readouterr().out
    assert f"model code 0.1.0 or earlier -> {__version__}" in out and "dry run" in out
    assert main(["upgrade-code", "--model", str(published), "--num-checks", "0"]) == 2
    assert "--num-checks" in capsys.readouterr().err


def test_a_repository_that_cannot_be_fetched_is_named():
    with pytest.raises(FileNotFoundError, match="'org/never-cached' is not a local folder .* could not be fetched"):
        upgrade_repo("org/never-cached", dry_run=True)
