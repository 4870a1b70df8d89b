// The dashboard: pick runs, compare their curves (uPlot: drag to zoom, double-click to reset, values
// under the cursor in the legend), smoothing, log scale; the per-run panels of one focused run.
// Live: polls api/runs, api/series (only the steps after those already shown) and api/run.
// Static report: window.STALWART_DATA = {root, runs, series: {id: ...}, panels: {id: ...}}.

const STATIC = window.STALWART_DATA || null;
const POINTS = 2000;            // per field, downsampled on the server (LTTB)
const CHARTS = [                 // [element id, fields]; the first field solid, the second dashed
  ["chart-loss", ["loss", "eval_loss"]], ["chart-lr", ["lr"]], ["chart-gnorm", ["grad_norm"]],
  ["chart-tps", ["tokens_per_s"]], ["chart-mfu", ["mfu"]], ["chart-step", ["step_time_s", "data_wait_s"]],
  // `stalwart rl` runs (their sections are shown only when a picked run has RL steps)
  ["chart-reward", ["reward_mean", "held_out_reward"]], ["chart-kl", ["kl", "clip_fraction"]],
  ["chart-mismatch", ["logprob_mismatch_max"]], ["chart-staleness", ["staleness_max"]],
  ["chart-rl-tps", ["rollout_tokens_per_s", "trainer_tokens_per_s"]],
  ["chart-idle", ["generator_idle_frac", "trainer_idle_frac"]],
];
const RL_CHARTS = new Set(["chart-reward", "chart-kl", "chart-mismatch", "chart-staleness", "chart-rl-tps",
                           "chart-idle"]);
const MARKS = /restart|recover|rollback|resumed|failure|skip|spike|exclu|controller_start|group_step_redone|group_transfer|island_sync/;
const S = {runs: [], picked: null, focus: null, data: {}, panels: null, charts: {}, sigs: {},
           smooth: 0, log: false, zoomed: false, xrange: null, syncing: false, marks: []};

const stepFmt = (v) => v == null ? "-" : Math.abs(v) >= 1e6 ? (v / 1e6).toFixed(2) + "M"
  : Math.abs(v) >= 1e4 ? (v / 1e3).toFixed(0) + "k" : String(Math.round(v));
const enc = encodeURIComponent;
function axisFmt(v) {   // short tick labels: 30k, 1.5M, 3e-4
  if (v == null) return "";
  const a = Math.abs(v);
  if (a >= 1e9) return +(v / 1e9).toPrecision(3) + "G";
  if (a >= 1e6) return +(v / 1e6).toPrecision(3) + "M";
  if (a >= 1e4) return +(v / 1e3).toPrecision(3) + "k";
  if (a !== 0 && a < 1e-2) return v.toExponential(1);
  return String(+v.toPrecision(3));
}

async function getJSON(url, stats) {
  const r = await fetch(url, {cache: "no-store"});
  const text = await r.text();
  if (stats) stats.bytes += text.length;
  if (!r.ok) throw new Error(`HTTP ${r.status}: ${text.slice(0, 200)}`);
  return JSON.parse(text);
}

// ---------------------------------------------------------------- data
function smoothEMA(ys, w) {   // exponential moving average, bias-corrected as TensorBoard does
  if (!w) return ys;
  const out = new Array(ys.length);
  let s = 0, n = 0;
  for (let i = 0; i < ys.length; i++) {
    if (ys[i] == null) { out[i] = null; continue; }
    s = w * s + (1 - w) * ys[i]; n++;
    out[i] = s / (1 - Math.pow(w, n));
  }
  return out;
}
const shown = (ys, smooth) => {   // the second field of a chart (eval loss, data wait) is never smoothed
  const s = smooth ? smoothEMA(ys, S.smooth) : ys;
  return S.log ? s.map((v) => v != null && v > 0 ? v : null) : s;
};

