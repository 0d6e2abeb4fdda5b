"""Every benchmark script imports and documents itself: ``python benchmarks/<name>.py --help`` exits 0."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCHMARKS = sorted(p for p in (Path(__file__).parent.parent / "benchmarks").glob("*.py")
                    if p.stem not in ("common", "netlab", "study"))  # libraries of the scripts


@pytest.fixture(scope="module")
def helps(request):
    """``--help`` of every script under test, run 2 at a time from the first test on: each process spends seconds of
    CPU importing torch and the rest before argparse answers, so the 2-core CI keeps both cores busy instead of
    waiting for each in turn. script -> future of its CompletedProcess."""
    scripts = [item.callspec.params["script"] for item in request.session.items
               if item.module is request.module and hasattr(item, "callspec")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {script: pool.submit(subprocess.run, [sys.executable, str(script), "--help"], capture_output=True,
                                   text=True, timeout=200) for script in scripts}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_help(script, helps):
    out = helps[script].result()
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:") and "Run:" in out.stdout


def test_every_benchmark_is_covered():
    assert {p.stem for p in BENCHMARKS} >= {"allreduce_link", "utilization", "overhead", "convergence", "join_cost",
                                             "fault_cost", "nat", "heterogeneous", "gpu", "memory_model",
                                             "data_rate", "big_models"}
