"""Accountable reducers (issue 24, finding 6): signed part summaries go to the reducer with each part and come back
to every member with the average, and every member checks each average it receives against them (bounds.py).

On the wire (hivemind's ``AveragingData``, whose ``peer_id`` and ``group_id`` our all-reduce does not otherwise use
past the first message):
  * a sender's part carries, in ``peer_id``, a *seal*: its signature (evidence.py ``part_statement``, now also over
    the sha256 of the part's summary), the summary, and an RSA sender's public key;
  * the reducer checks each participant's seal when the part arrives (:meth:`Attesting._seal_fault`): a summary that
    does not match the part is a fault it can prove (the part and the seal are the evidence of its refusal); a
    missing or wrong signature it cannot prove, so it stops serving without naming anyone (the round fails as if the
    sender had died); an honest reducer thus forwards only true summaries, signed;
  * each averaged part carries, in ``group_id``, every participant's (index, part digest, summary, signature, key),
    in sender order, the same bytes to every member (they enter the part's digest that members compare, verify.py);
  * a member receiving an average checks that every participant's entry is there and signed, and that the average
    lies within the bounds the summaries give for the run's aggregator (:meth:`Attesting._average_fault`). If not,
    the reducer alone can be at fault: the member fails the round and names the reducer, which every member then
    leaves out for ``averaging.suspect_rounds`` rounds (seam.py ``_suspect``), as for a malformed contribution.
Checks are on when we sign our parts (a libp2p identity: every peer's) and know every member's weight.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from hivemind.utils import MSGPackSerializer

from p2p_diloco.net.averaging.bounds import average_problem, parse_summary, summarize, summary_mismatch
from p2p_diloco.net.averaging.evidence import statement, tensor_digest
from p2p_diloco.net.averaging.wire import decode_part
from p2p_diloco.net.security.identity import RSA, verify

MAX_KEY_BYTES = 1024  # an RSA public key protobuf (2048-4096 bits) fits


def seal(signature: bytes, summary: bytes, key: bytes = b"") -> bytes:
    return MSGPackSerializer.dumps([signature, summary, key])


def unseal(blob: bytes) -> Optional[tuple[bytes, bytes, bytes]]:
    """(signature, summary, key) of a part's seal, or None if it is not one."""
    try:
        signature, summary, key = MSGPackSerializer.loads(blob)
    except Exception:  # noqa: BLE001 - anything a member can send
        return None
    if not all(isinstance(x, bytes) for x in (signature, summary, key)) or len(key) > MAX_KEY_BYTES:
        return None
    return signature, summary, key


def decode_entries(blob: bytes, num_senders: int) -> Optional[dict[int, tuple[bytes, bytes, bytes, bytes]]]:
    """sender index -> (digest, summary, signature, key) from an average's attestations; None if malformed."""
    try:
        rows = MSGPackSerializer.loads(blob)
        out = {}
        for index, digest, summary, signature, key in rows:
            if type(index) is not int or not 0 <= index < num_senders or index in out or \
                    not all(isinstance(x, bytes) for x in (digest, summary, signature, key)):
                return None
            out[index] = (digest, summary, signature, key)
        return out
    except Exception:  # noqa: BLE001 - anything a reducer can send
        return None


