"""Accountable reducers (issue 24, finding 6): the bounds a reducer's average must meet, given its members' signed
summaries (pure, against plain reference code), and a 3-peer swarm whose reducer serves a wrong average."""

from __future__ import annotations

import json

import pytest
import torch
from hivemind.compression import CompressionInfo

from p2p_diloco.net.averaging.aggregators import AGGREGATORS, Aggregator
from p2p_diloco.net.averaging.bounds import (BLOCK, average_problem, parse_summary, summarize, summary_mismatch)
from p2p_diloco.net.averaging.wire import WireCodec, decode_part

CODECS = ("fp32", "fp16", "scaled_fp16", "int8", "int4", "e3m0")


def _wire(codec: str, x: torch.Tensor) -> torch.Tensor:
    return decode_part(WireCodec(codec, 2 ** 19).compress(x, CompressionInfo.from_tensor(x)))


def _reference_stats(x: torch.Tensor):
    """Per block of BLOCK values, by a plain Python loop: (min, max, sum)."""
    flat = x.reshape(-1).tolist()
    rows = [flat[i:i + BLOCK] for i in range(0, len(flat), BLOCK)]
    return [(min(r), max(r), sum(r)) for r in rows]


def _members(n: int, numel: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(numel, generator=g)
    parts = [common * 0.5 + torch.randn(numel, generator=g) * (0.5 + i) for i in range(n)]
    parts[0][: BLOCK // 2] = 0.0  # a block half of zeros
    parts[-1][BLOCK: BLOCK + 64] = 3e-3  # a constant run
    return parts


def test_a_summary_is_each_blocks_min_max_and_sum_and_a_lie_about_it_is_seen():
    x = torch.randn(2 * BLOCK + 100, generator=torch.Generator().manual_seed(1))
    lo, hi, sums = parse_summary(summarize(x), x.numel())
    for (rlo, rhi, rsum), a, b, c in zip(_reference_stats(x), lo, hi, sums, strict=True):
        assert (float(a), float(b)) == (rlo, rhi) and abs(float(c) - rsum) < 1e-9
    assert summary_mismatch(x, summarize(x)) is None
    lie = summarize(x * 0.5)
    assert summary_mismatch(x, lie) == "a part summary that does not match its part"
    assert summary_mismatch(x, summarize(x)[:-8]) == "a part summary of the wrong size"
    assert parse_summary(b"x" * 5, x.numel()) is None


@pytest.mark.parametrize("aggregator", AGGREGATORS)
def test_honest_averages_pass_and_skewed_ones_fail_for_every_codec(aggregator):
    numel, n = 3 * BLOCK + 640, 4  # a last block of 640 values: a whole number of 64- and 128-value codec blocks
    rule = Aggregator(aggregator, trim_fraction=0.25)
    for seed in range(3):
        sent = [_wire("int8", p) for p in _members(n, numel, seed)]  # the parts as their reducer decodes them
        weights = [3.0, 1.0, 2.0, 5.0]
        claims = [(w, parse_summary(summarize(p), numel)) for w, p in zip(weights, sent)]
        honest = rule(sent, weights)
        for codec in CODECS:
            served = _wire(codec, honest)
            assert average_problem(served, claims, aggregator, 0.25, codec) is None, (codec, seed)
            for skew in (-10.0, 10.0):
                assert average_problem(_wire(codec, honest * skew), claims, aggregator, 0.25, codec) is not None
        # a flipped mean fails the sums: uncompressed, and through a 16-bit codec
        if aggregator == "mean":
            for codec in ("fp32", "scaled_fp16"):
                why = average_problem(_wire(codec, -honest), claims, aggregator, 0.25, codec)
                assert why is not None and "sums to" in why, (codec, why)
            shifted = _wire("fp32", honest + 0.05)
            assert average_problem(shifted, claims, aggregator, 0.25, "fp32") is not None
    # a non-finite average is left to the commit's own check; no members: nothing to check
    assert average_problem(torch.full((numel,), float("nan")), claims, aggregator, 0.25, "fp32") is None
    assert average_problem(honest, [], aggregator, 0.25, "fp32") is None


def test_parts_of_zeros_and_of_subnormal_values_pass_when_honest():
    numel = BLOCK + 64
    for scale in (0.0, 1e-39, 1e-30):
        parts = [p * scale for p in _members(3, numel, 3)]
        claims = [(w, parse_summary(summarize(p), numel)) for w, p in zip((1.0, 7.0, 2.0), parts)]
        for aggregator in AGGREGATORS:
            honest = Aggregator(aggregator)(parts, [1.0, 7.0, 2.0])
            for codec in CODECS:
                assert average_problem(_wire(codec, honest), claims, aggregator, 0.25, codec) is None, (scale, codec)


def test_the_trimmed_mean_box_holds_against_as_many_liars_as_it_trims():
    numel, n = BLOCK, 5  # trim_fraction 0.25 of 5: one value trimmed per side
    parts = _members(n, numel, 7)
    claims = [(1.0, parse_summary(summarize(p), numel)) for p in parts]
    liar = torch.full((numel,), 1e6)
    claims[2] = (1.0, parse_summary(summarize(liar), numel))  # one member (the reducer's own claim) claims huge values
    honest = Aggregator("trimmed_mean", trim_fraction=0.25)([*parts[:2], liar, *parts[3:]], [1.0] * n)
    assert average_problem(honest, claims, "trimmed_mean", 0.25, "fp32") is None
    assert average_problem(torch.full((numel,), 5e5), claims, "trimmed_mean", 0.25, "fp32") is not None


def test_a_sender_whose_signed_summary_lies_is_the_one_blamed_by_the_reducers_evidence():
    from hivemind.compression import serialize_torch_tensor

    from p2p_diloco.net.averaging.evidence import Accusation, judge, part_statement
    from p2p_diloco.net.security.identity import Identity

    sender, reducer = Identity.generate(), Identity.generate()
    x = torch.randn(4)
    tensor = serialize_torch_tensor(x)
    for summary, blamed in ((summarize(x * 2), sender), (summarize(x), reducer)):
        sig = sender.sign(part_statement(b"g", reducer.peer_id, 0, 1.0, tensor, summary))
        who, why = judge(culprit=sender.peer_id, reducer=reducer.peer_id, group_id=b"g",
                         accusation=Accusation("x", 0, sig, b"", summary), weight=1.0, tensor=tensor,
                         part_shapes=(torch.Size([4]),), expected_weight=1.0)
        assert who == blamed.peer_id, why


class _Receiver:
    """The state a member's runner holds when an average arrives (attest.Attesting's expectations)."""

    def __init__(self, ids, aggregator="mean", codec="fp32"):
        from hivemind.p2p import PeerID

        self.identity = ids[0]
        self.peer_id = PeerID(ids[0].peer_id)
        self.sender_peer_ids = self.ordered_peer_ids = [PeerID(i.peer_id) for i in ids]
        self.weights = {p: 1.0 for p in self.sender_peer_ids}
        self.group_id, self.aggregator, self.average_codec = b"g", Aggregator(aggregator), WireCodec(codec, 2 ** 19)


def test_a_receiver_names_the_reducer_for_a_missing_or_forged_summary_and_a_skewed_average():
    from hivemind.compression import serialize_torch_tensor
    from hivemind.utils import MSGPackSerializer

    from p2p_diloco.net.averaging.attest import Attesting, decode_entries
    from p2p_diloco.net.averaging.evidence import statement, tensor_digest
    from p2p_diloco.net.security.identity import Identity

    ids = [Identity.generate() for _ in range(3)]
    runner = type("R", (Attesting, _Receiver), {})(ids)
    runner._init_attesting()
    reducer = ids[2].peer_id
    parts = [torch.randn(BLOCK + 10, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    rows = []
    for i, (who, x) in enumerate(zip(ids, parts)):
        digest, summary = tensor_digest(serialize_torch_tensor(x)), summarize(x)
        rows.append([i, digest, summary, who.sign(statement(b"g", reducer, 0, 1.0, digest, summary)), b""])
    honest = Aggregator("mean")(parts, [1.0] * 3)
    blob = MSGPackSerializer.dumps(rows)
    assert decode_entries(blob, 3) is not None and runner._average_fault(2, 0, honest, blob) is None
    assert "out of bounds" in runner._average_fault(2, 0, honest * -10, blob)
    assert "without the summary of member" in runner._average_fault(2, 0, honest, MSGPackSerializer.dumps(rows[:2]))
    forged = [rows[0], [1, rows[1][1], summarize(parts[1] * 3), rows[1][3], b""], rows[2]]
    assert "did not sign" in runner._average_fault(2, 0, honest, MSGPackSerializer.dumps(forged))
    assert "without its members' summaries" in runner._average_fault(2, 0, honest, b"\xc1junk")
    assert decode_entries(MSGPackSerializer.dumps([rows[0], rows[0]]), 3) is None  # a member listed twice
    assert runner.check_seconds > 0


@pytest.mark.timeout(360)
def test_a_reducer_serving_a_wrong_average_is_not_committed_and_is_left_out(tmp_path, process_tag):
    """peer2's reducer serves everyone -10 x the true average of its parts from round 2 on (fault.attack=skew_reduce):
    the same bytes to every member, so the digest comparison sees nothing, and before this check every peer
    committed it. Now each honest member finds the average outside its members' signed bounds, fails the round
    naming peer2, leaves it out, and the two go on together with identical θ_global."""
    from p2p_diloco.config import load_config
    from p2p_diloco.ops.metrics import read_jsonl
    from p2p_diloco.ops.swarm import DEMO_DEFAULTS, ChaosPlan, run_swarm, write_peer_config

    cfg = load_config(defaults={**DEMO_DEFAULTS, "inner.batch_size": 4, "model.seq_len": 32, "data.eval_batches": 1,
                                "averaging.matchmaking_time": 4.0, "averaging.next_chunk_timeout": 10.0,
                                "averaging.roster_ttl": 10.0, "run.checkpoint_every": 0})
    plan = ChaosPlan(peer_args={"peer2": ["--fault.attack=skew_reduce", "--fault.attack_from=2"]})
    rounds = 3
    run_swarm(3, rounds, 6, str(tmp_path), write_peer_config(tmp_path, cfg), plan=plan, timeout=260,
              echo=lambda s: None)
    summary = json.loads((tmp_path / "summary.json").read_text())
    skewer = next(p["peer_id"] for p in summary["peers"] if p["name"] == "peer2")
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("peer*.log")))
    for name in ("peer0", "peer1"):
        rounds_ = [r for r in read_jsonl(tmp_path / name / "metrics.jsonl") if r.get("event") == "round"]
        committed = [r for r in rounds_ if r["committed"]]
        assert [r["round"] for r in committed] == list(range(1, rounds + 1)), f"{name}: {rounds_}\n{logs}"
        for r in committed:
            if r["round"] >= 2:  # the skewed average is never committed: every round from 2 on is without peer2
                assert sorted(r["outer/peers"]) == ["peer0", "peer1"], f"{name}: {r}\n{logs}"
        failed = [r for r in rounds_ if not r["committed"]]
        named = [r for r in failed if f"peer2 ({skewer})" in r["error"] and "out of bounds" in r["error"]]
        # a member may instead hear first that another member's all-reduce failed (it found the skew sooner)
        assert named, f"{name} did not name the reducer: {[r['error'] for r in failed]}\n{logs}"
    for r in summary["rounds"]:
        hashes = r["global_params_sha256"]
        assert {"peer0", "peer1"} <= set(hashes) and hashes["peer0"] == hashes["peer1"], r
