"""What validating the run's DHT records and checking commit certificates cost a peer (issue 24), at N peers. Run:

    python benchmarks/record_costs.py [--peers 4 16] [--repeats 3]

For each N it builds what a peer reads from the DHT in a round of an N-peer run, signed with real Ed25519 keys as
the peers' DHT nodes sign them (net/security/records.py): N roster entries and N commit records (8 commits each),
then times, median of ``--repeats`` runs of 200 reads each:

* the reference: decoding the N records' values (MessagePack), what a read costs with no validation at all;
* validation: the signature check and strip (a node's cache emptied before every read, so each signature is
  checked: the worst case; a node checks each record once) and the typed checks of net/records.py;
* the certificate: :func:`p2p_diloco.net.certificate.certify` over the N commit records.

and reports the bytes of each sealed record. What a round does with them (2 roster reads on the round's path, one
commit record stored per member, one commit-record read per join or repair) is measured in real swarms by
``benchmarks/scale.py``'s cost table (``net/roster_read_s``, ``net/certificate_store_s``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer

from common import table
from p2p_diloco.net.certificate import KEPT, certify
from p2p_diloco.net.consensus import PeerStatus
from p2p_diloco.net.keys import commits_key, roster_key
from p2p_diloco.net.records import check
from p2p_diloco.net.security.identity import Identity
from p2p_diloco.net.security.records import PeerSignatureValidator
from p2p_diloco.net.security.schema import RunRecordValidator

READS = 200
PREFIX = "bench_0123456789abcdef"


def sealed(identity: Identity, key: str, value: dict) -> DHTRecord:
    plain = DHTRecord(key=DHTID.generate(source=key).to_bytes(), subkey=MSGPackSerializer.dumps(identity.peer_id_b58),
                      value=MSGPackSerializer.dumps(value), expiration_time=time.time() + 3600)
    return DHTRecord(plain.key, plain.subkey, PeerSignatureValidator(identity).sign_value(plain), plain.expiration_time)


def records(n: int) -> tuple[list[DHTRecord], list[DHTRecord], list[str]]:
    ids = [Identity.generate() for _ in range(n)]
    digests = [f"{r:064x}" for r in range(1, KEPT + 1)]
    statuses = [PeerStatus(name=f"peer{k}", peer_id=i.peer_id_b58, round=KEPT, digest=digests[-1], steps_per_s=1.5,
                           tokens_trained=10 ** 6, reachability="public") for k, i in enumerate(ids)]
    roster = [sealed(i, roster_key(PREFIX), asdict(s)) for i, s in zip(ids, statuses)]
    commits = [sealed(i, commits_key(PREFIX), {"peer_id": i.peer_id_b58, "commits": [[r + 1, d] for r, d in
                                                                                    enumerate(digests)]})
               for i in ids]
    return roster, commits, [i.peer_id_b58 for i in ids]


def timed(read) -> float:
    samples = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for _ in range(READS):
            read()
        samples.append((time.perf_counter() - started) / READS)
    return statistics.median(samples)


def measure(n: int) -> list:
    roster, commits, ids = records(n)
    kinds = {roster_key(PREFIX): "roster", commits_key(PREFIX): "commits"}
    signatures = PeerSignatureValidator(Identity.generate())
    node = CompositeValidator([signatures, RunRecordValidator(kinds)])

    def decode(batch):
        return lambda: [MSGPackSerializer.loads(node.strip_value(r)) for r in batch]

    def validate(batch, kind):
        def read():
            signatures._verified.clear()  # every signature checked again: a node that never saw these records
            out = []
            for r in batch:
                assert node.validate(r)
                value = MSGPackSerializer.loads(node.strip_value(r))
                out.append(check(kind, MSGPackSerializer.loads(r.subkey), value))
            return out
        return read

    parsed = dict(validate(commits, "commits")())
    digest = parsed[ids[0]][-1][1]
    reference = timed(decode(roster + commits))
    roster_s, commits_s = timed(validate(roster, "roster")), timed(validate(commits, "commits"))
    certify_s = timed(lambda: certify(KEPT, digest, ids, parsed, set(ids), (KEPT - 1, ids), ids[0]))
    return [n, len(roster[0].value), len(commits[0].value), f"{reference * 1e3:.2f}", f"{roster_s * 1e3:.2f}",
            f"{commits_s * 1e3:.2f}", f"{certify_s * 1e6:.0f}", f"{(roster_s + commits_s) / reference:.0f}"]


def main() -> None:
    global args
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, nargs="+", default=[4, 16])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rows = [measure(n) for n in args.peers]
    print(table(["N", "roster entry bytes (sealed)", "commit record bytes (sealed)",
                 "decode N+N records ms (reference)", "validate N roster entries ms", "validate N commit records ms",
                 "certificate check µs", "validation / decoding"], rows))


if __name__ == "__main__":
    main()
