"""A MODEL of DiLoCo rounds with N peers (no network, no training; checked against swarms of N <= 4): a seeded
discrete-event simulation of the round-commit rate, the wall time per round and the goodput from 16 to 1,024 peers,
for today's all-or-nothing rounds and for survivable ones. The model in full, and its checks: benchmarks/scale.md.

One round (P = payload bytes on the wire, n = group size):
  inner       DyLU: peer i runs floor(v_i / v_max x H) steps, ending by T = H / v_max, and arrives exp(drift x z) later
  matchmaking the window of p2p_diloco/net/deadlines.py opens at the first arrival; the group waits for every peer
              the roster lists (a dead one until roster_ttl), else to the window's end; then mm_base + 2 rtt +
              mm_per_peer x n; later arrivals miss the round, fetch the state and rebase
  all-reduce  every member moves 2(n-1)/n x P each way, bound by the slowest link (plus ar_base + 2 rtt)
  losses      a member is lost in its all-reduce with probability p, a peer in its inner phase with inner_loss x p
              (a stall with probability stall_frac, noticed after next_chunk_timeout; else a death, after
              request_timeout); dead peers restart, stalled ones thaw, leavers are replaced, all download P first
  today       a loss fails the round for every member (commit rate (1-p)^n); work stays in θ_local
  new         the survivors re-reduce each lost reducer's part and commit without the lost contributions
  quorum      both rules commit only with more than half of the peers live at the previous round
Goodput = inner compute that entered θ_global within max_staleness attempts / (N x wall time). The overheads are
fitted to local swarms by --fit (defaults: the committed 4-peer run; mm_per_peer is assumed until two sizes exist).

Run:

    python benchmarks/scale_sim.py [--rounds 1000] [--plot benchmarks/scale-sim.png] [--quick]
    python benchmarks/scale_sim.py --fit benchmarks/results/scale-swarm4/summary.json [MORE/summary.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import NormalDist

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from p2p_diloco.net.deadlines import DeadlineEstimator  # noqa: E402  (pure: no hivemind, no torch)

PEERS = (16, 32, 64, 128, 256, 512, 1024)
P_LOSS = (0.001, 0.005, 0.02)
MBIT = 1e6 / 8  # bytes per second in one Mbit/s
TIMINGS = ("time", "outer/allreduce_s", "outer/allreduce_only_s", "outer/bytes_sent", "outer/bytes_received",
           "time/inner_s", "time/round_s", "time/wait_s")
POSITIVE = ("rounds", "inner_steps", "payload_bytes", "step_s", "uplink_mbps", "downlink_mbps", "part_size_bytes")


@dataclass(frozen=True)
class Params:
    """One swarm's parameters (defaults: a 150M-parameter model, averaging.codec int8, on home links)."""
    payload_bytes: float = 152e6      # P: values x bytes per value on the wire (150M x 8.125 bits)
    inner_steps: int = 500            # H of the fastest peer
    step_s: float = 0.5               # seconds per inner step of the fastest peer: an inner phase lasts H x step_s
    speed_sigma: float = 0.3          # lognormal spread of the peers' speeds (or speeds: a given list)
    speeds: tuple = ()                # relative speeds, cycled over the peers (overrides speed_sigma)
    drift_sigma: float = 0.01         # round-to-round speed noise: spreads the arrivals at matchmaking
    uplink_mbps: float = 100.0        # median uplink; links are lognormal with link_sigma
    downlink_mbps: float = 400.0
    link_sigma: float = 0.5
    host_bytes_per_s: float = 0.0     # > 0: every peer on one host whose all-reduce moves this many bytes/s in all
    rtt_s: float = 0.05
    mm_base_s: float = 0.058          # fitted: matchmaking after the last arrival (4-peer loopback swarm)
    mm_per_peer_s: float = 0.005      # assumed: the leader answers one join request per member
    ar_base_s: float = 0.0            # fitted: fixed all-reduce cost (0: one size measured, all went to throughput)
    sync_s: float = 0.144             # fitted: roster reads, pseudo-gradient and outer step per round
    matchmaking_floor: float = 10.0   # averaging.matchmaking_time
    allreduce_floor: float = 600.0    # averaging.allreduce_timeout, raised for P on home links as its doc says
    chunk_floor: float = 30.0         # averaging.next_chunk_timeout
    request_timeout: float = 5.0      # averaging.request_timeout: a dead peer's stream fails within it
    part_size_bytes: int = 2 ** 19
    p: float = 0.005                  # per member per round: lost during the round's averaging
    stall_frac: float = 0.3
    leave_frac: float = 0.25
    inner_loss: float = 1.0           # losses during the inner phase, per peer per round, as a multiple of p
    roster_ttl: float = 30.0          # averaging.roster_ttl: a lost peer's roster entry outlives it this long
    restart_s: float = 60.0
    stall_s: float = 120.0
    max_staleness: int = 4
    kill_round: int = -1              # scripted: peer 0 dies in this round (0-based) at kill_phase; -1: none
    kill_phase: str = "allreduce"     # inner, matchmaking or allreduce


