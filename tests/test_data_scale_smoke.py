"""`benchmarks/data_scale.py` at its smoke size: the corpus generator writes what it claims, and the quick runs of the
project's prepared-data path (a first run and its reuse) and of the lean pipeline report sane figures (the sizes
that matter live in the benchmark itself, docs/training.md#training-on-wmt-size-data)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "data_scale.py"


def load_script():
    spec = importlib.util.spec_from_file_location("data_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_corpus_is_wmt_like_seeded_and_written_once(tmp_path):
    data_scale = load_script()
    train, valid = data_scale.make_corpus(tmp_path, 2_000, seed=3, types=2_000)
    lines = train.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2_000 and len(valid.read_text(encoding="utf-8").splitlines()) == data_scale.VALIDATION_PAIRS
    pairs = [line.split("\t") for line in lines]
    assert all(len(pair) == 2 and pair[0].strip() and pair[1].strip() for pair in pairs)
    words = [len(pair[0].split()) for pair in pairs]
    assert 22 <= sum(words) / len(words) <= 28  # lognormal lengths of ~25 words
    assert 250 <= train.stat().st_size / 2_000 <= 300  # WMT-like bytes per pair (274 at 50k word types)
    assert len({word for pair in pairs for word in pair[0].split()}) > 1_000  # a long Zipf tail, not a few words
    # written once: a second call leaves the file alone; the same seed gives the same text, another seed another
    before = train.stat().st_mtime_ns
    assert data_scale.make_corpus(tmp_path, 2_000, seed=3, types=2_000)[0].stat().st_mtime_ns == before
    again = data_scale.make_corpus(tmp_path / "again", 2_000, seed=3, types=2_000)[0]
    other = data_scale.make_corpus(tmp_path / "other", 2_000, seed=4, types=2_000)[0]
    assert again.read_bytes() == train.read_bytes() and other.read_bytes() != train.read_bytes()


def test_smoke_run_reports_reuse_compact_ids_and_the_lean_pipeline(tmp_path):
    out = tmp_path / "data_scale.json"
    command = [
        sys.executable, str(SCRIPT), "--smoke", "--contenders", "project", "lean", "--workers", "1",
        "--runs", "second", "--repeat-up-to", "0", "--corpus-dir", str(tmp_path / "corpora"),
        "--work-dir", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(row["contender"], row["run"]): row for row in result["rows"]}
    assert list(rows) == [("project", "first, 1 worker"), ("project", "second run"), ("lean", "first, 1 worker")]
    first, second, lean = rows.values()
    corpus_bytes = first["corpus_bytes_per_pair"]
    summary = first["summary"]
    assert summary["reused"] is False and second["summary"]["reused"] is True
    assert summary["pairs_read"] == 2_000 and summary["pairs_kept"] + summary["pairs_dropped"] == 2_000
    assert second["summary"]["pairs_kept"] == summary["pairs_kept"] > 1_900
    assert second["summary"]["folder"] == summary["folder"]
    # compact ids on disk: the training split takes fewer bytes than its text (int64 ids would take about twice)
    assert 0 < first["bytes_per_pair_on_disk"] < corpus_bytes
    assert first["bytes_per_pair_on_disk"] * 2_000 < summary["folder_bytes_on_disk"]  # + tokenizer, validation
    assert 0 < lean["bytes_per_pair_on_disk"] < corpus_bytes and lean["summary"]["id_type"] == "uint16"
    assert lean["summary"]["pairs_read"] == 2_000 and 1_900 < lean["summary"]["pairs_kept"] <= 2_000
    for row in rows.values():
        assert row["cpu_s"] > 0 and row["wall_s"] > 0
        assert len(row["peak_above_imports_mb"]) == 1 and 0 <= row["peak_above_imports_mb"][0] < 2_000
    # the table comes last, one line per run
    table = [line for line in completed.stdout.splitlines() if line.startswith("| 2,000 |")]
    assert [line.split(" | ")[1:3] for line in table] == [[contender, run] for contender, run in rows]
