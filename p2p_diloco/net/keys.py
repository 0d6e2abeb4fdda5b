"""Every DHT key this project writes or reads, with their writers and readers (the DHT node itself: net/dht.py).

Keys under the run's prefix ``{safe_run_id}_{fingerprint}``, so runs and model shapes never mix:
  * ``{prefix}.0b...``           hivemind matchmaking (written by hivemind's averager)
  * ``{prefix}.all_averagers``   state donors, priority = round (written by hivemind's averager)
  * ``{prefix}.roster``          every peer's PeerStatus (round, digest of θ_global and momentum, leaving, its
                                 measured speed for DyLU), one subkey per peer id
  * ``{prefix}.finished``        peers that left after training all of ``run.rounds``: subkey peer id, value
                                 ``{"name": str, "round": int}``, kept an hour so that a peer finishing later (its
                                 roster alone, the leavers' entries expired) learns that the run is over
  * ``{prefix}.commits``         the rounds each peer committed as a member of the group: subkey peer id, value
                                 ``{"peer_id": str, "commits": [[round, digest], ...]}`` (its last 8), signed in its
                                 name and kept an hour, so that a member's signature outlives it: the commit
                                 certificates joiners and repairs check (net/certificate.py)

Run-level keys (``{safe_run_id}``: the run_id with characters other than letters, digits, ``_`` and ``-`` as ``_``):
  * ``{safe_run_id}.runs``       index of the run's prefixes: subkey = peer id, value = {"prefix": ...,
                                 "fingerprint": ...},
                                 refreshed with the roster heartbeat, so ``p2p-diloco status`` finds every
                                 prefix of a run knowing only its run_id
  * ``{safe_run_id}.config``     the run's shared settings: subkey = peer id, value ``{"settings": {"section.key":
                                 value}, "fingerprint": str}``, refreshed with the roster heartbeat; read by joiners
                                 to adopt them or be refused on a mismatch (net/run_settings.py)
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.net.consensus import PeerStatus
from p2p_diloco.net.records import valid_entries

logger = logging.getLogger(__name__)


def safe_run_id(run_id: str) -> str:
    """``run_id`` with every character other than letters, digits, ``_`` and ``-`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", run_id)


def run_prefix(run_id: str, fingerprint: str) -> str:
    """Namespace of one run: peers with another run_id, model or codec never group with us."""
    return f"{safe_run_id(run_id)}_{fingerprint}"


# ---------------------------------------------------------------------------------------------- the roster
# {prefix}.roster: one subkey per peer id, value = asdict(PeerStatus), expiring unless refreshed (heartbeat).

def roster_key(prefix: str) -> str:
    return f"{prefix}.roster"


def publish_status(dht: hivemind.DHT, prefix: str, status: PeerStatus, ttl: float, timeout: float) -> bool:
    """Store this peer's status for ``ttl`` seconds; False if the DHT did not confirm within ``timeout`` seconds."""
    future = dht.store(roster_key(prefix), subkey=status.peer_id, value=asdict(status),
                       expiration_time=get_dht_time() + ttl, return_future=True)
    try:
        return bool(future.result(timeout=timeout))
    except Exception as e:  # a DHT hiccup must never crash a peer: the status is refreshed by the next heartbeat
        logger.debug(f"publishing status failed: {e!r}")
        return False


def read_roster(dht: hivemind.DHT, prefix: str, timeout: float) -> list[PeerStatus]:
    """Every valid unexpired peer status of the run (net/records.py: invalid entries are dropped and counted);
    [] if the DHT does not answer."""
    return [status for status, _ in read_roster_expiring(dht, prefix, timeout)]


def read_roster_expiring(dht: hivemind.DHT, prefix: str, timeout: float) -> list[tuple[PeerStatus, float]]:
    """:func:`read_roster` with each entry's expiration time (DHT time)."""
    entries = _read_subkeys(dht, roster_key(prefix), timeout, "the roster")
    expiring = {str(k): float(getattr(v, "expiration_time", 0.0)) for k, v in entries.items()}
    return [(s, expiring.get(s.peer_id, 0.0)) for s in valid_entries("roster", entries, _value)]


def _value(entry):
    return entry.value


# ---------------------------------------------------------------------------------------------- the run index
# {safe_run_id}.runs: one subkey per peer id, value = {"prefix": ..., "fingerprint": ...}, expiring unless refreshed.

def run_index_key(run_id: str) -> str:
    return f"{safe_run_id(run_id)}.runs"


def publish_run_index(dht: hivemind.DHT, run_id: str, prefix: str, fingerprint: str, ttl: float) -> None:
    """Announce that ``prefix`` belongs to ``run_id`` for ``ttl`` seconds, without waiting for the store: the
    roster heartbeat that calls this must stay on time (a late heartbeat lets a live peer's entry expire), and
    a lost announcement only hides the run from ``status`` until the next heartbeat."""
    _store_nowait(dht, run_index_key(run_id), str(dht.peer_id), {"prefix": prefix, "fingerprint": fingerprint}, ttl)


def read_run_index(dht: hivemind.DHT, run_id: str, timeout: float) -> list[str]:
    """The prefixes of ``run_id`` announced within the roster TTL, sorted; [] if none or the DHT does not answer."""
    return sorted(set(valid_entries("runs", _read_subkeys(dht, run_index_key(run_id), timeout, "the run index"),
                                    _value)))


def _store_nowait(dht: hivemind.DHT, key: str, subkey: str, value: dict, ttl: float) -> None:
    """Store ``value`` under ``key``/``subkey`` for ``ttl`` seconds; the future is dropped: nobody waits."""
    dht.store(key, subkey=subkey, value=value, expiration_time=get_dht_time() + ttl, return_future=True)


def _read_subkeys(dht: hivemind.DHT, key: str, timeout: float, what: str) -> dict:
    """Every unexpired subkey of ``key`` (subkey → ValueWithExpiration); {} if none or the DHT does not answer."""
    future = dht.get(key, latest=True, return_future=True)
    try:
        found = future.result(timeout=timeout)
    except Exception as e:
        logger.debug(f"reading {what} failed: {e!r}")
        return {}
    return found.value if found is not None and isinstance(found.value, dict) else {}


# ---------------------------------------------------------------------------------------------- run settings
# {safe_run_id}.config: one subkey per peer id, value = {"settings": {...}, "fingerprint": str}, expiring unless
# refreshed (heartbeat).

def run_settings_key(run_id: str) -> str:
    return f"{safe_run_id(run_id)}.config"


def publish_run_settings(dht: hivemind.DHT, run_id: str, peer_id: str, settings: dict, fingerprint: str,
                         ttl: float) -> None:
    """Publish the run settings this peer trains with for ``ttl`` seconds, without waiting for the store (as the
    run index: the heartbeat that calls this must stay on time; a lost store is redone by the next heartbeat)."""
    _store_nowait(dht, run_settings_key(run_id), peer_id, {"settings": settings, "fingerprint": fingerprint}, ttl)


def read_run_settings(dht: hivemind.DHT, run_id: str, timeout: float) -> list[dict]:
    """Every unexpired published run settings entry of ``run_id``; [] if none or if the DHT does not answer."""
    return valid_entries("config", _read_subkeys(dht, run_settings_key(run_id), timeout, "run settings"), _value)


# ---------------------------------------------------------------------------------------------- finished peers
# {prefix}.finished: one subkey per peer id, value = {"name": str, "round": int}.

def finished_key(prefix: str) -> str:
    return f"{prefix}.finished"


def publish_finished(dht: hivemind.DHT, prefix: str, peer_id: str, name: str, round_: int, ttl: float,
                     timeout: float) -> bool:
    future = dht.store(finished_key(prefix), subkey=peer_id, value={"name": name, "round": round_},
                       expiration_time=get_dht_time() + ttl, return_future=True)
    try:
        return bool(future.result(timeout=timeout))
    except Exception as e:  # the roster's leaving entry says as much while it lives
        logger.debug(f"publishing the end of our run failed: {e!r}")
        return False


def read_finished(dht: hivemind.DHT, prefix: str, timeout: float) -> list[tuple[str, str, int]]:
    """(peer id, name, round) of every peer that left after training the whole run; [] if none or no answer."""
    return valid_entries("finished", _read_subkeys(dht, finished_key(prefix), timeout, "finished peers"), _value)


# ---------------------------------------------------------------------------------------------- commit records
# {prefix}.commits: one subkey per peer id, value = {"peer_id": str, "commits": [[round, digest], ...]}.

COMMITS_TTL = 3600.0  # s a commit record lasts after its last refresh: a member's signature outlives the member


def commits_key(prefix: str) -> str:
    return f"{prefix}.commits"


def publish_commits(dht: hivemind.DHT, prefix: str, peer_id: str, commits: list, ttl: float = COMMITS_TTL):
    """Store the (round, digest) pairs this peer committed; returns the store's future (None if nothing to store)."""
    if not commits:
        return None
    value = {"peer_id": peer_id, "commits": [list(c) for c in commits]}
    return dht.store(commits_key(prefix), subkey=peer_id, value=value, expiration_time=get_dht_time() + ttl,
                     return_future=True)


def commits_bytes(commits: list) -> int:
    """Bytes of the value :func:`publish_commits` stores for ``commits`` (before the signature's seal)."""
    from hivemind.utils import MSGPackSerializer

    return len(MSGPackSerializer.dumps({"peer_id": "x" * 52, "commits": [list(c) for c in commits]}))


def read_commits(dht: hivemind.DHT, prefix: str, timeout: float) -> dict[str, list[tuple[int, str]]]:
    """Every valid commit record of the run: peer id → its (round, digest) pairs; {} if the DHT does not answer."""
    return dict(valid_entries("commits", _read_subkeys(dht, commits_key(prefix), timeout, "commit records"), _value))