function append(have, d) {   // new points after have.last_step, per field
  for (const f in d.fields) {
    const a = have.fields[f] || (have.fields[f] = {x: [], y: []}), b = d.fields[f];
    for (let i = 0; i < b.x.length; i++) { a.x.push(b.x[i]); a.y.push(b.y[i]); }
    if (a.x.length > 2 * POINTS) have.reload = true;   // next refresh: the whole curve, downsampled again
  }
  have.last_step = d.last_step; have.gen = d.gen; have.steps_logged = d.steps_logged;
}

async function fetchSeries(rid, stats) {
  const have = S.data[rid];
  let url = `api/series?run=${enc(rid)}&points=${POINTS}`;
  if (have && !have.reload && have.last_step != null) url += `&since=${have.last_step}&gen=${have.gen}`;
  const d = await getJSON(url, stats);
  if (d.full || !have) S.data[rid] = d; else append(have, d);
}

// ---------------------------------------------------------------- charts
function tableFor(fields) {
  const parts = [], meta = [];
  S.picked.forEach((rid, ri) => {
    const d = S.data[rid];
    if (!d) return;
    fields.forEach((f, fi) => {
      const s = d.fields[f];   // a field no line of the run carries (all null) is not drawn
      if (s && s.x.length && s.y.some((v) => v != null)) {
        parts.push([s.x, shown(s.y, fi === 0)]); meta.push({rid, f, ri, fi});
      }
    });
  });
  return parts.length ? {data: uPlot.join(parts), meta} : null;
}

function drawMarks(u) {
  if (!S.marks.length || !u.root.parentNode || u.root.parentNode.id !== "chart-loss") return;
  const ctx = u.ctx, dpr = devicePixelRatio || 1;
  ctx.save();
  ctx.strokeStyle = ctx.fillStyle = "#c92a2a"; ctx.setLineDash([4 * dpr, 3 * dpr]);
  ctx.font = `${10 * dpr}px system-ui,sans-serif`;
  S.marks.forEach((m, i) => {
    if (m.step < u.scales.x.min || m.step > u.scales.x.max) return;
    const x = Math.round(u.valToPos(m.step, "x", true));
    ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
    ctx.fillText(m.event, x + 3 * dpr, u.bbox.top + (11 + 12 * (i % 4)) * dpr);   // staggered labels
  });
  ctx.restore();
}

function syncX(u) {   // zooming one chart zooms all of them to the same steps
  if (S.syncing) return;
  S.syncing = true;
  S.xrange = S.zoomed ? [u.scales.x.min, u.scales.x.max] : null;
  for (const c of Object.values(S.charts)) {
    if (c !== u) c.setScale("x", {min: u.scales.x.min, max: u.scales.x.max});
  }
  S.syncing = false;
}

function newChart(box, t) {
  const series = [{label: "step", value: (u, v) => stepFmt(v)}];
  t.meta.forEach((m) => series.push({
    label: (S.picked.length > 1 ? m.rid + " " : "") + m.f.replace(/_/g, " "),
    stroke: COLORS[m.ri % COLORS.length], width: 1.5, dash: m.fi ? [6, 4] : undefined, spanGaps: true,
    points: {show: false}, value: (u, v) => fmt(v),
  }));
  const opts = {
    width: Math.max(300, box.clientWidth - 4), height: 220, series,
    scales: {x: {time: false}, y: {distr: S.log ? 3 : 1}},
    axes: [{values: (u, ticks) => ticks.map(stepFmt), label: "step", labelSize: 14},
           {values: (u, ticks) => ticks.map(axisFmt), size: 56}],
    cursor: {sync: {key: "stalwart"}, drag: {x: true, y: false}},
    legend: {live: true},
    hooks: {setScale: [(u, key) => { if (key === "x") syncX(u); }], draw: [drawMarks],
            setSelect: [() => { S.zoomed = true; }]},
  };
  const u = new uPlot(opts, t.data, box);
  u.over.addEventListener("dblclick", () => { S.zoomed = false; });
  return u;
}

