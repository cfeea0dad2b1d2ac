"""The preparation lock across hosts (`hf_deep_nmt.data.prepared_lock`): an owner record with a lease beside the
prepared folder; a silent owner is waited for, then named and taken over; building folders are named by host and pid
and another host's are never removed; a SIGTERM leaves no building folder; each tokenized split is written once."""

import json
import logging
import os
import signal
import socket
import time

import fault_worker
import pytest
from test_prepared_data import settings, write_corpus

from hf_deep_nmt.data import prepared as prepared_data
from hf_deep_nmt.data import prepared_lock
from hf_deep_nmt.data.prepared import RECORD, prepare_data


def other_host_owner(folder, heartbeat: float, lease: float, host: str = "node-17", pid: int = 4242) -> dict:
    owner = {"host": host, "pid": pid, "started": heartbeat - 30.0, "heartbeat": heartbeat, "lease_seconds": lease}
    prepared_lock.owner_path(folder).write_text(json.dumps(owner))
    return owner


def test_a_silent_owner_is_waited_for_its_lease_then_named_and_taken_over(tmp_path, caplog):
    corpus = write_corpus(tmp_path / "train.tsv", pairs=60)
    folder = tmp_path / "shared"
    other_host_owner(folder, heartbeat=time.time(), lease=1.5)  # renewed just now, then never again
    theirs = prepared_lock.building_folder(folder, "node-17", 4242)
    elsewhere = prepared_lock.building_folder(folder, "node-18", 4242)  # same pid, another node: its own work
    for path in (theirs, elsewhere):
        path.mkdir()
        (path / "part").write_text("x")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        data = prepare_data(*settings(tmp_path, corpus, prepared_data_dir=str(folder)), seed=3)
    assert time.monotonic() - started >= 1.0  # the live lease was waited for
    assert f"Another process is preparing {folder} (process 4242 on node-17, started" in caplog.text
    assert f"Taking over the preparation of {folder} from process 4242 on node-17 (silent for" in caplog.text
    assert not data.reused and (folder / RECORD).is_file()
    assert not theirs.exists() and (elsewhere / "part").read_text() == "x"
    assert not prepared_lock.owner_path(folder).exists()  # released


def test_a_live_owner_on_another_host_is_never_taken_over(tmp_path, monkeypatch):
    folder = tmp_path / "shared"
    other_host_owner(folder, heartbeat=time.time(), lease=60)
    monkeypatch.setattr(prepared_lock, "POLL_SECONDS", 0.05)
    slept = []
    monkeypatch.setattr(prepared_lock.time, "sleep", lambda seconds: slept.append(seconds) or _stop(len(slept)))
    with pytest.raises(TimeoutError), prepared_lock.PreparationLock(folder):
        pass
    assert json.loads(prepared_lock.owner_path(folder).read_text())["host"] == "node-17"


def _stop(count: int) -> None:
    if count >= 5:
        raise TimeoutError("still waiting, as it should")


def test_the_building_folders_of_ended_processes_of_this_host_are_removed(tmp_path):
    folder = tmp_path / "shared"
    ended = prepared_lock.building_folder(folder, pid=2**22 - 1)  # no such process
    living = prepared_lock.building_folder(folder, pid=os.getpid())
    older = tmp_path / f".shared.building-{2**22 - 2}"  # a version that named only the pid
    for path in (ended, living, older):
        path.mkdir()
    prepared_lock.remove_abandoned_building_folders(folder)
    assert not ended.exists() and living.is_dir() and not older.exists()
    assert living.name == f".shared.building-{socket.gethostname()}-{os.getpid()}".replace("/", "_")


SIGTERMED = """
import sys, time
from pathlib import Path
from hf_deep_nmt.data import prepared as prepared_data
from hf_deep_nmt.training.arguments import DataArguments, ModelArguments

corpus, folder, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])
def slow(*args, **kwargs):
    marker.write_text("building")
    time.sleep(120)
prepared_data._tokenize_splits = slow
model_args = ModelArguments(model_type="deep_nmt", tokenizer_vocab_size=300)
data_args = DataArguments(train_file=corpus, max_source_length=32, max_target_length=32, prepared_data_dir=folder,
                          preprocessing_num_workers=1)
prepared_data.prepare_data(model_args, data_args, seed=3)
"""


def test_a_sigterm_while_building_leaves_no_building_folder_nor_owner(tmp_path):
    corpus = write_corpus(tmp_path / "train.tsv", pairs=60)
    folder, marker, log = tmp_path / "shared", tmp_path / "marker", tmp_path / "log"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = fault_worker.start_script(SIGTERMED, [str(corpus), str(folder), str(marker)], environment, log)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline and process.exitcode is None, log.read_text()[-2000:]
        time.sleep(0.1)
    assert list(tmp_path.glob(".shared.building-*"))  # building, with the tokenizer already written
    os.kill(process.pid, signal.SIGTERM)
    process.join(timeout=60)
    assert process.exitcode == 128 + signal.SIGTERM, log.read_text()[-2000:]
    assert not list(tmp_path.glob(".shared.building-*")) and not folder.exists()
    assert not prepared_lock.owner_path(folder).exists()


def test_each_tokenized_split_is_written_once(tmp_path, monkeypatch):
    """At the fullest moment of a build (the splits tokenized, the text not yet removed) the folder holds the text once
    and the tokens once; `save_to_disk` (a second copy of the tokens) is never called."""
    corpus = write_corpus(tmp_path / "train.tsv", pairs=120)
    monkeypatch.setattr(prepared_data.datasets.Dataset, "save_to_disk", lambda *a, **k: pytest.fail("copied"))
    fullest = set()
    tokenize = prepared_data._tokenize_splits

    def measured(building, *args, **kwargs):
        counts = tokenize(building, *args, **kwargs)
        fullest.update({path.relative_to(building).as_posix() for path in building.rglob("*.arrow")})
        return counts

    monkeypatch.setattr(prepared_data, "_tokenize_splits", measured)
    data = prepare_data(*settings(tmp_path, corpus, prepared_data_dir=str(tmp_path / "shared")), seed=3)
    assert fullest == {"work/train.arrow", "work/validation.arrow", "train/data.arrow", "validation/data.arrow"}
    assert sorted(data.record["files"]) == [
        *(f"tokenizer/{name}" for name in sorted(os.listdir(data.folder / "tokenizer"))),
        "train/data.arrow",
        "train/dataset_info.json",
        "train/state.json",
        "validation/data.arrow",
        "validation/dataset_info.json",
        "validation/state.json",
    ]
    reopened = prepare_data(*settings(tmp_path, corpus, prepared_data_dir=str(tmp_path / "shared")), seed=3)
    assert reopened.reused and reopened.train["input_ids"] == data.train["input_ids"] and len(data.train) == 120
