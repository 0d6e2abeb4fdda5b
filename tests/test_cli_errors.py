"""The errors a newcomer meets (issue 25): each is one line naming the key and the fix, exit code 2, before any
daemon starts, with nothing left running. And --version, --help / --help-all, --run-dir across commands.

The CLI runs here with hivemind made unimportable (``sys.modules['hivemind'] = None``): an error found only after a
DHT started would come out as an ImportError traceback (exit 1) instead; test_the_harness_catches_a_late_error shows
that it does.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version

import pytest

from p2p_diloco import cli
from p2p_diloco.config import SECTIONS, Config, ConfigError, load_config

pytestmark = pytest.mark.timeout(120)

NO_HIVEMIND = ("import sys; sys.modules['hivemind'] = None; from p2p_diloco.cli import main; "
               "sys.exit(main(sys.argv[1:]))")
PEER_ID = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
FAST_S = 20.0  # generous: these errors come in about a second on an idle machine, before torch is imported


def _cli(*args, env=None, timeout=90, module=False):
    """Run the CLI in a session of its own; return its result and wall time (s), once its session is empty."""
    command = [sys.executable, "-m", "p2p_diloco"] if module else [sys.executable, "-c", NO_HIVEMIND]
    start = time.monotonic()
    with subprocess.Popen([*command, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                          env={**os.environ, **(env or {})}) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    elapsed = time.monotonic() - start
    with pytest.raises(ProcessLookupError):  # nothing it started is left running
        os.killpg(proc.pid, 0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), elapsed


def _assert_one_line_error(out, *words: str) -> str:
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2p-diloco: error: "), out.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]
    assert out.stdout == "", out.stdout  # nothing started, nothing logged
    return lines[0]


# ---------------------------------------------------------------------------------------------- the network

@pytest.mark.parametrize("command", [["peer"], ["doctor"], ["status"], ["revoke", PEER_ID]])
def test_an_initial_peer_without_its_peer_id_is_refused_at_once(command, tmp_path):
    out, elapsed = _cli(*command, "--initial-peers", "/ip4/127.0.0.1/tcp/31337", f"--run.run_dir={tmp_path}")
    line = _assert_one_line_error(out, "network.initial_peers", "'/ip4/127.0.0.1/tcp/31337' has no peer id",
                                  "/ip4/127.0.0.1/tcp/31337/p2p/")
    assert "invalid p2p multiaddr" not in line and elapsed < FAST_S


def test_revoke_needs_the_run_to_name_its_revokers_and_the_key_of_one(tmp_path):
    """A member holds the secret, so the secret alone must not revoke (net/security/access.py): nothing starts."""
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    args = ["revoke", PEER_ID, "--initial-peers", f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID}",
            f"--network.secret_file={secret}"]
    out, elapsed = _cli(*args)
    _assert_one_line_error(out, "revoke: this run names no revokers", "--network.revokers=")
    out, _ = _cli(*args, "--network.revokers=not-a-peer-id")
    _assert_one_line_error(out, "network.revokers", "expected Ed25519 peer ids")
    assert elapsed < FAST_S


def test_a_bootstrap_node_pointing_at_another_needs_its_peer_id_too():
    out, _ = _cli("bootstrap", "--network.initial_peers=/dns4/boot.example.org/tcp/31337",
                  "--network.host_maddrs=/ip4/127.0.0.1/tcp/0")
    _assert_one_line_error(out, "network.initial_peers", "append /p2p/<peer id>")


@pytest.mark.parametrize("arg,words", [
    (f"--network.initial_peers=/ip4/1.2.3/tcp/31337/p2p/{PEER_ID}", ["network.initial_peers", "not IPv4"]),
    ("--network.initial_peers=1.2.3.4:31337", ["network.initial_peers", "not a multiaddr", "expected e.g. /ip4/"]),
    ("--network.host_maddrs=/ip4/0.0.0.0/tcp/99999", ["network.host_maddrs", "invalid multiaddr", "range(65536)"]),
    ("--network.announce_maddrs=/ip4/203.0.113.5/tpc/31337", ["network.announce_maddrs", "invalid multiaddr"]),
    ("--network.trusted_relays=/ip4/203.0.113.5/tcp/31337/p2p/QmNotAPeerId", ["network.trusted_relays"]),
])
def test_a_bad_multiaddr_names_its_key_before_the_dht_starts(arg, words, tmp_path):
    out, elapsed = _cli("peer", arg, f"--run.run_dir={tmp_path}")
    _assert_one_line_error(out, *words)
    assert elapsed < FAST_S


@pytest.mark.parametrize("command", ["bootstrap", "peer"])
def test_a_listen_port_in_use_is_named_with_the_fix(command, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out, elapsed = _cli(command, f"--network.host_maddrs=/ip4/127.0.0.1/tcp/{port}",
                            f"--network.identity_path={tmp_path / 'node.key'}")
    _assert_one_line_error(out, "network.host_maddrs", f"port {port} is already in use",
                           f"--network.host_maddrs=/ip4/127.0.0.1/tcp/{port + 1}")
    assert elapsed < FAST_S and not (tmp_path / "node.key").exists()  # no identity made: nothing started


def test_a_port_a_running_node_holds_is_refused_though_p2pd_would_share_it(tmp_path):
    """p2pd listens with SO_REUSEPORT: a second node on the same port would start, and take half the connections
    meant for the first."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    listen = f"--network.host_maddrs=/ip4/127.0.0.1/tcp/{port}"
    first = subprocess.Popen([sys.executable, "-m", "p2p_diloco", "bootstrap", listen,
                              f"--network.identity_path={tmp_path / 'boot.key'}"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        for line in first.stdout:  # blocks until the node listens and prints the join command
            if line.strip().startswith("p2p-diloco peer --initial-peers"):
                break
        out, _ = _cli("bootstrap", listen, f"--network.identity_path={tmp_path / 'other.key'}")
        _assert_one_line_error(out, f"tcp port {port} is already in use")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert first.returncode == 0


# ---------------------------------------------------------------------------------------------- bootstrap

def test_bootstrap_refuses_keys_of_other_sections_from_flags_and_files(tmp_path):
    out, _ = _cli("bootstrap", "--model.name=tiny", "--network.host_maddrs=/ip4/127.0.0.1/tcp/0")
    _assert_one_line_error(out, "bootstrap: reads only [network] keys", "model.name", "the command line")
    run = tmp_path / "run.toml"
    run.write_text('[network]\nhost_maddrs = ["/ip4/127.0.0.1/tcp/0"]\n[inner]\nlr = 0.001\n[run]\nrounds = 3\n')
    out, _ = _cli("bootstrap", "--config", run)
    _assert_one_line_error(out, "inner.lr, run.rounds", str(run))


# ---------------------------------------------------------------------------------------------- the model, the device

def test_an_unknown_preset_fails_before_the_dht_starts(tmp_path):
    out, elapsed = _cli("peer", "--model.name=tiney", f"--run.run_dir={tmp_path}")
    _assert_one_line_error(out, "model.name: no preset or config file 'tiney'", "did you mean tiny?")
    assert elapsed < FAST_S  # the presets are plain data (train/presets.py): no torch import
    out, _ = _cli("swarm", "--model.name=huge", "--run-dir", tmp_path / "swarm")
    _assert_one_line_error(out, "model.name", "presets: tiny")
    assert not (tmp_path / "swarm").exists(), "the swarm must not have started a node"


def test_a_hub_model_that_cannot_be_fetched_offline_names_model_init_from(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}  # an empty cache
    out, elapsed = _cli("peer", "--model.init_from=nosuch-org/nosuch-model", f"--run.run_dir={tmp_path}", env=env)
    line = _assert_one_line_error(out, "model.init_from", "'nosuch-org/nosuch-model' is not in the Hugging Face "
                                  "cache", "huggingface-cli download")
    assert "data.tokenizer" not in line and elapsed < FAST_S
    out, _ = _cli("peer", f"--model.init_from={tmp_path / 'no-such-folder'}", f"--run.run_dir={tmp_path}")
    _assert_one_line_error(out, "model.init_from: no folder")


def test_a_tokenizer_taken_from_model_init_from_names_that_key(tmp_path):
    from p2p_diloco.train.tokenizers import load_tokenizer

    missing = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"^model\.init_from: cannot load .* \(its tokenizer, which "
                                          r"data\.tokenizer='auto' takes\)"):
        load_tokenizer("auto", missing)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: cannot load"):
        load_tokenizer(missing, None)


def test_cuda_without_cuda_fails_before_the_dht_starts(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out, _ = _cli("peer", "--run.device=cuda", f"--run.run_dir={tmp_path}")
    _assert_one_line_error(out, "run.device: 'cuda' requested but CUDA is not available", "--run.device=cpu")


def test_the_harness_catches_a_late_error():
    """A well-formed command gets past the checks and reaches the DHT, where blocked hivemind fails it: exit 1 with
    a traceback, not the exit 2 the tests above see."""
    out, _ = _cli("status", "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}", "--network.join_timeout=1")
    assert out.returncode == 1 and "hivemind" in out.stderr and "Traceback" in out.stderr, out.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- flags and keys

def test_peer_takes_the_short_flags_of_swarm_and_other_commands_name_the_key(tmp_path):
    out, _ = _cli("peer", "--inner-steps", "0", f"--run.run_dir={tmp_path}")
    _assert_one_line_error(out, "diloco.inner_steps: must be > 0")  # --inner-steps is diloco.inner_steps
    out, _ = _cli("peer", "--rounds", "0")
    _assert_one_line_error(out, "run.rounds: must be > 0")
    out, _ = _cli("peer", "--rounds", "3", "--run.rounds=4")
    _assert_one_line_error(out, "--rounds and --run.rounds set the same key")
    out, _ = _cli("doctor", "--inner-steps", "10")
    _assert_one_line_error(out, "unrecognized arguments: --inner-steps 10", "use --diloco.inner_steps")
    out, _ = _cli("peer", "--lr=0.1")
    _assert_one_line_error(out, "--lr: use --inner.lr")
    out, _ = _cli("peer", "--seed", "1")
    _assert_one_line_error(out, "--seed: use --data.seed or --run.seed")
    out, _ = _cli("peer", "--peers", "3")  # swarm's flag for what has no key of a peer
    _assert_one_line_error(out, "--peers: a flag of swarm, not of peer")


def test_a_misspelt_key_gets_a_suggestion_and_the_file_it_came_from(tmp_path):
    out, _ = _cli("peer", "--inner.lrr=0.1")
    _assert_one_line_error(out, "unknown config key 'inner.lrr': did you mean inner.lr?")
    path = tmp_path / "peer.toml"
    path.write_text("[model]\ninner_steps = 10\n")  # the right key in the wrong section
    out, _ = _cli("peer", "--config", path)
    _assert_one_line_error(out, f"{path}: unknown config key 'model.inner_steps': did you mean diloco.inner_steps?")
    with pytest.raises(ConfigError, match="unknown config key 'network.inital_peers': did you mean "
                                          "network.initial_peers"):
        load_config(overrides={"network.inital_peers": "/ip4/1.2.3.4/tcp/1"})


def test_flags_fold_into_their_keys():
    args = type("Args", (), {"rounds": 3, "inner_steps": None, "run_dir": "runs/a"})()
    assert cli._flags_to_keys(args, {"inner.lr": "0.1"}, cli.PEER_FLAGS) == {
        "inner.lr": "0.1", "run.rounds": "3", "run.run_dir": "runs/a"}


# ---------------------------------------------------------------------------------------------- --version, --help

def test_version_prints_the_package_version():
    out, _ = _cli("--version", module=True)
    assert out.returncode == 0 and out.stdout.strip() == f"p2p-diloco {version('p2p-diloco')}", out


@pytest.mark.parametrize("command", ["peer", "doctor", "swarm"])
def test_help_is_short_and_help_all_has_every_key(command):
    short, _ = _cli(command, "--help", module=True)
    assert short.returncode == 0 and len(short.stdout.splitlines()) < 60, short.stdout
    assert "--model.name=tiny" in short.stdout and "--help-all" in short.stdout
    assert "--fault." not in short.stdout and "[fault]" not in short.stdout.replace("testing-only [fault]", "")
    full, _ = _cli(command, "--help-all", module=True)
    assert full.returncode == 0
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(Config(), section)):
            assert f"--{section}.{f.name}=" in full.stdout, f"{section}.{f.name} missing from --help-all"
    assert "[fault]  Testing only" in full.stdout


def test_config_list_shows_a_section_or_every_key():
    out, _ = _cli("config", "list", "fault", module=True)
    assert out.returncode == 0 and out.stdout.startswith("[fault]") and "--fault.inject=" in out.stdout
    assert "--run." not in out.stdout
    out, _ = _cli("config", "list", "nettwork", module=True)
    _assert_one_line_error(out, "no section 'nettwork': did you mean network?")


# ---------------------------------------------------------------------------------------------- --run-dir

@pytest.mark.parametrize("command,extra,option,message", [
    ("export", ["OUT"], ["--round", "1"], "no checkpoint or export in"),
    ("plot", [], ["--out", "figs"], "no metrics.jsonl in"),
])
def test_export_and_plot_take_the_run_folder_either_way(command, extra, option, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    extra = [str(tmp_path / e) for e in extra]
    for args in ([str(run_dir), *extra], ["--run-dir", str(run_dir), *extra], [*extra, "--run-dir", str(run_dir)],
                 [str(run_dir), *option, *extra]):  # as before: an option between the positionals
        assert cli.main([command, *args]) == 2
        err = capsys.readouterr().err
        assert f"{message} {run_dir}" in err and err.count("\n") == 1, err
    assert cli.main([command, str(run_dir), "--run-dir", str(run_dir), *extra]) == 2
    assert "give the run folder once" in capsys.readouterr().err
    assert cli.main([command, *extra]) == 2
    assert f"p2p-diloco {command} --run-dir DIR" in capsys.readouterr().err


def test_run_dir_names_the_run_folder_of_peer_and_doctor():
    for command in ("peer", "doctor"):
        out, _ = _cli(command, "--run-dir", "runs/a", "--run.run_dir=runs/b")
        _assert_one_line_error(out, "--run-dir and --run.run_dir set the same key")


def test_a_prefix_of_a_flag_is_refused_not_taken_for_the_flag():
    """argparse takes a unique prefix for the whole flag by default: 'peer --inner-step 3' started a real peer."""
    out, _ = _cli("peer", "--inner-step", "3")
    _assert_one_line_error(out, "--inner-step", "did you mean --inner-steps")
