"""Folder safety in one place: nothing a user saved is lost or silently overwritten.

An export, an average, a conversion or a CTranslate2 folder is written beside its final place and swapped in
(`write_marked_folder`), with a marker listing every file written (`WRITTEN_MARKER`); an existing folder is replaced
only when asked and only when the marker lists everything in it (`check_export_folder`). Run folders of `train` /
`train-staged` keep the same kind of list in their run record (`hf_deep_nmt.training.run_folder`), and
`overwrite_output_dir` removes only what it lists.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

# Written last into every folder an export or an average writes, listing the files written; only a folder whose every
# file it lists may be replaced (hidden, so never uploaded).
WRITTEN_MARKER = ".hf-deep-nmt-written.json"
EXPORT_FLAG = "`overwrite=True`, or `--overwrite-export true` on the command line"


def user_file_modes() -> tuple[int, int]:
    """(file mode, folder mode) a file / folder created by the user now would get: 0o666 / 0o777 less the umask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask, 0o777 & ~mask


@contextlib.contextmanager
def atomic_file(
    path: str | Path, mode: str = "w", *, replace: bool = True, keep_on_error: bool = False, **open_arguments
) -> Iterator[IO]:
    """`with atomic_file(path) as stream:` writes a temporary file beside `path` (`.NAME.XXXX.partial`, same folder, so
    same file system) and, when the block ends without an error, flushes it to disk, gives it the mode the replaced
    file had (a new file: the user's normal mode, umask) and renames it to `path` in one step: a reader, or a command
    interrupted meanwhile, sees the old file or the new one, never a truncated one. A symbolic link is replaced
    through (the file it names is). `replace=False`: only when nothing exists at `path` by then (`FileExistsError`
    otherwise, the temporary file removed). On an error the temporary file is removed (kept with `keep_on_error`; its
    path is `stream.name`) and `path` is untouched. A reader of the old file (`cat F | ... > F` done this way) keeps
    reading the old content."""
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    os.close(handle)
    stream = open(temporary, mode, **open_arguments)  # by name, so that `stream.name` names it
    try:
        yield stream
        stream.flush()
        os.fsync(stream.fileno())
        stream.close()
        try:
            file_mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            file_mode = user_file_modes()[0]
        os.chmod(temporary, file_mode)
        if replace:
            os.replace(temporary, target)
        else:  # a link fails when `target` exists, where a rename would replace it
            try:
                os.link(temporary, target)
            except FileExistsError:
                kept = f"; what was written is in {temporary}" if keep_on_error else ""
                raise FileExistsError(
                    f"{str(path)!r} was created by another program while this one wrote it: it is not replaced{kept}."
                ) from None
            except OSError:  # a file system without hard links: checked, then renamed (a narrow race remains)
                if os.path.lexists(target):
                    raise FileExistsError(
                        f"{str(path)!r} was created by another program while this one wrote it: it is not replaced."
                    ) from None
                os.replace(temporary, target)
            else:
                os.unlink(temporary)
    except BaseException:
        stream.close()
        if not keep_on_error:
            Path(temporary).unlink(missing_ok=True)
        raise


def write_json_atomically(path: str | Path, content: dict) -> None:
    """Write `content` to `path` as JSON through `atomic_file`: a reader sees the old record or the new one, never half
    of one (the checksum records of checkpoints, the stream position saved with them)."""
    with atomic_file(path, encoding="utf-8") as stream:
        json.dump(content, stream, indent=1, sort_keys=True)


def folder_entries(folder: Path) -> list[str]:
    """Every file, link and folder under `folder` as a relative POSIX path (links are not followed)."""
    entries = []
    for root, folders, files in os.walk(folder):
        base = Path(root).relative_to(folder)
        entries += [(base / name).as_posix() for name in [*folders, *files]]
    return sorted(entries)


def written_file_record(folder: str | Path, names) -> dict[str, dict]:
    """Size and SHA-256 of each file `names` (relative paths) of `folder`, as an export marker records them."""
    folder, record = Path(folder), {}
    for name in names:
        with (folder / name).open("rb") as handle:
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        record[name] = {"size": (folder / name).stat().st_size, "sha256": digest}
    return record


def record_written(folder: str | Path, names) -> None:
    """Add the files `names` of `folder` (as they are now) to its `WRITTEN_MARKER`: for a command that changes an
    export in place (`upgrade-code`), so that a later export may still replace what it wrote."""
    folder = Path(folder)
    marker = json.loads((folder / WRITTEN_MARKER).read_text(encoding="utf-8"))
    names = sorted(set(names))
    marker["files"] = sorted(set(marker.get("files") or []) | set(names))
    if isinstance(marker.get("checksums"), dict):
        marker["checksums"].update(written_file_record(folder, names))
    with atomic_file(folder / WRITTEN_MARKER, encoding="utf-8") as stream:
        stream.write(json.dumps(marker, indent=2) + "\n")


