"""`hf-deep-nmt upgrade-code`: bring the model code of an exported folder or a Hub repository to the installed version.

A folder exported by this package carries its modeling code (Hub remote code), and that code runs under whatever
transformers the user has. Code written before a transformers release can decode wrongly under it (0.1.0 ignored the
decoding state that transformers 5.24 passes as `cache`). This module rewrites the code files to the installed
package's (adding those a folder lacks), migrates `config.json` (loaded by the installed config class and saved again,
`auto_map` kept) and settles the output cap of `generation_config.json`; the weights, tokenizer, model card and the
export marker stay as they are.

Nothing is written before a check passes: in clean processes that cannot import this package (so the folder's own code
runs, as on a user's machine), the old and the new code decode the same inputs, greedy and with 4 beams, with and
without the cache; the new code's cached output must equal its uncached output and the old code's uncached output.
How many inputs the old code decoded wrongly with its cache is reported. A Hub repository is mended by one commit that
holds the changed code and config files only.

The check runs the folder's (or repository's) own model code, as `trust_remote_code=True` does in transformers, so it
runs only when the caller says so (`trust_remote_code=True`, `--trust-remote-code`), a dry run too; without it
`RemoteCodeNotTrusted` names the files that would run before anything runs. A check that could not run (the old code
does not load or decode here) is a failure, never a pass.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_deep_nmt.folders import WRITTEN_MARKER, check_writable_location, record_written
from hf_deep_nmt.model_folders import CODE_FILES
from hf_deep_nmt.model_folders import check_model_folder as check_folder

CONFIG_FILES = ("config.json", "generation_config.json")
BACKUP_FOLDER = ".hf-deep-nmt-upgrade-backup"  # hidden: never uploaded by `push`
DEFAULT_NUM_CHECKS = 4
CHECK_NEW_TOKENS = 12
DECODINGS = ("greedy", "beam4")


class UpgradeCheckFailed(RuntimeError):
    """The upgraded code does not decode like the code it replaces, or the comparison could not run (nothing was
    written)."""


class RemoteCodeNotTrusted(ValueError):
    """The check would run a folder's own model code, which the caller did not allow (nothing ran)."""


@dataclass
class UpgradeReport:
    source: str
    old_version: str
    new_version: str
    changed: list[str] = field(default_factory=list)
    inputs_checked: int = 0
    old_cached_wrong: dict[str, int] = field(default_factory=dict)  # decoding -> inputs the old cache got wrong
    backup: str | None = None
    commit: str | None = None
    written: bool = False

    def lines(self) -> list[str]:
        lines = [f"{self.source}: model code {self.old_version} -> {self.new_version}"]
        if not self.changed:
            return [*lines, "already current: nothing to change"]
        lines.append("files: " + ", ".join(self.changed))
        for decoding, wrong in self.old_cached_wrong.items():
            lines.append(
                f"{decoding}: the old code's cached decoding differed from its uncached decoding on {wrong} of "
                f"{self.inputs_checked} inputs"
            )
        lines.append(
            f"check passed: the new code, cached and uncached, decodes the {self.inputs_checked} inputs (greedy, 4 "
            "beams) as the old code does without its cache"
        )
        if self.backup:
            lines.append(f"the replaced files are kept in {self.backup}")
        if self.commit:
            lines.append(f"pushed: {self.commit}")
        if not self.written and not self.commit:
            lines.append("dry run: nothing written or pushed")
        return lines


def installed_code_folder() -> Path:
    import hf_deep_nmt.modeling.modeling_deep_nmt as modeling

    return Path(modeling.__file__).parent


def code_version(modeling_file: Path) -> str:
    """The hf-deep-nmt release a modeling file belongs to (its `CODE_VERSION`); files before 0.2.0 carry none."""
    match = re.search(r'^CODE_VERSION = "([^"]+)"', modeling_file.read_text(encoding="utf-8"), re.MULTILINE)
    return match.group(1) if match else "0.1.0 or earlier"


