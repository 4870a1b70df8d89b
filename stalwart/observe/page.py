"""The dashboard / report page: one self-contained HTML document (inline CSS, JS and SVG; no CDN).

Served live by ``stalwart dashboard`` (the script polls ``api/run``), or written by ``stalwart report``
with the data embedded (``window.STALWART_DATA``), so both show the same content.
"""

from __future__ import annotations

import html

_CSS = """
body{font:14px system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:10px 18px;display:flex;gap:24px;align-items:baseline;
  flex-wrap:wrap}
header h1{font-size:18px;margin:0} header span{opacity:.85}
main{padding:14px 18px;display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));
  gap:14px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:10px 12px;overflow:auto}
section.wide{grid-column:1/-1} h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;font-size:12.5px;width:100%}
td,th{padding:3px 6px;border-bottom:1px solid #eceef2;text-align:left}
th{background:#f1f3f6} tr.flag td{background:#ffe3e0;font-weight:600} tr.wait td{background:#fff6db}
tr.fault td{color:#b3261e}
.nodata{color:#8a93a3;font-style:italic} .note{color:#8a93a3;font-size:12px} svg text{font-size:11px;fill:#4a5366} .legend span{margin-right:12px}
pre{font-size:12px;white-space:pre-wrap;margin:0}
.bar{display:flex;height:22px;border-radius:4px;overflow:hidden;margin:6px 0}
"""

