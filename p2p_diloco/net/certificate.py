"""PURE: commit certificates — which θ_global a peer may adopt from someone else. No network, no torch.

A member of the group that commits round t signs (t, digest of θ_t): every peer publishes, in its own signed name,
the (round, digest) pairs of its last :data:`KEPT` commits (net/keys.py ``{prefix}.commits``; the signature is its
libp2p key's, net/security/records.py). The digest also covers the peer ids of the group that committed round t
(``quorum``, train/global_state.py), so a state served by anyone names the group that must have signed it.

A peer that adopts round t's θ_global by download (a join or a repair) takes it only with its **certificate**: the
signed records of more than half of that group naming exactly that (t, digest). And, where it can check the chain
(it holds round t − 1 itself and knows the group that committed it), with more than half of **that** group's
members among the signers: the rule that group used to commit (net/averaging/contribution.py ``count_quorum``),
now checked by the one who adopts. In both counts a member that died without signing (killed between its commit
and its record's store) counts neither way: "more than half of those alive or signed", as the quorum counts
those still alive. So

* a stranger who serves a state it made up (its own ids as the group, all of them signing) is refused by every
  peer that holds the round before: it would need the signatures of most of the run's last group;
* two groups of one round cannot both hold a certificate a peer at the round before accepts: the groups are
  disjoint, and each needs more than half of the same alive members;
* what it does not cover: a peer more than one round behind (or fresh, at round 0) checks only the group's own
  majority (it does not know the groups in between), and a Sybil majority of the run's identities signs anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional, Sequence

KEPT = 8  # commits each peer's record lists (a joiner one or two rounds late still finds its target's)


@dataclass(frozen=True)
class Verdict:
    """Whether a downloaded state's certificate holds, with the counts behind it (for the log and the metrics)."""
    ok: bool
    signed: int     # members of the state's group that signed its (round, digest)
    group: int      # the state's group
    chained: bool   # the chain to our own round's group was checked as well
    why: str = ""

    def describe(self) -> str:
        chain = ", chained to our round's group" if self.chained else ""
        return f"{self.signed} of {self.group} of its group signed it{chain}"


def signers(round_: int, digest: str, records: Mapping[str, Sequence[tuple[int, str]]]) -> set[str]:
    """The peer ids whose published commits include exactly (``round_``, ``digest``)."""
    return {peer for peer, commits in records.items() if (round_, digest) in {tuple(c) for c in commits}}


def remember(commits: Sequence[tuple[int, str]], round_: int, digest: str) -> list[tuple[int, str]]:
    """Our commit list after committing (``round_``, ``digest``): the newest :data:`KEPT`, one digest per round."""
    kept = [(r, d) for r, d in commits if r != round_]
    return sorted(kept + [(round_, digest)])[-KEPT:]


def certify(round_: int, digest: str, group: Collection[str], records: Mapping[str, Sequence[tuple[int, str]]],
            alive: Optional[Collection[str]] = None, prior: Optional[tuple[int, Collection[str]]] = None,
            me: str = "", last_round: Optional[int] = None) -> Verdict:
    """The verdict on a state of round ``round_`` whose digest is ``digest`` and whose committing group is ``group``
    (peer ids), given every peer's published commits (``records``: peer id → [(round, digest), ...]).

    ``alive``: the peer ids we see alive (live roster entries that announce no leave; None: no view, everyone
    counts). A member that died before its record was stored (killed between its commit and the store) can sign
    nothing, and is not counted against the state: more than half of the group's members **alive or signed** (a
    commit of this round, whatever its digest) must have signed it, and at least one; ourselves (``me``) left out
    when the group names us and we did not sign (we know we did not commit it: a member of a pair that lost its
    round while the other committed it could never repair otherwise). (A group of two whose other member died before
    the checks commits alone, by design: its certificate is its own signature.)

    ``prior``: (our round, the group that committed it). Used only when ``round_`` is our round + 1 and we know that
    group; not for the run's last round (``last_round``: its signers may have finished the run, their records gone
    with their DHT nodes, net/consensus.py alive_of): more than half of that group's members alive or signed,
    leaving out ourselves (``me``: we did not commit ``round_``, or we would hold it), must be among the signers.
    No chain is checked when none of them is left (a run resumed by peers with new keys: its group commits by the
    roster rule too)."""
    group = set(group)
    if round_ == 0:
        return Verdict(True, 0, 0, False)  # θ_0: built from the run's settings by everyone, committed by nobody
    if not group:
        return Verdict(False, 0, 0, False, "it names no group that committed it")
    signing = signers(round_, digest, records)
    committed = {peer for peer, commits in records.items() if any(c[0] == round_ for c in commits)}  # any digest
    counted = (lambda ids: set(ids)) if alive is None else (lambda ids: set(ids) & (set(alive) | committed))
    signed = signing & group
    voters = counted(group) - ({me} - signing)  # a member that did not sign it was us: we know we did not commit it
    if not signed or 2 * len(signed) <= len(voters):
        return Verdict(False, len(signed), len(group), False,
                       f"no commit certificate: {len(signed)} of the {len(voters)} peers of its group alive or "
                       f"signed signed it")
    if prior is None:
        return Verdict(True, len(signed), len(group), False)
    our_round, our_group = prior
    if round_ != our_round + 1 or not our_group or (last_round is not None and round_ >= last_round):
        return Verdict(True, len(signed), len(group), False)
    electors = counted(our_group) - {me}
    if not electors:  # none of it left (a run resumed by peers with new keys): its group committed by the roster
        return Verdict(True, len(signed), len(group), False)
    chained = signing & electors
    if 2 * len(chained) <= len(electors):
        return Verdict(False, len(signed), len(group), True,
                       f"no commit certificate: {len(chained)} of the {len(electors)} peers alive or signed of the "
                       f"group that committed round {our_round} signed it")
    return Verdict(True, len(signed), len(group), True)
