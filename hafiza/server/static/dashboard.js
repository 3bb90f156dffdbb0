// hafiza dashboard: polls /dashboard/state every second and draws plain canvas charts (no libraries, no CDN).
"use strict";

const POLL_MS = 1000;
const HISTORY = 120;
const PALETTE = ["#4c8bf5", "#f29d38", "#2f9e5b", "#8b3fd1", "#d64545", "#17a2b8", "#9c6b30", "#e83e8c"];
const KEY_STORE = "hafiza-api-key";

const fmt = {
  pct: (v) => (v == null ? "–" : (100 * v).toFixed(1) + " %"),
  int: (v) => (v == null ? "–" : Math.round(v).toLocaleString("en-US")),
  num: (v) => (v == null ? "–" : v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2)),
  secs: (v) => (v == null ? "–" : v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(2) + " s"),
  ratio: (v) => (v == null ? "–" : v.toFixed(2) + "×"),
  bytes: (v) => {
    if (v == null) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
  },
  age: (v) => (v == null ? "–" : v < 60 ? v.toFixed(0) + " s" : v < 3600 ? (v / 60).toFixed(0) + " min"
    : (v / 3600).toFixed(1) + " h"),
};

// A line chart (optionally stacked) over the last HISTORY samples; series may be added while it runs.
class Chart {
  constructor(id, options) {
    this.canvas = document.getElementById(id);
    this.legend = this.canvas.parentElement.querySelector(".legend");
    this.opts = Object.assign({ format: fmt.num, min: 0, max: null, stacked: false, empty: "" }, options);
    this.series = [];
    this.rows = [];
    for (const s of this.opts.series || []) this.addSeries(s.key, s.label, s.color);
  }

  addSeries(key, label, color) {
    if (this.series.some((s) => s.key === key)) return;
    this.series.push({ key, label, color: color || PALETTE[this.series.length % PALETTE.length] });
  }

  push(values) {
    this.rows.push(values);
    if (this.rows.length > HISTORY) this.rows.shift();
    this.canvas.dataset.points = String(this.rows.length);
    this.canvas.dataset.last = JSON.stringify(values);
    this.draw();
  }

  draw() {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth, h = c.clientHeight;
    if (!w || !h) return;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const left = 58, right = 8, top = 8, bottom = 16;
    const pw = w - left - right, ph = h - top - bottom;
    const stackedRows = this.rows.map((row) => this.stack(row));
    let hi = this.opts.max;
    if (hi == null) {
      hi = 0;
      for (const row of stackedRows) for (const s of this.series) if (row[s.key] != null) hi = Math.max(hi, row[s.key]);
      hi = this.opts.integer ? Math.max(2, 2 * Math.ceil(hi / 2)) : hi > 0 ? hi * 1.1 : 1;
    }
    const lo = this.opts.min;
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = "#6b7385";
    g.strokeStyle = "#e3e6ec";
    g.lineWidth = 1;
    for (let i = 0; i <= 2; i += 1) {
      const v = lo + ((hi - lo) * i) / 2;
      const y = top + ph - (ph * i) / 2;
      g.beginPath(); g.moveTo(left, y); g.lineTo(left + pw, y); g.stroke();
      g.fillText(this.opts.format(v), 2, y + 4);
    }
    g.fillText(`${HISTORY} s`, left, h - 2);
    const n = this.rows.length;
    if (n === 0 || this.series.length === 0) {
      if (this.opts.empty) g.fillText(this.opts.empty, left + 8, top + ph / 2);
      this.updateLegend();
      return;
    }
    const x = (i) => left + pw - ((n - 1 - i) * pw) / (HISTORY - 1);
    const y = (v) => top + ph - (ph * (Math.min(Math.max(v, lo), hi) - lo)) / (hi - lo || 1);
    const layered = this.series.filter((s) => !s.noStack).reverse();
    const order = this.opts.stacked ? layered.concat(this.series.filter((s) => s.noStack)) : this.series;
    for (const s of order) {
      g.strokeStyle = s.color;
      g.fillStyle = s.color + "55";
      g.lineWidth = 1.6;
      g.beginPath();
      let open = false, firstX = null, lastX = null;
      for (let i = 0; i < n; i += 1) {
        const v = stackedRows[i][s.key];
        if (v == null) { open = false; continue; }
        if (open) g.lineTo(x(i), y(v)); else { g.moveTo(x(i), y(v)); open = true; }
        if (firstX == null) firstX = x(i);
        lastX = x(i);
      }
      g.stroke();
      if (this.opts.stacked && !s.noStack && firstX != null) {
        g.lineTo(lastX, y(lo)); g.lineTo(firstX, y(lo)); g.closePath(); g.fill();
      }
    }
    this.updateLegend();
  }