_JS = r"""
const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = ["#2b6cb0", "#d9480f", "#2f9e44", "#862e9c", "#e8590c", "#0b7285", "#5c940d", "#c2255c"];
const FAULTS = /fail|error|restart|fallback|hang|timeout|kill|abort|stopped/;
const byId = (id) => document.getElementById(id);
let HM_FIELD = null;  // the heat map's field (step time or a phase), kept across refreshes

function make(el, attrs, text) {
  for (const k in attrs || {}) el.setAttribute(k, attrs[k]);
  if (text !== undefined) el.textContent = text;
  return el;
}
const svg = (tag, attrs, text) => make(document.createElementNS(SVGNS, tag), attrs, text);
const h = (tag, attrs, text) => make(document.createElement(tag), attrs, text);

function fmt(v) {
  if (v === null || v === undefined) return "-";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e4)) return v.toExponential(2);
  return (+v.toPrecision(4)).toString();
}
const ms = (s) => (s * 1000).toFixed(2);

function nodata(box, msg) {
  box.replaceChildren(h("div", {class: "nodata"}, msg || "no data"));
  box.dataset.points = "0";
}

// A line chart of [[step, value], ...] series, as inline SVG.
function lineChart(box, series) {
  const pts = series.flatMap((s) => s.points);
  if (!pts.length) return nodata(box);
  const W = 420, H = 200, L = 52, R = 10, T = 10, B = 28;
  let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
  let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { const pad = Math.abs(y0 || 1) * 0.1; y0 -= pad; y1 += pad; }
  const sx = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const sy = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  const g = svg("svg", {viewBox: `0 0 ${W} ${H}`, width: "100%", class: "chart-svg"});
  g.appendChild(svg("line", {x1: L, y1: H - B, x2: W - R, y2: H - B, stroke: "#999"}));
  g.appendChild(svg("line", {x1: L, y1: T, x2: L, y2: H - B, stroke: "#999"}));
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4, x = x0 + (x1 - x0) * i / 4;
    g.appendChild(svg("line", {x1: L, x2: W - R, y1: sy(y), y2: sy(y), stroke: "#eee"}));
    g.appendChild(svg("text", {x: L - 4, y: sy(y) + 4, "text-anchor": "end"}, fmt(y)));
    g.appendChild(svg("text", {x: sx(x), y: H - B + 14, "text-anchor": "middle"}, Math.round(x)));
  }
  g.appendChild(svg("text", {x: W - R, y: H - 2, "text-anchor": "end"}, "step"));
  const legend = h("div", {class: "legend"});
  series.forEach((s, i) => {
    const color = COLORS[i];
    const item = h("span", {}, "\u25A0 " + s.name);
    item.style.color = color;
    legend.appendChild(item);
    if (!s.points.length) return;
    const d = s.points.map((p, j) => (j ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join("");
    g.appendChild(svg("path", {d, fill: "none", stroke: color, "stroke-width": 1.6, class: "series",
                               "data-name": s.name}));
    if (s.points.length < 40) {
      s.points.forEach((p) => g.appendChild(svg("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.5, fill: color})));
    }
  });
  box.replaceChildren(g, legend);
  box.dataset.points = String(pts.length);
}
const points = (rows, key) => rows.filter((r) => r[key] !== null && r[key] !== undefined).map((r) => [r.step, r[key]]);

// green (fast) .. red (slow)
function heatColor(t) {
  t = Math.max(0, Math.min(1, t));
  const r = Math.round(255 * Math.min(1, 2 * t)), g = Math.round(255 * Math.min(1, 2 * (1 - t)) * 0.85 + 30);
  return `rgb(${r},${g},70)`;
}

// The rank x step heat map: one <g class="hm-row"> per rank, one <rect> per step.
function heatmap(box, hm) {
  if (!hm || !hm.ranks.length) return nodata(box);
  const n = hm.steps.length, cw = Math.max(2, Math.min(14, Math.floor(860 / Math.max(1, n))));
  const ch = 18, L = 58, T = 6, W = L + cw * n + 10, H = T + ch * hm.ranks.length + 26;
  const vals = hm.matrix.flat().filter((v) => v !== null), lo = Math.min(...vals), hi = Math.max(...vals);
  const g = svg("svg", {width: W, height: H, class: "heatmap-svg"});
  hm.ranks.forEach((rank, i) => {
    const row = svg("g", {class: "hm-row", "data-rank": rank});
    row.appendChild(svg("text", {x: L - 6, y: T + i * ch + 13, "text-anchor": "end"}, "rank " + rank));
    hm.matrix[i].forEach((v, j) => {
      if (v === null) return;
      const fill = heatColor(hi > lo ? (v - lo) / (hi - lo) : 0);
      const cell = svg("rect", {x: L + j * cw, y: T + i * ch, width: cw - 0.5, height: ch - 1, fill, class: "hm-cell"});
      cell.appendChild(svg("title", {}, `rank ${rank} step ${hm.steps[j]}: ${ms(v)} ms`));
      row.appendChild(cell);
    });
    g.appendChild(row);
  });
  const y = T + ch * hm.ranks.length + 14;
  g.appendChild(svg("text", {x: L, y}, "step " + hm.steps[0]));
  g.appendChild(svg("text", {x: L + cw * n, y, "text-anchor": "end"}, "step " + hm.steps[n - 1]));
  g.appendChild(svg("text", {x: L + cw * n / 2, y, "text-anchor": "middle"},
                    `${hm.field}: ${ms(lo)} ms (green) .. ${ms(hi)} ms (red)`));
  box.replaceChildren(g);
}

// Mixture of experts: the expert x step load heat map of one sparse layer (load = count / mean count).
let EXPERT_LAYER = null;
function renderExperts(d) {
  const ex = d.experts, box = byId("experts"), sel = byId("expert-layer");
  byId("experts-section").style.display = ex ? "" : "none";
  if (!ex) return;
  if (sel.options.length !== ex.layers.length) {
    sel.replaceChildren(...ex.layers.map((l) => h("option", {value: l}, "layer " + l)));
  }
  if (!ex.layers.includes(EXPERT_LAYER)) EXPERT_LAYER = ex.layers[0];
  sel.value = EXPERT_LAYER;
  const m = ex.load[EXPERT_LAYER], n = ex.steps.length;
  const cw = Math.max(2, Math.min(14, Math.floor(860 / Math.max(1, n))));
  const ch = 14, L = 70, T = 6, W = L + cw * n + 10, H = T + ch * m.length + 26;
  const hi = Math.max(2, ...m.flat().filter((v) => v !== null));
  const g = svg("svg", {width: W, height: H, class: "experts-svg"});
  m.forEach((row, e) => {
    g.appendChild(svg("text", {x: L - 6, y: T + e * ch + 11, "text-anchor": "end"}, "expert " + e));
    row.forEach((v, j) => {
      if (v === null) return;
      const cell = svg("rect", {x: L + j * cw, y: T + e * ch, width: cw - 0.5, height: ch - 1,
                                fill: heatColor(v / hi), class: "ex-cell"});
      const tip = `layer ${EXPERT_LAYER} expert ${e} step ${ex.steps[j]}: ${v.toFixed(2)} x mean load`;
      cell.appendChild(svg("title", {}, tip));
      g.appendChild(cell);
    });
  });
  const y = T + ch * m.length + 14;
  g.appendChild(svg("text", {x: L, y}, "step " + ex.steps[0]));
  g.appendChild(svg("text", {x: L + cw * n, y, "text-anchor": "end"}, "step " + ex.steps[n - 1]));
  g.appendChild(svg("text", {x: L + cw * n / 2, y, "text-anchor": "middle"},
                    `load / mean: 0 (green) .. ${hi.toFixed(1)} (red)`));
  box.replaceChildren(g);
  const s = ex.series;
  lineChart(byId("chart-balance"), [{name: "max/mean load (layer mean)", points: s.moe_load_imbalance || []},
                                    {name: "worst layer", points: s.moe_load_imbalance_max || []},
                                    {name: "max/mean per EP rank", points: s.moe_ep_imbalance || []}]);
}

function table(box, headers, rows, rowClass) {
  if (!rows.length) return nodata(box);
  const t = h("table"), head = h("tr");
  headers.forEach((x) => head.appendChild(h("th", {}, x)));
  t.appendChild(head);
  rows.forEach((r, i) => {
    const tr = h("tr", {class: rowClass ? rowClass(i) : ""});
    r.forEach((c) => tr.appendChild(h("td", {}, String(c))));
    t.appendChild(tr);
  });
  box.replaceChildren(t);
}

function renderHeader(d) {
  const s = d.summary, last = d.train.length ? d.train[d.train.length - 1] : null;
  byId("run-name").textContent = d.name;
  byId("run-status").textContent = s
    ? `finished: ${s.steps} steps, final loss ${fmt(s.final_loss)}, ${fmt(s.tokens_per_s)} tok/s, ` +
      `MFU ${fmt(100 * (s.mfu || 0))}%`
    : last ? `running: step ${last.step}, loss ${fmt(last.loss)}` : "no metrics yet";
  byId("updated").textContent = "updated " + new Date().toLocaleTimeString() +
    (window.STALWART_DATA ? " (static report)" : " (live)");
}

function renderCharts(d) {
  lineChart(byId("chart-loss"), [{name: "train loss", points: points(d.train, "loss")},
                                 {name: "eval loss", points: points(d.eval, "eval_loss")}]);
  lineChart(byId("chart-tps"), [{name: "tokens/s", points: points(d.train, "tokens_per_s")}]);
  lineChart(byId("chart-mfu"), [{name: "MFU", points: points(d.train, "mfu")}]);
  lineChart(byId("chart-step"), [{name: "step time s", points: points(d.train, "step_time_s")},
                                 {name: "data wait s", points: points(d.train, "data_wait_s")}]);
}

function renderHeatmap(d) {
  const sel = byId("hm-field"), fields = Object.keys(d.heatmaps || {});
  if (sel.options.length !== fields.length) sel.replaceChildren(...fields.map((f) => h("option", {value: f}, f)));
  if (!fields.includes(HM_FIELD)) {  // default: the phase with the worst straggler, else step time
    const rows = (d.stragglers || {}).rows || [];
    const worst = rows.filter((r) => r.flagged && !r.wait && r.phase !== "step_time_s")
                      .sort((a, b) => b.score - a.score)[0];
    HM_FIELD = worst && fields.includes(worst.phase) ? worst.phase : fields[0];
  }
  if (HM_FIELD) sel.value = HM_FIELD;
  heatmap(byId("heatmap"), (d.heatmaps || {})[HM_FIELD]);
}

function renderStragglers(d) {
  const st = d.stragglers;
  if (!st) return nodata(byId("stragglers"), "no data (no timings/ directory)");
  const rows = st.rows;
  table(byId("stragglers"), ["phase", "rank", "median ms", "fastest ms", "score", "flag"],
        rows.map((r) => [r.phase, r.rank, ms(r.median_s), ms(r.fastest_s), r.score === null ? "-" : r.score.toFixed(2),
                         r.flagged ? (r.wait ? "waits (victim)" : "SLOW") : ""]),
        (i) => rows[i].flagged ? (rows[i].wait ? "wait" : "flag") : "");
  byId("suspects").textContent = st.suspects.length
    ? `suspected straggler rank(s): ${st.suspects.join(", ")} (score >= ${st.threshold})`
    : `no stragglers (threshold ${st.threshold})`;
}

// The goodput accounting (stalwart.observe.goodput): ETTR, the wall-time buckets, one row per failure.
function renderGoodput(d) {
  const gp = d.goodput, box = byId("goodput");
  if (!gp) return nodata(box, "no data (no events.jsonl)");
  const parts = Object.entries(gp.buckets), share = (v) => gp.wall_s > 0 ? 100 * v / gp.wall_s : 0;
  const bar = h("div", {class: "bar"});
  parts.forEach(([k, v], i) => {
    const seg = h("div", {title: `${k}: ${v.toFixed(2)} s`});
    seg.style.width = share(v) + "%";
    seg.style.background = COLORS[i];
    bar.appendChild(seg);
  });
  const t = h("div", {id: "goodput-buckets"});
  table(t, ["bucket", "seconds", "share"],
        parts.map(([k, v]) => ["\u25A0 " + k, v.toFixed(2), share(v).toFixed(1) + "%"]));
  t.querySelectorAll("tr").forEach((tr, i) => { if (i) tr.firstChild.style.color = COLORS[i - 1]; });
  const ettr = gp.ettr === null ? "-" : (100 * gp.ettr).toFixed(1) + "%";
  const counts = Object.entries(gp.counts).map(([k, v]) => k + ": " + v).join(", ");
  const head = h("div", {id: "goodput-ettr"}, `goodput: ETTR ${ettr} (productive / wall) of ` +
                 `${gp.wall_s.toFixed(1)} s wall-clock, ${gp.steps_recomputed} steps recomputed`);
  const events = h("div", {class: "note"}, "events: " + counts);
  const sec = (v) => v === null || v === undefined ? "-" : v.toFixed(2);
  const f = h("div", {id: "goodput-failures"});
  table(f, ["failure", "rank", "step", "injected", "detected s", "to next step s", "recomputed"],
        gp.failures.map((x) => [x.kind, x.rank, x.step, x.injected || "-", sec(x.detection_latency_s),
                                sec(x.fault_to_step_s), x.steps_recomputed === null ? "-" : x.steps_recomputed]),
        () => "fault");
  box.replaceChildren(head, events, bar, t, ...(gp.failures.length ? [f] : []));
}

function renderEvents(d) {
  const ev = d.events.slice().reverse();
  const details = (e) => Object.entries(e).filter(([k]) => k !== "time" && k !== "event")
    .map(([k, v]) => k + "=" + (typeof v === "number" ? fmt(v) : JSON.stringify(v))).join("  ");
  table(byId("events"), ["time", "event", "details"],
        ev.map((e) => [new Date(e.time * 1000).toLocaleString(), e.event, details(e)]),
        (i) => FAULTS.test(ev[i].event) ? "fault" : "");
  if (d.flight_text) byId("flight").replaceChildren(h("pre", {}, d.flight_text));
  else nodata(byId("flight"), "no flight-recorder dumps");
}

function render(d) {
  renderHeader(d);
  renderCharts(d);
  renderHeatmap(d);
  renderExperts(d);
  renderStragglers(d);
  renderGoodput(d);
  renderEvents(d);
  document.body.dataset.ready = "1";
}

async function refresh() {
  try {
    const r = await fetch("api/run", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
    byId("err").textContent = "";
  } catch (e) {
    byId("err").textContent = "refresh failed: " + e.message;
  }
}

byId("expert-layer").addEventListener("change", (e) => {
  EXPERT_LAYER = e.target.value;
  if (window.STALWART_DATA) render(window.STALWART_DATA); else refresh();
});
byId("hm-field").addEventListener("change", (e) => {
  HM_FIELD = e.target.value;
  if (window.STALWART_DATA) render(window.STALWART_DATA); else refresh();
});
if (window.STALWART_DATA) render(window.STALWART_DATA);
else { refresh(); setInterval(refresh, 5000); }
"""