def changed_since_written(folder: str | Path) -> list[str]:
    """Files the `WRITTEN_MARKER` of `folder` lists whose size or SHA-256 is not the one it recorded (a file edited
    or replaced since, or a name added to the list by hand): they are not the files the export wrote. Empty for a
    marker of an earlier version, which recorded no checksums."""
    return _marker_entries(Path(folder))[1]


def _marker_entries(folder: Path) -> tuple[set[str], list[str]]:
    """(the files the marker of `folder` vouches for, the listed ones that do not match their record)."""
    try:
        marker = json.loads((folder / WRITTEN_MARKER).read_text(encoding="utf-8"))
        listed = set(marker["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return set(), []
    checksums = marker.get("checksums")
    if checksums is None:  # written before markers recorded checksums: the list is all there is
        return listed, []
    if not isinstance(checksums, dict):
        return set(), sorted(listed)
    vouched, changed = set(), []
    for name in sorted(listed):
        path, entry = folder / name, checksums.get(name)
        if not path.is_file() or path.is_symlink():
            vouched.add(name)  # gone, or not a file: nothing of the user's to lose under this name
            continue
        matches = isinstance(entry, dict) and entry.get("size") == path.stat().st_size
        if matches and entry.get("sha256") == written_file_record(folder, [name])[name]["sha256"]:
            vouched.add(name)
        else:
            changed.append(name)
    return vouched, changed


def files_not_written_by_us(folder: str | Path) -> list[str]:
    """Entries of `folder` that no export or average of this package wrote there (per its `WRITTEN_MARKER`); every
    entry when there is no readable marker. A listed file whose size or SHA-256 differs from what the marker recorded
    (`changed_since_written`) counts as not written by us: it is never removed."""
    folder = Path(folder)
    entries = [entry for entry in folder_entries(folder) if entry != WRITTEN_MARKER]
    written = _marker_entries(folder)[0]
    parents = {parent.as_posix() for name in written for parent in Path(name).parents if parent != Path(".")}
    return [entry for entry in entries if entry not in written | parents]


def nearest_existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable_location(folder: str | Path, what: str) -> None:
    """`PermissionError` naming `what` when `folder` (or the folder it would be created in) cannot be written."""
    existing = nearest_existing_parent(Path(folder))
    if not existing.is_dir():
        raise NotADirectoryError(f"{what} {str(folder)!r} cannot be created: {str(existing)!r} is a file.")
    writable = os.access(existing, os.W_OK | os.X_OK)
    if writable:  # access() says yes to root even on read-only mounts: try it
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hf-deep-nmt-probe.", dir=existing))
        except OSError:
            writable = False
    if not writable:
        raise PermissionError(
            f"{what} {str(folder)!r} cannot be written: {str(existing)!r} is not writable by this user; choose "
            "another folder."
        )


def check_apart(folder: str | Path, sources: dict[str, str | Path]) -> None:
    """`ValueError` when `folder` is inside one of the `sources` (description -> path: the model folder a command
    reads) or holds one: the result would become part of the folder it is made from (uploaded by `push` with it, in
    the way of the folder's next export) or take it along when replaced. The folders themselves are left to the
    caller (`check_export_folder`'s `protected`)."""
    folder = Path(folder)
    for description, path in sources.items():
        source, target = Path(path).resolve(), folder.resolve()
        if target != source and source in target.parents:
            raise ValueError(
                f"{str(folder)!r} is inside {description} {str(path)!r}: the result would become part of the folder "
                f"it is made from (uploaded with it by `push`, in the way of its next export); write it beside it, "
                f"e.g. {str(source.parent / (source.name + '-' + target.name))!r}."
            )
        if target in source.parents:
            raise ValueError(
                f"{str(folder)!r} holds {description} {str(path)!r}: replacing it would take that folder along; write "
                "the result to a folder of its own."
            )


def check_export_folder(
    folder: str | Path,
    overwrite: bool = False,
    *,
    flag: str = EXPORT_FLAG,
    protected: dict[str, str | Path] | None = None,
    sources: dict[str, str | Path] | None = None,
) -> None:
    """Refuse, before any work, a folder an export (or an average) must not write to.

    `FileExistsError` when `folder` exists and is not empty, unless `overwrite` (`flag` names how to ask for it); even
    then when it holds anything an earlier export or average of this package did not write (corpus files,
    checkpoints, unknown files). `ValueError` when it is one of the `protected` folders (description -> path, e.g. the
    Trainer output folder, the corpus folder, the inputs of the command), and when it is inside one of the `sources`
    (description -> path: the model folder a conversion reads) or holds one: the result would become part of the
    folder it is made from (uploaded by `push` with it, in the way of the folder's next export) or take it along when
    replaced. `PermissionError` when it cannot be written.
    """
    folder = Path(folder)
    here = Path.cwd().resolve()
    if folder.resolve() == here or folder.resolve() in here.parents:
        raise ValueError(
            f"{str(folder)!r} is the current folder ({here}) or a folder above it: the result replaces its folder as "
            f"a whole; name a new folder for it (e.g. {str(folder / 'export')!r})."
        )
    for description, path in (protected or {}).items():
        if folder.resolve() == Path(path).resolve():
            raise ValueError(f"{str(folder)!r} is {description}; write the result to a folder of its own.")
    check_apart(folder, sources or {})  # after the exact matches above, whose messages say more
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{str(folder)!r} is a file, not a folder; choose a folder for the result.")
    if folder.is_dir() and any(folder.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"Export folder {str(folder)!r} exists and is not empty; choose another folder, or ask to replace it "
                f"({flag})."
            )
        unknown = files_not_written_by_us(folder)
        if unknown:
            changed = [name for name in changed_since_written(folder) if name in unknown]
            why = (
                f"; {changed[:5]} {'is' if len(changed) == 1 else 'are'} listed by its {WRITTEN_MARKER} but changed "
                "since the export wrote it (size or SHA-256)"
                if changed
                else ""
            )
            raise FileExistsError(
                f"{str(folder)!r} holds files that no export or average of hf-deep-nmt wrote ({unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''}{why}), so it is never replaced, not even when asked; they are "
                "kept. Choose another folder, or move those files away first."
            )
    check_writable_location(folder, "Export folder")


def write_marked_folder(
    folder: str | Path,
    write,
    *,
    overwrite: bool = False,
    flag: str = EXPORT_FLAG,
    protected: dict[str, str | Path] | None = None,
) -> Path:
    """Call `write(staging_folder)`, list what it wrote in `WRITTEN_MARKER`, give every file the user's normal mode
    (umask) and swap the folder into `folder`: a failure never leaves a half-written or half-deleted folder, and an
    earlier result is replaced only after `check_export_folder` allowed it (checked again just before the swap)."""
    folder = Path(folder)
    check_export_folder(folder, overwrite, flag=flag, protected=protected)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write(staging)
        written = folder_entries(staging)
        files = [name for name in written if (staging / name).is_file()]
        checksums = written_file_record(staging, [name for name in files if not (staging / name).is_symlink()])
        marker = {"written_by": "hf-deep-nmt", "files": files, "checksums": checksums}
        (staging / WRITTEN_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        file_mode, folder_mode = user_file_modes()
        for name in [*written, WRITTEN_MARKER]:
            (staging / name).chmod(folder_mode if (staging / name).is_dir() else file_mode)
        staging.chmod(folder_mode)
        if folder.exists():
            check_export_folder(folder, overwrite, flag=flag, protected=protected)
            retired = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            folder.rename(retired / folder.name)
            try:
                staging.rename(folder)
            except BaseException:  # interrupted between the two renames: the earlier result goes back
                (retired / folder.name).rename(folder)
                retired.rmdir()
                raise
            shutil.rmtree(retired)
        else:
            staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return folder


def check_run_folders(output_dir: str, export_dir: str | None, corpus_files: list[str]) -> dict[str, Path]:
    """Refuse an export folder that is the output folder, holds it, or is a corpus folder, and an output or export
    folder that cannot be written. Returns the folders an export must never replace (for `check_export_folder`)."""
    output = Path(output_dir).resolve()
    protected = {f"the training output_dir ({output_dir!r}), which holds the checkpoints": output}
    for corpus in corpus_files:
        protected[f"the folder of the corpus file {corpus!r}"] = Path(corpus).resolve().parent
    if export_dir:
        export = Path(export_dir).resolve()
        for description, folder in protected.items():
            if export == folder:
                raise ValueError(f"export_dir {export_dir!r} is {description}; give the export a folder of its own.")
        if export in output.parents:
            raise ValueError(
                f"output_dir {output_dir!r} is inside export_dir {export_dir!r}: an overwritten export would take the "
                "checkpoints with it; give the two separate folders."
            )
    check_writable_location(output_dir, "output_dir")
    return protected


def path_kind(path: Path) -> str:
    """What `path` names, for the errors that say so: "file" (a regular file), "missing", "dangling" (a symbolic link
    to nothing), "loop" (links that lead back to themselves), "folder" or "special" (a FIFO, socket or device)."""
    if not os.path.lexists(path):
        return "missing"
    try:
        path.stat()
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "loop"
        if error.errno == errno.ENOENT:
            return "dangling"
        raise
    if path.is_dir():
        return "folder"
    return "file" if path.is_file() else "special"


def saved_weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a saved model folder (one, or the shards its index names)."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        return [folder / shard for shard in shards]
    return []
