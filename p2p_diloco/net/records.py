"""The one seam where DHT records become Python values: every record this project reads from the DHT (the roster,
finished peers, the run index, the run settings, revocations, commit records) is checked here, and so is every
record another node asks our DHT node to store under one of the run's keys
(:class:`p2p_diloco.net.security.schema.RunRecordValidator`).

A record is valid only if
  * its subkey is a base58 PeerID (so that net/security/records.py's signature check applies to it: the record was
    signed by that peer's own key) and, where the value names a peer (the roster's ``peer_id``), that same PeerID;
  * its value has the kind's shape: typed fields (an int is an int, never a bool or a string), ints and floats
    within bounds, floats finite, strings bounded and, for names shown to people, without control characters;
  * it is among the first :data:`MAX_ENTRIES` of its key (a key holding more is read in part: the rest is ignored).

An invalid record is dropped and counted (:data:`DROPPED`, and Prometheus through ops/telemetry.py where present),
logged once per (author, reason), and never raised: a stranger's record cannot stop a peer.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import fields
from typing import Any, Callable, Iterable, Mapping, Optional

from p2p_diloco.net.certificate import KEPT as KEPT_COMMITS
from p2p_diloco.net.consensus import PeerStatus

logger = logging.getLogger(__name__)

MAX_ENTRIES = 4096     # subkeys read per key; a larger key is read in part (the rest is ignored and counted)
MAX_NAME = 64          # characters of a peer name, after control characters are stripped
MAX_ROUND = 2 ** 31    # rounds: far above any run (a round a minute for 4000 years)
MAX_COUNT = 2 ** 62    # tokens, bytes
MAX_RATE = 1e12        # tokens/s, steps/s
MAX_SECONDS = 1e7      # a duration (s)
MAX_LOSS = 1e4         # a training loss (nats per token: ln(vocabulary) is far below)
MAX_SETTINGS = 256     # keys of a published run-settings entry
MAX_TEXT = 4096        # characters of a string setting
MAX_LIST = 64          # items of a list setting
REACHABILITY = ("public", "relayed", "client", "unknown")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")
_HEX = re.compile(r"[0-9a-f]{0,128}")
_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,200}")
_MAC = re.compile(r"[0-9a-f]{64}")
_SIG = re.compile(r"[0-9a-f]{128}")  # an Ed25519 signature, hex
_PEER = re.compile(r"[1-9A-HJ-NP-Za-km-z]{40,60}")  # a base58 PeerID
_SETTING = re.compile(r"[a-z0-9_]{1,32}\.[a-z0-9_]{1,64}")

DROPPED: dict[tuple[str, str], int] = {}  # (kind, reason) -> records dropped by this process
_LOGGED: set = set()
_LOG_LIMIT = 4096  # (author, reason) pairs logged; beyond, drops are only counted


class RecordError(ValueError):
    """Why a record is invalid (a short reason, the same for every record with that fault: it labels a counter)."""


def count_dropped_record(kind: str, reason: str, author: str = "?") -> None:
    """Count one dropped record of ``kind`` ("roster", ...) for ``reason``; log it once per (author, reason)."""
    DROPPED[(kind, reason)] = DROPPED.get((kind, reason), 0) + 1
    try:
        from p2p_diloco.ops import telemetry
    except ImportError:
        telemetry = None
    if telemetry is not None and hasattr(telemetry, "count_dropped_record"):
        try:
            telemetry.count_dropped_record(kind, reason)
        except Exception as e:  # a metrics failure must not stop a peer either
            logger.debug(f"counting a dropped record failed: {e!r}")
    if (author, reason) not in _LOGGED and len(_LOGGED) < _LOG_LIMIT:
        _LOGGED.add((author, reason))
        logger.warning(f"ignored {kind} record(s) from {clean_text(author, 60)!r}: {reason}")


def clean_text(value: str, limit: int = MAX_NAME) -> str:
    """``value`` without control or bidi characters, at most ``limit`` characters (for terminals and logs)."""
    return _CONTROL.sub("", value)[:limit]


# ---------------------------------------------------------------------------------------------- fields
def integer(value: Any, what: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if type(value) is not int:  # bool is an int subclass: refused as well
        raise RecordError(f"{what} is not an integer")
    if not low <= value <= high:
        raise RecordError(f"{what} out of range")
    return value


def real(value: Any, what: str, low: float = 0.0, high: float = MAX_RATE) -> float:
    if type(value) not in (int, float):
        raise RecordError(f"{what} is not a number")
    value = float(value)
    if not math.isfinite(value) or not low <= value <= high:
        raise RecordError(f"{what} not finite or out of range")
    return value


def flag(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise RecordError(f"{what} is not a boolean")
    return value


def text(value: Any, what: str, limit: int, pattern: Optional[re.Pattern] = None) -> str:
    if type(value) is not str or len(value) > limit:
        raise RecordError(f"{what} is not a string of at most {limit} characters")
    if pattern is not None and not pattern.fullmatch(value):
        raise RecordError(f"{what} is malformed")
    return value


def author(subkey: Any) -> str:
    """The PeerID (base58) a record's subkey names; RecordError if it names none."""
    if type(subkey) is not str or not 40 <= len(subkey) <= 60 or not _names_a_peer(subkey):
        raise RecordError("subkey is not a peer id")
    return subkey


