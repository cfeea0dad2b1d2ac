"""ONE `torchrun` launch of two gloo CPU ranks for the whole test session, shared by the test modules that check what
two ranks do (`MODULES`). Each launch costs three fresh interpreters (the launcher importing torch, each rank torch,
transformers and the package): about 12 CPU seconds before a rank does anything. So the two ranks of one launch run
every module's script in turn, each in a folder of its own, with a barrier between two scripts.

A module declares its script as a `Scenario`: the source both ranks run (as `python script.py FOLDER ARGUMENTS...`
would, `sys.argv[1]` being the scenario's folder) and what the test process writes into that folder first (`prepare`,
which returns the arguments). A script leaves the process group open: the launch closes it once at the end. The
first script to need the process group forms it, as it would alone (the Trainer's arguments do, in
test_distributed.py, the first of `MODULES`), so that forming the group stays part of what is checked.

The `two_ranks` fixture (conftest.py) launches once for the scenarios of the collected modules; `two_ranks(name)`
returns the scenario's folder, failing with the ranks' errors if the script did not finish on both ranks or the launch
did not exit cleanly. Under pytest-xdist the workers share the launch: the first to ask launches under a file lock in
the session's common temporary folder, the others wait for it and read what it left there."""

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

# The modules whose scenarios share the launch, in the order the ranks run them. test_rank_race.py patches the run
# record's functions in the ranks, so it runs last.
MODULES = ("test_distributed", "test_nonfinite_skipping", "test_prepared_data", "test_rank_race")

DRIVER = """
import gc, json, os, sys, traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)
work, names = sys.argv[1], json.loads(sys.argv[2])
for name in names:
    folder = os.path.join(work, name)
    with open(os.path.join(folder, "arguments.json")) as handle:
        sys.argv = [name, folder, *json.load(handle)]
    with open(os.path.join(folder, "script.py")) as handle:
        source = handle.read()
    # what is alive now lives to the end, out of the garbage collector's sight: the Trainer's full collections no
    # longer walk the imports' 400,000 objects (0.25 CPU s each)
    gc.freeze()
    try:
        exec(compile(source, os.path.join(folder, "script.py"), "exec"), {"__name__": "__main__"})
        dist.barrier()  # the next script starts on both ranks once this one is done on both
    except BaseException:
        # torchrun stops the other rank and the launch fails: the scripts after this one do not run
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    open(os.path.join(folder, f"done{dist.get_rank()}"), "w").close()
# leave together and close gloo's threads before the interpreter exits (a rank that exits with gloo's threads still
# running can abort with "terminate called without an active exception")
dist.barrier()
dist.destroy_process_group()
# and skip the interpreter's teardown: a C++ thread destroyed there still aborted a rank now and then after all of the
# above (twice in about 25 torchrun runs on the 2-core machine)
sys.stderr.flush()
sys.stdout.flush()
os._exit(0)
"""


@dataclass(frozen=True)
class Scenario:
    """`source`, run by both ranks with `sys.argv` = [name, folder, *arguments], after `prepare(folder)` (in the test
    process) returned the arguments."""

    source: str
    prepare: Callable[[Path], list[str]] = lambda folder: []


def torchrun_available() -> bool:
    return importlib.util.find_spec("torch.distributed.run") is not None


def _scenarios(names: list[str]) -> dict[str, Scenario]:
    # each module is imported by its test name, as pytest imports it (tests/ is on sys.path): the same module object
    return {name: importlib.import_module(name).SCENARIO for name in MODULES if name in names}


def _launch(work: Path, names: list[str]) -> dict:
    scenarios = _scenarios(names)
    for name, scenario in scenarios.items():
        folder = work / name
        folder.mkdir()
        (folder / "script.py").write_text(scenario.source)
        (folder / "arguments.json").write_text(json.dumps(scenario.prepare(folder)))
    (work / "driver.py").write_text(DRIVER)
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    # torchrun's own module under this interpreter (the `torchrun` script's first line may name another one)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    command = [*torchrun, "--standalone", "--nproc_per_node", "2", str(work / "driver.py"), str(work)]
    completed = subprocess.run(
        [*command, json.dumps(list(scenarios))],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return {"names": list(scenarios), "returncode": completed.returncode, "stderr": completed.stderr[-4000:]}


def shared_launch(request, shared_folder) -> Callable[[str], Path]:
    """The `two_ranks` fixture: launch the scenarios of the collected modules once a session, into the folder
    `shared_folder("two-ranks", build)` gives (conftest's `shared_session_folder`); returns `folder(name)`."""
    if not torchrun_available():
        pytest.skip("needs torchrun")
    names = sorted({item.path.stem for item in request.session.items})

    def build(work: Path) -> None:
        work.mkdir()
        try:
            launch = _launch(work, names)
        except Exception as error:  # a launch that timed out, a scenario that could not be prepared: every test
            launch = {"names": names, "returncode": None, "stderr": repr(error)}  # says so, none launches again
        (work / "launch.json").write_text(json.dumps(launch))

    work = shared_folder("two-ranks", build)
    launch = json.loads((work / "launch.json").read_text())

    def folder(name: str) -> Path:
        assert name in launch["names"], f"{name} was not collected when the ranks were launched"
        finished = all((work / name / f"done{rank}").is_file() for rank in (0, 1))
        assert finished, f"the ranks did not finish {name}:\n" + launch["stderr"]
        assert launch["returncode"] == 0, launch["stderr"]
        return work / name

    return folder
