"""The only user of hivemind's averager: a canonical, all-or-nothing butterfly all-reduce of pseudo-gradients.

Why not hivemind's stock all-reduce (HIVEMIND.md, facts 1 and 2):
  * its reducer sends each sender ``lossy(avg - that sender's part)``, which the sender adds to its own tensor, so every
    peer ends with different bytes; and
  * when a reducer dies its part silently keeps each peer's own values, and a failed sender is dropped from the parts
    it had not sent yet, so parts end up averaged over different peers, all reported as success.

What we do instead, keeping hivemind's matchmaking, transport and part streaming:
  * each reducer encodes the average of its part once (with the run's codec) and streams *those bytes* to every sender;
    every peer, the reducer included, decodes the same bytes, so all peers hold bit-identical results;
  * a reducer that loses any sender stops serving results at once (it would otherwise average later parts over
    fewer peers); and
  * a peer that misses any part from any reducer fails the round: a partial average is never applied.
Before the all-reduce, every member sees the same gathered metadata (round, θ_global digest, tokens) and derives the
same set of participants: members whose (round, digest) is not the group's majority contribute with weight 0, and
so do members that most others name as suspects (screening.py: a reducer refused a malformed contribution of theirs
in an earlier round). The weight each participant sends, and each reducer expects, is derived from that same list.

We subclass ``AllReduceRunner`` and override ``DecentralizedAverager._aggregate_with_group`` /
``_run_allreduce_inplace_``, which are private: hivemind is pinned to exactly 1.1.12 for this reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import AsyncIterator, Iterator, Optional, Sequence

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import deserialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip, enter_asynchronously
from hivemind.utils.streaming import combine_from_streaming

from p2p_diloco.net import dht as _dht  # noqa: F401  (imported first for its torch sharing-strategy setting)
from p2p_diloco.net.aggregators import Aggregator
from p2p_diloco.net.allreduce import CanonicalAllReduceRunner
from p2p_diloco.config import AveragingConfig
from p2p_diloco.net.codecs import ErrorFeedback
from p2p_diloco.net.consensus import majority_state
from p2p_diloco.net.deadlines import DeadlineEstimator
from p2p_diloco.net.gate import MemberGate, contribution_proof
from p2p_diloco.net.screening import accused, member_weights, sane_contribution
from p2p_diloco.net.reducer_checks import capped_fractions, sane_bandwidths
from p2p_diloco.net.verify import PartVerifier
from p2p_diloco.net.wire import WireCodec, payload_bytes
from p2p_diloco.ops.procs import become_child_process

logger = logging.getLogger(__name__)


@dataclass
class Contribution:
    """What a peer announces to its group before averaging (all-gathered, identical on every member)."""
    name: str
    round: int        # number of rounds committed so far: the version of θ_global the pseudo-gradient is relative to
    digest: str       # sha256 of θ_global (hex)
    tokens: int       # tokens processed since the last commit: the weight of this contribution
    steps_per_s: float = 0.0  # the member's inner-step speed: every member plans its next round from the same list
    suspects: list[str] = field(default_factory=list)  # peer ids this member leaves out (a reducer named them)
    proof: str = ""           # private runs: membership proof for the sender's PeerID, hex (net/gate.py)


@dataclass
class AverageResult:
    """Outcome of one averaging attempt. When ``ok``, the pseudo-gradient buffers hold the canonical average."""
    ok: bool
    group_size: int = 0                       # members whose contribution is in the average
    peers: list[str] = field(default_factory=list)  # their names
    tokens: int = 0                           # tokens behind the average
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0                      # matchmaking and all-reduce
    allreduce_seconds: float = 0.0            # the all-reduce alone, once the group formed
    error: Optional[str] = None
    stale: bool = False                       # the group averaged a θ_global other than ours: repair before contributing
    group_round: Optional[int] = None         # the round the group's majority was at
    speeds: list[float] = field(default_factory=list)  # every group member's inner steps per second (DyLU)
    reducer_bytes: int = 0                    # the most bytes our reducer held at once to combine a part
    malformed: dict = field(default_factory=dict)  # peer id -> (name, why): members a reducer refused this round


def choose_participants(contributions: Sequence[Contribution], peer_ids: Sequence[str] = ()) -> list[int]:
    """Indices of members whose pseudo-gradient enters the average: the largest class sharing one (round, digest).

    Pure and deterministic: every member evaluates it on the same gathered list and gets the same answer. Ties go to
    the higher round, then to the smaller digest. Members with no tokens contribute nothing, nor do members (with
    ``peer_ids`` given) that a majority of the others name as suspects.
    """
    left_out = accused(peer_ids, [c.suspects for c in contributions]) if peer_ids else set()
    states = [(c.round, c.digest) for i, c in enumerate(contributions) if i not in left_out]
    if not states:
        return []
    best = majority_state(states)
    return [i for i, c in enumerate(contributions)
            if (c.round, c.digest) == best and c.tokens > 0 and i not in left_out]


class MalformedRound(Exception):
    """A reducer refused a member's contribution: the round fails on every member, the culprits are named."""

    def __init__(self, culprits: dict):
        self.culprits = culprits  # peer id (base58) -> why
        super().__init__("; ".join(f"{p}: {why}" for p, why in culprits.items()))


