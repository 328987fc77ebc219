// The live dashboard: polls "stats" (per-second samples of the server's counters) about once a
// second and redraws the tiles and charts. Polling with fetch, rather than an EventSource, lets
// the request carry the API key.

import { api, errorText, formatNumber, formatSeconds, health, showStatus } from "./common.js";
import { drawChart } from "./charts.js";

const POLL_MS = 1000;

const percent = (v) => (v === null || v === undefined ? null : v * 100);
// a - b, or a alone when b is unknown (a server without the disk tier reports no disk hits)
const diff = (a, b) => (a === null || a === undefined ? null : a - (b ?? 0));
const quantiles = (key) => ["p50", "p90", "p99"].map((q, k) => ({
  label: q,
  color: `--series-${k + 1}`,
  value: (s) => (s[key] ? s[key][q] : null),
}));

const CHARTS = [
  {
    id: "tokens",
    title: "Output tokens/s",
    series: [{ label: "tokens/s", color: "--series-1", value: (s) => s.output_tokens_per_s }],
    format: (v) => formatNumber(v, v < 10 ? 1 : 0),
  },
  {
    id: "requests",
    title: "Requests",
    series: [
      { label: "running", color: "--series-1", value: (s) => s.running },
      { label: "waiting", color: "--series-2", value: (s) => s.waiting },
    ],
    format: (v) => formatNumber(v, 0),
    minMax: 4,
    integer: true,
  },
  {
    id: "kv",
    title: "KV cache blocks",
    // Stacked used + cached, scaled to them: beside a large pool, free blocks would flatten
    // the rest to nothing; the legend gives all three.
    stacked: true,
    series: [
      { label: "used", color: "--series-2", value: (s) => s.kv_blocks_used },
      { label: "cached", color: "--series-4", value: (s) => s.kv_blocks_cached },
    ],
    extra: [{ label: "free", color: "--series-3", value: (s) => s.kv_blocks_free }],
    format: (v) => formatNumber(v, 0),
    minMax: 4,
    integer: true,
    subtitle: (doc) => `of ${formatNumber(doc.kv_blocks_total, 0)} blocks × ${doc.block_size} tokens`,
  },
  {
    id: "hit",
    title: "Prefix-cache hit rate",
    stacked: true,
    // hits in RAM and hits loaded from the disk tier (which the hit rate includes)
    series: [
      { label: "RAM", color: "--series-3", value: (s) => percent(diff(s.prefix_cache_hit_rate, s.prefix_cache_disk_hit_rate)) },
      { label: "disk", color: "--series-1", value: (s) => percent(s.prefix_cache_disk_hit_rate) },
    ],
    format: (v) => `${Math.round(v)}%`,
    yMax: () => 100,
  },
  { id: "ttft", title: "Time to first token", series: quantiles("ttft_s"), format: formatSeconds, seconds: true },
  { id: "itl", title: "Inter-token latency", series: quantiles("itl_s"), format: formatSeconds, seconds: true },
  {
    id: "batch",
    title: "Step batch size",
    series: [{ label: "requests per step", color: "--series-4", value: (s) => s.step_batch_size }],
    format: (v) => formatNumber(v, v < 10 ? 1 : 0),
    minMax: 2,
  },
  {
    id: "steps",
    title: "Worker steps/s",
    series: [{ label: "steps/s", color: "--series-1", value: (s) => s.steps_per_s }],
    format: (v) => formatNumber(v, v < 10 ? 1 : 0),
  },
];

