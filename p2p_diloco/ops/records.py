"""What a peer says about each round it attempted: the metrics record and the log line (``log_round``), and what its
roster entry shows about its work (``report``). ``Peer._end_round`` calls both; the record's fields are listed in
docs/guides/monitoring.md."""

from __future__ import annotations

import time

from p2p_diloco.ops.metrics import throughput_text


def log_round(peer, result, committed: bool, train_loss: float, tokens: int, steps: int, timing: dict) -> None:
    """The round's metrics record (with a held-out loss every ``run.eval_every`` committed rounds) and one log line."""
    deadlines = getattr(peer.averager, "deadlines", None)  # a mocked averager has none
    deadline = deadlines.allreduce_timeout if deadlines is not None else None
    record = {"event": "round", "peer": peer.name, "round": peer.round, "committed": committed,
              "run/round": max(peer.run_round, peer.round),
              "outer/group_size": result.group_size, "outer/peers": result.peers, "train/loss": train_loss,
              "train/tokens": tokens, "train/inner_steps": steps,
              "train/planned_steps": peer.rounds.planned if steps else 0, "outer/allreduce_s": result.seconds,
              "outer/allreduce_only_s": result.allreduce_seconds, "outer/allreduce_timeout_s": deadline,
              "outer/bytes_sent": result.bytes_sent, "outer/bytes_received": result.bytes_received,
              "outer/reducer_bytes": getattr(result, "reducer_bytes", 0),
              "outer/check_s": getattr(result, "check_s", 0.0),
              "outer/check_messages": getattr(result, "check_messages", 0),
              "outer/check_bytes": getattr(result, "check_bytes", 0), **_net_costs(peer),
              "global_params_sha256": peer.state.params_digest, "state_sha256": peer.state.digest,
              "error": result.error, **timing, **peer.replica.round_stats(tokens, timing["time/inner_s"]),
              **(peer.rounds.background_split if steps else {})}
    eval_every = peer.cfg.run.eval_every
    if committed and eval_every and peer.round % eval_every == 0:
        begun = time.perf_counter()
        record["eval/loss"] = peer._evaluate()
        record["time/eval_s"] = time.perf_counter() - begun
    peer.metrics.log(record)
    if committed:
        ev = f", eval {record['eval/loss']:.4f}" if "eval/loss" in record else ""
        peer.log.info(f"round {peer.round}: group {result.group_size}, train loss {train_loss:.4f}{ev}, "
                      f"all-reduce {result.seconds:.2f} s, sent {result.bytes_sent / 1e6:.2f} MB, "
                      f"{throughput_text(record)}")
    else:
        peer.log.warning(f"round {peer.round + 1} not committed ({result.error}); θ_global kept, "
                         f"training continues from θ_local")


def _net_costs(peer) -> dict:
    """What the run's records cost since the last round record: roster reads (how many, the entries they returned,
    seconds with their validation: the cost grows with N) and storing our signed commit record (net/certificate.py)."""
    membership = getattr(peer, "membership", None)
    if membership is None or not hasattr(membership, "take_costs"):
        return {}
    return {f"net/{name}": value for name, value in membership.take_costs().items()}


def report(peer, result, train_loss: float, steps: int, committed: bool) -> None:
    """What the roster shows about our work (published with the next heartbeat or state change): our speed
    over recent rounds (averaging excluded), tokens trained, the last all-reduce, the last round's inner steps
    (done and planned) and mean training loss."""
    if peer.membership is not None:
        peer.membership.work.update(steps_per_s=peer.pace.steps_per_s, tokens_per_s=peer.pace.tokens_per_s,
                                    tokens_trained=peer.tokens_trained, last_allreduce_s=result.seconds,
                                    last_bytes=result.bytes_sent + result.bytes_received, last_steps=steps,
                                    last_round=peer.round if committed else peer.round + 1,
                                    last_planned_steps=peer.rounds.planned if steps else 0,
                                    last_loss=train_loss if 0 < train_loss < 1e4 else 0.0,  # NaN: none
                                    missed_rounds=peer._missed_rounds())
