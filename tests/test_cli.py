"""Command line: bad input gives one clear line and exit code 2; the bootstrap node keeps its identity."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time

import pytest

from p2p_diloco.config import SECTIONS, Config, ConfigError, dump_toml, load_config, parse_overrides

pytestmark = pytest.mark.timeout(120)


def _cli(*args, timeout=90):
    return subprocess.run([sys.executable, "-m", "p2p_diloco", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------------------------------------- config, in-process

def test_overrides_are_typed_and_layered(tmp_path):
    path = tmp_path / "peer.toml"
    path.write_text('[inner]\nlr = 0.002\nbatch_size = 4\n[network]\ninitial_peers = ["/ip4/1.2.3.4/tcp/1"]\n')
    overrides, rest = parse_overrides(["--inner.lr=3e-3", "--run.rounds", "none", "--other"])
    assert rest == ["--other"]
    cfg = load_config(path, overrides, defaults={"inner.batch_size": 16, "inner.grad_accum": 2})
    assert cfg.inner.lr == 3e-3            # command line beats file
    assert cfg.inner.batch_size == 4       # file beats a subcommand's defaults
    assert cfg.inner.grad_accum == 2       # a subcommand's defaults beat field defaults
    assert cfg.run.rounds is None and cfg.network.initial_peers == ["/ip4/1.2.3.4/tcp/1"]


def test_dumped_config_reads_back_equal(tmp_path):
    cfg = load_config(overrides={"inner.grad_clip": "none", "network.initial_peers": "/a/b,/c/d", "run.rounds": "7"})
    (tmp_path / "c.toml").write_text(dump_toml(cfg))
    assert load_config(tmp_path / "c.toml") == cfg


@pytest.mark.parametrize("overrides,message", [
    ({"model.foo": "1"}, "unknown config key 'model.foo'"),
    ({"nosuch.key": "1"}, "unknown config key 'nosuch.key'"),
    ({"inner.lr": "fast"}, "inner.lr: expected float"),
    ({"inner.batch_size": "1.5"}, "inner.batch_size: expected int"),
    ({"inner.lr": "-1"}, "inner.lr: must be > 0"),
    ({"averaging.codec": "int3"}, "averaging.codec: expected one of"),
    ({"data.streaming": "maybe"}, "data.streaming: expected bool"),
    ({"averaging.min_group_size": "8", "averaging.target_group_size": "4"}, "averaging.min_group_size"),
    ({"diloco.overlap_steps": "2"}, "diloco.overlap_steps: settling after 2 inner steps needs diloco.overlap=delayed"),
    ({"diloco.overlap": "eager", "diloco.overlap_steps": "1"}, "needs diloco.overlap=delayed, not eager"),
    ({"diloco.overlap": "delayed", "diloco.overlap_steps": "-1"}, "diloco.overlap_steps: must be >= 0"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(overrides=overrides)


def test_toml_types_are_checked(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[inner]\nbatch_size = "eight"\n')
    with pytest.raises(ConfigError, match="inner.batch_size: expected int"):
        load_config(path)


# ---------------------------------------------------------------------------------------------- the real CLI

@pytest.mark.parametrize("args,message", [
    (["peer", "--model.foo=1"], "unknown config key 'model.foo'"),
    (["peer", "--inner.lr=abc"], "inner.lr: expected float"),
    (["peer", "--config=/nonexistent/peer.toml"], "config file not found"),
    (["swarm", "--run.rounds=3"], "use --rounds"),
    (["swarm", "--fault.slowdown=2"], "use --slowdown"),
    (["swarm", "--peers", "2", "--slowdown", "1,2,4"], "--slowdown: expected at most 2 factors"),
    (["peer", "--diloco.outer_optimizer=delayed_nesterov"], "diloco.dn_delay: required"),
    (["peer", "--bogus"], "unrecognized arguments: --bogus"),
    (["doctor", "--network.reachability=maybe"], "network.reachability: expected one of auto, public, private"),
    (["peer", "--network.trusted_relays=relay.example:31337"], "network.trusted_relays: expected multiaddrs"),
    (["peer", "--nproc-per-node", "0"], "--nproc-per-node: must be >= 1"),
    (["peer", "--diloco.overlap=eager", "--diloco.overlap_steps=5"], "diloco.overlap_steps: settling after 5"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    out = _cli(*args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_an_unusable_identity_file_exits_2_with_one_line(tmp_path):
    (tmp_path / "bad.key").write_bytes(b"not a libp2p key")
    out = _cli("bootstrap", f"--network.identity_path={tmp_path / 'bad.key'}",
               "--network.host_maddrs=/ip4/127.0.0.1/tcp/0")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (f"p2p-diloco: error: network.identity_path: {tmp_path / 'bad.key'}: "
                                                   f"not a libp2p key protobuf"), out.stderr


def test_missing_model_config_exits_2(tmp_path):
    out = _cli("peer", f"--model.name={tmp_path / 'nope' / 'config.json'}", f"--run.run_dir={tmp_path / 'run'}",
               "--run.progress=false")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("p2p-diloco: error: model.name:"), out.stderr


def test_unreachable_initial_peer_exits_2_after_a_bounded_wait(tmp_path, process_tag):
    # a well-formed address where nobody listens (port 9 on loopback: discard, closed here)
    maddr = "/ip4/127.0.0.1/tcp/9/p2p/QmeLscqEuVK2ZqAiEZvKUnFSVK4PaRKQRMsvGvfLDoCEVw"
    start = time.monotonic()
    out = _cli("peer", "--initial-peers", maddr, "--network.join_timeout=10", f"--run.run_dir={tmp_path}",
               "--network.host_maddrs=/ip4/127.0.0.1/tcp/0", "--run.progress=false")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "p2p-diloco: error:" in out.stderr.strip().splitlines()[-1]
    assert time.monotonic() - start < 60


def test_help_all_lists_every_key_with_its_default():
    out = _cli("peer", "--help-all")  # --help shows the most-used keys only (test_cli_errors.py)
    assert out.returncode == 0
    defaults = Config()
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(defaults, section)):
            assert f"--{section}.{f.name}=" in out.stdout, f"{section}.{f.name} missing from --help"
    assert "[s]" in out.stdout and "[inner steps]" in out.stdout  # units are shown


def test_bootstrap_keeps_its_identity_and_stops_on_sigterm(tmp_path, process_tag):
    ids = []
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-m", "p2p_diloco", "bootstrap",
                                 "--network.host_maddrs=/ip4/127.0.0.1/tcp/0",
                                 f"--network.identity_path={tmp_path / 'keys' / 'boot.key'}"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:  # blocks until the node prints its addresses and the join command
            lines.append(line)
            if line.strip().startswith("p2p-diloco peer --initial-peers"):
                break
        assert any("/p2p/" in line for line in lines), "".join(lines)
        ids.append(lines[-1].strip().rsplit("/p2p/", 1)[1])
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, rest
    assert ids[0] == ids[1], "the bootstrap node must keep its peer id across restarts"
