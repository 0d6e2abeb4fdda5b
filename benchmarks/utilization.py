"""Compute utilization: the share of a peer's wall time spent in inner steps, in the all-reduce, and waiting.

Loopback (default): a local swarm (``p2p-diloco swarm``, tiny model, one torch thread per peer) runs a few rounds at
each H; every peer logs, per round, the time in inner steps (``time/inner_s``), in the all-reduce once its group
formed (``outer/allreduce_only_s``) and the round's whole wall time (``time/round_s``: roster read and state check,
inner steps, pseudo-gradient, matchmaking, all-reduce, outer step; held-out evaluation excluded). Matchmaking
(``outer/allreduce_s - outer/allreduce_only_s``) is mostly waiting for the slowest peer of the group; "other" is the
rest (state check, pseudo-gradient, outer step). The first round is left out (it includes the peers' start-up skew).
Shares are pooled over the remaining rounds of every peer of a run; with ``--runs`` the table gives the median
over runs.

Rate-limited links (``--link MBIT``, needs root): each peer runs in its own network namespace (benchmarks/netlab.py)
on links shaped to MBIT Mbit/s both ways, with ``--model`` (default: a 7.2M-parameter model, 4 layers x 384, whose
16-bit all-reduce between 2 peers at 20 Mbit/s takes about as long as 10 inner steps of 2 x 32 tokens on one core
here) for each ``--codec`` x ``--overlap``. Reported: inner compute share of the wall time, the share spent waiting
for the average (``time/wait_s``: matchmaking and the all-reduce, or with overlap only what the next round's inner
steps did not hide), inner tokens/s, and that throughput relative to the same codec without overlap (what a
background all-reduce costs the inner steps on this CPU). Run:

    python benchmarks/utilization.py [--peers 2] [--h 50 --h 500] [--rounds 4] [--runs 3]
    sudo nice -n 10 python benchmarks/utilization.py --link 20 --h 10 --rounds 6 --runs 3 \\
        --codec scaled_fp16 --codec int4 --overlap none --overlap delayed --overlap eager
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from common import demo_config, median, rounds_of, swarm_records, table

SHARES = ("inner", "allreduce", "matchmaking", "other")
LINK_DEFAULTS = {"inner.batch_size": 2, "model.seq_len": 32, "inner.warmup_steps": 5, "run.eval_every": 0,
                 "run.checkpoint_every": 0, "averaging.matchmaking_time": 5.0, "averaging.next_chunk_timeout": 60.0,
                 "averaging.allreduce_timeout": 300.0, "averaging.roster_ttl": 15.0}


def measure(peers: int, h: int, rounds: int) -> dict:
    records = swarm_records(peers, rounds, h, demo_config(**{"run.eval_every": 0}), f"util-h{h}")
    rows = [r for recs in records.values() for r in rounds_of(recs) if r["committed"] and r["round"] > 1]
    if not rows:
        raise RuntimeError(f"H={h}: no committed round after the first")
    total = lambda key: sum(r[key] for r in rows)  # noqa: E731  (pooled over peers and rounds)
    wall = total("time/round_s")
    inner, allreduce = total("time/inner_s") / wall, total("outer/allreduce_only_s") / wall
    matchmaking = (total("outer/allreduce_s") - total("outer/allreduce_only_s")) / wall
    return {"h": h, "round_s": median(r["time/round_s"] for r in rows), "inner": inner, "allreduce": allreduce,
            "matchmaking": matchmaking, "other": 1 - inner - allreduce - matchmaking, "samples": len(rows),
            "tokens_per_s": total("train/tokens") / wall,
            "inner_tokens_per_s": total("train/tokens") / total("time/inner_s")}


def loopback(args) -> None:
    out = []
    for h in args.h or [50, 500]:
        runs = [measure(args.peers, h, args.rounds) for _ in range(args.runs)]
        for r in runs:
            print(r, flush=True)
        m = {k: median(r[k] for r in runs) for k in runs[0]}
        out.append([h, f"{m['round_s']:.1f}", *(f"{100 * m[k]:.1f}%" for k in SHARES),
                    f"{m['tokens_per_s']:.0f} / {m['inner_tokens_per_s']:.0f}", sum(r["samples"] for r in runs)])
    print(table(["H", "round s (median)", "inner compute", "all-reduce", "matchmaking (waiting for the group)",
                 "other (state check, pseudo-gradient, outer step)", "tokens/s per peer: whole round / inner only",
                 "peer-rounds"], out))


# ------------------------------------------------------------------------------------- rate-limited links
def payload_model(path: Path) -> str:
    """A 7.2M-parameter Llama config (4 x 384, MLP 1024, byte vocabulary): a payload the link notices."""
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=4, hidden_size=384, num_attention_heads=6, num_key_value_heads=6,
                intermediate_size=1024, vocab_size=256, max_position_embeddings=256,
                tie_word_embeddings=True).to_json_file(str(path / "config.json"))
    return str(path / "config.json")


def swarm_in_lab(lab, run_dir: Path, overrides: dict, rounds: int, h: int) -> dict[str, list[dict]]:
    """One run: a peer per namespace (peer0 starts the swarm, the others join through it); their round records."""
    import subprocess

    from p2p_diloco.config import load_config
    from p2p_diloco.ops.metrics import read_jsonl
    from p2p_diloco.ops.procs import stop_groups
    from p2p_diloco.ops.swarm import DEMO_DEFAULTS, write_peer_config

    args = write_peer_config(run_dir, load_config(defaults={**DEMO_DEFAULTS, **overrides}))
    args += [f"--run.rounds={rounds}", f"--diloco.inner_steps={h}", f"--run.expected_peers={lab.n}"]
    procs, initial = [], []
    try:
        for i in range(lab.n):
            peer_dir = run_dir / f"peer{i}"
            peer_dir.mkdir(parents=True, exist_ok=True)
            cmd = [*lab.exec_prefix(i), sys.executable, "-m", "p2p_diloco", "peer", *args, f"--run.name=peer{i}",
                   f"--run.run_dir={peer_dir}", f"--network.host_maddrs=/ip4/{lab.address(i)}/tcp/0"]
            if initial:
                cmd += ["--initial-peers", ",".join(initial)]
            log = open(run_dir / f"peer{i}.log", "w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
            if i == 0:
                initial = _wait_for_maddrs(peer_dir / "maddrs.txt", procs[0])
        deadline = time.monotonic() + 1800
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        stop_groups([p.pid for p in procs if p.poll() is None])
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a peer failed: see {run_dir}/peer*.log")
    return {f"peer{i}": read_jsonl(run_dir / f"peer{i}" / "metrics.jsonl") for i in range(lab.n)}


def _wait_for_maddrs(path: Path, proc, timeout: float = 120.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.is_file() and path.read_text().strip():
            return path.read_text().split()
        time.sleep(0.2)  # the peer writes the file once its DHT is up: nothing to wait on but the file
    raise RuntimeError(f"peer0 did not start (see {path.parent.parent}/peer0.log)")


def link_shares(records: dict[str, list[dict]]) -> dict:
    """Pooled over peers and rounds after the first: inner and waiting shares of the wall time, inner tokens/s.
    With overlap a record logs the commit of the round before it; the last one (no inner steps) is left out."""
    rows = [r for recs in records.values() for r in rounds_of(recs)
            if r["committed"] and r["round"] > 1 and r["time/inner_s"] > 0]
    if not rows:
        raise RuntimeError("no committed round after the first")
    total = lambda key: sum(r.get(key, 0.0) for r in rows)  # noqa: E731
    wall = total("time/round_s")
    waited = sum(r.get("time/wait_s", r["outer/allreduce_s"]) for r in rows)  # older records: the whole average
    return {"inner": total("time/inner_s") / wall, "wait": waited / wall,
            "round_s": median(r["time/round_s"] for r in rows), "allreduce_s": median(r["outer/allreduce_only_s"]
                                                                                      for r in rows),
            "inner_tokens_per_s": total("train/tokens") / total("time/inner_s"), "samples": len(rows)}


def rate_limited(args) -> None:
    from netlab import NetLab

    scratch = Path(tempfile.mkdtemp(prefix="util-link-"))
    model = args.model or payload_model(scratch)
    h = (args.h or [10])[0]
    results: dict[tuple, list[dict]] = {}
    with NetLab(args.peers) as lab:
        lab.set_rate(args.link)
        for run in range(args.runs):
            for codec in args.codec or ["scaled_fp16"]:
                for overlap in args.overlap or ["none"]:
                    overrides = {**LINK_DEFAULTS, "model.name": model, "averaging.codec": codec}
                    if overlap != "none":  # delayed-tN: delayed, settled after N inner steps (overlap_steps)
                        mode, _, tau = overlap.partition("-t")
                        overrides["diloco.overlap"] = mode
                        if tau:
                            overrides["diloco.overlap_steps"] = int(tau)
                    run_dir = scratch / f"{codec}-{overlap}-{run}"
                    shares = link_shares(swarm_in_lab(lab, run_dir, overrides, args.rounds, h))
                    results.setdefault((codec, overlap), []).append(shares)
                    print(json.dumps({"codec": codec, "overlap": overlap, "run": run, **shares}), flush=True)
    rows = []
    for (codec, overlap), runs in results.items():
        m = {k: median(r[k] for r in runs) for k in runs[0]}
        base = results.get((codec, "none"))
        rel = m["inner_tokens_per_s"] / median(r["inner_tokens_per_s"] for r in base) if base else None
        rows.append([codec, overlap, f"{m['round_s']:.1f}", f"{m['allreduce_s']:.1f}", f"{100 * m['inner']:.1f}%",
                     f"{100 * m['wait']:.1f}%", f"{m['inner_tokens_per_s']:.0f}", f"{rel:.3f}" if rel else "–",
                     sum(r["samples"] for r in runs)])
    print(f"\n{args.peers} peers, {args.link:g} Mbit/s links, H = {h}, model {model}; median of {args.runs} runs\n")
    print(table(["codec", "overlap", "round s", "all-reduce s", "inner compute", "waiting for the average",
                 "inner tokens/s", "inner tokens/s vs no overlap", "peer-rounds"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2, help="peers (default 2: one per core of this machine)")
    parser.add_argument("--h", type=int, action="append", help="inner steps per round (default 50 and 500; with "
                        "--link one value, default 10)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run; the first is not counted (default 4)")
    parser.add_argument("--runs", type=int, default=1, help="runs per setting; the table gives the median of each "
                        "column over them (default 1)")
    parser.add_argument("--link", type=float, help="run each peer in a network namespace with links of this many "
                        "Mbit/s (needs root)")
    parser.add_argument("--codec", action="append", help="with --link: averaging.codec values (default scaled_fp16)")
    parser.add_argument("--overlap", action="append", help="with --link: diloco.overlap values (default none); "
                        "delayed-tN: delayed with diloco.overlap_steps=N")
    parser.add_argument("--model", help="with --link: model.name (default: the 7.2M-parameter payload model)")
    args = parser.parse_args()
    rate_limited(args) if args.link else loopback(args)


if __name__ == "__main__":
    main()
