"""Signed DHT records: the libp2p key encoding and signatures (net/security/identity.py, pure), and two real DHT nodes whose
validators refuse a record written in the other's name (net/security/records.py)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict

import pytest

from p2p_diloco.net.security.identity import (Identity, IdentityError, check_sealed, decode_key, encode_key, peer_id_bytes,
                                     seal, unseal, verify)

KEY, SUBKEY, VALUE, EXPIRATION = b"key-id", b"\xb4subkey", b"\x81\xa5round\x03", 1234.5


@pytest.fixture(scope="module")
def rsa_identity(tmp_path_factory):
    """An RSA identity file as hivemind writes it (P2P.generate_identity), and its PeerID as hivemind reads it."""
    from hivemind.p2p import P2P, PeerID

    path = tmp_path_factory.mktemp("rsa") / "rsa.key"
    P2P.generate_identity(str(path))
    return Identity.load(str(path)), PeerID.from_identity(path.read_bytes()).to_base58(), path


@pytest.mark.timeout(10)
def test_peer_ids_are_libp2p_s(rsa_identity):
    from hivemind.p2p import PeerID

    ed = Identity.generate()
    assert ed.peer_id_b58.startswith("12D3KooW") and PeerID(ed.peer_id).to_base58() == ed.peer_id_b58
    assert Identity.from_protobuf(ed.to_protobuf()).peer_id == ed.peer_id
    rsa, hivemind_id, _ = rsa_identity
    assert rsa.peer_id_b58 == hivemind_id and hivemind_id.startswith("Qm")
    assert peer_id_bytes(hivemind_id) == rsa.peer_id and peer_id_bytes("prefix_of-a-run") is None
    assert decode_key(encode_key(1, b"x" * 300)) == (1, b"x" * 300)  # a 2-byte varint length
    with pytest.raises(IdentityError):
        decode_key(b"\x08\x01\x12\x20short")
    with pytest.raises(IdentityError):
        Identity.from_protobuf(encode_key(2, b"\x02" * 33))  # secp256k1: not ours


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind", ["ed25519", "rsa"])
def test_a_record_verifies_only_under_its_signer_and_unchanged(kind, rsa_identity):
    a = Identity.generate() if kind == "ed25519" else rsa_identity[0]
    b = Identity.generate()
    sealed = seal(a, KEY, SUBKEY, VALUE, EXPIRATION)
    assert unseal(sealed)[0] == VALUE
    assert check_sealed(a.peer_id, KEY, SUBKEY, sealed, EXPIRATION), "signed by A, verifies under A"
    assert not check_sealed(b.peer_id, KEY, SUBKEY, sealed, EXPIRATION), "A's record is not B's"
    assert not check_sealed(a.peer_id, KEY, SUBKEY, seal(b, KEY, SUBKEY, VALUE, EXPIRATION), EXPIRATION), \
        "re-signed by B under A's subkey"
    tampered = sealed.replace(b"\x03", b"\x09", 1)
    assert not check_sealed(a.peer_id, KEY, SUBKEY, tampered, EXPIRATION), "tampered value"
    assert not check_sealed(a.peer_id, KEY, SUBKEY, sealed, EXPIRATION + 3600), "extended expiration"
    assert not check_sealed(a.peer_id, b"other-key", SUBKEY, sealed, EXPIRATION), "moved to another key"
    assert not check_sealed(a.peer_id, KEY, SUBKEY, VALUE, EXPIRATION), "unsigned"


@pytest.mark.timeout(10)
def test_a_carried_rsa_key_must_hash_to_the_peer_id(rsa_identity):
    rsa, _, _ = rsa_identity
    message = b"message"
    signature = rsa.sign(message)
    assert verify(rsa.peer_id, message, signature, rsa.public_key)
    assert not verify(rsa.peer_id, message, signature, b""), "an RSA PeerID needs the carried key"
    from cryptography.hazmat.primitives.asymmetric import rsa as rsa_keys

    mallory = Identity(rsa_keys.generate_private_key(public_exponent=65537, key_size=1024))  # its own RSA key,
    assert not verify(rsa.peer_id, message, mallory.sign(message), mallory.public_key)  # carried under A's PeerID


@pytest.mark.timeout(60)
def test_dht_nodes_refuse_records_in_another_peers_name(rsa_identity, tmp_path, process_tag):
    """Node A (hivemind's RSA identity file) and node B (a key we generate, its file gone once p2pd read it)."""
    from hivemind.utils.timed_storage import get_dht_time

    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.net.consensus import PeerStatus
    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.net.keys import publish_status, read_roster, roster_key

    before = set(os.listdir(tempfile.gettempdir()))  # where the key file is written
    a = start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(rsa_identity[2])))
    b = start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=[str(m) for m in a.get_visible_maddrs()]))
    try:
        assert a.peer_id.to_base58() == rsa_identity[1] and b.peer_id.to_base58().startswith("12D3KooW")
        left = set(os.listdir(tempfile.gettempdir())) - before
        assert not [n for n in left if n.startswith("p2p-diloco-id-")], "key file left"
        ids = {"a": a.peer_id.to_base58(), "b": b.peer_id.to_base58()}
        for name, dht in (("a", a), ("b", b)):
            assert publish_status(dht, "run_x", PeerStatus(name=name, peer_id=ids[name], round=3, digest="d"),
                                  ttl=30, timeout=5)
        for forger, victim in ((b, "a"), (a, "b")):
            forged = PeerStatus(name=victim, peer_id=ids[victim], round=99, digest="forged")
            future = forger.store(roster_key("run_x"), subkey=ids[victim], value=asdict(forged),
                                  expiration_time=get_dht_time() + 300, return_future=True)
            assert not future.result(timeout=5), "a record in another peer's name must be refused"
        for dht in (a, b):
            assert sorted((s.name, s.round, s.digest) for s in read_roster(dht, "run_x", 5)) == [
                ("a", 3, "d"), ("b", 3, "d")]
    finally:
        a.shutdown()
        b.shutdown()
