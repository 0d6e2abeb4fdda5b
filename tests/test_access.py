"""Private runs, without a swarm: the keys and proofs (net/security/access.py), the DHT authorizer (net/security/auth.py), and bad input
to the secret's keys (one line, exit code 2)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import subprocess
import sys

import pytest

from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.net.security.access import AccessKeys, ReplayGuard, _hkdf, ed25519_public_key, read_secret

PEER_A, PEER_B = b"\x00\x24peer-a-bytes", b"\x00\x24peer-b-bytes"


@pytest.mark.timeout(10)
def test_hkdf_is_rfc5869_extract_then_expand():
    # extract with our fixed salt, then two expand blocks T(1), T(2), computed here step by step with hmac/hashlib
    prk = hmac.new(b"p2p-diloco access v1", b"secret", hashlib.sha256).digest()
    t1 = hmac.new(prk, b"info\x01", hashlib.sha256).digest()
    t2 = hmac.new(prk, t1 + b"info\x02", hashlib.sha256).digest()
    assert _hkdf(b"secret", b"info", 64) == t1 + t2


@pytest.mark.timeout(10)
def test_a_proof_is_bound_to_its_peer_its_run_and_its_secret():
    keys = AccessKeys.derive(b"s3cret", "run-a")
    proof = keys.proof(PEER_A)
    assert keys.verify(PEER_A, proof)
    assert not keys.verify(PEER_B, proof), "a proof must not be usable by another peer"
    assert not AccessKeys.derive(b"s3cret", "run-b").verify(PEER_A, proof), "nor in another run"
    assert not AccessKeys.derive(b"other", "run-a").verify(PEER_A, proof), "nor under another secret"
    assert not keys.verify(PEER_A, b""), "an empty proof is no proof"
    assert keys.dht == AccessKeys.derive(b"s3cret", "run-b").dht, "the DHT key is the swarm's (bootstrap nodes)"
    assert len({keys.dht, keys.revoke, keys.member}) == 3


@pytest.mark.timeout(10)
def test_revocation_records_need_the_secret_and_name_their_peer():
    from p2p_diloco.net.security.identity import Identity

    operator = Identity.generate()
    keys = AccessKeys.derive(b"s3cret", revokers=(operator.peer_id_b58,))
    record = keys.revocation("QmPeerA", at=1000.0, signer=operator)
    forged = AccessKeys.derive(b"guess", revokers=(operator.peer_id_b58,)).revocation("QmPeerC", 1000.0, operator)
    records = {"QmPeerA": record, "QmPeerB": record, "QmPeerC": forged, "QmPeerD": {"at": 1.0}, "QmPeerE": "x"}
    assert keys.revoked_peers(records) == {"QmPeerA"}, "a record moved to another peer, or forged, must not count"


@pytest.mark.timeout(10)
def test_with_revokers_a_revocation_needs_one_of_their_signatures_too():
    """A member holds the secret, so it can MAC any revocation: a run that names its revokers takes only the ones
    one of them signed (their Ed25519 keys are in their PeerIDs), for that peer and time, under that secret."""
    from p2p_diloco.net.security.identity import Identity

    operator, member, rsa_like = Identity.generate(), Identity.generate(), "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    victim = Identity.generate().peer_id_b58
    keys = AccessKeys.derive(b"s3cret", revokers=(operator.peer_id_b58,))
    signed = keys.revocation(victim, at=1000.0, signer=operator)
    assert keys.is_revocation(victim, signed)
    assert not keys.is_revocation(victim, AccessKeys.derive(b"s3cret").revocation(victim, at=1000.0)), \
        "a member's record (MAC'd with the secret, unsigned) no longer revokes"
    assert not keys.is_revocation(victim, keys.revocation(victim, at=1000.0, signer=member)), "signed by a non-revoker"
    assert not keys.is_revocation(victim, {**signed, "by": member.peer_id_b58}), "the signature names its signer"
    assert not keys.is_revocation(member.peer_id_b58, signed), "moved to another peer"
    assert not keys.is_revocation(victim, {**signed, "at": 2000.0}), "another time"
    assert not keys.is_revocation(victim, {**signed, "sig": "00" * 64}), "a made-up signature"
    other_secret = AccessKeys.derive(b"another", revokers=(operator.peer_id_b58,))
    assert not other_secret.is_revocation(victim, other_secret.revocation(victim, 1000.0, signer=operator) | {
        "sig": signed["sig"]}), "a signature under another secret"
    # a run without revokers takes no revocation at all
    assert not AccessKeys.derive(b"s3cret").is_revocation(victim, signed)
    assert ed25519_public_key(operator.peer_id_b58) is not None and ed25519_public_key(rsa_like) is None
    assert ed25519_public_key("not base58 0OIl") is None


@pytest.mark.timeout(10)
def test_replay_guard_refuses_a_seen_nonce_and_old_or_future_requests():
    guard = ReplayGuard(window=60)
    assert guard.fresh(1000.0, b"n1", now=1000.5)
    assert not guard.fresh(1000.0, b"n1", now=1001.0), "replayed"
    assert not guard.fresh(900.0, b"n2", now=1000.0), "too old"
    assert not guard.fresh(1100.0, b"n3", now=1000.0), "from the future"
    assert not guard.fresh(1000.0, b"", now=1000.0), "no nonce"


# ---------------------------------------------------------------------------------------------- the authorizer
def _ping():
    from hivemind.proto import dht_pb2

    return dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"node"), validate=False)


@pytest.mark.timeout(30)
def test_authorizer_refuses_a_wrong_secret_a_replay_a_tampered_request_and_a_revoked_sender():
    from hivemind.p2p import PeerID
    from hivemind.proto import dht_pb2

    from p2p_diloco.net.security.auth import REMOTE_PEER, HMACAuthorizer

    member = HMACAuthorizer(AccessKeys.derive(b"s3cret"))
    stranger = HMACAuthorizer(AccessKeys.derive(b"wrong"))

    async def scenario():
        ok = _ping()
        await member.sign_request(ok, None)
        replay = dht_pb2.PingRequest.FromString(ok.SerializeToString())
        assert await member.validate_request(ok)
        assert not await member.validate_request(replay), "a replayed request must be refused"
        wrong = _ping()
        await stranger.sign_request(wrong, None)
        assert not await member.validate_request(wrong), "a request signed with another secret must be refused"
        tampered = _ping()
        await member.sign_request(tampered, None)
        tampered.validate = True
        assert not await member.validate_request(tampered), "a changed request must be refused"
        unsigned = _ping()
        assert not await member.validate_request(unsigned), "an unsigned request must be refused"
        # responses: a member's is accepted, an outsider's is not
        request = _ping()
        await member.sign_request(request, None)
        response = dht_pb2.PingResponse(dht_time=1.0)
        await member.sign_response(response, request)
        assert await member.validate_response(dht_pb2.PingResponse.FromString(response.SerializeToString()), request)
        outsider_response = dht_pb2.PingResponse(dht_time=1.0)
        await stranger.sign_response(outsider_response, request)
        assert not await member.validate_response(outsider_response, request)
        # a revoked sender (the connection's authenticated PeerID) is refused even with the right secret
        revoked = PeerID(b"\x00\x24" + b"r" * 36)
        member.update(member.keys, frozenset({revoked.to_base58()}))
        fresh = _ping()
        await member.sign_request(fresh, None)
        token = REMOTE_PEER.set(revoked)
        try:
            assert not await member.validate_request(fresh)
        finally:
            REMOTE_PEER.reset(token)
        assert member.refused == 6

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.timeout(10)
def test_secret_file_errors_name_the_key(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ConfigError, match=r"network.secret_file: .* is empty"):
        load_config(overrides={"network.secret_file": str(empty)})
    with pytest.raises(ConfigError, match=r"network.secret_file: cannot read .*missing"):
        load_config(overrides={"network.secret_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match=r"cannot read .*: Is a directory"):
        load_config(overrides={"network.secret_file": str(tmp_path)})
    (tmp_path / "ok").write_text("s3cret\n")
    with pytest.raises(ConfigError, match="set one of them, not both"):
        load_config(overrides={"network.secret_file": str(tmp_path / "ok"), "network.secret": "x"})
    assert read_secret(None, str(tmp_path / "ok")) == b"s3cret"
    assert read_secret(None, None) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["peer", "bootstrap"])
def test_bad_secret_file_is_one_line_and_exit_code_2(tmp_path, command):
    empty = tmp_path / "empty"
    empty.write_text("")
    for path in (empty, tmp_path):  # an empty file; one that cannot be read (a folder: we may run as root)
        out = subprocess.run([sys.executable, "-m", "p2p_diloco", command, f"--network.secret_file={path}"],
                             capture_output=True, text=True, timeout=50)
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and "network.secret_file" in out.stderr, out.stderr


@pytest.mark.timeout(30)
def test_a_new_secret_in_the_file_replaces_the_old_one_and_a_broken_file_keeps_it(tmp_path):
    from p2p_diloco.net.security.auth import Access

    path = tmp_path / "secret"
    path.write_text("first\n")
    access = Access(None, str(path), "run")
    old = access.keys
    assert not access.reread_secret(), "an unchanged file is no rotation"
    path.write_text("second\n")
    assert access.reread_secret() and access.keys == AccessKeys.derive(b"second", "run")
    assert not old.verify(b"peer", access.keys.proof(b"peer")), "old-secret holders are outsiders now"
    path.write_text("")
    assert not access.reread_secret() and access.keys == AccessKeys.derive(b"second", "run")
