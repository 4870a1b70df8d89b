"""The progress display (smoothed tokens/s, text printed as given) and the profile config's step window."""

import io

import pytest

from stalwart.config.core import ConfigError
from stalwart.config.profile import ProfileConfig, parse_steps
from stalwart.metrics.progress import Progress, RateWindow


@pytest.mark.unit
def test_rate_window_is_time_weighted_over_the_last_steps():
    w = RateWindow(window=4)
    rates = [w.add(100, s) for s in (0.1, 0.1, 1.0, 0.1)]  # one slow step (an eval pause)
    assert rates[1] == pytest.approx(1000.0)
    assert rates[3] == pytest.approx(400 / 1.3)  # not the last step's 1000, not the mean of rates
    for _ in range(4):
        w.add(100, 0.1)
    assert w.rate == pytest.approx(1000.0)  # the slow step left the window
    assert RateWindow().rate == 0.0


@pytest.mark.unit
def test_progress_bar_prints_brackets_as_text():
    from rich.console import Console

    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=140, color_system=None)
    p = Progress(10, 0, True, console=con)
    assert p.tty
    p.log("layout [single process], device [bold]cpu")
    p.update(3, "loss 5.000  [x] 865 tok/s")
    p.close()
    out = buf.getvalue()
    assert "layout [single process], device [bold]cpu" in out
    assert "[x] 865 tok/s" in out and "3/10" in out


@pytest.mark.unit
def test_profile_steps_parse_and_reject_with_the_field_named():
    assert parse_steps("10-12") == (10, 12) and parse_steps(" 7 ") == (7, 7) and parse_steps("") is None
    for bad in ("ten", "12-10", "0-3", "3-"):
        with pytest.raises(ConfigError, match="profile.steps"):
            ProfileConfig(steps=bad)
