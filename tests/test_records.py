"""Every DHT record validated at one seam (net/records.py), on read and on store (net/security/schema.py): typed and
bounded fields, a subkey that is a PeerID equal to the value's, a valid signature, a cap on entries per key."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer as S

from p2p_diloco.net import records
from p2p_diloco.net.consensus import PeerStatus
from p2p_diloco.net.records import DROPPED, RecordError, check, valid_entries
from p2p_diloco.net.security.access import AccessKeys
from p2p_diloco.net.security.identity import Identity
from p2p_diloco.net.security.records import PeerSignatureValidator
from p2p_diloco.net.security.schema import RunRecordValidator

A, B = Identity.generate(), Identity.generate()


def entry(identity=A, **changes) -> dict:
    status = PeerStatus(name="alice", peer_id=identity.peer_id_b58, round=3, digest="ab" * 32, steps_per_s=1.5,
                        tokens_trained=100, reachability="public")
    return {**asdict(status), **changes}


def dropped(kind: str) -> int:
    return sum(n for (k, _), n in DROPPED.items() if k == kind)


@pytest.mark.timeout(10)
def test_a_valid_roster_entry_parses_to_its_status():
    status = check("roster", A.peer_id_b58, entry())
    assert status == PeerStatus(**entry())
    older = {k: v for k, v in entry().items() if k not in ("steps_per_s", "reachability")}
    assert check("roster", A.peer_id_b58, {**older, "from_a_newer_peer": [1]}).steps_per_s == 0.0, \
        "missing optional fields take their default, unknown ones are ignored"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("changes, reason", [
    ({"round": "9"}, "round is not an integer"),
    ({"round": True}, "round is not an integer"),
    ({"round": 2 ** 40}, "round out of range"),
    ({"round": -1}, "round out of range"),
    ({"tokens_trained": 1.5}, "tokens_trained is not an integer"),
    ({"steps_per_s": math.inf}, "steps_per_s not finite"),
    ({"steps_per_s": math.nan}, "steps_per_s not finite"),
    ({"steps_per_s": 1e13}, "steps_per_s not finite or out of range"),
    ({"tokens_per_s": -1.0}, "tokens_per_s not finite"),
    ({"tokens_per_s": "fast"}, "tokens_per_s is not a number"),
    ({"leaving": 1}, "leaving is not a boolean"),
    ({"digest": "Z" * 64}, "digest is malformed"),
    ({"digest": "a" * 500}, "digest is not a string"),
    ({"name": "x" * 1000}, "name is not a string"),
    ({"name": None}, "name is not a string"),
    ({"reachability": "everywhere"}, "reachability is unknown"),
    ({"missed_rounds": -3}, "missed_rounds out of range"),
    ({"missed_rounds": "many"}, "missed_rounds is not an integer"),
    ({"peer_id": B.peer_id_b58}, "peer_id differs from the subkey"),
])
def test_a_bad_field_is_refused_with_its_reason(changes, reason):
    with pytest.raises(RecordError, match=reason.split(" not")[0] if "not finite" in reason else reason):
        check("roster", A.peer_id_b58, entry(**changes))


@pytest.mark.timeout(10)
def test_the_subkey_must_be_a_peer_id_and_the_value_a_dictionary():
    for subkey in ("sybil-1", 12, b"raw", None, "Qm" + "1" * 44):
        with pytest.raises(RecordError, match="subkey is not a peer id"):
            check("roster", subkey, entry())
    with pytest.raises(RecordError, match="not a dictionary"):
        check("roster", A.peer_id_b58, [1, 2])
    with pytest.raises(RecordError, match="digest missing"):
        check("roster", A.peer_id_b58, {k: v for k, v in entry().items() if k != "digest"})


@pytest.mark.timeout(10)
def test_names_lose_control_characters_and_are_bounded():
    status = check("roster", A.peer_id_b58, entry(name="evil\x1b[2J\x07\u202eeman" + "n" * 100))
    assert status.name.startswith("evil[2Jeman") and len(status.name) == records.MAX_NAME
    assert check("finished", A.peer_id_b58, {"name": "bob\r\n", "round": 5}) == (A.peer_id_b58, "bob", 5)


@pytest.mark.timeout(10)
def test_other_kinds_are_typed_too():
    assert check("runs", A.peer_id_b58, {"prefix": "my_run_abc123", "fingerprint": "abc"}) == "my_run_abc123"
    with pytest.raises(RecordError, match="prefix is malformed"):
        check("runs", A.peer_id_b58, {"prefix": "../../etc", "fingerprint": "abc"})
    good = {"settings": {"model.seq_len": 64, "data.dataset": "tiny", "run.rounds": None, "inner.lr": 1e-3,
                         "model.layers": [1, 2]}, "fingerprint": "f"}
    assert check("config", A.peer_id_b58, good) == good
    for bad in ({"settings": {"model.seq_len": math.nan}, "fingerprint": "f"},
                {"settings": {"Model Seq": 1}, "fingerprint": "f"},
                {"settings": {"model.x": {"nested": 1}}, "fingerprint": "f"},
                {"settings": {f"a.k{i}": 1 for i in range(300)}, "fingerprint": "f"},
                {"settings": {"model.seq_len": 1}}):
        with pytest.raises(RecordError):
            check("config", A.peer_id_b58, bad)
    keys = AccessKeys.derive(b"secret")
    revocation = keys.revocation(B.peer_id_b58, 1000.0)
    assert check("revoked", B.peer_id_b58, revocation) == (B.peer_id_b58, revocation)
    with pytest.raises(RecordError):
        check("revoked", B.peer_id_b58, {"at": "1000", "mac": revocation["mac"]})


@pytest.mark.timeout(10)
def test_invalid_entries_are_dropped_counted_and_logged_once(caplog):
    before = dropped("roster")
    entries = {A.peer_id_b58: entry(), B.peer_id_b58: entry(B, round="9"), "sybil-1": entry()}
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.net.records"):
        assert valid_entries("roster", entries) == [PeerStatus(**entry())]
        assert valid_entries("roster", entries) == [PeerStatus(**entry())]
    assert dropped("roster") == before + 4
    assert sum("round is not an integer" in r.message for r in caplog.records) <= 1, "logged once per author/reason"
    assert valid_entries("roster", {A.peer_id_b58: object()}) == [], "anything else is a dropped record, not a crash"


@pytest.mark.timeout(30)
def test_at_most_max_entries_are_read_per_key(monkeypatch):
    monkeypatch.setattr(records, "MAX_ENTRIES", 5)
    ids = [Identity.generate() for _ in range(8)]
    before = DROPPED.get(("roster", "too many entries under one key"), 0)
    read = valid_entries("roster", {i.peer_id_b58: entry(i) for i in ids})
    assert len(read) == 5 and DROPPED[("roster", "too many entries under one key")] == before + 1


def _record(key: str, subkey, value: dict, signer=None, expiration=2e9) -> DHTRecord:
    from p2p_diloco.net.security.identity import seal

    key_id, sub, val = DHTID.generate(source=key).to_bytes(), S.dumps(subkey), S.dumps(value)
    return DHTRecord(key_id, sub, seal(signer, key_id, sub, val, expiration) if signer else val, expiration)


@pytest.mark.timeout(10)
def test_a_dht_node_refuses_to_store_bad_or_unsigned_records_under_the_run_keys():
    node = CompositeValidator([PeerSignatureValidator(A), RunRecordValidator({"run_x.roster": "roster"})])
    key = "run_x.roster"
    assert node.validate(_record(key, A.peer_id_b58, entry(), signer=A)), "a valid signed entry is stored"
    assert not node.validate(_record(key, A.peer_id_b58, entry())), "unsigned, in A's name"
    assert not node.validate(_record(key, A.peer_id_b58, entry(), signer=B)), "signed by another peer"
    assert not node.validate(_record(key, B.peer_id_b58, entry(B, round="9"), signer=B)), "signed, malformed"
    assert not node.validate(_record(key, "sybil-1", entry())), "not a peer id: nobody's signature"
    assert not node.validate(_record(key, B.peer_id_b58, entry(A), signer=B)), "B's entry claiming to be A"
    assert node.validate(_record("another.key", "sybil-1", {"x": 1})), "keys of no run are not ours to judge"


@pytest.mark.timeout(10)
def test_a_private_node_refuses_revocations_not_signed_by_one_of_its_revokers():
    keys = AccessKeys.derive(b"secret", revokers=(A.peer_id_b58,))  # A is the run's revoker
    node = RunRecordValidator({"revoked": "revoked"}, keys)
    good = keys.revocation(B.peer_id_b58, 1000.0, signer=A)
    assert node.validate(_record("revoked", B.peer_id_b58, good))
    assert check("revoked", B.peer_id_b58, good) == (B.peer_id_b58, good)
    assert not node.validate(_record("revoked", B.peer_id_b58, {**good, "at": 2000.0})), "forged"
    assert not node.validate(_record("revoked", B.peer_id_b58, {"garbage": 1})), "malformed"
    # a member's record (the secret's MAC, no revoker's signature) is refused on store
    unsigned = keys.revocation(B.peer_id_b58, 1000.0)
    assert not node.validate(_record("revoked", B.peer_id_b58, unsigned)), "unsigned"
    # and a run that names no revokers takes none
    assert not RunRecordValidator({"revoked": "revoked"}, AccessKeys.derive(b"secret")).validate(
        _record("revoked", B.peer_id_b58, good))
    with pytest.raises(RecordError):
        check("revoked", B.peer_id_b58, {**good, "by": "x" * 500})