  stack(row) {
    if (!this.opts.stacked) return row;
    const out = {};
    let acc = 0;
    for (const s of this.series) {
      if (s.noStack) { out[s.key] = row[s.key]; continue; }
      acc += row[s.key] || 0;
      out[s.key] = acc;
    }
    return out;
  }

  updateLegend() {
    const last = this.rows[this.rows.length - 1] || {};
    this.legend.replaceChildren(...this.series.map((s) => {
      const span = document.createElement("span");
      const swatch = document.createElement("i");
      swatch.style.background = s.color;
      const value = document.createElement("b");
      value.textContent = this.opts.format(last[s.key]);
      span.append(swatch, s.label + " ", value);
      return span;
    }));
  }
}

const charts = {
  usage: new Chart("chart-usage", { format: fmt.pct, max: 1, series: [{ key: "usage", label: "in use" }] }),
  blocks: new Chart("chart-blocks", {
    format: fmt.int, integer: true, stacked: true, series: [
      { key: "in_use", label: "in use", color: "#f29d38" }, { key: "cached", label: "cached", color: "#4c8bf5" },
      { key: "free", label: "free", color: "#c9ced8" }],
  }),
  hit: new Chart("chart-hit", {
    format: fmt.pct, max: 1, series: [{ key: "interval", label: "last second" }, { key: "total", label: "since start" }],
  }),
  ttft: new Chart("chart-ttft", { format: fmt.secs, series: [{ key: "recent", label: "median" }, { key: "last", label: "last" }] }),
  toks: new Chart("chart-toks", { format: fmt.num, series: [{ key: "tok_s", label: "tok/s" }] }),
  reqs: new Chart("chart-reqs", { format: fmt.int, integer: true, series: [{ key: "running", label: "running" }, { key: "waiting", label: "waiting" }] }),
  preempt: new Chart("chart-preempt", {
    format: fmt.int, integer: true, series: [{ key: "preemptions", label: "preemptions" }, { key: "evictions", label: "evictions" },
      { key: "pinned_evictions", label: "pinned evicted" }],
  }),
  tierBytes: new Chart("chart-tier-bytes", { format: fmt.bytes, empty: "no store tiers (serve --store-ram / --store-disk / --store-redis)" }),
  tierHit: new Chart("chart-tier-hit", { format: fmt.pct, max: 1, empty: "no store tiers" }),
  ratio: new Chart("chart-ratio", { format: fmt.ratio, empty: "no store tiers", series: [{ key: "ratio", label: "all tiers" }] }),
};
charts.blocks.addSeries("pinned", "pinned", "#8b3fd1");
charts.blocks.series[3].noStack = true;

let apiKey = sessionStorage.getItem(KEY_STORE) || "";
let previous = null;
let stopped = false;

function headers() {
  return apiKey ? { "x-api-key": apiKey } : {};
}

function setStatus(state, text) {
  const el = document.getElementById("status");
  el.dataset.state = state;
  el.textContent = text;
}

function setText(id, text) {
  document.getElementById(id).textContent = text;
}

function toast(text) {
  const el = document.getElementById("toast");
  el.textContent = text;
  el.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { el.hidden = true; }, 4000);
}

function rate(now, before, num, den) {
  if (!before) return null;
  const dq = den(now) - den(before);
  return dq > 0 ? (num(now) - num(before)) / dq : null;
}

