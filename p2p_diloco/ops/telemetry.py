"""A peer's Prometheus endpoint (``metrics.port``): its rounds, timings, traffic and losses in the text format.

The numbers come from the records the peer already logs (``run_dir/metrics.jsonl``): :class:`PrometheusSink` is one
more sink behind ops/metrics.py's fan-out, and :meth:`Telemetry.observe` turns each record into metric updates, so
the round loop holds no metrics code of its own. Two counters are for other code to increment, from any thread:
:func:`count_restart` (a helper process of the network stack restarted) and :func:`count_dropped_record` (a record
read from the DHT or from another peer dropped as invalid).

The metrics live in one registry per process (:func:`process_telemetry`), not prometheus_client's global one, so a
test can build as many :class:`Telemetry` as it likes in one process. The endpoint is prometheus_client's own HTTP
server (a daemon thread), started when the peer builds its sinks and stopped when it closes them. It has no
authentication: it listens on 127.0.0.1 unless ``metrics.host`` says otherwise.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from p2p_diloco.config import ConfigError
from p2p_diloco.ops.metrics import MetricsSink
from p2p_diloco.ops.standing import MISSED_ROUNDS_WARN, Standing

PREFIX = "p2p_diloco"
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, math.inf)
MAX_LABEL_SETS = 64  # distinct label values per labelled counter; more are counted under "other"
MAX_LABEL_CHARS = 64  # a label value is cut to this many characters


class Telemetry:
    """Every metric of one peer process, in its own registry; ``clock`` gives Unix seconds (tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.registry = CollectorRegistry()
        self.clock = clock
        self.started = clock()
        self.last_commit: Optional[float] = None  # Unix seconds of our last committed round
        self._labels: dict[str, set[tuple]] = {"restarts": set(), "dropped": set()}
        self._lock = threading.Lock()
        r, p = self.registry, PREFIX
        self.info = Info(f"{p}_peer", "this peer: its name and run id", registry=r)
        self.committed = Counter(f"{p}_rounds_committed", "rounds this peer committed (its average applied to "
                                 "θ_global)", registry=r)
        self.failed = Counter(f"{p}_rounds_failed", "averaging attempts that did not commit (θ_global kept, "
                              "training continues from θ_local)", registry=r)
        self.round_seconds = self._seconds("round", "wall time of a round: state check, inner steps, averaging and "
                                           "outer step (evaluation excluded)")
        self.inner_seconds = self._seconds("inner", "inner steps of a round")
        self.matchmaking_seconds = self._seconds("matchmaking", "gathering a group before an all-reduce")
        self.allreduce_seconds = self._seconds("allreduce", "the all-reduce alone, once the group formed")
        self.sent = Counter(f"{p}_sent_bytes", "tensor bytes this peer sent in all-reduces", registry=r)
        self.received = Counter(f"{p}_received_bytes", "tensor bytes this peer received in all-reduces", registry=r)
        self.tokens = Counter(f"{p}_tokens", "tokens of this peer's inner steps", registry=r)
        self.train_loss = Gauge(f"{p}_train_loss", "mean training loss of the last round's inner steps (nats per "
                                "token)", registry=r)
        self.eval_loss = Gauge(f"{p}_eval_loss", "held-out loss of θ_global at its last evaluation (nats per token)",
                               registry=r)
        self.tokens_per_second = Gauge(f"{p}_tokens_per_second", "inner-step throughput of the last round (all "
                                       "ranks)", registry=r)
        self.group_size = Gauge(f"{p}_group_size", "peers whose pseudo-gradients entered the last round's average "
                                "(0: no group formed)", registry=r)
        self.round = Gauge(f"{p}_round", "θ_global's round: rounds the run committed, as this peer holds it",
                           registry=r)
        Gauge(f"{p}_last_commit_age_seconds", "seconds since this peer's last committed round (since it started, "
              "before its first)", registry=r).set_function(self._commit_age)
        self.uncommitted = Gauge(f"{p}_uncommitted_rounds", "averaging attempts since this peer's last committed "
                                 "round (0 after a commit): a peer training alone while the run goes on",
                                 registry=r)
        self.missed = Gauge(f"{p}_missed_rounds", "rounds the run committed since this peer's last committed round, "
                            "from the roster (0 after a commit; ops/standing.py warns at "
                            f"{MISSED_ROUNDS_WARN})", registry=r)
        self._standing = Standing()
        self.last_commit_time = Gauge(f"{p}_last_commit_timestamp_seconds", "Unix time of this peer's last "
                                      "committed round (0: none yet)", registry=r)
        self.restarts = Counter(f"{p}_helper_restarts", "restarts of a helper process of the network stack, by "
                                "helper", ["helper"], registry=r)
        self.dropped = Counter(f"{p}_dropped_records", "records from the DHT or from other peers dropped as "
                               "invalid, by kind and reason", ["kind", "reason"], registry=r)

    def _seconds(self, what: str, doc: str) -> Histogram:
        return Histogram(f"{PREFIX}_{what}_seconds", doc, buckets=SECONDS_BUCKETS, registry=self.registry)

    def _commit_age(self) -> float:
        return self.clock() - (self.last_commit if self.last_commit is not None else self.started)

    # ---------------------------------------------------------------------------------------------- the seam
    def observe(self, record: dict[str, Any]) -> None:
        """Update the metrics from one record of the peer's sink (``event``: start, round, rebase, join...)."""
        if _number(record.get("round")) is not None:
            self.round.set(record["round"])
        if _number(record.get("eval/loss")) is not None:
            self.eval_loss.set(record["eval/loss"])
        if record.get("event") == "round":
            self._observe_round(record)

    def _observe_round(self, record: dict[str, Any]) -> None:
        self._standing.observe(record)
        self.missed.set(self._standing.missed)
        if record.get("committed"):
            self.committed.inc()
            self.uncommitted.set(0)
            self.last_commit = self.clock()
            self.last_commit_time.set(self.last_commit)
        else:
            self.failed.inc()
            self.uncommitted.inc()
        value = {key: _number(record.get(key)) for key in (
            "time/round_s", "time/inner_s", "outer/allreduce_s", "outer/allreduce_only_s", "outer/bytes_sent",
            "outer/bytes_received", "outer/group_size", "train/loss", "train/tokens", "train/tokens_per_s")}
        steps = bool(record.get("train/inner_steps"))  # a record drained after the last round has no inner steps
        _observe(self.round_seconds, value["time/round_s"])
        if steps:
            _observe(self.inner_seconds, value["time/inner_s"])
            _set(self.train_loss, value["train/loss"])
            _set(self.tokens_per_second, value["train/tokens_per_s"])
            _inc(self.tokens, value["train/tokens"])
        if value["outer/allreduce_s"] is not None and value["outer/allreduce_only_s"] is not None:
            _observe(self.matchmaking_seconds, max(0.0, value["outer/allreduce_s"] - value["outer/allreduce_only_s"]))
        if value["outer/group_size"]:  # the all-reduce ran only if a group formed
            _observe(self.allreduce_seconds, value["outer/allreduce_only_s"])
        _inc(self.sent, value["outer/bytes_sent"])
        _inc(self.received, value["outer/bytes_received"])
        _set(self.group_size, value["outer/group_size"])

    # ------------------------------------------------------------------------------------- other code's counts
    def count_restart(self, helper: str) -> None:
        self.restarts.labels(*self._bounded("restarts", helper)).inc()

    def count_dropped_record(self, kind: str, reason: str) -> None:
        self.dropped.labels(*self._bounded("dropped", kind, reason)).inc()

    def _bounded(self, counter: str, *values) -> tuple:
        """Label values cut to MAX_LABEL_CHARS; past MAX_LABEL_SETS distinct ones, "other" (a reason built from
        untrusted input must not grow the registry without bound)."""
        values = tuple(_label(v) for v in values)
        with self._lock:
            seen = self._labels[counter]
            if values not in seen:
                if len(seen) >= MAX_LABEL_SETS:
                    return ("other",) * len(values)
                seen.add(values)
        return values


_process: Optional[Telemetry] = None
_process_lock = threading.Lock()


def process_telemetry() -> Telemetry:
    """This process's metrics, made at the first call (what the endpoint serves and other code counts into)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = Telemetry()
        return _process


def count_restart(helper: str) -> None:
    """Count one restart of a helper of the network stack (e.g. "dht", "p2pd", "averager"): a fixed name, not
    input. Never raises; counted whether or not the endpoint is on."""
    process_telemetry().count_restart(helper)


def count_dropped_record(kind: str, reason: str) -> None:
    """Count one record dropped as invalid (``kind``: e.g. "roster", "run_settings"; ``reason``: a short fixed
    phrase such as "bad type" or "too large", never the record's own text). Counted in this process only: call it
    from the peer's main process (a child process has its own registry, which nobody serves)."""
    process_telemetry().count_dropped_record(kind, reason)


class PrometheusSink(MetricsSink):
    """Serves ``telemetry``'s registry at http://host:port/metrics and updates it from every record logged."""

    def __init__(self, host: str, port: int, peer: str, run_id: str, telemetry: Optional[Telemetry] = None):
        self.telemetry = telemetry or process_telemetry()
        self.telemetry.info.info({"peer": _label(peer), "run_id": _label(run_id)})
        self.host, self.port = host, port
        try:
            self.server, self.thread = start_http_server(port, host, registry=self.telemetry.registry)
        except OSError as e:  # taken after the CLI's preflight check: still one line, exit code 2
            raise ConfigError(endpoint_error(host, port, e)) from None

    def log(self, record: dict[str, Any]) -> None:
        self.telemetry.observe(record)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()  # shutdown() alone keeps the port bound
            self.thread.join(timeout=5)
            self.server = None


def check_endpoint(host: str, port: int) -> None:
    """Bind ``host:port`` as the endpoint will and let go; ConfigError naming metrics.port or metrics.host if it
    cannot (one line, before the peer's slow start)."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"metrics.host: {host!r} is not an address of this machine ({e.strerror}): use "
                          f"127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    with socket.socket(family, kind) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server does
        try:
            sock.bind(address)
        except OSError as e:
            raise ConfigError(endpoint_error(host, port, e)) from None


def endpoint_error(host: str, port: int, error: OSError) -> str:
    where = f"metrics.port: cannot serve metrics on {host}:{port}"
    if error.errno == errno.EADDRINUSE:
        return (f"{where}: port {port} is already in use (another peer on this machine?): choose another, e.g. "
                f"--metrics.port={port + 1 if port < 65535 else port - 1}, or 0 (off)")
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{where}: {host} is not an address of this machine (metrics.host: 127.0.0.1 or 0.0.0.0)"
    if error.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need root): choose a port above 1024"
    return f"{where}: {os.strerror(error.errno) if error.errno else error}"


def _number(value) -> Optional[float]:
    """A finite int or float (not a bool) as float, else None: records may hold None, NaN or nothing."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _label(value) -> str:
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text[:MAX_LABEL_CHARS] or "none"


def _observe(histogram: Histogram, value: Optional[float]) -> None:
    if value is not None and value >= 0:
        histogram.observe(value)


def _set(gauge: Gauge, value: Optional[float]) -> None:
    if value is not None:
        gauge.set(value)


def _inc(counter: Counter, value: Optional[float]) -> None:
    if value is not None and value > 0:
        counter.inc(value)