function renderCharts() {
  const rl = CHARTS.some(([id, fields]) => RL_CHARTS.has(id) && tableFor(fields));
  document.querySelectorAll("section.rl").forEach((el) => { el.style.display = rl ? "" : "none"; });
  document.body.dataset.rl = rl ? "1" : "0";
  for (const [id, fields] of CHARTS) {
    const box = byId(id), t = tableFor(fields);
    if (!t) {
      if (S.charts[id]) { S.charts[id].destroy(); delete S.charts[id]; }
      nodata(box);
      continue;
    }
    const sig = JSON.stringify([t.meta, S.log, S.picked]);
    if (S.charts[id] && S.sigs[id] === sig) {
      S.charts[id].setData(t.data, !S.zoomed);
    } else {
      if (S.charts[id]) S.charts[id].destroy();
      box.replaceChildren();
      S.charts[id] = newChart(box, t);
      S.sigs[id] = sig;
    }
    if (S.zoomed && S.xrange) {   // keep the zoom (and fit y to it) across refreshes and redraws
      S.syncing = true;
      S.charts[id].setScale("x", {min: S.xrange[0], max: S.xrange[1]});
      S.syncing = false;
    }
    box.dataset.points = String(t.data[0].length);
    box.dataset.series = t.meta.map((m) => m.rid + ":" + m.f).join(",");
  }
}

// A small chart of named [[x, y], ...] lists (the expert-balance chart).
function plotPairs(box, named) {
  const parts = named.filter(([, p]) => p.length).map(([, p]) => [p.map((q) => q[0]), p.map((q) => q[1])]);
  if (box._u) { box._u.destroy(); box._u = null; }
  if (!parts.length) return nodata(box);
  box.replaceChildren();
  const series = [{label: "step"}, ...named.filter(([, p]) => p.length).map(([name], i) =>
    ({label: name, stroke: COLORS[i], width: 1.5, spanGaps: true, points: {show: false}}))];
  const data = uPlot.join(parts);
  box._u = new uPlot({width: Math.max(300, box.clientWidth - 4), height: 200, series,
                      scales: {x: {time: false}}}, data, box);
  box.dataset.points = String(data[0].length);
  box.dataset.series = series.slice(1).map((x) => x.label).join(",");
}

// ---------------------------------------------------------------- runs, header, panels
function renderRuns() {
  const box = byId("runs");
  box.replaceChildren(...S.runs.map((r) => {
    const label = h("label", {class: "run-pick"}), cb = h("input", {type: "checkbox", value: r.id});
    cb.checked = S.picked.includes(r.id);
    cb.addEventListener("change", () => {
      S.picked = S.runs.map((x) => x.id).filter((id) => id === r.id ? cb.checked : S.picked.includes(id));
      if (!S.picked.includes(S.focus)) S.focus = S.picked[0] || null;
      renderFocus(); refresh(true);
    });
    label.append(cb, " " + r.id);
    return label;
  }));
  renderFocus();
}

function renderFocus() {
  const sel = byId("focus");
  sel.replaceChildren(...S.picked.map((id) => h("option", {value: id}, id)));
  if (S.focus) sel.value = S.focus;
}

function renderHeader(p) {
  const s = p && p.summary, last = p && p.last;
  byId("run-name").textContent = S.focus || "";
  byId("run-status").textContent = s && s.kind === "rl"
    ? `finished: ${s.steps} RL steps, held-out reward ${fmt(s.initial_reward_mean)} -> ${fmt(s.final_reward_mean)}`
    : s ? `finished: ${s.steps} steps, final loss ${fmt(s.final_loss)}, ${fmt(s.tokens_per_s)} tok/s, ` +
      `MFU ${fmt(100 * (s.mfu || 0))}%`
    : last && last.reward_mean != null ? `running: RL step ${last.step}, reward ${fmt(last.reward_mean)}`
    : last ? `running: step ${last.step}, loss ${fmt(last.loss)}` : p ? "no metrics yet" : "reading the run...";
  byId("updated").textContent = "updated " + new Date().toLocaleTimeString() + (STATIC ? " (static report)" : " (live)");
}