const TILES = [
  { id: "now-tokens", label: "Output tok/s", value: (s) => formatNumber(s.output_tokens_per_s, 1) },
  { id: "now-running", label: "Running", value: (s) => String(s.running) },
  { id: "now-waiting", label: "Waiting", value: (s) => String(s.waiting) },
  {
    id: "now-kv",
    label: "KV used",
    value: (s, doc) => (doc.kv_blocks_total ? `${formatNumber((100 * s.kv_blocks_used) / doc.kv_blocks_total, 1)}%` : "–"),
  },
  {
    id: "now-cached",
    label: "KV cached",
    value: (s, doc) => (doc.kv_blocks_total ? `${formatNumber((100 * s.kv_blocks_cached) / doc.kv_blocks_total, 1)}%` : "–"),
  },
  {
    id: "now-hit",
    label: "Prefix hits",
    // With no lookups in the trailing window, the rate since the start.
    value: (s, doc) => {
      const rate = s.prefix_cache_hit_rate ?? doc.totals.prefix_cache_hit_rate;
      return rate === null || rate === undefined ? "–" : `${Math.round(100 * rate)}%`;
    },
    unit: (s) => (s.prefix_cache_hit_rate === null ? "overall" : ""),
  },
  {
    id: "now-disk",
    label: "Disk cache",
    value: (s, doc) => (doc.disk_budget_blocks ? `${formatNumber((100 * s.disk_blocks) / doc.disk_budget_blocks, 1)}%` : "off"),
    unit: (s, doc) => (doc.disk_budget_blocks ? `of ${formatNumber(doc.disk_budget_blocks, 0)} blocks` : ""),
  },
  {
    id: "now-spec",
    label: "Drafts accepted",
    // speculative decoding: the share of drafted tokens verification kept ("–": none drafted)
    value: (s, doc) => {
      const rate = s.spec_acceptance_rate ?? doc.totals.spec_acceptance_rate;
      return rate === null || rate === undefined ? "–" : `${Math.round(100 * rate)}%`;
    },
    unit: (s) => (s.spec_acceptance_rate === null ? "overall" : ""),
  },
  { id: "now-ttft", label: "TTFT p50", value: (s) => formatSeconds(s.ttft_s && s.ttft_s.p50) },
  { id: "now-itl", label: "ITL p50", value: (s) => formatSeconds(s.itl_s && s.itl_s.p50) },
  { id: "now-batch", label: "Batch size", value: (s) => formatNumber(s.step_batch_size, 1) },
];

const state = { doc: null, samples: [], windowS: 300 };
const views = new Map();

function build() {
  const tiles = document.getElementById("tiles");
  for (const tile of TILES) {
    const box = document.createElement("div");
    box.className = "tile";
    const label = document.createElement("div");
    label.className = "label";
    label.textContent = tile.label;
    const value = document.createElement("div");
    value.className = "value";
    value.id = tile.id;
    value.textContent = "–";
    box.append(label, value);
    tiles.append(box);
  }
  const charts = document.getElementById("charts");
  for (const chart of CHARTS) {
    const box = document.createElement("figure");
    box.className = "chart";
    box.id = `chart-${chart.id}`;
    const title = document.createElement("h3");
    title.textContent = chart.title;
    if (chart.subtitle) {
      const subtitle = document.createElement("span");
      subtitle.className = "subtitle";
      title.append(" ", subtitle);
    }
    const legend = document.createElement("div");
    legend.className = "legend";
    const canvas = document.createElement("canvas");
    canvas.setAttribute("role", "img");
    canvas.setAttribute("aria-label", chart.title);
    box.append(title, legend, canvas);
    charts.append(box);
    views.set(chart.id, { legend, canvas, subtitle: title.querySelector(".subtitle") });
  }
  const bar = document.querySelector(".topbar");
  const range = document.createElement("div");
  range.className = "range";
  for (const [label, seconds] of [["1 min", 60], ["2 min", 120], ["5 min", 300]]) {
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = label;
    button.dataset.seconds = String(seconds);
    button.addEventListener("click", () => {
      state.windowS = seconds;
      render();
    });
    range.append(button);
  }
  bar.insertBefore(range, bar.querySelector(".nav-link"));
}

function legendEntry(series, latest, chart) {
  const entry = document.createElement("span");
  const swatch = document.createElement("span");
  swatch.className = `swatch s${series.color.slice(-1)}`;
  const value = latest === null || latest === undefined ? "–" : chart.format(latest);
  entry.append(swatch, `${series.label} ${value}`);
  return entry;
}

