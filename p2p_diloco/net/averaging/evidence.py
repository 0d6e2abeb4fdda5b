"""Accusations with evidence: a reducer that refuses a sender's part must show the part as the sender signed it.

Without this, a reducer's PROTOCOL_VIOLATION naming any member made every member suspect it, so one member could
have any other excluded for 5, 10, 20 … rounds (issue 24, finding 5). Now:
  * every sender signs each part it sends to another reducer with its libp2p identity key (net/security/identity.py):
    the signature covers the group id, the reducer's PeerID, the part's index, its weight, the sha256 of the
    part's protobuf (deterministic serialization) and the sha256 of the part's summary (bounds.py); it travels,
    with the summary, in the message's otherwise unused ``peer_id`` field (attest.py ``seal``);
  * a reducer that refuses a part sends, with the culprit's PeerID, the offending part itself, its weight and an
    :class:`Accusation` (its reason, the part's index, the culprit's signature) in place of the group id;
  * every member judges the accusation itself (:func:`judge`): the culprit's signature must hold over exactly this
    group, this reducer, this index, this weight and these bytes, and the member's own screening of the part must
    find it bad (screening.part_problem, the shapes and weights every member derives alike, or a summary that is not
    the part's: bounds.summary_mismatch). Then the member names the
    culprit, with its own reason. Otherwise the accusation is void and the member names the *reducer* instead: it
    refused a part nobody can show was bad. A reducer naming itself (its own contribution) needs no evidence.
The round fails on every member either way (the refusing reducer serves nothing more); what changes is whom members
leave out next (seam.py ``_suspect``, screening.accused). Cost: one signature per part sent (Ed25519, measured in
BENCHMARKS.md), 64 bytes per part on the wire; evidence is sent only with a refusal.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer

from p2p_diloco.net.averaging.bounds import summary_mismatch
from p2p_diloco.net.averaging.screening import part_problem
from p2p_diloco.net.averaging.wire import decode_part
from p2p_diloco.net.security.identity import verify

_TAG = b"p2p-diloco part v1"
MAX_ACCUSATION_BYTES = 1 << 20  # a refusal's accusation (reason, index, signature, key, summary) above this is void
MAX_REASON = 300


def tensor_digest(tensor: runtime_pb2.Tensor) -> bytes:
    """sha256 of a part's deterministic protobuf encoding."""
    return hashlib.sha256(tensor.SerializeToString(deterministic=True)).digest()


def part_statement(group_id: bytes, reducer: bytes, part_index: int, weight: float,
                   tensor: runtime_pb2.Tensor, summary: bytes = b"") -> bytes:
    """What a sender signs for one part: the group, the reducer (raw PeerID), the part's index and weight, the
    sha256 of the part's deterministic protobuf encoding and, if given, the sha256 of its summary (bounds.py)."""
    return statement(group_id, reducer, part_index, weight, tensor_digest(tensor), summary)


def statement(group_id: bytes, reducer: bytes, part_index: int, weight: float, digest: bytes,
              summary: bytes = b"") -> bytes:
    """:func:`part_statement` from the part's digest: what a receiver of the average rebuilds (attest.py)."""
    parts = (_TAG, group_id, reducer, struct.pack(">qd", part_index, weight), digest)
    if summary:
        parts += (hashlib.sha256(summary).digest(),)
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


@dataclass(frozen=True)
class Accusation:
    """What a refusing reducer claims, in the refusal's ``group_id`` field (msgpack)."""
    why: str
    part_index: int
    signature: bytes  # the culprit's, over part_statement of the part the refusal carries
    carried_key: bytes = b""  # an RSA culprit's public key (an Ed25519 PeerID holds its own)
    summary: bytes = b""  # the summary the culprit signed with the part (bounds.py), if any

    def encode(self) -> bytes:
        return MSGPackSerializer.dumps([self.why[:MAX_REASON], self.part_index, self.signature, self.carried_key,
                                        self.summary])

    @classmethod
    def decode(cls, blob: bytes) -> Optional["Accusation"]:
        """The accusation in a refusal, or None if it is not a well-formed one (anything a member can send)."""
        if len(blob) > MAX_ACCUSATION_BYTES:
            return None
        try:
            fields = MSGPackSerializer.loads(blob)
            why, index, signature, key, *rest = fields
        except Exception:  # noqa: BLE001 - anything a member can send
            return None
        summary = rest[0] if len(rest) == 1 else None if rest else b""
        if not (isinstance(why, str) and type(index) is int and isinstance(signature, bytes) and isinstance(key, bytes)
                and isinstance(summary, bytes)):
            return None
        return cls(why[:MAX_REASON], index, signature, key, summary)


def judge(*, culprit: bytes, reducer: bytes, group_id: bytes, accusation: Optional[Accusation], weight: float,
          tensor: runtime_pb2.Tensor, part_shapes: Sequence[torch.Size], expected_weight: Optional[float]
          ) -> tuple[bytes, str]:
    """Whom a member blames for a reducer's refusal, and why: (culprit, our own reason) if the evidence holds, else
    (reducer, why the accusation is void). ``expected_weight``: the weight the culprit had to send (None: any; 0: a
    non-participant, whose parts no reducer screens)."""
    if culprit == reducer:
        return culprit, accusation.why if accusation is not None else "refused its own contribution"
    if accusation is None:
        return reducer, "refused a member's part without evidence"
    void = f"refused a member's part ({accusation.why}) without"
    statement = part_statement(group_id, reducer, accusation.part_index, weight, tensor, accusation.summary)
    if not verify(culprit, statement, accusation.signature, accusation.carried_key):
        return reducer, f"{void} the member's signature over it"
    problem = part_trouble(tensor, weight, accusation.part_index, part_shapes, expected_weight, accusation.summary)
    if problem is None:
        return reducer, f"{void} a fault in it: the part it showed is well-formed"
    return culprit, problem


def part_trouble(tensor: runtime_pb2.Tensor, weight: float, part_index: int, part_shapes: Sequence[torch.Size],
                 expected_weight: Optional[float], summary: bytes = b"") -> Optional[str]:
    """A reducer's screening of one received part, as anyone can redo it: why it cannot enter the average, or None.
    With a ``summary`` the sender signed, a summary that is not the part's is a fault too (bounds.py)."""
    if expected_weight == 0:
        return None  # a non-participant's part enters as zeros, undecoded: nothing it holds can be a fault
    if not 0 <= part_index < len(part_shapes):
        return f"more than the {len(part_shapes)} parts due" if part_index >= 0 else None
    try:
        part = decode_part(tensor)
    except Exception as e:  # noqa: BLE001 - anything a sender can make the decoder raise
        return f"an undecodable part ({type(e).__name__})"
    problem = part_problem(part, part_shapes[part_index], weight, weight if expected_weight is None else expected_weight)
    return summary_mismatch(part, summary) if problem is None and summary else problem