function renderPanels(p) {
  S.panels = p;
  S.marks = (p.events || []).filter((e) => typeof e.step === "number" && MARKS.test(e.event));
  byId("chart-loss").dataset.marks = String(S.marks.length);
  if (S.charts["chart-loss"]) S.charts["chart-loss"].redraw(false);
  renderHeader(p);
  renderHeatmap(p);
  renderExperts(p);
  renderStragglers(p);
  renderGoodput(p);
  renderEvents(p);
  renderProfiles(p);
  document.body.dataset.panels = S.focus;
}

function showMessage(msg) {
  byId("message").textContent = msg || "";
  byId("message").style.display = msg ? "" : "none";
  byId("content").style.display = msg ? "none" : "";
}

// ---------------------------------------------------------------- refresh loop
let busy = false;
async function refresh(force) {
  if (busy && !force) return;
  busy = true;
  const t0 = performance.now(), stats = {bytes: 0};
  try {
    const runs = STATIC || await getJSON("api/runs", stats);
    if (!runs.runs.length) { showMessage(runs.message); document.body.dataset.ready = "1"; return; }
    showMessage(null);
    const ids = runs.runs.map((r) => r.id);
    const changed = JSON.stringify(ids) !== JSON.stringify(S.runs.map((r) => r.id));
    S.runs = runs.runs;
    if (S.picked === null) S.picked = ids.slice(0, 4);
    S.picked = S.picked.filter((id) => ids.includes(id));
    if (!S.focus || !S.picked.includes(S.focus)) S.focus = S.picked[0] || null;
    if (changed) renderRuns();
    if (STATIC) S.picked.forEach((id) => { S.data[id] = STATIC.series[id]; });
    else await Promise.all(S.picked.map((id) => fetchSeries(id, stats)));
    const tc = performance.now();
    renderCharts();
    const t1 = performance.now();
    document.body.dataset.chartMs = (t1 - tc).toFixed(1);   // drawing alone, without the fetch
    const first = !document.body.dataset.ready;
    document.body.dataset.ready = "1";
    if (first) document.body.dataset.renderMs = (t1 - t0).toFixed(1);
    else { document.body.dataset.refreshMs = (t1 - t0).toFixed(1); document.body.dataset.refreshBytes = stats.bytes; }
    document.body.dataset.lastStep = S.picked.map((id) => S.data[id] && S.data[id].last_step).join(",");
    if (first) renderHeader(null);
    if (S.focus) renderPanels(STATIC ? STATIC.panels[S.focus] : await getJSON(`api/run?run=${enc(S.focus)}`));
    byId("err").textContent = "";
  } catch (e) {
    byId("err").textContent = "refresh failed: " + e.message;
  } finally {
    busy = false;
  }
}

byId("smooth").addEventListener("input", (e) => {
  S.smooth = +e.target.value; byId("smooth-val").textContent = S.smooth.toFixed(2); renderCharts();
});
byId("logscale").addEventListener("change", (e) => { S.log = e.target.checked; renderCharts(); });
byId("focus").addEventListener("change", (e) => {
  S.focus = e.target.value;
  if (STATIC) renderPanels(STATIC.panels[S.focus]); else refresh(true);
});
byId("expert-layer").addEventListener("change", (e) => { EXPERT_LAYER = e.target.value; renderExperts(S.panels); });
byId("hm-field").addEventListener("change", (e) => { HM_FIELD = e.target.value; renderHeatmap(S.panels); });
window.addEventListener("resize", () => {
  for (const [id, u] of Object.entries(S.charts)) u.setSize({width: Math.max(300, byId(id).clientWidth - 4), height: 220});
});
refresh();
if (!STATIC) setInterval(refresh, 5000);
