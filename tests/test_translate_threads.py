"""`hf-deep-nmt translate --threads N`: the count reaches torch; without it, the default leaves out the cores other
work holds (issue 39: two threads on a loaded two-core machine burned six times the CPU time of one)."""

import pytest
import torch

from hf_deep_nmt.cli import main
from hf_deep_nmt.serving import threads


@pytest.fixture
def restored_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_threads_option_reaches_torch(tiny_export, tmp_path, restored_threads, capsys):
    folder, _, _ = tiny_export
    source = tmp_path / "in.es"
    source.write_text("hola mundo\nel sol sale\n", encoding="utf-8")
    wanted = torch.get_num_threads() + 2  # not what torch had
    arguments = ["translate", "--model", str(folder), "--input", str(source), "--no-progress"]
    assert main([*arguments, "--threads", str(wanted)]) == 0
    assert torch.get_num_threads() == wanted
    assert capsys.readouterr().out.count("\n") == 2  # a line each (random weights: odd characters)


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_a_bad_thread_count_is_refused_naming_it(value, tmp_path, restored_threads, capsys):
    before = torch.get_num_threads()
    assert main(["translate", "--model", str(tmp_path / "absent"), "--threads", value]) == 2
    error = capsys.readouterr().err
    assert "--threads" in error and f"got {value!r}" in error and torch.get_num_threads() == before


@pytest.mark.parametrize(
    ("environment", "cores", "load", "expected"),
    [
        (None, 2, 0.1, 2),  # idle: every usable core
        (None, 2, 1.6, 1),  # one core held by other work
        (None, 2, 7.0, 1),  # overloaded: still one thread
        (None, 16, 5.4, 11),
        ("3", 2, 7.0, 3),  # the user's OMP_NUM_THREADS wins
    ],
)
def test_the_default_thread_count_leaves_out_busy_cores(monkeypatch, environment, cores, load, expected):
    if environment is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", environment)
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, 0.0, 0.0))
    assert threads.default_threads() == expected


def test_set_threads_refuses_a_bad_count(restored_threads):
    with pytest.raises(ValueError, match=r"`threads` must be a positive integer, got 0\."):
        threads.set_threads(0)
