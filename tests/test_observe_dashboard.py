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


def _check_page(driver, run):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 20).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    for chart in ("chart-loss", "chart-tps", "chart-mfu", "chart-step"):
        el = driver.find_element(By.ID, chart)
        assert int(el.get_attribute("data-points")) > 10, chart
        assert el.find_elements(By.CSS_SELECTOR, "path.series"), chart
    # the loss chart has both train and eval series
    names = [p.get_attribute("data-name") for p in driver.find_elements(By.CSS_SELECTOR, "#chart-loss path.series")]
    assert names == ["train loss", "eval loss"]
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
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == [], errors


@pytest.mark.e2e
def test_dashboard_in_headless_chromium(browser, run):
    server, url = serve_in_thread(run)
    try:
        browser.get(url)
        _check_page(browser, run)
        assert "(live)" in browser.find_element("id", "updated").text
    finally:
        server.shutdown()
        server.server_close()


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


@pytest.mark.unit
def test_api_rereads_the_run_directory(run):
    server, url = serve_in_thread(run)
    try:
        data = _get(url + "api/run")
        assert len(data["train"]) == 60 and data["n_ranks"] == RANKS
        assert len(data["heatmaps"]["step_time_s"]["ranks"]) == RANKS
        assert _get(url + "api/stragglers")["stragglers"]["suspects"] == [2]
        with open(run / "metrics.jsonl", "a") as f:  # the job logs another step
            f.write(json.dumps({"step": 61, "loss": 2.0, "tokens_per_s": 1.0, "mfu": 0.1, "time": 2e9}) + "\n")
        assert _get(url + "api/train")["train"][-1]["step"] == 61
        assert validate_trace(_get(url + "trace.json?first=5&last=9")) == []
        with pytest.raises(urllib.error.HTTPError) as bad:  # a bad query is the client's error, said in words
            urllib.request.urlopen(url + "trace.json?first=abc", timeout=10)
        assert bad.value.code == 400 and b"integers" in bad.value.read()
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "<script" in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # no CDN
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
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 2100.0, "event": "restart", "attempt": 1}) + "\n" +
                                           json.dumps({"time": 2500.0, "event": "finished", "step": 40}) + "\n")
    done = run_cli("diagnose", str(tmp_path), check=False)
    assert done.returncode == 0 and "HISTORY: the run went on after these dumps (finished at step 40" in done.stdout
    (flight / "rank-1.json").write_text(json.dumps(_dump(1, [_e(0)], t=2600.0, job="j", attempt=1)))
    newest = run_cli("diagnose", str(tmp_path), "--json", check=False)
    a = json.loads(newest.stdout)
    assert list(a["ranks"]) == ["1"] and a["attempt"]["attempt"] == 1 and a["attempt"]["older_dumps"] == [0, 2]
