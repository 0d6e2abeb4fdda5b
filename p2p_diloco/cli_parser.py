"""The argument parser of ``p2p-diloco``: its commands, their flags, and their help.

A command's ``--help`` shows its own flags and the most-used config keys (config.COMMON_KEYS); ``--help-all`` shows
every key, the testing-only [fault] section included (only there). Unknown flags are answered with the config key
or the flag they most likely meant.
"""

from __future__ import annotations

import argparse
import difflib
import textwrap
from typing import Optional

from p2p_diloco.config import COMMON_KEYS, TESTING_SECTIONS, SECTIONS, describe, suggest_keys

DESCRIPTION = "Peer-to-peer DiLoCo training over the internet, on hivemind, with bit-identical global parameters."
KEYS_INTRO = ("in a TOML file under [section], or as --section.key=value; 'run setting': every peer of a run holds "
              "the same value")


class CommandParser(argparse.ArgumentParser):
    """A command's parser. Its epilog, the config keys, is written when help is printed: the most-used keys, or
    (after ``--help-all``) every key."""

    def __init__(self, *args, **kwargs):
        # no prefixes of flags: 'peer --inner-step 3' must be refused with a hint, not taken as --inner-steps
        super().__init__(*args, allow_abbrev=False, **kwargs)

    key_sections: Optional[list[str]] = []  # [] reads no config; None: every section
    key_defaults: Optional[dict] = None     # the command's own defaults, shown as the keys' defaults
    key_exclude: tuple = ()                 # keys the command sets itself (swarm)
    show_all = False
    intermixed = False  # positionals may sit on either side of options (a first positional that is optional)
    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        # argparse alone gives an optional first positional the first chunk of positionals it meets, so that
        # 'export RUN_DIR --round 3 OUT' would leave OUT over: collect the positionals around the options first
        if not self.intermixed or self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False

    def format_help(self) -> str:
        if self.key_sections != []:
            self.epilog = self._keys_help()
        return super().format_help()

    def _keys_help(self) -> str:
        command = self.prog.rpartition(" ")[2]
        if self.show_all:
            return f"config keys ({KEYS_INTRO}):\n" + describe(self.key_sections, self.key_defaults)
        keys = [k for k in COMMON_KEYS if k not in self.key_exclude
                and (self.key_sections is None or k.partition(".")[0] in self.key_sections)]
        return (f"most-used config keys, with their defaults (every key, its type, unit and full help: "
                f"p2p-diloco {command} --help-all,\nor p2p-diloco config list [SECTION]); in a TOML file under "
                f"[section], or as --section.key=value:\n" + describe(self.key_sections, self.key_defaults, keys=keys))