def check_model_folder(folder: Path) -> dict:
    """The config of an exported folder of this package, or a clear error about why `folder` is not one
    (`hf_deep_nmt.model_folders.check_model_folder` with its code required)."""
    check_folder(
        folder, hub_ids=False, own_code=True, config_hint="name an exported model folder or a Hub repository id"
    )
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def write_new_files(old: Path, new: Path) -> None:
    """Fill the empty folder `new` with the installed code, the migrated configs and links to every other file of
    `old` (weights, tokenizer, card), for the check."""
    from transformers import AutoConfig, GenerationConfig

    from hf_deep_nmt import registration  # noqa: F401  (registers the config classes)
    from hf_deep_nmt.hub import settle_output_cap

    for name in os.listdir(old):
        if name not in (*CODE_FILES, *CONFIG_FILES) and not name.startswith("."):
            (new / name).symlink_to((old / name).resolve())
    saved = json.loads((old / "config.json").read_text(encoding="utf-8"))
    # The installed class reads the fields of older releases; saved again, they are in today's form.
    AutoConfig.from_pretrained(old).save_pretrained(new)
    migrated = json.loads((new / "config.json").read_text(encoding="utf-8"))
    for key in ("auto_map", "architectures"):  # what the model's save wrote, which a config alone does not know
        if key in saved:
            migrated[key] = saved[key]
    (new / "config.json").write_text(json.dumps(migrated, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name in CODE_FILES:
        shutil.copyfile(installed_code_folder() / name, new / name)
    if (old / "generation_config.json").is_file():
        generation = settle_output_cap(GenerationConfig.from_pretrained(old))
        generation.save_pretrained(new)


CHECK_SCRIPT = r"""
import json
import os
import sys

sys.modules["hf_deep_nmt"] = None  # the folder's own code must run, as on a machine without this package

import torch
from transformers import AutoModelForSeq2SeqLM

folder, inputs_file, out_file, new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
inputs = torch.load(inputs_file, weights_only=True)
results = {}
try:
    if not os.path.isdir(folder):  # never a Hub id: the folder named is the one to check
        raise FileNotFoundError(f"no folder {folder!r}")
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True, local_files_only=True).eval()
except Exception as error:
    results["error"] = f"loading failed: {type(error).__name__}: {error}"
else:
    for name, beams in (("greedy", 1), ("beam4", 4)):
        for cached in (True, False):
            key = f"{name}-{'cached' if cached else 'uncached'}"
            try:
                with torch.no_grad():
                    out = model.generate(
                        **inputs, num_beams=beams, do_sample=False, use_cache=cached, max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens // 2,
                    )
                results[key] = out.tolist()
            except Exception as error:
                results[key] = f"{type(error).__name__}: {error}"
with open(out_file, "w") as handle:
    json.dump(results, handle)
"""


def check_inputs(config: dict, count: int, seed: int = 0) -> dict:
    """`count` padded source rows of seeded random tokens (special tokens left out), lengths 3 to 12, each ending
    in `</s>`."""
    import torch

    pad, eos = config.get("pad_token_id", 1), config.get("eos_token_id", 2)
    special = {pad, eos, config.get("bos_token_id"), config.get("decoder_start_token_id"), config.get("unk_token_id")}
    vocab = config.get("source_vocab_size") or config.get("vocab_size")
    allowed = torch.tensor([token for token in range(vocab) if token not in special])
    generator = torch.Generator().manual_seed(seed)
    lengths = [3 + (5 * row) % 10 for row in range(count)]
    rows = torch.full((count, max(lengths)), pad)
    for row, length in enumerate(lengths):
        picks = torch.randint(len(allowed), (length - 1,), generator=generator)
        rows[row, : length - 1] = allowed[picks]
        rows[row, length - 1] = eos
    return {"input_ids": rows, "attention_mask": rows.ne(pad).long()}


def decode_in_clean_process(folder: Path, inputs_file: Path, work: Path, label: str) -> dict:
    """Decode the check inputs with `folder`'s own code in a process that cannot import this package, with a
    module cache of its own (so two copies of the code never meet)."""
    # absolute: the process runs in a folder of its own, where a relative path would name nothing (or a Hub id)
    folder, inputs_file, work = Path(folder).absolute(), Path(inputs_file).absolute(), Path(work).absolute()
    out_file = work / f"{label}.json"
    env = dict(os.environ, HF_MODULES_CACHE=str(work / f"modules-{label}"), HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    run_dir = work / f"cwd-{label}"
    run_dir.mkdir()
    completed = subprocess.run(
        [sys.executable, "-c", CHECK_SCRIPT, str(folder), str(inputs_file), str(out_file), str(CHECK_NEW_TOKENS)],
        cwd=run_dir,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    if completed.returncode != 0 or not out_file.is_file():
        tail = " ".join(completed.stderr.strip().splitlines()[-3:])
        raise UpgradeCheckFailed(f"the check of the {label} code could not run ({tail}); nothing was written.")
    return json.loads(out_file.read_text(encoding="utf-8"))


def compare(old: dict, new: dict, report: UpgradeReport) -> None:
    """Fill the report from the two decodings; `UpgradeCheckFailed` when the new code is not exact, or when the old
    code gave nothing to compare with (it did not load, or failed an uncached decoding): a comparison that could not
    run is never a pass."""
    if "error" in new:
        raise UpgradeCheckFailed(f"the upgraded folder does not load: {new['error']}; nothing was written.")
    unchecked = old.get("error") or "; ".join(
        f"{decoding} uncached: {old.get(f'{decoding}-uncached')}"
        for decoding in DECODINGS
        if not isinstance(old.get(f"{decoding}-uncached"), list)
    )
    if unchecked:
        raise UpgradeCheckFailed(
            f"the check could not compare the new code with the old code of {report.source}, which failed here "
            f"({unchecked}); nothing was written. If that code cannot run under this transformers at all, run "
            "upgrade-code where the transformers it was made for is installed."
        )
    problems = []
    for decoding in DECODINGS:
        cached, uncached = new[f"{decoding}-cached"], new[f"{decoding}-uncached"]
        for name, value in ((f"{decoding} cached", cached), (f"{decoding} uncached", uncached)):
            if isinstance(value, str):
                problems.append(f"the new code failed {name}: {value}")
        if problems:
            continue
        if cached != uncached:
            rows = sum(a != b for a, b in zip(cached, uncached))
            problems.append(f"{decoding}: the new code's cached and uncached decoding differ on {rows} inputs")
        reference = old[f"{decoding}-uncached"]
        if reference != uncached:
            rows = sum(a != b for a, b in zip(reference, uncached))
            problems.append(f"{decoding}: the new code decodes {rows} inputs differently from the old code")
        old_cached = old.get(f"{decoding}-cached")
        report.old_cached_wrong[decoding] = (
            len(reference) if not isinstance(old_cached, list) else sum(a != b for a, b in zip(old_cached, reference))
        )
    if problems:
        raise UpgradeCheckFailed("; ".join(problems) + "; nothing was written.")


def plan_and_check(
    old: Path, work: Path, num_checks: int, report: UpgradeReport, trust_remote_code: bool = False
) -> Path:
    """Write the upgraded files into `work/new`, check them against `old` (running `old`'s own code, only with
    `trust_remote_code`: else `RemoteCodeNotTrusted` before anything runs); returns `work/new`."""
    import torch

    config = check_model_folder(old)
    new = work / "new"
    new.mkdir()
    write_new_files(old, new)  # reads the folder's files; runs none of its code
    report.changed = [
        name
        for name in (*CODE_FILES, *CONFIG_FILES)
        if (new / name).is_file() and not ((old / name).is_file() and filecmp.cmp(old / name, new / name, False))
    ]
    if not report.changed:
        return new
    if trust_remote_code is not True:
        code = [name for name in CODE_FILES if (old / name).is_file()]
        raise RemoteCodeNotTrusted(
            f"Checking the upgrade of {report.source} runs its own model code ({', '.join(code)}: "
            f"{report.old_version}) in a separate process, to compare its translations with the new code's; a dry "
            "run runs it too. Allow it only for a model you trust: add --trust-remote-code (trust_remote_code=True "
            "from Python). Nothing ran and nothing was written."
        )
    inputs_file = work / "inputs.pt"
    torch.save(check_inputs(config, num_checks), inputs_file)
    report.inputs_checked = num_checks
    compare(
        decode_in_clean_process(old, inputs_file, work, "old"),
        decode_in_clean_process(new, inputs_file, work, "new"),
        report,
    )
    return new


def replace_in_folder(folder: Path, new: Path, report: UpgradeReport) -> None:
    """Swap the changed files into `folder` (each by an atomic rename), the replaced ones kept in a hidden backup
    folder that the export marker lists, so a later export with overwrite may still replace the folder."""
    check_writable_location(folder, "Model folder")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup = folder / BACKUP_FOLDER / f"{report.old_version.split()[0]}-{stamp}"
    backup.mkdir(parents=True)
    for name in report.changed:
        if (folder / name).exists():
            shutil.copy2(folder / name, backup / name)
    for name in report.changed:
        staged = folder / f".{name}.upgrade"
        shutil.copyfile(new / name, staged)
        if (folder / name).exists():
            shutil.copymode(folder / name, staged)
        os.replace(staged, folder / name)
    marker = folder / WRITTEN_MARKER
    if marker.is_file():
        try:
            readable = isinstance(json.loads(marker.read_text(encoding="utf-8"))["files"], list)
        except (ValueError, KeyError, TypeError):
            readable = False
        if readable:
            kept = [
                (backup / name).relative_to(folder).as_posix() for name in report.changed if (backup / name).exists()
            ]
            # a code file the folder lacked (`kernels_deep_nmt.py` in a 0.1.0 folder) is written by us now too; the
            # marker records their checksums, so that a later export may replace them (and only them)
            record_written(folder, [*kept, *report.changed])
    report.backup = str(backup)
    report.written = True


def upgrade_folder(
    folder: str | Path,
    *,
    num_checks: int = DEFAULT_NUM_CHECKS,
    dry_run: bool = False,
    trust_remote_code: bool = False,
) -> UpgradeReport:
    """Upgrade the model code of an exported folder in place (see the module docstring). The check runs the folder's
    own code: only with `trust_remote_code=True` (else `RemoteCodeNotTrusted`, nothing run), a dry run too."""
    folder = Path(folder).expanduser()
    check_model_folder(folder)
    report = _new_report(str(folder), folder)
    with tempfile.TemporaryDirectory(prefix="hf-deep-nmt-upgrade-") as work:
        new = plan_and_check(folder, Path(work), num_checks, report, trust_remote_code)
        if report.changed and not dry_run:
            replace_in_folder(folder, new, report)
    return report


def upgrade_repo(
    repo_id: str,
    *,
    num_checks: int = DEFAULT_NUM_CHECKS,
    dry_run: bool = False,
    revision: str | None = None,
    token: str | None = None,
    api=None,
    trust_remote_code: bool = False,
) -> UpgradeReport:
    """Upgrade the model code of a Hub repository by one commit holding only the changed code and config files
    (made on top of the commit that was checked, so a change pushed meanwhile is never overwritten). The check runs
    the repository's own code: only with `trust_remote_code=True` (else `RemoteCodeNotTrusted`), a dry run too."""
    from huggingface_hub import CommitOperationAdd, HfApi, constants, snapshot_download

    if not dry_run and api is None and constants.is_offline_mode():
        raise ConnectionError(
            "pushing needs the Hugging Face Hub, but offline mode is on (HF_HUB_OFFLINE is set); unset "
            "HF_HUB_OFFLINE, or check the upgrade with --dry-run."
        )
    try:
        snapshot = Path(snapshot_download(repo_id, revision=revision, token=token))
    except (OSError, ValueError) as error:  # the Hub unreachable, offline without a cached copy, no such repository
        reason = " ".join(str(error).split())
        raise FileNotFoundError(
            f"{repo_id!r} is not a local folder (no such folder: {Path(repo_id).absolute()}) and could not be fetched "
            f"as a Hub repository{f' at revision {revision!r}' if revision else ''}: {reason}"
        ) from error
    check_model_folder(snapshot)
    report = _new_report(repo_id, snapshot)
    with tempfile.TemporaryDirectory(prefix="hf-deep-nmt-upgrade-") as work:
        new = plan_and_check(snapshot, Path(work), num_checks, report, trust_remote_code)
        if report.changed and not dry_run:
            operations = [
                CommitOperationAdd(path_in_repo=name, path_or_fileobj=(new / name).read_bytes())
                for name in report.changed
            ]
            api = api or HfApi(token=token)
            parent = snapshot.name if re.fullmatch(r"[0-9a-f]{40}", snapshot.name) else None
            info = api.create_commit(
                repo_id,
                operations=operations,
                commit_message=f"Upgrade the model code to hf-deep-nmt {report.new_version}",
                commit_description="\n".join(report.lines()),
                repo_type="model",
                revision=revision,
                parent_commit=parent,
            )
            report.commit = str(getattr(info, "commit_url", info))
    return report


def _new_report(source: str, folder: Path) -> UpgradeReport:
    from hf_deep_nmt import __version__

    return UpgradeReport(
        source=source, old_version=code_version(folder / "modeling_deep_nmt.py"), new_version=__version__
    )
