"""One run per output folder: `RunFolder` holds the folder's lock (`hf_deep_nmt.training.lock`: two runs never write
into one `output_dir` at once) and applies its run record (`hf_deep_nmt.training.run_record`: the recipe that decides,
before any work, whether a folder holding earlier checkpoints is resumed, cleared or refused), with SIGTERM / SIGUSR1
handled as requests to save and stop (`hf_deep_nmt.training.preemption`).

The names of both modules are importable from here too, where code written before they were split imports them.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

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


class RunFolder:
    """`with RunFolder(output_dir, command, recipe, shape):` holds the folder's lock for the block (released on error
    and on a preemption signal too; see `hf_deep_nmt.training.lock` for taking over a lock left behind), with SIGTERM /
    SIGUSR1 handled as requests to save and stop (`hf_deep_nmt.training.preemption`); `start` and `finish` are the run
    record's (`RunRecord`). Only the main process of a multi-process launch (`RANK` 0) locks and writes; the others
    only read the same decision."""

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
            if self.main_process:
                self._lock.acquire()
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
        """`RunRecord.start`: what to resume from, or `RunFolderError` naming the folder and the ways out."""
        return self.run_record.start(resume_from_checkpoint, overwrite_output_dir, inputs)

    def finish(self) -> None:
        """Mark the run finished (re-running the same command is then refused as having nothing to train)."""
        self.run_record.finish()
