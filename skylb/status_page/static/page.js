// The SkyLB status page: polls /skylb/v1/status?format=json (the controller's system view, or a balancer's own
// status) and draws it. Plain DOM, textContent only (no HTML from data), no library, no build step.
"use strict";

const POLL_MS = 2000;
const STATUS_URL = "/skylb/v1/status?format=json";
// The last snapshot's counters (forwarded per link, placements per rule) and its time, for the rates.
const previous = {forwarding: null, rules: null};

function fromBalancer(d) {
  // A balancer's own status, in the controller view's shape: its region, the regions it serves, its replicas.
  const served = d.served_regions && Object.keys(d.served_regions).length ? d.served_regions : {[d.region]: 0};
  // A balancer's status does not name a replica's region; when it serves one region, every replica is of it.
  const regions = Object.keys(served), onlyRegion = regions.length === 1 ? regions[0] : null;
  return {
    revision: d.membership_revision, static_membership: d.static_membership, time: d.time,
    regions: Object.entries(served).map(([region, epoch]) => ({region, balancer_region: d.region, epoch})),
    balancers: [{region: d.region, url: location.origin, healthy: true, draining: d.draining, reachable: true,
                 error: null, queue_len: d.queue_len, in_flight: d.in_flight,
                 available_replicas: d.available_replicas, peers: d.peers, quota: d.quota,
                 placed_by_rule: d.placed_by_rule}],
    replicas: d.replicas.map((r) => ({...r, region: onlyRegion, balancer: location.origin})),
  };
}

function cell(row, field, text, cls) {
  const td = row.insertCell();
  td.dataset.field = field;
  td.textContent = text === null || text === undefined ? "-" : String(text);
  if (cls) td.className = cls;
  return td;
}

const round = (v) => (Math.abs(v) >= 10 ? Math.round(v) : Math.round(v * 100) / 100);
const num = (row, field, value) => cell(row, field, value, "num");
const flag = (row, field, value) => cell(row, field, value ? "yes" : "no", value ? "yes" : "no");

function body(id, rows, empty) {
  const tbody = document.querySelector(`#${id} tbody`);
  tbody.replaceChildren();
  if (!rows.length) {
    const td = tbody.insertRow().insertCell();
    td.colSpan = document.querySelectorAll(`#${id} thead th`).length;
    td.className = "empty";
    td.textContent = empty;
  }
  return rows.map((key) => { const row = tbody.insertRow(); row.dataset.key = key; return row; });
}

function drawRegions(view) {
  const byRegion = new Map(view.balancers.map((b) => [b.region, b]));
  const rows = body("regions", view.regions.map((r) => r.region), "no regions");
  view.regions.forEach((r, i) => {
    const row = rows[i], b = byRegion.get(r.region) || {};  // the region's own balancer, live or not
    cell(row, "region", r.region);
    cell(row, "balancer_region", r.balancer_region, r.balancer_region === r.region ? "" : "note");
    num(row, "epoch", r.epoch);
    cell(row, "url", b.url);
    if (b.url) flag(row, "healthy", b.healthy); else cell(row, "healthy", null);
    cell(row, "draining", b.url ? (b.draining ? "yes" : "no") : null, b.draining ? "note" : "");
    cell(row, "state", b.url ? (b.reachable ? "up" : `unreachable (${b.error})`) : null, b.reachable ? "yes" : "no");
    num(row, "queue_len", b.queue_len);
    num(row, "in_flight", b.in_flight);
    num(row, "available_replicas", b.available_replicas);
  });
}

function drawReplicas(view) {
  const regionOf = new Map(view.balancers.map((b) => [b.url, b.region]));
  const rows = body("replicas", view.replicas.map((r) => r.id), "no replicas");
  view.replicas.forEach((r, i) => {
    const row = rows[i];
    cell(row, "region", r.region);
    cell(row, "id", r.id);
    cell(row, "engine", r.engine);
    flag(row, "healthy", r.healthy);
    cell(row, "draining", r.draining ? "yes" : "no", r.draining ? "note" : "");
    cell(row, "available", r.available ? "yes" : (r.reason || (r.available === false ? "no" : null)),
         r.available ? "yes" : "no");
    num(row, "pending", r.pending);
    num(row, "running", r.running);
    num(row, "outstanding", r.outstanding);
    const kv = cell(row, "kv_usage", r.kv_usage === null || r.kv_usage === undefined ? null : "");
    if (r.kv_usage !== null && r.kv_usage !== undefined) {
      kv.dataset.value = String(r.kv_usage);
      const bar = document.createElement("span"), fill = document.createElement("span");
      bar.className = "kv";
      fill.style.width = `${Math.round(r.kv_usage * 100)}%`;
      bar.append(fill);
      kv.append(bar, `${(r.kv_usage * 100).toFixed(1)}%`);
    }
    cell(row, "balancer", regionOf.get(r.balancer) || r.balancer);
  });
}