_BODY = """
<header><h1>stalwart &middot; <span id="run-name"></span></h1><span id="run-status"></span>
<span id="updated"></span><span id="err" style="color:#ffb4a9"></span></header>
<main>
<section><h2>Loss / eval loss</h2><div id="chart-loss" class="chart"></div></section>
<section><h2>Throughput (tokens/s)</h2><div id="chart-tps" class="chart"></div></section>
<section><h2>MFU</h2><div id="chart-mfu" class="chart"></div></section>
<section><h2>Step time / data wait (s)</h2><div id="chart-step" class="chart"></div></section>
<section class="wide"><h2>Per-rank heat map <select id="hm-field"></select></h2><div id="heatmap"></div></section>
<section class="wide" id="experts-section"><h2>Expert load per step <select id="expert-layer"></select></h2>
<div id="experts"></div><div id="chart-balance" class="chart"></div></section>
<section><h2>Stragglers (rank median / fastest rank's median)</h2><div id="suspects"></div>
<div id="stragglers"></div></section>
<section><h2>Goodput</h2><div id="goodput"></div></section>
<section class="wide"><h2>Event log (newest first)</h2><div id="events"></div></section>
<section class="wide"><h2>Flight recorder</h2><div id="flight"></div></section>
</main>
"""


def render_page(title: str, embedded_json: str | None = None) -> str:
    """The page; with ``embedded_json`` it is a static report that needs no server."""
    data = ""
    if embedded_json is not None:
        data = "<script>window.STALWART_DATA=" + embedded_json.replace("</", "<\\/") + ";</script>\n"
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>stalwart: {html.escape(title)}</title><link rel=\"icon\" href=\"data:,\">"
            f"<style>{_CSS}</style></head>\n<body>{_BODY}{data}<script>{_JS}</script></body></html>\n")
