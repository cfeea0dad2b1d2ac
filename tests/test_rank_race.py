"""Ranks that never race on a run folder: under `torchrun` only the main process reads the folder, decides (start,
resume, refuse) and writes, and the other rank follows its decision. One launch of two gloo ranks takes several fresh
folders in a row with the main process slowed down before it writes and the other rank listing the folder late (the
interleaving that made a rank refuse a fresh folder as "outputs of an earlier run without a recipe record"), then
folders whose decision is a resume or a refusal, which must reach both ranks word for word. The launch is the
session's one launch of two ranks (tests/two_ranks.py), whose last scenario this is."""

import json
import os
import socket
import textwrap
from pathlib import Path

from two_ranks import Scenario

from hf_deep_nmt.training.run_folder import LOCK_FILE, RunFolder

FRESH_DELAYS = (0.0, 0.1, 0.3, 0.6)  # seconds the main process waits before each write of its run record

WORKER = """
import json, os, sys, time

import torch.distributed as dist

if not dist.is_initialized():  # the first scenario of the launch
    dist.init_process_group("gloo")
from hf_deep_nmt.training import run_record
from hf_deep_nmt.training.run_folder import RunFolder, RunFolderError

work, delays, others = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
rank = dist.get_rank()
delay = [0.0]
write_record, earlier_outputs = run_record._write_record_file, run_record.RunRecord.earlier_outputs
if rank == 0:  # the main process slowed down before it writes its record
    run_record._write_record_file = lambda *a: (time.sleep(delay[0]), write_record(*a))[1]
else:  # and the other one, if it still read the folder, listing it late: after the main one wrote
    run_record.RunRecord.earlier_outputs = lambda self, *a: (time.sleep(0.4), earlier_outputs(self, *a))[1]
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
run_record._write_record_file, run_record.RunRecord.earlier_outputs = write_record, earlier_outputs
"""


def prepare(tmp_path: Path) -> list[str]:
    """The folders the ranks take after the fresh ones: an unfinished run, a finished one, one locked by this test
    process (alive while the ranks run)."""
    recipe = {"max_steps": 2}
    with RunFolder(tmp_path / "interrupted", "train", recipe) as folder:  # a run that wrote results, unfinished
        folder.start(None, False)
        (tmp_path / "interrupted" / "results.json").write_text("{}")
    with RunFolder(tmp_path / "finished", "train", recipe) as folder:
        folder.start(None, False)
        (tmp_path / "finished" / "results.json").write_text("{}")
        folder.finish()
    (tmp_path / "locked").mkdir()  # held by a live process of this host (the one that launches the ranks)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": "train", "since": "now"}
    (tmp_path / "locked" / LOCK_FILE).write_text(json.dumps(holder))
    return [json.dumps(FRESH_DELAYS), json.dumps(["interrupted", "finished", "locked"])]


SCENARIO = Scenario(textwrap.dedent(WORKER), prepare)


def test_two_ranks_follow_the_main_process_on_fresh_resumed_and_refused_folders(two_ranks):
    tmp_path = two_ranks("test_rank_race")
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
    holder = json.loads((tmp_path / "locked" / LOCK_FILE).read_text())["pid"]  # the test process that launched them
    assert f"process {holder} on {socket.gethostname()}" in outcomes["locked"][1]
