"""Adopting someone else's θ_global: a state downloaded from a donor (a join or a repair), checked before it replaces
ours (shapes and dtypes, finiteness, the donor's digest, the run's round, and the round's commit certificate,
net/certificate.py), and the snapshot we serve to others. A part of :class:`~p2p_diloco.net.membership.Membership`
(its ``state``, ``averager``, ``dht``, ``prefix``, ``cfg``, roster view ``_known``, ``metrics`` and ``log``)."""

from __future__ import annotations

import time
from typing import Optional

import torch
from hivemind.utils.timed_storage import get_dht_time

from p2p_diloco.net.certificate import Verdict, certify
from p2p_diloco.net.consensus import SyncTarget
from p2p_diloco.net.keys import read_commits
from p2p_diloco.train.global_state import parse_quorum
from p2p_diloco.train.outer import state_digests


class Adoption:
    """State transfers of a :class:`~p2p_diloco.net.membership.Membership`."""

    certificate_read_s = 0.0  # the last certificate check's DHT read, validation and pings, seconds

    def fetch(self, target: SyncTarget, fresh: bool) -> bool:
        """Download ``target`` from its donors (digest-checked) into our state. True if our state was replaced.
        ``fresh``: this peer has not trained yet (the transfer is logged as a join, else as a repair)."""
        kind = "join" if fresh else "repair"
        self.log.info(f"{kind}: our round {self.state.round} ({self.state.digest[:12]}) vs the run's round "
                      f"{target.round} ({target.digest[:12]}); fetching state")
        return self._fetch_state(target, kind)

    def _fetch_state(self, target: SyncTarget, kind: str) -> bool:
        start = time.perf_counter()
        got = self.averager.download_state(target.donors)
        if got is None:
            self.log.warning(f"{kind}: no donor delivered the state; retrying next round")
            return False
        metadata, tensors, donor = got
        problem = self._check_state(metadata, tensors, target)
        verdict = None if problem else self._certificate(metadata)
        problem = problem or (verdict.why if not verdict.ok else None)
        if problem:
            self.log.warning(f"{kind}: state from {donor} rejected: {problem}")
            return False
        self.state.load(metadata["round"], tensors, metadata.get("members", ()), parse_quorum(metadata.get("quorum")))
        self.state_changed()
        seconds = time.perf_counter() - start
        size = sum(t.numel() * t.element_size() for t in tensors)
        self.metrics.log({"event": kind, "peer": self.name, "round": self.state.round, "donor": metadata.get("name"),
                          "state_bytes": size, "seconds": seconds, "global_params_sha256": self.state.params_digest,
                          "state_sha256": self.state.digest, "certificate_signed": verdict.signed,
                          "certificate_group": verdict.group, "certificate_chained": verdict.chained,
                          "certificate_read_s": self.certificate_read_s})
        self.log.info(f"{kind}: got round {self.state.round} from {metadata.get('name')} ({size / 1e6:.1f} MB in "
                      f"{seconds:.2f} s); digest verified, {verdict.describe()}")
        return True

    def _check_state(self, metadata, tensors, target: SyncTarget) -> Optional[str]:
        """Why a downloaded state is unusable, or None: shapes and dtypes, finiteness, the donor's own digest, and
        the run's round. (Its size was bounded while it arrived: net/averaging/averager.py.)"""
        ours = self.state.tensors()
        if not isinstance(metadata, dict) or metadata.get("fingerprint") != self.fingerprint:
            return "not a state of this run's model"
        if not isinstance(metadata.get("round"), int) or isinstance(metadata.get("round"), bool):
            return "its round is not a number"
        if [(t.shape, t.dtype) for t in tensors] != [(t.shape, t.dtype) for t in ours]:
            return "tensor shapes or dtypes differ"
        if not all(bool(torch.isfinite(t).all()) for t in tensors):
            return "it holds NaN or Inf"
        quorum = parse_quorum(metadata.get("quorum"))
        if quorum is None:
            return "its round's quorum is not a list of peer ids"
        n = len(self.state.params)
        _, digest = state_digests(tensors[:n], tensors[n:], quorum)
        if digest != metadata.get("digest"):
            return "bytes do not match the donor's digest (corrupted in transit)"
        if metadata.get("round", -1) < target.round or (metadata["round"] == target.round and target.digest
                                                        and digest != target.digest):
            return f"round {metadata.get('round')} is not the run's round {target.round}"
        return None

    def _certificate(self, metadata: dict) -> Verdict:
        """The commit certificate of a downloaded state (net/certificate.py), checked against the commit records
        in the DHT and, one round ahead of ours, against the group that committed our round. Refused while members
        that did not sign look alive: those are pinged once, and the ones that do not answer (a member killed
        between its commit and its record's store, whose roster entry has not expired yet) no longer count."""
        begun = time.perf_counter()
        records = read_commits(self.dht, self.prefix, self.cfg.averaging.request_timeout)
        now = get_dht_time()
        alive = {pid for pid, (s, expires) in self._known.items() if expires > now and not s.leaving}
        alive.add(self.peer_id)
        group = parse_quorum(metadata.get("quorum")) or []
        check = lambda alive: certify(metadata["round"], metadata["digest"], group, records, alive,  # noqa: E731
                                      (self.state.round, list(self.state.quorum)), self.peer_id, self.cfg.run.rounds)
        verdict = check(alive)
        if not verdict.ok and self.dht is not None:
            signed = {p for p, commits in records.items() if metadata["round"] in {c[0] for c in commits}}
            silent = sorted((set(group) | set(self.state.quorum)) & alive - signed - {self.peer_id})
            if silent:
                from p2p_diloco.net.dht import answering

                answered = answering(self.dht, silent, min(2.0, self.cfg.averaging.request_timeout))
                verdict = check(alive - (set(silent) - answered))
        self.certificate_read_s = time.perf_counter() - begun
        return verdict

    def donate_state(self) -> tuple[dict, list]:
        """Called on hivemind's state thread when a peer downloads from us: a consistent snapshot."""
        round_, digest, tensors, members, quorum = self.state.snapshot()
        metadata = {"round": round_, "digest": digest, "fingerprint": self.fingerprint, "name": self.name,
                    "members": members, "quorum": quorum}
        return metadata, tensors

