"""The convergence study's bookkeeping (benchmarks/study.py, convergence.py): a results file shared by processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from study import Spec, load_results  # noqa: E402


def test_a_line_still_being_written_is_not_read(tmp_path):
    done = {"spec": {**Spec(seed=0).__dict__, "extra": []}, "curve": [[0, 1.0]], "final": 1.0}
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps(done) + "\n" + json.dumps({**done, "final": 2.0})[:40])  # a writer is mid-line
    results = load_results(path)
    assert list(results) == [Spec(seed=0).key()] and results[Spec(seed=0).key()]["final"] == 1.0


def test_the_device_field_keeps_earlier_results_keys():
    """Results recorded before ``device`` existed (CPU runs) keep their keys; a GPU run is another run."""
    assert "device" not in json.loads(Spec().key())
    assert Spec(device="cuda").key() != Spec().key()


@pytest.mark.timeout(240)
def test_jobs_run_every_missing_run_once(tmp_path):
    out = tmp_path / "study.jsonl"
    cmd = [sys.executable, "convergence.py", "--engine", "sim", "--batch", "4", "--steps", "4", "--warmup", "1",
           "--seeds", "0", "1", "--peers", "1", "2", "--h", "2", "--eval-windows", "8", "--eval-points", "1",
           "--jobs", "3", "--out", str(out), "--plot", str(tmp_path / "plot.png")]
    proc = subprocess.run(cmd, cwd=BENCHMARKS, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = out.read_text().splitlines()
    keys = [Spec(**{**json.loads(line)["spec"], "extra": ()}).key() for line in lines]
    assert len(lines) == 6 and len(set(keys)) == 6  # data parallel, M 1 and M 2, for 2 seeds: each exactly once
    assert (tmp_path / "plot.png").is_file() and "DiLoCo M=2 H=2" in proc.stdout
