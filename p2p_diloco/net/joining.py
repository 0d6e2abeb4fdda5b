"""How a peer enters the swarm: the DHT (with our reachability probed and the run's published settings settled
against ours), then the averager, the membership and the announcement of where others can reach us.

Two steps because the model sits between them: :func:`open_dht` runs before the model is built (the run's settings
may complete our config), :func:`join_swarm` after (the averager's buffers take the model's shapes). Both set the
swarm-facing attributes of the :class:`~p2p_diloco.peer.Peer` they are given. hivemind is imported here lazily,
so that a peer with an injected averager (tests) never loads it.
"""

from __future__ import annotations

import signal
import threading

from p2p_diloco.ops.faults import parse_attack


def open_dht(peer) -> None:
    """Join the DHT, find out how we can take part (net/nat.py) and settle our config against the run's
    published settings (net/run_settings.py)."""
    from p2p_diloco.net import nat
    from p2p_diloco.net.run_settings import settle

    peer._probe = nat.probe(peer.cfg.network, peer.log)
    peer.dht = peer._probe.dht
    peer.cfg = settle(peer.cfg, peer.dht, peer.given, peer.log)


def join_swarm(peer) -> None:
    """Our reachability decided, the averager and the membership made, our addresses written and said; then wait
    for ``run.join_after_round``."""
    from p2p_diloco.net import nat
    from p2p_diloco.net.dht import visible_maddrs
    from p2p_diloco.net.keys import run_prefix
    from p2p_diloco.net.membership import Membership
    from p2p_diloco.net.run_settings import run_fingerprint

    cfg = peer.cfg
    peer.dht, choice, peer.relay_issue = nat.decide(cfg.network, peer._probe, payload_bytes(peer))
    peer.log.info(f"reachability: {choice.reason}; taking part as {choice.mode}")
    peer.relay = peer._probe.relay if choice.mode == "relayed" else None  # renewed after a failed round (exchange)
    peer._probe = None  # it holds the first DHT: after a restart that one would stay, with its futures' memory
    fingerprint = run_fingerprint(peer.fingerprint, cfg)  # the whole run spec too: other settings never average
    prefix = run_prefix(cfg.run.run_id, fingerprint)
    peer.averager = _averager(peer, prefix, choice.mode, access(peer))
    peer.membership = Membership(cfg, peer.dht, peer.averager, prefix, peer.name, peer.state, fingerprint,
                                 peer.metrics, peer.stop_event, peer.log, reachability=choice.mode)
    maddrs = visible_maddrs(peer.dht)
    (peer.run_dir / "maddrs.txt").write_text("\n".join(maddrs) + "\n")
    peer.log.info(f"joined run {cfg.run.run_id!r} as {peer.averager.peer_id} (group key prefix {prefix}); others "
                  f"can join through: {' '.join(maddrs)}")
    peer.membership.wait_for_round(cfg.run.join_after_round)


def access(peer):
    """A private run's access rules (net/security/auth.py), or None for an open run, said in one line."""
    from p2p_diloco.net.security.auth import Access

    net = peer.cfg.network
    if net.secret is None and net.secret_file is None:
        peer.log.warning("open run: anyone who can reach a peer may join, upload into the average and download "
                         "the model (set network.secret_file to make it private)")
        return None
    rules = Access(net.secret, net.secret_file, peer.cfg.run.run_id, net.revokers)
    rules.refresh(peer.dht, peer.cfg.averaging.request_timeout)
    who = f"signed by {len(net.revokers)} revoker(s)" if net.revokers else "off (network.revokers is empty)"
    peer.log.info(f"private run: members only (secret {rules.keys.fingerprint}, {len(rules.revoked)} revoked "
                  f"peer(s); revocations {who})")
    return rules


def payload_bytes(peer) -> int:
    """Bytes of one pseudo-gradient on the wire."""
    from p2p_diloco.net.averaging.wire import payload_bytes as wire_bytes

    a = peer.cfg.averaging
    return wire_bytes(sum(p.numel() for p in peer.state.params), a.codec, a.average_codec)