class CanonicalAverager(MemberGate, PartVerifier, DecentralizedAverager):
    """DecentralizedAverager running :class:`CanonicalAllReduceRunner`; its process dies with its parent. In a
    private run (``access_keys``) it serves members only (net/gate.py). With ``verify_parts``, members compare the
    digests of the averaged parts they received before a round counts (net/verify.py); ``max_share`` caps the share
    of the vector one member reduces (net/reducer_checks.py)."""

    _rpc_handlers = None  # collect our own rpc_* methods (rpc_admit), not a list inherited from the parent class

    def __init__(self, *args, codec: WireCodec, average_codec: WireCodec, min_participants: int, fault=None,
                 aggregator: Aggregator = Aggregator(), weight_by_tokens: bool = True, max_weight_ratio: float = 8.0,
                 attack=None, access_keys=None, revoked: frozenset = frozenset(), verify_parts: bool = False,
                 max_share: float = float("inf"), equivocate_from: Optional[int] = None, **kwargs):
        self._init_gate(access_keys, revoked)
        self._average_codec = average_codec
        self._min_participants = min_participants
        self._fault = fault
        self._aggregator, self._attack = aggregator, attack
        self._weight_by_tokens, self._max_weight_ratio = weight_by_tokens, max_weight_ratio
        self._verify_parts_on, self._max_share, self._equivocate_from = verify_parts, max_share, equivocate_from
        self._verifications = {}
        self.state_provider = None  # set in the host process: () -> (metadata dict, tensors)
        super().__init__(*args, compression=codec, **kwargs)

    def run(self):
        become_child_process()
        super().run()

    async def _aggregate_with_group(self, group_info, min_vector_size: int, weight: float, **kwargs):
        self._verify_until = time.monotonic() + self._allreduce_timeout - 1.0  # inside the step's own deadline
        verification, error = None, None
        try:
            bandwidths, mode_ids, gathered = zip(*map(self.serializer.loads, group_info.gathered))
            contributions = [self._contribution(g) for g in gathered]
            peer_ids = [str(p) for p in group_info.peer_ids]
            members = choose_participants(contributions, peer_ids)
            weights = member_weights([c.tokens for c in contributions], members, self._weight_by_tokens,
                                     self._max_weight_ratio)
            await self._check_group(group_info.group_id, group_info.peer_ids, [contribution_proof(g) for g in gathered])
            me = group_info.peer_ids.index(self.peer_id)
            summary = dict(members=[contributions[i].name for i in members], member_of=me in members,
                           tokens=sum(contributions[i].tokens for i in members),
                           group_round=contributions[members[0]].round if members else None,
                           speeds=[c.steps_per_s for c in contributions])
            if len(members) < self._min_participants:
                raise AllreduceException(f"only {len(members)} of {len(contributions)} members agree on θ_global")
            left_out = accused(peer_ids, [c.suspects for c in contributions])  # they reduce nothing either
            download_bandwidths = [b if AveragingMode(m) != AveragingMode.CLIENT and i not in left_out else 0.0
                                   for i, (b, m) in enumerate(zip(bandwidths, mode_ids))]
            peer_fractions = await self._reducer_fractions(download_bandwidths, min_vector_size)
            if self._verify_parts_on:  # members are named with the end of their (authenticated) peer id
                labels = [f"{c.name} (…{p[-6:]})" for c, p in zip(contributions, peer_ids)]
                verification = self._open_verification(group_info, labels)
            started = time.monotonic()
            try:
                stats = await self._allreduce_round(group_info, contributions[me].round + 1,
                                                    peer_fractions=peer_fractions, weights=weights, **kwargs)
            except MalformedRound as e:  # every member fails this round and learns whom to leave out
                stats = _malformed_summary(e.culprits, contributions, peer_ids)
            digests = stats.pop("digests", None)
            if verification is not None and digests is not None:  # a failed round is never committed
                await self._verify_parts(group_info, verification, digests)
            return dict(summary, allreduce_seconds=time.monotonic() - started, **stats)
        except BaseException as e:
            error = e
            raise MatchmakingException(f"all-reduce failed: {e!r}") from None
        finally:
            self._close_verification(group_info.group_id, verification, error)

    async def _reducer_fractions(self, download_bandwidths, min_vector_size: int) -> list[float]:
        """The share of the vector each member reduces: hivemind's load balancing of the declared bandwidths (not
        a finite number >= 0: undeclared), capped at ``max_share`` x an equal share (net/reducer_checks.py)."""
        download = sane_bandwidths(download_bandwidths)
        sizes = await asyncio.get_event_loop().run_in_executor(
            None, load_balance_peers, self.total_size, download, min_vector_size)
        return capped_fractions(sizes, [b != 0.0 for b in download], self._max_share)

    async def _allreduce_round(self, group_info, round_: int, weights: list, **kwargs) -> dict:
        """The all-reduce of our buffers, with the test-only faults and attacks due in ``round_``."""
        fault = self._fault if self._fault and self._fault.due("allreduce", round_) else None
        attack = self._attack if self._attack is not None and self._attack.due(round_) else None
        equivocate = self._equivocate_from is not None and round_ >= self._equivocate_from
        me = group_info.peer_ids.index(self.peer_id)
        async with enter_asynchronously(self.get_tensors()) as local_tensors:
            if self._attack is not None:
                self._attack.on_tensors(local_tensors, round_)
            return await self._run_allreduce_inplace_(
                local_tensors, group_info, weight=weights[me], weights=weights, aggregator=self._aggregator,
                attack=attack, fault=fault, equivocate=equivocate, **kwargs)

    def _contribution(self, gathered) -> Contribution:
        """A member's gathered record; one that is not a well-formed contribution counts as one with no tokens."""
        try:
            raw = self.serializer.loads(gathered)
        except Exception:  # noqa: BLE001 - anything a member can send
            raw = None
        return Contribution(**sane_contribution(raw))

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        runner = CanonicalAllReduceRunner(
            p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=group_id,
            ordered_peer_ids=group_info.peer_ids, average_codec=self._average_codec, **kwargs)
        self._running_groups[group_id].set_result(runner)
        try:
            async for tensor, averaged in azip(as_aiter(*tensors), runner):
                tensor.copy_(averaged)  # copy, not add: every peer ends with the same decoded bytes
        except Exception:
            if not runner.malformed:
                raise
        if runner.malformed:
            raise MalformedRound({str(p): why for p, why in runner.malformed.items()})
        if runner.failed_reducers or runner.tensor_part_container.failed_size:
            raise AllreduceException(f"lost parts of reducer(s) {sorted(map(str, runner.failed_reducers))}")
        return dict(bytes_sent=runner.bytes_sent, bytes_received=runner.bytes_received,
                    reducer_bytes=runner.reducer_peak_bytes, digests=runner.part_digests.digests())

    # ------------------------------------------------------------------------------------------ state for joiners
    def get_current_state(self):
        """Runs in the host process (hivemind's state thread): a consistent snapshot of θ_global and momentum."""
        if self.state_provider is None:
            raise RuntimeError("no state to serve yet")
        metadata, tensors = self.state_provider()
        return metadata, tensors, None

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        served = 0
        async for message in super().rpc_download_state(request, context):
            yield message
            served += 1
            if self._fault is not None and served == 1 and self._fault.phase == "serving":
                self._fault.strike()  # armed from the round it names on: see Averager.serve_state

    async def _download_state(self, future, donors: list, timeout: float):
        """Try ``donors`` (base58 peer ids) in order; resolve ``future`` with (metadata, tensors, donor) or None."""
        try:
            for donor in donors:
                try:
                    result = await asyncio.wait_for(self._download_from(PeerID.from_base58(donor)), timeout)
                except Exception as e:
                    logger.warning(f"state download from {donor} failed: {e!r}")
                    continue
                if result is not None:
                    future.set_result((*result, donor))
                    return
            future.set_result(None)
        except BaseException as e:
            if not future.done():
                future.set_exception(e)
            raise

    async def _download_from(self, donor):
        stub = self.get_stub(self._p2p, donor, namespace=self.prefix)
        await self._prove_membership(stub)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata, parts, tensors = None, [], []
        async for message in aiter_with_timeout(stream, timeout=self.next_chunk_timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
        return (metadata, tensors) if metadata is not None else None

    async def _set_deadlines(self, allreduce_timeout: float, next_chunk_timeout: float, matchmaking_time: float):
        self._allreduce_timeout = allreduce_timeout
        self.next_chunk_timeout = next_chunk_timeout
        self.allreduce_kwargs.update(sender_timeout=next_chunk_timeout, reducer_timeout=2 * next_chunk_timeout)
        self._matchmaking.min_matchmaking_time = matchmaking_time
        self._matchmaking.potential_leaders.min_matchmaking_time = matchmaking_time

    async def _arm_fault(self, fault):
        self._fault = fault

    async def _set_target_group_size(self, size: int):
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size


class Averager:
    """The averaging seam used by a peer: shared pseudo-gradient buffers and one ``average()`` call per round.

    The buffers are allocated once (in shared memory) with the shapes of the model's parameters. A round writes the
    pseudo-gradient into them inside ``with averager.pseudo_grads() as bufs:``, then calls :meth:`average`; if the
    result is ``ok``, the buffers hold the canonical weighted average, bit-identical on every peer of the group.
    ``error_feedback`` (an :class:`~p2p_diloco.net.codecs.ErrorFeedback`, or None when off) is the peer's to use:
    add its residual to the pseudo-gradient before averaging, commit it with the round.
    """

    def __init__(self, dht, cfg: AveragingConfig, prefix: str, shapes: Sequence[torch.Size], *,
                 client_mode: bool = False, expected_group_size: Optional[int] = None, fault=None,
                 weight_by_tokens: bool = True, attack=None, access=None, equivocate_from: Optional[int] = None):
        self.cfg = cfg
        self.access = access  # net/auth.Access of a private run, None in an open run
        self.client_mode = client_mode
        self.fault = fault
        self.suspects: dict[str, int] = {}  # peer id -> the last round we leave it out of (a reducer named it)
        self._offenses: dict[str, int] = {}
        buffers = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        # error feedback's pending residual is written by the averager's process: allocate it (shared) before the fork
        self.error_feedback = ErrorFeedback(shapes) if cfg.error_feedback else None
        codec = WireCodec(cfg.codec, cfg.part_size_bytes,
                          residuals=self.error_feedback.pending if self.error_feedback else None)
        self._averager = CanonicalAverager(
            buffers, dht, start=True, prefix=prefix, codec=codec, min_participants=cfg.min_group_size,
            average_codec=WireCodec(cfg.average_codec or cfg.codec, cfg.part_size_bytes),
            fault=fault if fault is not None and fault.phase == "allreduce" else None, attack=attack,
            aggregator=Aggregator(cfg.aggregator, cfg.clip_multiple, cfg.centered_clip_iters, cfg.trim_fraction),
            weight_by_tokens=weight_by_tokens, max_weight_ratio=cfg.max_weight_ratio,
            access_keys=access.keys if access else None, revoked=access.revoked if access else frozenset(),
            verify_parts=cfg.verify_parts, max_share=cfg.max_share, equivocate_from=equivocate_from,
            target_group_size=expected_group_size or cfg.target_group_size, min_group_size=cfg.min_group_size,
            min_matchmaking_time=cfg.matchmaking_time, request_timeout=cfg.request_timeout,
            allreduce_timeout=cfg.allreduce_timeout, next_chunk_timeout=cfg.next_chunk_timeout,
            part_size_bytes=cfg.part_size_bytes, client_mode=client_mode, allow_state_sharing=False,
            shutdown_timeout=5)
        self._group_size = expected_group_size or cfg.target_group_size
        payload = payload_bytes(sum(b.numel() for b in buffers), cfg.codec, cfg.average_codec)
        self._estimator = DeadlineEstimator(cfg.allreduce_timeout, cfg.next_chunk_timeout, cfg.part_size_bytes,
                                            payload_bytes=payload,
                                            matchmaking_floor=cfg.matchmaking_time)
        self.deadlines = self._estimator.deadlines(self._group_size)
        self._pending: Optional[PendingAverage] = None  # an all-reduce under way (start_average)

    @property
    def peer_id(self) -> str:
        return str(self._averager.peer_id)

    @contextlib.contextmanager
    def pseudo_grads(self) -> Iterator[Sequence[torch.Tensor]]:
        """The shared buffers; the averager does not touch them while this context is open."""
        if self._pending is not None:
            raise RuntimeError("the buffers belong to an all-reduce under way: take its result() first")
        with self._averager.get_tensors() as tensors:
            yield tensors

    @property
    def matchmaking_timeout(self) -> float:
        """How long a peer may look for a group (s): two matchmaking windows plus a request round trip."""
        return 2 * self.deadlines.matchmaking_time + self.cfg.request_timeout

    def observe_round(self, seconds: float) -> None:
        """A whole round's wall time (inner steps and averaging), for the matchmaking window."""
        self._estimator.observe_round(seconds)

    def average(self, contribution: Contribution, weight: float) -> AverageResult:
        """Find a group and all-reduce the buffers; never raises, never waits beyond the configured timeouts."""
        return self.start_average(contribution, weight).result()

    def start_average(self, contribution: Contribution, weight: float) -> "PendingAverage":
        """Start :meth:`average` in the averager's process and return at once (``diloco.overlap``). Until the
        pending average's ``result()`` is taken, the buffers belong to the averager: :meth:`pseudo_grads` refuses."""
        self._update_deadlines()
        contribution = replace(contribution, suspects=[p for p, last in self.suspects.items()
                                                       if last > contribution.round])
        pending = PendingAverage(self, contribution)
        try:
            contribution = replace(contribution, proof=self._proof())
            pending.control = self._averager.step(gather=asdict(contribution), weight=float(weight), wait=False,
                                                  timeout=self.matchmaking_timeout, allow_retries=False)
            if self.fault is not None and self.fault.due("matchmaking", contribution.round + 1):
                self._strike_in_matchmaking(pending.control)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            pending.error = _one_line(e)
        self._pending = pending
        return pending

    def _finish(self, out: dict, seconds: float, round_: int) -> AverageResult:
        result = AverageResult(ok=out["member_of"] and "error" not in out, group_size=len(out["members"]),
                               peers=out["members"], tokens=out["tokens"], bytes_sent=out.get("bytes_sent", 0),
                               bytes_received=out.get("bytes_received", 0), seconds=seconds,
                               allreduce_seconds=out["allreduce_seconds"], group_round=out["group_round"],
                               speeds=out["speeds"], reducer_bytes=out.get("reducer_bytes", 0),
                               malformed=out.get("malformed", {}))
        if "error" in out:
            result.error = out["error"]
            self._suspect(result.malformed, round_)
            return result
        self._estimator.observe(out["bytes_sent"] + out["bytes_received"], out["allreduce_seconds"])
        if not out["member_of"]:
            result.stale, result.error = True, f"the group averaged round {out['group_round']} of another θ_global"
        return result

    def _suspect(self, malformed: dict, round_: int) -> None:
        """Members a reducer refused: left out of our averages for suspect_rounds committed rounds after round_ − 1
        (doubled at each repeat), by naming them in our contributions (a majority of members must agree)."""
        for peer in malformed:
            if peer == self.peer_id or not self.cfg.suspect_rounds:
                continue
            self._offenses[peer] = self._offenses.get(peer, 0) + 1
            self.suspects[peer] = round_ - 1 + self.cfg.suspect_rounds * 2 ** (self._offenses[peer] - 1)
            logger.warning(f"member {malformed[peer][0]} ({peer}) sent a malformed contribution "
                           f"({malformed[peer][1]}): left out of our averages through round {self.suspects[peer]}")

    def serve_state(self, provider, round_: int) -> None:
        """Offer our state to joiners: ``provider() -> (metadata, tensors)``; donors of later rounds are preferred."""
        if self.client_mode:
            return  # unreachable peers cannot serve
        self._averager.state_provider = provider
        self._averager.state_sharing_priority = float(round_ + 1)
        self._averager.allow_state_sharing = True
        if self.fault is not None and self.fault.phase == "serving" and round_ + 1 >= self.fault.round:
            # the averager process holds its own copy of the fault: arm it there for this round only
            self._averager._outer_pipe.send(("_arm_fault", [], dict(fault=self.fault)))

    def stop_serving(self) -> None:
        if self._averager.allow_state_sharing:
            self._averager.allow_state_sharing = False

    def download_state(self, donors: Sequence[str]):
        """Fetch (metadata, tensors, donor) from the first of ``donors`` that answers; None if none did.

        Each donor gets ``averaging.state_timeout`` seconds; at most ``averaging.state_attempts`` donors are tried.
        """
        donors = list(donors)[: self.cfg.state_attempts]
        if not donors:
            return None
        future = MPFuture()
        self._averager._outer_pipe.send(("_download_state", [], dict(future=future, donors=donors,
                                                                       timeout=self.cfg.state_timeout)))
        try:
            return future.result(timeout=self.cfg.state_timeout * len(donors) + 10)
        except Exception as e:
            logger.warning(f"state download failed: {_one_line(e)}")
            return None

    def _proof(self) -> str:
        return self.access.keys.proof(self._averager.peer_id.to_bytes()).hex() if self.access else ""

    def access_changed(self) -> None:
        """A new secret or revocations (net/auth.Access.refresh): tell the averager's process."""
        self._averager._outer_pipe.send(("_set_access", [], dict(keys=self.access.keys,
                                                                 revoked=self.access.revoked)))

    def set_group_size(self, size: int) -> None:
        """Start each round's all-reduce as soon as ``size`` peers (the live roster) have gathered."""
        size = max(self.cfg.min_group_size, min(size, self.cfg.target_group_size))
        if size != self._group_size:
            self._group_size = size
            self._averager._outer_pipe.send(("_set_target_group_size", [], dict(size=size)))

    def _update_deadlines(self) -> None:
        """Deadlines for the coming round from measurements (p2p_diloco/net/deadlines.py); sent to the averager."""
        deadlines = self._estimator.deadlines(self._group_size)
        if deadlines != self.deadlines:
            self.deadlines = deadlines
            # step() reads the matchmaking window in this process, the matchmaker in the averager process
            self._averager.matchmaking_kwargs["min_matchmaking_time"] = deadlines.matchmaking_time
            self._averager._outer_pipe.send(("_set_deadlines", [], asdict(deadlines)))

    def _strike_in_matchmaking(self, control) -> None:
        """Fault injection: fail while the averager looks for a group (declared in the DHT, or being joined)."""
        while control.stage == AveragingStage.IDLE and not control.done():
            time.sleep(0.01)  # the stage lives in the averager process; it changes within milliseconds
        time.sleep(0.2)  # let the declaration reach the DHT, so that others may be grouping with us
        self.fault.strike()

    def close(self) -> None:
        if self._averager.is_alive():
            self._averager.shutdown()


class PendingAverage:
    """An all-reduce under way in the averager's process (:meth:`Averager.start_average`)."""

    def __init__(self, averager: Averager, contribution: Contribution):
        self.averager, self.contribution = averager, contribution
        self.control = None  # hivemind's StepControl, once the step has started
        self.error: Optional[str] = None  # the step failed to start
        self.started = time.perf_counter()
        self.waited = 0.0  # seconds result() blocked its caller
        self._result: Optional[AverageResult] = None

    def done(self) -> bool:
        return self._result is not None or self.control is None or self.control.done()

    def result(self) -> AverageResult:
        """The outcome; waits at most for the matchmaking and all-reduce deadlines. Never raises; frees the buffers."""
        if self._result is None:
            begun = time.perf_counter()
            self._result = self._wait()
            self.waited = time.perf_counter() - begun
            if self.averager._pending is self:
                self.averager._pending = None
        return self._result

    def _wait(self) -> AverageResult:
        if self.control is None:
            return AverageResult(ok=False, seconds=time.perf_counter() - self.started, error=self.error)
        budget = self.averager.matchmaking_timeout + self.averager.deadlines.allreduce_timeout + 10
        try:  # the budget runs from the start: a round that trained meanwhile does not extend it
            out = self.control.result(timeout=max(5.0, self.started + budget - time.perf_counter()))
        except BaseException as e:
            if not self.control.done():
                self.control.cancel()
            if isinstance(e, KeyboardInterrupt):
                raise
            return AverageResult(ok=False, seconds=time.perf_counter() - self.started, error=_one_line(e))
        return self.averager._finish(out, time.perf_counter() - self.started, self.contribution.round + 1)


def _malformed_summary(culprits: dict, contributions, peer_ids) -> dict:
    """A round failed on a malformed contribution: who sent what, for the result and its error text."""
    malformed = {p: (contributions[peer_ids.index(p)].name if p in peer_ids else "?", why)
                 for p, why in culprits.items()}
    return dict(malformed=malformed, error="round failed, malformed contribution refused: " +
                "; ".join(f"{name} ({p}): {why}" for p, (name, why) in malformed.items()))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"[:300]
