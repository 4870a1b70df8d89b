"""The mixture-of-experts view: expert x step load from metrics.jsonl, in the report and the page."""

from __future__ import annotations

import json

import pytest

from stalwart.observe.experts import expert_view
from stalwart.observe.reader import load_run
from test_observe_dashboard import browser  # noqa: F401  (the headless-chromium fixture)


def _records(steps: int = 12) -> list[dict]:
    out = []
    for s in range(1, steps + 1):
        hot = [40 - 2 * s, 8, 8, 8] if s <= 10 else [8, 8, 8, 8]  # expert 0 cools down as the bias acts
        out.append({"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_s": 100.0, "mfu": 0.01, "step_time_s": 0.1,
                    "moe_tokens_per_expert": {"1": hot, "2": [16, 16, 16, 16]},
                    "moe_expert_bias": {"1": [-0.01 * s, 0, 0, 0], "2": [0, 0, 0, 0]},
                    "moe_load_imbalance": 1.0, "moe_ep_imbalance": 1.1, "moe_a2a_s": 0.01, "time": 1.0 + s})
    return out


@pytest.mark.unit
def test_expert_view_is_load_relative_to_the_mean():
    view = expert_view(_records())
    assert view["layers"] == ["1", "2"] and view["steps"] == list(range(1, 13))
    assert view["load"]["1"][0][0] == pytest.approx(38 / ((38 + 24) / 4))
    assert view["load"]["2"][3] == [1.0] * 12 and view["series"]["moe_a2a_s"][0] == [1, 0.01]
    assert expert_view([{"step": 1, "loss": 1.0}]) is None  # a dense model has no expert view


@pytest.mark.e2e
def test_report_shows_the_expert_heat_map(browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from stalwart.observe.report import write_report

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    write_report(run, tmp_path / "rep", trace=False)
    assert (tmp_path / "rep" / "experts.png").stat().st_size > 500
    assert load_run(run)["experts"]["layers"] == ["1", "2"]
    browser.get((tmp_path / "rep" / "report.html").as_uri())
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready") == "1")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#experts rect.ex-cell")) == 4 * 12
    assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#expert-layer option")] == ["layer 1", "layer 2"]
    balance = browser.find_element(By.ID, "chart-balance")
    assert int(balance.get_attribute("data-points")) == 12
    assert balance.get_attribute("data-series") == "max/mean load (layer mean),max/mean per EP rank"
    assert balance.find_elements(By.CSS_SELECTOR, "canvas")  # drawn by uPlot
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
