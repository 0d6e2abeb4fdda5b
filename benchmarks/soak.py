"""Soak: a bootstrap node and 4 peers on 127.0.0.1 (the demo's tiny model) training round after round for
``--minutes``, with a fault every minute drawn in a seeded rotation (benchmarks/soak_report.py ``plan_faults``):

* ``kill_restart``: SIGKILL to a peer's whole process group, then the peer restarted on the same run folder (it
  resumes from its checkpoint);
* ``kill_p2pd``: SIGKILL to the peer's ``p2pd`` (the Go daemon its DHT process started);
* ``kill_dht``: SIGKILL to the peer's DHT child process (the parent of its p2pd);
* ``term_restart``: SIGTERM to the peer's process group (SIGKILL after ``--stop-grace`` s), then a restart.

After the faults' minutes come ``--quiet-min`` minutes without any (default 2), so that the end is measured on a
settled swarm: a fault on one peer moves the others' descriptors for a minute (its state download, their new
connections), and the last fault would otherwise fall in the end's window.

A peer that exits by itself (for example after a helper died) is restarted too, and the exit is recorded. Every
``--sample-every`` seconds, per peer: resident memory, open descriptors and threads of all its processes together
(the main process and every descendant, read from /proc) and of the main process alone; its run folder's size
(metrics.jsonl and checkpoint apart) and its log's; the helper restarts its log reports (net/supervise.py) and its
rounds committed and attempted (metrics.jsonl). Everything goes to ``--out`` as JSON lines as it happens; at the end
the table per peer (start against end after warm-up) and the verdict are printed. Every process group started is
ended by PID, and the temporary folder removed, at the end and on Ctrl-C or SIGTERM. Run:

    python benchmarks/soak.py --minutes 20 --out benchmarks/results/soak.jsonl
    python benchmarks/soak.py --minutes 3 --out /tmp/soak-quick.jsonl      # a quick check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from common import demo_config
from soak_report import (count_restarts, count_rounds, fd_kind, parse_stat, parse_status, plan_faults, report,
                         summary_lines)

from p2p_diloco.ops.metrics import read_jsonl
from p2p_diloco.ops.procs import group_members
from p2p_diloco.ops.swarm import LocalSwarm, write_peer_config

CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------- /proc
def read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the process is gone
        return None


def process_table() -> dict[int, dict]:
    """Every live process: pid → its stat fields (zombies left out)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            text = read(f"/proc/{entry}/stat")
            if text is not None:
                stat = parse_stat(text)
                if stat["state"] != "Z":
                    table[int(entry)] = stat
    return table


