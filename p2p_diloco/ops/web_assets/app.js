// The run page: fetches /api/run every few seconds and renders it. Every value comes from DHT records that anyone
// in the run can write: it is only ever put into the page as text (textContent), never as markup, and it is cut to
// a bounded length and count (the server bounds it too: ops/web_view.py).
"use strict";

const NAME_CHARS = 40;
const DIGEST_CHARS = 12;
const MAX_PEER_ROWS = 200;
const MAX_ROUND_ROWS = 30;
const MAX_NAMES_SHOWN = 8;

function cut(value, limit) {
  const s = value === null || value === undefined ? "" : String(value);
  return s.length <= limit ? s : s.slice(0, limit - 1) + "…";
}

// An element with a class and text content; children appended as nodes.
function el(tag, cls, content) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (Array.isArray(content)) node.append(...content);
  else if (content !== undefined && content !== null) node.textContent = String(content);
  return node;
}

function num(x, digits) {
  if (typeof x !== "number" || !isFinite(x)) return "-";
  for (const [unit, scale] of [["G", 1e9], ["M", 1e6], ["k", 1e3]]) {
    if (Math.abs(x) >= scale) return (x / scale).toFixed(1) + unit;
  }
  return x.toFixed(digits === undefined ? 0 : digits);
}

function ago(now, t) {
  if (typeof t !== "number") return "-";
  const s = Math.max(0, now - t);
  return s < 90 ? s.toFixed(0) + " s ago" : (s / 60).toFixed(0) + " min ago";
}

function table(cls, headers, rows) {
  const head = el("tr", null, headers.map((h) => el("th", null, h)));
  return el("table", cls, [el("thead", null, [head]), el("tbody", null, rows)]);
}

function row(cells) {
  return el("tr", null, cells.map(([text, cls]) => el("td", cls || null, text)));
}

function more(shown, total, what) {
  return total > shown ? [el("p", "more", "… and " + (total - shown) + " more " + what + " not shown")] : [];
}

function peerRow(p, now) {
  const steps = p.steps_done === null ? "-" : p.steps_done + " / " + (p.steps_planned === null ? "-" : p.steps_planned);
  return row([
    [cut(p.name, NAME_CHARS), "peer-name"], [p.state, "state-" + cut(p.state, 16)], [num(p.round), "num peer-round"],
    [cut(p.digest, DIGEST_CHARS), "digest"], [cut(p.reachability, 16)], [num(p.tokens_per_s), "num"],
    [num(p.steps_per_s, 2), "num"], [num(p.last_round), "num"], [steps, "num"], [num(p.loss, 3), "num"], [num(p.allreduce_s, 2), "num"],
    [num(p.missed_rounds), p.missed_rounds >= MISSED_ROUNDS_WARN ? "num missed" : "num"],
    [ago(now, p.last_seen)], [p.leaving ? "yes" : "no"],
  ]);
}

// rounds the run committed without a peer before its row is marked (ops/standing.py MISSED_ROUNDS_WARN)
const MISSED_ROUNDS_WARN = 3;
const PEER_HEADERS = ["peer", "state", "round", "digest", "reachability", "tokens/s", "steps/s", "last round",
  "steps done / planned", "loss", "all-reduce s", "missed rounds", "last seen", "leaving"];

function roundRow(r) {
  const digests = r.digests.slice(0, 4).map((d) => {
    const names = d.names.slice(0, MAX_NAMES_SHOWN).map((n) => cut(n, NAME_CHARS)).join(", ");
    const rest = d.peers > Math.min(d.names.length, MAX_NAMES_SHOWN) ? ", …" : "";
    return el("div", null, cut(d.digest, DIGEST_CHARS) + ": " + d.peers + " peer(s): " + names + rest);
  });
  if (r.digests.length > 4) digests.push(el("div", "more", "… " + (r.digests.length - 4) + " more digests"));
  const tr = el("tr", r.fork ? "fork" : null);
  tr.append(el("td", "num", String(r.round)), el("td", "num", String(r.committed_by)), el("td", "digest", digests),
    el("td", r.fork ? "fork" : null, r.fork ? "FORK" : "one"), el("td", "num", num(r.allreduce_s, 2)),
    el("td", "num", num(r.loss, 3)));
  return tr;
}

function renderRun(run, now) {
  const fork = run.fork ? [el("p", "fork", "FORK at round " + run.round + ": " +
    run.digests.map((d) => d.peers + " peer(s) on " + cut(d.digest, DIGEST_CHARS)).join(", "))] : [];
  const summary = el("p", "summary", [
    el("span", null, ["round ", el("b", "run-round", String(run.round))]),
    el("span", null, ["live peers ", el("b", "run-live", String(run.live_peers))]),
    el("span", null, "agreeing " + run.agreeing_peers + " on " + cut(run.digest, DIGEST_CHARS)),
    el("span", null, "tokens " + num(run.tokens_trained)), el("span", null, "tokens/s " + num(run.tokens_per_s)),
  ]);
  const peers = run.peers.slice(0, MAX_PEER_ROWS);
  const parts = [el("h2", null, "prefix " + cut(run.prefix, 80)), summary, ...fork,
    el("h3", null, "Peers (" + run.peers_total + ")"),
    table("peers", PEER_HEADERS, peers.map((p) => peerRow(p, now))), ...more(peers.length, run.peers_total, "peers")];
  if (run.gone_total > 0) {
    const gone = run.gone.slice(0, 50);
    parts.push(el("h3", null, "Gone (roster entry expired: " + run.gone_total + ")"),
      table("gone", PEER_HEADERS, gone.map((p) => peerRow(p, now))), ...more(gone.length, run.gone_total, "gone peers"));
  }
  const rounds = run.rounds.slice(0, MAX_ROUND_ROWS);
  parts.push(el("h3", null, "Rounds seen (" + run.rounds.length + ")"),
    table("rounds-seen", ["round", "peers seen", "digests (peers holding each)", "fork", "all-reduce s (median)", "loss (mean)"],
      rounds.map(roundRow)));
  return el("section", "run", parts);
}

function renderSettings(settings) {
  const keys = Object.keys(settings);
  document.getElementById("settings-count").textContent = String(keys.length);
  document.querySelector("#settings tbody").replaceChildren(
    ...keys.slice(0, 200).map((k) => row([[cut(k, 80), "setting-key"], [cut(settings[k], 160)]])));
}

function render(view) {
  document.getElementById("run-id").textContent = cut(view.run_id, 80);
  const status = document.getElementById("status");
  const read = view.read_at ? "read " + ago(view.time, view.read_at) : "not read yet";
  status.textContent = (view.error ? view.error + "; " : "") + read + ", refreshed every " + view.refresh_s + " s";
  status.className = view.error ? "status error" : "status";
  const runs = view.runs.map((run) => renderRun(run, view.time));
  if (runs.length === 0) runs.push(el("p", "empty", "No peer of this run found (yet): is the run id right?"));
  runs.push(...more(view.runs.length, view.runs_total, "prefixes"));
  document.getElementById("runs").replaceChildren(...runs);
  renderSettings(view.settings);
}

let refreshMs = 3000;

async function refresh() {
  try {
    const response = await fetch("/api/run", { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const view = await response.json();
    refreshMs = Math.min(Math.max(1000 * (view.refresh_s || 3), 1000), 60000);
    render(view);
  } catch (e) {
    const status = document.getElementById("status");
    status.textContent = "cannot reach the page's server (" + cut(e, 120) + "); retrying";
    status.className = "status error";
  } finally {
    setTimeout(refresh, refreshMs);
  }
}

refresh();