// --fairness tenant: the tenants of the largest token counts (doc.tenants is null without it).
function renderTenants(tenants) {
  const section = document.getElementById("tenants");
  section.hidden = !tenants;
  if (!tenants) return;
  document.getElementById("tenants-subtitle").textContent =
    `${tenants.active} active, ${tenants.tracked} named of at most ${formatNumber(tenants.capacity, 0)}, ` +
    `${formatNumber(tenants.preempted, 0)} preempted for fairness (quantum ${formatNumber(tenants.quantum, 0)} tokens)`;
  const rows = tenants.top.map((t) => {
    const row = document.createElement("tr");
    const name = document.createElement("td");
    if (t.name === null) {
      name.className = "anonymous";
      name.textContent = "(no user)";
    } else {
      name.textContent = t.name;
    }
    const tokens = document.createElement("td");
    tokens.textContent = formatNumber(t.tokens, 0);
    const requests = document.createElement("td");
    requests.textContent = String(t.requests);
    row.append(name, tokens, requests);
    return row;
  });
  document.getElementById("tenant-rows").replaceChildren(...rows);
}

function render() {
  const { doc, samples } = state;
  if (!doc) return;
  renderTenants(doc.tenants);
  for (const button of document.querySelectorAll(".range button")) {
    button.classList.toggle("primary", Number(button.dataset.seconds) === state.windowS);
  }
  const latest = samples[samples.length - 1];
  if (latest) {
    for (const tile of TILES) {
      const element = document.getElementById(tile.id);
      element.textContent = tile.value(latest, doc);
      const unit = tile.unit ? tile.unit(latest, doc) : "";
      if (unit) {
        const small = document.createElement("span");
        small.className = "unit";
        small.textContent = unit;
        element.append(small);
      }
    }
  }
  const now = latest ? latest.t : 0;
  const shown = samples.filter((s) => s.t >= now - state.windowS);
  const times = shown.map((s) => s.t);
  for (const chart of CHARTS) {
    const { legend, canvas, subtitle } = views.get(chart.id);
    if (subtitle) subtitle.textContent = chart.subtitle(doc);
    const series = chart.series.map((s) => ({ color: s.color, values: shown.map((x) => s.value(x) ?? null) }));
    const entries = [...chart.series, ...(chart.extra || [])];
    legend.replaceChildren(...entries.map((s) => legendEntry(s, latest ? s.value(latest) : null, chart)));
    drawChart(canvas, {
      times,
      series,
      stacked: chart.stacked,
      integer: chart.integer,
      yMax: chart.yMax ? chart.yMax(doc) : 0,
      minMax: chart.seconds ? 0.01 : chart.minMax,
      axis: chart.seconds ? "seconds" : chart.id === "hit" ? "percent" : "number",
      windowS: state.windowS,
    });
  }
}

async function poll() {
  const status = document.getElementById("server-status");
  try {
    const last = state.samples.length ? state.samples[state.samples.length - 1].t : null;
    const response = await api(last === null ? "stats" : `stats?since=${last}`, { cache: "no-store" });
    if (!response.ok) throw new Error(await errorText(response));
    const doc = await response.json();
    state.doc = doc;
    state.samples.push(...doc.samples);
    const keep = doc.history_s || 300;
    const newest = state.samples.length ? state.samples[state.samples.length - 1].t : 0;
    state.samples = state.samples.filter((s) => s.t >= newest - keep);
    document.getElementById("model-name").textContent = doc.model || "";
    document.getElementById("history").textContent = `${Math.round(keep / 60)} minutes`;
    document.getElementById("trailing").textContent = `${doc.trailing_s} s`;
    showStatus(status, await health());
    render();
  } catch (error) {
    showStatus(status, "unreachable");
    status.title = String(error.message || error);
  }
  setTimeout(poll, POLL_MS);
}

build();
window.addEventListener("resize", render);
poll();
