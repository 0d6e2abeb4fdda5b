"""``p2p-diloco``: bootstrap | peer | swarm | status | web | revoke | export | generate | plot | doctor | config. Thin:
parse, build, run, and clean up in ``finally``. The parser and its help: cli_parser.py.

Bad input (unknown key, wrong type, missing file, unreachable initial peer) prints one line and exits with code 2;
what can be checked before a daemon starts (multiaddrs, a taken port, the model, the device: config/preflight.py)
is checked first.
"""

from __future__ import annotations

import difflib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from typing import Optional

from p2p_diloco.cli_parser import build_parser, unrecognized
from p2p_diloco.config import SECTIONS, ConfigError, describe, load_config, parse_overrides, preflight
from p2p_diloco.errors import JoinError
from p2p_diloco.ops.stop import on_stop_signals

USAGE_ERROR = 2


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-V"], ["--version"]):
        print(f"p2p-diloco {version()}")
        return 0
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args = None
    try:
        overrides, rest = parse_overrides(argv)
        args, unknown = parser.parse_known_args(rest)
        args.argv = argv  # for a peer that relaunches itself under torchrun
        if unknown:
            raise ConfigError(unrecognized(unknown, parser, argv[0]))
        if overrides and not getattr(args, "reads_config", True):
            raise ConfigError(f"{argv[0]}: takes no config keys (got --{next(iter(overrides))})")
        code = args.func(args, overrides)
    except (ConfigError, JoinError) as e:
        _fail(str(e))
        code = getattr(e, "exit_code", USAGE_ERROR)  # net/supervise.py NetworkLost: 3, the network stack is gone
    if args is not None and getattr(args, "func", None) is _cmd_peer:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End a peer process without the interpreter's teardown. Peer.close() has saved and fsynced the checkpoint,
    closed the metrics and shut the DHT and averager down; what is left is garbage collection over the objects of
    torch, transformers and hivemind, which took 5 s on an idle 2-core machine and over 30 s on a busy one, so that
    a stopped peer lingered (and a restarted one waited) for that long.

    The one piece of that teardown kept: multiprocessing's temporary folder (``pymp-*``, where torch passes shared
    tensors to the averager's process), which it removes at a normal exit and would otherwise stay in /tmp."""
    tempdir = multiprocessing.current_process()._config.get("tempdir")  # the folder util.get_temp_dir() made
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(message: str) -> None:
    print(f"p2p-diloco: error: {message}", file=sys.stderr)


def version() -> str:
    """The installed package's version (importlib.metadata)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("p2p-diloco")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _parser():
    commands = {"bootstrap": _cmd_bootstrap, "peer": _cmd_peer, "doctor": _cmd_doctor, "swarm": _cmd_swarm,
                "status": _cmd_status, "web": _cmd_web, "export": _cmd_export, "generate": _cmd_generate,
                "revoke": _cmd_revoke, "plot": _cmd_plot, "health": _cmd_health, "config": _cmd_config}
    return build_parser(commands, version())


def _flags_to_keys(args, overrides: dict[str, str], flags: dict[str, str]) -> dict[str, str]:
    """A command's short flags (attribute -> config key) folded into the overrides; one key set twice is refused."""
    overrides = dict(overrides)
    for attr, key in flags.items():
        value = getattr(args, attr, None)
        if value is None:
            continue
        if key in overrides:
            raise ConfigError(f"--{attr.replace('_', '-')} and --{key} set the same key: give one of them")
        overrides[key] = str(value)
    return overrides


def _one_run_dir(args, command: str) -> str:
    """The run folder of export and plot: positional (as before) or --run-dir, once."""
    if args.run_dir is not None and args.run_dir_flag is not None:
        raise ConfigError(f"{command}: give the run folder once, as RUN_DIR or as --run-dir")
    if args.run_dir is None and args.run_dir_flag is None:
        raise ConfigError(f"{command}: needs a run folder: p2p-diloco {command} --run-dir DIR")
    return args.run_dir if args.run_dir is not None else args.run_dir_flag


# ---------------------------------------------------------------------------------------------- commands

