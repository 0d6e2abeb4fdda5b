"""A peer's libp2p identity key, and DHT records signed with it. The encodings are hivemind's and libp2p's own:
hivemind's ``crypto_pb2`` protobufs, ``py-multihash`` and hivemind's ``PeerID`` (base58); the keys and signatures
are ``cryptography``'s.

A libp2p PeerID is a multihash of the peer's public key (the protobuf ``PublicKey{key_type, data}``):
  * Ed25519 (``12D3KooW...``): the *identity* multihash (``00 24`` + the 36-byte protobuf), so the PeerID itself holds
    the 32-byte public key: a verifier needs nothing else;
  * RSA (``Qm...``): the *sha256* multihash (``12 20`` + sha256 of the protobuf, DER SubjectPublicKeyInfo inside), so
    a signed record carries the protobuf public key and the verifier checks that it hashes to the PeerID.
p2pd reads the private key as a protobuf ``PrivateKey{key_type, data}`` file (Ed25519 data: seed || public key, 64
bytes; RSA data: PKCS#1 DER, as hivemind's ``P2P.generate_identity`` writes it). The same key signs our records, so
a record stored under a subkey naming a PeerID can be checked against that PeerID alone.

A signed record's value is ``value || signature || public key (RSA only) || len(sig) u16 || len(key) u16 || MAGIC``;
the signature covers (DHT key id, subkey bytes, value bytes, expiration time) under a domain tag.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Optional

import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

RSA, ED25519 = crypto_pb2.RSA, crypto_pb2.Ed25519  # libp2p crypto.pb KeyType
MAGIC = b"\x00p2pdsig"  # the trailer of a signed value
_TAG = b"p2p-diloco record v1"
_TRAILER = struct.Struct(">HH")
_IDENTITY_MAX = 42  # libp2p: a public key protobuf up to this long is inlined in its PeerID (identity multihash)


class IdentityError(ValueError):
    """An identity file we cannot use (unreadable, not a libp2p key, a key type we do not sign with)."""


# ---------------------------------------------------------------------------------------------- protobuf, multihash
def encode_key(key_type: int, data: bytes, message=crypto_pb2.PublicKey) -> bytes:
    """The protobuf ``{PublicKey|PrivateKey}{key_type = 1, data = 2}`` (the two share one layout)."""
    try:
        return message(key_type=key_type, data=data).SerializeToString()
    except ValueError as e:  # a key type crypto.proto does not know
        raise IdentityError(f"not a libp2p key type: {e}") from None


def decode_key(blob: bytes) -> tuple[int, bytes]:
    """(key_type, data) of a protobuf PublicKey/PrivateKey; raises IdentityError if it is not one."""
    try:
        key = crypto_pb2.PublicKey.FromString(blob)
    except DecodeError:
        key = None
    if key is None or not key.IsInitialized():  # both fields are required; an unknown key type leaves one unset
        raise IdentityError("not a libp2p key protobuf")
    return key.key_type, key.data


def peer_id_of(public_key_proto: bytes) -> bytes:
    """The PeerID (raw multihash) of a protobuf public key: identity multihash up to 42 bytes, else sha256."""
    if len(public_key_proto) <= _IDENTITY_MAX:
        return multihash.encode(public_key_proto, "id")
    return multihash.encode(hashlib.sha256(public_key_proto).digest(), "sha2-256")


def _inlined_key(peer_id: bytes) -> bytes:
    """The public key protobuf an identity-multihash PeerID holds; b"" for a sha256 one or bytes that are neither."""
    try:
        decoded = multihash.decode(peer_id)
    except ValueError:
        return b""
    return decoded.digest if decoded.name == "id" else b""


def peer_id_bytes(peer: str) -> Optional[bytes]:
    """The raw multihash of a base58 PeerID, or None if ``peer`` is not one."""
    try:
        raw = PeerID.from_base58(peer).to_bytes()
    except ValueError:
        return None
    return raw if is_peer_id(raw) else None


def is_peer_id(raw: bytes) -> bool:
    """Is ``raw`` a PeerID multihash we can check (an Ed25519 identity one, or a sha256 one)?"""
    try:
        decoded = multihash.decode(raw)
    except ValueError:
        return False
    if decoded.name == "sha2-256":
        return decoded.length == 32
    if decoded.name != "id":
        return False
    try:
        key_type, data = decode_key(decoded.digest)
    except IdentityError:
        return False
    return key_type == ED25519 and len(data) == 32


# ---------------------------------------------------------------------------------------------- the private key
class Identity:
    """A private key we hold, whose PeerID p2pd will announce. Picklable (DHT processes get a copy)."""

    def __init__(self, private_key):
        if isinstance(private_key, ed25519.Ed25519PrivateKey):
            raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            self.key_type, self.public_key = ED25519, encode_key(ED25519, raw)
        elif isinstance(private_key, rsa.RSAPrivateKey):
            der = private_key.public_key().public_bytes(serialization.Encoding.DER,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo)
            self.key_type, self.public_key = RSA, encode_key(RSA, der)
        else:
            raise IdentityError(f"unsupported key type {type(private_key).__name__} (use Ed25519 or RSA)")
        self._key = private_key
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> "Identity":
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def from_protobuf(cls, blob: bytes) -> "Identity":
        key_type, data = decode_key(blob)
        if key_type == ED25519 and len(data) in (64, 96):  # seed || public key (|| public key again: legacy)
            return cls(ed25519.Ed25519PrivateKey.from_private_bytes(data[:32]))
        if key_type == RSA:
            try:
                return cls(serialization.load_der_private_key(data, password=None))
            except ValueError as e:
                raise IdentityError(f"unreadable RSA key: {e}") from None
        raise IdentityError(f"key type {key_type} is not supported (Ed25519 = 1 and RSA = 0 are)")

    @classmethod
    def load(cls, path: str) -> "Identity":
        try:
            return cls.from_protobuf(Path(path).read_bytes())
        except OSError as e:
            raise IdentityError(f"cannot read {path}: {e.strerror or e}") from None

    def to_protobuf(self) -> bytes:
        if self.key_type == ED25519:
            seed = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())
            return encode_key(ED25519, seed + decode_key(self.public_key)[1], crypto_pb2.PrivateKey)
        return encode_key(RSA, self._key.private_bytes(serialization.Encoding.DER,
                                                       serialization.PrivateFormat.TraditionalOpenSSL,
                                                       serialization.NoEncryption()), crypto_pb2.PrivateKey)

    def write(self, path: str) -> None:
        """Write the p2pd key file, readable by its owner only (fails if it exists)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.to_protobuf())

    @property
    def peer_id_b58(self) -> str:
        return PeerID(self.peer_id).to_base58()

    def sign(self, message: bytes) -> bytes:
        if self.key_type == ED25519:
            return self._key.sign(message)
        return self._key.sign(message, padding.PKCS1v15(), hashes.SHA256())

    def __getstate__(self):
        return {"blob": self.to_protobuf()}

    def __setstate__(self, state):
        self.__init__(Identity.from_protobuf(state["blob"])._key)


