"""inner.shard: a peer of K processes holds 1/K of the parameters, gradients and AdamW state on each (FSDP2 over
gloo on this CPU machine), and trains exactly what one process holding everything would."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest

from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.train.shard import check_shardable

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("state,settings", [
    ("fp32", []),
    ("fp32", ["model.gradient_checkpointing=true", "model.loss_chunk=16"]),  # the chunked loss's module is the root
    ("fp32", ["run.compile=true"]),  # each decoder layer compiled, then sharded (2.1e-6 measured)
    pytest.param("8bit", [], marks=pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                                      reason="torchao not installed"))])
def test_shard_pseudo_gradient_of_two_processes_equals_one_process_on_the_same_data(tmp_path, state, settings):
    """benchmarks/shard_check.py: two sharded ranks, each on its own 2 sequences per step, against one process on the
    same 4 sequences per step: the same mean loss, the same averaged gradient, the same AdamW steps: δ equal within
    fp32 rounding (with 8-bit moments, within their quantization: each rank quantizes its own shard's blocks). And
    θ_local ← θ_global reaches every shard: gathered back, the host copy is θ_global to the bit. The AdamW shards
    read back equal, and are not read under another checkpoint's tag. θ_global evaluated through the shards while
    θ_local is trained on (overlap) gives the one-process loss, and θ_local is back in the shards after."""
    from shard_check import main

    result = main(["--preset", "tiny", "--steps", "3", "--optimizer-state", state, "--json", str(tmp_path / "r.json"),
                   *(f"--set={kv}" for kv in settings)])
    assert result["sharded"] and result["load_reached_shards"] and result["moments_restored"]
    assert result["rank1_host_copy_bytes"] == 0, "rank 1 keeps a host copy of θ_local that only rank 0 reads"
    # θ_global evaluated through the shards while they hold θ_local (overlap), each rank half of the batches
    assert result["eval_loss_sharded"] == pytest.approx(result["eval_loss_one_process"], rel=1e-5)
    assert result["local_kept_through_eval"], "θ_local did not come back to the shards after the evaluation"
    assert result["losses_sharded"] == pytest.approx(result["losses_one_process"], rel=1e-5)
    assert result["max_abs_delta"] > 1e-4, "the inner steps moved nothing"
    # the gradients are summed in another order (per rank, then reduce-scattered): 7.7e-7 measured here, where a
    # different step (one rank's data alone, a gradient not averaged) moves parameters by about lr = 1e-3
    # (8-bit moments: 2.8e-5, each rank quantizing its own shard's blocks)
    worst = result["max_abs_delta_diff"]
    assert worst < (1e-5 if state == "fp32" else 1e-4), f"δ differs by {worst:.3g}"


def test_shard_refuses_offload_with_one_line():
    with pytest.raises(ConfigError, match="inner.offload") as caught:
        check_shardable(load_config(overrides={"inner.shard": "true", "inner.offload": "true"}))
    assert "\n" not in str(caught.value)
    check_shardable(load_config(overrides={"inner.shard": "true"}))  # the default options shard


@pytest.mark.timeout(400)
def test_shard_two_process_peer_and_one_process_peer_hold_the_same_theta_global_every_round(tmp_path, process_tag):
    """A real swarm: one peer of 2 sharded processes (`--nproc-per-node 2 --inner.shard=true`) and one ordinary
    peer. Sharding is a machine setting (the run accepts a member that shards and one that does not); every round
    both commit holds the same θ_global digest on both, the sharded peer counts the tokens of both its ranks, and its
    evaluation through its shards (each rank half of the held-out batches) gives the other's held-out loss.
    The sharded peer is then stopped (SIGTERM to its rank 0: it saves, each rank its AdamW shard, and releases its
    other rank) and restarted from its checkpoint (the saved θ_local scattered to its shards, the AdamW shards read
    back), and commits two more rounds with the other."""
    from test_ranks import _cmdline, _committed, _swarm, _wait_for

    run = tmp_path / "run"
    swarm = _swarm(run, ["--run.rounds=1000"])
    try:
        sharded = swarm.start_peer("sharded", ["--nproc-per-node", "2", "--inner.shard=true"])
        swarm.start_peer("plain")
        _wait_for(lambda: all(len(_committed(run, name)) >= 3 for name in ("sharded", "plain")), 200,
                  "3 rounds committed by both")
        os.kill(_wait_for(lambda: _rank0_pid(process_tag, _cmdline), 10, "the sharded peer's rank 0"), signal.SIGTERM)
        assert sharded.proc.wait(timeout=90) == 0  # rank 0 stopped in order (saved, released rank 1): torchrun 0
        first = len(_committed(run, "sharded"))
        swarm.start_peer("sharded", ["--nproc-per-node", "2", "--inner.shard=true"])
        _wait_for(lambda: len(_committed(run, "sharded")) >= first + 2, 200, "2 more rounds of the sharded peer")
    finally:
        swarm.close()
    mine = {r["round"]: r for r in _committed(run, "sharded")}
    theirs = {r["round"]: r for r in _committed(run, "plain")}
    together = [k for k in mine if k in theirs and sorted(mine[k]["outer/peers"]) == ["plain", "sharded"]]
    assert len(together) >= 5, f"rounds committed together: {together}"
    for k in together:
        assert mine[k]["global_params_sha256"] == theirs[k]["global_params_sha256"], f"round {k}: θ_global differs"
        assert mine[k]["train/tokens"] == 2 * mine[k]["train/inner_steps"] * 2 * 32
        # θ_global evaluated through the shards, each rank half of the held-out batches: the one-process loss
        assert mine[k]["eval/loss"] == pytest.approx(theirs[k]["eval/loss"], abs=1e-4), f"round {k}"
    log = (run / "sharded.log").read_text()
    assert "device cpu x 2 process(es), sharded, starting at round 0" in log
    assert "device cpu x 2 process(es), sharded, resumed at round" in log
    assert (run / "sharded" / "inner-shards" / ".metadata").is_file()  # each rank's AdamW shard, saved on stop
    assert "resumed without the inner AdamW state" not in log


@pytest.mark.timeout(300)
def test_shard_peer_with_overlap_evaluates_theta_global_through_its_shards(tmp_path, process_tag):
    """With diloco.overlap the shards hold θ_local (θ_global + the work in flight) when a round is evaluated:
    θ_global is scattered to them for the evaluation and θ_local back after (Exchange.global_in_model with shards),
    so the sharded peer's held-out loss is the one-process peer's (evaluated on θ_local it differs), and both go on
    holding the same θ_global."""
    from test_ranks import _committed, _swarm, _wait_for

    run = tmp_path / "run"
    swarm = _swarm(run, ["--run.rounds=1000", "--diloco.overlap=delayed"])
    try:
        swarm.start_peer("sharded", ["--nproc-per-node", "2", "--inner.shard=true"])
        swarm.start_peer("plain")
        together = lambda: [r for r in _committed(run, "sharded") if sorted(r["outer/peers"]) == ["plain", "sharded"]]
        _wait_for(lambda: len(together()) >= 3 and len(_committed(run, "plain")) >= 4, 200, "3 rounds together")
    finally:
        swarm.close()
    theirs = {r["round"]: r for r in _committed(run, "plain")}
    for mine in together():
        k = mine["round"]
        assert mine["global_params_sha256"] == theirs[k]["global_params_sha256"], f"round {k}: θ_global differs"
        assert mine["eval/loss"] == pytest.approx(theirs[k]["eval/loss"], abs=1e-4), f"round {k}"


def _rank0_pid(tag: str, cmdline) -> int:
    from conftest import tagged_pids

    for pid in tagged_pids(tag):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=0" in env and b"--run.name=sharded" in cmdline(pid) and b"p2p_diloco" in cmdline(pid):
            return pid
    return 0