def _cmd_bootstrap(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.bootstrap import DEFAULTS, run_bootstrap

    sources: dict[str, str] = {}
    cfg = load_config(args.config, overrides, defaults=DEFAULTS, sources=sources)
    preflight.only_sections("bootstrap", ["network"], sources)
    preflight.check_network(cfg.network)
    _setup_logging("bootstrap")
    stop = threading.Event()
    # nothing to save: the first signal ends the node at once (raised in the main thread, run_bootstrap's finally
    # shuts its DHT down); the DHT's own process ignores the signal (procs.become_child_process)
    _on_stop_signals(stop, started=lambda: False)
    try:
        run_bootstrap(cfg.network, stop, maddrs_file=args.maddrs_file, echo=lambda s: print(s, flush=True))
    except KeyboardInterrupt:
        print("bootstrap node stopped", flush=True)
    return 0


PEER_FLAGS = {"rounds": "run.rounds", "inner_steps": "diloco.inner_steps", "run_dir": "run.run_dir"}


def _cmd_peer(args, overrides: dict[str, str]) -> int:
    if args.initial_peers:
        overrides = {"network.initial_peers": args.initial_peers, **overrides}
    overrides = _flags_to_keys(args, overrides, PEER_FLAGS)
    given: set[str] = set()  # the keys set by files and flags: the run's published settings complete the others
    cfg = load_config(args.config, overrides, given=given)  # bad input fails here, before the slow imports below
    # a rank > 0 of a multi-GPU peer (torchrun) starts no daemon: rank 0 listens on the port, maybe already
    preflight.check_network(cfg.network, listen=int(os.environ.get("RANK") or 0) == 0)
    preflight.check_training(cfg)
    if int(os.environ.get("RANK") or 0) == 0:  # rank 0 alone serves the metrics (metrics.port)
        preflight.check_metrics(cfg.metrics)
    from p2p_diloco.ops import ranks

    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node: must be >= 1, got {args.nproc_per_node}")
        if args.nproc_per_node > 1 and cfg.inner.shard:
            from p2p_diloco.train.shard import check_shardable

            check_shardable(cfg)  # before torchrun: one line and exit 2, not K failed ranks
        command = ranks.torchrun_argv(args.nproc_per_node, args.argv)
        os.execv(command[0], command)
    rank = ranks.rank()
    if rank is not None:
        ranks.as_torchrun_worker()
    if rank:
        _setup_logging(f"{cfg.run.name or 'peer'}/rank{rank}")
        return ranks.run_follower(cfg)
    stop, peer = threading.Event(), None
    # a stop signal ends the peer cleanly once it holds state of its own (it saves it); before, it aborts the start-up
    _on_stop_signals(stop, started=lambda: peer is not None and peer._ready)
    try:
        from p2p_diloco.peer import Peer

        from p2p_diloco.ops.health import pid_file

        peer = Peer(cfg, given=given, stop_event=stop)
        _setup_logging(peer.name)
        with pid_file(peer.run_dir):  # for p2p-diloco health
            try:
                peer.start()
                peer.run()
            finally:
                peer.close()
    except KeyboardInterrupt:
        logging.getLogger("p2p_diloco").info("stopped while starting")
    return 0


def _cmd_doctor(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.doctor import run_doctor

    if args.initial_peers:
        overrides = {"network.initial_peers": args.initial_peers, **overrides}
    cfg = load_config(args.config, _flags_to_keys(args, overrides, {"run_dir": "run.run_dir"}))
    preflight.check_network(cfg.network)
    _setup_logging("doctor", level=logging.WARNING)
    return run_doctor(cfg, echo=lambda s: print(s, flush=True))


def _cmd_swarm(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.swarm import SET_BY_SWARM, demo_defaults, run_swarm, write_peer_config

    for key, flag in SET_BY_SWARM.items():  # per-peer keys
        if key in overrides:
            raise ConfigError(f"{key}: set by the swarm itself; use {flag}" if flag else f"{key}: set by the swarm itself")
    for flag in ("peers", "rounds", "inner_steps"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.chaos is not None and (args.peers < 3 or args.rounds < 6):
        raise ConfigError("--chaos: needs --peers >= 3 and --rounds >= 6")
    if args.kill_each_round is not None:
        if args.chaos is not None:
            raise ConfigError("--kill-each-round: not with --chaos (choose one plan of faults)")
        if args.rounds < 3 or args.peers < args.rounds - 1:
            raise ConfigError(f"--kill-each-round: needs --rounds >= 3 and --peers >= rounds - 1 (one victim per "
                              f"round from round 2 to {args.rounds - 1}), got --peers {args.peers} --rounds {args.rounds}")
    slowdowns = _slowdowns(args.slowdown, args.peers)
    # validate everything before starting a single process; peers then read one effective config file
    cfg = load_config(args.config, overrides, defaults=demo_defaults(args.peers))
    if cfg.metrics.port:
        raise ConfigError("metrics.port: the swarm's peers cannot share one port: run them with p2p-diloco peer, "
                          "each with its own --metrics.port")
    preflight.check_network(cfg.network, listen=False)  # the swarm gives its nodes their addresses
    preflight.check_training(cfg)
    if not args.no_report and cfg.run.sample_every == 0:
        cfg.run.sample_every = args.rounds  # the peers log a text sample of the final θ_global for the report
    peer_args = write_peer_config(args.run_dir, cfg)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # a TERM must end the children too, as Ctrl+C does
    # and SIGINT stops it even where it started ignored (a script's background job), as it stops a peer or bootstrap
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return run_swarm(args.peers, args.rounds, args.inner_steps, args.run_dir, peer_args, timeout=args.timeout,
                     chaos=args.chaos, kill_each_round=args.kill_each_round, slowdowns=slowdowns,
                     echo=lambda s: print(s, flush=True),
                     report=not args.no_report, bootstrap_args=_secret_args(cfg, args.run_dir))


def _secret_args(cfg, run_dir) -> list[str]:
    """A private run's secret, for the swarm's bootstrap node (which reads no peer config): always as a file, a
    0600 one in the run folder for a ``network.secret`` (an argv is readable by every user of the machine)."""
    from p2p_diloco.config.secrets import secret_via_file

    net = secret_via_file(cfg, run_dir).network
    return [f"--network.secret_file={net.secret_file}"] if net.secret_file is not None else []


def _slowdowns(text: Optional[str], peers: int) -> Optional[list[float]]:
    if text is None:
        return None
    try:
        factors = [float(f) for f in text.split(",")]
    except ValueError:
        raise ConfigError(f"--slowdown: expected comma-separated factors >= 1, e.g. 1,1,2,4, got {text!r}") from None
    if len(factors) > peers or any(not f >= 1 for f in factors):
        raise ConfigError(f"--slowdown: expected at most {peers} factors (one per peer), each >= 1, got {text!r}")
    return factors


def _client_config(command: str, args, overrides: dict[str, str]):
    """The config of a DHT client of a live run (status, web): --initial-peers is required and checked."""
    if args.initial_peers:
        overrides = {"network.initial_peers": args.initial_peers, **overrides}
    cfg = load_config(args.config, overrides)
    if not cfg.network.initial_peers:
        raise ConfigError(f"{command}: needs --initial-peers (the multiaddr of any live node of the run)")
    preflight.check_network(cfg.network)
    return cfg


def _cmd_status(args, overrides: dict[str, str]) -> int:
    cfg = _client_config("status", args, overrides)
    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch: must be > 0, got {args.watch}")
    from p2p_diloco.ops.status import run_status

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # stdout carries the view (JSON for scripts)
    stop = threading.Event()
    _on_stop_signals(stop)
    return run_status(cfg, args.watch, args.json, stop, echo=lambda s: print(s, flush=True))


def _cmd_web(args, overrides: dict[str, str]) -> int:
    cfg = _client_config("web", args, overrides)
    if not args.refresh > 0:
        raise ConfigError(f"--refresh: must be > 0, got {args.refresh}")
    from p2p_diloco.ops.web import run_web

    _setup_logging("web", level=logging.WARNING)
    stop = threading.Event()
    _on_stop_signals(stop)
    code = run_web(cfg, args.host, args.port, args.refresh, stop, echo=lambda s: print(s, flush=True))
    _exit_now(code)  # served and stopped: skip the interpreter's seconds of teardown (hivemind, torch)
    return code  # not reached


def _cmd_revoke(args, overrides: dict[str, str]) -> int:
    if args.initial_peers:
        overrides = {"network.initial_peers": args.initial_peers, **overrides}
    cfg = load_config(args.config, overrides)
    preflight.check_network(cfg.network)
    from p2p_diloco.ops.revoke import run_revoke

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return run_revoke(cfg.network, args.peer_id, echo=lambda s: print(s, flush=True))


def _cmd_export(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.export import export_run

    round_, out = export_run(_one_run_dir(args, "export"), args.out, args.round)
    print(f"θ_global of round {round_} exported to {out}: load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def _cmd_generate(args, overrides: dict[str, str]) -> int:
    for flag in ("samples", "max_new_tokens", "top_k"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.temperature <= 0:
        raise ConfigError(f"--temperature: must be > 0, got {args.temperature}")
    from p2p_diloco.ops.generate import run_generate

    run_generate(args.run_dir, args.prompt, args.samples, args.max_new_tokens, args.temperature, args.top_k,
                 args.seed, args.device, echo=print)
    return 0


def _cmd_health(args, overrides: dict[str, str]) -> int:
    if args.max_age is not None and not args.max_age > 0:
        raise ConfigError(f"--max-age: must be > 0 seconds, got {args.max_age}")
    if not os.path.isdir(args.run_dir):
        raise ConfigError(f"--run-dir: {args.run_dir} is not a folder")
    from p2p_diloco.ops.health import check

    verdict = check(args.run_dir, args.max_age)
    print(verdict.reason, flush=True)
    return 0 if verdict.healthy else 1


def _cmd_plot(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.plot import write_plots

    for path in write_plots(_one_run_dir(args, "plot"), args.out):
        print(path)
    return 0


def _cmd_config(args, overrides: dict[str, str]) -> int:
    if args.section is not None and args.section not in SECTIONS:
        close = difflib.get_close_matches(args.section, list(SECTIONS), n=1)
        raise ConfigError(f"config list: no section {args.section!r}: "
                          + (f"did you mean {close[0]}?" if close else f"sections: {', '.join(SECTIONS)}"))
    print(describe(None if args.section is None else [args.section]))
    return 0


# ---------------------------------------------------------------------------------------------- helpers

def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _on_stop_signals(stop: threading.Event, started=lambda: True) -> None:
    """SIGINT and SIGTERM set ``stop`` (before ``started()``: abort); a second one, or a stop stuck for 12 s, ends
    the process at once (ops/stop.py)."""
    on_stop_signals(stop, started)


def _setup_logging(name: str, level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, stream=sys.stdout,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "httpx", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
