"""``p2p-diloco doctor``: what this machine sees of the swarm, one verdict per line, short enough to paste into an
issue. It joins the swarm like a peer would (as a DHT client, so it disturbs nobody), then reports:

  initial peers        which answered, through which address
  round trip, clock    DHT pings to the first that answered (hivemind needs clocks within 3 s of each other)
  throughput           up and down, against a p2p-diloco bootstrap node (it serves a speed test)
  reachable            p2pd's AutoNAT verdict: can others dial this machine?
  addresses            what this machine announces to others
  relay                its reservation at a relay, and whether the relay's limits fit the run's payload
  mode                 how a peer started here with this config would take part (public, relayed, client)
  /dev/shm, disk       room for the averager's shared buffers and for checkpoints
  GPU                  what torch sees

The exit code is 0 when no line says FAIL.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from p2p_diloco.config import Config
from p2p_diloco.errors import JoinError

SPEED_PROTOCOL = "/p2p-diloco/doctor/speed/2.0.0"  # 2: the request carries a membership proof
SPEED_BYTES = 2 << 20       # each way; at 20 Mbit/s up, about a second
SPEED_MAX_BYTES = 64 << 20  # what a bootstrap node serves at most per request
SPEED_PROOF_BYTES = 32      # the membership proof in a request (net/security/access.py; zeros in an open run)
SPEED_PER_PEER, SPEED_TOTAL = 1, 4  # speed tests a bootstrap node serves at once to one peer, and in all
SPEED_HEADER_TIMEOUT = 10.0  # s for a request's header to arrive (a silent stream does not hold a slot longer)
CLOCK_WARN_S, CLOCK_FAIL_S = 1.0, 3.0  # hivemind rejects peers more than 3 s apart (MAX_DHT_TIME_DISCREPANCY_SECONDS)


@dataclass
class Line:
    verdict: str  # OK | WARN | FAIL | INFO
    name: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.verdict:^4}] {self.name}: {self.detail}"


def run_doctor(cfg: Config, echo: Callable[[str], None] = print) -> int:
    """Print the report line by line; return 0 if no line failed, else 1."""
    lines: list[Line] = []

    def say(line: Line) -> None:
        lines.append(line)
        echo(str(line))

    params = _parameter_count(cfg)
    payload = params * (4 if cfg.averaging.codec == "fp32" else 2)
    echo(f"p2p-diloco doctor: model {cfg.model.name} ({params / 1e6:.1f}M parameters, {payload / 1e6:.1f} MB "
         f"per all-reduce payload), run {cfg.run.run_id!r}")
    _network_checks(cfg, payload, say)
    for line in _local_checks(cfg, params):
        say(line)
    return 1 if any(line.verdict == "FAIL" for line in lines) else 0


# ---------------------------------------------------------------------------------------------- network
def _network_checks(cfg: Config, payload: int, say: Callable[[Line], None]) -> None:
    from p2p_diloco.net.dht import nat_status, reconnect, start_dht

    net = cfg.network
    if not net.initial_peers:
        say(Line("FAIL", "initial peers", "none given (--initial-peers MADDR[,MADDR])"))
        return
    try:
        dht = start_dht(net, client_mode=True, relays=list(net.trusted_relays or net.initial_peers))
    except JoinError as e:
        say(Line("FAIL", "initial peers", str(e)))
        return
    try:
        answered = [m for m in net.initial_peers if reconnect(dht, [m], cfg.averaging.request_timeout)]
        say(Line("OK" if answered else "FAIL", "initial peers",
                 f"{len(answered)} of {len(net.initial_peers)} answered" + (f" (first: {answered[0]})" if answered else "")))
        if answered:
            first = answered[0].rsplit("/p2p/", 1)[1]
            for line in _ping_lines(dht, first) + [_throughput_line(dht, first, _speed_proof(net, dht))]:
                say(line)
        status = nat_status(dht, timeout=net.reachability_timeout)
        say(_reachable_line(status))
        say(_addresses_line(dht))
        for line in _relay_lines(cfg, dht, status, payload):
            say(line)
    finally:
        dht.shutdown()


def _reachable_line(status: Optional[str]) -> Line:
    if status == "public":
        return Line("OK", "reachable from outside", "yes: peers dialed this machine back (AutoNAT)")
    if status == "private":
        return Line("WARN", "reachable from outside", "no: behind NAT or a firewall, peers cannot dial this machine "
                    "(AutoNAT); it can still take part through a relay or in client mode")
    return Line("WARN", "reachable from outside", f"unknown: AutoNAT gave no verdict ({status or 'none in time'}); "
                "it needs a connected peer with a public address")


def _addresses_line(dht) -> Line:
    from p2p_diloco.net.reachability import is_public_ip

    maddrs = [str(m) for m in dht.get_visible_maddrs(latest=True)]
    shown = [m.split("/p2p/")[0] + ("/p2p-circuit" if "/p2p-circuit" in m else "") for m in maddrs]
    public = [m for m in maddrs if "/p2p-circuit" not in m and is_public_ip(m.split("/")[2])]
    verdict = "OK" if public or any("/p2p-circuit" in m for m in maddrs) else "WARN"
    return Line(verdict, "announced addresses", ", ".join(sorted(set(shown))) or "none")


def _relay_lines(cfg: Config, dht, status: Optional[str], payload: int) -> list[Line]:
    from p2p_diloco.net.nat import RELAY_WAIT_S, find_relay, findings
    from p2p_diloco.net.reachability import choose_mode, limits_text, relay_problem, short_maddr

    relay = None
    if status == "public":
        lines = [Line("INFO", "relay", "not needed: others can dial this machine")]
    else:
        relay = find_relay(dht, timeout=RELAY_WAIT_S)
        problem = relay_problem(relay, payload)
        if relay is None:
            lines = [Line("WARN", "relay", "no reservation: run a relay (p2p-diloco bootstrap on a public host) and "
                          "list it in network.trusted_relays")]
        else:
            lines = [Line("OK" if problem is None else "WARN", "relay",
                          f"reserved at {short_maddr(relay.relay)}; {limits_text(relay)}" + (f": {problem}" if problem else ""))]
    choice = choose_mode(findings(cfg.network, status, relay, payload))
    return lines + [Line("INFO", "mode", f"a peer here would take part as {choice.mode}: {choice.reason}")]


def _ping_lines(dht, peer: str) -> list[Line]:
    samples = dht.run_coroutine(_PingQuery(peer, count=5))
    if not samples:
        return [Line("FAIL", "round trip", f"no answer to DHT pings from {peer}")]
    rtt, offset = min(samples)
    verdict = "OK" if abs(offset) < CLOCK_WARN_S else "WARN" if abs(offset) < CLOCK_FAIL_S else "FAIL"
    return [Line("INFO", "round trip", f"{rtt * 1e3:.1f} ms to {peer[:16]}… (best of {len(samples)} DHT pings)"),
            Line(verdict, "clock offset", f"{offset * 1e3:+.0f} ms against {peer[:16]}… (hivemind needs < 3 s)")]


def _speed_proof(net, dht) -> bytes:
    """Our membership proof for a private run's bootstrap node (the run-independent one: a bootstrap serves the
    secret's whole swarm); zeros in an open run."""
    if net.secret is None and net.secret_file is None:
        return bytes(SPEED_PROOF_BYTES)
    from p2p_diloco.net.security.access import AccessKeys, read_secret

    return AccessKeys.derive(read_secret(net.secret, net.secret_file)).proof(dht.peer_id.to_bytes())


