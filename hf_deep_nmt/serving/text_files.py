r"""Text files in and out of `translate`, and the rules that keep what a user has: input split on `\n` alone and
checked to be UTF-8 text, an output path refused before any work when it is the input or an existing file (unless
asked), translations streamed in input order to a temporary file renamed into place when complete.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterable
from pathlib import Path

from hf_deep_nmt.folders import atomic_file, path_kind


def split_lines(text: str) -> list[str]:
    r"""Lines of `text` split on `\n` alone, so U+0085, U+2028, U+2029, form feed or `\x1c`-`\x1e` inside a line keep
    it one line (`str.splitlines` would split there). A final `\n` ends the last line rather than starting an empty
    one, and one `\r` before each `\n` (or at the very end) is dropped, so a CRLF file gives the same lines as its LF
    copy; a `\r` elsewhere stays in its line."""
    if not text:
        return []
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def decode_lines(data: bytes, name: str) -> list[str]:
    """`split_lines` of UTF-8 `data` (a leading byte-order mark dropped); `ValueError` naming `name`, the line and
    the byte offset of the first byte that is not UTF-8."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(
            f"{name} is UTF-16 text (it starts with a UTF-16 byte-order mark), not UTF-8; convert it first, keeping "
            "every character: `iconv -f UTF-16 -t UTF-8`."
        )
    if b"\0" in data:
        at = data.index(b"\0")
        line = data.count(b"\n", 0, at) + 1
        raise ValueError(
            f"{name} holds NUL bytes (the first at byte {at}, line {line}): UTF-16 text "
            "without a byte-order mark, or not text at all; convert UTF-16 to UTF-8 first (`iconv -f UTF-16LE -t "
            "UTF-8`, or UTF-16BE), or remove the NUL bytes (`tr -d '\\000'`)."
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{name} is not valid UTF-8: byte {error.start} (line {line}) is 0x{data[error.start]:02x} "
            f"({error.reason}); find its encoding (`file -i`) and convert it to UTF-8 first "
            "(`iconv -f ENCODING -t UTF-8`)."
        ) from None
    return split_lines(text.removeprefix("\ufeff"))


def read_lines(source: str | Path = "-") -> list[str]:
    """The lines of a UTF-8 text file (`-`: stdin), split as `split_lines` does. A missing path, a folder or
    anything but a regular file (a FIFO, a device) is refused naming it, as are bytes that are not UTF-8."""
    if str(source) == "-":
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream put in place of stdin
            return split_lines(sys.stdin.read().removeprefix("\ufeff"))
        return decode_lines(stream.read(), "stdin")
    path = Path(source)
    kind = path_kind(path)
    if kind == "missing":
        raise FileNotFoundError(f"input file not found: {source}")
    if kind == "loop":
        raise ValueError(
            f"input {source} is a loop of symbolic links (it leads back to itself); point the link at the text file."
        )
    if kind == "dangling":
        raise FileNotFoundError(f"input file not found: {source} is a symbolic link to a missing file")
    if kind == "folder":
        raise IsADirectoryError(f"input {source} is a folder, not a text file; name a file in it.")
    if kind == "special":
        raise ValueError(
            f"input {source} is not a regular file (a FIFO, socket or device); pass its text on stdin instead "
            f"(`--input -` and `< {source}`)."
        )
    try:
        data = path.read_bytes()
    except PermissionError:
        raise PermissionError(f"cannot read the input file {source}: permission denied.") from None
    return decode_lines(data, str(source))


def _same_file(first: Path, second: Path) -> bool:
    try:
        return os.path.samefile(first, second)
    except OSError:
        return first.resolve() == second.resolve()


def _stdin_is(path: Path) -> bool:
    """Whether stdin is the regular file `path` (`< path` on the command line): compared by device and inode, so that
    any name of the file counts."""
    try:
        stdin = os.fstat(sys.stdin.fileno())
        output = os.stat(path)
    except (OSError, AttributeError, ValueError):  # no stdin, a text stream put in its place, no such file
        return False
    return stat.S_ISREG(stdin.st_mode) and (stdin.st_dev, stdin.st_ino) == (output.st_dev, output.st_ino)