function update(s) {
  setText("model", `${s.model} · ${fmt.int(s.kv.total_blocks)} blocks × ${s.kv.block_size} tokens (${s.kv.dtype}, ${fmt.bytes(s.kv.capacity_bytes)})`);
  const b = s.blocks;
  const hitInterval = rate(s, previous, (x) => x.prefix_cache.hits, (x) => x.prefix_cache.queries);
  setText("tile-usage", fmt.pct(s.kv.usage));
  setText("tile-usage-note", `${fmt.int(s.kv.stored_tokens)} tokens stored, ${fmt.int(s.kv.waste_slots)} slots empty`);
  setText("tile-blocks", `${fmt.int(b.free)} / ${fmt.int(b.cached)} / ${fmt.int(b.in_use)} / ${fmt.int(b.pinned)}`);
  setText("tile-blocks-note", `${fmt.bytes(s.kv.bytes_per_block)} per block`);
  setText("tile-hit", fmt.pct(s.prefix_cache.hit_rate));
  setText("tile-hit-note", `${fmt.int(s.prefix_cache.hits)} of ${fmt.int(s.prefix_cache.queries)} prompt tokens`);
  setText("tile-ttft", fmt.secs(s.rates.ttft_recent_s));
  setText("tile-ttft-note", `last ${fmt.secs(s.rates.ttft_last_s)}`);
  setText("tile-toks", fmt.num(s.rates.tokens_per_s));
  setText("tile-toks-note", `${fmt.int(s.counters.generation_tokens)} generated since start`);
  setText("tile-reqs", `${s.requests.running} / ${s.requests.waiting}`);
  setText("tile-reqs-note", `${fmt.int(s.requests.finished)} finished`);
  setText("tile-preempt", fmt.int(s.counters.preemptions));
  setText("tile-preempt-note", `${fmt.int(s.counters.evictions)} evictions, ${fmt.int(s.counters.pinned_evictions)} pinned`);
  const spec = s.speculative;
  setText("tile-spec", spec ? fmt.pct(spec.draft_tokens ? spec.acceptance_rate : null) : "off");
  setText("tile-spec-note", spec ? `${fmt.int(spec.accepted_tokens)} of ${fmt.int(spec.draft_tokens)} drafted tokens accepted`
    : "speculative decoding is off");
  setText("tile-ratio", fmt.ratio(s.store.compression_ratio));
  setText("tile-ratio-note", s.store.tiers.length ? `tiers: ${s.store.tiers.map((t) => t.name).join(" → ")}` : "no store tiers");

  charts.usage.push({ usage: s.kv.usage });
  charts.blocks.push({ free: b.free, cached: b.cached, in_use: b.in_use, pinned: b.pinned });
  charts.hit.push({ interval: hitInterval, total: s.prefix_cache.hit_rate });
  charts.ttft.push({ recent: s.rates.ttft_recent_s, last: s.rates.ttft_last_s });
  charts.toks.push({ tok_s: s.rates.tokens_per_s });
  charts.reqs.push({ running: s.requests.running, waiting: s.requests.waiting });
  charts.preempt.push({ preemptions: s.counters.preemptions, evictions: s.counters.evictions,
    pinned_evictions: s.counters.pinned_evictions });
  const bytes = {}, hits = {};
  for (const t of s.store.tiers) {
    charts.tierBytes.addSeries(t.name, t.name);
    charts.tierHit.addSeries(t.name, t.name);
    bytes[t.name] = t.bytes;
    const before = previous && previous.store.tiers.find((p) => p.name === t.name);
    hits[t.name] = rate(t, before, (x) => x.hits, (x) => x.hits + x.misses);
    if (hits[t.name] == null) hits[t.name] = t.hit_rate;
  }
  charts.tierBytes.push(bytes);
  charts.tierHit.push(hits);
  charts.ratio.push({ ratio: s.store.compression_ratio });
  renderPrefixes(s);
  renderTiers(s);
  previous = s;
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.append(td);
  return td;
}

function button(label, cls, onClick) {
  const el = document.createElement("button");
  el.type = "button";
  el.textContent = label;
  el.className = cls;
  el.addEventListener("click", onClick);
  return el;
}