def _throughput_line(dht, peer: str, proof: bytes = bytes(SPEED_PROOF_BYTES), attempts: int = 2) -> Line:
    for _ in range(attempts):  # one retry: a stream reset once on a busy link says nothing of its speed
        result = dht.run_coroutine(_SpeedQuery(peer, SPEED_BYTES, SPEED_BYTES, proof))
        if not isinstance(result, str):
            break
    if result is None:
        return Line("INFO", "throughput", "not measured: the first initial peer serves no speed test (it is not a "
                    "p2p-diloco bootstrap node)")
    if isinstance(result, str):
        return Line("WARN", "throughput", f"not measured: the speed test with {peer[:16]}… failed {attempts} times "
                    f"({result})")
    up_s, down_s = result
    return Line("INFO", "throughput", f"up {SPEED_BYTES * 8 / up_s / 1e6:.1f} Mbit/s, down "
                f"{SPEED_BYTES * 8 / down_s / 1e6:.1f} Mbit/s ({SPEED_BYTES >> 20} MiB each way with {peer[:16]}…)")


class _PingQuery:
    """Runs in the DHT's process: (round trip s, clock offset s) of ``count`` DHT pings."""

    def __init__(self, peer: str, count: int):
        self.peer, self.count = peer, count

    async def __call__(self, _dht, node) -> list[tuple[float, float]]:
        from hivemind.p2p import PeerID
        from hivemind.proto import dht_pb2
        from hivemind.utils.timed_storage import get_dht_time

        stub, samples = node.protocol.get_stub(PeerID.from_base58(self.peer)), []
        for _ in range(self.count):
            try:
                sent = get_dht_time()
                response = await stub.rpc_ping(dht_pb2.PingRequest(peer=node.protocol.node_info), timeout=5)
                received = get_dht_time()
            except Exception:
                continue
            if response.dht_time:
                samples.append((received - sent, response.dht_time - (sent + received) / 2))
        return samples


