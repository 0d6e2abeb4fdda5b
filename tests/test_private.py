"""A private run of 2 members against real outsider processes (tests/outsider.py): no secret, a wrong (stale)
secret, and a valid secret whose PeerID was revoked while the run went on (``p2p-diloco revoke``). None of them can
read or write the DHT, join a group, upload a part or download the state; the members' every round is theirs alone
(same θ_global on both, both in every group) and they log each refusal. A member holding the secret cannot write a
roster entry in another member's name (signed records). The same outsider with the valid secret, before
its revocation, shows that each attempt does work for a member: the refusals are the gate's, not the probe's. No
handler of the members' averagers is destroyed by the garbage collector while it waits (it was, in every run)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p_diloco.net.security.identity import Identity
from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.procs import stop_groups
from p2p_diloco.ops.swarm import LocalSwarm

OUTSIDER = Path(__file__).with_name("outsider.py")
SECRET = "correct horse battery staple"
PEER_ARGS = ["--model.name=tiny", "--model.seq_len=32", "--inner.batch_size=4", "--data.eval_batches=1",
             "--diloco.inner_steps=10", "--run.threads=1", "--run.progress=false", "--run.expected_peers=2",
             "--averaging.matchmaking_time=4", "--averaging.request_timeout=2", "--averaging.roster_ttl=6",
             "--run.run_id=private-test", "--run.checkpoint_every=0"]


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.3)  # files written by other processes: no event to wait on
    raise AssertionError(f"timed out waiting for {what}")


def _rounds(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name / "metrics.jsonl"
    return [r for r in read_jsonl(path) if r.get("event") == "round"] if path.is_file() else []


def _log(run_dir: Path, name: str) -> str:
    path = run_dir / f"{name}.log"
    return path.read_text() if path.is_file() else ""


@pytest.fixture(scope="module")
def private_run(tmp_path_factory, module_process_tag):
    """Bootstrap and 2 members holding the secret, running until the tests are done; yields (swarm, info)."""
    run_dir = tmp_path_factory.mktemp("private")
    secret_file = run_dir / "secret"
    secret_file.write_text(SECRET + "\n")
    operator = Identity.generate()  # the run's one revoker: members cannot revoke each other
    operator.write(str(run_dir / "operator.key"))
    access = [f"--network.secret_file={secret_file}", f"--network.revokers={operator.peer_id_b58}"]
    swarm = LocalSwarm(run_dir, peer_args=[*access, *PEER_ARGS])
    try:
        swarm.start_bootstrap(extra_args=access)
        for name in ("peer0", "peer1"):
            swarm.start_peer(name)
        _wait(lambda: all(any(r["committed"] for r in _rounds(run_dir, n)) for n in ("peer0", "peer1")), 90,
              "both members to commit a round")
        prefix = re.search(r"group key prefix (\S+)\)", _log(run_dir, "peer0")).group(1)
        target = (run_dir / "peer0" / "maddrs.txt").read_text().split()[-1]  # the loopback address
        yield swarm, dict(run_dir=run_dir, secret_file=secret_file, prefix=prefix, target=target, access=access)
    finally:
        swarm.close()


def _outsiders(info, cases: dict) -> dict:
    """Run one outsider process per case at once (case name -> dict(secret=..., identity=...)); their reports."""
    procs = {}
    for case, how in cases.items():
        out = info["run_dir"] / f"{case}.json"
        args = [sys.executable, str(OUTSIDER), "--bootstrap", _bootstrap(info), "--target", info["target"],
                "--prefix", info["prefix"], "--run-id", "private-test", "--out", str(out)]
        args += ["--secret", how["secret"]] if how.get("secret") else []
        args += ["--identity", str(how["identity"])] if how.get("identity") else []
        args += ["--forge", how["forge"]] if how.get("forge") else []
        with open(info["run_dir"] / f"{case}.log", "w") as log:  # a file: the outsider's children inherit it
            procs[case] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for case, proc in procs.items():
            assert proc.wait(timeout=90) == 0, _log(info["run_dir"], case)[-2000:]
    finally:
        stop_groups([proc.pid for proc in procs.values()])
    return {case: json.loads((info["run_dir"] / f"{case}.json").read_text()) for case in cases}


def _bootstrap(info) -> str:
    return [line.strip() for line in _log(info["run_dir"], "bootstrap").splitlines()
            if line.strip().startswith("/ip4/127.0.0.1/")][0]


def _assert_refused(report: dict):
    assert report["dht_join"].startswith("refused"), report
    assert report["dht_read"].startswith("refused"), report
    assert report["dht_write"].startswith("refused"), report
    assert report["join_group"] == "PROTOCOL_VIOLATION", report
    assert report["upload"] in ("BAD_GROUP_ID", "PROTOCOL_VIOLATION"), report
    assert report["download"].startswith("0 bytes"), report


@pytest.mark.timeout(200)
def test_outsiders_are_refused_everywhere_and_the_members_rounds_are_their_own(private_run):
    from hivemind.p2p import P2P, PeerID

    swarm, info = private_run
    run_dir = info["run_dir"]
    identity = run_dir / "member.key"
    P2P.generate_identity(str(identity))
    member_id = PeerID.from_identity(identity.read_bytes()).to_base58()
    victim = (run_dir / "peer1" / "maddrs.txt").read_text().split()[-1].rsplit("/p2p/", 1)[1]
    reports = _outsiders(info, {"no-secret": {}, "wrong-secret": {"secret": "an old secret"},
                                "member": {"secret": SECRET, "identity": identity},
                                "forger": {"secret": SECRET, "forge": victim}})
    allowed = reports.pop("member")
    # a member cannot write in another member's name: refused by its own node, by the target, and not stored
    forger = reports.pop("forger")
    assert forger["forge"] == "dht store False, direct store [False], not visible"
    # nor revoke another member: the secret alone does not make a revocation in a run with revokers
    assert forger["revoke"] == "direct store [False], not visible", forger
    for case, report in reports.items():
        _assert_refused(report)
    # a holder of the secret: everything works (the probe is real) ...
    assert allowed["dht_join"] == "joined" and allowed["dht_read"].startswith("read"), allowed
    assert allowed["dht_write"] == "written", allowed
    assert allowed["join_group"] != "PROTOCOL_VIOLATION", allowed
    assert not allowed["download"].startswith("0 bytes") and "ACCEPTED" in allowed["download"], allowed

    # `p2p-diloco status` runs while the revocation below goes on (the forgery is checked in its view at the end)
    status = subprocess.Popen([sys.executable, "-m", "p2p_diloco", "status", "--json", "--initial-peers",
                               _bootstrap(info), "--run.run_id=private-test",
                               f"--network.secret_file={info['secret_file']}",
                               "--network.host_maddrs=/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, start_new_session=True)

    # ... until it is revoked, without restarting anyone
    command = [sys.executable, "-m", "p2p_diloco", "revoke", member_id, "--initial-peers", _bootstrap(info),
               *info["access"], "--network.host_maddrs=/ip4/127.0.0.1/tcp/0"]
    # a member (its own key) may not revoke: one line, exit 2, nothing stored
    by_member = subprocess.run([*command, f"--network.identity_path={identity}"], capture_output=True, text=True,
                               timeout=60)
    assert by_member.returncode == 2 and "is not among network.revokers" in by_member.stderr, by_member
    with open(run_dir / "revoke.log", "w") as log:  # the operator, one of the run's revokers, may
        revoke = subprocess.Popen([*command, f"--network.identity_path={run_dir / 'operator.key'}"], stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert revoke.wait(timeout=60) == 0, _log(run_dir, "revoke")
        view, _ = status.communicate(timeout=60)
    finally:
        stop_groups([revoke.pid, status.pid])
    for node in ("bootstrap", "peer0", "peer1"):
        _wait(lambda: member_id in "".join(re.findall(r"revoked peers: .*", _log(run_dir, node))), 40,
              f"{node} to read the revocation")
    revoked = _outsiders(info, {"revoked": {"secret": SECRET, "identity": identity}})["revoked"]
    reports["revoked"] = revoked
    _assert_refused(revoked)

    # every attempt was refused by the members, and named the outsider
    logs = _log(run_dir, "peer0") + _log(run_dir, "bootstrap")
    for case, report in reports.items():
        assert report["peer_id"] in logs, f"{case}: no refusal of {report['peer_id']} logged"
    assert f"refused a join request from {revoked['peer_id']}: revoked" in _log(run_dir, "peer0")

    # nobody took the forged entry (round 999) for peer1's: no repair toward it, not in `p2p-diloco status`
    assert f"ignored a DHT record in the name of {victim}" in _log(run_dir, "peer0")
    assert not any("round 999" in _log(run_dir, n) for n in ("peer0", "peer1")), "a member believed the forgery"
    assert not any(victim in "".join(re.findall(r"revoked peers: .*", _log(run_dir, n)))
                   for n in ("bootstrap", "peer0", "peer1")), "a member's unsigned revocation was taken"
    peers = {p["peer_id"]: p for run in json.loads(view)["runs"] for p in run["peers"]}
    assert victim in peers and peers[victim]["name"] == "peer1" and peers[victim]["round"] < 999, view

    # the members' rounds: all committed by both, with both alone in the group and the same θ_global
    last = max(r["round"] for r in _rounds(run_dir, "peer0"))

    def committed_by_both():  # each member writes its own record of a round: wait for both, after the outsiders
        rounds = {n: {r["round"]: r for r in _rounds(run_dir, n) if r["committed"]} for n in ("peer0", "peer1")}
        common = sorted(set(rounds["peer0"]) & set(rounds["peer1"]))
        return (rounds, common) if len(common) >= 3 and common[-1] > last else None

    committed, both = _wait(committed_by_both, 90, "both members to commit a round after the outsiders")
    for round_ in both:
        a, b = committed["peer0"][round_], committed["peer1"][round_]
        assert sorted(a["outer/peers"]) == ["peer0", "peer1"] == sorted(b["outer/peers"]), (a, b)
        assert a["global_params_sha256"] == b["global_params_sha256"], f"round {round_}: members disagree"
    # no handler of the members' averagers was lost on the way: hivemind references a revocation check's future only
    # weakly and drops a failed group's future while parts wait on it, and the garbage collector destroyed such
    # waiting handlers mid-stream
    for name in ("peer0", "peer1"):
        assert "Task was destroyed but it is pending" not in _log(run_dir, name), _log(run_dir, name)[-3000:]
