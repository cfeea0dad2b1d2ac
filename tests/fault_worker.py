"""Child process of the kill, signal and memory-limit tests: runs the real command line (`hf_deep_nmt.cli.main`),
with test-only slow-downs set by environment variables so that a SIGKILL from the test lands where it is meant to:

- FAULT_STEP_DELAY: seconds to sleep after every optimizer step (so a kill after checkpoint N lands before N + 1);
- FAULT_HANG_AT_STEP / FAULT_MARKER: while writing the checkpoint of that step, after its weights, optimizer and
  scheduler files but before its RNG and trainer state, create the marker file and hang (the test kills it there);
- FAULT_STEP_FILE: after every optimizer step, write the step number into this file (so that a signal can be sent
  once training is under way);
- FAULT_HANG_IN_EVALUATION: at the start of the final evaluation, create this marker file and hang (the test signals
  it there).

Two ways in: `python fault_worker.py ARGS...` (a fresh interpreter), or `start(arguments, environment, log)`, which
forks the run from a multiprocessing fork server that imported torch, transformers and the package once per test
process (`set_forkserver_preload`); `start_script` forks a `python -c` script the same way. Either way the run is a
process of its own that the test kills, signals or limits as a whole; the fork only spares each run the 5 CPU seconds
a fresh interpreter spends importing.
"""

import gc
import multiprocessing
import os
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import transformers.trainer
from transformers import Trainer, TrainerCallback

from hf_deep_nmt import cli
from hf_deep_nmt.training import pipeline


def install_slow_downs(environment: Mapping[str, str]) -> None:
    """Patch the Trainer and the pipeline of this process with the slow-downs `environment` asks for."""
    step_delay = float(environment.get("FAULT_STEP_DELAY", "0"))
    hang_at_step = int(environment.get("FAULT_HANG_AT_STEP", "0"))
    marker, step_file = environment.get("FAULT_MARKER"), environment.get("FAULT_STEP_FILE")
    hang_in_evaluation = environment.get("FAULT_HANG_IN_EVALUATION")

    class SlowSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if step_file:
                Path(step_file).write_text(str(state.global_step))
            time.sleep(step_delay)

    save_optimizer_and_scheduler = Trainer._save_optimizer_and_scheduler

    def save_optimizer_and_scheduler_then_hang(self, output_dir):
        save_optimizer_and_scheduler(self, output_dir)
        if self.state.global_step == hang_at_step:
            Path(marker).write_text(output_dir)
            time.sleep(600)

    def hang_in_evaluation_instead(*args, **kwargs):
        Path(hang_in_evaluation).write_text("evaluating")
        time.sleep(600)

    transformers.trainer.DEFAULT_CALLBACKS.append(SlowSteps)
    if hang_at_step:
        Trainer._save_optimizer_and_scheduler = save_optimizer_and_scheduler_then_hang
    if hang_in_evaluation:
        pipeline.score_validation = hang_in_evaluation_instead


def run(arguments: list[str]) -> int:
    torch.set_num_threads(1)
    install_slow_downs(os.environ)
    return cli.main(arguments)


def _enter_child(environment: dict[str, str], log: str, error_log: str, limit: int) -> None:
    # the fork server's child: its own environment, its output into `log` (standard error into `error_log` when it is
    # given), at most `limit` bytes of address space when it is given; the objects of the server's imports out of
    # the garbage collector's sight (`gc.freeze`), as they would be garbage in no run: a full collection (the
    # Trainer makes one) no longer walks their 400,000 objects, 0.25 CPU s, nor copies their pages into the child
    gc.freeze()
    for stream, path in ((1, log), (2, error_log or log)):
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(descriptor, stream)
        os.close(descriptor)
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.environ.clear()
    os.environ.update(environment)


def _forked_run(arguments: list[str], environment: dict[str, str], limit: int, log: str, error_log: str) -> None:
    _enter_child(environment, log, error_log, limit)
    sys.exit(run(arguments))


def _forked_script(source: str, arguments: list[str], environment: dict[str, str], log: str, error_log: str) -> None:
    _enter_child(environment, log, error_log, 0)
    sys.argv = ["-c", *arguments]
    exec(compile(source, "<string>", "exec"), {"__name__": "__main__"})


# What the fork server imports before it forks any run: this module's heavy imports, by their installed names (the
# server's `sys.path` is a fresh interpreter's, without tests/; each run imports this small module itself)
_FORK_SERVER = multiprocessing.get_context("forkserver")
_FORK_SERVER.set_forkserver_preload(["torch", "transformers.trainer", "hf_deep_nmt.cli", pipeline.__name__])


def _started(target, arguments: tuple, log: Path, error_log: Path | None) -> multiprocessing.Process:
    for path in (log, error_log):
        if path is not None:
            Path(path).write_bytes(b"")
    process = _FORK_SERVER.Process(target=target, args=(*arguments, str(log), str(error_log or "")), daemon=False)
    process.start()
    return process


def start(
    arguments: list[str], environment: dict[str, str], log: Path, error_log: Path | None = None, limit: int = 0
) -> multiprocessing.Process:
    """The run as a started process (`pid`, `exitcode`: negative for a signal, `join`), its output going to `log`
    (standard error to `error_log` if given), under an address-space limit of `limit` bytes if given (what a fresh
    interpreter with these imports maps: the server's mappings are the child's)."""
    return _started(_forked_run, (arguments, environment, limit), log, error_log)


def start_script(
    source: str, arguments: list[str], environment: dict[str, str], log: Path, error_log: Path | None = None
) -> multiprocessing.Process:
    """`python -c SOURCE ARGUMENTS...` as a started process forked from the server (see `start`)."""
    return _started(_forked_script, (source, arguments, environment), log, error_log)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
