// Per-run panels of the dashboard: heat map, experts, stragglers, goodput, events, flight recorder,
// profiler traces. Each takes the panels object of one run (GET api/run?run=ID).
const SVGNS = "http://www.w3.org/2000/svg";
const COLORS = ["#2b6cb0", "#d9480f", "#2f9e44", "#862e9c", "#e8590c", "#0b7285", "#5c940d", "#c2255c"];
const FAULTS = /fail|error|restart|fallback|hang|timeout|kill|abort|stopped|rollback|group_lost|redone/;
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
  plotPairs(byId("chart-balance"), [["max/mean load (layer mean)", s.moe_load_imbalance || []],
                                    ["worst layer", s.moe_load_imbalance_max || []],
                                    ["max/mean per EP rank", s.moe_ep_imbalance || []]]);
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


function renderProfiles(d) {
  const box = byId("profiles"), ps = d.profiles || [];
  if (!ps.length) return nodata(box, "no profiler traces (train with --profile.steps 10-12)");
  const list = h("ul");
  ps.forEach((p) => {
    const li = h("li"), a = h("a", {href: p.href, download: p.name, class: "profile-link"}, p.name);
    li.append(a, ` rank ${p.rank}, ${p.kind === "trace" ? "Chrome trace" : "CUDA memory snapshot"}, ` +
              `${(p.bytes / 1e6).toFixed(1)} MB`);
    list.appendChild(li);
  });
  box.replaceChildren(list, h("div", {class: "note"},
    "Open a trace in https://ui.perfetto.dev (or chrome://tracing), a memory snapshot in https://pytorch.org/memory_viz."));
}
