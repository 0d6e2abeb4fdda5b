"""Every benchmark script imports and documents itself: ``python benchmarks/<name>.py --help`` exits 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted(p for p in (Path(__file__).parent.parent / "benchmarks").glob("*.py")
                    if p.stem not in ("common", "netlab", "study"))  # libraries of the scripts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_help(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:") and "Run:" in out.stdout


def test_every_benchmark_is_covered():
    assert {p.stem for p in BENCHMARKS} >= {"allreduce_link", "utilization", "overhead", "convergence", "join_cost",
                                             "fault_cost", "nat", "heterogeneous", "gpu", "memory_model",
                                             "data_rate", "big_models"}
