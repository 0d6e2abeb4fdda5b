"""PURE: what the run page (``p2p-diloco web``, ops/web.py) shows, as JSON, from the run's records.

Every record comes from the DHT and is untrusted: each value shown is typed here (text, a finite number or None)
and bounded (text truncated, at most :data:`MAX_PEERS` peers and :data:`MAX_ROUNDS` rounds per prefix, at most
:data:`MAX_PREFIXES` prefixes), so that the page stays cheap for a run of a thousand peers and a forged record
cannot make it large. The browser renders what it gets as text only (web_assets/app.js).

The roster holds each peer's latest round and digest, not its history: the rounds listed are those this page saw
while it ran (:class:`RoundHistory`), each with the digests its peers held (more than one: a fork) and who held
each.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import OrderedDict
from typing import Any, Optional

MAX_PREFIXES = 8      # prefixes of the run shown (a run has one unless its peers disagree on the model or codec)
MAX_PEERS = 200       # peers sent per prefix, the ones that disagree with the run first; the rest are counted
MAX_GONE = 50         # peers whose entry expired, kept for GONE_KEEP_S seconds
GONE_KEEP_S = 600.0
MAX_ROUNDS = 30       # rounds kept per prefix
MAX_NAMES = 20        # peer names listed per (round, digest); the rest are counted
MAX_TRACKED = 5000    # peers remembered per (round, digest): a forged roster cannot grow memory without bound
MAX_SETTINGS = 120    # run settings shown
NAME_CHARS = 64
TEXT_CHARS = 160
DIGEST_CHARS = 64
STATE_ORDER = {"differs": 0, "behind": 1, "agrees": 2}


def text(value: Any, limit: int = TEXT_CHARS) -> str:
    """``value`` as a string of at most ``limit`` characters (an ellipsis marks the cut)."""
    s = value if isinstance(value, str) else "" if value is None else str(value)
    return s if len(s) <= limit else s[:limit - 1] + "…"


def number(value: Any) -> Optional[float]:
    """A finite int or float as is, anything else (NaN, a string, a bool) as None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def count(value: Any) -> int:
    """A non-negative int, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def peer_row(p: dict, last_seen: float) -> dict:
    """One peer of ops/status.py's view, bounded and typed."""
    steps, planned = p.get("last_steps"), p.get("last_planned_steps")
    return {"name": text(p.get("name"), NAME_CHARS), "peer_id": text(p.get("peer_id"), NAME_CHARS),
            "state": text(p.get("state"), 16), "round": count(p.get("round")),
            "digest": text(p.get("digest"), DIGEST_CHARS), "reachability": text(p.get("reachability"), 16),
            "leaving": p.get("leaving") is True, "tokens_per_s": number(p.get("tokens_per_s")),
            "steps_per_s": number(p.get("steps_per_s")), "tokens_trained": number(p.get("tokens_trained")),
            # steps done and planned in its last round, where its record has them (0 and 0: none yet, or an older peer)
            "steps_done": count(steps) if count(steps) or count(planned) else None,
            "steps_planned": count(planned) if count(steps) or count(planned) else None,
            "last_round": count(p.get("last_round")) or None,  # the round those steps, this loss and all-reduce are about
            "loss": number(p.get("last_loss")) or None,  # 0: the peer has none yet
            "allreduce_s": number(p.get("last_allreduce_s")),
            # rounds the run committed since its last committed one (ops/standing.py): a peer only downloading them
            "missed_rounds": count(p.get("missed_rounds")),
            "bytes": number(p.get("last_bytes")), "last_seen": last_seen}


