"""Ranks that never race on a run folder: under `torchrun` only the main process reads the folder, decides (start,
resume, refuse) and writes, and the other rank follows its decision. One launch of two gloo ranks takes several fresh
folders in a row with the main process slowed down before it writes and the other rank listing the folder late (the
interleaving that made a rank refuse a fresh folder as "outputs of an earlier run without a recipe record"), then
folders whose decision is a resume or a refusal, which must reach both ranks word for word."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from hf_deep_nmt.training.run_folder import LOCK_FILE, RunFolder

FRESH_DELAYS = (0.0, 0.1, 0.3, 0.6)  # seconds the main process waits before each write of its run record

WORKER = """
import json, os, sys, time

import torch.distributed as dist

dist.init_process_group("gloo")
from hf_deep_nmt.training import run_record
from hf_deep_nmt.training.run_folder import RunFolder, RunFolderError

work, delays, others = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
rank = dist.get_rank()
delay = [0.0]
if rank == 0:  # the main process slowed down before it writes its record
    write = run_record._write_record_file
    run_record._write_record_file = lambda *a: (time.sleep(delay[0]), write(*a))[1]
else:  # and the other one, if it still read the folder, listing it late: after the main one wrote
    listing = run_record.RunRecord.earlier_outputs
    run_record.RunRecord.earlier_outputs = lambda self, *a: (time.sleep(0.4), listing(self, *a))[1]
outcomes = []
for name, pause in [(f"fresh{index}", value) for index, value in enumerate(delays)] + [(n, 0.0) for n in others]:
    delay[0] = pause
    try:
        with RunFolder(f"{work}/{name}", "train", {"max_steps": 2}) as folder:
            outcomes.append([name, "started", folder.start(None, False)])
    except RunFolderError as error:
        outcomes.append([name, "refused", str(error)])
    dist.barrier()
with open(f"{work}/rank{rank}.json", "w") as handle:
    json.dump(outcomes, handle)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None, reason="needs torchrun")
def test_two_ranks_follow_the_main_process_on_fresh_resumed_and_refused_folders(tmp_path):
    recipe = {"max_steps": 2}
    with RunFolder(tmp_path / "interrupted", "train", recipe) as folder:  # a run that wrote results, unfinished
        folder.start(None, False)
        (tmp_path / "interrupted" / "results.json").write_text("{}")
    with RunFolder(tmp_path / "finished", "train", recipe) as folder:
        folder.start(None, False)
        (tmp_path / "finished" / "results.json").write_text("{}")
        folder.finish()
    (tmp_path / "locked").mkdir()  # held by a live process of this host (this one)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": "train", "since": "now"}
    (tmp_path / "locked" / LOCK_FILE).write_text(json.dumps(holder))
    others = ["interrupted", "finished", "locked"]
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    # torchrun's own module under this interpreter (the `torchrun` script's first line may name another one)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(tmp_path / "worker.py"),
        str(tmp_path),
    ]
    completed = subprocess.run(
        [*command, json.dumps(FRESH_DELAYS), json.dumps(others)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    main, other = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert other == main  # the same decision, the same refusal text, on both ranks
    outcomes = {name: (what, value) for name, what, value in main}
    for index in range(len(FRESH_DELAYS)):
        assert outcomes[f"fresh{index}"] == ("started", None)
        assert json.loads((tmp_path / f"fresh{index}" / "hf-deep-nmt-run.json").read_text())["finished"] is False
    assert outcomes["interrupted"] == ("started", "last")
    assert (
        outcomes["finished"][0] == "refused" and "holds a finished run of this same recipe" in outcomes["finished"][1]
    )
    assert outcomes["locked"][0] == "refused" and "is in use by another hf-deep-nmt run" in outcomes["locked"][1]
    assert f"process {os.getpid()} on {socket.gethostname()}" in outcomes["locked"][1]