def _draw_peers(prm: Params, n: int, rng: np.random.Generator):
    """Speeds (steps/s) and links (bytes/s) of n peers: lognormal quantiles, shuffled, so that the slowest of N moves
    smoothly with N instead of with the luck of N draws."""
    z = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    speed = np.resize(np.asarray(prm.speeds, float), n) if prm.speeds else np.exp(prm.speed_sigma * rng.permutation(z))
    speed = speed / speed.max() / prm.step_s
    up = prm.uplink_mbps * MBIT * np.exp(prm.link_sigma * rng.permutation(z))
    down = prm.downlink_mbps * MBIT * np.exp(prm.link_sigma * rng.permutation(z))
    return speed, up, down


def _transfer_s(prm: Params, nbytes: float, n: int, up, down) -> float:
    """Seconds to move ``nbytes`` each way per member: the slowest link, or the shared host."""
    if prm.host_bytes_per_s > 0:
        return n * nbytes / prm.host_bytes_per_s
    return float(np.max(nbytes / np.minimum(up, down)))


def simulate(prm: Params, n: int, rounds: int, rule: str, seed: int = 0) -> dict:
    """Play ``rounds`` round attempts of ``n`` peer slots under ``rule`` ('today' or 'new'); return the statistics.
    Every round draws the same random numbers whatever happens, so both rules see the same peers and the same
    losses (common random numbers)."""
    rng = np.random.default_rng([seed, n])  # not p: a loss at a smaller p is a loss at a larger p too
    speed, up, down = _draw_peers(prm, n, rng)
    fetch = prm.payload_bytes / down
    est = DeadlineEstimator(prm.allreduce_floor, prm.chunk_floor, prm.part_size_bytes, int(prm.payload_bytes),
                            matchmaking_floor=prm.matchmaking_floor)
    ready = np.zeros(n)                   # when each slot can start a round (synced)
    listed = np.zeros(n)                  # until when a lost peer's roster entry still counts (roster_ttl)
    work = np.zeros(n)                    # inner seconds not yet in θ_global
    since = np.full(n, -1)                # attempt at which that work began (-1: none)
    now, useful, live_prev = 0.0, 0.0, n
    commits = quorum_fails = timeouts = 0
    log, waits, ars = [], [], []  # log: (group size, survivors, live at the previous round, committed, wall s)
    for k in range(rounds):
        z, (u_loss, u_kind, u_when, u_leave, u_inner) = rng.standard_normal(n), rng.random((5, n))
        live = ready <= now + 1e-9
        if live.sum() < 2:  # too few peers to average: wait for the next to come back
            now = float(np.min(ready[~live]))
            continue
        dl = est.deadlines(int(live.sum()))
        # inner phase, DyLU: peer i runs max(1, floor(v_i / v_max x H)) steps, ending at or before T = H / v_max (up
        # to one of its steps early); speed noise this round moves the arrivals
        steps = np.maximum(1, np.floor(prm.inner_steps * speed / speed[live].max() + 1e-9))
        arrive = np.where(live, now + steps / speed * np.exp(prm.drift_sigma * z), np.inf)
        gone = live & (u_inner < prm.p * prm.inner_loss)  # lost during the inner phase: never arrives
        if k == prm.kill_round and prm.kill_phase == "inner":
            gone[0] = live[0]
        gone_at = now + u_when * (arrive - now)
        work[live] += np.where(gone, gone_at, arrive)[live] - now
        since[live & (since < 0)] = k
        arrive[gone] = np.inf
        listed[gone] = gone_at[gone] + prm.roster_ttl
        first = arrive.min()
        window_end = first + dl.matchmaking_time
        member = arrive <= window_end
        size = int(member.sum())
        # the group gathers every peer the roster lists (a dead peer until its entry expires): one missing, it waits
        # out the whole window
        expected = int((live & ~gone).sum() + ((~live | gone) & (listed > first)).sum())
        gathered = arrive[member].max() if size >= expected else window_end
        close = gathered + prm.mm_base_s + 2 * prm.rtt_s + prm.mm_per_peer_s * size
        moved = 2 * (size - 1) / size * prm.payload_bytes
        t_ar = prm.ar_base_s + 2 * prm.rtt_s + _transfer_s(prm, moved, size, up[member], down[member])
        lost = member & (u_loss < prm.p)
        when = u_when.copy()
        if k == prm.kill_round and prm.kill_phase != "inner" and member[0]:
            lost[0], when[0] = True, 0.0 if prm.kill_phase == "matchmaking" else 0.5
        stall = lost & (u_kind < prm.stall_frac)
        detect = np.where(stall, dl.next_chunk_timeout, prm.request_timeout)
        noticed = np.minimum(when * t_ar + detect, dl.allreduce_timeout)
        survivors = member & ~lost
        if size < 2:
            ok, end = False, close
        elif t_ar > dl.allreduce_timeout:  # too slow for the deadline: no rule saves it
            ok, end = False, close + dl.allreduce_timeout
            timeouts += 1
        elif not lost.any():
            ok, end = True, close + t_ar
        elif rule == "today":
            ok, end = False, close + float(noticed[lost].min())
        else:
            k_lost = int(lost.sum())
            again = prm.ar_base_s + _transfer_s(prm, k_lost * 2 * prm.payload_bytes / size, size - k_lost,
                                                up[survivors], down[survivors])
            ok, end = bool(survivors.sum() >= 2), close + max(t_ar, float(noticed[lost].max())) + again
        if ok and survivors.sum() * 2 <= live_prev:
            ok, quorum_fails = False, quorum_fails + 1
        if ok:
            commits += 1
            fresh = survivors & (k - since <= prm.max_staleness)
            useful += float(work[fresh].sum())
            work[survivors], since[survivors] = 0.0, -1
            est.observe(int(2 * moved), t_ar)  # sent + received, as the seam reports them
        # work older than max_staleness attempts is what a rebasing peer drops
        stale = (since >= 0) & (k + 1 - since > prm.max_staleness)
        work[stale], since[stale] = 0.0, -1
        # who can start the next round when: stragglers fetch the state, the lost restart or thaw, leavers are replaced
        nxt = end + prm.sync_s
        late = live & ~member & ~gone
        ready[late] = np.maximum(nxt, arrive[late] + fetch[late])
        died = np.where(gone, gone_at, close + when * t_ar)
        lost |= gone
        ready[lost] = died[lost] + np.where(stall[lost] | (gone & (u_kind < prm.stall_frac))[lost], prm.stall_s,
                                            prm.restart_s) + fetch[lost]
        listed[lost] = died[lost] + prm.roster_ttl
        leave = survivors & (u_leave < prm.p * prm.leave_frac)  # announced: its roster entry goes at once
        ready[leave] = nxt + prm.restart_s + fetch[leave]
        work[leave], since[leave] = 0.0, -1  # a leaver's work is in θ_global or gone with it
        ready[member & ~lost & ~leave] = nxt
        est.observe_round(nxt - now)
        log.append((size, int(survivors.sum()), live_prev, ok, nxt - now))
        waits.append(float(np.median(end - arrive[member])) if size else 0.0)
        ars.append(t_ar)
        live_prev = int(live.sum())
        now = nxt
    attempts = len(log)
    return {"n": n, "rule": rule, "p": prm.p, "attempts": attempts, "commits": commits,
            "commit_rate": commits / max(attempts, 1), "round_s": now / max(attempts, 1),
            "goodput": useful / (n * now) if now else 0.0, "quorum_fails": quorum_fails, "timeouts": timeouts,
            "group_sizes": [g[0] for g in log], "log": log, "wait_s": float(np.median(waits)) if waits else 0.0,
            "allreduce_s": float(np.median(ars)) if ars else 0.0}


