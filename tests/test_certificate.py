"""Commit certificates (issue 24: θ_global only from what a group committed; issue 23: a commit record no two
groups of one round can both hold): the pure rule against a reference written from its definition, the record's
validation, and the check a joiner or a repairing peer makes before it adopts a downloaded state."""

from __future__ import annotations

import itertools
import random
import threading
import types

import pytest
import torch

from p2p_diloco.config import Config
from p2p_diloco.net import keys
from p2p_diloco.net.certificate import KEPT, certify, remember, signers
from p2p_diloco.net.membership import Membership
from p2p_diloco.net.records import RecordError, check
from p2p_diloco.ops.metrics import MetricsSink
from p2p_diloco.train.global_state import GlobalState
from p2p_diloco.train.outer import OuterNesterov

pytestmark = pytest.mark.timeout(60)
D, E = "ab" * 32, "cd" * 32


def _reference(round_, digest, group, records, alive, prior, me, last_round):
    """The rule as the docs state it, written plainly: at least one and more than half of the group's members alive
    or signed (any digest of the round), ourselves left out unless we signed, signed exactly (round, digest); and, one round past ours with our round's
    group known (not the run's last round), more than half of that group's members alive or signed, ourselves left
    out, are among the signers (no such member: nothing to check)."""
    if round_ == 0:
        return True
    signed_any = [p for p, commits in records.items() if any(r == round_ and d == digest for r, d in commits)]
    committed_any = [p for p, commits in records.items() if any(r == round_ for r, _ in commits)]
    counts = lambda p: alive is None or p in alive or p in committed_any
    voters = [p for p in group if counts(p) and (p != me or p in signed_any)]
    signed = [p for p in voters if p in signed_any]
    if not group or not signed or not len(signed) > len(voters) / 2:
        return False
    our_round, our_group = prior
    if round_ != our_round + 1 or not our_group or (last_round is not None and round_ >= last_round):
        return True
    electors = [p for p in our_group if counts(p) and p != me]
    if not electors:
        return True
    return len([p for p in electors if p in signed_any]) > len(electors) / 2


def test_the_rule_agrees_with_its_reference_on_random_cases():
    rng = random.Random(7)
    ids = [f"Qm{i}" for i in range(8)]
    for _ in range(5000):
        round_ = rng.randint(0, 4)
        group = rng.sample(ids, rng.randint(0, 5))
        records = {p: [(rng.choice([round_, round_ - 1, round_ + 1]), rng.choice([D, E]))
                       for _ in range(rng.randint(0, 2))] for p in rng.sample(ids, rng.randint(0, 8))}
        alive = rng.choice([None, set(rng.sample(ids, rng.randint(0, 8)))])
        prior = (rng.randint(0, 4), rng.sample(ids, rng.randint(0, 5)))
        me, last = rng.choice(ids), rng.choice([None, 3, 5])
        verdict = certify(round_, D, group, records, alive, prior, me, last)
        assert verdict.ok == _reference(round_, D, group, records, alive, prior, me, last), \
            (round_, group, records, alive, prior, me)
        assert verdict.ok or verdict.why


def test_a_group_of_strangers_signing_its_own_state_is_refused_one_round_ahead():
    run = ["QmA", "QmB", "QmC"]                  # the group that committed our round 4; we are QmC
    honest = {"QmA": [(5, D)], "QmB": [(5, D)]}
    everyone = {"QmA", "QmB", "QmC", "QmX", "QmY"}
    assert certify(5, D, ["QmA", "QmB"], honest, everyone, (4, run), "QmC").ok  # both others signed: chained
    forged = {**honest, "QmX": [(5, E)], "QmY": [(5, E)]}
    verdict = certify(5, E, ["QmX", "QmY"], forged, everyone, (4, run), "QmC")  # its own group, all signing
    assert not verdict.ok and verdict.chained and "0 of the 2" in verdict.why, verdict
    assert certify(5, E, ["QmX", "QmY"], forged, everyone, (0, []), "QmC").ok  # a fresh joiner checks the group
    # a made-up group naming live members of the run needs their signatures
    assert not certify(5, E, ["QmA", "QmB", "QmX"], forged, everyone, (0, []), "QmC").ok
    # members that died before signing count neither way: the one who signed carries a group of two ...
    assert certify(5, D, ["QmA", "QmB"], {"QmA": [(5, D)]}, {"QmA", "QmC"}, (4, run), "QmC").ok
    # ... while they look alive (their entries not expired yet), it waits
    assert not certify(5, D, ["QmA", "QmB"], {"QmA": [(5, D)]}, everyone, (4, run), "QmC").ok
    # none of our round's group left (the run resumed by peers with new keys): the new group alone decides
    assert certify(5, D, ["QmN1", "QmN2"], {"QmN1": [(5, D)], "QmN2": [(5, D)]}, {"QmN1", "QmN2", "QmC"},
                   (4, run), "QmC").ok
    assert not certify(5, D, ["QmA"], {}, None, None).ok  # nobody signed: never


def test_two_disjoint_groups_of_one_round_never_both_pass_a_peer_at_the_round_before():
    ids = [f"Qm{i}" for i in range(7)]
    for size in range(1, 8):
        for our_group in itertools.combinations(ids, size):
            records = {p: [(3, D if i % 2 else E)] for i, p in enumerate(ids)}
            first = [p for p in ids if records[p][0][1] == D]
            second = [p for p in ids if records[p][0][1] == E]
            both = certify(3, D, first, records, set(ids), (2, list(our_group)), "Qme").ok and \
                certify(3, E, second, records, set(ids), (2, list(our_group)), "Qme").ok
            assert not both, our_group


