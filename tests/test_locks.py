"""Locks and settings that lie: a run folder's lock written by hand with values no run of hf-deep-nmt writes (a lease
of days, a non-finite one, a heartbeat far in the future, a process id out of range) is refused, naming the lock file
and the field, and never waited for or taken over; no lock makes a command wait longer than the lease this process
writes; a bad `HF_DEEP_NMT_LOCK_LEASE` or `RANK` is refused naming the variable and what it admits."""

import json
import logging
import re
import time

import pytest

from hf_deep_nmt.cli import describe_error
from hf_deep_nmt.training import lock
from hf_deep_nmt.training.run_folder import LOCK_FILE, MAX_PID, RunFolder, RunFolderError, lease_seconds, lock_problem


def write_lock(folder, **fields):
    holder = {"pid": 4242, "host": "node-17", "command": "train", "since": "earlier"}
    holder.update(fields)
    text = json.dumps(holder)  # json writes float("inf") as Infinity, as a hand edit would
    folder.mkdir(exist_ok=True)
    (folder / LOCK_FILE).write_text(text)
    return text


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"heartbeat": "now", "lease_seconds": 1e6}, r"`lease_seconds` is 1000000\.0, not a number of seconds"),
        ({"heartbeat": "now", "lease_seconds": float("inf")}, r"`lease_seconds` is inf"),
        ({"heartbeat": "now", "lease_seconds": float("nan")}, r"`lease_seconds` is nan"),
        ({"heartbeat": "now", "lease_seconds": 0}, r"`lease_seconds` is 0,"),
        ({"heartbeat": "now", "lease_seconds": True}, r"`lease_seconds` is True,"),
        ({"heartbeat": "future", "lease_seconds": 60}, r"`heartbeat` lies 10000000 s in the future"),
        ({"heartbeat": float("inf"), "lease_seconds": 60}, r"`heartbeat` is inf, not a time"),
        ({"heartbeat": "now"}, r"`lease_seconds` is None"),  # half of a lease
        ({"pid": 1 << 40}, r"`pid` is 1099511627776, not a process id \(an integer from 1 to 4194304\)"),
        ({"pid": 0}, r"`pid` is 0, not a process id"),
        ({"pid": -1}, r"`pid` is -1, not a process id"),
        ({"pid": "4242"}, r"`pid` is '4242', not a process id"),
        ({"host": 17}, r"`host` is 17, not a host name"),
    ],
)
def test_a_lock_with_values_no_run_writes_is_refused_naming_the_file_and_the_field(tmp_path, fields, named):
    folder = tmp_path / "run"
    now = time.time()
    if fields.get("heartbeat") == "now":
        fields = {**fields, "heartbeat": now - 10}
    elif fields.get("heartbeat") == "future":
        fields = {**fields, "heartbeat": now + 1e7}
    text = write_lock(folder, **fields)
    started = time.monotonic()
    with pytest.raises(RunFolderError) as refused:
        with RunFolder(folder, "train", {}):
            pass
    message = str(refused.value)
    assert time.monotonic() - started < 5  # no wait on the lock's word
    assert f"locked by {str(folder / LOCK_FILE)!r}, which no run of hf-deep-nmt wrote" in message
    assert "neither waited for nor taken over; if no run is using the folder, delete it" in message
    assert re.search(named, message), message
    assert (folder / LOCK_FILE).read_text() == text  # not taken over


def test_values_a_run_writes_are_accepted():
    now = 1_000_000.0
    assert lock_problem({"pid": 1, "host": "a"}, now) is None  # a lock of a version without leases
    assert lock_problem({"pid": MAX_PID, "host": "a", "heartbeat": now + 59, "lease_seconds": 86400}, now) is None
    assert "in the future" in lock_problem({"pid": 5, "host": "a", "heartbeat": now + 61, "lease_seconds": 1}, now)
    assert "`pid`" in lock_problem({"pid": MAX_PID + 1, "host": "a"}, now)


def test_a_long_but_valid_lease_is_waited_for_at_most_the_lease_this_process_writes(tmp_path, monkeypatch, caplog):
    """A lease of a day not renewed for more than half of it: a running holder renews every quarter, so it is waited
    for, but only as long as this process's own lease (here 0.5 s), then refused as still running."""
    monkeypatch.setattr(lock, "LEASE_SECONDS", 0.5)
    folder = tmp_path / "run"
    text = write_lock(folder, heartbeat=time.time() - 50_000, lease_seconds=86_400)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(RunFolderError, match=r"runs 36\d{3} s more"):
        with RunFolder(folder, "train", {}):
            pass
    assert 0.5 <= time.monotonic() - started < 5
    assert "renews it every 21600 s: waiting 0 s for its lease to run out" in caplog.text
    assert (folder / LOCK_FILE).read_text() == text


@pytest.mark.parametrize("value", ["abc", "0", "-5", "inf", "nan", "1e6", "0.5"])
def test_a_bad_lease_variable_is_refused_naming_it(tmp_path, monkeypatch, value):
    monkeypatch.setenv("HF_DEEP_NMT_LOCK_LEASE", value)
    with pytest.raises(ValueError) as refused:
        with RunFolder(tmp_path / "run", "train", {}):
            pass
    assert str(refused.value) == (
        f"HF_DEEP_NMT_LOCK_LEASE={value!r} is not a lock lease: give a number of seconds from 1 to 86400 (default "
        "120), or unset it."
    )
    assert not (tmp_path / "run").exists()  # refused before the folder is made
    assert describe_error(refused.value)[0] == 2  # the command line's usage error
    monkeypatch.setenv("HF_DEEP_NMT_LOCK_LEASE", " 30 ")
    assert lease_seconds() == 30.0
    monkeypatch.setenv("HF_DEEP_NMT_LOCK_LEASE", "")
    assert lease_seconds() == 120.0


def test_a_bad_rank_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "abc")
    with pytest.raises(ValueError, match=r"^RANK='abc' is not a process rank: the launcher .* sets it to 0, 1, 2"):
        RunFolder(tmp_path / "run", "train", {})
    monkeypatch.setenv("RANK", "1")
    assert RunFolder(tmp_path / "run", "train", {}).main_process is False
