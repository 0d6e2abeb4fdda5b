"""What a run leaves on disk and how it is read back (issue 24, findings 9 and 11): checkpoints are read with
``weights_only=True`` (a crafted pickle in a run folder received from someone else is refused with one line, exit
code 2, and never runs), and the run's secret is in no checkpoint, W&B config, swarm peer config or command line."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from p2p_diloco import cli
from p2p_diloco.config import ConfigError, load_config
from p2p_diloco.config.secrets import REDACTED, redacted
from p2p_diloco.ops.checkpoint import CHECKPOINT_NAME, load_checkpoint, read_checkpoint

pytestmark = pytest.mark.timeout(120)
SECRET = "hunter2-correct-horse"


class _Payload:
    """Unpickling this runs ``touch MARKER``: what a crafted checkpoint.pt would do to whoever loads it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _crafted_run(tmp_path):
    run_dir, marker = tmp_path / "received-run", tmp_path / "code-ran"
    run_dir.mkdir()
    torch.save({"round": 3, "params": [torch.zeros(2)], "config": _Payload(marker)}, run_dir / CHECKPOINT_NAME)
    return run_dir, marker


def test_a_crafted_checkpoint_is_refused_and_never_runs(tmp_path, capsys):
    run_dir, marker = _crafted_run(tmp_path)
    with pytest.raises(ConfigError, match="refused: it holds objects other than tensors"):
        load_checkpoint(run_dir)  # a peer resuming from this folder
    for command in (["export", str(run_dir), str(tmp_path / "out")],
                    ["generate", "--run-dir", str(run_dir), "--prompt", "x"]):
        capsys.readouterr()
        assert cli.main(command) == 2, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "refused" in err and CHECKPOINT_NAME in err, err
    assert not marker.exists(), "loading the checkpoint ran its code"


def test_a_file_that_is_no_checkpoint_is_one_line_too(tmp_path):
    (tmp_path / CHECKPOINT_NAME).write_bytes(b"not a checkpoint at all")
    with pytest.raises(ConfigError, match="refused: .* [(]Unsupported operand"):
        load_checkpoint(tmp_path)
    torch.save({"round": 1}, tmp_path / "whole.pt")
    (tmp_path / CHECKPOINT_NAME).write_bytes((tmp_path / "whole.pt").read_bytes()[:100])  # cut short
    with pytest.raises(ConfigError, match="not a readable checkpoint"):
        load_checkpoint(tmp_path)
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="not a checkpoint of this program"):
        read_checkpoint(tmp_path / "list.pt")


def test_a_peers_checkpoint_loads_safely_and_holds_no_secret(tmp_path):
    from test_peer import _peer  # a real Peer with a fake averager (tests/test_peer.py)

    peer, _ = _peer(tmp_path, ["ok"], rounds=1, **{"network.secret": SECRET})
    peer.run()
    peer.close()  # saves checkpoint.pt
    raw = (tmp_path / "run" / CHECKPOINT_NAME).read_bytes()
    assert SECRET.encode() not in raw
    saved = load_checkpoint(tmp_path / "run")  # weights_only=True: everything in it is a tensor or a plain value
    assert saved["round"] == 1 and saved["config"]["network"]["secret"] == REDACTED


def test_configs_for_wandb_keep_no_secret():
    cfg = load_config(overrides={"network.secret": SECRET})
    shown = redacted(cfg.to_dict())
    assert shown["network"]["secret"] == REDACTED and cfg.network.secret == SECRET, "the copy, not the config"
    assert redacted(load_config().to_dict())["network"]["secret"] is None, "no secret: nothing to hide"


def test_a_swarm_gives_its_children_the_secret_in_a_private_file_not_in_argv_or_config(tmp_path):
    from p2p_diloco.ops.swarm import write_peer_config

    cfg = load_config(overrides={"network.secret": SECRET})
    args = write_peer_config(tmp_path, cfg)
    config_file = tmp_path / "peer-config.toml"
    assert args == [f"--config={config_file}"] and SECRET not in config_file.read_text()
    secret_file = tmp_path / "network.secret"
    assert f'secret_file = "{secret_file}"' in config_file.read_text()
    for path in (config_file, secret_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert secret_file.read_text().strip() == SECRET
    assert load_config(str(config_file)).network.secret_file == str(secret_file), "the peers read it back"
    bootstrap = cli._secret_args(cfg, tmp_path)
    assert bootstrap == [f"--network.secret_file={secret_file}"] and SECRET not in " ".join(bootstrap)
