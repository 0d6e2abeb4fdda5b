"""Is this peer in the run? A peer whose rounds keep failing while the run commits without it says so plainly, once,
in its log, and once more when it is back (issue 28: a volunteer's GPU must not train for nobody with nothing on
screen). The same count is a Prometheus gauge (ops/telemetry.py) and a column of ``p2p-diloco status``.

Fed the peer's own records (ops/metrics.py's fan-out, so the round loop holds no code for it): a round record says
whether the round committed, our θ_global round, and the run's round as this peer last read it from the roster
(``run/round``: the latest round credible to it, net/consensus.py credible_rounds: a stranger's entry claiming a
far round is not the run's). :class:`Standing` is pure.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from p2p_diloco.ops.metrics import MetricsSink

MISSED_ROUNDS_WARN = 3  # rounds the run committed without this peer before it says so


class Standing:
    """Rounds the run committed since this peer's last committed round (``missed``), from its round records."""

    def __init__(self, threshold: int = MISSED_ROUNDS_WARN):
        self.threshold = threshold
        self.base: Optional[int] = None  # the run's round at our last commit (or at our first failed attempt)
        self.missed = 0
        self.attempts = 0  # our attempts since our last commit
        self.warned = False

    def observe(self, record: dict[str, Any]) -> Optional[tuple[int, str]]:
        """Take one record; a (logging level, line) to say when this peer has just fallen out of the run or come
        back, else None."""
        ours = _round(record.get("round"))
        if record.get("event") != "round" or ours is None:
            return None
        if record.get("committed"):
            line = None
            if self.warned:
                line = (logging.INFO, f"back in the run: round {ours} committed with this peer, after the run "
                                      f"committed {self.missed} round(s) without it ({self.attempts} attempt(s) "
                                      f"failed)")
            self.base, self.missed, self.attempts, self.warned = ours, 0, 0, False
            return line
        self.attempts += 1
        run = max(ours, _round(record.get("run/round")) or 0)
        if self.base is None:
            self.base = run
        self.missed = max(0, run - self.base)
        if self.missed < self.threshold or self.warned:
            return None
        self.warned = True
        error = (str(record.get("error") or "").strip().splitlines() or ["no group formed"])[0][:200]
        return (logging.WARNING, f"NOT IN THE RUN: the run committed {self.missed} round(s) without this peer "
                                 f"(the run is at round {run}, this peer last committed round {self.base}; "
                                 f"{self.attempts} attempt(s) failed, the last: {error}); it keeps training "
                                 f"and trying")


class StandingSink(MetricsSink):
    """Logs :class:`Standing`'s lines on the peer's logger."""

    def __init__(self, logger: logging.Logger):
        self.standing, self.logger = Standing(), logger

    def log(self, record: dict[str, Any]) -> None:
        said = self.standing.observe(record)
        if said is not None:
            self.logger.log(*said)


def _round(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