@functools.lru_cache(maxsize=8192)
def _names_a_peer(subkey: str) -> bool:
    # base58 decoding is pure Python (~0.5 ms): a roster read sees the same peers again and again
    from p2p_diloco.net.security.identity import peer_id_bytes  # hivemind's PeerID: kept out of the pure checks

    return peer_id_bytes(subkey) is not None


def _mapping(value: Any) -> dict:
    if not isinstance(value, dict):  # what msgpack decodes a map to (a typing.Mapping check costs 10 x more)
        raise RecordError("value is not a dictionary")
    return value


# ---------------------------------------------------------------------------------------------- kinds
_STATUS_FIELDS = {f.name for f in fields(PeerStatus)}


def roster_entry(subkey: Any, value: Any) -> PeerStatus:
    """A :class:`PeerStatus` from a roster record. Unknown fields (a newer peer's) are ignored, missing optional
    ones take their default."""
    peer = author(subkey)
    v = _mapping(value)
    if v.get("peer_id") != peer:
        raise RecordError("peer_id differs from the subkey")
    for required in ("name", "round", "digest"):
        if required not in v:
            raise RecordError(f"{required} missing")
    status = PeerStatus(name=clean_text(text(v["name"], "name", 4 * MAX_NAME)), peer_id=peer,
                        round=integer(v["round"], "round", 0, MAX_ROUND), digest=text(v["digest"], "digest", 128, _HEX))
    checks: dict[str, Callable[[Any, str], Any]] = {
        "leaving": flag, "donor": flag, "tokens_per_s": real, "tokens_trained": integer, "last_bytes": integer,
        "last_allreduce_s": lambda x, w: real(x, w, 0.0, MAX_SECONDS), "steps_per_s": real,
        "last_round": lambda x, w: integer(x, w, 0, MAX_ROUND), "last_steps": integer, "last_planned_steps": integer,
        "last_loss": lambda x, w: real(x, w, 0.0, MAX_LOSS), "missed_rounds": lambda x, w: integer(x, w, 0, MAX_ROUND),
        "reachability": lambda x, w: text(x, w, 16) if x in REACHABILITY else _raise(f"{w} is unknown")}
    for name, check in checks.items():
        if name in v and name in _STATUS_FIELDS:
            setattr(status, name, check(v[name], name))
    return status


def _raise(reason: str):
    raise RecordError(reason)


def finished_entry(subkey: Any, value: Any) -> tuple[str, str, int]:
    """(peer id, name, round) from a "finished the run" record."""
    peer = author(subkey)
    v = _mapping(value)
    return peer, clean_text(text(v.get("name"), "name", 4 * MAX_NAME)), integer(v.get("round"), "round", 0, MAX_ROUND)


def run_index_entry(subkey: Any, value: Any) -> str:
    """The run prefix a run-index record announces."""
    author(subkey)
    v = _mapping(value)
    text(v.get("fingerprint"), "fingerprint", 128)
    return text(v.get("prefix"), "prefix", 200, _PREFIX)


