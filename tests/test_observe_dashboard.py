"""The dashboard in a real headless Chromium (Selenium), its JSON API, and the static report.

Skips when chromium / chromedriver / selenium are absent (CI installs them: see docs/observability.md).
"""

import json
import shutil
import urllib.error
import urllib.request

import pytest

from test_observe_logic import _dump, _e
from conftest import run_cli
from stalwart.observe.goodput import BUCKETS, account_run
from stalwart.observe.server import serve_in_thread
from stalwart.observe.synthetic import write_synthetic_run
from stalwart.observe.trace import validate_trace

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
RANKS = 4


def _get(url):
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


@pytest.fixture
def run(tmp_path):
    return write_synthetic_run(tmp_path / "run", ranks=RANKS, steps=60, slow_rank=2)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not CHROMIUM or not CHROMEDRIVER:
        pytest.skip("chromium and chromedriver are not installed (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--no-first-run", f"--user-data-dir={tmp_path_factory.mktemp('chrome-profile')}",
              "--window-size=1400,1800"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _wait(driver, js, timeout=30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: d.execute_script("return " + js))


def _shot(driver, tmp_path, name):
    """Screenshots go to the test's directory, and to $STALWART_SCREENSHOTS when set (to look at them)."""
    import os

    driver.save_screenshot(str(tmp_path / name))
    if os.environ.get("STALWART_SCREENSHOTS"):
        driver.save_screenshot(os.path.join(os.environ["STALWART_SCREENSHOTS"], name))


def _leave(driver, server):
    """Off the live page (it polls) before its server stops, so no test sees another's errors."""
    driver.get("about:blank")
    driver.get_log("browser")
    server.shutdown()
    server.server_close()


def _check_page(driver, run, focus="run"):
    from selenium.webdriver.common.by import By

    _wait(driver, f"document.body.dataset.panels === {focus!r}")
    for chart in ("chart-loss", "chart-lr", "chart-gnorm", "chart-tps", "chart-mfu", "chart-step"):
        el = driver.find_element(By.ID, chart)
        assert int(el.get_attribute("data-points")) > 10, chart
        assert el.find_elements(By.CSS_SELECTOR, "canvas"), chart
    assert driver.find_element(By.ID, "chart-loss").get_attribute("data-series").endswith("loss,run:eval_loss") or \
        focus != "run"
    rows = driver.find_elements(By.CSS_SELECTOR, "#heatmap g.hm-row")
    assert [r.get_attribute("data-rank") for r in rows] == [str(r) for r in range(RANKS)]
    assert all(r.find_elements(By.CSS_SELECTOR, "rect.hm-cell") for r in rows)
    assert "suspected straggler rank(s): 2" in driver.find_element(By.ID, "suspects").text
    flagged = driver.find_elements(By.CSS_SELECTOR, "#stragglers tr.flag")
    assert flagged and any(tr.text.split()[:2] == ["forward", "2"] for tr in flagged)
    g = account_run(run)  # the page shows the one goodput calculation: ETTR, buckets, failures
    assert f"goodput: ETTR {100 * g['ettr']:.1f}%" in driver.find_element(By.ID, "goodput-ettr").text
    shown = [tr.text.split() for tr in driver.find_elements(By.CSS_SELECTOR, "#goodput-buckets tr")][1:]
    assert [(r[1], float(r[2])) for r in shown] == [(k, round(g["buckets"][k], 2)) for k in BUCKETS]
    failures = driver.find_elements(By.CSS_SELECTOR, "#goodput-failures tr.fault")
    assert [tr.text.split()[:4] for tr in failures] == [["signal", "1", "34", "kill"]]
    events = driver.find_element(By.ID, "events").text
    assert "failure" in events and "checkpoint_saved" in events
    assert driver.find_elements(By.CSS_SELECTOR, "#events tr.fault")
    # the failure, resume and recovery are marked on the loss chart (every event with a step, by name)
    assert int(driver.find_element(By.ID, "chart-loss").get_attribute("data-marks")) >= 2
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors


@pytest.mark.e2e
def test_dashboard_in_headless_chromium(browser, run, tmp_path):
    server, url = serve_in_thread(run)
    try:
        browser.get(url)
        _check_page(browser, run)
        assert "(live)" in browser.find_element("id", "updated").text
    finally:
        _leave(browser, server)


@pytest.mark.e2e
def test_dashboard_compares_runs_zooms_smooths_and_refreshes_incrementally(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    root = tmp_path / "runs"
    a = write_synthetic_run(root / "a", ranks=RANKS, steps=300, slow_rank=2)
    write_synthetic_run(root / "b", ranks=2, steps=250, slow_rank=None, failure_at=None, seed=3)
    server, url = serve_in_thread(root)
    try:
        browser.get(url)
        _check_page(browser, a, focus="a")
        picks = [e.get_attribute("value") for e in browser.find_elements(By.CSS_SELECTOR, "#runs input")]
        assert picks == ["a", "b"]
        assert browser.find_element(By.ID, "chart-loss").get_attribute("data-series") == \
            "a:loss,a:eval_loss,b:loss,b:eval_loss"
        assert browser.find_element(By.ID, "chart-lr").get_attribute("data-series") == "a:lr,b:lr"
        render_ms = float(browser.execute_script("return document.body.dataset.renderMs"))
        # hover: the legend shows the values under the cursor
        over = browser.find_element(By.CSS_SELECTOR, "#chart-loss .u-over")
        ActionChains(browser).move_to_element_with_offset(over, 40, 20).perform()
        vals = [v.text for v in browser.find_elements(By.CSS_SELECTOR, "#chart-loss .u-legend .u-value")]
        assert vals[0] not in ("", "-") and float(vals[1]) > 0, vals
        _shot(browser, tmp_path, "dashboard-compare.png")
        # zoom: a drag on one chart narrows every chart to the same steps
        w = over.size["width"]
        ActionChains(browser).move_to_element_with_offset(over, -w // 4, 10).click_and_hold() \
            .move_by_offset(w // 4, 0).release().perform()
        xs = browser.execute_script("return Object.values(S.charts).map((u) => [u.scales.x.min, u.scales.x.max])")
        assert all(x == xs[0] for x in xs) and 40 < xs[0][0] < xs[0][1] < 200, xs
        # log scale and smoothing
        browser.find_element(By.ID, "logscale").click()
        assert browser.execute_script("return S.charts['chart-loss'].scales.y.distr") == 3
        raw = browser.execute_script("return S.charts['chart-gnorm'].data[1].slice(0, 50)")
        browser.execute_script("const s = byId('smooth'); s.value = 0.9; s.dispatchEvent(new Event('input'))")
        smooth = browser.execute_script("return S.charts['chart-gnorm'].data[1].slice(0, 50)")
        spread = lambda v: max(x for x in v if x) - min(x for x in v if x)  # noqa: E731
        assert spread(smooth) < 0.6 * spread(raw)
        _shot(browser, tmp_path, "dashboard-zoom-log-smooth.png")
        # live refresh: only the new steps travel
        with open(a / "metrics.jsonl", "a") as f:
            for step in range(301, 311):
                rec = {"step": step, "loss": 2.4, "lr": 3e-4, "grad_norm": 1.0, "time": 2e9 + step}
                f.write(json.dumps(rec) + "\n")
        browser.execute_script("refresh(true)")
        _wait(browser, "document.body.dataset.lastStep === '310,250'")
        refresh_ms = float(browser.execute_script("return document.body.dataset.refreshMs"))
        refresh_bytes = int(browser.execute_script("return document.body.dataset.refreshBytes"))
        assert refresh_bytes < 8000, refresh_bytes  # 10 new steps of one run, not the whole runs
        chart_ms = float(browser.execute_script("return document.body.dataset.chartMs"))
        print(f"\n2 runs: first fetch + draw {render_ms:.0f} ms (last draw {chart_ms:.0f} ms), "
              f"refresh {refresh_ms:.0f} ms, {refresh_bytes} bytes of curves")
    finally:
        _leave(browser, server)


@pytest.mark.e2e
def test_dashboard_renders_a_million_step_run(browser, tmp_path):
    import time

    from stalwart.observe.synthetic import write_long_run

    run = write_long_run(tmp_path / "long", 1_000_000)
    server, url = serve_in_thread(run)
    try:
        t0 = time.perf_counter()
        browser.get(url)
        _wait(browser, "document.body.dataset.ready === '1'", timeout=240)
        wall = time.perf_counter() - t0
        render_ms = float(browser.execute_script("return document.body.dataset.renderMs"))
        chart_ms = float(browser.execute_script("return document.body.dataset.chartMs"))
        pts = int(browser.find_element("id", "chart-loss").get_attribute("data-points"))
        assert 1000 < pts <= 4000, pts  # LTTB: 2000 points per curve (train loss and eval loss joined)
        assert browser.execute_script("return S.charts['chart-loss'].scales.x.max") == 1_000_000
        _shot(browser, tmp_path, "dashboard-1m.png")
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 1_000_001, "loss": 2.0, "lr": 3e-4, "time": 2e9}) + "\n")
        browser.execute_script("refresh(true)")
        _wait(browser, "document.body.dataset.lastStep === '1000001'")
        refresh_ms = float(browser.execute_script("return document.body.dataset.refreshMs"))
        refresh_bytes = int(browser.execute_script("return document.body.dataset.refreshBytes"))
        assert refresh_bytes < 4000, refresh_bytes
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
        print(f"\n1M steps: page ready {wall:.1f} s after load (the server's first parse included), first "
              f"fetch + draw {render_ms:.0f} ms, draw alone {chart_ms:.0f} ms, refresh {refresh_ms:.0f} ms, "
              f"{refresh_bytes} bytes")
    finally:
        _leave(browser, server)


@pytest.mark.e2e
def test_dashboard_says_when_the_directory_holds_no_run(browser, tmp_path):
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    server, url = serve_in_thread(tmp_path / "empty")
    try:
        browser.get(url)
        _wait(browser, "document.body.dataset.ready === '1'")
        msg = browser.find_element("id", "message")
        assert msg.is_displayed() and msg.text.startswith("No run in ") and "stalwart train --run.dir" in msg.text
        assert not browser.find_element("id", "content").is_displayed()
        _shot(browser, tmp_path, "dashboard-empty.png")
    finally:
        _leave(browser, server)


@pytest.mark.e2e
def test_static_report_in_headless_chromium(browser, run, tmp_path):
    from stalwart.cli.report import main

    assert main([str(run), "--out", str(tmp_path / "rep"), "--trace", "--trace-steps", "40:49"]) == 0
    for f in ("report.html", "loss.png", "throughput.png", "heatmap.png", "goodput.png", "trace.json"):
        assert (tmp_path / "rep" / f).stat().st_size > 500, f
    trace = json.loads((tmp_path / "rep" / "trace.json").read_text())
    assert validate_trace(trace) == []
    assert {e["args"]["step"] for e in trace["traceEvents"] if e["ph"] == "X"} == set(range(40, 50))
    browser.get((tmp_path / "rep" / "report.html").as_uri())
    _check_page(browser, run)
    assert "(static report)" in browser.find_element("id", "updated").text


@pytest.mark.unit
def test_api_rereads_the_run_directory(run):
    server, url = serve_in_thread(run)
    try:
        data = _get(url + "api/run")
        assert data["last"]["step"] == 60 and data["n_ranks"] == RANKS and "train" not in data
        assert len(data["heatmaps"]["step_time_s"]["ranks"]) == RANKS
        assert _get(url + "api/stragglers")["stragglers"]["suspects"] == [2]
        assert [r["id"] for r in _get(url + "api/runs")["runs"]] == ["run"]
        full = _get(url + "api/series?points=20")
        assert full["full"] and full["last_step"] == 60 and len(full["fields"]["loss"]["x"]) == 20
        with open(run / "metrics.jsonl", "a") as f:  # the job logs another step
            f.write(json.dumps({"step": 61, "loss": 2.0, "tokens_per_s": 1.0, "mfu": 0.1, "time": 2e9}) + "\n")
        new = _get(url + f"api/series?since=60&gen={full['gen']}")
        assert not new["full"] and new["fields"]["loss"] == {"x": [61], "y": [2.0]}
        assert validate_trace(_get(url + "trace.json?first=5&last=9")) == []
        for bad, code, words in (("trace.json?first=abc", 400, b"integers"), ("api/series?since=x", 400, b"integers"),
                                 ("api/run?run=../etc", 404, b"no run")):
            with pytest.raises(urllib.error.HTTPError) as err:  # the client's error, said in words
                urllib.request.urlopen(url + bad, timeout=10)
            assert err.value.code == code and words in err.value.read()
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "uPlot" in page and "<script src" not in page and "<link rel=\"stylesheet\"" not in page  # no CDN
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.unit
def test_no_data_is_shown_for_an_empty_run(tmp_path):
    from stalwart.observe.reader import load_run

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0, "time": 1}\n')
    d = load_run(tmp_path)
    assert d["goodput"] is None and d["stragglers"] is None and d["heatmaps"] == {} and d["flight"] is None


