"""The dashboard / report page: one self-contained HTML document (inline CSS and JS; no CDN).

The curves are drawn by uPlot (MIT, vendored under ``static/`` with its licence); the per-run panels
(``static/panels.js``) and the page logic (``static/dashboard.js``) are inlined with it. Served live
by ``stalwart dashboard`` (the script polls the JSON API), or written by ``stalwart report`` with the
data embedded (``window.STALWART_DATA``), so both show the same content.
"""

from __future__ import annotations

import html
from functools import cache
from importlib.resources import files

UPLOT_VERSION = "1.6.32"

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
#controls{padding:8px 18px;background:#e9edf2;display:flex;gap:18px;flex-wrap:wrap;align-items:center}
#runs label{margin-right:10px;white-space:nowrap} #message{margin:30px 18px;padding:16px;background:#fff3cd;
  border:1px solid #e0c46c;border-radius:6px;font-size:15px}
.chart{min-height:60px} .u-legend{font-size:12px} .u-legend .u-value{min-width:60px}
"""

_BODY = """
<header><h1>stalwart &middot; <span id="run-name"></span></h1><span id="run-status"></span>
<span id="updated"></span><span id="err" style="color:#ffb4a9"></span></header>
<div id="controls"><span><b>runs</b> <span id="runs"></span></span>
<label>panels of <select id="focus"></select></label>
<label>smoothing <input id="smooth" type="range" min="0" max="0.99" step="0.01" value="0">
<span id="smooth-val">0.00</span></label>
<label><input id="logscale" type="checkbox"> log scale</label>
<span class="note">drag on a chart to zoom (all charts follow), double-click to reset; values under the cursor
are in each legend</span></div>
<div id="message" style="display:none"></div>
<main id="content">
<section><h2>Loss (solid) / eval loss (dashed)</h2><div id="chart-loss" class="chart"></div></section>
<section><h2>Learning rate</h2><div id="chart-lr" class="chart"></div></section>
<section><h2>Gradient norm</h2><div id="chart-gnorm" class="chart"></div></section>
<section><h2>Throughput (tokens/s)</h2><div id="chart-tps" class="chart"></div></section>
<section><h2>MFU</h2><div id="chart-mfu" class="chart"></div></section>
<section><h2>Step time (solid) / data wait (dashed), s</h2><div id="chart-step" class="chart"></div></section>
<section class="rl"><h2>RL reward (solid) / held-out reward (dashed)</h2><div id="chart-reward" class="chart"></div></section>
<section class="rl"><h2>KL to the reference (solid) / clip fraction (dashed)</h2><div id="chart-kl" class="chart"></div></section>
<section class="rl"><h2>Log-probability mismatch, generator vs trainer (max)</h2><div id="chart-mismatch" class="chart"></div></section>
<section class="rl"><h2>Staleness of trained samples, weight versions (max)</h2><div id="chart-staleness" class="chart"></div></section>
<section class="rl"><h2>Rollout tokens/s (solid) / trainer tokens/s (dashed)</h2><div id="chart-rl-tps" class="chart"></div></section>
<section class="rl"><h2>Idle share: generators (solid) / trainers (dashed)</h2><div id="chart-idle" class="chart"></div></section>
<section class="wide"><h2>Per-rank heat map <select id="hm-field"></select></h2><div id="heatmap"></div></section>
<section class="wide" id="experts-section"><h2>Expert load per step <select id="expert-layer"></select></h2>
<div id="experts"></div><div id="chart-balance" class="chart"></div></section>
<section><h2>Stragglers (rank median / fastest rank's median)</h2><div id="suspects"></div>
<div id="stragglers"></div></section>
<section><h2>Goodput</h2><div id="goodput"></div></section>
<section><h2>Profiler traces</h2><div id="profiles"></div></section>
<section class="wide"><h2>Event log (newest first; marked on the loss chart)</h2><div id="events"></div></section>
<section class="wide"><h2>Flight recorder</h2><div id="flight"></div></section>
</main>
"""


@cache
def _static(name: str) -> str:
    return (files("stalwart.observe") / "static" / name).read_text(encoding="utf-8")


def _script(code: str) -> str:
    return "<script>" + code.replace("</script", "<\\/script") + "</script>"


def render_page(title: str, embedded_json: str | None = None) -> str:
    """The page; with ``embedded_json`` it is a static report that needs no server."""
    data = ""
    if embedded_json is not None:
        data = "<script>window.STALWART_DATA=" + embedded_json.replace("</", "<\\/") + ";</script>\n"
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>stalwart: {html.escape(title)}</title><link rel=\"icon\" href=\"data:,\">"
            f"<style>{_static('uPlot.min.css')}{_CSS}</style></head>\n<body>{_BODY}{data}"
            f"{_script(_static('uPlot.iife.min.js'))}{_script(_static('panels.js'))}"
            f"{_script(_static('dashboard.js'))}</body></html>\n")
