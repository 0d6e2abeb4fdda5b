"""Averaging pseudo-gradients among a group: the canonical butterfly all-reduce and everything it checks.

  contribution.py    what a member announces, a round's outcome, who takes part (pure)
  averager.py        CanonicalAverager: hivemind's averager process running our all-reduce
  allreduce.py       CanonicalAllReduceRunner: reducers stream the encoded average itself; all or nothing
  seam.py            Averager: the one object a peer talks to (buffers, average, state transfer)
  state_pipe.py      the state a donor serves and a joiner downloads, between processes without shared memory
  wire.py, codecs.py the wire formats (fp32, fp16, int8, int4, e3m0) and error feedback
  screening.py       who is left out and with what weight, from the gathered list (pure)
  aggregators.py     mean, clipped mean, CenteredClip, trimmed mean per part (pure)
  verify.py          reducer checks: members compare digests of the averaged bytes they received
  reducer_checks.py  the pure part of those checks and the capped share of the vector
  evidence.py        signed parts: a reducer's accusation counts only with the accused's signature
  bounds.py          part summaries and the bounds a reducer's average must meet (pure)
  attest.py          signed summaries with parts and averages; every average checked by its receivers
  attacks.py         a reducer's attacks, for tests (frame, equivocate, skew_reduce)
"""

from p2p_diloco.net.averaging.contribution import AverageResult, Contribution, choose_participants

__all__ = ["AverageResult", "Contribution", "choose_participants", "Averager", "PendingAverage"]


def __getattr__(name: str):
    """The seam on first use, so that importing a pure module of this package does not import hivemind."""
    if name in ("Averager", "PendingAverage"):
        from p2p_diloco.net.averaging import seam

        return getattr(seam, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