def settings_entry(subkey: Any, value: Any) -> dict:
    """A run-settings record: ``{"settings": {"section.key": value}, "fingerprint": str}``, values JSON scalars or
    short lists of them (what config values are)."""
    author(subkey)
    v = _mapping(value)
    text(v.get("fingerprint"), "fingerprint", 128)
    settings = _mapping(v.get("settings"))
    if len(settings) > MAX_SETTINGS:
        raise RecordError("too many settings")
    for key, item in settings.items():
        text(key, "a setting's name", 97, _SETTING)
        for one in (item if isinstance(item, list) and len(item) <= MAX_LIST else [item]):
            if one is None or type(one) in (bool, int) or (type(one) is float and math.isfinite(one)):
                continue
            if type(one) is not str or len(one) > MAX_TEXT:
                raise RecordError("a setting has an unusable value")
    return {"settings": dict(settings), "fingerprint": v["fingerprint"]}


def revocation_entry(subkey: Any, value: Any) -> tuple[str, dict]:
    """(revoked peer, record) from a well-formed revocation record (its MAC is checked with the run's keys, in
    net/security/access.py)."""
    peer = author(subkey)
    v = _mapping(value)
    if type(v.get("at")) is not float:
        raise RecordError("at is not a float")
    real(v["at"], "at", 0.0, 1e11)
    text(v.get("mac"), "mac", 64, _MAC)
    out = {"at": v["at"], "mac": v["mac"]}
    if "by" in v or "sig" in v:  # signed by one of the run's revokers (net/security/access.py)
        out["by"] = text(v.get("by"), "by", 60, _PEER)
        out["sig"] = text(v.get("sig"), "sig", 128, _SIG)
    return peer, out


def commits_entry(subkey: Any, value: Any) -> tuple[str, list[tuple[int, str]]]:
    """(peer, [(round, digest), ...]) from a commit record: the rounds its author committed as a member of the
    group, at most :data:`~p2p_diloco.net.certificate.KEPT` (net/certificate.py)."""
    peer = author(subkey)
    v = _mapping(value)
    if v.get("peer_id") != peer:
        raise RecordError("peer_id differs from the subkey")
    commits = v.get("commits")
    if not isinstance(commits, list) or len(commits) > KEPT_COMMITS:
        raise RecordError(f"commits is not a list of at most {KEPT_COMMITS}")
    out = []
    for item in commits:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise RecordError("a commit is not a (round, digest) pair")
        out.append((integer(item[0], "a commit's round", 1, MAX_ROUND), text(item[1], "a commit's digest", 128, _HEX)))
    return peer, out


KINDS: dict[str, Callable[[Any, Any], Any]] = {
    "roster": roster_entry, "finished": finished_entry, "runs": run_index_entry, "config": settings_entry,
    "revoked": revocation_entry, "commits": commits_entry}


def check(kind: str, subkey: Any, value: Any) -> Any:
    """The parsed record, or RecordError."""
    return KINDS[kind](subkey, value)


def valid_entries(kind: str, entries: Mapping[Any, Any], value_of: Callable[[Any], Any] = lambda e: e) -> list:
    """The parsed valid records among ``entries`` (subkey → record; ``value_of`` takes a record's value), in subkey
    order, at most :data:`MAX_ENTRIES`; every other one dropped and counted, never raised."""
    out = []
    for i, subkey in enumerate(_ordered(entries)):
        if i >= MAX_ENTRIES:
            count_dropped_record(kind, "too many entries under one key", "?")
            break
        try:
            out.append(check(kind, subkey, value_of(entries[subkey])))
        except RecordError as e:
            count_dropped_record(kind, str(e), str(subkey))
        except Exception as e:  # anything else a crafted value triggers is a bad record too, never a crash
            count_dropped_record(kind, f"unreadable ({type(e).__name__})", str(subkey))
    return out


def _ordered(entries: Mapping) -> Iterable:
    try:
        return sorted(entries, key=lambda k: (type(k).__name__, str(k)))
    except Exception:  # keys no str() can render: keep the DHT's order
        return list(entries)
