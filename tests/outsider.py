"""A node outside a private run that tries everything a member can do, and reports what worked (tests only).

    python tests/outsider.py --bootstrap MADDR --target MADDR --prefix PREFIX --run-id RUN --out result.json
        [--secret TEXT] [--identity KEY_FILE] [--forge PEER_ID]

It joins the DHT through the bootstrap node (or, refused, starts a DHT node of its own), dials the target member
directly, and tries: reading the roster, writing a roster entry (a leaver's, so a member that accepts it does not
wait for it), joining a group (rpc_join_group, with a proof made from its secret, if any), uploading a part
(rpc_aggregate_part) and downloading the state (rpc_admit, then rpc_download_state). With ``--forge PEER_ID``
(another member's), it only writes a roster entry in that member's name, far ahead of the run (round 999, another
digest, not leaving), unsigned and signed with its own key, through the DHT and straight to the target, then reads
the target's roster back; and it stores a revocation of that member made with the secret alone (no revoker's
signature) straight to the target, then reads the target's list back. Each outcome goes into the JSON report: what the member answered, never what the outsider
hoped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("--bootstrap", "--target", "--prefix", "--run-id", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--secret", default=None)
    p.add_argument("--identity", default=None)
    p.add_argument("--forge", default=None)
    args = p.parse_args()

    from p2p_diloco.config import NetworkConfig
    from p2p_diloco.errors import JoinError
    from p2p_diloco.net.dht import start_dht

    report = {}
    net = NetworkConfig(initial_peers=[args.bootstrap], host_maddrs=[LOOPBACK], identity_path=args.identity,
                        secret=args.secret, join_timeout=10.0, reachability="public")
    try:
        dht = start_dht(net)
        report["dht_join"] = "joined"
    except JoinError as e:
        report["dht_join"] = f"refused: {e}"
        net.initial_peers = []
        dht = start_dht(net)  # a node of our own, to dial the member directly
    try:
        report["peer_id"] = str(dht.peer_id)
        report.update(dht.run_coroutine(_Attempts(args.target, args.prefix, args.run_id, args.secret, args.forge)))
    finally:
        dht.shutdown()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


class _Attempts:
    """Runs in the outsider's DHT process, with its P2P node and DHT protocol."""

    def __init__(self, target: str, prefix: str, run_id: str, secret, victim=None):
        self.target, self.prefix, self.run_id, self.secret, self.victim = target, prefix, run_id, secret, victim

    async def __call__(self, _dht, node) -> dict:
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        address, peer = self.target.rsplit("/p2p/", 1)
        target = PeerID.from_base58(peer)
        await node.p2p._client.connect(target, [Multiaddr(address)])
        out = {}
        attempts = (("dht_read", self.read_roster), ("dht_write", self.write_roster), ("join_group", self.join_group),
                    ("upload", self.upload), ("download", self.download))
        for name, attempt in ((("forge", self.forge), ("revoke", self.revoke)) if self.victim else attempts):
            try:
                out[name] = await asyncio.wait_for(attempt(node, target), 20)
            except Exception as e:
                out[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        return out

    def proof(self, peer_id) -> bytes:
        from p2p_diloco.net.security.access import AccessKeys

        return AccessKeys.derive(self.secret.encode(), self.run_id).proof(peer_id.to_bytes()) if self.secret else b""

    async def read_roster(self, node, target) -> str:
        from hivemind.dht.routing import DHTID

        key = DHTID.generate(source=f"{self.prefix}.roster")
        found = await node.protocol.call_find(target, [key])
        if found is None:
            return "refused: no answer"
        value, _ = found[key]
        return f"read {len(value.value) if value is not None else 0} entries"

    async def write_roster(self, node, target) -> str:
        from hivemind.dht.routing import DHTID
        from hivemind.utils.timed_storage import get_dht_time

        from p2p_diloco.net.consensus import PeerStatus

        status = PeerStatus(name="outsider", peer_id=str(node.peer_id), round=999, digest="0" * 64, leaving=True)
        key, expiration = DHTID.generate(source=f"{self.prefix}.roster"), get_dht_time() + 30
        value = _signed(node, key, status.peer_id, asdict(status), expiration)  # our own entry: signed by us
        ok = await node.protocol.call_store(target, [key], [value], expiration, subkeys=[status.peer_id])
        if not ok or not all(ok):
            return f"refused: {ok}"
        found = await node.protocol.call_find(target, [key])  # is our entry in the member's roster now?
        entries = found[key][0].value if found and found[key][0] is not None else {}
        return "written" if status.peer_id in entries else "not stored"

    async def forge(self, node, target) -> str:
        """An entry in another member's name: stored through the DHT (unsigned: ours would not sign it) and straight
        to the target (signed with our own key); then is it in the target's roster?"""
        from hivemind.dht.routing import DHTID
        from hivemind.utils.timed_storage import get_dht_time

        from p2p_diloco.net.consensus import PeerStatus
        from p2p_diloco.net.security.identity import seal

        status = PeerStatus(name="forged", peer_id=self.victim, round=999, digest="f" * 64, tokens_trained=10 ** 9)
        key, expiration = f"{self.prefix}.roster", get_dht_time() + 300
        through_dht = await node.store(key, asdict(status), expiration, subkey=self.victim)
        key_id, ser = DHTID.generate(source=key), node.protocol.serializer
        identity = next(v.identity for v in node.protocol.record_validator._validators if hasattr(v, "identity"))
        sealed = seal(identity, key_id.to_bytes(), ser.dumps(self.victim), ser.dumps(asdict(status)), expiration)
        direct = await node.protocol.call_store(target, [key_id], [sealed], expiration, subkeys=[self.victim])
        validator, node.protocol.record_validator = node.protocol.record_validator, None  # read what is stored
        try:
            found = await node.protocol.call_find(target, [key_id])
        finally:
            node.protocol.record_validator = validator
        entries = found[key_id][0].value if found and found[key_id][0] is not None else {}
        entry = entries.get(self.victim) if entries else None
        visible = entry is not None and b"forged" in entry.value
        return f"dht store {through_dht}, direct store {direct}, " + ("visible" if visible else "not visible")

    async def revoke(self, node, target) -> str:
        """A revocation of that member, MAC'd with the secret but signed by none of the run's revokers, stored
        straight to the target; is it in the target's revocation list then?"""
        from hivemind.dht.routing import DHTID
        from hivemind.utils.timed_storage import get_dht_time

        from p2p_diloco.net.security.access import AccessKeys
        from p2p_diloco.net.security.auth import REVOKED_KEY

        record = AccessKeys.derive(self.secret.encode()).revocation(self.victim)
        key_id, ser, expiration = DHTID.generate(source=REVOKED_KEY), node.protocol.serializer, get_dht_time() + 300
        direct = await node.protocol.call_store(target, [key_id], [ser.dumps(record)], expiration,
                                                subkeys=[self.victim])
        found = await node.protocol.call_find(target, [key_id])
        entries = found[key_id][0].value if found and found[key_id][0] is not None else {}
        return f"direct store {direct}, " + ("visible" if entries and self.victim in entries else "not visible")

    async def join_group(self, node, target) -> str:
        from hivemind.proto import averaging_pb2
        from hivemind.utils import MSGPackSerializer as S
        from hivemind.utils.timed_storage import get_dht_time

        from p2p_diloco.net.averaging.averager import CanonicalAverager

        stub = CanonicalAverager.get_stub(node.p2p, target, namespace=self.prefix)
        user = S.dumps(dict(name="outsider", round=0, digest="0", tokens=1, proof=self.proof(node.peer_id).hex()))
        request = averaging_pb2.JoinRequest(schema_hash=b"outsider", expiration=get_dht_time() + 10,
                                            gather=S.dumps([1.0, 0, user]), group_key=f"{self.prefix}.0b")
        async for message in await stub.rpc_join_group(request):
            return averaging_pb2.MessageCode.Name(message.code)
        return "no answer"

    async def upload(self, node, target) -> str:
        from hivemind.proto import averaging_pb2, runtime_pb2

        from p2p_diloco.net.averaging.averager import CanonicalAverager

        stub = CanonicalAverager.get_stub(node.p2p, target, namespace=self.prefix)
        part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"\0" * 20, weight=1e6,
                                           tensor_part=runtime_pb2.Tensor(buffer=b"\0" * 64, dtype="float32"))
        answered = asyncio.Event()

        async def parts():
            # Our input ends only once the member answered, as the averager's own senders do (allreduce.py): the
            # member answers after our first part and closes the stream, and an end-of-stream written after that
            # close fails (EPIPE), which hivemind's reader then raises instead of the answer it already holds.
            yield part
            await answered.wait()

        async for message in await stub.rpc_aggregate_part(parts()):
            answered.set()
            return averaging_pb2.MessageCode.Name(message.code)
        return "no answer"

    async def download(self, node, target) -> str:
        from hivemind.proto import averaging_pb2

        from p2p_diloco.net.averaging.averager import CanonicalAverager

        stub = CanonicalAverager.get_stub(node.p2p, target, namespace=self.prefix)
        admitted = "n/a"
        if self.secret:
            replies = await stub.rpc_admit(averaging_pb2.JoinRequest(gather=self.proof(node.peer_id)))
            codes = [averaging_pb2.MessageCode.Name(reply.code) async for reply in replies]
            admitted = ",".join(codes) or "no answer"
        size = 0
        async for message in await stub.rpc_download_state(averaging_pb2.DownloadRequest()):
            size += len(message.tensor_part.buffer)
        return f"{size} bytes (admission: {admitted})"


def _signed(node, key_id, subkey, value, expiration) -> bytes:
    """``value`` serialized and signed as our DHT node signs the records it stores (net/security/records.py)."""
    from hivemind.dht.validation import DHTRecord

    ser = node.protocol.serializer
    record = DHTRecord(key_id.to_bytes(), ser.dumps(subkey), ser.dumps(value), expiration)
    return node.protocol.record_validator.sign_value(record)


if __name__ == "__main__":
    sys.exit(main())
