"""DHT nodes: one per peer, in its own process with its own p2pd daemon (hivemind.DHT), which die with the process
that created them; p2pd's flags hivemind does not expose, AutoNAT's verdict, reconnecting to the initial peers. The
keys this project writes and reads under a run, and their readers: net/keys.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler
from typing import Optional, Sequence

import hivemind
import torch
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2p_diloco.config import ConfigError, NetworkConfig
from p2p_diloco.net.security.auth import REVOKED_KEY, Access, bind_remote_peers
from p2p_diloco.net.security.identity import RSA
from p2p_diloco.net.security.records import PeerSignatureValidator, provide_identity
from p2p_diloco.net.security.schema import RunRecordValidator
from p2p_diloco.net.security.warden import AnswerMembership
from p2p_diloco.errors import JoinError
from p2p_diloco.net.failfast import FailFast, HelperDied
from p2p_diloco.ops.procs import become_child_process, end_hard, subprocesses_die_with_us

logger = logging.getLogger(__name__)

# hivemind switches torch to the "file_system" sharing strategy on import, which starts a torch_shm_manager daemon
# that outlives its peer by tens of seconds, outside the peer's process group. What we share (hivemind's future
# buffers, one averaging buffer per parameter) is shared before forking: file descriptors suffice, leave no daemon.
torch.multiprocessing.set_sharing_strategy("file_descriptor")


class DHT(FailFast, hivemind.DHT):
    """hivemind.DHT whose background process, and the p2pd daemon it starts, die with the process that created it;
    its p2pd also reports AutoNAT's verdict (:func:`nat_status`) and uses its trusted relays at once. Calls on it
    fail at once with HelperDied once its process or p2pd is known dead (net/supervise.py); ``relaunch(host_maddrs)``
    starts a new node like it (same settings and identity), set by :func:`start_dht`."""

    def __init__(self, *args, p2pd_flags: Optional[dict] = None, **kwargs):
        self._p2pd_flags = dict(p2pd_flags or {})  # set before super().__init__, which may start the process
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        become_child_process()
        subprocesses_die_with_us()
        _configure_p2pd(self._p2pd_flags)
        if self.kwargs.get("authorizer") is not None:
            bind_remote_peers()  # a private run: the authorizer refuses revoked senders (net/security/auth.py)
        self._inner_pipe = _RequestsIn(self._inner_pipe)
        super().run()

    async def _dropped(self, node=None) -> None:
        """What a request that could not be read becomes (:class:`_RequestsIn`): nothing."""

    def shutdown(self) -> None:
        """hivemind's, but our end of the pipe is closed after the process ended, not right after the request: closed
        at once, the DHT process's read of the request failed now and then (ConnectionResetError in ``DHT._run``),
        the request was lost, and the process was ended the hard way 3 s later, leaving its p2pd socket behind."""
        if self.is_alive():
            self._outer_pipe.send(("_shutdown", [], {}))
            self.join(self.shutdown_timeout)
            if self.is_alive():
                logger.warning("DHT did not shut down within the grace period; ending it the hard way")
                self.terminate()
                self.join(self.shutdown_timeout)
                self._remove_daemon_socket()  # its p2pd dies with it, too abruptly to remove its socket file
        self._outer_pipe.close()

    daemon_socket: Optional[str] = None  # the path of our p2pd's control socket, learnt at start (start_dht)

    def _remove_daemon_socket(self) -> None:
        if self.daemon_socket and os.path.basename(self.daemon_socket).startswith("hivemind-p2pd-"):
            with contextlib.suppress(OSError):
                os.unlink(self.daemon_socket)

    def terminate(self) -> None:
        end_hard(self)  # hivemind's fallback when shutdown() timed out: this process ignores SIGTERM


class _RequestsIn:
    """The DHT process's end of its request pipe, read in ``hivemind.DHT.run``, where a request that cannot be read
    costs ``wait_timeout`` (3 s) of sleep with no request served. One cannot be read when the process that sent it
    has ended since: its futures and pipe travel as file descriptors that the reader fetches from the sender
    (multiprocessing's resource sharer), and the averager's process, which stores its records through this DHT, is
    shut down right before it when a peer stops (FileNotFoundError, ConnectionResetError). The sleep held up the
    DHT's own shutdown request past its 3 s grace, and two peers stopping at once past their 12 s (CI). Such a
    request is dropped at once: its sender is gone and waits for no answer."""

    def __init__(self, pipe):
        self._pipe = pipe

    def fileno(self) -> int:
        return self._pipe.fileno()

    def poll(self, *args) -> bool:
        return self._pipe.poll(*args)

    def recv(self):
        message = self._pipe.recv_bytes()  # EOFError here: the pipe itself is closed (our peer is gone), as before
        try:
            return ForkingPickler.loads(message)
        except (OSError, EOFError, RuntimeError) as e:  # EOFError: the sender died within the fetch (CI: it ended
            # the DHT's process, which hivemind's loop does not catch)
            logger.debug(f"a request whose sender has gone was dropped: {e!r}")
            return "_dropped", [], {}


# ---------------------------------------------------------------------------------------------- p2pd settings
# Settings hivemind 1.1.12's P2P.create cannot pass to its p2pd (hivemind is pinned exactly, see averaging.py),
# applied in the DHT's own process only:
#  * the relay's limits per relayed connection (network.relay_time_limit, network.relay_data_limit);
#  * with trusted relays, -relayDiscovery=0: otherwise p2pd's autorelay waits for 4 relay candidates or 3 minutes
#    (go-libp2p's bootDelay) before it reserves a slot; with static relays it reserves once AutoNAT says "private";
#  * AutoNAT's verdict ("NAT status is public|private", logged at debug level by the autonat subsystem) is kept for
#    nat_status(): p2pd exposes it in no other way.
_NAT_STATUS: dict = {"status": None}
_NAT_CHANGED: Optional[asyncio.Event] = None


def _configure_p2pd(flags: dict) -> None:
    from hivemind.utils.logging import loglevel, python_level_to_golog

    level = os.environ.get("GOLOG_LOG_LEVEL") or python_level_to_golog(loglevel)  # a user's setting, if any
    os.environ["GOLOG_LOG_LEVEL"] = f"{level},autonat=debug"
    make_args, log_line = P2P._make_process_args, P2P._log_p2pd_message

    def make_process_args(*args, **kwargs):
        if kwargs.get("trustedRelays"):
            kwargs.setdefault("relayDiscovery", False)
        return make_args(*args, **{**kwargs, **flags})

    def log_p2pd_message(line: str) -> None:
        match = re.search(r"NAT status is (public|private|unknown)", line)
        if match:
            _NAT_STATUS["status"] = match.group(1)
            if _NAT_CHANGED is not None:
                _NAT_CHANGED.set()
        log_line(line)

    P2P._make_process_args = staticmethod(make_process_args)
    P2P._log_p2pd_message = staticmethod(log_p2pd_message)


def nat_status(dht: hivemind.DHT, timeout: float = 0.0) -> Optional[str]:
    """AutoNAT's verdict on this node: "public" (peers dialed it back), "private" (they could not) or "unknown";
    None if it has none yet. Waits up to ``timeout`` seconds for a first verdict (p2pd starts asking its peers to
    dial back 15 s after it started)."""
    return dht.run_coroutine(_NatStatusQuery(timeout))


class _NatStatusQuery:
    """Runs in the DHT's process (picklable, unlike a closure)."""

    def __init__(self, timeout: float):
        self.timeout = timeout

    async def __call__(self, _dht, _node) -> Optional[str]:
        global _NAT_CHANGED
        if _NAT_STATUS["status"] is None and self.timeout > 0:
            _NAT_CHANGED = _NAT_CHANGED or asyncio.Event()
            try:
                await asyncio.wait_for(_NAT_CHANGED.wait(), self.timeout)
            except asyncio.TimeoutError:
                pass
        return _NAT_STATUS["status"]


JOIN_RETRY_S = 2.0  # between attempts to reach the initial peers when p2pd fails at once (within join_timeout)


def start_dht(cfg: NetworkConfig, *, client_mode: Optional[bool] = None, force_reachability: Optional[str] = None,
              relays: Sequence[str] = (), identity=None) -> DHT:
    """Start a DHT node from the [network] section; raise JoinError (one line) if it cannot join in time.

    ``client_mode`` overrides ``network.client_mode``; ``force_reachability`` ("public"/"private") replaces p2pd's
    AutoNAT verdict; ``relays``: multiaddrs of relays to reserve a slot at as soon as this node is found unreachable.
    With ``network.secret`` or ``network.secret_file``, the node speaks only to holders of the secret (net/security/auth.py).
    Its identity key is ours (``network.identity_path``, else a fresh one): records under its PeerID are signed with
    it, and records in another PeerID's name not signed by that peer are refused (net/security/records.py), as are
    malformed records under the run's keys once they are known (net/security/schema.py).
    """
    private = cfg.secret is not None or cfg.secret_file is not None
    access = Access(cfg.secret, cfg.secret_file, revokers=cfg.revokers) if private else None
    _check_maddrs("network.initial_peers", cfg.initial_peers)
    _check_maddrs("network.host_maddrs", cfg.host_maddrs)
    _check_maddrs("network.announce_maddrs", cfg.announce_maddrs)
    _check_maddrs("network.trusted_relays", cfg.trusted_relays)
    restart = identity is not None  # a restart's identity is ours, and its old p2pd is dead: nothing to check
    identity, identity_file, check_identity, forget_file = provide_identity(cfg.identity_path, identity)
    # hivemind 1.1.12 checks that the id is free by reading the key file as RSA: an Ed25519 key (ours by default)
    # failed every start of a peer whose key file existed ("Could not deserialize key data", exit 2)
    check_identity = check_identity and not restart and identity.key_type == RSA
    try:
        dht = _start(cfg, access, identity, identity_file, check_identity, client_mode, force_reachability, relays)
    finally:
        forget_file()  # p2pd read it at start (a key we generated: nobody else ever sees it)
    if access is not None:  # a private bootstrap keeps connections with members only (net/security/warden.py)
        dht.run_coroutine(AnswerMembership())
    dht.daemon_socket = _daemon_socket(dht, cfg.join_timeout)
    # a restart (net/supervise.py) keeps who we are: the same identity, even one generated for this process alone
    dht.relaunch = lambda host_maddrs: start_dht(replace(cfg, host_maddrs=list(host_maddrs)), client_mode=client_mode,
                                                 force_reachability=force_reachability, relays=relays,
                                                 identity=identity)
    return dht


def _daemon_socket(dht, timeout: float) -> Optional[str]:
    """Our p2pd's control socket path (``/unix/...`` in its multiaddr), or None if the DHT does not say."""
    try:
        maddr = dht.run_coroutine(hivemind.DHT._get_p2p_daemon_listen_maddr, return_future=True).result(timeout)
        return str(maddr).removeprefix("/unix") if str(maddr).startswith("/unix/") else None
    except Exception as e:  # noqa: BLE001 - only the cleanup after a hard stop needs it
        logger.debug(f"the p2pd socket path is unknown: {e!r}")
        return None


def _start(cfg: NetworkConfig, access: Optional[Access], identity, identity_file: str, check_identity: bool,
           client_mode: Optional[bool], force_reachability: Optional[str], relays: Sequence[str]) -> DHT:
    kwargs = dict(
        initial_peers=list(cfg.initial_peers),
        host_maddrs=list(cfg.host_maddrs),
        announce_maddrs=list(cfg.announce_maddrs) or None,
        identity_path=identity_file,
        check_if_identity_free=check_identity,
        record_validators=[PeerSignatureValidator(identity, exempt_keys=[REVOKED_KEY]),
                           RunRecordValidator({REVOKED_KEY: "revoked"}, access.keys if access else None)],
        client_mode=cfg.client_mode if client_mode is None else client_mode,
        startup_timeout=cfg.join_timeout,
        bootstrap_timeout=cfg.join_timeout,
        force_reachability=force_reachability,
        use_auto_relay=bool(relays),
        trusted_relays=list(relays) or None,
        authorizer=access.authorizer() if access is not None else None,
    )
    flags = {"relayDataLimit": cfg.relay_data_limit, "relayTimeLimit": f"{round(cfg.relay_time_limit * 1000)}ms"}
    deadline = time.monotonic() + cfg.join_timeout
    while True:
        try:
            dht = DHT(start=True, await_ready=False, p2pd_flags=flags, **kwargs)
            dht.wait_until_ready(timeout=cfg.join_timeout + 5)
            return dht
        except TimeoutError:
            dht.shutdown()
            raise JoinError(f"could not join the swarm within {cfg.join_timeout:.0f} s "
                            f"(network.initial_peers={','.join(cfg.initial_peers)})") from None
        except RuntimeError as e:  # hivemind: "DHTNode bootstrap failed: none of the initial_peers responded"
            dht.shutdown()
            if time.monotonic() + JOIN_RETRY_S < deadline:  # a ping unanswered in hivemind's 3 s: a loaded node,
                # or one that refuses us: ask again until network.join_timeout, then say so
                logger.info(f"no initial peer answered our ping yet; trying again in {JOIN_RETRY_S:.0f} s")
                time.sleep(JOIN_RETRY_S)  # a node outside this process: no event to wait on
                continue
            raise JoinError(f"no initial peer answered our DHT requests (a private run's nodes answer only holders "
                            f"of its secret: network.secret_file): {str(e).strip().splitlines()[-1][:200]}") from None
        except (P2PDaemonError, OSError, ValueError) as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            if "bootstrap" not in msg.lower() and "connect" not in msg.lower():
                raise JoinError(msg) from None
            if time.monotonic() + JOIN_RETRY_S >= deadline:  # p2pd refused at once: the peer may be restarting
                raise JoinError(f"no initial peer reachable ({','.join(cfg.initial_peers)}): {msg}") from None
            logger.info(f"no initial peer reachable yet ({msg}); trying again in {JOIN_RETRY_S:.0f} s")
            time.sleep(JOIN_RETRY_S)  # the network or the initial peer outside this process: no event to wait on


def reconnect(dht: hivemind.DHT, maddrs: Sequence[str], timeout: float) -> int:
    """Dial and ping these nodes again, so that they are back in this node's DHT routing table; return how many
    answered. A DHT node drops every neighbour that fails a request (a home router's outage does that to all of
    them) and hivemind never bootstraps again by itself: without this, such a peer stays alone for good. 0 if the
    DHT process does not answer within 2 × ``timeout`` + 5 s (two dials and a ping per node, run together)."""
    try:
        return dht.run_coroutine(_Reconnect(list(maddrs), timeout), return_future=True).result(timeout=2 * timeout + 5)
    except (TimeoutError, HelperDied) as e:
        logger.debug(f"reconnecting failed: {e!r}")
        return 0


def redial(dht: hivemind.DHT, maddrs: Sequence[str], timeout: float) -> None:
    """:func:`reconnect` without waiting for the answer: from a heartbeat, which must stay on time. A node that
    restarted (a bootstrap node after its p2pd died, net/supervise.py) knows nobody: being dialed puts us back in
    its routing table, so that joiners find the run through it again."""
    dht.run_coroutine(_Reconnect(list(maddrs), timeout), return_future=True)


class _Reconnect:
    """Runs in the DHT's process (picklable, unlike a closure)."""

    def __init__(self, maddrs: list[str], timeout: float):
        self.maddrs, self.timeout = maddrs, timeout

    async def __call__(self, _dht, node) -> int:
        async def ping(maddr: str) -> bool:
            address, peer = maddr.rsplit("/p2p/", 1)
            peer_id = PeerID.from_base58(peer)
            for fresh in (False, True):  # a connection that lived through the outage may still be stalled
                try:
                    if fresh:
                        await asyncio.wait_for(node.p2p._client.disconnect(peer_id), self.timeout)
                    await asyncio.wait_for(node.p2p._client.connect(peer_id, [Multiaddr(address)]), self.timeout)
                    if await node.protocol.call_ping(peer_id) is not None:
                        return True
                except Exception as e:
                    logger.debug(f"reconnecting to {maddr} failed: {e!r}")
            return False

        return sum(await asyncio.gather(*(ping(m) for m in self.maddrs if "/p2p/" in m)))


def answers(dht: hivemind.DHT, peer_id: str, timeout: float) -> Optional[bool]:
    """Whether the peer's DHT node answers a ping within ``timeout`` (dialed if need be): False for a peer that died
    (its p2pd went with it) or that we cannot reach; None when our own DHT could not ask (not the peer's fault)."""
    try:
        return dht.run_coroutine(_Ping(peer_id, timeout), return_future=True).result(timeout=timeout + 5)
    except Exception as e:  # noqa: BLE001 - our DHT's process died or is stuck: the supervisor's business
        logger.debug(f"could not ping {peer_id}: {e!r}")
        return None


def answering(dht: hivemind.DHT, peer_ids: Sequence[str], timeout: float) -> set[str]:
    """Which of ``peer_ids`` answer a ping within ``timeout``, asked at once; all of them when our own DHT could
    not ask (nobody is taken for dead for our own failure)."""
    if not peer_ids:
        return set()
    try:
        answered = dht.run_coroutine(_PingAll(list(peer_ids), timeout), return_future=True).result(timeout=timeout + 5)
    except Exception as e:  # noqa: BLE001 - our DHT's process died or is stuck: the supervisor's business
        logger.debug(f"could not ping {len(peer_ids)} peer(s): {e!r}")
        return set(peer_ids)
    return {p for p, ok in zip(peer_ids, answered) if ok}


class _PingAll:
    """Runs in the DHT's process (picklable, unlike a closure)."""

    def __init__(self, peer_ids: list[str], timeout: float):
        self.peer_ids, self.timeout = peer_ids, timeout

    async def __call__(self, dht, node) -> list[bool]:
        return list(await asyncio.gather(*(_Ping(p, self.timeout)(dht, node) for p in self.peer_ids)))


class _Ping:
    """Runs in the DHT's process (picklable, unlike a closure)."""

    def __init__(self, peer_id: str, timeout: float):
        self.peer_id, self.timeout = peer_id, timeout

    async def __call__(self, _dht, node) -> bool:
        try:
            answer = await asyncio.wait_for(node.protocol.call_ping(PeerID.from_base58(self.peer_id)), self.timeout)
        except Exception:  # noqa: BLE001 - a bad id, a timeout: no answer
            return False
        return answer is not None


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Multiaddrs others can dial, with the peer id; loopback ones last."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    return sorted(maddrs, key=lambda m: ("/127.0.0.1/" in m or "/::1/" in m, m))


def _check_maddrs(key: str, maddrs: Sequence[str]) -> None:
    for maddr in maddrs:
        if not maddr.startswith("/"):
            raise ConfigError(f"{key}: not a multiaddr: {maddr!r} (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...)")
        try:
            Multiaddr(maddr)
        except Exception as e:  # the multiaddr library raises several unrelated types
            raise ConfigError(f"{key}: invalid multiaddr {maddr!r}: {e}") from None


