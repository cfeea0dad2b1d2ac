"""Training curves: the points come from the Trainer's `log_history`, the PNG is written, and without matplotlib the
plot is skipped with a message."""

import builtins
import logging

import pytest

from hf_deep_nmt.training.curves import curve_points, plot_training_curves

HISTORY = [
    {"loss": 9.5, "step": 1},
    {"loss": 8.0, "step": 2},
    {"eval_loss": 7.9, "eval_bleu": 0.4, "step": 2},
    {"nonfinite_steps_skipped": 1, "step": 3},
    {"loss": 6.5, "step": 3},
    {"nonfinite_steps_skipped": 2, "step": 4},
    {"eval_loss": 6.8, "eval_bleu": 1.7, "step": 4},
    {"train_runtime": 3.0, "step": 4},
]


def test_curve_points_come_from_the_log_history():
    points = curve_points(HISTORY)
    assert points["loss"] == [(1, 9.5), (2, 8.0), (3, 6.5)]
    assert points["eval_bleu"] == [(2, 0.4), (4, 1.7)] and points["eval_loss"] == [(2, 7.9), (4, 6.8)]
    assert points["skipped"] == [(3, 1), (4, 2)]  # optimizer steps skipped for a non-finite loss or gradient


def test_curves_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_training_curves(HISTORY, tmp_path / "run")
    assert path == tmp_path / "run" / "training_curves.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_plot_is_skipped_with_a_message(tmp_path, monkeypatch, caplog):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with caplog.at_level(logging.WARNING):
        assert plot_training_curves(HISTORY, tmp_path) is None
    assert "matplotlib is not installed: training curves skipped" in caplog.text
    assert not (tmp_path / "training_curves.png").exists()
