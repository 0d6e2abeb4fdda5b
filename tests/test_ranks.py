"""A multi-GPU machine is one peer: ``p2p-diloco peer --nproc-per-node K`` (torchrun, gloo on this CPU machine) next to
an ordinary one-process peer, on loopback."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import tagged_pids
from p2p_diloco.config import ModelConfig
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.ranks import torchrun_argv
from p2p_diloco.ops.swarm import LocalSwarm
from p2p_diloco.train.model import build_model
from p2p_diloco.train.outer import params_digest

COMMON = ["--diloco.inner_steps=3", "--run.expected_peers=2", "--model.seq_len=32", "--inner.batch_size=2",
          "--inner.warmup_steps=2", "--data.eval_batches=1", "--averaging.matchmaking_time=5",
          "--averaging.request_timeout=2", "--averaging.next_chunk_timeout=15", "--averaging.roster_ttl=6",
          "--run.progress=false", "--run.threads=1"]


def _committed(run_dir: Path, name: str) -> list[dict]:
    return [r for r in read_jsonl(run_dir / name / "metrics.jsonl") if r.get("event") == "round" and r["committed"]]


def _swarm(run_dir: Path, args: list[str]) -> LocalSwarm:
    run_dir.mkdir(parents=True)
    swarm = LocalSwarm(run_dir, peer_args=[*COMMON, *args])
    swarm.start_bootstrap()
    return swarm


def _wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.2)  # the peers' metrics files are the only signal from other processes
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_torchrun_argv_drops_our_flag_and_keeps_the_rest():
    argv = ["peer", "--config", "x.toml", "--nproc-per-node", "4", "--run.name=a", "--nproc-per-node=4"]
    command = torchrun_argv(4, argv)
    assert command[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m"]
    assert command[6:] == ["p2p_diloco", "peer", "--config", "x.toml", "--run.name=a"]


@pytest.mark.timeout(300)
def test_two_rank_peer_agrees_counts_all_ranks_and_its_death_leaves_the_others_going(tmp_path, process_tag,
                                                                                       bpe_tokenizer, monkeypatch):
    """One two-rank peer and two one-rank peers, started from a checkpoint saved with save_pretrained (model.init_from,
    with its BPE tokenizer through data.tokenizer='auto'). One swarm for both checks, to keep the suite short:
    (1) θ_global at round 0 is the checkpoint on every peer, and three rounds commit with equal digests, the two-rank
    peer counting the tokens of both its ranks; (2) SIGKILL of its rank 1 ends the whole peer (torchrun reports the
    failure, no process is left) while the two others go on committing rounds without it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # inherited by every process: nothing may be downloaded
    from transformers import AutoTokenizer

    checkpoint = tmp_path / "ckpt"
    model = build_model(ModelConfig(name="tiny"), vocab_size=400, seed=11)
    model.save_pretrained(str(checkpoint))
    AutoTokenizer.from_pretrained(bpe_tokenizer).save_pretrained(str(checkpoint))
    saved = params_digest(p.detach() for p in model.parameters())
    run = tmp_path / "run"
    swarm = _swarm(run, ["--run.rounds=1000", "--run.expected_peers=3", f"--model.init_from={checkpoint}"])
    try:
        multi = swarm.start_peer("multi", ["--nproc-per-node", "2"])
        others = [swarm.start_peer(name) for name in ("a", "b")]
        multi_rounds = _wait_for(lambda: _committed(run, "multi")[2:] and _committed(run, "multi"), 200,
                                 "three rounds of the two-rank peer")
        os.kill(_wait_for(lambda: _follower_pid(process_tag), 10, "rank 1"), signal.SIGKILL)
        killed_at = time.time()
        assert multi.proc.wait(timeout=90) != 0  # torchrun reports the failed rank
        _wait_for(lambda: not [p for p in tagged_pids(process_tag) if b"--run.name=multi" in _cmdline(p)], 30,
                  "every process of the two-rank peer to end")
        later = _wait_for(lambda: [r for r in _committed(run, "a") if r["time"] > killed_at
                                   and r["outer/peers"] == ["a", "b"]], 120, "the two others to commit without it")
        for child in others:
            child.proc.send_signal(signal.SIGTERM)
        assert [child.proc.wait(timeout=60) for child in others] == [0, 0]
    finally:
        swarm.close()
    for name in ("multi", "a", "b"):
        (start,) = [r for r in read_jsonl(run / name / "metrics.jsonl") if r["event"] == "start"]
        assert start["global_params_sha256"] == saved, f"{name} did not start from the checkpoint"
        assert "agrees with" in (run / f"{name}.log").read_text()
    by_round = {name: {r["round"]: r for r in _committed(run, name)} for name in ("a", "b")}
    for r in multi_rounds[:3]:
        assert r["outer/group_size"] >= 2 and "multi" in r["outer/peers"]
        assert all(by_round[p][r["round"]]["global_params_sha256"] == r["global_params_sha256"]
                   for p in r["outer/peers"] if p != "multi"), f"round {r['round']}: θ_global differs"
        # each rank trains its own batch x seq_len tokens per inner step (DyLU may give the peer fewer than H steps)
        assert r["train/inner_steps"] >= 1 and r["train/tokens"] == 2 * r["train/inner_steps"] * 2 * 32
    one_rank = by_round["a"][multi_rounds[0]["round"]]
    assert one_rank["train/tokens"] == one_rank["train/inner_steps"] * 2 * 32
    assert later[0]["round"] > multi_rounds[-1]["round"]
    assert "device cpu x 2 process(es)" in (run / "multi.log").read_text()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _follower_pid(tag: str) -> int:
    for pid in tagged_pids(tag):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=1" in env and b"LOCAL_RANK=1" in env:
            return pid
    return 0