class RoundHistory:
    """Rounds as the page saw them, per prefix: round → digest → peers (id → name) that held it; and round → peer
    → (all-reduce s, loss) from the records whose ``last_round`` is that round and that hold it (a peer publishes
    its new round before the numbers of the attempt that reached it). Bounded (newest rounds kept)."""

    def __init__(self, max_rounds: int = MAX_ROUNDS):
        self.max_rounds = max_rounds
        self.rounds: dict[str, OrderedDict] = {}  # prefix → round → digest → peer id → name
        self.numbers: dict[str, dict] = {}  # prefix → round → peer id → (allreduce_s, loss)

    def observe(self, prefix: str, peers: list[dict]) -> None:
        rounds = self.rounds.setdefault(prefix, OrderedDict())
        numbers = self.numbers.setdefault(prefix, {})
        for p in peers:
            if p["round"] <= 0:  # round 0 is the initial state: no round was committed
                continue
            holders = rounds.setdefault(p["round"], {}).setdefault(p["digest"], {})
            if p["peer_id"] in holders or len(holders) < MAX_TRACKED:
                holders[p["peer_id"]] = p["name"]
            about = p.get("last_round") or 0
            if 0 < about <= p["round"] and about in rounds:  # its last attempt reached a round it holds
                mine = numbers.setdefault(about, {})
                if p["peer_id"] in mine or len(mine) < MAX_TRACKED:
                    mine[p["peer_id"]] = (p["allreduce_s"], p["loss"])
        for old in sorted(rounds)[:-self.max_rounds]:
            del rounds[old]
            numbers.pop(old, None)

    def forget(self, keep: set[str]) -> None:
        for prefix in set(self.rounds) - keep:
            del self.rounds[prefix]
            self.numbers.pop(prefix, None)

    def view(self, prefix: str) -> list[dict]:
        """Newest round first: its digests (most holders first), whether it forked, median all-reduce and loss."""
        out = []
        for round_, digests in sorted(self.rounds.get(prefix, {}).items(), reverse=True):
            entries = list(self.numbers.get(prefix, {}).get(round_, {}).values())
            times = [t for t, _ in entries if t is not None]
            losses = [x for _, x in entries if x is not None]
            listed = sorted(digests.items(), key=lambda kv: (-len(kv[1]), kv[0]))
            out.append({"round": round_, "fork": len(digests) > 1, "committed_by": sum(map(len, digests.values())),
                        "allreduce_s": statistics.median(times) if times else None,
                        "loss": statistics.fmean(losses) if losses else None,
                        "digests": [{"digest": d, "peers": len(h), "names": sorted(h.values())[:MAX_NAMES]}
                                    for d, h in listed]})
        return out


def bounded_settings(settings: Optional[dict]) -> dict[str, str]:
    """The run settings most peers publish, each value as short JSON text."""
    if not isinstance(settings, dict):
        return {}
    keys = sorted(str(k) for k in settings)[:MAX_SETTINGS]
    return {text(k, 80): text(json.dumps(settings[k], default=str), TEXT_CHARS) for k in keys}


def run_view(run: dict, gone: list[dict], history: RoundHistory) -> dict:
    """One prefix of ops/status.py's view (:func:`describe_run`), bounded, with the rounds seen and the peers gone."""
    peers = sorted(run["peers"], key=lambda p: (STATE_ORDER.get(p["state"], 0), p["name"]))
    return {"prefix": text(run["prefix"]), "fingerprint": text(run["fingerprint"]), "round": count(run["round"]),
            "digest": text(run["digest"], DIGEST_CHARS),
            "digests": [{"digest": d, "peers": n} for d, n in list(run["digests"].items())[:MAX_NAMES]],
            "fork": len(run["digests"]) > 1, "live_peers": run["live_peers"],
            "agreeing_peers": run["agreeing_peers"], "tokens_trained": number(run["tokens_trained"]),
            "tokens_per_s": number(run["tokens_per_s"]), "peers_total": len(peers),
            "peers": peers[:MAX_PEERS], "gone": gone[:MAX_GONE], "gone_total": len(gone),
            "rounds": history.view(run["prefix"])}


def page_view(run_id: str, runs: list[dict], settings: dict, read_at: Optional[float], now: float,
              error: Optional[str], refresh_s: float) -> dict:
    """The JSON of ``/api/run``."""
    return {"run_id": text(run_id), "time": now, "read_at": read_at, "refresh_s": refresh_s,
            "error": text(error) if error else None, "settings": settings, "runs_total": len(runs),
            "runs": runs[:MAX_PREFIXES]}
