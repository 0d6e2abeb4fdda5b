"""Fault injection, a test tool: kill or stall this peer at a named phase of a named round.

``--fault.inject=kill:allreduce:3`` makes the peer SIGKILL itself while its reducer streams results in round 3;
``stall:...`` freezes the peer's whole process group with SIGSTOP instead (a frozen machine: no FIN, no RST), which
only timeouts can detect (the local swarm can thaw it with SIGCONT); ``term:...`` sends the peer SIGTERM, a graceful
stop at that moment (it saves a checkpoint holding its unfinished round's work). ``hold:...`` pauses the peer at that
moment until a test harness removes the file ``run_dir/hold`` the peer created (at most HOLD_MAX_S), so that the
harness can act on the network (take the peer's router down) while, say, an all-reduce is in flight. Phases:
  * ``inner``        halfway through the round's planned inner steps (at its end if DyLU's time budget ends it sooner)
  * ``matchmaking``  once the averager is looking for a group
  * ``sending``      as a sender, after our first part went to a reducer (the rest of our parts not yet sent)
  * ``allreduce``    after the reducer has streamed its first averaged part (parts still in flight)
  * ``checks``       once every average arrived, before the members compare what reducers sent (reducer checks)
  * ``serving``      after the first message of a state download served to a joining peer
  * ``download``     after the first message of a state download received (joining or repairing; any round)
For ``serving`` the round is that of the state served plus one (the round the joiner will train), and the fault
strikes at the first download served at or after that round (a joiner's arrival is not timed to the round).
Round 0 means the first round that reaches the phase (a peer that joins a run going on does not know its rounds in
advance: tests/test_stop.py parks such peers in a phase with ``hold:PHASE:0``).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

PHASES = ("inner", "matchmaking", "sending", "allreduce", "checks", "serving", "download")
AVERAGER_PHASES = ("sending", "allreduce", "checks", "download")  # struck in the averager's process
ACTIONS = ("kill", "stall", "term", "hold")
HOLD_FILE = "hold"
HOLD_MAX_S = 120.0
_held: set = set()  # holds already served in this process: a hold strikes once (strike() may be called per part)


@dataclass(frozen=True)
class Fault:
    action: str
    phase: str
    round: int
    main_pid: int  # the peer's main process: a kill takes it (and so, through PDEATHSIG, every helper) down
    hold_path: str = ""  # hold: the file that marks the peer as held, removed by the harness to release it

    def due(self, phase: str, round_: int) -> bool:
        return phase == self.phase and self.round in (0, round_)  # 0: any round (a hold strikes once)

    def strike(self) -> None:
        """Kill, freeze or hold the peer now. Does not return when it kills."""
        if self.action == "hold":
            self._hold()
            return
        if self.action == "stall":
            os.killpg(os.getpgid(self.main_pid), signal.SIGSTOP)
            return
        if self.action == "term":
            os.kill(self.main_pid, signal.SIGTERM)
            return
        os.kill(self.main_pid, signal.SIGKILL)
        os._exit(137)  # when called from a helper process (averager), vanish at once too

    def _hold(self) -> None:
        if self in _held:
            return
        _held.add(self)
        path = Path(self.hold_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{self.phase}:{self.round}\n")
        deadline = time.monotonic() + HOLD_MAX_S
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # the harness is another process: it removes the file, there is no event to wait on


def parse_fault(text: Optional[str], main_pid: Optional[int] = None, hold_path: str = "") -> Optional[Fault]:
    """``ACTION:PHASE:ROUND`` → Fault; None for None. Raises ValueError with a readable message."""
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in ACTIONS or parts[1] not in PHASES or not parts[2].isdigit():
        raise ValueError(f"expected ACTION:PHASE:ROUND with ACTION in {ACTIONS} and PHASE in {PHASES}, got {text!r}")
    return Fault(parts[0], parts[1], int(parts[2]), main_pid if main_pid is not None else os.getpid(), hold_path)


ATTACK_SCALE = 1000.0  # weight, flip and random: how much larger than honest
STALE_ROUNDS = 5  # stale: the pseudo-gradient of this many rounds ago
SKEW = -10.0  # skew_reduce: the average a reducer serves, sign flipped and ten times larger


@dataclass
class Attack:
    """``fault.attack``: from round ``start`` on, this member puts a bad contribution through the normal all-reduce
    (security tests, benchmarks/robust.py). It acts in the averager's process: ``on_tensors`` on its buffers before
    they are cut into parts (nan, flip, random, stale), ``on_wire`` on each message to another reducer (shape,
    weight). ``equivocate`` and ``frame`` act as a reducer (net/averaging/attacks.py) and are not handled here;
    ``skew_reduce``, as a reducer, sends everyone the same wrong average of its parts (``on_average``)."""
    mode: str
    start: int
    history: list = field(default_factory=list)  # stale: our honest pseudo-gradients of the last rounds, newest last

    def due(self, round_: int) -> bool:
        return round_ >= self.start

    def on_tensors(self, tensors, round_: int) -> None:
        import torch

        if self.mode == "stale":  # every round, before it strikes too: it needs the history
            self.history = (self.history + [[t.clone() for t in tensors]])[-(STALE_ROUNDS + 1):]
        if not self.due(round_):
            return
        if self.mode == "nan":
            for t in tensors:
                t.view(-1)[::97] = float("nan")
        elif self.mode == "flip":
            for t in tensors:
                t.mul_(-ATTACK_SCALE)
        elif self.mode == "random":
            g = torch.Generator().manual_seed(round_)
            noise = [torch.randn(t.shape, generator=g) for t in tensors]
            scale = ATTACK_SCALE * _norm(tensors) / max(_norm(noise), 1e-30)
            for t, n in zip(tensors, noise):
                t.copy_(n * scale)
        elif self.mode == "stale":  # the oldest we kept: STALE_ROUNDS rounds ago once that many have passed
            for t, old in zip(tensors, self.history[0]):
                t.copy_(old)

    def on_average(self, averaged):
        """skew_reduce: the average a reducer serves for a part, finite and wrong (× SKEW); else unchanged."""
        return averaged * SKEW if self.mode == "skew_reduce" else averaged

    def on_wire(self, msg) -> None:
        """A message carrying one of our parts to another reducer (hivemind's AveragingData)."""
        if self.mode == "weight":
            msg.weight = msg.weight * ATTACK_SCALE
        elif self.mode == "shape":
            import torch
            from hivemind.compression import serialize_torch_tensor

            msg.tensor_part.CopyFrom(serialize_torch_tensor(torch.zeros(7)))


def _norm(tensors) -> float:
    return float(sum(float(t.double().pow(2).sum()) for t in tensors) ** 0.5)


def parse_attack(mode: Optional[str], start: int) -> Optional[Attack]:
    """``fault.attack`` → Attack, or None (honest, or equivocate, which the reducer checks implement)."""
    return Attack(mode, start) if mode is not None and mode != "equivocate" else None
