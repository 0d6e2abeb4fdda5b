"""model.init_from end to end: a checkpoint saved with save_pretrained is θ_global at round 0 on every peer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2p_diloco.config import ModelConfig
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.train.model import build_model
from p2p_diloco.train.outer import params_digest


@pytest.mark.timeout(300)
def test_two_peers_start_from_a_saved_checkpoint_and_agree(tmp_path, process_tag, bpe_tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the peers inherit it: nothing may be downloaded
    from transformers import AutoTokenizer

    model = build_model(ModelConfig(name="tiny"), vocab_size=400, seed=11)
    model.save_pretrained(str(tmp_path / "ckpt"))
    AutoTokenizer.from_pretrained(bpe_tokenizer).save_pretrained(str(tmp_path / "ckpt"))  # its own tokenizer
    saved = params_digest(p.detach() for p in model.parameters())
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "p2p_diloco", "swarm", "--run-dir", str(run), "--peers", "2",
                          "--rounds", "2", "--inner-steps", "4", f"--model.init_from={tmp_path / 'ckpt'}",
                          "--model.seq_len=32", "--inner.batch_size=2", "--data.eval_batches=1"],
                         capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for name in ("peer0", "peer1"):
        (start,) = [r for r in read_jsonl(run / name / "metrics.jsonl") if r["event"] == "start"]
        assert start["global_params_sha256"] == saved, f"{name} did not start from the checkpoint's weights"
        log = (run / f"{name}.log").read_text()
        assert f"from {tmp_path / 'ckpt'}" in log and "agrees with 1 other peer" in log
    rounds = json.loads((run / "summary.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(len(set(r["global_params_sha256"].values())) == 1 and r["group_size"] == 2 for r in rounds)


def _membership(digest_of_others: list[str], monkeypatch):
    import threading
    import types

    import torch

    from p2p_diloco.config import Config
    from p2p_diloco.net.consensus import PeerStatus
    from p2p_diloco.net.membership import Membership
    from p2p_diloco.ops.metrics import MetricsSink
    from p2p_diloco.train.global_state import GlobalState
    from p2p_diloco.train.outer import OuterSGD

    state = GlobalState([torch.ones(3)], OuterSGD([torch.ones(3)], lr=1.0))
    me = Membership(Config(), None, types.SimpleNamespace(peer_id="me"), "prefix", "me", state, "fp", MetricsSink(),
                    threading.Event())
    roster = [PeerStatus(name=f"p{i}", peer_id=f"id{i}", round=0, digest=d) for i, d in enumerate(digest_of_others)]
    monkeypatch.setattr(me, "roster", lambda: roster)
    return me, state.digest


def test_a_peer_whose_initial_weights_differ_from_the_runs_refuses_to_train(monkeypatch):
    from p2p_diloco.config import ConfigError

    me, mine = _membership([], monkeypatch)
    me, mine = _membership([mine, "f" * 64], monkeypatch)
    me.check_initial_state("ckpt")  # two of three hold our bytes: we train
    me, mine = _membership(["a" * 64, "a" * 64], monkeypatch)
    with pytest.raises(ConfigError, match=r"^model\.init_from: 'ckpt' gives us initial weights .* every peer must"):
        me.check_initial_state("ckpt")
