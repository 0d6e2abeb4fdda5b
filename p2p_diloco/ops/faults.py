"""Fault injection, a test tool: kill or stall this peer at a named phase of a named round.

``--fault.inject=kill:allreduce:3`` makes the peer SIGKILL itself while its reducer streams results in round 3;
``stall:...`` freezes the peer's whole process group with SIGSTOP instead (a frozen machine: no FIN, no RST), which
only timeouts can detect (the local swarm can thaw it with SIGCONT); ``term:...`` sends the peer SIGTERM, a graceful
stop at that moment (it saves a checkpoint holding its unfinished round's work). Phases:
  * ``inner``        halfway through the round's planned inner steps (at its end if DyLU's time budget ends it sooner)
  * ``matchmaking``  once the averager is looking for a group
  * ``allreduce``    after the reducer has streamed its first averaged part (parts still in flight)
  * ``serving``      after the first message of a state download served to a joining peer
For ``serving`` the round is that of the state served plus one (the round the joiner will train), and the fault
strikes at the first download served at or after that round (a joiner's arrival is not timed to the round).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Optional

PHASES = ("inner", "matchmaking", "allreduce", "serving")
ACTIONS = ("kill", "stall", "term")


@dataclass(frozen=True)
class Fault:
    action: str
    phase: str
    round: int
    main_pid: int  # the peer's main process: a kill takes it (and so, through PDEATHSIG, every helper) down

    def due(self, phase: str, round_: int) -> bool:
        return phase == self.phase and round_ == self.round

    def strike(self) -> None:
        """Kill or freeze the peer now. Does not return when it kills."""
        if self.action == "stall":
            os.killpg(os.getpgid(self.main_pid), signal.SIGSTOP)
            return
        if self.action == "term":
            os.kill(self.main_pid, signal.SIGTERM)
            return
        os.kill(self.main_pid, signal.SIGKILL)
        os._exit(137)  # when called from a helper process (averager), vanish at once too


def parse_fault(text: Optional[str], main_pid: Optional[int] = None) -> Optional[Fault]:
    """``ACTION:PHASE:ROUND`` → Fault; None for None. Raises ValueError with a readable message."""
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in ACTIONS or parts[1] not in PHASES or not parts[2].isdigit():
        raise ValueError(f"expected ACTION:PHASE:ROUND with ACTION in {ACTIONS} and PHASE in {PHASES}, got {text!r}")
    return Fault(parts[0], parts[1], int(parts[2]), main_pid if main_pid is not None else os.getpid())