class _HelpAll(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="show every config key (testing-only " + ", ".join(f"[{s}]" for s in TESTING_SECTIONS)
                              + " included) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        parser.show_all = True
        parser.print_help()
        parser.exit()


def build_parser(commands, version: str) -> argparse.ArgumentParser:
    """``commands``: name -> the function running it (cli.py's ``_cmd_*``)."""
    parser = argparse.ArgumentParser(prog="p2p-diloco", description=DESCRIPTION, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run 'p2p-diloco COMMAND --help' for a command's options and its most-used "
                                            "config keys, 'p2p-diloco config list' for every key.")
    parser.add_argument("-V", "--version", action="version", version=f"p2p-diloco {version}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=CommandParser)

    def command(name: str, help_text: str, sections: Optional[list[str]], defaults: Optional[dict] = None,
                exclude: tuple = ()) -> CommandParser:
        if sections == []:  # a command that reads no config
            p = sub.add_parser(name, help=help_text, description=help_text)
        else:
            p = sub.add_parser(name, help=help_text, description=textwrap.fill(help_text, 110),
                               formatter_class=argparse.RawDescriptionHelpFormatter)
            p.key_sections, p.key_defaults, p.key_exclude = sections, defaults, exclude
            p.add_argument("--help-all", action=_HelpAll)
            p.add_argument("--config", metavar="FILE", action="append",
                           help="TOML config file; repeat it to layer files (e.g. a run config, then a machine "
                                "config: later files win); --section.key=value flags override them")
        p.set_defaults(func=commands[name], reads_config=sections != [])
        return p

    from p2p_diloco.ops.bootstrap import DEFAULTS as BOOTSTRAP_DEFAULTS
    from p2p_diloco.ops.swarm import DEMO_DEFAULTS, SET_BY_SWARM

    b = command("bootstrap", "Run a DHT-only bootstrap node that peers use to find each other (reads only "
                "[network] keys).", ["network"], BOOTSTRAP_DEFAULTS)
    b.add_argument("--maddrs-file", metavar="FILE", help="also write the node's multiaddrs to FILE")

    p = command("peer", "Join a run and train: inner AdamW steps, then a fault-tolerant all-reduce every H steps.",
                None)
    _initial_peers(p)
    p.add_argument("--nproc-per-node", type=int, metavar="K",
                   help="run this peer as K processes, one per GPU of this machine (data parallel inside the peer; "
                        "the same as starting it with torchrun --standalone --nproc-per-node K -m p2p_diloco peer)")
    p.add_argument("--rounds", type=int, metavar="N", help="rounds to train (same as --run.rounds)")
    p.add_argument("--inner-steps", type=int, metavar="H", help="inner steps per round (same as --diloco.inner_steps)")
    _run_dir(p, "this peer's folder for metrics and checkpoints (same as --run.run_dir)")

    d = command("doctor", "Check this machine's view of a swarm (initial peers, reachability, relay, clock, shared "
                "memory, disk, GPU): one verdict per line, to paste into an issue.", None)
    _initial_peers(d)
    _run_dir(d, "the run folder whose disk space to check (same as --run.run_dir)")

    s = command("swarm", "Run a bootstrap node and N peers on 127.0.0.1 (the demo, and the shape of our tests).",
                None, DEMO_DEFAULTS, exclude=tuple(SET_BY_SWARM))
    s.add_argument("--peers", type=int, default=3, help="number of peers (default 3; beyond 16, the defaults of "
                   "averaging.roster_ttl, request_timeout and matchmaking_time become 30, 10 and 30 s)")
    s.add_argument("--rounds", type=int, default=6, help="rounds to train (default 6)")
    s.add_argument("--inner-steps", type=int, default=30, help="H, inner steps per round (default 30)")
    s.add_argument("--run-dir", default="runs/swarm", metavar="DIR",
                   help="folder for logs, metrics, checkpoints and summary.json (default runs/swarm)")
    s.add_argument("--timeout", type=float, default=None, help="stop the swarm after this many seconds")
    s.add_argument("--chaos", type=int, default=None, metavar="SEED",
                   help="inject seeded failures: SIGKILLs during an all-reduce, inner steps or matchmaking and "
                        "while serving state, a graceful leave, two joins, a bootstrap kill (needs --peers >= 3, "
                        "--rounds >= 6)")
    s.add_argument("--kill-each-round", type=int, default=None, metavar="SEED",
                   help="from round 2 to the one before the last, SIGKILL one member per round at a seeded phase "
                        "(inner, matchmaking, sending, allreduce, checks) and start a fresh peer in its place "
                        "(needs --rounds >= 3, --peers >= rounds - 1)")
    s.add_argument("--slowdown", metavar="F[,F...]", default=None,
                   help="fault.slowdown of each peer in turn, e.g. 1,1,2,4: peer i sleeps (F - 1) x each inner "
                        "step's compute time after it, behaving like a machine F times slower (default: all 1)")
    s.add_argument("--no-report", action="store_true",
                   help="skip the text sample from the final θ_global and the plots at the end of the run")

    st = command("status", "Show a live run from the DHT, read-only: each peer's round, digest agreement, speed, "
                 "reachability, last all-reduce; the run's round and tokens.", ["network", "run", "averaging"])
    _initial_peers(st)
    st.add_argument("--watch", type=float, nargs="?", const=5.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 5) until Ctrl-C")
    st.add_argument("--json", action="store_true", help="print JSON (one object per refresh) instead of a table")

    w = command("web", "Serve a live run's page and JSON API (/api/run) from the DHT, read-only: settings, peers, "
                "rounds and forks, refreshed live; assets ship in the package (works offline).",
                ["network", "run", "averaging"])
    _initial_peers(w)
    w.add_argument("--host", default="127.0.0.1",
                   help="address to serve the page on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    w.add_argument("--port", type=int, default=8080, help="port to serve the page on (default 8080; 0: any free port)")
    w.add_argument("--refresh", type=float, default=3.0, metavar="SECONDS",
                   help="read the run from the DHT every SECONDS (default 3)")

    e = command("export", "Write θ_global of a run as a Hugging Face folder (config, safetensors, tokenizer).", [])
    e.add_argument("run_dir", metavar="RUN_DIR", nargs="?",
                   help="a peer's run folder, or a swarm's (its peers' folders inside); or --run-dir")
    e.add_argument("out", metavar="OUT", help="folder to write (must not exist, or be empty)")
    _run_dir(e, "the run folder (instead of RUN_DIR)", dest="run_dir_flag")
    e.intermixed = True
    e.add_argument("--round", type=int, default=None,
                   help="that round, from a checkpoint at it or a peer's export (run.export_every); default: the "
                        "latest round saved")

    g = command("generate", "Print sampled continuations of a prompt from θ_global of a run or an exported folder.",
                [])
    g.add_argument("--run-dir", required=True, metavar="DIR", help="a run folder (peer or swarm) or an exported folder")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--samples", type=int, default=3, help="continuations to draw (default 3)")
    g.add_argument("--max-new-tokens", type=int, default=100, help="tokens per continuation (default 100)")
    g.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    g.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default 50)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text (default 0)")
    g.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")

    r = command("revoke", "Remove a member from a private run, without restarting it: every node refuses its peer "
                "id within seconds.", ["network"])
    r.add_argument("peer_id", metavar="PEER_ID", help="the peer id to refuse (as in the roster or its log)")
    _initial_peers(r)

    pl = command("plot", "Draw a run's metrics as PNGs: loss per peer, round timeline, group size and traffic.", [])
    pl.add_argument("run_dir", metavar="RUN_DIR", nargs="?", help="a peer's run folder, or a swarm's; or --run-dir")
    _run_dir(pl, "the run folder (instead of RUN_DIR)", dest="run_dir_flag")
    pl.intermixed = True
    pl.add_argument("--out", metavar="DIR", default=None, help="folder for the PNGs (default: the run folder)")

    h = command("health", "Exit 0 if the peer of a run folder is alive and in the run (its last committed round is "
                "recent), else print why and exit 1: for a container HEALTHCHECK or a Kubernetes probe. Reads the "
                "folder only (peer.pid, metrics.jsonl): no network, well under a second.", [])
    h.add_argument("--run-dir", required=True, metavar="DIR", help="the peer's run folder (its run.run_dir)")
    h.add_argument("--max-age", type=float, default=None, metavar="SECONDS",
                   help="longest time since the peer's last committed round, or its start (default: 5 x its recent "
                        "rounds' median time, at least 120 s; 900 s before it has timed a round)")

    c = command("config", "List the config keys: type, default, unit, whether a run setting, and help.", [])
    c.add_argument("action", choices=["list"], help="list: print the keys")
    c.add_argument("section", nargs="?", metavar="SECTION", help=f"only this section ({', '.join(SECTIONS)})")
    return parser


def _initial_peers(p: argparse.ArgumentParser) -> None:
    p.add_argument("--initial-peers", metavar="MADDR[,MADDR]",
                   help="multiaddrs of any live node of the run, each ending in /p2p/<peer id> (same as "
                        "--network.initial_peers)")


def _run_dir(p: argparse.ArgumentParser, help_text: str, dest: str = "run_dir") -> None:
    p.add_argument("--run-dir", metavar="DIR", dest=dest, default=None, help=help_text)


def unrecognized(unknown: list[str], parser: argparse.ArgumentParser, command: str) -> str:
    """The message for arguments no parser took, with what each flag most likely meant: a flag of the command
    (difflib), the config key of that name (``--inner-steps`` -> ``--diloco.inner_steps``), or another command."""
    hints = []
    own = command_parser(parser, command)
    flags = [] if own is None else [f for f in own._option_string_actions if f.startswith("--")]
    for arg in unknown:
        if not arg.startswith("--"):
            continue
        flag = arg.partition("=")[0]
        close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.8)
        keys = suggest_keys(flag[2:])
        elsewhere = [name for name, p in _commands(parser).items() if flag in p._option_string_actions]
        if close:
            hints.append(f"{flag}: did you mean {close[0]}?")
        elif keys:
            hints.append(f"{flag}: use " + " or ".join(f"--{key}" for key in keys))
        elif elsewhere:
            hints.append(f"{flag}: a flag of {' and '.join(elsewhere)}, not of {command}")
    text = f"unrecognized arguments: {' '.join(unknown)}"
    return text + (f" ({'; '.join(hints)})" if hints else " (config keys look like --section.key=value)")


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_parser(parser: argparse.ArgumentParser, name: str) -> Optional[argparse.ArgumentParser]:
    """The sub-parser of command ``name``, or None."""
    return _commands(parser).get(name)
