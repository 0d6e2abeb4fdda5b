"""benchmarks/scale_sim.py, the model of rounds with N peers: its all-or-nothing rule gives the closed form, survivable
rounds commit at least as often, losses cost goodput, the quorum holds, the fit reads a real swarm, and bad input is
one line and exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import scale_sim  # noqa: E402
from scale_sim import Params, simulate  # noqa: E402

SWARM4 = ROOT / "benchmarks" / "results" / "scale-swarm4" / "summary.json"
FAST = Params(inner_steps=50, payload_bytes=20e6, restart_s=5.0, stall_s=10.0)  # short rounds, quick restarts


@pytest.mark.parametrize("n,p", [(4, 0.05), (8, 0.03), (16, 0.01)])
def test_all_or_nothing_gives_the_closed_form(n, p):
    # lost peers are back by the next round and nobody leaves: every round's group is the whole swarm
    out = simulate(replace(FAST, p=p, restart_s=0.0, stall_s=0.0, leave_frac=0.0, inner_loss=0.0), n, 2000, "today",
                   seed=1)
    sizes = out["group_sizes"]
    # the chance that no member of each round's actual group was lost, (1 - p)^n when the whole swarm is in it (a
    # group of at most half the peers live at the previous round, after two peers of four died, cannot commit)
    expected = sum((1 - p) ** g for g, _, live_prev, _, _ in out["log"] if 2 * g > live_prev) / len(sizes)
    sigma = math.sqrt(expected * (1 - expected) / out["attempts"])
    assert abs(out["commit_rate"] - expected) < 4 * sigma, (out["commit_rate"], expected, sigma)
    assert sum(g == n for g in sizes) / len(sizes) > 0.95  # the whole swarm: the closed form itself
    assert abs(out["commit_rate"] - (1 - p) ** n) < 4 * sigma + 0.02
    assert out["timeouts"] == 0


@pytest.mark.parametrize("n,p", [(8, 0.02), (32, 0.01), (64, 0.05)])
def test_survivable_rounds_commit_at_least_as_often(n, p):
    today = simulate(replace(FAST, p=p), n, 400, "today")
    new = simulate(replace(FAST, p=p), n, 400, "new")
    assert today["commit_rate"] < 1.0  # losses happened
    assert new["commit_rate"] >= today["commit_rate"]
    assert new["commit_rate"] == 1.0  # a loss never fails a survivable round while the quorum holds
    assert new["goodput"] > today["goodput"] or p * n < 0.5


@pytest.mark.parametrize("rule", ["today", "new"])
def test_goodput_decreases_as_losses_grow(rule):
    goodput = [simulate(replace(FAST, p=p), 32, 300, rule)["goodput"] for p in (0.0, 0.01, 0.05, 0.2)]
    assert all(a > b for a, b in zip(goodput, goodput[1:])), goodput


def test_the_quorum_holds_when_stragglers_miss_the_window():
    # arrivals spread far past a one-second window: groups of at most half the live peers never commit
    prm = replace(FAST, drift_sigma=0.4, matchmaking_floor=1.0, p=0.0)
    out = simulate(prm, 16, 300, "new")
    assert out["quorum_fails"] > 0
    for size, survivors, live_prev, ok, _ in out["log"]:
        assert not ok or 2 * survivors > live_prev


def test_a_crash_costs_the_survivors_a_matchmaking_window_per_roster_listing():
    # the demo's deadlines: a 10 s matchmaking window; a dead peer counts in the roster for roster_ttl seconds
    local = replace(FAST, inner_steps=1, step_s=0.7, payload_bytes=1e6, host_bytes_per_s=3e7, speed_sigma=0.0,
                    matchmaking_floor=10.0, request_timeout=1.0, rtt_s=0.0)
    cost = {(ttl, phase): scale_sim.crash_cost(replace(local, roster_ttl=ttl), 3, phase)
            for ttl in (0.1, 6.0, 15.0) for phase in ("inner", "allreduce")}
    assert cost[(0.1, "inner")] < 1.0  # forgotten at once: nobody waits for it
    assert 8.5 < cost[(6.0, "inner")] < 10.5  # the next round waits out one window
    assert 18.0 < cost[(15.0, "inner")] < 20.5  # still listed a round later: two windows
    for ttl in (0.1, 6.0, 15.0):  # a death mid-all-reduce also fails that round (today's rule)
        assert cost[(ttl, "allreduce")] > cost[(ttl, "inner")] + 0.5


def test_seeded_and_deterministic():
    a = simulate(replace(FAST, p=0.02), 16, 100, "new", seed=3)
    b = simulate(replace(FAST, p=0.02), 16, 100, "new", seed=3)
    c = simulate(replace(FAST, p=0.02), 16, 100, "new", seed=4)
    assert a == b and a != c


def test_the_slowest_link_bounds_the_all_reduce():
    prm = replace(FAST, link_sigma=0.0, rtt_s=0.0, ar_base_s=0.0, uplink_mbps=80.0, downlink_mbps=80.0)
    out = simulate(prm, 8, 5, "new")
    assert out["allreduce_s"] == pytest.approx(2 * 7 / 8 * 20e6 / 10e6)  # 2(N-1)/N x P at 10 MB/s
    slow = simulate(replace(prm, speeds=(1.0,), link_sigma=1.0), 8, 5, "new")
    assert slow["allreduce_s"] > out["allreduce_s"]


def test_fit_reads_a_real_swarm():
    run = scale_sim.read_run(str(SWARM4))
    assert run["n"] == 4 and run["detail"] and run["commit_rate"] == 1.0
    fitted = scale_sim.fit([run])
    assert fitted["host_bytes_per_s"] > 0 and fitted["mm_base_s"] >= 0 and not fitted["fitted_per_peer"]
    rows = scale_sim.compare([run], fitted, rounds=20, seed=0)
    round_row = next(line for line in rows.splitlines() if "round s" in line)
    assert round_row.endswith("agree |")


def test_fit_of_two_sizes_recovers_the_per_peer_costs():
    # runs on one host: matchmaking 0.05 + 0.01 N s; all-reduce 0.2 s + (N x bytes moved) / 40 MB/s
    def run(n):
        moved = 2 * (n - 1) / n * 1e6
        return {"n": n, "detail": True, "mm_s": 0.05 + 0.01 * n, "moved": moved,
                "allreduce_s": 0.2 + n * moved / 40e6, "sync_s": 0.1}
    fitted = scale_sim.fit([run(8), run(16), run(32)])
    assert fitted["fitted_per_peer"]
    assert fitted["mm_base_s"] == pytest.approx(0.05) and fitted["mm_per_peer_s"] == pytest.approx(0.01)
    assert fitted["ar_base_s"] == pytest.approx(0.2) and fitted["host_bytes_per_s"] == pytest.approx(40e6)


def test_quick_run_prints_the_table_and_plot(tmp_path, capsys):
    assert scale_sim.main(["--quick", "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "r.json")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + 3 * 3  # header, then p x N in (16, 32, 64)
    assert (tmp_path / "p.png").stat().st_size > 10_000
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert {r["n"] for r in rows} == {16, 32, 64} and {r["rule"] for r in rows} == {"today", "new"}


def test_no_hivemind_or_torch():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import scale_sim; "
            "scale_sim.main(['--peers', '16', '--rounds', '5']); "
            "assert 'hivemind' not in sys.modules and 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("args", [["--peers", "1"], ["--p", "x"], ["--p", "1.5"], ["--fit", "/nonexistent.json"],
                                  ["--link-sigma", "-1"], ["--rounds", "0"]])
def test_bad_input_is_one_line_and_exit_2(args, capsys):
    with pytest.raises(SystemExit) as exit_:
        scale_sim.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error" in err