function rates(table, view) {
  // Counts a table's rows put by key; a row's rate since the table's last snapshot (null for a new row or the
  // first snapshot); done() keeps this snapshot's counts for the next one.
  const before = previous[table], counts = {};
  const dt = before ? view.time - before.time : 0;
  return {
    rate(key, n) {
      counts[key] = n;
      const was = before && before.counts[key];
      return was === undefined || dt <= 0 ? null : ((n - was) / dt).toFixed(2);
    },
    done() { previous[table] = {counts, time: view.time}; },
  };
}

function drawForwarding(view) {
  const links = view.balancers.flatMap((b) => (b.peers || []).map((p) => ({from: b.region, ...p})));
  const rows = body("forwarding", links.map((l) => `${l.from}>${l.region}`), "no peers");
  const since = rates("forwarding", view);
  links.forEach((l, i) => {
    const row = rows[i];
    cell(row, "from", l.from);
    cell(row, "to", l.region);
    num(row, "forwarded", l.forwarded);
    num(row, "rate", since.rate(`${l.from}>${l.region}`, l.forwarded));
    num(row, "queue_len", l.queue_len);
    flag(row, "available", l.available);
  });
  since.done();
}

function drawRules(view) {
  // Each balancer's placements by the routing profile's plugin that made them (its status's placed_by_rule).
  const items = view.balancers.flatMap((b) => Object.entries(b.placed_by_rule || {})
    .map(([rule, n]) => ({region: b.region, rule, n})));
  const rows = body("rules", items.map((x) => `${x.region}>${x.rule}`), "no placements yet");
  const since = rates("rules", view);
  items.forEach((x, i) => {
    const row = rows[i];
    cell(row, "region", x.region);
    cell(row, "rule", x.rule || "(none)");
    num(row, "placements", x.n);
    num(row, "rate", since.rate(`${x.region}>${x.rule}`, x.n));
  });
  since.done();
}

function drawQuotas(view) {
  const items = view.balancers.filter((b) => b.quota).flatMap((b) => {
    const levels = Object.entries(b.quota.levels || {});
    return (levels.length ? levels : [[null, null]]).map(([bucket, level]) => ({b, bucket, level}));
  });
  const rows = body("quotas", items.map((q) => `${q.b.region}>${q.bucket}`), "no quota status");
  items.forEach(({b, bucket, level}, i) => {
    const row = rows[i], waiting = Object.values(b.quota.waiting || {}).reduce((a, n) => a + n, 0);
    cell(row, "region", b.region);
    cell(row, "backend", b.quota.redis_fallback ? `${b.quota.backend} (falling back)` : b.quota.backend);
    num(row, "share", b.quota.share === null || b.quota.share === undefined ? null
                      : `${(b.quota.share * 100).toFixed(1)}%`);
    num(row, "waiting", waiting);
    cell(row, "bucket", bucket === null ? "(no bucket in use)" : bucket);
    cell(row, "level", level && Object.entries(level).map(([k, v]) => `${k.replace("_", " ")} ${round(v)}`)
      .join(", "));
  });
}

function draw(view) {
  if (view.static_membership) {  // --replica flags: no controller, so no revision to show
    document.getElementById("membership").textContent = "static membership (no controller)";
  } else {
    document.getElementById("revision").textContent = view.revision === null ? "none yet" : String(view.revision);
  }
  const when = document.getElementById("snapshot-time"), at = new Date(view.time * 1000);
  when.dateTime = at.toISOString();
  when.dataset.unix = String(view.time);
  when.textContent = at.toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  drawRegions(view);
  drawReplicas(view);
  drawForwarding(view);
  drawRules(view);
  drawQuotas(view);
}

function setState(text, cls) {
  const state = document.getElementById("state");
  state.textContent = text;
  state.className = `state ${cls}`;
}

async function poll() {
  try {
    const resp = await fetch(STATUS_URL, {credentials: "same-origin", cache: "no-store"});
    if (resp.status === 401 || resp.status === 403) { location.reload(); return; }  // the session ended
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const data = await resp.json();
    draw(data.source === "controller" ? data : fromBalancer(data));
    setState(`live, every ${POLL_MS / 1000} s`, "live");
  } catch (err) {
    setState(`not updated: ${err.message}`, "error");
  }
  setTimeout(poll, POLL_MS);
}

document.addEventListener("DOMContentLoaded", poll);
