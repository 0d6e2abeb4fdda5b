"""PURE: all-reduce deadlines derived from the model size, measured throughput and observed round times.

The rule (configured values are floors, so a fast link never gets tighter deadlines than configured):
  * every peer moves 2(N−1)/N × payload bytes in a butterfly all-reduce (payload = values × bytes per value);
  * the throughput estimate is the *slowest* recent round's bytes moved / all-reduce seconds (conservative);
  * allreduce_timeout   = max(floor, 4 × expected transfer seconds, 3 × slowest recent all-reduce seconds);
  * next_chunk_timeout  = max(floor, 8 × part_size_bytes / throughput): a peer silent for eight part times is dead;
  * matchmaking_time    = max(floor, 5% of the median recent round time): peers' arrival at the all-reduce spreads
    in proportion to the length of a round (speed jitter accumulates over the inner steps); doubled after each
    attempt whose group held too few of the run to commit (no quorum: the peers arrived further apart than the
    window), up to 8×, and back to 1× once a round commits. A full group starts at once, so a long window costs
    time only while a peer of the roster is missing.
Until a round has been measured, the floors apply. A straggler past these deadlines misses the round; it then finds
itself behind the run's roster and fetches the new state before contributing again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


MAX_WIDEN = 8


@dataclass(frozen=True)
class Deadlines:
    allreduce_timeout: float
    next_chunk_timeout: float
    matchmaking_time: float


class DeadlineEstimator:
    """Keeps the last ``window`` good rounds' measurements and derives the next round's deadlines."""

    def __init__(self, allreduce_floor: float, chunk_floor: float, part_size_bytes: int, payload_bytes: int,
                 matchmaking_floor: float = 0.0, window: int = 5):
        self.allreduce_floor, self.chunk_floor, self.matchmaking_floor = allreduce_floor, chunk_floor, matchmaking_floor
        self.part_size_bytes, self.payload_bytes = part_size_bytes, payload_bytes
        self.history: deque[tuple[int, float]] = deque(maxlen=window)  # (bytes moved, all-reduce seconds)
        self.round_times: deque[float] = deque(maxlen=window)  # wall seconds of whole rounds
        self.widen = 1  # the matchmaking window's factor: doubled after a group without quorum

    def observe(self, bytes_moved: int, seconds: float) -> None:
        """A good round's all-reduce: its throughput, and the matchmaking window back to its base."""
        self.widen = 1
        if bytes_moved > 0 and seconds > 0:
            self.history.append((bytes_moved, seconds))

    def no_quorum(self) -> None:
        """The group held too few of the run's peers to commit: the next attempt gathers for twice as long."""
        self.widen = min(2 * self.widen, MAX_WIDEN)

    def observe_round(self, seconds: float) -> None:
        if seconds > 0:
            self.round_times.append(seconds)

    def deadlines(self, group_size: int) -> Deadlines:
        matchmaking = self.matchmaking_floor
        if self.round_times:
            matchmaking = max(self.matchmaking_floor, 0.05 * sorted(self.round_times)[len(self.round_times) // 2])
        matchmaking *= self.widen
        if not self.history:
            return Deadlines(self.allreduce_floor, self.chunk_floor, matchmaking)
        throughput = min(b / s for b, s in self.history)  # bytes per second, slowest recent round
        moved = 2 * (group_size - 1) / max(group_size, 1) * self.payload_bytes
        slowest = max(s for _, s in self.history)
        allreduce = max(self.allreduce_floor, 4 * moved / throughput, 3 * slowest)
        chunk = max(self.chunk_floor, 8 * self.part_size_bytes / throughput)
        return Deadlines(allreduce, chunk, matchmaking)
