"""``p2p-diloco``: bootstrap | peer | swarm | status | revoke | export | generate | plot | doctor. Thin: parse, build,
run, and clean up in ``finally``.

Bad input (unknown key, wrong type, missing file, unreachable initial peer) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
from typing import Optional

from p2p_diloco.config import ConfigError, describe, load_config, parse_overrides
from p2p_diloco.errors import JoinError

USAGE_ERROR = 2

DESCRIPTION = "Peer-to-peer DiLoCo training over the internet, on hivemind, with bit-identical global parameters."


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
            raise ConfigError(f"unrecognized arguments: {' '.join(unknown)} (config keys look like --section.key=value)")
        if overrides and not getattr(args, "reads_config", True):
            raise ConfigError(f"{argv[0]}: takes no config keys (got --{next(iter(overrides))})")
        code = args.func(args, overrides)
    except (ConfigError, JoinError) as e:
        _fail(str(e))
        code = USAGE_ERROR
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


# ---------------------------------------------------------------------------------------------- parser

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2p-diloco", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run 'p2p-diloco COMMAND --help' for a command's options and config keys.")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    def command(name: str, help_text: str, func, sections: Optional[list[str]],
                defaults: Optional[dict] = None) -> argparse.ArgumentParser:
        if sections == []:  # a command that reads no config
            p = sub.add_parser(name, help=help_text, description=help_text)
        else:
            p = sub.add_parser(name, help=help_text, description=help_text,
                               formatter_class=argparse.RawDescriptionHelpFormatter,
                               epilog="config keys (in a TOML file under [section], or as --section.key=value; "
                                      "'run setting': every peer of a run holds the same value):\n"
                                      + describe(sections, defaults))
            p.add_argument("--config", metavar="FILE", action="append",
                           help="TOML config file; repeat it to layer files (e.g. a run config, then a machine "
                                "config: later files win); --section.key=value flags override them")
        p.set_defaults(func=func, reads_config=sections != [])
        return p

    from p2p_diloco.ops.bootstrap import DEFAULTS as BOOTSTRAP_DEFAULTS
    from p2p_diloco.ops.swarm import DEMO_DEFAULTS

    b = command("bootstrap", "Run a DHT-only bootstrap node that peers use to find each other.", _cmd_bootstrap,
                ["network"], BOOTSTRAP_DEFAULTS)
    b.add_argument("--maddrs-file", metavar="FILE", help="also write the node's multiaddrs to FILE")

    p = command("peer", "Join a run and train: inner AdamW steps, then a fault-tolerant all-reduce every H steps.",
                _cmd_peer, None)
    p.add_argument("--initial-peers", metavar="MADDR[,MADDR]",
                   help="multiaddrs of any live node of the run (same as --network.initial_peers)")
    p.add_argument("--nproc-per-node", type=int, metavar="K",
                   help="run this peer as K processes, one per GPU of this machine (data parallel inside the peer; "
                        "the same as starting it with torchrun --standalone --nproc-per-node K -m p2p_diloco peer)")

    d = command("doctor", "Check this machine's view of a swarm (initial peers, reachability, relay, clock, shared "
                "memory, disk, GPU): one verdict per line, to paste into an issue.", _cmd_doctor, None)
    d.add_argument("--initial-peers", metavar="MADDR[,MADDR]",
                   help="multiaddrs of any live node of the run (same as --network.initial_peers)")

    s = command("swarm", "Run a bootstrap node and N peers on 127.0.0.1 (the demo, and the shape of our tests).",
                _cmd_swarm, None, DEMO_DEFAULTS)
    s.add_argument("--peers", type=int, default=3, help="number of peers (default 3)")
    s.add_argument("--rounds", type=int, default=6, help="rounds to train (default 6)")
    s.add_argument("--inner-steps", type=int, default=30, help="H, inner steps per round (default 30)")
    s.add_argument("--run-dir", default="runs/swarm", help="folder for logs, metrics, checkpoints and summary.json")
    s.add_argument("--timeout", type=float, default=None, help="stop the swarm after this many seconds")
    s.add_argument("--chaos", type=int, default=None, metavar="SEED",
                   help="inject seeded failures: SIGKILLs during an all-reduce, inner steps or matchmaking and "
                        "while serving state, a graceful leave, two joins, a bootstrap kill (needs --peers >= 3, "
                        "--rounds >= 6)")
    s.add_argument("--slowdown", metavar="F[,F...]", default=None,
                   help="fault.slowdown of each peer in turn, e.g. 1,1,2,4: peer i sleeps (F - 1) x each inner "
                        "step's compute time after it, behaving like a machine F times slower (default: all 1)")
    s.add_argument("--no-report", action="store_true",
                   help="skip the text sample from the final θ_global and the plots at the end of the run")

    st = command("status", "Show a live run from the DHT, read-only: each peer's round, digest agreement, speed, "
                 "reachability, last all-reduce; the run's round and tokens.", _cmd_status,
                 ["network", "run", "averaging"])
    st.add_argument("--initial-peers", metavar="MADDR[,MADDR]",
                    help="multiaddrs of any live node of the run (same as --network.initial_peers)")
    st.add_argument("--watch", type=float, nargs="?", const=5.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 5) until Ctrl-C")
    st.add_argument("--json", action="store_true", help="print JSON (one object per refresh) instead of a table")

    e = command("export", "Write θ_global of a run as a Hugging Face folder (config, safetensors, tokenizer).",
                _cmd_export, [])
    e.add_argument("run_dir", metavar="RUN_DIR", help="a peer's run folder, or a swarm's (its peers' folders inside)")
    e.add_argument("out", metavar="OUT", help="folder to write (must not exist, or be empty)")
    e.add_argument("--round", type=int, default=None,
                   help="that round, from a checkpoint at it or a peer's export (run.export_every); default: the "
                        "latest round saved")

    g = command("generate", "Print sampled continuations of a prompt from θ_global of a run or an exported folder.",
                _cmd_generate, [])
    g.add_argument("--run-dir", required=True, metavar="DIR", help="a run folder (peer or swarm) or an exported folder")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--samples", type=int, default=3, help="continuations to draw (default 3)")
    g.add_argument("--max-new-tokens", type=int, default=100, help="tokens per continuation (default 100)")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default 50)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text (default 0)")
    g.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")

    r = command("revoke", "Remove a member from a private run, without restarting it: every node refuses its peer "
                "id within seconds.", _cmd_revoke, ["network"])
    r.add_argument("peer_id", metavar="PEER_ID", help="the peer id to refuse (as in the roster or its log)")
    r.add_argument("--initial-peers", metavar="MADDR[,MADDR]",
                   help="multiaddrs of any live node of the run (same as --network.initial_peers)")

    pl = command("plot", "Draw a run's metrics as PNGs: loss per peer, round timeline, group size and traffic.",
                 _cmd_plot, [])
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a peer's run folder, or a swarm's")
    pl.add_argument("--out", metavar="DIR", default=None, help="folder for the PNGs (default: RUN_DIR)")
    return parser


# ---------------------------------------------------------------------------------------------- commands

def _cmd_bootstrap(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.bootstrap import DEFAULTS, run_bootstrap

    cfg = load_config(args.config, overrides, defaults=DEFAULTS)
    _setup_logging("bootstrap")
    stop = threading.Event()
    _on_stop_signals(stop)  # the DHT's own process resets these to the default (procs.become_child_process)
    run_bootstrap(cfg.network, stop, maddrs_file=args.maddrs_file, echo=lambda s: print(s, flush=True))
    return 0


def _cmd_peer(args, overrides: dict[str, str]) -> int:
    if args.initial_peers:
        overrides = {"network.initial_peers": args.initial_peers, **overrides}
    given: set[str] = set()  # the keys set by files and flags: the run's published settings complete the others
    cfg = load_config(args.config, overrides, given=given)  # bad input fails here, before the slow imports below
    from p2p_diloco.ops import ranks

    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node: must be >= 1, got {args.nproc_per_node}")
        command = ranks.torchrun_argv(args.nproc_per_node, args.argv)
        os.execv(command[0], command)
    rank = ranks.rank()
    if rank is not None:
        ranks.as_torchrun_worker()
    if rank:
        _setup_logging(f"{cfg.run.name or 'peer'}/rank{rank}")
        return ranks.run_follower(cfg)
    from p2p_diloco.peer import Peer

    peer = Peer(cfg, given=given)
    _setup_logging(peer.name)
    try:
        peer.start()
        # hivemind's averager sets SIGINT to "ignore" in this process when it starts: install ours after it
        _on_stop_signals(peer.stop_event)
        peer.run()
    finally:
        peer.close()
    return 0


def _cmd_doctor(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.doctor import run_doctor

    if args.initial_peers:
        overrides = {"network.initial_peers": args.initial_peers, **overrides}
    cfg = load_config(args.config, overrides)
    _setup_logging("doctor", level=logging.WARNING)
    return run_doctor(cfg, echo=lambda s: print(s, flush=True))


def _cmd_swarm(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.swarm import DEMO_DEFAULTS, SET_BY_SWARM, run_swarm, write_peer_config

    for key, flag in SET_BY_SWARM.items():  # per-peer keys
        if key in overrides:
            raise ConfigError(f"{key}: set by the swarm itself; use {flag}" if flag else f"{key}: set by the swarm itself")
    for flag in ("peers", "rounds", "inner_steps"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.chaos is not None and (args.peers < 3 or args.rounds < 6):
        raise ConfigError("--chaos: needs --peers >= 3 and --rounds >= 6")
    slowdowns = _slowdowns(args.slowdown, args.peers)
    # validate everything before starting a single process; peers then read one effective config file
    cfg = load_config(args.config, overrides, defaults=DEMO_DEFAULTS)
    if not args.no_report and cfg.run.sample_every == 0:
        cfg.run.sample_every = args.rounds  # the peers log a text sample of the final θ_global for the report
    peer_args = write_peer_config(args.run_dir, cfg)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # a TERM must end the children too, as Ctrl+C does
    # and SIGINT stops it even where it started ignored (a script's background job), as it stops a peer or bootstrap
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return run_swarm(args.peers, args.rounds, args.inner_steps, args.run_dir, peer_args, timeout=args.timeout,
                     chaos=args.chaos, slowdowns=slowdowns, echo=lambda s: print(s, flush=True),
                     report=not args.no_report, bootstrap_args=_secret_args(cfg.network))


def _secret_args(net) -> list[str]:
    """A private run's secret, for the swarm's bootstrap node (which reads no peer config)."""
    if net.secret_file is not None:
        return [f"--network.secret_file={net.secret_file}"]
    return [f"--network.secret={net.secret}"] if net.secret is not None else []


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


def _cmd_status(args, overrides: dict[str, str]) -> int:
    if args.initial_peers:
        overrides = {"network.initial_peers": args.initial_peers, **overrides}
    cfg = load_config(args.config, overrides)
    if not cfg.network.initial_peers:
        raise ConfigError("status: needs --initial-peers (the multiaddr of any live node of the run)")
    if args.watch is not None and args.watch <= 0:
        raise ConfigError(f"--watch: must be > 0, got {args.watch}")
    from p2p_diloco.ops.status import run_status

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)  # stdout carries the view (JSON for scripts)
    stop = threading.Event()
    _on_stop_signals(stop)
    return run_status(cfg, args.watch, args.json, stop, echo=lambda s: print(s, flush=True))


def _cmd_revoke(args, overrides: dict[str, str]) -> int:
    if args.initial_peers:
        overrides = {"network.initial_peers": args.initial_peers, **overrides}
    cfg = load_config(args.config, overrides)
    from p2p_diloco.ops.revoke import run_revoke

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    return run_revoke(cfg.network, args.peer_id, echo=lambda s: print(s, flush=True))


def _cmd_export(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.export import export_run

    round_, out = export_run(args.run_dir, args.out, args.round)
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


def _cmd_plot(args, overrides: dict[str, str]) -> int:
    from p2p_diloco.ops.plot import write_plots

    for path in write_plots(args.run_dir, args.out):
        print(path)
    return 0


# ---------------------------------------------------------------------------------------------- helpers

def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _on_stop_signals(stop: threading.Event) -> None:
    def handler(signum, frame):
        logging.getLogger("p2p_diloco").info(f"got {signal.Signals(signum).name}: stopping after the current step")
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _setup_logging(name: str, level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, stream=sys.stdout,
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "httpx", "datasets", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
