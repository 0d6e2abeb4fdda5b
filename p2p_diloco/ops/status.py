"""``p2p-diloco status``: a read-only view of a live run, from the DHT, without joining it as a trainer.

The view starts a client-mode DHT node (it stores nothing for others and is never in a group), finds the run's
prefixes in the run index (``{safe_run_id}.runs``, see :mod:`p2p_diloco.net.keys`), and reads each prefix's roster.
A peer appears while its roster entry lives: a dead peer disappears ``averaging.roster_ttl`` seconds (of the run's
peers) after its last heartbeat. :func:`describe_run` and :func:`render` are pure.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict
from typing import Callable, Optional, Sequence

from p2p_diloco.config import Config
from p2p_diloco.net.consensus import PeerStatus, majority_state
from p2p_diloco.ops.standing import MISSED_ROUNDS_WARN

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def describe_run(prefix: str, roster: Sequence[PeerStatus]) -> dict:
    """One prefix of a run, from its roster: the run's state (the latest round any live peer committed, and the
    digest most of them hold for it, as peers themselves decide) and every peer against it: ``agrees``,
    ``behind`` (an older round: ``rounds_behind`` of them) or ``differs`` (other bytes for the same round)."""
    live = [s for s in roster if not s.leaving]
    basis = live or list(roster)
    latest = max(s.round for s in basis)
    round_, digest = majority_state([(s.round, s.digest) for s in basis if s.round == latest])
    peers = []
    for s in sorted(roster, key=lambda s: s.name):
        state = "agrees" if (s.round, s.digest) == (round_, digest) else "behind" if s.round < round_ else "differs"
        peers.append({**asdict(s), "state": state, "reachability": getattr(s, "reachability", None),
                      "rounds_behind": max(0, round_ - s.round)})
    at_latest = Counter(s.digest for s in basis if s.round == latest)
    return {"prefix": prefix, "fingerprint": prefix.rsplit("_", 1)[-1], "round": round_, "digest": digest,
            # digest → live peers holding it at the latest round; more than one: the round forked
            "digests": dict(sorted(at_latest.items(), key=lambda kv: (-kv[1], kv[0]))),
            "live_peers": len(live), "agreeing_peers": sum(p["state"] == "agrees" for p in peers if not p["leaving"]),
            # tokens of the peers now in the roster: a peer gone for longer than the roster TTL no longer counts
            "tokens_trained": sum(s.tokens_trained for s in roster),
            "tokens_per_s": sum(s.tokens_per_s for s in live), "peers": peers}


def read_status(dht, run_id: str, timeout: float) -> dict:
    """The run's current view (JSON-ready): every prefix announced in the run index that has live entries."""
    from p2p_diloco.net.keys import read_roster, read_run_index

    runs = []
    for prefix in read_run_index(dht, run_id, timeout):
        roster = read_roster(dht, prefix, timeout)
        if roster:
            runs.append(describe_run(prefix, roster))
    return {"run_id": run_id, "time": time.time(), "runs": runs}


# ---------------------------------------------------------------------------------------------- rendering

def render(view: dict) -> str:
    """The view as a text table (one block per prefix of the run)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(view["time"]))
    if not view["runs"]:
        return f"run {view['run_id']!r}: no peer found ({stamp}); is the run id right, and the run alive?"
    lines = []
    for run in view["runs"]:
        lines.append(f"run {view['run_id']!r}: round {run['round']}, {run['live_peers']} live peer(s), "
                     f"{_si(run['tokens_trained'])} tokens trained, {_si(run['tokens_per_s'])} tokens/s  ({stamp})")
        lines.append(f"  prefix {run['prefix']}; state {run['digest'][:12]} held by {run['agreeing_peers']} of "
                     f"{run['live_peers']} live peer(s)")
        if len(run.get("digests", {})) > 1:
            lines.append(f"  FORK at round {run['round']}: " + ", ".join(
                f"{n} peer(s) on {d[:12]}" for d, n in run["digests"].items()))
        lines.append(f"  {'peer':<16} {'round':>5}  {'digest':<12}  {'state':<7} {'tokens/s':>8} {'tokens':>7}  "
                     f"{'last all-reduce':>15} {'reachability':<12} leaving")
        for p in run["peers"]:
            last = f"{p['last_allreduce_s']:.2f} s {_si(p['last_bytes'])}B" if p["last_allreduce_s"] else "-"
            lines.append(f"  {p['name'][:16]:<16} {p['round']:>5}  {p['digest'][:12]:<12}  {p['state']:<7} "
                         f"{_si(p['tokens_per_s']):>8} {_si(p['tokens_trained']):>7}  {last:>15} "
                         f"{p['reachability'] or '-':<12} {'yes' if p['leaving'] else 'no'}")
        out = [p for p in run["peers"] if not p["leaving"] and max(p.get("rounds_behind", 0),
                                                                   p.get("missed_rounds", 0)) >= MISSED_ROUNDS_WARN]
        if out:  # the run commits without them (each says so in its own log too: ops/standing.py)
            lines.append(f"  NOT IN THE RUN (round {run['round']}): " + ", ".join(map(_out_of_run, out)))
    return "\n".join(lines)


def _out_of_run(p: dict) -> str:
    if p.get("rounds_behind", 0) >= MISSED_ROUNDS_WARN:
        return f"{p['name'][:16]} at round {p['round']}, {p['rounds_behind']} behind"
    # it holds the run's round, by download: its own count says the run committed them without it
    return f"{p['name'][:16]} at round {p['round']}, committed none of the last {p['missed_rounds']} (downloads them)"


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


# ---------------------------------------------------------------------------------------------- the command

def run_status(cfg: Config, watch: Optional[float], as_json: bool, stop: threading.Event,
               echo: Callable[[str], None] = print) -> int:
    """Print the run's view once, or every ``watch`` seconds until ``stop`` is set (JSON: one object per line)."""
    from p2p_diloco.net.dht import start_dht

    dht = start_dht(cfg.network, client_mode=True)
    try:
        while True:
            view = read_status(dht, cfg.run.run_id, cfg.averaging.request_timeout)
            text = json.dumps(view) if as_json else render(view)
            if watch and not as_json:  # a terminal shows the latest view only; a file or pipe gets them all
                text = CLEAR_SCREEN + text if sys.stdout.isatty() else text + "\n"
            echo(text)
            if not watch or stop.wait(watch):
                return 0
    finally:
        dht.shutdown()
