"""A node outside a private run that tries everything a member can do, and reports what worked (tests only).

    python tests/outsider.py --bootstrap MADDR --target MADDR --prefix PREFIX --run-id RUN --out result.json
        [--secret TEXT] [--identity KEY_FILE]

It joins the DHT through the bootstrap node (or, refused, starts a DHT node of its own), dials the target member
directly, and tries: reading the roster, writing a roster entry (a leaver's, so a member that accepts it does not
wait for it), joining a group (rpc_join_group, with a proof made from its secret, if any), uploading a part
(rpc_aggregate_part) and downloading the state (rpc_admit, then rpc_download_state). Each outcome goes into the
JSON report: what the member answered, never what the outsider hoped.
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
        report.update(dht.run_coroutine(_Attempts(args.target, args.prefix, args.run_id, args.secret)))
    finally:
        dht.shutdown()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


class _Attempts:
    """Runs in the outsider's DHT process, with its P2P node and DHT protocol."""

    def __init__(self, target: str, prefix: str, run_id: str, secret):
        self.target, self.prefix, self.run_id, self.secret = target, prefix, run_id, secret

    async def __call__(self, _dht, node) -> dict:
        from hivemind.p2p import PeerID
        from hivemind.utils.multiaddr import Multiaddr

        address, peer = self.target.rsplit("/p2p/", 1)
        target = PeerID.from_base58(peer)
        await node.p2p._client.connect(target, [Multiaddr(address)])
        out = {}
        for name, attempt in (("dht_read", self.read_roster), ("dht_write", self.write_roster),
                              ("join_group", self.join_group), ("upload", self.upload),
                              ("download", self.download)):
            try:
                out[name] = await asyncio.wait_for(attempt(node, target), 20)
            except Exception as e:
                out[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        return out

    def proof(self, peer_id) -> bytes:
        from p2p_diloco.net.access import AccessKeys

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
        key = DHTID.generate(source=f"{self.prefix}.roster")
        ok = await node.protocol.call_store(target, [key], [node.protocol.serializer.dumps(asdict(status))],
                                            get_dht_time() + 30, subkeys=[status.peer_id])
        if not ok or not all(ok):
            return f"refused: {ok}"
        found = await node.protocol.call_find(target, [key])  # is our entry in the member's roster now?
        entries = found[key][0].value if found and found[key][0] is not None else {}
        return "written" if status.peer_id in entries else "not stored"

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
        from hivemind.utils.asyncio import as_aiter

        from p2p_diloco.net.averaging.averager import CanonicalAverager

        stub = CanonicalAverager.get_stub(node.p2p, target, namespace=self.prefix)
        part = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"\0" * 20, weight=1e6,
                                           tensor_part=runtime_pb2.Tensor(buffer=b"\0" * 64, dtype="float32"))
        async for message in await stub.rpc_aggregate_part(as_aiter(part)):
            return averaging_pb2.MessageCode.Name(message.code)
        return "no answer"

    async def download(self, node, target) -> str:
        from hivemind.proto import averaging_pb2

        from p2p_diloco.net.averaging.averager import CanonicalAverager

        stub = CanonicalAverager.get_stub(node.p2p, target, namespace=self.prefix)
        admitted = "n/a"
        if self.secret:
            reply = await stub.rpc_admit(averaging_pb2.JoinRequest(gather=self.proof(node.peer_id)), timeout=10)
            admitted = averaging_pb2.MessageCode.Name(reply.code)
        size = 0
        async for message in await stub.rpc_download_state(averaging_pb2.DownloadRequest()):
            size += len(message.tensor_part.buffer)
        return f"{size} bytes (admission: {admitted})"


if __name__ == "__main__":
    sys.exit(main())
