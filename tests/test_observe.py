"""Seeing a run and using what it trained: status, export, generate, plot and the metric sinks.

Most tests look at one live 3-peer swarm started once for this module through ``p2p-diloco swarm``: while it
runs, an in-process observer reads the run's view from the DHT (as ``p2p-diloco status`` does) and kills one peer
once it has seen all three agree; after it ends, its folder is exported, sampled and plotted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import tagged_pids
from p2p_diloco.config import NetworkConfig, load_config
from p2p_diloco.ops.checkpoint import CHECKPOINT_NAME as CHECKPOINT
from p2p_diloco.ops.metrics import read_jsonl

pytestmark = pytest.mark.timeout(300)

RUN_ID = "observe/test"  # a character that run ids may hold but DHT prefixes may not
ROUNDS = 6  # the survivors must outlive the killed peer's roster entry by a few rounds
ROSTER_TTL = 6.0  # the swarm's default


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """As the peers run (run.threads=1): on a busy 2-core machine, tiny models run many times faster so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cli(capsys, *args) -> tuple[int, str, str]:
    """``p2p-diloco ARGS`` in this process (transformers is imported once for the module, not once per command)."""
    from p2p_diloco.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@dataclass
class LiveRun:
    run_dir: Path
    lines: list[str] = field(default_factory=list)  # the swarm's stdout
    returncode: int | None = None
    views: list[tuple[float, dict]] = field(default_factory=list)  # (monotonic time, status view)
    killed_at: float | None = None
    status_cli: list[str] = field(default_factory=list)  # JSON lines of `status --watch 1 --json`
    status_cli_rc: int | None = None

    @property
    def stdout(self) -> str:
        return "\n".join(self.lines)

    def records(self, peer: str) -> list[dict]:
        return read_jsonl(self.run_dir / peer / "metrics.jsonl")

    def logged_sha(self, round_: int) -> str:
        shas = {r["global_params_sha256"] for p in ("peer0", "peer1", "peer2") for r in self.records(p)
                if r.get("event") == "round" and r["committed"] and r["round"] == round_}
        assert len(shas) == 1, shas
        return shas.pop()


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, module_process_tag) -> LiveRun:
    run = LiveRun(tmp_path_factory.mktemp("swarm"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2p_diloco", "swarm", "--run-dir", str(run.run_dir), "--peers", "3", "--rounds",
         str(ROUNDS), "--inner-steps", "10", f"--run.run_id={RUN_ID}", "--model.seq_len=64", "--inner.batch_size=4",
         "--data.eval_batches=2", "--averaging.matchmaking_time=5", "--run.tensorboard=true", "--run.export_every=2",
         "--run.export_keep=2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    bootstrap = threading.Event()
    done = threading.Event()

    def read():
        for line in proc.stdout:
            run.lines.append(line.rstrip("\n"))
            if line.startswith("bootstrap node at"):
                bootstrap.set()
            if line.startswith("swarm:"):
                done.set()  # every peer and the bootstrap node are gone; the sample and plots follow
        bootstrap.set()
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert bootstrap.wait(60) and proc.poll() is None, run.stdout
        maddr = run.lines[0].split()[-1]
        _observe(run, maddr, module_process_tag, done)
        run.returncode = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the swarm ends its children itself
            proc.wait(timeout=60)
        reader.join(timeout=10)
    return run


def _observe(run: LiveRun, maddr: str, tag: str, done: threading.Event) -> None:
    """Read the run's view every ~0.5 s until the swarm is done; kill peer2 once all three agree at round >= 1 and
    it has written a checkpoint; meanwhile run the status command itself."""
    from p2p_diloco.net.dht import start_dht
    from p2p_diloco.ops.status import read_status

    dht = start_dht(NetworkConfig(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"]), client_mode=True)
    cli = None
    try:
        while not done.is_set():
            view = read_status(dht, RUN_ID, timeout=3)
            run.views.append((time.monotonic(), view))
            peers = view["runs"][0]["peers"] if view["runs"] else []
            if cli is None and peers:
                cli = threading.Thread(target=_status_cli, args=(run, maddr), daemon=True)
                cli.start()
            if (run.killed_at is None and len(peers) == 3 and min(p["round"] for p in peers) >= 1
                    and {p["state"] for p in peers} == {"agrees"} and (run.run_dir / "peer2" / CHECKPOINT).is_file()):
                _kill_group(tag, "peer2")
                run.killed_at = time.monotonic()
            done.wait(0.5)  # the roster lives in the DHT: there is no event to wait on, so poll
    finally:
        dht.shutdown()
        if cli is not None:
            cli.join(timeout=60)


def _status_cli(run: LiveRun, maddr: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "p2p_diloco", "status", "--initial-peers", maddr,
                             f"--run.run_id={RUN_ID}", "--network.host_maddrs=/ip4/127.0.0.1/tcp/0", "--watch", "1",
                             "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            run.status_cli.append(line)
            if len(run.status_cli) == 2:
                break
    finally:
        proc.send_signal(signal.SIGINT)
        run.status_cli_rc = proc.wait(timeout=30)


def _kill_group(tag: str, name: str) -> None:
    """SIGKILL a peer of the swarm and its helpers (its own process group, which the swarm created for it)."""
    for pid in tagged_pids(tag):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if f"--run.name={name}".encode() in cmdline and os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
                return
        except (OSError, ProcessLookupError):
            continue
    raise AssertionError(f"no process of {name} found")


# ---------------------------------------------------------------------------------------------- status

def test_status_sees_three_agreeing_peers_then_two_after_the_roster_ttl(live_run):
    assert live_run.killed_at is not None, "the observer never saw three peers agree at round >= 1"
    before = [v for t, v in live_run.views if t < live_run.killed_at and v["runs"]]
    three = [v["runs"][0] for v in before if len(v["runs"][0]["peers"]) == 3]
    assert three and three[-1]["agreeing_peers"] == 3
    assert len({p["digest"] for p in three[-1]["peers"]}) == 1
    assert len(before[-1]["runs"]) == 1 and before[-1]["runs"][0]["prefix"].startswith("observe_test_")

    after = [(t - live_run.killed_at, v["runs"][0]) for t, v in live_run.views if t > live_run.killed_at and v["runs"]]
    gone = [(dt, run) for dt, run in after if "peer2" not in {p["name"] for p in run["peers"]}]
    assert gone, "peer2 never left the view"
    dt, run = gone[0]
    # the entry outlives the last heartbeat (at most ttl/3 before the kill) by the TTL: gone after ~4-6 s
    assert 2.0 < dt < ROSTER_TTL + 8, dt
    assert sorted(p["name"] for p in run["peers"]) == ["peer0", "peer1"]
    assert all("peer2" not in {p["name"] for p in r["peers"]} for dt2, r in after if dt2 > dt)
    last = max((r for _, r in after), key=lambda r: r["round"])
    assert last["round"] >= 2 and last["tokens_trained"] > 0
    worker = last["peers"][0]
    assert worker["tokens_per_s"] > 0 and worker["last_bytes"] > 0 and worker["last_allreduce_s"] > 0


def test_status_command_prints_json_while_watching_and_stops_on_ctrl_c(live_run):
    from p2p_diloco.ops.status import render

    assert len(live_run.status_cli) == 2 and live_run.status_cli_rc == 0
    for line in live_run.status_cli:
        view = json.loads(line)
        assert view["run_id"] == RUN_ID and len(view["runs"]) == 1
        assert len(view["runs"][0]["peers"]) >= 2 and "differs" not in {p["state"] for p in view["runs"][0]["peers"]}
    table = render(json.loads(live_run.status_cli[-1]))
    assert "peer0" in table and "agrees" in table and f"run {RUN_ID!r}: round" in table


def test_status_needs_an_initial_peer(capsys):
    code, _, err = _cli(capsys, "status", f"--run.run_id={RUN_ID}")
    assert code == 2 and err.count("\n") == 1 and "--initial-peers" in err


# ---------------------------------------------------------------------------------------------- swarm output

def test_swarm_prints_a_sample_of_the_final_model_and_writes_plots(live_run):
    out = live_run.stdout
    assert live_run.returncode == 1 and "peers that failed: {'peer2': -9}" in out  # the kill was ours
    sample = out.split(f"sample from θ_global of round {ROUNDS}")[1].split("\nplots:")[0].splitlines()[1:]
    # the continuation may break lines early (the model writes newlines too): count every line of the sample
    assert sample[0].startswith("  Return the ") and len("".join(sample)) > len("  Return the ") + 10, sample
    assert "plots: loss.png, timeline.png, rounds.png" in out
    for name in ("loss.png", "timeline.png", "rounds.png"):
        data = (live_run.run_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000, name


def test_plot_command_writes_the_pngs_to_another_folder(live_run, tmp_path, capsys):
    code, out, err = _cli(capsys, "plot", str(live_run.run_dir), "--out", str(tmp_path / "figs"))
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["loss.png", "rounds.png", "timeline.png"]
    assert out.count(".png") == 3
    code, _, err = _cli(capsys, "plot", str(tmp_path / "no-such-run"))
    assert code == 2 and err.count("\n") == 1 and "not found" in err


def test_tensorboard_event_files_hold_every_round(live_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(live_run.run_dir / "peer0" / "tensorboard"))
    events.Reload()
    rounds = [r for r in live_run.records("peer0") if r.get("event") == "round"]  # a failed round keeps its step
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [r["round"] for r in rounds] and loss[-1].step == ROUNDS
    assert [e.value for e in loss] == pytest.approx([r["train/loss"] for r in rounds], rel=1e-6)
    assert sorted({e.step for e in events.Scalars("eval/loss")}) == list(range(0, ROUNDS + 1))
    assert "outer/allreduce_s" in events.Tags()["scalars"]
    assert [e.step for e in events.Tensors("sample/text_summary")] == [ROUNDS]  # the peers' text sample


# ---------------------------------------------------------------------------------------------- export

def test_export_loads_in_transformers_with_the_peers_logits_and_tokens(live_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from p2p_diloco.ops.export import load_global
    from p2p_diloco.train.data import build_data
    from p2p_diloco.train.inner import evaluate
    from p2p_diloco.train.tokenizers import ByteTokenizer

    out = tmp_path / "hf"
    code, stdout, err = _cli(capsys, "export", str(live_run.run_dir), str(out))
    assert code == 0 and f"round {ROUNDS} exported" in stdout, err
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    info = json.loads((out / "p2p_diloco.json").read_text())
    assert info["round"] == ROUNDS and info["global_params_sha256"] == live_run.logged_sha(ROUNDS)

    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    mine = load_global(live_run.run_dir)  # the peer's own model class and θ_global
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x).logits, mine.model(x).logits)
    # the loss the peer itself logged for θ_global of the last round, on the shared held-out batches
    data = build_data(mine.cfg.data, mine.cfg.model.seq_len, mine.cfg.inner.batch_size, "any")
    logged = [r["eval/loss"] for r in live_run.records("peer0") if r.get("round") == ROUNDS and "eval/loss" in r]
    assert evaluate(model, data.eval_batches, torch.device("cpu")) == pytest.approx(logged[0], rel=1e-5)

    tok = AutoTokenizer.from_pretrained(str(out))
    for text in ("Return the value", "Größe — 日本語 🎉\n\ttabs", "\x00\x7f control"):
        assert tok.encode(text) == ByteTokenizer().encode(text)
        assert tok.decode(tok.encode(text)) == text
    generated = pipeline("text-generation", model=str(out))("Return the ", max_new_tokens=8, do_sample=False)
    assert generated[0]["generated_text"].startswith("Return the ")


def test_export_of_an_earlier_round_from_a_checkpoint_or_an_export(live_run, tmp_path):
    from p2p_diloco.config import ConfigError
    from p2p_diloco.ops.export import export_run

    from p2p_diloco.ops.checkpoint import load_checkpoint

    # the killed peer's last checkpoint holds the last round it saved (the kill may land between a commit and its
    # checkpoint); every peer exported every 2nd round
    killed = load_checkpoint(live_run.run_dir / "peer2")["round"]
    assert killed in [r["round"] for r in live_run.records("peer2") if r.get("event") == "round" and r["committed"]]

    def own(peer: str) -> list[int]:
        return sorted(int(f.name.split("-")[1]) for f in (live_run.run_dir / peer / "exports").glob("round-*"))

    # run.export_keep=2: a peer keeps its newest two exports and deletes the older ones, saying which
    assert own("peer0") == own("peer1") == [ROUNDS - 2, ROUNDS]
    deleted = [d for r in live_run.records("peer0") if r.get("event") == "export" for d in r["deleted"]]
    assert deleted == [f"round-{r:06d}" for r in range(2, ROUNDS - 2, 2)]
    saved = sorted({killed, *own("peer0"), *own("peer2")})
    for round_ in {ROUNDS - 2, killed}:
        assert export_run(live_run.run_dir, tmp_path / f"r{round_}", round_) == (round_, tmp_path / f"r{round_}")
        info = json.loads((tmp_path / f"r{round_}" / "p2p_diloco.json").read_text())
        assert info["round"] == round_ and info["global_params_sha256"] == live_run.logged_sha(round_)
    missing = min(set(range(1, ROUNDS)) - set(saved))
    with pytest.raises(ConfigError, match=f"round {missing} not available .*saved rounds: {', '.join(map(str, saved))}"):
        export_run(live_run.run_dir, tmp_path / "missing", missing)
    with pytest.raises(ConfigError, match="not an empty folder"):
        export_run(live_run.run_dir, tmp_path / f"r{ROUNDS - 2}")


@pytest.mark.parametrize("args, message", [
    (["export", "/no/such/run", "out"], "run folder not found"),
    (["generate", "--run-dir", "/no/such/run", "--prompt", "x"], "not found"),
])
def test_export_and_generate_bad_input_exit_2_with_one_line(capsys, args, message):
    code, _, err = _cli(capsys, *args)
    assert code == 2 and err.count("\n") == 1 and message in err, err


# ---------------------------------------------------------------------------------------------- generate

def test_generate_is_seeded_and_reads_runs_and_exported_folders(live_run, tmp_path):
    from p2p_diloco.ops.export import export_run
    from p2p_diloco.ops.generate import load_generator, sample

    run = load_generator(live_run.run_dir)
    first = sample(run, "Return the ", samples=2, max_new_tokens=20, seed=3)
    assert len(first) == 2 and first != ["", ""]
    assert sample(run, "Return the ", samples=2, max_new_tokens=20, seed=3) == first
    assert sample(run, "Return the ", samples=2, max_new_tokens=20, seed=4) != first
    export_run(live_run.run_dir, tmp_path / "hf")
    exported = load_generator(tmp_path / "hf")
    assert exported.source.endswith(f"(round {ROUNDS})")
    assert sample(exported, "Return the ", samples=2, max_new_tokens=20, seed=3) == first


def test_generate_command_prints_samples(live_run, capsys):
    code, out, err = _cli(capsys, "generate", "--run-dir", str(live_run.run_dir), "--prompt", "Return the ",
                          "--samples", "2", "--max-new-tokens", "16")
    assert code == 0, err
    assert out.count("--- sample") == 2 and out.count("\nReturn the ") == 2 and f"θ_global of round {ROUNDS}" in out
    code, _, err = _cli(capsys, "generate", "--run-dir", str(live_run.run_dir), "--prompt", "x", "--samples", "0")
    assert code == 2 and "--samples" in err


# ---------------------------------------------------------------------------------------------- in-process runs

def test_export_with_a_hugging_face_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from p2p_diloco.ops.checkpoint import save_checkpoint
    from p2p_diloco.ops.export import export_run, load_global
    from p2p_diloco.train.model import build_model

    docs = [f"document {i} says the lazy dog sleeps {i % 7} times" for i in range(50)]
    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(docs, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(
        str(tmp_path / "tok"))
    cfg = load_config(overrides={"model.seq_len": "32", "data.tokenizer": str(tmp_path / "tok"), "run.seed": "7"})
    model = build_model(cfg.model, raw.get_vocab_size(), seed=7)
    save_checkpoint(tmp_path / "run", {"round": 3, "global_params": list(model.parameters()),
                                       "config": cfg.to_dict()})  # what export reads of a peer's checkpoint
    assert export_run(tmp_path / "run", tmp_path / "hf") == (3, tmp_path / "hf")

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok.encode("the lazy dog", add_special_tokens=False) == raw.encode("the lazy dog").ids
    assert exported.config.eos_token_id == raw.token_to_id("[EOS]")
    x = torch.tensor([tok.encode("document 3 says the lazy dog", add_special_tokens=False)])
    with torch.no_grad():
        assert torch.equal(exported(x).logits, model.eval()(x).logits)
        assert torch.equal(exported(x).logits, load_global(tmp_path / "run").model(x).logits)


def test_wandb_offline_run_is_written_without_network(tmp_path, monkeypatch, process_tag):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    from p2p_diloco.ops.metrics import build_sink

    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never let wandb try the network in tests
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(overrides={"run.wandb_project": "p2p-diloco-test", "run.tensorboard": "true"})
    sink = build_sink(cfg, tmp_path, "peer0")
    for round_ in range(1, 4):
        sink.log({"event": "round", "round": round_, "train/loss": 5.0 - round_, "committed": True})
    sink.close()  # ends W&B's service process: process_tag checks that nothing is left
    assert [r["round"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    (offline,) = (tmp_path / "wandb").glob("offline-run-*")
    (history,) = offline.glob("run-*.wandb")
    assert b"train/loss" in history.read_bytes()


@pytest.mark.parametrize("key, package", [("run.tensorboard=true", "tensorboard"),
                                          ("run.wandb_project=x", "wandb")])
def test_a_sink_without_its_package_is_a_config_error(monkeypatch, key, package):
    import importlib.util

    from p2p_diloco.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError, match=f"pip install 'p2p-diloco\\[{package}\\]'"):
        load_config(overrides=dict([key.split("=")]))


def test_export_keep_deletes_only_the_oldest_of_the_peers_own_round_folders(tmp_path):
    from p2p_diloco.ops.export import prune_exports

    for name in ("round-000003", "round-000010", "round-000007", "round-notes", "keep-me"):
        (tmp_path / "exports" / name).mkdir(parents=True)
        (tmp_path / "exports" / name / "model.safetensors").write_bytes(b"x")
    (tmp_path / "peer1" / "exports" / "round-000001").mkdir(parents=True)  # another peer's: not this peer's to delete
    assert prune_exports(tmp_path, 0) == []  # 0: keep them all
    assert prune_exports(tmp_path, 2) == [tmp_path / "exports" / "round-000003"]  # by round, not by name or age
    assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == [
        "keep-me", "round-000007", "round-000010", "round-notes"]
    assert (tmp_path / "peer1" / "exports" / "round-000001").is_dir()
    assert prune_exports(tmp_path, 2) == []