def test_the_commit_list_keeps_the_newest_and_one_digest_per_round():
    commits = []
    for r in range(1, 12):
        commits = remember(commits, r, D)
    assert [r for r, _ in commits] == list(range(12 - KEPT, 12))
    assert remember(commits, 11, E)[-1] == (11, E) and len(remember(commits, 11, E)) == KEPT
    assert signers(11, D, {"QmA": commits, "QmB": [(11, E)]}) == {"QmA"}


def test_commit_records_are_typed_and_bounded():
    peer = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    assert check("commits", peer, {"peer_id": peer, "commits": [[3, D], [4, E]]}) == (peer, [(3, D), (4, E)])
    bad = [{"peer_id": "QmOther", "commits": []}, {"peer_id": peer, "commits": [[3, D]] * (KEPT + 1)},
           {"peer_id": peer, "commits": [["3", D]]}, {"peer_id": peer, "commits": [[True, D]]},
           {"peer_id": peer, "commits": [[3, "not hex"]]}, {"peer_id": peer, "commits": [[3]]},
           {"peer_id": peer, "commits": "x"}, {"peer_id": peer, "commits": [[0, D]]}]
    for value in bad:
        with pytest.raises(RecordError):
            check("commits", peer, value)
    with pytest.raises(RecordError):
        check("commits", "sybil-1", {"peer_id": "sybil-1", "commits": []})


class _DHT:
    """The commit records a DHT read returns (already validated and signature-checked in the real seam)."""

    def __init__(self, records):
        self.records = records

    def get(self, key, latest=True, return_future=True):
        assert key == keys.commits_key("prefix")
        found = {p: types.SimpleNamespace(value={"peer_id": p, "commits": [list(c) for c in cs]})
                 for p, cs in self.records.items()}
        future = types.SimpleNamespace(result=lambda timeout=None: types.SimpleNamespace(value=found))
        return future


def test_a_repairing_peer_checks_the_certificate_against_its_own_rounds_group(monkeypatch):
    monkeypatch.setattr("p2p_diloco.net.records._names_a_peer", lambda subkey: True)  # test ids, not real keys
    params = [torch.ones(3)]
    state = GlobalState(params, OuterNesterov(params, lr=0.7, momentum=0.9))
    run = sorted(f"Qm{c}" + "a" * 44 for c in "ABC")
    state.round, state.quorum = 4, run
    me = Membership(Config(), _DHT({run[0]: [(5, D)], run[1]: [(5, D)], "Qm" + "x" * 44: [(5, E)]}),
                    types.SimpleNamespace(peer_id=run[2]), "prefix", "me", state, "fp", MetricsSink(),
                    threading.Event())
    assert me._certificate({"round": 5, "digest": D, "quorum": run[:2]}).ok
    verdict = me._certificate({"round": 5, "digest": E, "quorum": ["Qm" + "x" * 44]})
    assert not verdict.ok and verdict.chained


@pytest.mark.timeout(10)
def test_a_commit_record_in_another_members_name_is_refused_on_store():
    """A certificate is only as good as its signatures: a DHT node refuses a commit record under a member's PeerID
    that the member did not sign, or that names another peer (the same seam as the roster's)."""
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import CompositeValidator, DHTRecord
    from hivemind.utils import MSGPackSerializer as S

    from p2p_diloco.net.security.identity import Identity
    from p2p_diloco.net.security.records import PeerSignatureValidator
    from p2p_diloco.net.security.schema import RunRecordValidator, run_keys

    member, stranger = Identity.generate(), Identity.generate()
    key = keys.commits_key("run_x")
    assert run_keys("run_x", "run")[key] == "commits"  # every peer's node validates the key on store

    def record(subkey, value, signer=None):
        plain = DHTRecord(key=DHTID.generate(source=key).to_bytes(), subkey=S.dumps(subkey), value=S.dumps(value),
                          expiration_time=1e10)
        if signer is None:
            return plain
        signed = PeerSignatureValidator(signer).sign_value(plain)
        return DHTRecord(plain.key, plain.subkey, signed, plain.expiration_time)

    node = CompositeValidator([PeerSignatureValidator(member), RunRecordValidator({key: "commits"})])
    mine = {"peer_id": member.peer_id_b58, "commits": [[5, D]]}
    assert node.validate(record(member.peer_id_b58, mine, signer=member))
    assert not node.validate(record(member.peer_id_b58, mine, signer=stranger)), "signed by a stranger"
    assert not node.validate(record(member.peer_id_b58, mine)), "unsigned"
    assert not node.validate(record(stranger.peer_id_b58, mine, signer=stranger)), "the stranger's naming the member"


def test_a_member_of_a_pair_that_missed_the_commit_repairs_from_its_partner():
    """CI, a private run of two: peer0 committed round 96, peer1 (in that group, its own commit lost) did not. Counted
    as an alive member that did not sign, peer1 refused peer0's state (1 of 2 signed) on every repair, and neither
    could average again. We know we did not commit it: we are left out of the count."""
    ours, theirs = "QmB", "QmA"
    records = {theirs: [(95, E), (96, D)], ours: [(95, E)]}
    verdict = certify(96, D, [theirs, ours], records, {theirs, ours}, (95, [theirs, ours]), ours)
    assert verdict.ok and verdict.chained, verdict
    # a third party (not in the group) still counts the unsigned member against it
    assert not certify(96, D, [theirs, ours], records, {theirs, ours}, None, "QmC").ok
