"""Attacks by a reducer, for tests only (``fault.attack``): mixin of the canonical all-reduce's runner (allreduce.py).

  * ``frame``: refuse the first other participating sender's well-formed part, calling it NaN (evidence.py);
  * ``equivocate``: send every other sender other averaged bytes than the rest (verify.py);
  * ``skew_reduce``: send everyone the same wrong average, ops/faults.py ``Attack.on_average`` (attest.py).
"""

from __future__ import annotations

import asyncio

import torch

from p2p_diloco.net.averaging.bounds import BLOCK


class ReducerAttacks:
    """Expects ``attack``, ``peer_id``, ``sender_peer_ids``, ``average_codec``, ``_own_infos``,
    ``_expected_weight``."""

    def _framing(self, sender_index: int) -> bool:
        """fault.attack=frame: as a reducer, refuse the first other participating sender's well-formed part."""
        if self.attack is None or self.attack.mode != "frame":
            return False
        others = [p for p in self.sender_peer_ids if p != self.peer_id and self._expected_weight(p, 1.0) > 0]
        return bool(others) and self.sender_peer_ids[sender_index] == others[0]

    def _deceived(self, sender_index: int) -> bool:
        """fault.attack=equivocate: every other sender (ourselves excepted) gets other bytes than the rest."""
        others = [p for p in self.sender_peer_ids if p != self.peer_id]
        return others.index(self.sender_peer_ids[sender_index]) % 2 == 1

    async def _lie(self, averaged: torch.Tensor, part_index: int):
        """The average's first block of values rotated by one, encoded with the run's codec: a valid part with other
        bytes, and one the bounds on averages do not see (bounds.py: same values, sums and ranges per block), so
        that only the members' comparison of digests can catch it."""
        lie = averaged.clone().view(-1)
        head = lie[:BLOCK]
        head.copy_(torch.roll(head.clone(), 1))
        lie = lie.view(averaged.shape)
        return await asyncio.get_event_loop().run_in_executor(None, self.average_codec.compress, lie,
                                                              self._own_infos[part_index])
