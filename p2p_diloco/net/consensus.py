"""PURE decisions about agreement between peers; no network, no torch.

Every peer evaluates these functions on the same inputs (the group's gathered contributions, or the roster read
from the DHT) and so reaches the same verdict without further messages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Collection, Optional, Sequence


@dataclass
class PeerStatus:
    """What a peer publishes about itself in the DHT roster."""
    name: str
    peer_id: str
    round: int            # rounds committed: the version of θ_global
    digest: str           # sha256 of θ_global and the outer optimizer state, as bytes
    leaving: bool = False  # announced a graceful leave: not counted, not a donor
    donor: bool = True     # serves its state to joiners (client-mode peers cannot)
    # what this peer reports about its work, for scheduling and for anyone watching the run (not for agreement)
    tokens_per_s: float = 0.0       # inner-step throughput over its recent rounds (averaging excluded)
    tokens_trained: int = 0         # tokens of inner steps this peer has trained in the run (all rounds)
    last_allreduce_s: float = 0.0   # its last averaging attempt, matchmaking included
    last_bytes: int = 0             # bytes it sent and received in that attempt
    reachability: str = "unknown"   # how it takes part (net/reachability.py): public | relayed | client
    steps_per_s: float = 0.0        # inner steps per second over its recent rounds (DyLU plans from it; 0: unknown)
    # its last round, for anyone watching the run (p2p-diloco web): inner steps done and planned, mean training loss
    last_round: int = 0             # the round those (and last_allreduce_s) are about: its last attempt's (0: none)
    last_steps: int = 0
    last_planned_steps: int = 0
    last_loss: float = 0.0          # 0: none yet
    # rounds the run committed since this peer's last committed round (ops/standing.py): a peer that catches up by
    # download every round holds the run's θ_global round without ever committing one; `status` shows it from this
    missed_rounds: int = 0


@dataclass
class SyncTarget:
    """The state a peer must fetch before it contributes again."""
    round: int
    digest: str
    donors: list[str] = field(default_factory=list)  # peer ids holding exactly that state, in order of name


def _best(keys: Counter) -> tuple[int, str]:
    # most holders first, then the higher round, then the smaller digest: a total order, the same on every peer
    return max(keys, key=lambda k: (keys[k], k[0], [-ord(ch) for ch in k[1]]))


def majority_state(states: Sequence[tuple[int, str]]) -> tuple[int, str]:
    """The (round, digest) held by most members; ties go to the higher round, then the smaller digest."""
    return _best(Counter(states))


def credible_rounds(me: PeerStatus, others: Sequence[PeerStatus]) -> set[int]:
    """The rounds a peer may follow: its own, any round at most the others' (lower) median round, and, step by
    step above those, a round r whose entries are more than half of the peers at round r − 1 or later (this peer
    included) when r − 1 is credible itself: the signed roster entries at r are r's commit certificate.

    The roster is written by anyone, but each entry only in its own signed name (net/records.py): one entry
    claiming round 10^9 is not followed, and neither are a few identities claiming rounds after the run's (they
    would have to outnumber the run's peers, a Sybil majority). A group commits only with more than half of the
    run (:func:`has_quorum`), so the peers holding the round it commits soon outnumber the rest; until their
    entries reach this peer (a second or two), it waits. What the rule cannot tell apart: a run of one peer
    joined by two fresh peers at once (they start the run anew instead of joining it); join one at a time."""
    rounds = sorted(s.round for s in others)
    base = rounds[(len(rounds) - 1) // 2] if rounds else me.round
    entries = {(s.peer_id, s.round) for s in others if s.peer_id != me.peer_id}  # one per signed identity
    holders = Counter(round_ for _, round_ in entries)
    credible = {me.round} | {r for r in rounds if r <= base}
    for r in sorted(set(rounds) - credible):  # ascending: each step stands on the one below it
        since = sum(1 for _, round_ in entries if round_ >= r - 1) + (me.round >= r - 1)
        if r - 1 in credible and 2 * holders[r] > since:
            credible.add(r)
    return credible


LATER_DONORS = 2  # rounds past the target whose holders are tried after its own holders (see sync_target)


def remembered(known_round: int, latest: int, others: Sequence[PeerStatus]) -> bool:
    """Whether a round this peer saw as the run's (``known_round``) still stands above the latest credible round:
    while some live peer holds it or a later one, and only up to :data:`LATER_DONORS` rounds above it. The bound is
    the one the donors have, for the same reason: a peer that joined when the roster held nothing but a stranger's
    claim of round 10^9 followed it (one other entry is all a fresh peer can go by); once the run's peers are in
    the roster, that claim is far above anything credible and is dropped (CI's roster-attack test: the peer sat out
    every round while the stranger's entry lived)."""
    return latest < known_round <= latest + LATER_DONORS and any(s.round >= known_round for s in others)


def sync_target(me: PeerStatus, roster: Sequence[PeerStatus], known_round: int = 0) -> Optional[SyncTarget]:
    """None if ``me`` holds the run's current state, else the state to fetch and who can serve it.

    The current state is the latest credible round (:func:`credible_rounds`); if peers disagree about that round's
    bytes (a round half-committed when a reducer died), the digest held by most of them, ties broken as in
    :func:`majority_state`. A peer never repairs towards an older round. ``known_round``: a round this peer saw
    earlier as the run's (:class:`~p2p_diloco.net.membership.Membership` remembers it while some live peer holds it
    or a later one): the holders of a round die, their entries expire, and what is left (the peers that moved
    past it, the stragglers below it) may not make it credible again; the peer still must not go on below it.

    Donors: the target's own holders, in name order, then (if all of those fail) the peers at most
    :data:`LATER_DONORS` rounds past it, nearest round first: when every member of the group that committed the
    target round but one died, that one may have committed the next round alone with the averages it had, and it
    is the only peer that can bring a straggler back into the run. A later state is checked like any (its donor's
    digest, finite values); the bound keeps a stranger's claim of a far round out of the list, and one near the
    run's round is repaired at that round as soon as the run's peers there outnumber it."""
    others = [s for s in roster if not s.leaving and s.peer_id != me.peer_id]
    latest = max(credible_rounds(me, others))
    if remembered(known_round, latest, others):
        latest = known_round
    live = [s for s in others if s.round == latest] + [me]
    at_latest = Counter((s.round, s.digest) for s in live if s.round == latest)
    target_round, target_digest = _best(at_latest) if at_latest else (latest, "")  # "": its holders are gone
    if (me.round, me.digest) == (target_round, target_digest):
        return None
    # one order on every peer (by name, relayed donors last: their state would cross a relay): predictable, and a
    # failed donor is simply skipped by the next attempt
    holders = sorted((s for s in others if s.donor and (s.round, s.digest) == (target_round, target_digest)),
                     key=lambda s: (s.reachability == "relayed", s.name))
    later = sorted((s for s in others if s.donor and target_round < s.round <= target_round + LATER_DONORS),
                   key=lambda s: (s.round, s.reachability == "relayed", s.name))
    return SyncTarget(target_round, target_digest, [s.peer_id for s in holders + later])


# ---------------------------------------------------------------------------------------------- one θ_global per round

def electorate(me: PeerStatus, live: Sequence[PeerStatus]) -> int:
    """How many peers ``me`` sees holding a θ_global of its round (itself included): the peers that could be in
    this round's group. A member announces it with its contribution (:func:`has_quorum`)."""
    ids = {s.peer_id for s in live if s.round == me.round and not s.leaving}
    return len(ids | {me.peer_id})


def alive_of(quorum: Collection[str], me: PeerStatus, live: Sequence[PeerStatus], final: bool = False) -> int:
    """How many of ``quorum`` (the peer ids that committed our round) ``me`` sees alive: a live roster entry (at any
    round) that announces no leave, or ``me`` itself (net/averaging/contribution.py count_quorum).

    0 at the run's last round (``final``: no view of who is alive), so that its group commits only with more than
    half of the whole group that committed the round before: there a member whose entry is gone may have finished
    the run rather than died (its finished record may have gone with its DHT node), and stragglers counting only
    the members they see would commit a second final θ_global (a 16-peer swarm: 14 peers on one, 2 on another).
    Before, that round kept the roster rule, with the run's size kept (:class:`RunSize`), and a stranger's entries
    at the run's round made every peer stop one round short. What this costs: a run whose last group lost more than
    half of its members before the last round stops one round short (:attr:`RunSize.given_up`), joiners or not."""
    if final:
        return 0
    alive = {s.peer_id for s in live if not s.leaving} | {me.peer_id}
    return len(set(quorum) & alive)


def quorum_size(views: Sequence[int]) -> int:
    """The run's size at round t−1 as a group sees it: the upper median of its members' :func:`electorate` views
    (0: a member without a view, e.g. outside a swarm, is not counted). One member's low or high claim cannot
    move it alone."""
    known = sorted(v for v in views if v > 0)
    return known[len(known) // 2] if known else 0


def has_quorum(holders: int, views: Sequence[int]) -> bool:
    """May a group commit round t? Only if more than half of the run's peers at round t−1 are in it: ``holders`` is
    how many of its members hold the θ_global it averages; ``views`` each member's electorate.

    Why this keeps one θ_global per round: a peer is in one group per round, so two groups of round t are disjoint;
    if at least half of each group's members see every peer of both groups in the roster, both quorum sizes are at
    least |G1 ∪ G2|, and |G1| + |G2| ≤ |G1 ∪ G2| leaves room for at most one group holding more than half. A group
    without quorum fails the round like any failed all-reduce (its members keep training from θ_local and rebase
    onto the run's θ_global if another group committed). The rule's assumption is that roster views agree; a peer
    missing from most members' views (a DHT partition) is the case it does not cover."""
    size = quorum_size(views)
    return size == 0 or 2 * holders > size


def with_my_group(me: PeerStatus, live: Sequence[PeerStatus], group: tuple[int, frozenset]) -> list[PeerStatus]:
    """``live`` with the members of the group ``me`` last committed with read as holding our θ_global: ``group`` is
    (the round it committed, its members' names). Right after a commit, the roster still shows the other members at
    the round before until their new entries reach us (seconds, under load); read as they are, the first member to
    look sees itself nearly alone at the new round, names itself the leader and gathers a group nobody joins,
    while the rest follow the real leader. Only members of our own group are read so, only for the round it
    committed, and a member's entry that moved on is left as it is."""
    round_, names = group
    if round_ != me.round or not names:
        return list(live)
    return [replace(s, round=me.round, digest=me.digest) if s.round == me.round - 1 and s.name in names else s
            for s in live]


def expected_group(me: PeerStatus, live: Sequence[PeerStatus], quorum: Collection[str] = (),
                   left: Collection[str] = (), floor: int = 0) -> int:
    """How many peers the round's group waits for (the leader starts it once that many joined, or when its window
    ends): every live entry, ourselves, and the peers of ``quorum`` (those that committed our round: GlobalState.
    quorum) that the roster read missed, unless they announced a leave (``left``). Under load a read misses entries
    whose heartbeat was late; the leader then started the group as soon as the peers it saw had joined, and the
    missed ones, arriving a second later, failed the round (the last of a run, 3 of 5 times with 16 peers on 2
    cores). The leader passes only the listed peers that still answer a ping (net/exchange.py): a dead one would
    cost every round after its death the whole window.
    ``floor``: round 1 has no such list (θ_0 was committed by nobody), but every peer waited for the run's
    ``run.expected_peers`` before it (a read missed 5 of 16 once: round 1 went to 11, the 5 others repaired)."""
    return max(floor, len({s.peer_id for s in live} | {me.peer_id} | (set(quorum) - set(left))))


def designated_leader(me: PeerStatus, live: Sequence[PeerStatus], passed_over: Collection[str] = (),
                      quorum: Collection[str] = ()) -> str:
    """The peer id that gathers this round's group: the smallest id among the peers at our round that can accept
    connections (donors: client-mode peers cannot lead), leaving out those ``passed_over`` (:class:`Leaders`) while
    any other can lead. Every peer that reads the same roster names the same leader, so the run forms one group
    instead of several racing ones; a peer whose view differs still joins the declared leader that hivemind orders
    first. A dead leader is replaced once its roster entry expires.

    ``quorum``: the peer ids that committed our round (GlobalState.quorum, the same on every peer of our θ_global):
    while one of them can lead and is not passed over, the leader is one of them. Anyone can publish a roster entry
    at our round under a key of its own; without this, a stranger's entries with small ids would each cost the run a
    window per round. (Passed over before the list is preferred: a peer that joined the round by download, outside
    the list, whose only listed peer at the round is a dead leader, used to name it again after passing it over.)"""
    ids = {s.peer_id for s in live if s.round == me.round and not s.leaving and s.donor}
    if me.donor:
        ids.add(me.peer_id)
    ids = ids - set(passed_over) or ids  # passed over first: a peer whose only candidate of the list is dead leads
    return min((ids & set(quorum)) or ids) if ids else ""


@dataclass
class Leaders:
    """The leaders a peer passes over in its current round. A leader whose roster entry stays fresh but that gathered
    no group in a whole matchmaking window (frozen, still in its inner steps, or unreachable: a home peer whose
    router came back without its relayed connection) is passed over for the rest of the round by every peer that
    waited for it: they failed the same window and name the same next leader. Without this they named it every
    attempt while its entry lived (CI: a peer held in its inner steps with the smallest id stalled round 1 of two
    others for 2 minutes; a home peer whose router failed stalled round 4 of two others until the test gave up).

    Only for the round: a peer that was merely late for a leader's window (its group formed and committed without
    us) would otherwise keep naming a leader nobody else skips, round after round. The leader itself is not passed
    over by its own view: a fast leader whose window the others all missed gathers them on its next attempt."""
    round: int = -1
    passed: set = field(default_factory=set)  # leaders passed over at ``round``
    named: tuple = (-1, "")  # (round, other leader) our last contribution waited for; "" when we led it

    def name(self, me: PeerStatus, live: Sequence[PeerStatus], quorum: Collection[str] = ()) -> str:
        """This round's leader as :func:`designated_leader` names it, leaving out those passed over at our round."""
        if me.round != self.round:
            self.round, self.passed = me.round, set()
        leader = designated_leader(me, live, self.passed, quorum)
        self.named = (me.round, "" if leader == me.peer_id else leader)
        return leader

    def no_group(self) -> None:
        """Our last contribution found no group: the leader it waited for is passed over for the rest of its round."""
        round_, leader = self.named
        if leader and round_ == self.round:
            self.passed.add(leader)


def finished_without(rounds: int, others: Sequence[PeerStatus], recorded: Sequence[tuple[str, str, int]],
                     group: Sequence[str] = ()) -> list[str]:
    """The peers that finished the run (left after committing ``rounds``), by name, if the run is over for a peer
    that has not; else []. ``others``: the roster without this peer; ``recorded``: (peer id, name, round) of peers
    that left (their roster entries may have expired); ``group``: the peer ids of the group that committed the
    θ_global this peer holds, itself left out ([] at round 0).

    The run is over when every other peer in the roster has left and one of them finished it, and also when more
    than half of the group that committed our θ_global finished it: they committed the run's last round(s) without
    us, and its final θ_global is theirs. Committing our own last round would fork it (a group that meets after the
    others left sees only its own members, and once it forgets the run's size it finds a quorum among them); the
    finishers stopped serving their state, so the stragglers stop too, saying so. Only that group's members count:
    anyone can write finished records under fresh keys, and a count of all of them (the rule until stop 40) let a
    stranger stop every peer, or three stragglers ignore three finishers; a member of our group is a peer whose
    contribution is in the θ_global we hold."""
    finishers = {s.peer_id: s.name for s in others if s.leaving and s.round >= rounds}
    for peer, name, round_ in recorded:
        if round_ >= rounds:
            finishers.setdefault(peer, name)
    members = set(group)
    ours = members.intersection(finishers)
    training = any(not s.leaving for s in others)
    if finishers and (not training or len(ours) > len(members) / 2):
        return sorted(set(finishers.values()))
    return []


FORGET_AFTER = 3  # attempts without quorum in a row after which a peer forgets the run's size it remembered


@dataclass
class RunSize:
    """A peer's lower bound on the run's size, kept across rounds: the largest group it committed with (and
    ``run.expected_peers`` before any), so that a roster read that misses peers (a loaded DHT answers in part) does
    not shrink the quorum. A run that really shrank (more than half of a group gone at once) fails
    :data:`FORGET_AFTER` attempts without quorum, then its peers forget the bound and go by what they see.

    Except at the run's last round (``final``): there the bound is kept, and after :data:`FORGET_AFTER` attempts
    without quorum the peer has :attr:`given_up`. Peers that miss the last round while the others commit it and
    leave see a run of two or three once those entries expire, and the finished records may have gone with the
    finishers' DHT nodes; forgetting, they committed a last round of their own, a second final θ_global (a 16-peer
    swarm: 14 peers on one, 2 on another). A run whose other peers really died at its last round ends one round
    short instead, every peer on the same θ_global. (The last round's quorum is counted over the whole group that
    committed the round before, :func:`alive_of`; the bound serves the roster rule, where no member of that group
    is in ours.)"""
    floor: int = 0
    failures: int = 0
    given_up: bool = False

    def electorate(self, seen: int) -> int:
        return max(seen, self.floor)

    def committed(self, group: int) -> None:
        self.floor, self.failures = max(self.floor, group), 0

    def no_quorum(self, final: bool = False) -> None:
        self.failures += 1
        if self.failures >= FORGET_AFTER:
            if final:
                self.given_up = True
            else:
                self.floor, self.failures = 0, 0