function renderPrefixes(s) {
  const body = document.querySelector("#prefix-table tbody");
  setText("prefix-summary", `${s.count} listed in the pool · ${fmt.int(s.unattributed_cached_blocks)} cached blocks not attributed`);
  const rows = s.prefixes.map((p) => {
    const tr = document.createElement("tr");
    tr.dataset.id = p.id;
    tr.dataset.tokens = String(p.tokens);
    const preview = cell(tr, "", "preview");
    preview.append(document.createTextNode(p.head == null ? "(text needs the admin key)" : p.head));
    if (p.tail) {
      const gap = document.createElement("span");
      gap.className = "gap";
      gap.textContent = " … ";
      preview.append(gap, document.createTextNode(p.tail));
    }
    cell(tr, fmt.int(p.tokens) + (p.stranded_blocks ? ` (+${p.stranded_blocks} unreachable blocks)` : ""));
    cell(tr, fmt.int(p.shared_tokens));
    cell(tr, p.in_use_blocks ? `${p.in_use_blocks} blocks` : "–");
    cell(tr, p.pinned_blocks ? `${p.pinned_blocks} blocks · ${fmt.age(p.pin_ttl_s)}` : "–");
    cell(tr, p.ttl_left_s == null ? "–" : fmt.age(p.ttl_left_s));
    cell(tr, fmt.int(p.requests));
    cell(tr, fmt.age(p.idle_s));
    cell(tr, fmt.bytes(p.bytes));
    const td = cell(tr, "");
    td.append(button("drop", "danger drop", () => dropPrefix(p.id)));
    return tr;
  });
  if (rows.length === 0) {
    const tr = document.createElement("tr");
    const td = cell(tr, "no cached prefixes", "empty");
    td.colSpan = 10;
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

function renderTiers(s) {
  const body = document.querySelector("#tier-table tbody");
  const pool = document.createElement("tr");
  pool.dataset.tier = "pool";
  cell(pool, "pool");
  cell(pool, s.kv.dtype + " blocks");
  cell(pool, fmt.int(s.blocks.cached + s.blocks.in_use));
  cell(pool, fmt.bytes((s.blocks.cached + s.blocks.in_use) * s.kv.bytes_per_block));
  cell(pool, fmt.bytes(s.kv.capacity_bytes));
  cell(pool, fmt.pct(s.prefix_cache.hit_rate));
  cell(pool, "–");
  cell(pool, "working pool");
  cell(pool, "").append(button("drop cached", "danger clear", () => clearTier("pool", pool)));
  const rows = [pool];
  for (const t of s.store.tiers) {
    const tr = document.createElement("tr");
    tr.dataset.tier = t.name;
    cell(tr, t.name);
    cell(tr, t.kind);
    cell(tr, fmt.int(t.entries));
    cell(tr, fmt.bytes(t.bytes));
    cell(tr, fmt.bytes(t.capacity_bytes));
    cell(tr, fmt.pct(t.hit_rate));
    cell(tr, fmt.ratio(t.compression_ratio));
    cell(tr, t.degraded ? "unreachable" : t.enabled ? "ok" : "disabled");
    cell(tr, "").append(button("clear", "danger clear", () => clearTier(t.name, tr)));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
}

async function post(url) {
  const r = await fetch(url, { method: "POST", headers: { ...headers(), "content-type": "application/json" }, body: "{}" });
  const body = await r.json().catch(() => ({}));
  if (r.status === 401) askForKey();
  if (!r.ok) throw new Error((body.error && body.error.message) || `HTTP ${r.status}`);
  return body;
}

async function dropPrefix(id) {
  const shared = document.getElementById("include-shared").checked;
  try {
    const r = await post(`/dashboard/prefixes/${encodeURIComponent(id)}/drop?include_shared=${shared}`);
    toast(`dropped ${r.dropped_blocks} blocks (${r.dropped_tokens} tokens)` +
      (r.kept_in_use_blocks ? `, ${r.kept_in_use_blocks} in use kept` : "") +
      (r.kept_shared_blocks ? `, ${r.kept_shared_blocks} shared kept` : "") +
      (r.deleted_from_tiers ? `; deleted from tiers: ${Object.entries(r.deleted_from_tiers)
        .map(([t, n]) => `${t} ${n}`).join(", ")}` : ""));
  } catch (e) {
    toast(`drop failed: ${e.message}`);
  }
  await poll();
}

const armed = new Map();
async function clearTier(name, row) {
  if (armed.get(name) !== true) {  // a second click within 4 s confirms
    armed.set(name, true);
    toast(`click again to clear ${name}`);
    setTimeout(() => armed.delete(name), 4000);
    return;
  }
  armed.delete(name);
  try {
    const r = await post(`/dashboard/tiers/${encodeURIComponent(name)}/clear`);
    toast(name === "pool" ? `dropped ${r.dropped_blocks} cached blocks from the pool`
      : `cleared ${name} (${fmt.int(r.entries_before)} entries before)`);
  } catch (e) {
    toast(`clear failed: ${e.message}`);
  }
  await poll();
}

function askForKey() {
  document.getElementById("key-form").hidden = false;
  document.getElementById("key-button").hidden = false;
  setStatus("auth", apiKey ? "API key refused" : "API key needed");
}

document.getElementById("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = document.getElementById("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, apiKey);
  document.getElementById("key-form").hidden = true;
  poll();
});
document.getElementById("key-button").addEventListener("click", () => {
  document.getElementById("key-form").hidden = false;
});

let inFlight = null;
function poll() {
  if (!inFlight) inFlight = fetchState().finally(() => { inFlight = null; });
  return inFlight;
}

async function fetchState() {
  let r;
  try {
    r = await fetch("/dashboard/state", { headers: headers(), cache: "no-store" });
  } catch (e) {
    setStatus("error", "server unreachable");
    return;
  }
  if (r.status === 401) { askForKey(); return; }
  if (!r.ok) { setStatus("error", `HTTP ${r.status}`); return; }
  const state = await r.json();
  update(state);
  setStatus("live", "live · " + new Date(state.time * 1000).toLocaleTimeString());
  document.getElementById("key-button").hidden = !state.auth;
}

async function loop() {
  while (!stopped) {
    await poll();
    await new Promise((resolve) => setTimeout(resolve, POLL_MS));
  }
}

window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.draw()));
window.hafizaDashboard = { charts, stop: () => { stopped = true; } };
loop();