def crash_cost(prm: Params, n: int, phase: str, kill_round: int = 2) -> float:
    """Seconds the survivors lose when peer 0 dies in round ``kill_round`` (0-based) at ``phase`` and stays dead, as
    benchmarks/fault_cost.py measures it: the wall time from that round's start to the second commit after it, less
    twice the median undisturbed round."""
    out = simulate(replace(prm, p=0.0, restart_s=1e9, kill_round=kill_round, kill_phase=phase), n, kill_round + 6,
                   "today")
    spent, commits = 0.0, 0
    for _, _, _, ok, wall in out["log"][kill_round:]:
        spent, commits = spent + wall, commits + ok
        if commits == 2:
            break
    return spent - 2 * float(np.median([entry[4] for entry in out["log"][:kill_round]]))


def projection(prm: Params, peers, losses, rounds: int, seed: int) -> list[dict]:
    return [simulate(replace(prm, p=p), n, rounds, rule, seed) for p in losses for n in peers
            for rule in ("today", "new")]


def table(rows: list[dict]) -> str:
    by = {(r["p"], r["n"], r["rule"]): r for r in rows}
    lines = ["| p | N | (1-p)^N | commit today | commit new | s/round today | s/round new | goodput today | "
             "goodput new |", "|" + "---|" * 9]
    for p, n in sorted({(r["p"], r["n"]) for r in rows}):
        t, w = by[(p, n, "today")], by[(p, n, "new")]
        lines.append(f"| {p:.1%} | {n} | {(1 - p) ** n:.1%} | {t['commit_rate']:.1%} | {w['commit_rate']:.1%} | "
                     f"{t['round_s']:.0f} | {w['round_s']:.0f} | {t['goodput']:.1%} | {w['goodput']:.1%} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, p in enumerate(sorted({r["p"] for r in rows})):
        for rule, style in (("today", "--"), ("new", "-")):
            sel = sorted((r for r in rows if r["p"] == p and r["rule"] == rule), key=lambda r: r["n"])
            ns = [r["n"] for r in sel]
            for ax, key in zip(axes, ("commit_rate", "goodput")):
                ax.plot(ns, [100 * r[key] for r in sel], style, marker="o", color=f"C{i}", label=f"{rule}, p={p:.1%}")
    for ax, title in zip(axes, ("round-commit rate (%)", "goodput: inner compute committed / wall (%)")):
        ax.set(xlabel="peers N", title=title, ylim=(-3, 103))
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("scale_sim.py (a model): all-or-nothing rounds (today, dashed) vs survivable rounds (new, solid)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------ fit to real swarms
def read_run(path: str) -> dict:
    """What a local swarm measured: summary.json and, when they sit beside it, the peers' metrics.jsonl."""
    summary = json.loads(Path(path).read_text())
    if not isinstance(summary, dict) or not isinstance(summary.get("rounds"), list):
        raise ValueError(f"{path}: not a swarm summary.json (no 'rounds' list)")
    recs = []  # every round record that carries the timings (a peer killed mid-line leaves a torn last line)
    for f in sorted(Path(path).parent.glob("*/metrics.jsonl")):
        lines = [line for line in f.read_text().splitlines() if line.strip().endswith("}")]
        recs += [r for r in map(json.loads, lines) if r.get("event") == "round" and all(r.get(k) is not None
                                                                                      for k in TIMINGS)]
    # N: the most peers that committed one round, whatever group they were in (a forked round counts all its groups)
    n = max((len(r.get("global_params_sha256") or {}) or r.get("group_size", 0) for r in summary["rounds"]), default=0)
    if n < 2:
        raise ValueError(f"{path}: no round committed by two peers or more")
    run = {"path": path, "n": n, "rounds": len(summary["rounds"]), "detail": bool(recs)}
    if not recs:  # summary only: the all-reduce time includes matchmaking; no inner or round times
        run.update(wait_s=_med([r["allreduce_s"] for r in summary["rounds"]]))
        return run
    done = [r for r in recs if r.get("committed")]
    if not done:
        raise ValueError(f"{path}: no committed round in the peers' metrics")
    per_round: dict[int, list[dict]] = {}
    for r in done:
        per_round.setdefault(r["round"], []).append(r)
    spreads, mms = [], []
    for rs in per_round.values():
        arrive = [r["time"] - r.get("time/eval_s", 0.0) - r["outer/allreduce_s"] for r in rs]
        spreads.append(max(arrive) - min(arrive))
        mms.append(min(r["outer/allreduce_s"] - r["outer/allreduce_only_s"] for r in rs))  # the last to arrive
    run.update(commit_rate=len(done) / len(recs), failed_attempts=len(recs) - len(done),
               wait_s=_med([r["outer/allreduce_s"] for r in done]), mm_s=_med(mms), spread_s=_med(spreads),
               allreduce_s=_med([r["outer/allreduce_only_s"] for r in done]),
               moved=_med([r["outer/bytes_sent"] + r["outer/bytes_received"] for r in done]) / 2,
               inner_s=_med([r["time/inner_s"] for r in done]), round_s=_med([r["time/round_s"] for r in done]),
               sync_s=_med([r["time/round_s"] - r["time/inner_s"] - r["time/wait_s"] for r in done]),
               goodput=sum(r["time/inner_s"] for r in recs) / sum(r["time/round_s"] for r in recs))
    return run


def _med(xs) -> float:
    return float(np.median(xs)) if len(xs) else float("nan")


def fit(runs: list[dict]) -> dict:
    """mm_base (+ mm_per_peer when two sizes were run), the host's all-reduce throughput (+ ar_base likewise)."""
    runs = [r for r in runs if r["detail"]]
    if not runs:
        raise ValueError("no run has its peers' metrics.jsonl beside summary.json: nothing to fit overheads to")
    ns = np.array([r["n"] for r in runs], float)
    several = len(set(ns)) > 1
    mm = np.array([r["mm_s"] for r in runs])
    agg = np.array([r["n"] * r["moved"] for r in runs])  # bytes through the one host per all-reduce
    ar = np.array([r["allreduce_s"] for r in runs])
    if several:
        mm_per, mm_base = np.polyfit(ns, mm, 1)
        inv_tput, ar_base = np.polyfit(agg, ar, 1)
    else:
        mm_per, mm_base = Params.mm_per_peer_s, float(np.mean(mm)) - Params.mm_per_peer_s * ns[0]
        inv_tput, ar_base = float(np.mean(ar / agg)), 0.0
    return {"mm_base_s": max(float(mm_base), 0.0), "mm_per_peer_s": max(float(mm_per), 0.0),
            "ar_base_s": max(float(ar_base), 0.0), "host_bytes_per_s": 1 / max(float(inv_tput), 1e-12),
            "sync_s": _med([r["sync_s"] for r in runs]), "fitted_per_peer": several}


def local_params(run: dict, fitted: dict, seed: int = 0) -> Params:
    """The model of one local swarm: its payload, inner time and arrival spread as inputs, the fitted overheads, the
    demo's deadlines (matchmaking 10 s, next chunk 15 s, requests 3 s, roster TTL 6 s), one host, no losses."""
    n = run["n"]
    spread_unit = float(np.mean(np.ptp(np.random.default_rng(seed).standard_normal((2000, n)), axis=1)))
    return Params(payload_bytes=run["moved"] * n / (2 * (n - 1)), inner_steps=1, step_s=run["inner_s"],
                  speed_sigma=0.0, drift_sigma=run["spread_s"] / run["inner_s"] / spread_unit, p=0.0,
                  matchmaking_floor=10.0, chunk_floor=15.0, request_timeout=3.0, roster_ttl=6.0, rtt_s=0.0,
                  **{k: v for k, v in fitted.items() if k != "fitted_per_peer"})


def compare(runs: list[dict], fitted: dict, rounds: int, seed: int) -> str:
    """The model at each run's N (its payload, inner time and arrival spread as inputs) against what it measured."""
    lines = ["| N | rounds | what | measured | model | |", "|" + "---|" * 6]
    sims = rounds * 4
    for run in runs:
        if not run["detail"]:
            lines.append(f"| {run['n']} | {run['rounds']} | wait s (summary only) | {run['wait_s']:.2f} | – | "
                         "no metrics.jsonl beside it |")
            continue
        n, prm = run["n"], local_params(run, fitted, seed)
        model = simulate(prm, n, sims, "new", seed)
        for key, label in (("commit_rate", "attempts committed"), ("wait_s", "matchmaking + all-reduce s"),
                           ("allreduce_s", "all-reduce s"), ("round_s", "round s"), ("goodput", "inner / round")):
            meas, mod = run[key], model[key]
            off = abs(mod - meas) > (0.05 if key in ("commit_rate", "goodput") else 0.25 * meas)
            lines.append(f"| {n} | {run['rounds']} | {label} | {meas:.3g} | {mod:.3g} | "
                         f"{'DISAGREE' if off else 'agree'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ entry point
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad input: one line, exit 2
        sys.stderr.write(f"scale_sim.py: error: {message}\n")
        sys.exit(2)


def ints(text: str) -> tuple:
    return tuple(int(x) for x in text.split(","))


def floats(text: str) -> tuple:
    return tuple(float(x) for x in text.split(","))


def main(argv=None) -> int:
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1000, help="round attempts per simulation (default 1000)")
    ap.add_argument("--peers", type=ints, default=PEERS, help="N values (default 16,32,...,1024)")
    ap.add_argument("--p", type=floats, default=P_LOSS, help="loss probabilities (default 0.001,0.005,0.02)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run: N up to 64, 40 rounds")
    ap.add_argument("--plot", metavar="FILE", help="draw commit rate and goodput against N (matplotlib)")
    ap.add_argument("--json", metavar="FILE", help="write every simulation's statistics")
    ap.add_argument("--fit", nargs="+", metavar="PATH", help="swarm summary.json files: fit the overheads, print "
                    "model against measured, and project with the fitted overheads")
    for field, value in asdict(Params()).items():
        if field not in ("p", "speeds", "host_bytes_per_s"):
            ap.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value, help=f"(default {value})")
    ap.add_argument("--speeds", type=floats, default=(), help="relative peer speeds, cycled (replaces "
                    "--speed-sigma)")
    args = ap.parse_args(argv)
    given = {f: getattr(args, f) for f in asdict(Params()) if f not in ("p", "host_bytes_per_s")}
    ok = {name.replace("_", "-"): math.isfinite(value) and (value > 0 if name in POSITIVE else value >= 0)
          for name, value in vars(args).items()
          if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "kill_round"}
    ok.update({"peers": min(args.peers) >= 2, "p": all(0 <= p < 1 for p in args.p), "speeds": min(args.speeds + (1,))
               > 0, "stall-frac": ok["stall-frac"] and args.stall_frac <= 1,
               "kill-phase": args.kill_phase in ("inner", "matchmaking", "allreduce")})
    bad = next((name for name, good in ok.items() if not good), None)
    if bad:
        ap.error(f"--{bad}: " + {"peers": "every N must be >= 2", "p": "every p must be in [0, 1)", "stall-frac": "must "
                 "be in [0, 1]", "kill-phase": "must be inner, matchmaking or allreduce"}.get(bad, "must be a finite "
                 "number, " + ("> 0" if bad.replace("-", "_") in POSITIVE + ("speeds",) else ">= 0")))
    prm = Params(**given)
    peers, rounds = (tuple(n for n in args.peers if n <= 64), min(args.rounds, 40)) if args.quick else \
        (args.peers, args.rounds)
    if args.fit:
        try:
            runs = [read_run(p) for p in args.fit]
            fitted = fit(runs)
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--fit: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        print("fitted to " + ", ".join(f"{r['path']} (N={r['n']}, {r['rounds']} rounds)" for r in runs))
        print(", ".join(f"{k} = {v:.4g}" for k, v in fitted.items() if k != "fitted_per_peer")
              + ("" if fitted["fitted_per_peer"] else " (one size: mm_per_peer_s assumed, ar_base_s set to 0)"))
        print(compare(runs, fitted, rounds, args.seed))
        local = local_params(next(r for r in runs if r["detail"]), fitted, args.seed)
        for ttl in (6.0, 15.0):  # benchmarks/faults.md 8.1 and 8.2 measured both
            print(f"model, roster_ttl {ttl:g} s: seconds the survivors lose when one of 3 peers is SIGKILLed (as "
                  "benchmarks/fault_cost.py measures it): " + ", ".join(
                      f"{ph} {crash_cost(replace(local, roster_ttl=ttl), 3, ph):.1f}"
                      for ph in ("inner", "matchmaking", "allreduce")))
        print()
        prm = replace(prm, mm_base_s=fitted["mm_base_s"], mm_per_peer_s=fitted["mm_per_peer_s"],
                      ar_base_s=fitted["ar_base_s"], sync_s=fitted["sync_s"])
    begun = time.perf_counter()
    rows = projection(prm, peers, args.p, rounds, args.seed)
    print(f"projection: {rounds} round attempts per cell, seed {args.seed}, payload {prm.payload_bytes / 1e6:.0f} MB, "
          f"H = {prm.inner_steps} x {prm.step_s} s, links {prm.uplink_mbps:g}/{prm.downlink_mbps:g} Mbit/s "
          f"(sigma {prm.link_sigma}), speeds sigma {prm.speed_sigma}, losses {prm.stall_frac:.0%} stalls, leaves "
          f"{prm.leave_frac} x p, restart {prm.restart_s:g} s")
    print(table(rows))
    print(f"({time.perf_counter() - begun:.1f} s)")
    if args.json:
        rows_out = [{k: v for k, v in r.items() if k != "log"} for r in rows]
        Path(args.json).write_text(json.dumps({"params": asdict(prm), "rows": rows_out}))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