class Attesting:
    """Mixin of :class:`~p2p_diloco.net.averaging.allreduce.CanonicalAllReduceRunner`: the seals, the reducer's
    checks of them and the receivers' checks of averages. Expects ``identity``, ``weights``, ``group_id``,
    ``peer_id``, ``sender_peer_ids``, ``ordered_peer_ids``, ``aggregator``, ``average_codec``, ``_part_shapes``."""

    def _init_attesting(self) -> None:
        self._entries: dict[int, dict[int, list]] = {}  # part index -> sender index -> [digest, summary, sig, key]
        self._attestations: dict[int, bytes] = {}  # part index -> what we forward with our average of it
        self.check_seconds = 0.0  # time spent checking seals and averages
        self._key = self.identity.public_key if self.identity is not None and self.identity.key_type == RSA else b""

    @property
    def attesting(self) -> bool:
        return self.identity is not None and self.weights is not None

    def _participates(self, peer) -> bool:
        return self.weights is None or self.weights.get(peer, 0.0) > 0

    def _sign_part(self, msg, reducer: bytes, part_index: int) -> None:
        """Seal one of our parts (in an executor): the summary of the part as its reducer decodes it, signed."""
        started = time.perf_counter()
        summary = b""
        if self._participates(self.peer_id):
            try:
                summary = summarize(decode_part(msg.tensor_part))
            except Exception:  # noqa: BLE001 - an attack made our part undecodable (tests): no summary
                summary = b""
        sig = self.identity.sign(statement(self.group_id, reducer, part_index, msg.weight,
                                           tensor_digest(msg.tensor_part), summary))
        msg.peer_id = seal(sig, summary, self._key)
        self.sign_seconds += time.perf_counter() - started

    def _seal_fault(self, sender_index: int, part_index: int, part, msg) -> tuple[Optional[str], bool]:
        """A participant's part arrived (decoded, in an executor): (why its seal fails, whether we can prove it).
        A good seal is kept, to forward with our average."""
        if not self.attesting:
            return None, False
        started = time.perf_counter()
        try:
            sealed = unseal(msg.peer_id)
            if sealed is None:
                return "no seal on its part", False
            signature, summary, key = sealed
            digest = tensor_digest(msg.tensor_part)
            sender = self.sender_peer_ids[sender_index].to_bytes()
            signed = statement(self.group_id, self.peer_id.to_bytes(), part_index, msg.weight, digest, summary)
            if not verify(sender, signed, signature, key):
                return "no valid signature on its part", False
            mismatch = summary_mismatch(part, summary)
            if mismatch is not None:
                return mismatch, True
            self._entries.setdefault(part_index, {})[sender_index] = [digest, summary, signature, key]
            return None, False
        finally:
            self.check_seconds += time.perf_counter() - started

    def _own_entry(self, part_index: int, encoded, mine) -> None:
        """Our own contribution to a part we reduce, sealed as any sender's."""
        if not self.attesting or not self._participates(self.peer_id):
            return
        summary = summarize(mine)
        digest = tensor_digest(encoded)
        me = self.peer_id.to_bytes()
        sig = self.identity.sign(statement(self.group_id, me, part_index, self.weights[self.peer_id], digest, summary))
        self._entries.setdefault(part_index, {})[self.sender_peer_ids.index(self.peer_id)] = \
            [digest, summary, sig, self._key]

    def _attestation(self, part_index: int) -> bytes:
        """What goes back with our average of a part: every participant's entry, in sender order (built once)."""
        if not self.attesting:
            return b""
        if part_index not in self._attestations:
            entries = self._entries.get(part_index, {})
            self._attestations[part_index] = MSGPackSerializer.dumps([[i, *entries[i]] for i in sorted(entries)])
        return self._attestations[part_index]

    def _average_fault(self, reducer_index: int, part_index: int, average, blob: bytes) -> Optional[str]:
        """Why reducer ``reducer_index``'s average of a part cannot be right (in an executor), or None."""
        if not self.attesting:
            return None
        started = time.perf_counter()
        try:
            return self._judge_average(reducer_index, part_index, average, blob)
        finally:
            self.check_seconds += time.perf_counter() - started

    def _judge_average(self, reducer_index: int, part_index: int, average, blob: bytes) -> Optional[str]:
        entries = decode_entries(blob, len(self.sender_peer_ids))
        if entries is None:
            return f"sent part {part_index} without its members' summaries"
        reducer = self.ordered_peer_ids[reducer_index].to_bytes()
        claims = []
        for i, sender in enumerate(self.sender_peer_ids):
            weight = self.weights.get(sender, 0.0)
            if weight <= 0:
                continue
            if i not in entries:
                return f"sent part {part_index} without the summary of member …{str(sender)[-6:]}"
            digest, summary, signature, key = entries[i]
            parsed = parse_summary(summary, average.numel())
            if parsed is None or not verify(sender.to_bytes(), statement(self.group_id, reducer, part_index, weight,
                                                                         digest, summary), signature, key):
                return f"sent part {part_index} with a summary member …{str(sender)[-6:]} did not sign"
            claims.append((weight, parsed))
        problem = average_problem(average, claims, self.aggregator.name, self.aggregator.trim_fraction,
                                  self.average_codec.name)
        return None if problem is None else f"its average of part {part_index} is out of bounds: {problem}"

    async def _sealed(self, msg, reducer: bytes, part_index: int):
        """Seal a part we send (off the event loop)."""
        if self.identity is not None:
            await asyncio.get_event_loop().run_in_executor(None, self._sign_part, msg, reducer, part_index)
        return msg