@pytest.mark.e2e
def test_diagnose_reports_only_the_newest_attempt_and_whether_the_run_went_on(tmp_path):
    """A finished healthy run keeps an earlier attempt's dumps: through the CLI they are history (exit 0)."""
    flight = tmp_path / "flight"
    flight.mkdir()
    old = {0: _dump(0, [_e(0), _e(1), _e(2, state="started")], job="j", attempt=0),
           1: _dump(1, [_e(0), _e(1)], job="j", attempt=0),
           2: _dump(2, [_e(0), _e(1), _e(2, state="started")], job="j", attempt=0)}
    for r, d in old.items():
        (flight / f"rank-{r}.json").write_text(json.dumps(d))
    live = run_cli("diagnose", str(tmp_path), check=False)
    assert live.returncode == 1 and "from attempt 0 of launch j" in live.stdout and "HISTORY" not in live.stdout
    assert live.stdout.rstrip().endswith("verdict: the run's current state diverged (exit 1)")
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 2100.0, "event": "restart", "attempt": 1}) + "\n" +
                                           json.dumps({"time": 2500.0, "event": "finished", "step": 40}) + "\n")
    done = run_cli("diagnose", str(tmp_path), check=False)
    assert done.returncode == 0 and "HISTORY: the run went on after these dumps (finished at step 40" in done.stdout
    assert done.stdout.rstrip().endswith("verdict: nothing wrong now (exit 0)")
    (flight / "rank-1.json").write_text(json.dumps(_dump(1, [_e(0)], t=2600.0, job="j", attempt=1)))
    newest = run_cli("diagnose", str(tmp_path), "--json", check=False)
    a = json.loads(newest.stdout)
    assert list(a["ranks"]) == ["1"] and a["attempt"]["attempt"] == 1 and a["attempt"]["older_dumps"] == [0, 2]