def descendants(pid: int, table: dict[int, dict]) -> list[int]:
    children: dict[int, list[int]] = {}
    for p, stat in table.items():
        children.setdefault(stat["ppid"], []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def is_p2pd(pid: int) -> bool:
    return "p2pd" in (read(f"/proc/{pid}/cmdline") or "")


def usage(pid: int, shm: Optional[dict] = None, kinds: bool = False) -> dict:
    """RSS, threads and open descriptors of one process; with ``shm``, note in it (inode → bytes) the files of
    /dev/shm its descriptors hold: torch's shared tensors live there (deleted files, so in nobody's RSS until
    mapped), and they stay allocated as long as a descriptor holds them. With ``kinds``, its descriptors by kind
    (``fd_kinds``: socket, pipe, shm, file, other): what grew, when something did."""
    status = read(f"/proc/{pid}/status")
    out = parse_status(status) if status else {"rss_bytes": 0, "threads": 0}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    out["fds"] = len(fds)
    counts: dict[str, int] = {}
    for fd in fds if shm is not None or kinds else ():
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/dev/shm/") and shm is not None:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                shm[st.st_ino] = st.st_size
        except OSError:  # closed meanwhile
            continue
        kind = fd_kind(target)
        counts[kind] = counts.get(kind, 0) + 1
    if kinds:
        out["fd_kinds"] = counts
    return out


def tree_usage(pids: list[int]) -> dict:
    total = {"rss_bytes": 0, "threads": 0, "fds": 0, "procs": len(pids)}
    shm: dict[int, int] = {}
    for pid in pids:
        for key, value in usage(pid, shm).items():
            total[key] += value
    total["shm_bytes"], total["shm_files"] = sum(shm.values()), len(shm)  # each file once, however many hold it
    return total


def helpers(pid: int, table: dict[int, dict], known_dht: Optional[int] = None) -> tuple[Optional[int], Optional[int]]:
    """(the DHT child, its p2pd) of a peer's main process: the p2pd among its descendants and the process above
    it. Without a p2pd (killed, and not restarted), ``known_dht`` (the DHT child seen before) if it still lives: the
    averager is forked from the same command line, so nothing else tells the two apart."""
    below = descendants(pid, table)
    p2pd = next((p for p in below if is_p2pd(p)), None)
    dht = table[p2pd]["ppid"] if p2pd is not None else known_dht
    return (dht if dht in table and table[dht]["ppid"] == pid else None), p2pd


def uptime_s(pid: int, table: dict[int, dict]) -> float:
    boot_s = float(read("/proc/uptime").split()[0])
    return boot_s - table[pid]["starttime"] / CLK_TCK if pid in table else 0.0


def folder(path: Path) -> dict:
    size, files = 0, 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                pass
    sizes = {n: (path / n).stat().st_size if (path / n).is_file() else 0 for n in ("metrics.jsonl", "checkpoint.pt")}
    return {"dir_bytes": size, "dir_files": files, "metrics_bytes": sizes["metrics.jsonl"],
            "checkpoint_bytes": sizes["checkpoint.pt"]}


# ---------------------------------------------------------------------------------------------- the soak
class Soak:
    def __init__(self, args, root: Path, out):
        self.args, self.root, self.out = args, root, out
        cfg = demo_config(**{"diloco.inner_steps": args.inner_steps})
        self.swarm = LocalSwarm(root, peer_args=[*write_peer_config(root, cfg), f"--run.rounds={args.rounds}"])
        self.names = [f"peer{i}" for i in range(args.peers)]
        self.t0 = time.monotonic()
        self.groups: list[int] = []  # every process group started (its leader's pid), ended at close
        self.stopping: dict[str, tuple[float, str]] = {}  # peer → (SIGKILL deadline, fault kind) while it stops
        self.last_fault: dict[str, float] = {}
        self.dht_seen: dict[str, Optional[int]] = {}  # peer → its DHT child at the last sample

    def now(self) -> float:
        return time.monotonic() - self.t0

    def emit(self, **line) -> None:
        line = {"t_s": round(self.now(), 2), "wall": round(time.time(), 3), **line}
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()
        if line["kind"] != "sample":
            print(json.dumps(line), flush=True)

    def start(self, name: str, first: bool) -> None:
        child = self.swarm.peers.get(name)
        if child is not None and child.log_file is not None:
            child.log_file.close()
        expected = self.args.peers if first else 1  # a restarted peer resumes: nobody to wait for
        child = self.swarm.start_peer(name, [f"--run.expected_peers={expected}"])
        self.groups.append(child.proc.pid)
        if not first:
            self.emit(kind="restart", peer=name, pid=child.proc.pid)

    def fault(self, kind: str, name: str) -> None:
        proc = self.swarm.peers[name].proc
        table = process_table()
        dht, p2pd = helpers(proc.pid, table, self.dht_seen.get(name))
        target = {"kill_restart": proc.pid, "term_restart": proc.pid, "kill_p2pd": p2pd, "kill_dht": dht}[kind]
        self.last_fault[name] = self.now()
        committed = count_rounds(read_jsonl(self.swarm.peers[name].run_dir / "metrics.jsonl"))["committed"]
        if proc.poll() is not None or target is None:
            why = "the peer is not running" if proc.poll() is not None else f"no {kind[5:]} process (yet)"
            self.emit(kind="fault", fault=kind, peer=name, skipped=why, committed=committed)
            return
        if kind in ("kill_restart", "term_restart"):
            os.killpg(proc.pid, signal.SIGKILL if kind == "kill_restart" else signal.SIGTERM)
            self.stopping[name] = (self.now() + (10 if kind == "kill_restart" else self.args.stop_grace), kind)
        else:
            os.kill(target, signal.SIGKILL)
        self.emit(kind="fault", fault=kind, peer=name, pid=target, peer_pid=proc.pid, committed=committed)

    def watch_exits(self) -> None:
        """Restart peers whose stop we asked for once they exited (or SIGKILL them past the grace), and peers that
        exited by themselves."""
        for name in self.names:
            proc = self.swarm.peers[name].proc
            code = proc.poll()
            if name in self.stopping:
                deadline, kind = self.stopping[name]
                if code is None and self.now() < deadline:
                    continue
                if code is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
                    self.emit(kind="stop_overdue", peer=name, fault=kind, grace_s=self.args.stop_grace)
                else:
                    self.emit(kind="stopped", peer=name, fault=kind, exit_code=code,
                              after_s=round(self.now() - self.last_fault[name], 1))
                self.stopping.pop(name)
                self.start(name, first=False)
            elif code is not None:
                log = read(str(self.swarm.peers[name].log_path)) or ""
                last = [x for x in log.splitlines() if x.strip()][-3:]
                self.emit(kind="exit", peer=name, exit_code=code, last_lines=last,
                          since_fault_s=round(self.now() - self.last_fault.get(name, 0.0), 1))
                self.start(name, first=False)

    def sample(self) -> None:
        table = process_table()
        children = [("bootstrap", self.swarm.bootstrap)] + [(n, self.swarm.peers[n]) for n in self.names]
        for name, child in children:
            pid = child.proc.pid
            alive = child.proc.poll() is None and pid in table
            below = descendants(pid, table) if alive else []
            dht, p2pd = helpers(pid, table, self.dht_seen.get(name)) if alive else (None, None)
            self.dht_seen[name] = dht
            line = {"kind": "sample", "peer": name, "pid": pid, "alive": alive, "up_s": round(uptime_s(pid, table), 1),
                    "since_fault_s": round(self.now() - self.last_fault.get(name, -1e9), 1),
                    "tree": tree_usage([pid] + below if alive else []), "main": usage(pid, kinds=True) if alive else
                    {"rss_bytes": 0, "threads": 0, "fds": 0}, "dht": dht, "p2pd": p2pd}
            if child.run_dir is not None:
                log = read(str(child.log_path)) or ""
                line.update(folder(child.run_dir), log_bytes=len(log.encode()), **count_restarts(log),
                            **count_rounds(read_jsonl(child.run_dir / "metrics.jsonl")))
            self.emit(**line)

    def wait_first_round(self, timeout_s: float = 600.0) -> float:
        """Seconds until some peer committed round 1 (the peers import, build the model and wait for each
        other first: a minute or more on a loaded machine). Raises after ``timeout_s``."""
        begun = time.monotonic()
        while time.monotonic() - begun < timeout_s:
            if any(count_rounds(read_jsonl(self.swarm.peers[n].run_dir / "metrics.jsonl"))["committed"]
                   for n in self.names):
                return round(time.monotonic() - begun, 1)
            if any(self.swarm.peers[n].proc.poll() is not None for n in self.names):
                raise RuntimeError(f"a peer exited before the first round; see the logs in {self.root}")
            time.sleep(1.0)  # polling the peers' metrics files
        raise RuntimeError(f"no round committed within {timeout_s:.0f} s; see the logs in {self.root}")

    def run(self) -> None:
        args = self.args
        maddrs = self.swarm.start_bootstrap()
        self.groups.append(self.swarm.bootstrap.proc.pid)
        for name in self.names:
            self.start(name, first=True)
        start_up_s = self.wait_first_round()
        self.t0 = time.monotonic()  # the soak's clock: faults, samples and warm-up count from the first commit
        plan = plan_faults(args.seed, args.minutes, self.names, args.fault_every)
        self.emit(kind="config", minutes=args.minutes, peers=args.peers, inner_steps=args.inner_steps,
                  seed=args.seed, quiet_min=args.quiet_min, start_up_s=start_up_s, warmup_min=args.warmup_min, settle_s=args.settle_s, sample_every_s=args.sample_every,
                  fault_every_s=args.fault_every, plan=plan, bootstrap=maddrs[0], code=args.label,
                  p2p_diloco=str(Path(sys.modules["p2p_diloco"].__file__).parent))
        next_sample = 0.0
        while self.now() < (args.minutes + args.quiet_min) * 60:  # the faults' minutes, then the quiet end
            while plan and plan[0][0] <= self.now():
                _, kind, name = plan.pop(0)
                if name in self.stopping:
                    self.emit(kind="fault", fault=kind, peer=name, skipped="the peer is still stopping")
                else:
                    self.fault(kind, name)
            self.watch_exits()
            if self.now() >= next_sample:
                self.sample()
                next_sample = max(next_sample + args.sample_every, self.now())
            time.sleep(0.5)  # polling: a fault, a sample or an exit is due within the second
        self.sample()

    def close(self) -> None:
        """End every process group started (the swarm's SIGTERM then SIGKILL, then SIGKILL to any group left)."""
        self.swarm.close()
        for pgid in self.groups:
            if group_members(pgid):
                os.killpg(pgid, signal.SIGKILL)
        left = [p for pgid in self.groups for p in group_members(pgid)]
        self.emit(kind="closed", groups=len(self.groups), processes_left=left)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="soak duration (default 20)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=20, help="H: inner steps per round (default 20)")
    parser.add_argument("--rounds", type=int, default=100_000, help="run.rounds: more than the soak can reach")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault rotation")
    parser.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults (default 60)")
    parser.add_argument("--quiet-min", type=float, default=2.0,
                        help="minutes without faults after the last one, at the end: the end is measured on a settled "
                        "swarm, not on one still serving the last fault's state transfer (default 2)")
    parser.add_argument("--sample-every", type=float, default=15.0, help="seconds between samples (default 15)")
    parser.add_argument("--warmup-min", type=float, default=3.0,
                        help="warm-up: samples before this many minutes are left out of start/end (default 3)")
    parser.add_argument("--settle-s", type=float, default=60.0, help="samples of a process younger than this, or "
                        "within this of a fault on its peer, are left out of start/end (default 60)")
    parser.add_argument("--stop-grace", type=float, default=30.0, help="SIGTERM → SIGKILL after this (s)")
    parser.add_argument("--out", default="benchmarks/results/soak.jsonl", help="results (JSON lines)")
    parser.add_argument("--label", default="", help="a note saved in the results, e.g. the commit measured")
    parser.add_argument("--keep", action="store_true", help="keep the swarm's temporary folder (logs, metrics)")
    args = parser.parse_args()
    if args.peers < 2 or args.minutes <= 0 or args.quiet_min < 0:
        print("soak: --peers must be at least 2, --minutes positive and --quiet-min not negative", file=sys.stderr)
        sys.exit(2)
    root = Path(tempfile.mkdtemp(prefix="soak-"))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # a stop, like Ctrl-C
    with open(args.out, "w") as out:
        soak = Soak(args, root, out)
        try:
            soak.run()
        except KeyboardInterrupt:
            soak.emit(kind="interrupted")
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up below runs to its end
            soak.close()
            if args.keep:
                print(f"soak: the swarm's folder is kept: {root}")
            else:
                shutil.rmtree(root, ignore_errors=True)
    with open(args.out) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    rows, v, text = report(lines, args.warmup_min * 60, args.settle_s)
    with open(args.out, "a") as f:
        f.writelines(summary_lines(rows, v))
    print(text)


if __name__ == "__main__":
    main()
