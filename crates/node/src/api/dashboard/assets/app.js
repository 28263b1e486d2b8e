// Headroom dashboard: polls GET /v1/stats every second and draws it.
//
// The bearer token comes from the URL fragment (/#token=..., which browsers never send to the
// server) or the form, and is kept in sessionStorage (this tab only). The fragment is removed
// from the address bar once read. Everything shown is set as text (never as HTML), so a volume
// name cannot inject markup; the server's Content-Security-Policy forbids inline script anyway.
"use strict";

const TOKEN_KEY = "headroom-token";
const POLL_MS = 1000;
const WINDOW_S = 300; // history drawn
const SERIES_MAX = 6; // volumes drawn per chart
const COLORS = ["#2f6fde", "#8a4bd6", "#1f9d63", "#d98a00", "#d6453d", "#0f9bb3"];
const DIMENSIONS = ["cpu_ns", "ingress_bytes", "egress_bytes", "device_units"];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  samples: [], // oldest first, at most WINDOW_S, keyed by unix_ms
  report: null,
  colors: new Map(), // volume name -> colour, stable while shown
  timer: null,
};

function $(id) { return document.getElementById(id); }

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

function readFragmentToken() {
  const hash = window.location.hash.replace(/^#/, "");
  if (!hash) return;
  const params = new URLSearchParams(hash);
  const value = params.get("token");
  if (value) {
    sessionStorage.setItem(TOKEN_KEY, value);
    // Keep the token out of the address bar, bookmarks and screenshots.
    history.replaceState(null, "", window.location.pathname + window.location.search);
  }
}

function showMessage(kind, text) {
  const box = $("message");
  box.dataset.kind = kind;
  box.textContent = text;
  box.hidden = false;
}

function clearMessage() {
  const box = $("message");
  box.hidden = true;
  box.dataset.kind = "";
  box.textContent = "";
}

function setStatus(kind, text) {
  // Anything but live dims the numbers on screen: they are no longer current.
  document.body.dataset.state = kind;
  const el = $("status");
  el.dataset.state = kind;
  el.textContent = text;
}

// ---------------------------------------------------------------- formatting

function fmtInt(v) {
  if (v === null || v === undefined) return "–";
  return Math.round(v).toLocaleString("en-US");
}
function fmtMBps(bytesPerS) {
  if (bytesPerS === null || bytesPerS === undefined) return "–";
  const mb = bytesPerS / 1e6;
  return mb >= 100 ? mb.toFixed(0) : mb.toFixed(1);
}
function fmtLatency(us) {
  if (us === null || us === undefined) return "–";
  if (us >= 1000) return (us / 1000).toFixed(us >= 100000 ? 0 : 2) + " ms";
  return us.toFixed(0) + " µs";
}
function fmtPercent(v) { return (v * 100).toFixed(v >= 0.1 ? 0 : 1) + " %"; }
function fmtCredits(c) {
  if (!c) return "–";
  if (c.iops !== null && c.iops !== undefined) return fmtInt(c.iops);
  if (c.bytes !== null && c.bytes !== undefined) return fmtMBps(c.bytes) + " MB";
  return "–";
}
// null: unlimited; 0: no promise (an unlimited volume's baseline is 0: it runs on spare).
function fmtBaseline(b) {
  const parts = [];
  if (b.iops) parts.push(fmtInt(b.iops) + " IOPS");
  if (b.bytes_per_s) parts.push(fmtMBps(b.bytes_per_s) + " MB/s");
  if (parts.length) return parts.join(" · ");
  return b.iops === null && b.bytes_per_s === null ? "unlimited" : "none";
}
function fmtLending(l) {
  if (!l) return "";
  const parts = [];
  if (l.unused_iops) parts.push(fmtInt(l.unused_iops) + " IOPS");
  if (l.unused_bytes_per_s) parts.push(fmtMBps(l.unused_bytes_per_s) + " MB/s");
  return parts.join(" · ");
}
function fmtTime(ms) { return new Date(ms).toLocaleTimeString("en-GB", { hour12: false }); }

// Short axis labels: 1.2k, 35, 0.5.
function fmtAxis(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(1).replace(/\.0$/, "") + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(1).replace(/\.0$/, "") + "M";
  if (a >= 1e3) return String(Number((v / 1e3).toFixed(2))) + "k";
  if (a >= 10 || v === 0) return v.toFixed(0);
  return String(Number(v.toFixed(2)));
}

function phaseOf(v) {
  if (v.iops === null || v.iops === undefined) return ["unknown", "–"];
  if (v.bursting) {
    const p = v.phase_iops || {};
    const on = p.burst_credit > 0 && p.burst_spare > 0 ? "credits + spare"
      : p.burst_spare > 0 ? "spare" : "credits";
    return ["burst", "burst · " + on];
  }
  if (v.queue_depth > 0) return ["throttled", "throttled"];
  if (v.iops > 0 || v.bytes_per_s > 0) return ["baseline", "baseline"];
  return ["idle", "idle"];
}

// ---------------------------------------------------------------- SVG drawing

function el(name, attrs, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  // Four gridlines: maxima whose quarters are round (0.25, 0.5, 1, 1.5, 2, 2.5).
  for (const m of [1, 2, 4, 6, 8, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// series: [{color, points: [[unix_ms, value|null]]}]; draws on a fixed time window.
function lineChart(svg, series, opts) {
  const w = Math.max(svg.clientWidth || 560, 200);
  const h = Math.max(svg.clientHeight || 170, 60);
  const pad = opts.spark ? { l: 0, r: 0, t: 2, b: 2 } : { l: 44, r: 8, t: 8, b: 20 };
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  const t1 = opts.t1, t0 = opts.t1 - opts.spanMs;
  let max = opts.yMax || 0;
  for (const s of series) for (const [, v] of s.points) if (v !== null && v > max) max = v;
  max = opts.fixedMax || niceMax(max);
  const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * (w - pad.l - pad.r);
  const y = (v) => h - pad.b - (v / max) * (h - pad.t - pad.b);
  if (!opts.spark) {
    for (let i = 0; i <= 4; i++) {
      const v = (max * i) / 4;
      svg.append(el("line", { class: "grid", x1: pad.l, x2: w - pad.r, y1: y(v), y2: y(v) }));
      svg.append(el("text", { x: pad.l - 6, y: y(v) + 3.5, "text-anchor": "end" },
        opts.axis ? opts.axis(v) : fmtAxis(v)));
    }
    const step = [10, 15, 30, 60, 120].find((s) => s * 5 >= opts.spanMs / 1000) || 60;
    for (let k = 0; k * step * 1000 <= opts.spanMs; k++) {
      const ago = k * step;
      const label = ago === 0 ? "now" : ago % 60 === 0 ? `−${ago / 60} min` : `−${ago} s`;
      const edge = ago === 0 ? "end" : ago * 1000 >= opts.spanMs ? "start" : "middle";
      svg.append(el("text", { x: x(t1 - ago * 1000), y: h - 5, "text-anchor": edge }, label));
    }
  } else {
    svg.append(el("line", { class: "grid", x1: 0, x2: w, y1: y(0), y2: y(0), stroke: "#e3e7ee" }));
  }
  let drawn = 0;
  for (const s of series) {
    let d = "";
    let pen = false;
    for (const [t, v] of s.points) {
      if (t < t0 || v === null || v === undefined) { pen = false; continue; }
      d += `${pen ? "L" : "M"}${x(t).toFixed(1)},${y(Math.min(v, max)).toFixed(1)}`;
      pen = true;
    }
    if (!d) continue;
    drawn++;
    if (opts.fill) {
      const first = s.points.find(([t, v]) => t >= t0 && v !== null);
      const last = [...s.points].reverse().find(([t, v]) => t >= t0 && v !== null);
      if (first && last && s.points.every(([, v]) => v !== null)) {
        svg.append(el("path", {
          d: `${d}L${x(last[0]).toFixed(1)},${y(0)}L${x(first[0]).toFixed(1)},${y(0)}Z`,
          fill: s.color, "fill-opacity": 0.12, stroke: "none",
        }));
      }
    }
    svg.append(el("path", {
      d, fill: "none", stroke: s.color, "stroke-width": opts.spark ? 1.5 : 1.8,
      "stroke-linejoin": "round", "stroke-linecap": "round",
    }));
  }
  if (!drawn && !opts.spark) {
    svg.append(el("text", { class: "empty", x: w / 2, y: h / 2, "text-anchor": "middle" },
      opts.empty || "no data yet"));
  }
}

// ---------------------------------------------------------------- rendering

// The time drawn: the history there is, at least a minute, at most WINDOW_S.
function spanMs() {
  if (state.samples.length < 2) return 60000;
  const have = state.samples[state.samples.length - 1].unix_ms - state.samples[0].unix_ms;
  return Math.min(WINDOW_S * 1000, Math.max(60000, have));
}

function spanLabel(ms) {
  return ms >= 120000 ? `${Math.round(ms / 60000)} min` : `${Math.round(ms / 1000)} s`;
}

function colorFor(name) {
  if (!state.colors.has(name)) {
    const used = new Set(state.colors.values());
    const free = COLORS.find((c) => !used.has(c)) || COLORS[state.colors.size % COLORS.length];
    state.colors.set(name, free);
  }
  return state.colors.get(name);
}

function renderNode(report) {
  const last = state.samples[state.samples.length - 1];
  const t1 = last ? last.unix_ms : Date.now();
  for (const dim of DIMENSIONS) {
    const card = $("util-" + dim);
    const valueEl = card.querySelector(".card-value");
    const value = last ? last.node.utilisation[dim] : null;
    const capacity = report.capacity_per_second[dim];
    card.dataset.value = value === null || value === undefined ? "" : String(value);
    if (!report.scheduler) {
      valueEl.textContent = "no scheduler";
      valueEl.className = "card-value unlimited";
      card.dataset.level = "";
    } else if (capacity === null || capacity === undefined) {
      valueEl.textContent = "unlimited";
      valueEl.className = "card-value unlimited";
      card.dataset.level = "";
    } else {
      valueEl.textContent = value === null || value === undefined ? "–" : fmtPercent(value);
      valueEl.className = "card-value";
      card.dataset.level = value >= 0.9 ? "bad" : value >= 0.7 ? "warn" : "";
    }
    const points = state.samples.map((s) => [s.unix_ms, s.node.utilisation[dim]]);
    lineChart(card.querySelector(".spark"), [{ color: "#2f6fde", points }],
      { t1, spanMs: spanMs(), spark: true, fill: true, yMax: 1 });
  }
  const iops = last ? last.node.iops : null;
  const bytes = last ? last.node.bytes_per_s : null;
  $("node-iops").textContent = fmtInt(iops);
  $("node-iops").dataset.value = iops === null || iops === undefined ? "" : String(iops);
  $("node-mbps").textContent = fmtMBps(bytes);
  $("node-mbps").dataset.value = bytes === null || bytes === undefined ? "" : String(bytes);
  const active = last ? last.volumes_active : 0;
  $("node-volumes").textContent =
    `${active} active of ${report.volumes_tracked} volume${report.volumes_tracked === 1 ? "" : "s"}`;
}

function chip(list, name, detail, data) {
  const li = document.createElement("li");
  li.dataset.volume = name;
  for (const [k, v] of Object.entries(data || {})) li.dataset[k] = String(v);
  const b = document.createElement("b");
  b.textContent = name;
  li.append(b, document.createTextNode(detail));
  list.append(li);
}

function renderSpare(report) {
  const bursting = $("bursting-list");
  bursting.replaceChildren();
  for (const v of report.bursting) {
    const parts = [];
    if (v.burst_credit_iops > 0) parts.push(fmtInt(v.burst_credit_iops) + " IOPS on credits");
    if (v.burst_spare_iops > 0) parts.push(fmtInt(v.burst_spare_iops) + " IOPS on spare");
    chip(bursting, v.name, parts.join(" · "),
      { creditIops: v.burst_credit_iops, spareIops: v.burst_spare_iops });
  }
  if (!report.bursting.length) {
    const li = document.createElement("li");
    li.className = "none";
    li.textContent = report.scheduler ? "no volume is bursting" : "no scheduler: burst phases unknown";
    bursting.append(li);
  }
  const lending = $("lending-list");
  lending.replaceChildren();
  for (const v of report.lending) {
    chip(lending, v.name, fmtLending(v) + " unused",
      { unusedIops: v.unused_iops === null ? "" : v.unused_iops });
  }
  if (!report.lending.length) {
    const li = document.createElement("li");
    li.className = "none";
    li.textContent = "no volume is under a finite baseline";
    lending.append(li);
  }
  const s = report.spare;
  $("spare-summary").textContent = s.lending_volumes
    ? `${s.lending_volumes} volume${s.lending_volumes === 1 ? "" : "s"}, ${fmtInt(s.unused_baseline_iops)} IOPS`
      + (s.unused_baseline_bytes_per_s ? ` · ${fmtMBps(s.unused_baseline_bytes_per_s)} MB/s` : "")
    : "none";
}

function chartVolumes(report) {
  // The busiest now, then whoever was busiest over the window, up to SERIES_MAX.
  const names = [];
  for (const v of report.volumes) {
    if (names.length >= SERIES_MAX) break;
    if ((v.iops || 0) > 0 || (v.bytes_per_s || 0) > 0) names.push(v.name);
  }
  const totals = new Map();
  for (const s of state.samples) for (const v of s.volumes) {
    totals.set(v.name, (totals.get(v.name) || 0) + (v.iops || 0));
  }
  for (const [name, total] of [...totals.entries()].sort((a, b) => b[1] - a[1])) {
    if (names.length >= SERIES_MAX || total <= 0) break;
    if (!names.includes(name)) names.push(name);
  }
  for (const name of [...state.colors.keys()]) if (!names.includes(name)) state.colors.delete(name);
  return names;
}

function renderCharts(report) {
  const names = chartVolumes(report);
  const last = state.samples[state.samples.length - 1];
  const t1 = last ? last.unix_ms : Date.now();
  const series = (pick) => names.map((name) => ({
    color: colorFor(name),
    points: state.samples.map((s) => {
      const v = s.volumes.find((x) => x.name === name);
      return [s.unix_ms, v ? pick(v) : null];
    }),
  }));
  const legend = $("legend");
  legend.replaceChildren();
  for (const name of names) {
    const li = document.createElement("li");
    li.style.setProperty("--swatch", colorFor(name));
    li.textContent = name;
    legend.append(li);
  }
  const span = spanMs();
  for (const label of document.querySelectorAll(".window-label")) label.textContent = spanLabel(span);
  const empty = report.scheduler ? "no volume has done I/O yet" : "no scheduler: no per-volume counters";
  lineChart($("chart-iops"), series((v) => v.iops), { t1, spanMs: span, empty });
  lineChart($("chart-mbps"), series((v) => (v.bytes_per_s === null ? null : v.bytes_per_s / 1e6)), { t1, spanMs: span, empty });
  lineChart($("chart-latency"), series((v) => v.latency_us_mean),
    { t1, spanMs: span, empty,
      axis: (v) => (v === 0 ? "0" : v >= 1000 ? fmtAxis(v / 1000) + " ms" : fmtAxis(v) + " µs") });
  lineChart($("chart-credits"), series((v) => (v.credits ? v.credits.iops : null)),
    { t1, spanMs: span, empty: "no volume with IOPS credits" });
}

function cell(row, field, text, value, cls) {
  const td = document.createElement("td");
  td.dataset.field = field;
  if (value !== undefined) td.dataset.value = value === null ? "" : String(value);
  if (cls) td.className = cls;
  td.textContent = text;
  row.append(td);
  return td;
}

// The promise audit over the history drawn: seconds this volume wanted its baseline and got
// less (the node's fault), and the I/Os it was owed then.
function promiseOver(name) {
  let seconds = 0, ops = 0, seen = false;
  for (const sample of state.samples) {
    const v = sample.volumes.find((row) => row.name === name);
    if (v && v.promise) {
      seen = true;
      seconds += v.promise.short_seconds;
      ops += v.promise.shortfall_ops;
    }
  }
  return seen ? { seconds, ops } : null;
}

function fmtPromise(v, p) {
  if (!p || !(v.baseline.iops || v.baseline.bytes_per_s)) return "–"; // no baseline, no promise
  if (p.seconds === 0) return "kept";
  return `${fmtInt(p.seconds)} s short · ${fmtInt(p.ops)} I/Os`;
}

function renderTable(report) {
  const body = $("volumes-body");
  const rows = [];
  for (const v of report.volumes) {
    const tr = document.createElement("tr");
    tr.dataset.volume = v.name;
    tr.dataset.bursting = String(v.bursting);
    tr.dataset.lending = String(!!v.lending);
    const name = cell(tr, "name", "", undefined, "name");
    if (state.colors.has(v.name)) {
      const sw = document.createElement("span");
      sw.className = "swatch";
      sw.style.background = state.colors.get(v.name);
      name.append(sw);
    }
    name.append(document.createTextNode(v.name));
    cell(tr, "tenant", v.tenant || "–", v.tenant);
    cell(tr, "iops", fmtInt(v.iops), v.iops, "num");
    cell(tr, "bytes_per_s", fmtMBps(v.bytes_per_s), v.bytes_per_s, "num");
    cell(tr, "latency_us_mean", fmtLatency(v.latency_us_mean), v.latency_us_mean, "num");
    cell(tr, "latency_us_p99", fmtLatency(v.latency_us_p99 ?? null), v.latency_us_p99 ?? null, "num");
    cell(tr, "queue_depth", v.queue_depth === null ? "–" : fmtInt(v.queue_depth), v.queue_depth, "num");
    cell(tr, "credits", fmtCredits(v.credits), v.credits ? v.credits.iops : null, "num");
    const [phase, label] = phaseOf(v);
    const td = cell(tr, "phase", "", phase);
    const span = document.createElement("span");
    span.className = "phase";
    span.dataset.phase = phase;
    span.textContent = label;
    td.append(span);
    cell(tr, "baseline", fmtBaseline(v.baseline), v.baseline.iops, "num");
    cell(tr, "lending", fmtLending(v.lending), v.lending ? v.lending.unused_iops : null, "num lend");
    const promise = promiseOver(v.name);
    cell(tr, "promise_short_seconds", fmtPromise(v, promise), promise ? promise.seconds : null,
      promise && promise.seconds > 0 ? "num short" : "num");
    rows.push(tr);
  }
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = 12;
    td.className = "muted";
    td.textContent = "no volumes";
    tr.append(td);
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  const more = report.volumes_tracked - report.volumes.length;
  $("volumes-note").textContent = "this second, busiest first"
    + (more > 0 ? ` · ${more} more not shown` : "")
    + (report.volumes_total > report.volumes_tracked
      ? ` · ${report.volumes_total - report.volumes_tracked} beyond the 10,000 followed` : "");
}

function render(report) {
  const policy = $("policy");
  policy.textContent = "policy " + report.policy;
  policy.dataset.policy = report.policy;
  const last = state.samples[state.samples.length - 1];
  const stamp = $("sample-time");
  stamp.dataset.unixMs = last ? String(last.unix_ms) : "";
  stamp.textContent = last ? "sample " + fmtTime(last.unix_ms) : "waiting for the first sample";
  renderNode(report);
  renderSpare(report);
  renderCharts(report);
  renderTable(report);
  $("footer").textContent = report.note
    ? report.note
    : `Headroom · sampled every ${report.interval_ms} ms · GET /v1/stats`;
}

// ---------------------------------------------------------------- polling

function merge(samples) {
  const lastMs = state.samples.length ? state.samples[state.samples.length - 1].unix_ms : 0;
  for (const s of samples) if (s.unix_ms > lastMs) state.samples.push(s);
  const cutoff = (state.samples.length ? state.samples[state.samples.length - 1].unix_ms : 0)
    - WINDOW_S * 1000;
  while (state.samples.length && state.samples[0].unix_ms < cutoff) state.samples.shift();
}

async function poll() {
  state.timer = null;
  const tok = token();
  if (!tok) {
    setStatus("unauthorized", "no token");
    showMessage("no-token",
      "No API token. Open this page as /#token=YOUR_TOKEN, or paste the token above (it is kept for this tab only).");
    return; // the form restarts polling
  }
  const last = state.samples[state.samples.length - 1];
  const seconds = last
    ? Math.min(WINDOW_S, Math.max(2, Math.ceil((Date.now() - last.unix_ms) / 1000) + 2))
    : WINDOW_S;
  try {
    const response = await fetch(`/v1/stats?seconds=${seconds}&limit=50`, {
      headers: { Authorization: "Bearer " + tok },
      cache: "no-store",
    });
    if (response.status === 401) {
      setStatus("unauthorized", "unauthorized");
      showMessage("unauthorized",
        "401 Unauthorized: the server refused this API token. Paste the right token above, or open /#token=YOUR_TOKEN.");
    } else if (!response.ok) {
      let reason = `${response.status} ${response.statusText}`;
      try { reason = (await response.json()).error || reason; } catch (e) { /* not JSON */ }
      setStatus("error", "error");
      showMessage("error", "The API answered: " + reason);
    } else {
      const report = await response.json();
      merge(report.samples);
      state.report = report;
      clearMessage();
      setStatus("live", "live");
      render(report);
    }
  } catch (err) {
    setStatus("error", "offline");
    showMessage("error", "Cannot reach the Headroom API (" + err.message + "). Retrying every second.");
  }
  schedule();
}

function schedule() {
  if (state.timer === null) state.timer = setTimeout(poll, POLL_MS);
}

function restart() {
  if (state.timer !== null) clearTimeout(state.timer);
  state.timer = null;
  state.samples = [];
  poll();
}

window.addEventListener("DOMContentLoaded", () => {
  readFragmentToken();
  window.addEventListener("hashchange", () => { readFragmentToken(); restart(); });
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = $("token-input");
    if (input.value.trim()) sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    restart();
  });
  $("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    restart();
  });
  window.addEventListener("resize", () => { if (state.report) render(state.report); });
  poll();
});