class _SpeedQuery:
    """Runs in the DHT's process: (upload s, download s) of a speed test with ``peer``, None if it serves none, or
    why the test failed (one line)."""

    def __init__(self, peer: str, up: int, down: int, proof: bytes = bytes(SPEED_PROOF_BYTES)):
        self.peer, self.up, self.down, self.proof = peer, up, down, proof

    async def __call__(self, _dht, node) -> Optional[tuple[float, float] | str]:
        from hivemind.p2p import PeerID

        try:
            _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(self.peer),
                                                                           SPEED_PROTOCOL)
        except Exception:
            return None
        try:
            start = time.perf_counter()
            writer.write(self.up.to_bytes(8, "big") + self.down.to_bytes(8, "big") + self.proof)
            chunk = bytes(1 << 16)
            for offset in range(0, self.up, len(chunk)):
                writer.write(chunk[: self.up - offset])
                await writer.drain()
            await asyncio.wait_for(reader.readexactly(1), 120)  # the server has all our bytes
            uploaded = time.perf_counter()
            await asyncio.wait_for(reader.readexactly(self.down), 120)
            return uploaded - start, time.perf_counter() - uploaded
        except Exception as e:
            return repr(e)[:200]
        finally:
            writer.close()


class ServeSpeedTest:
    """Runs in a bootstrap node's DHT process: answer speed tests (see _SpeedQuery). In a private run (``keys``,
    net/security/access.py) only to a peer whose request carries a valid membership proof for its libp2p-authenticated
    PeerID; in any run at most SPEED_PER_PEER at once per peer and SPEED_TOTAL in all (others: the stream is closed
    unanswered, which the doctor reports as a failed test)."""

    def __init__(self, keys=None):
        self.keys = keys  # AccessKeys of the swarm's secret (run-independent), None in an open run
        self.refused = 0

    async def __call__(self, _dht, node) -> None:
        active: dict = {}  # PeerID -> speed tests it holds now

        async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = info.peer_id
            if active.get(peer, 0) >= SPEED_PER_PEER or sum(active.values()) >= SPEED_TOTAL:
                self.refused += 1
                writer.close()
                return
            active[peer] = active.get(peer, 0) + 1
            try:
                header = await asyncio.wait_for(reader.readexactly(16 + SPEED_PROOF_BYTES), SPEED_HEADER_TIMEOUT)
                if self.keys is not None and not self.keys.verify(peer.to_bytes(), header[16:]):
                    self.refused += 1
                    return  # not a member: closed unanswered
                up = min(int.from_bytes(header[:8], "big"), SPEED_MAX_BYTES)
                down = min(int.from_bytes(header[8:16], "big"), SPEED_MAX_BYTES)
                await reader.readexactly(up)
                writer.write(b"\x01")
                chunk = bytes(1 << 16)
                for offset in range(0, down, len(chunk)):
                    writer.write(chunk[: down - offset])
                    await writer.drain()
            except Exception:
                pass
            finally:
                active[peer] -= 1
                if not active[peer]:
                    del active[peer]
                writer.close()

        await node.p2p.add_binary_stream_handler(SPEED_PROTOCOL, handle)


# ---------------------------------------------------------------------------------------------- local
def _local_checks(cfg: Config, params: int) -> list[Line]:
    shm_needed = 2 * params * 4  # the averager's fp32 buffers, moved to shared memory, and hivemind's copies
    disk_needed = 2 * params * 4 * 5  # a checkpoint (θ_global, momentum, model, AdamW's two moments), written beside the last
    return [_free_line("/dev/shm", Path("/dev/shm"), shm_needed, "Docker: --shm-size=8g or --ipc=host"),
            _free_line("disk", _existing_parent(Path(cfg.run.run_dir)), disk_needed, f"for {cfg.run.run_dir}"),
            _gpu_line(cfg)]


def _free_line(name: str, path: Path, needed: int, advice: str) -> Line:
    try:
        free = shutil.disk_usage(path).free
    except OSError as e:
        return Line("FAIL", name, f"cannot read {path}: {e.strerror}")
    verdict = "OK" if free >= needed else "FAIL"
    return Line(verdict, name, f"{free / 2**30:.1f} GiB free at {path}, this model needs about "
                f"{needed / 2**30:.2f} GiB" + ("" if verdict == "OK" else f" ({advice})"))


def _gpu_line(cfg: Config) -> Line:
    import torch

    if not torch.cuda.is_available():
        wanted = cfg.run.device.startswith("cuda")
        return Line("FAIL" if wanted else "INFO", "GPU", f"none visible to torch {torch.__version__}; training "
                    "runs on the CPU" + (f" (run.device = {cfg.run.device})" if wanted else ""))
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return Line("OK", "GPU", ", ".join(f"{g.name} ({g.total_memory / 2**30:.0f} GiB)" for g in gpus)
                + f"; CUDA {torch.version.cuda}")


def _existing_parent(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists():
        path = path.parent
    return path


def _parameter_count(cfg: Config) -> int:
    """Parameters of the run's model, built on the meta device (no memory, no download)."""
    import torch
    from transformers import AutoModelForCausalLM

    from p2p_diloco.train.model import DEFAULT_VOCAB_SIZE, load_model_config

    vocab = 256 if cfg.data.tokenizer == "byte" else DEFAULT_VOCAB_SIZE
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_model_config(cfg.model, vocab))
    return sum(p.numel() for p in model.parameters())