def verify(peer_id: bytes, message: bytes, signature: bytes, carried_key: bytes = b"") -> bool:
    """Did the key behind ``peer_id`` sign ``message``? An RSA (sha256) PeerID needs the key carried with the record,
    which must hash to the PeerID; an Ed25519 PeerID holds its key."""
    public_key = _inlined_key(peer_id) or carried_key
    if not public_key or peer_id_of(public_key) != peer_id:
        return False
    try:
        key_type, data = decode_key(public_key)
        if key_type == ED25519 and len(data) == 32:
            ed25519.Ed25519PublicKey.from_public_bytes(data).verify(signature, message)
            return True
        if key_type == RSA:
            key = serialization.load_der_public_key(data)
            if isinstance(key, rsa.RSAPublicKey):
                key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
                return True
    except (InvalidSignature, IdentityError, ValueError):
        pass
    return False


# ---------------------------------------------------------------------------------------------- signed records
def record_message(key: bytes, subkey: bytes, value: bytes, expiration: float) -> bytes:
    """What a record's signature covers: the DHT key id, the subkey and value bytes, the expiration time."""
    parts = (_TAG, key, subkey, value, struct.pack(">d", expiration))
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def seal(identity: Identity, key: bytes, subkey: bytes, value: bytes, expiration: float) -> bytes:
    """``value`` with its signature (and, for an RSA identity, the public key) appended."""
    signature = identity.sign(record_message(key, subkey, value, expiration))
    carried = identity.public_key if identity.key_type == RSA else b""
    return value + signature + carried + _TRAILER.pack(len(signature), len(carried)) + MAGIC


def unseal(sealed: bytes) -> Optional[tuple[bytes, bytes, bytes]]:
    """(value, signature, carried key) of a sealed value, or None if it carries no signature."""
    end = len(sealed) - len(MAGIC) - _TRAILER.size
    if end < 0 or not sealed.endswith(MAGIC):
        return None
    sig_len, key_len = _TRAILER.unpack(sealed[end:end + _TRAILER.size])
    start = end - sig_len - key_len
    if start < 0:
        return None
    return sealed[:start], sealed[start:start + sig_len], sealed[start + sig_len:end]


def check_sealed(peer_id: bytes, key: bytes, subkey: bytes, sealed: bytes, expiration: float) -> bool:
    """Was this sealed record signed by ``peer_id``'s key, over exactly this key, subkey, value and expiration?"""
    parts = unseal(sealed)
    if parts is None:
        return False
    value, signature, carried = parts
    return verify(peer_id, record_message(key, subkey, value, expiration), signature, carried)
