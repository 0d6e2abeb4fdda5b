"""The service files (peers/systemd, peers/compose, bootstrap/) parse, and every p2p-diloco command in them is one
the CLI takes: a known command, known flags, config keys that exist with valid values, the config file it names
shipped in the image, and a health check that looks at the folder its peer writes to."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from p2p_diloco.cli import _parser
from p2p_diloco.config import load_config, parse_overrides

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
UNITS = [ROOT / "peers" / "systemd" / "p2p-diloco-peer.service", ROOT / "bootstrap" / "p2p-diloco-bootstrap.service"]
COMPOSE = [ROOT / "peers" / "compose" / "gpu-peer.yml", ROOT / "peers" / "compose" / "cpu-demo.yml",
           ROOT / "bootstrap" / "docker-compose.yml"]
# config paths inside the image or on the host -> the repository's files they are copied from
CONFIGS = {"/opt/p2p-diloco/peers/": ROOT / "peers", "/etc/p2p-diloco/bootstrap.toml": ROOT / "bootstrap" / "bootstrap.toml",
           "/etc/p2p-diloco/peer.toml": ROOT / "peers" / "machine-80gb.toml"}


def _expand(text: str) -> str:
    """Compose's ${VAR:-default} -> default, ${VAR:?message} -> a placeholder, $$ -> $."""
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    return re.sub(r"\$\{\w+:\?[^}]*\}", "placeholder", text).replace("$$", "$")


def _p2p_argv(words: list[str]) -> list[str]:
    """The arguments of the p2p-diloco command in ``words`` (a command line, maybe behind sh -c '... exec')."""
    for i, word in enumerate(words):
        if word == "p2p-diloco" or word.endswith("/p2p-diloco"):
            return words[i + 1:]
    raise AssertionError(f"no p2p-diloco command in {words}")


def _service_argv(service: dict) -> list[str]:
    command = [_expand(c) for c in service["command"]]
    if service.get("entrypoint") == ["sh", "-c"]:
        return _p2p_argv(shlex.split(command[0]))
    return command  # the image's entrypoint is p2p-diloco


def _config_file(path: str) -> Path:
    for prefix, local in CONFIGS.items():
        if path == prefix or path.startswith(prefix) and prefix.endswith("/"):
            found = local / path[len(prefix):] if prefix.endswith("/") else local
            assert found.is_file(), f"{path}: no such file shipped ({found})"
            return found
    raise AssertionError(f"{path}: not a config file the image or the install guide provides")


def check_command(argv: list[str]) -> object:
    """Parse ``argv`` as the CLI does and load its config with its keys; return the parsed arguments."""
    overrides, rest = parse_overrides(argv)
    args, unknown = _parser().parse_known_args(rest)
    assert not unknown, f"{argv[0]}: unknown arguments {unknown}"
    if getattr(args, "reads_config", False):
        config = [str(_config_file(c)) for c in args.config] if args.config else None
        if argv[0] == "bootstrap":
            from p2p_diloco.ops.bootstrap import DEFAULTS

            load_config(config, overrides, defaults=DEFAULTS)
        else:
            load_config(config, overrides)
    return args


def _compose(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["services"]


@pytest.mark.parametrize("path", COMPOSE, ids=lambda p: p.name)
def test_compose_services_run_real_commands_restart_and_check_health(path):
    services = _compose(path)
    for name, service in services.items():
        args = check_command(_service_argv(service))
        assert service.get("restart") in ("on-failure", "unless-stopped", "always"), f"{name}: no restart policy"
        assert service.get("init") is True, f"{name}: SIGTERM must reach the node through an init"
        if args.func.__name__ == "_cmd_peer":
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD" and _p2p_argv(test[1:])[0] == "health", f"{name}: no p2p-diloco health check"
            health = check_command(_p2p_argv(test[1:]))
            assert health.run_dir == args.run_dir, f"{name}: the health check reads another folder than the peer's"


def test_the_cpu_demo_has_a_bootstrap_two_peers_and_the_run_page():
    services = _compose(COMPOSE[1])
    commands = sorted(_service_argv(s)[0] for s in services.values())
    assert commands == ["bootstrap", "peer", "peer", "web"]
    assert "8080:8080" in services["web"]["ports"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_units_run_real_commands_and_verify(unit):
    text = unit.read_text()
    exec_start = re.search(r"^ExecStart=(.+)$", text, re.M).group(1)
    check_command(_p2p_argv(shlex.split(exec_start)))
    assert re.search(r"^Restart=(on-failure|always)$", text, re.M)
    assert re.search(r"^TimeoutStopSec=(\d+)$", text, re.M) and int(re.search(r"^TimeoutStopSec=(\d+)$", text,
                                                                             re.M).group(1)) > 15
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (out.stdout + out.stderr).splitlines()
                if line.strip() and "is not executable: No such file or directory" not in line]  # not installed here
    assert not problems, problems