def check_output_path(target: str | Path, source: str | Path = "-", overwrite: bool = False) -> None:
    """Refuse an output path before any work: the input file itself (by any name: symbolic or hard link, relative
    path; the file stdin is read from when the input is `-`; even with `overwrite`), an existing file unless
    `overwrite`, a folder, a missing or unwritable folder. Devices and FIFOs (`/dev/null`) hold nothing that could be
    lost and are accepted."""
    if str(target) == "-":
        return
    path = Path(target)
    if str(source) != "-" and os.path.lexists(path) and _same_file(path, Path(source)):
        raise ValueError(
            f"output {target} is the input file {source}: the translations would replace the text being translated; "
            "write them to another file."
        )
    if str(source) == "-" and _stdin_is(path):
        raise ValueError(
            f"output {target} is the file stdin is read from (`< {target}`): the translations would replace the text "
            "being translated; write them to another file."
        )
    if path.is_dir():
        raise IsADirectoryError(f"output {target} is a folder; name a file (e.g. {path / 'translations.txt'}).")
    if os.path.lexists(path):
        if path.exists() and not stat.S_ISREG(path.stat().st_mode):
            return
        if not overwrite:
            raise FileExistsError(
                f"output file {target} exists; choose another name, or pass --overwrite (`overwrite=True`) to "
                "replace it."
            )
        if not os.access(path, os.W_OK):
            raise PermissionError(f"cannot write the output file {target}: permission denied.")
        return
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"the folder of output {target} does not exist ({folder}); create it first.")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create the output file {target}: the folder {folder} is not writable.")


class _OutputFile:
    """Opened at the first write, so that a run failing before its first translation creates no file. A file is
    written under a temporary name beside it and renamed into place once every line is written (`atomic_file`): an
    interrupted run never leaves a truncated file where a good one was, and a file being read meanwhile (`cat F |
    ... --output F --overwrite`) keeps its text until the end. Without `overwrite` the rename never replaces a file
    that appeared meanwhile. stdout, devices and FIFOs (`/dev/null`) are written directly."""

    def __init__(self, target: str | Path, overwrite: bool):
        self.target, self.overwrite, self.stream, self.lines = target, overwrite, None, 0
        self._file: contextlib.ExitStack | None = None

    @property
    def partial(self) -> str | None:
        """The temporary file being written (None for stdout, a device or a FIFO)."""
        return self.stream.name if self._file is not None else None

    def write(self, lines: list[str]) -> None:
        if self.stream is None:
            if str(self.target) == "-":
                self.stream = sys.stdout
            elif os.path.exists(self.target) and not os.path.isfile(self.target):  # /dev/null, a FIFO
                self.stream = open(self.target, "w", encoding="utf-8", newline="\n")
            else:
                self._file = contextlib.ExitStack()
                output = atomic_file(
                    self.target, replace=self.overwrite, keep_on_error=True, encoding="utf-8", newline="\n"
                )
                self.stream = self._file.enter_context(output)
        # a translation never holds a line break: every output line stays opposite its input line
        self.stream.write("".join(line.replace("\r", " ").replace("\n", " ") + "\n" for line in lines))
        self.stream.flush()
        self.lines += len(lines)

    def close(self, error: BaseException | None = None) -> None:
        """Put the file in place (no `error`), or keep the temporary file with the lines written so far."""
        if self._file is not None:
            if error is None:
                self._file.close()
            else:
                self._file.__exit__(type(error), error, error.__traceback__)
        elif self.stream is not None and self.stream is not sys.stdout:
            self.stream.close()


def write_pieces(pieces: Iterable[list[str]], target: str | Path, overwrite: bool, total: int) -> None:
    """Write each piece of lines to `target` (`-`: stdout) as it comes (`_OutputFile`). On an error after the first
    line, the file keeps the lines written and the error names it (an exception note, counting them of `total`)."""
    output = _OutputFile(target, overwrite)
    try:
        for piece in pieces:
            output.write(piece)
        if output.stream is None:
            output.write([])
    except BaseException as error:
        output.close(error)
        if output.lines and output.partial is not None:
            error.add_note(
                f"the first {output.lines} of {total} translations are in {output.partial} ({target} was not changed)"
            )
        elif output.lines and str(target) != "-":
            error.add_note(f"the first {output.lines} of {total} translations were written to {target}")
        raise
    output.close()