# ---------------------------------------------------------------------------------------------- a dead helper
def watch_network(peer) -> None:
    """Put the peer's network stack under watch (net/supervise.py): a dead DHT process, p2pd or averager is found
    within seconds, and ``peer.supervisor.ensure()`` at the top of each round restarts the stack through
    :func:`rejoin`."""
    from p2p_diloco.net.supervise import Supervisor

    peer.supervisor = Supervisor(_watch(peer), lambda: rejoin(peer), peer.log, stop_event=peer.stop_event)


def _watch(peer):
    from p2p_diloco.net.supervise import Watch

    return Watch(peer.dht, peer.averager._averager, on_down=peer.averager.abandon)


def rejoin(peer):
    """A new network stack in place of one whose helper died: a DHT node with the same identity, settings and
    listen ports, an averager and a membership like the old ones (same prefix, reachability, access rules), back in
    the roster. θ_local, θ_global, the outer state and the data position are the peer's and stay as they are; the
    next round catches up with the run through the ordinary join/rebase path. Returns the new stack's Watch."""
    from p2p_diloco.net.dht import visible_maddrs
    from p2p_diloco.net.failfast import close_host_side, drop_unclaimed_descriptors, fresh_shared_locks
    from p2p_diloco.net.membership import Membership
    from p2p_diloco.net.supervise import pinned_maddrs

    old, members = peer.averager, peer.membership
    members.stop()  # no leave announced: we are coming back under the same peer id
    old.abandon("the network stack is restarting")
    old.close()
    residual = old.error_feedback.state_dict() if old.error_feedback is not None else None
    old.release()  # its shared buffers, before the new helpers are forked: they would hold them for good
    if peer.dht.is_alive():
        peer.dht.shutdown()
    close_host_side(peer.dht)  # its pipes, before the new helpers are forked: they would inherit them for good
    fresh_shared_locks()  # a helper killed holding one of hivemind's would block the new ones for good
    drop_unclaimed_descriptors()  # the dead helpers' share of commands they never read
    peer.dht = peer.dht.relaunch(pinned_maddrs(peer.cfg.network.host_maddrs, peer.supervisor.watch.bound))
    peer.averager = _averager(peer, members.prefix, members.reachability, old.access)
    if residual is not None and peer.averager.error_feedback is not None:
        peer.averager.error_feedback.load_state_dict(residual)  # not lost with the process
    peer.membership = Membership(peer.cfg, peer.dht, peer.averager, members.prefix, peer.name, peer.state,
                                 members.fingerprint, peer.metrics, peer.stop_event, peer.log,
                                 reachability=members.reachability)
    peer.membership.work = members.work
    peer.membership.commits = members.commits  # the rounds we signed: our record keeps naming them
    (peer.run_dir / "maddrs.txt").write_text("\n".join(visible_maddrs(peer.dht)) + "\n")
    peer.membership.enter()
    return _watch(peer)


def _averager(peer, prefix: str, mode: str, rules):
    """The averaging seam for this peer's model (its process forked from this, the main, thread)."""
    from p2p_diloco.net.averaging import Averager

    cfg = peer.cfg
    sigint = signal.getsignal(signal.SIGINT)  # hivemind's averager sets SIGINT to "ignore" in this process: keep ours
    averager = Averager(peer.dht, cfg.averaging, prefix, [p.shape for p in peer.state.params],
                        client_mode=mode == "client", fault=peer.fault, access=rules,
                        weight_by_tokens=cfg.diloco.weight_by_tokens,
                        attack=parse_attack(cfg.fault.attack, cfg.fault.attack_from),
                        equivocate_from=cfg.fault.attack_from if cfg.fault.attack == "equivocate" else None)
    if threading.current_thread() is threading.main_thread() and sigint is not None:
        signal.signal(signal.SIGINT, sigint)
    return averager
