"""The convergence study's bookkeeping (benchmarks/study.py, convergence.py): a results file shared by processes."""

from __future__ import annotations

import argparse
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


def _study_args(**given):
    args = dict(preset="tiny", corpus="stdlib", steps=600, batch=128, seq_len=128, warmup=25, lr=2e-3, dp_lr=None,
                lr_for={}, peers=[1, 4], h=[10], outer_lr=None, momentum=None, engine="sim", codec=None,
                device="cpu", seeds=[0, 1], eval_windows=512, eval_points=16)
    return argparse.Namespace(**{**args, **given})


def test_each_method_at_its_own_inner_lr():
    """``--dp-lr`` and ``--lr-for M:LR`` give each method its tuned lr; the others keep ``--lr``, and the table names
    each method's lr only when they differ."""
    from convergence import specs_of

    methods = specs_of(_study_args(dp_lr=2.8e-3, lr_for={1: 2.8e-3}))
    lrs = {name: {s.lr for s in specs} for name, specs in methods.items()}
    assert lrs == {"AdamW / data parallel (batch 128) lr 0.0028": {2.8e-3},
                   "DiLoCo M=1 H=10 nesterov 0.5/0.5 lr 0.0028": {2.8e-3},
                   "DiLoCo M=4 H=10 nesterov 0.5/0.5 lr 0.002": {2e-3}}
    plain = specs_of(_study_args())
    assert {s.lr for specs in plain.values() for s in specs} == {2e-3} and "DiLoCo M=4 H=10 nesterov 0.5/0.5" in plain
    # a run keeps its results key whatever the table calls it: the same spec as before --lr-for existed
    before = plain["DiLoCo M=4 H=10 nesterov 0.5/0.5"][0]
    assert methods["DiLoCo M=4 H=10 nesterov 0.5/0.5 lr 0.002"][0].key() == before.key()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("item", ["3:1e-3", "1:abc"])
def test_a_bad_lr_for_is_one_line_and_exit_2(item, tmp_path):
    out = tmp_path / "study.jsonl"
    proc = subprocess.run([sys.executable, "convergence.py", "--peers", "1", "4", "--lr-for", item, "--out", str(out)],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "--lr-for" in proc.stderr
    assert not out.exists()  # nothing ran


@pytest.mark.timeout(240)
def test_the_swarm_engine_measures_what_the_reference_computes(tmp_path, process_tag):
    """``--engine swarm`` (real peer processes, benchmarks/learning-quality.md 7.7) and ``--engine sim`` (the
    in-process reference the study's tables mostly come from) give the same eval losses along the run when the
    swarm sends fp32; the swarm's record also says that every round averaged every peer."""
    out = tmp_path / "study.jsonl"
    common = [sys.executable, "convergence.py", "--batch", "4", "--steps", "10", "--warmup", "1", "--seeds", "0",
              "--peers", "2", "--h", "5", "--eval-windows", "8", "--eval-points", "2", "--out", str(out),
              "--plot", str(tmp_path / "plot.png")]
    for engine in (["--engine", "sim"], ["--engine", "swarm", "--codec", "fp32"]):
        proc = subprocess.run(common + engine, cwd=BENCHMARKS, capture_output=True, text=True, timeout=200)
        assert proc.returncode == 0, proc.stderr[-2000:]
    runs = {json.loads(line)["spec"].get("engine"): json.loads(line) for line in out.read_text().splitlines()}
    sim, swarm = runs["sim"], runs["swarm"]
    assert [t for t, _ in swarm["curve"]] == [t for t, _ in sim["curve"]] == [0, 2560, 5120]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(swarm["curve"], sim["curve"])), (swarm["curve"], sim["curve"])
    assert swarm["curve"][-1][1] < swarm["curve"][0][1] - 1.0  # it learned
    assert swarm["min_group"] == 2 and swarm["failed_rounds"] == 0 and swarm["bytes_sent_per_peer"] > 0
