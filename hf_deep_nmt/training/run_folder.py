"""One run per output folder: `RunFolder` holds the folder's lock (`hf_deep_nmt.training.lock`: two runs never write
into one `output_dir` at once) and applies its run record (`hf_deep_nmt.training.run_record`: the recipe that decides,
before any work, whether a folder holding earlier checkpoints is resumed, cleared or refused), with SIGTERM / SIGUSR1
handled as requests to save and stop (`hf_deep_nmt.training.preemption`).

Under a multi-process launch (`torchrun`, `accelerate launch`) only the main process reads the folder, decides
(start, resume or refuse) and writes; the others wait for its decision, sent through `torch.distributed`
(`main_decides`), and follow it, refusal included. Left to read the folder themselves, a rank that looked between two
writes of the main one saw a record-less run and refused a fresh folder.

The names of both modules are importable from here too, where code written before they were split imports them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from hf_deep_nmt.training.lock import (  # noqa: F401  (imported from here before the lock had its own module)
    CLOCK_SKEW_SECONDS,
    DEFAULT_LEASE_SECONDS,
    LEASE_LIMITS,
    LEASE_VARIABLE,
    LOCK_FILE,
    LOCK_SIZE,
    MAX_PID,
    FolderLock,
    RunFolderError,
    _process_alive,
    lease_seconds,
    lock_problem,
)
from hf_deep_nmt.training.preemption import PreemptionSignals
from hf_deep_nmt.training.run_record import (  # noqa: F401  (imported from here before the record had its own module)
    ADDED_SETTINGS,
    CHECKSUM_RECORDS,
    NOT_RECIPE,
    READ_ONLY_OUTPUTS,
    RUN_OUTPUTS,
    RUN_RECORD,
    STAGE_PREFIX,
    RunOutputsCallback,
    RunRecord,
    _main_process,
    claim_outputs,
    missing_checksum_records,
    recipe_differences,
    run_recipe,
    run_shape,
)

T = TypeVar("T")


def _process_group():
    """`torch.distributed` when the launch initialised a group of several processes (the Trainer's arguments do, as
    they are parsed), else None: a single process decides alone."""
    try:
        import torch.distributed as distributed
    except ImportError:
        return None
    if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
        return distributed
    return None


# the errors a decision may end in, rebuilt by name on the other ranks (anything else arrives as a RuntimeError with
# its class and text): a decision travels as JSON, never pickled
_DECISION_ERRORS = {
    cls.__name__: cls
    for cls in (
        RunFolderError,
        FileExistsError,
        FileNotFoundError,
        NotADirectoryError,
        IsADirectoryError,
        PermissionError,
        OSError,
        ValueError,
        TypeError,
        RuntimeError,
    )
}


def _decision_error(payload: dict[str, str]) -> Exception:
    """The main process's error as the other ranks raise it: the same class and message where the class is one a
    decision ends in, else a `RuntimeError` naming it."""
    cls = _DECISION_ERRORS.get(payload["type"])
    if cls is None:
        return RuntimeError(
            f"The main process stopped deciding about the run folder: {payload['type']}: {payload['message']}"
        )
    return cls(payload["message"])


def _broadcast_json(distributed, payload: Any = None) -> Any:
    """`payload` (JSON) from rank 0 to every rank, as bytes in a tensor on the group's device (NCCL's: the current
    CUDA device); the other ranks pass nothing and get rank 0's payload."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if distributed.get_backend() == "nccl" else "cpu"
    data = (
        torch.frombuffer(bytearray(json.dumps(payload).encode()), dtype=torch.uint8) if payload is not None else None
    )
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64, device=device)
    distributed.broadcast(size, src=0)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device) if data is None else data.to(device)
    distributed.broadcast(data, src=0)
    return json.loads(bytes(data.cpu().tolist()).decode())


def main_decides(decide: Callable[[], T], main_process: bool) -> T:
    """`decide()` on the main process, its outcome on every process: the others wait for it (a broadcast from rank
    0) and return the same value or raise the same error, so that no rank reads a folder the main one is writing.
    Without a process group of several ranks, each process calls `decide()` itself. Outcomes are JSON values (what
    to resume from: a path, `"last"`, True or None)."""
    distributed = _process_group()
    if distributed is None:
        return decide()
    if not main_process:
        received = _broadcast_json(distributed)
        if "error" in received:
            raise _decision_error(received["error"])
        return received["value"]
    try:
        value = decide()
    except BaseException as error:
        _broadcast_json(distributed, {"error": {"type": type(error).__name__, "message": str(error)}})
        raise
    _broadcast_json(distributed, {"value": value})
    return value


class RunFolder:
    """`with RunFolder(output_dir, command, recipe, shape):` holds the folder's lock for the block (released on error
    and on a preemption signal too; see `hf_deep_nmt.training.lock` for taking over a lock left behind), with SIGTERM /
    SIGUSR1 handled as requests to save and stop (`hf_deep_nmt.training.preemption`); `start` and `finish` are the run
    record's (`RunRecord`). Only the main process of a multi-process launch (`RANK` 0) locks, reads the folder and
    writes; the others receive its decisions (`main_decides`): the lock refused, what to resume from, the refusal."""

    def __init__(
        self, output_dir: str | Path, command: str, recipe: dict[str, Any], shape: dict[str, Any] | None = None
    ):
        self.folder = Path(output_dir)
        self.main_process = _main_process()
        self.run_record = RunRecord(self.folder, command, recipe, shape, self.main_process)
        self._signals = PreemptionSignals()
        self._lock = FolderLock(self.folder, command, on_lost=self._taken_over)
        self.lock_lost = self._lock.lost  # set when another run took the lock over

    def _taken_over(self, message: str) -> None:
        self._signals.taken_over = message  # the Trainer stops at the end of its step, without saving

    def __enter__(self) -> RunFolder:
        self._signals.__enter__()
        try:
            main_decides(self._lock.acquire if self.main_process else lambda: None, self.main_process)
        except BaseException:
            self._signals.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._lock.release()
        finally:
            self._signals.__exit__(*exc)

    def start(
        self,
        resume_from_checkpoint: str | bool | None,
        overwrite_output_dir: bool,
        inputs: Iterable[str | Path | None] = (),
    ) -> str | bool | None:
        """`RunRecord.start` on the main process, its outcome on every one (`main_decides`): what to resume from, or
        `RunFolderError` naming the folder and the ways out."""
        inputs = list(inputs)
        return main_decides(
            lambda: self.run_record.start(resume_from_checkpoint, overwrite_output_dir, inputs), self.main_process
        )

    def finish(self) -> None:
        """Mark the run finished (re-running the same command is then refused as having nothing to train)."""
        self.run_record.finish()
