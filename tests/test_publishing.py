"""Publishing through huggingface_hub (offline: exactly which files would be uploaded, what is refused).

The exported folder is the `tiny_export` fixture of conftest.py."""

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete

from hf_deep_nmt.cli import main
from hf_deep_nmt.hub import push_to_hub, upload_operations


class FakeApi:
    """Stands in for `HfApi`: records the calls, holds the files of an existing repository."""

    def __init__(self, existing: list[str] | None = None):
        self.existing, self.calls = existing, []

    def repo_exists(self, repo_id, repo_type=None):
        return self.existing is not None

    def list_repo_files(self, repo_id, repo_type=None):
        return list(self.existing)

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", repo_id, operations))
        return "commit-url"


EXPORTED_FILES = [
    "README.md",
    "config.json",
    "configuration_deep_nmt.py",
    "contract_deep_nmt.py",
    "generation_config.json",
    "kernels_deep_nmt.py",
    "model.safetensors",
    "modeling_deep_nmt.py",
    "sizes_deep_nmt.py",
    "tokenizer.json",
    "tokenizer_config.json",
]


def test_push_uploads_exactly_the_exported_files_in_one_commit(tiny_export):
    folder = tiny_export[0]
    (folder / ".cache").mkdir(exist_ok=True)
    (folder / ".cache" / "lock").write_text("")  # hidden files never travel
    api = FakeApi()
    assert push_to_hub(folder, "org/tiny", private=True, api=api) == "commit-url"
    (create, repo_id, kwargs), (commit, _, operations) = api.calls
    assert (create, repo_id, kwargs["private"], commit) == ("create_repo", "org/tiny", True, "create_commit")
    assert all(isinstance(operation, CommitOperationAdd) for operation in operations)
    assert [operation.path_in_repo for operation in operations] == EXPORTED_FILES
    weights = next(operation for operation in operations if operation.path_in_repo == "model.safetensors")
    assert weights.path_or_fileobj == str(folder / "model.safetensors")


def test_push_refuses_a_repository_with_files_unless_asked(tiny_export):
    folder = tiny_export[0]
    api = FakeApi(existing=[".gitattributes", "model.safetensors", "old_weights.bin"])
    with pytest.raises(FileExistsError, match=r"'org/tiny' already holds 2 file\(s\).*overwrite=True"):
        push_to_hub(folder, "org/tiny", api=api)
    assert api.calls == []
    push_to_hub(folder, "org/tiny", api=api, overwrite=True)
    [(_, _, operations)] = api.calls
    deleted = [op.path_in_repo for op in operations if isinstance(op, CommitOperationDelete)]
    assert deleted == ["old_weights.bin"]  # stale files go in the same commit; .gitattributes stays
    assert push_to_hub(folder, "org/empty", api=FakeApi(existing=[".gitattributes"])) == "commit-url"


def test_push_needs_an_exported_folder(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="not an exported model folder"):
        upload_operations(tmp_path)
    assert main(["push", "--model", str(tmp_path), "--repo-id", "org/x", "--dry-run"]) == 2


def test_push_dry_run_lists_the_files(tiny_export, capsys):
    assert main(["push", "--model", str(tiny_export[0]), "--repo-id", "org/tiny", "--dry-run"]) == 0
    assert capsys.readouterr().out.split() == EXPORTED_FILES
