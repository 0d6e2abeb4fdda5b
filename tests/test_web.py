"""The run page (``p2p-diloco web``, ops/web.py) in a real browser: headless Chromium from the system's packages,
driven by Selenium through the system's chromedriver (never a download: Selenium Manager is kept offline).

One test watches a live 2-peer swarm through the command; another serves a view built from forged roster records
(markup in names, a fork, a thousand peers) and checks that the page shows them as text, bounded. Each saves a
screenshot under ``$P2P_DILOCO_ARTIFACTS`` (default: ``test-artifacts/`` in the repository root, git-ignored). The
browser tests skip, saying why, where Chromium, chromedriver or Selenium is missing.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path

import pytest

from p2p_diloco.net.consensus import PeerStatus
from p2p_diloco.ops import web_view
from p2p_diloco.ops.status import describe_run
from p2p_diloco.ops.web import HEADERS, RunPageServer, RunWatcher, open_server, page_url

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
MARKUP = '<img src=x onerror="window.pwned=1">'  # 36 characters: the page shows names up to 40


def artifacts_dir() -> Path:
    path = Path(os.environ.get("P2P_DILOCO_ARTIFACTS") or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser():
    """Headless Chromium through /usr/bin/chromedriver; skips where either or Selenium is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[dev]')")
    if CHROMIUM is None or not os.access(CHROMEDRIVER, os.X_OK):
        pytest.skip("no system Chromium or chromedriver (apt-get install chromium chromium-driver; .ci/run does)")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never fetch a browser or a driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000",
                "--no-first-run", "--disable-extensions", "--disable-background-networking"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, timeout: float, what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.5).until(condition)
    except TimeoutException:
        shown = driver.execute_script("return document.body.innerText")[:3000]
        raise AssertionError(f"{what} within {timeout:.0f} s; the page shows:\n{shown}") from None


