"""benchmarks/soak_report.py, the soak's pure parts: the fault rotation, /proc and log parsing, start/end after
warm-up and the verdict. No swarm here: benchmarks/soak.py runs one for as long as it is told."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from soak_report import (FAULT_KINDS, count_restarts, count_rounds, fd_kind, life_ratio, parse_stat, parse_status,  # noqa: E402
                         plan_faults, report, summarize, verdict)

PEERS = ["peer0", "peer1", "peer2", "peer3"]


@pytest.mark.timeout(30)
def test_plan_rotates_kinds_and_peers_and_is_seeded():
    plan = plan_faults(7, 20, PEERS)
    assert [t for t, _, _ in plan] == [60.0 * i for i in range(1, 20)]  # every minute, none at the very end
    for block in range(0, 16, 4):  # every block of four holds each kind and each peer once
        assert sorted(k for _, k, _ in plan[block:block + 4]) == sorted(FAULT_KINDS)
        assert sorted(p for _, _, p in plan[block:block + 4]) == PEERS
    assert all(a[2] != b[2] for a, b in zip(plan, plan[1:]))  # never the same peer twice in a row
    assert plan == plan_faults(7, 20, PEERS)
    assert plan != plan_faults(8, 20, PEERS)
    assert Counter(k for _, k, _ in plan_faults(1, 3, PEERS)) == Counter(dict.fromkeys(
        [k for _, k, _ in plan_faults(1, 3, PEERS)], 1))  # 2 faults in 3 minutes, both distinct kinds
    with pytest.raises(ValueError):
        plan_faults(0, 5, [])


@pytest.mark.timeout(30)
def test_proc_and_log_parsing():
    stat = "4242 (python -m (x) y) S 17 4242 4242 0 -1 4194560 " + " ".join(["0"] * 12) + " 987654 10 20"
    assert parse_stat(stat) == {"state": "S", "ppid": 17, "pgrp": 4242, "starttime": 987654}
    status = "Name:\tpython\nVmRSS:\t  123456 kB\nRssAnon:\t 1 kB\nThreads:\t7\n"
    assert parse_status(status) == {"rss_bytes": 123456 * 1024, "threads": 7}
    assert parse_status("Name:\tkthreadd\nThreads:\t1\n") == {"rss_bytes": 0, "threads": 1}
    assert [fd_kind(t) for t in ("socket:[81]", "pipe:[82]", "/dev/shm/torch_1_2_3 (deleted)", "/tmp/a.log",
                                 "anon_inode:[eventpoll]")] == ["socket", "pipe", "shm", "file", "other"]
    log = ("peer1 r3: network: p2pd (pid 12) died; restarted the network stack (1 of 5 tries)\n"
           "peer1 r3: network: the DHT process died; restarting the network stack failed (Timeout)\n"
           "Traceback (most recent call last):\nTask exception was never retrieved\n"
           "round 2 not committed: could not find a group\n")
    assert count_restarts(log) == {"restarted": 1, "restart_failed": 1, "tracebacks": 1, "never_retrieved": 1}
    records = [{"event": "start"}, {"event": "round", "committed": True}, {"event": "round", "committed": False},
               {"event": "round", "committed": True}, {"event": "inner"}]
    assert count_rounds(records) == {"committed": 2, "attempted": 3}


def sample(t, rss, fds, up=1000.0, since_fault=1e9, metrics=0, alive=True):
    usage = {"rss_bytes": rss, "fds": fds, "threads": 20, "procs": 4}
    return {"kind": "sample", "peer": "peer0", "pid": 42, "t_s": t, "alive": alive, "up_s": up, "since_fault_s": since_fault,
            "tree": usage, "main": dict(usage), "p2pd": 4343, "dir_bytes": 1000 + metrics, "dir_files": 3, "metrics_bytes": metrics,
            "checkpoint_bytes": 500, "log_bytes": 100, "restarted": 2, "restart_failed": 0, "tracebacks": 0,
            "never_retrieved": 0, "committed": 9, "attempted": 12}


@pytest.mark.timeout(30)
def test_start_and_end_leave_out_warmup_and_settling():
    samples = [sample(t, 999 if t < 180 else 100, 10) for t in range(0, 180, 15)]  # warm-up: not counted
    samples += [sample(180 + 15 * i, 100, 10) for i in range(8)]
    samples += [sample(300 + 15 * i, 5000, 99, up=20.0) for i in range(3)]  # a process just restarted: left out
    samples += [sample(345 + 15 * i, 5000, 99, since_fault=30.0) for i in range(3)]  # just after a fault: too
    samples += [sample(390 + 15 * i, 106, 11, metrics=600 * (i + 1)) for i in range(8)]
    row = summarize(samples, warmup_s=180, settle_s=60)
    assert row["steady_samples"] == 16
    assert row["tree_rss_bytes"] == (100, 106) and row["tree_rss_bytes_ratio"] == pytest.approx(1.06)
    assert row["tree_fds"] == (10, 11) and row["tree_fds_ratio"] == pytest.approx(1.1)
    assert row["tree_rss_bytes_peak"] == 106
    assert row["tree_fds_worst_life"] == pytest.approx(1.1)  # one process (the sample's pid) all along
    assert row["metrics_bytes"] == (0, 4800)
    assert row["metrics_bytes_per_min"] == pytest.approx(4800 / ((495 - 180) / 60))
    assert (row["committed"], row["attempted"], row["restarted"]) == (9, 12, 2)


@pytest.mark.timeout(30)
def test_growth_within_a_life_is_read_from_medians_at_its_ends():
    # one sample taken during an all-reduce (its connections open) at the end is not growth; a rise held is
    assert life_ratio([100, 101, 100, 99, 100, 100, 100, 130]) == pytest.approx(1.0)
    assert life_ratio([100, 101, 100, 99, 100, 100, 130, 130, 130, 130]) == pytest.approx(1.3)
    assert life_ratio([100, 100, 100, 100, 112, 112, 112, 112]) == pytest.approx(1.12)  # two windows, no more
    assert life_ratio([100, 100, 100, 112, 112, 112, 112]) is None  # shorter: a level is not told from a transient
    assert life_ratio([0] * 4 + [5] * 4) is None


@pytest.mark.timeout(30)
def test_verdict_flags_growth_and_unmeasured_figures_and_names_growing_files():
    flat = {"tree_rss_bytes_ratio": 1.05, "tree_fds_ratio": 0.9, "checkpoint_bytes": (500, 500), "dir_files": (3, 3),
            "metrics_bytes_per_min": 0.0, "log_bytes_per_min": 0.0, "dir_bytes": (1, 1)}
    v = verdict({"peer0": flat, "bootstrap": {"tree_rss_bytes_ratio": 1.0, "tree_fds_ratio": 1.0}})
    assert (v["memory_flat"], v["fds_flat"], v["folder_bounded"], v["notes"]) == (True, True, True, [])
    v = verdict({"peer0": {**flat, "tree_rss_bytes_ratio": 1.2, "metrics_bytes_per_min": 10240.0},
                 "peer1": {**flat, "tree_fds_ratio": None, "steady_samples": 1}})
    assert (v["memory_flat"], v["fds_flat"], v["folder_bounded"]) == (False, False, True)  # metrics.jsonl rotates
    assert v["notes"] == ["peer0: RSS grew ×1.20 after warm-up",
                          "peer0: metrics grows 10.0 KiB/min (14 MiB/day), rotated past 32 MiB: at most 64 MiB kept",
                          "peer1: FDs not measured after warm-up (1 steady samples)"]
    v = verdict({"peer0": {**flat, "tree_fds_worst_life": 3.0}})  # a leak a restart of the peer hid
    assert not v["fds_flat"] and v["notes"] == ["peer0: FDs grew ×3.00 within the life of one process"]
    v = verdict({"peer0": {**flat, "tree_shm_bytes": (10, 13), "tree_shm_bytes_ratio": 1.3}})
    assert not v["memory_flat"] and v["notes"] == ["peer0: shared memory held grew ×1.30 after warm-up"]
    v = verdict({"peer0": {**flat, "checkpoint_bytes": (500, 1500)}})
    assert not v["folder_bounded"] and v["notes"] == ["peer0: checkpoint_bytes grew from 500 to 1500"]


@pytest.mark.timeout(30)
def test_report_counts_our_restarts_and_exits():
    lines = [sample(180 + 15 * i, 100, 10) for i in range(8)]
    lines += [{"kind": "restart", "peer": "peer0"}, {"kind": "restart", "peer": "peer0"},
              {"kind": "exit", "peer": "peer0"}]
    rows, v, text = report(lines, warmup_s=180, settle_s=60)
    assert v["memory_flat"] and v["fds_flat"]
    row = next(x for x in text.splitlines() if x.startswith("| peer0"))
    assert "| 2 | 1 | 2 | 9 / 12 |" in row  # restarted by the soak, exits of its own, helper restarts, rounds


@pytest.mark.timeout(30)
def test_fault_outcomes_say_how_the_peer_stopped_and_when_it_committed_again():
    from soak_report import fault_outcomes, render_faults

    def at(t, committed, peer="peer1"):
        return {**sample(t, 100, 10), "peer": peer, "committed": committed}

    lines = [at(45, 7), {"kind": "fault", "t_s": 60, "fault": "term_restart", "peer": "peer1", "committed": 8},
             at(60.1, 8), at(60.2, 9, peer="peer2"),
             {"kind": "stopped", "t_s": 62, "peer": "peer1", "exit_code": 0, "after_s": 2.04},
             {"kind": "restart", "t_s": 62, "peer": "peer1"}, at(75, 9), at(90, 9), at(105, 10),
             {"kind": "fault", "t_s": 120, "fault": "kill_p2pd", "peer": "peer1", "committed": 10}, at(135, 10),
             {"kind": "fault", "t_s": 180, "fault": "kill_dht", "peer": "peer1", "skipped": "no dht process (yet)",
              "committed": 10}, at(195, 10)]
    rows = fault_outcomes(lines)
    assert [(r["fault"], r["outcome"], r["back_s"]) for r in rows] == [
        # not at 75: the stopping process committed round 9 (counted at the new one's first sample)
        ("term_restart", ["exit 0 after 2.0 s", "restarted"], 45.0),
        ("kill_p2pd", [], None), ("kill_dht", [], None)]
    table = render_faults(rows).splitlines()
    assert table[2] == "| 1 | term_restart | peer1 | exit 0 after 2.0 s, restarted | 45 s |"
    assert table[3] == "| 2 | kill_p2pd | peer1 | kept running | never (until its next fault or the end) |"
    assert table[4] == "| 3 | kill_dht | peer1 | skipped: no dht process (yet) | – |"