def _rl_run(root):
    """An RL-shaped run directory: warm-up lines (kind sft) whose step numbers overlap the RL steps',
    RL steps, held-out evaluations, and an RL summary."""
    root.mkdir(parents=True)
    lines = [{"step": s, "kind": "sft", "loss": 5.0 - 0.1 * s} for s in range(1, 21)]
    for s in range(1, 31):
        lines.append({"step": s, "kind": "rl", "reward_mean": s / 40, "loss": 0.01, "grad_norm": 0.5, "kl": 0.001 * s,
                      "clip_fraction": 0.01, "logprob_mismatch_max": 0.0, "staleness_max": 1 if s > 1 else 0,
                      "rollout_tokens_per_s": 2000.0, "trainer_tokens_per_s": 4000.0, "generator_idle_frac": 0.3,
                      "trainer_idle_frac": 0.6})
    lines += [{"step": s, "kind": "eval", "held_out_reward": 0.1 + s / 50} for s in (0, 10, 20, 30)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (root / "summary.json").write_text(json.dumps({"kind": "rl", "steps": 30, "initial_reward_mean": 0.1,
                                                   "final_reward_mean": 0.7}))
    return root


@pytest.mark.unit
def test_rl_series_keep_the_warm_up_out_of_the_curves(tmp_path):
    from stalwart.observe.series import RunSeries

    q = RunSeries(_rl_run(tmp_path / "rl")).query()
    f = q["fields"]
    assert f["loss"]["y"] == [0.01] * 30  # the sft lines (loss 3.0-4.9 at steps 1-20) are not the RL curve
    assert f["reward_mean"]["y"][-1] == 0.75 and f["held_out_reward"]["x"] == [0, 10, 20, 30]
    assert q["last_step"] == 30 and f["staleness_max"]["y"][:2] == [0, 1]


@pytest.mark.e2e
def test_dashboard_shows_rl_charts_only_for_rl_runs(browser, run, tmp_path):
    from selenium.webdriver.common.by import By

    rl = _rl_run(tmp_path / "runs" / "rl")
    server, url = serve_in_thread(rl)
    try:
        browser.get(url)
        _wait(browser, "document.body.dataset.rl === '1'")
        for chart, n in (("chart-reward", 31), ("chart-kl", 30), ("chart-staleness", 30), ("chart-idle", 30)):
            el = browser.find_element(By.ID, chart)
            assert el.is_displayed() and int(el.get_attribute("data-points")) == n, chart
        assert browser.find_element(By.ID, "chart-reward").get_attribute("data-series") == \
            "rl:reward_mean,rl:held_out_reward"
        assert browser.find_element(By.ID, "run-status").text == "finished: 30 RL steps, held-out reward 0.1 -> 0.7"
        _shot(browser, tmp_path, "dashboard-rl.png")
    finally:
        _leave(browser, server)
    server, url = serve_in_thread(run)  # a pre-training run: no RL section
    try:
        browser.get(url)
        _wait(browser, "document.body.dataset.rl === '0'")
        assert not browser.find_element(By.ID, "chart-reward").is_displayed()
    finally:
        _leave(browser, server)