def _texts(driver, css: str) -> list[str]:
    """The text of every element matching ``css``, read at once in the page (it re-renders every refresh: elements
    found one call earlier may be gone)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), (e) => e.textContent)", css)


def _round(driver) -> int:
    texts = _texts(driver, ".run-round")
    return int(texts[0]) if texts and texts[0].isdigit() else -1


# ---------------------------------------------------------------------------------------------- a live swarm

def _start_swarm(run_dir: Path, run_id: str) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2p_diloco", "swarm", "--run-dir", str(run_dir), "--peers", "2", "--rounds", "200",
         "--inner-steps", "4", f"--run.run_id={run_id}", "--model.seq_len=64", "--inner.batch_size=4",
         "--data.eval_batches=1", "--no-report"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("bootstrap node at"):
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(90) and proc.poll() is None, "\n".join(lines)
    return proc, lines[0].split()[-1], lines


def _start_web(maddr: str, run_id: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "p2p_diloco", "web", "--initial-peers", maddr, "--port", "0", "--refresh", "1",
         f"--run.run_id={run_id}", "--network.host_maddrs=/ip4/127.0.0.1/tcp/0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()  # "run page of ... at http://127.0.0.1:PORT/ ..." once it serves
    assert line.startswith("run page of"), line + proc.stdout.read() if proc.poll() is not None else line
    return proc, line.split(" at ")[1].split()[0]


def _stop(proc: subprocess.Popen, sig: int, timeout: float) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.timeout(300)
def test_web_page_shows_the_swarms_peers_and_rounds_rising_in_chromium(browser, tmp_path, process_tag):
    run_id = "web/test"  # a character that prefixes may not hold: the page shows the run id, not the prefix
    swarm, maddr, swarm_lines = _start_swarm(tmp_path / "swarm", run_id)
    web = None
    try:
        web, url = _start_web(maddr, run_id)
        browser.get(url)
        _wait(browser, lambda d: {"peer0", "peer1"} <= set(_texts(d, ".peer-name")), 120, "both peers listed")
        first = _wait(browser, lambda d: _round(d) >= 1 and _round(d), 120, "a committed round shown")
        _wait(browser, lambda d: _round(d) >= first + 2, 120, f"the round rising from {first}")
        assert browser.find_element("id", "run-id").text == run_id
        assert set(_texts(browser, ".peer-round")) <= {str(r) for r in range(first, first + 50)}
        assert _texts(browser, ".rounds-seen td.num")[:1], "no round listed in the rounds seen"
        browser.save_screenshot(str(artifacts_dir() / "web_swarm.png"))
        with urllib.request.urlopen(url + "api/run", timeout=10) as answer:
            view = json.load(answer)
        run = view["runs"][0]
        assert {p["name"] for p in run["peers"]} == {"peer0", "peer1"} and run["round"] >= first + 2
        assert run["rounds"] and all(len(r["digests"]) >= 1 for r in run["rounds"])
        assert view["settings"]["run.run_id"] == json.dumps(run_id)
        begun = time.monotonic()
        assert _stop(web, signal.SIGTERM, 15) == 0
        assert time.monotonic() - begun < 15
    finally:
        if web is not None:
            _stop(web, signal.SIGKILL, 15)
        _stop(swarm, signal.SIGINT, 90)  # the swarm ends its peers and bootstrap node itself


# ---------------------------------------------------------------------------------------------- forged records

def _forged_roster(n: int) -> list[PeerStatus]:
    """``n`` peers at round 7, one of them named with markup, a tenth of them on another digest (a fork)."""
    roster = [PeerStatus(name=f"peer{i:04d}", peer_id=f"id{i:04d}", round=7, digest=("b" if i % 10 == 0 else "a") * 64,
                         tokens_per_s=100.0 + i, last_allreduce_s=0.5, steps_per_s=float("nan"), last_round=7,
                         last_steps=3, last_planned_steps=4, last_loss=2.5)
              for i in range(n)]
    roster[10].name = MARKUP  # a peer on the minority digest: listed first
    roster[20].name = "x" * 500  # truncated by the page's server
    return roster


def _serve(watcher: RunWatcher) -> tuple[RunPageServer, str]:
    server = open_server("127.0.0.1", 0, watcher.body)
    threading.Thread(target=server.serve_forever, args=(0.2,), daemon=True).start()
    return server, page_url(server)


def _forged_watcher(n: int) -> RunWatcher:
    watcher = RunWatcher(None, "forged<b>run</b>", refresh_s=1.0, timeout=1.0)
    view = {"runs": [describe_run("forged_abc", _forged_roster(n))]}
    watcher.show(view, {"run.name": "<b>bold</b>", "model.name": "tiny"})
    return watcher


@pytest.mark.timeout(120)
def test_web_page_shows_markup_in_records_as_text_and_bounds_a_thousand_peers(browser):
    server, url = _serve(_forged_watcher(1000))
    try:
        browser.get(url)
        _wait(browser, lambda d: MARKUP in _texts(d, ".peer-name"), 60, "the name with markup shown as text")
        assert browser.find_elements("tag name", "img") == [], "a record's markup became an element"
        assert browser.execute_script("return window.pwned") is None
        assert browser.find_element("id", "run-id").text == "forged<b>run</b>"
        assert "bold" not in " ".join(_texts(browser, "b")), "markup in a setting became an element"
        rows = browser.find_elements("css selector", ".run .peers tbody tr")
        assert len(rows) == web_view.MAX_PEERS, len(rows)  # bounded: the rest counted
        assert f"… and {1000 - web_view.MAX_PEERS} more peers not shown" in _texts(browser, ".more")
        assert all(len(t) <= 40 for t in _texts(browser, ".peer-name"))
        assert any("FORK at round 7" in t for t in _texts(browser, ".fork"))
        browser.save_screenshot(str(artifacts_dir() / "web_markup.png"))
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------- no browser

def test_web_api_is_typed_bounded_and_served_under_a_strict_policy():
    watcher = _forged_watcher(1000)
    server, url = _serve(watcher)
    try:
        with urllib.request.urlopen(url + "api/run", timeout=10) as answer:
            view = json.load(answer)
            assert answer.headers["Content-Security-Policy"] == HEADERS["Content-Security-Policy"]
        with urllib.request.urlopen(url, timeout=10) as answer:
            assert b'<script src="/app.js"' in answer.read() and "script-src 'self'" in answer.headers[
                "Content-Security-Policy"]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(url + "etc/passwd", timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    run = view["runs"][0]
    assert run["peers_total"] == 1000 and len(run["peers"]) == web_view.MAX_PEERS
    assert run["peers"][0]["state"] == "differs"  # the peers that disagree with the run come first
    assert run["fork"] and [d["peers"] for d in run["digests"]] == [900, 100]
    assert run["rounds"][0]["round"] == 7 and run["rounds"][0]["fork"] and run["rounds"][0]["committed_by"] == 1000
    assert run["rounds"][0]["loss"] == 2.5 and run["rounds"][0]["allreduce_s"] == 0.5
    assert all(len(d["names"]) <= web_view.MAX_NAMES for d in run["rounds"][0]["digests"])
    long = [p["name"] for p in run["peers"] if p["name"].startswith("xxx")]
    assert all(len(name) == web_view.NAME_CHARS for name in long)
    assert all(p["steps_per_s"] is None for p in run["peers"])  # NaN in a record: shown as unknown, valid JSON
    assert {(p["steps_done"], p["steps_planned"], p["loss"]) for p in run["peers"]} == {(3, 4, 2.5)}
    assert len(json.dumps(view)) < 200_000  # cheap to send every few seconds


def test_web_shows_the_steps_and_loss_that_roster_records_carry():
    """A peer's last round (steps done and planned, loss) passes the roster's record checks into the page's rows;
    a record without them (an older peer's) shows them as unknown; an impossible loss drops the record."""
    from p2p_diloco.net.records import RecordError, roster_entry

    peer = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
    record = {"name": "p", "peer_id": peer, "round": 2, "digest": "ab" * 32, "last_round": 2, "last_steps": 9,
              "last_planned_steps": 12, "last_loss": 3.25, "missed_rounds": 4}
    row = web_view.peer_row({**asdict(roster_entry(peer, record)), "state": "agrees"}, 0.0)
    assert (row["last_round"], row["steps_done"], row["steps_planned"], row["loss"]) == (2, 9, 12, 3.25)
    assert row["missed_rounds"] == 4
    old = {k: v for k, v in record.items() if not k.startswith("last_")}
    row = web_view.peer_row({**asdict(roster_entry(peer, old)), "state": "agrees"}, 0.0)
    assert row["loss"] is None and row["steps_done"] is None and row["steps_planned"] is None
    with pytest.raises(RecordError):
        roster_entry(peer, {**record, "last_loss": -1.0})


def test_web_remembers_bounded_rounds_and_peers_gone():
    now = [1000.0]
    watcher = RunWatcher(None, "run", refresh_s=1.0, timeout=1.0, clock=lambda: now[0])
    a, b = PeerStatus("a", "ida", 0, "0" * 64), PeerStatus("b", "idb", 0, "0" * 64)
    for r in range(1, web_view.MAX_ROUNDS + 6):
        a.round = b.round = r
        a.digest, b.digest = f"{r:064x}", f"{r:064x}" if r != 3 else "f" * 64
        now[0] += 5
        watcher.show({"runs": [describe_run("p", [a, b] if r < web_view.MAX_ROUNDS + 5 else [a])]}, {})
    view = json.loads(watcher.body())
    run = view["runs"][0]
    assert [r["round"] for r in run["rounds"]] == list(range(web_view.MAX_ROUNDS + 5, 5, -1))
    assert [p["name"] for p in run["gone"]] == ["b"] and run["gone"][0]["last_seen"] == now[0] - 5
    now[0] += web_view.GONE_KEEP_S
    watcher.show({"runs": [describe_run("p", [a])]}, {})
    assert json.loads(watcher.body())["runs"][0]["gone"] == []
    watcher.show(None, None, error="reading the run failed: TimeoutError")  # the last view stays, with the error
    view = json.loads(watcher.body())
    assert view["error"].startswith("reading the run failed") and view["runs"][0]["peers"][0]["name"] == "a"
    assert math.isclose(view["read_at"], now[0])


@pytest.mark.timeout(120)
def test_web_refuses_a_taken_port_and_a_bad_initial_peer_in_one_line(capsys):
    from p2p_diloco.cli import main

    taken = open_server("127.0.0.1", 0, lambda: b"{}")
    port = taken.server_address[1]
    maddr = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
    try:  # the command itself, once: the port is bound before any DHT starts, so nothing else is needed
        out = subprocess.run([sys.executable, "-m", "p2p_diloco", "web", "--initial-peers", maddr, "--port", str(port)],
                             capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
        assert out.returncode == 2 and out.stderr == (f"p2p-diloco: error: web: cannot listen on 127.0.0.1:{port}: "
                                                      f"Address already in use\n"), out
        for args, says in ((["--initial-peers", "/ip4/1.2.3"], "invalid multiaddr '/ip4/1.2.3'"),
                           (["--port", "1"], "web: needs --initial-peers"),
                           (["--initial-peers", maddr, "--port", "70000"], "--port: must be in 0..65535"),
                           (["--initial-peers", maddr, "--refresh", "0"], "--refresh: must be > 0")):
            capsys.readouterr()
            assert main(["web", *args]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and says in err, err
    finally:
        taken.server_close()


def test_web_gives_a_rounds_numbers_to_the_round_they_are_about():
    """A peer publishes its new round before the numbers of the attempt that reached it: loss and all-reduce time
    go to the round its record says they are about (``last_round``), and only to a round it holds."""
    history = web_view.RoundHistory()

    def seen(round_: int, about: int, loss: float) -> None:
        history.observe("p", [{"peer_id": "a", "name": "a", "round": round_, "digest": f"d{round_}",
                               "last_round": about, "allreduce_s": 1.0, "loss": loss}])

    seen(1, 1, 5.0)
    seen(2, 1, 5.0)  # round 2 committed, its numbers not yet published
    seen(2, 2, 4.0)
    seen(2, 3, 3.0)  # a failed attempt at round 3: a round it does not hold
    assert [(r["round"], r["loss"], r["committed_by"]) for r in history.view("p")] == [(2, 4.0, 1), (1, 5.0, 1)]
