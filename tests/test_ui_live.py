"""Every dashboard page against a real daemon holding real replay data: ``policyd demo``'s
replay of generated fact-checking and code-writing workflows through the real wire, history and
HTTP API, plus a few workflows left mid-flight (experiments/ui_demo.py). Streamlit AppTest checks
each page's content against what the daemon reports; the slow test renders every page in headless
Chromium and checks that the images are not blank and show their charts."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pytest
from streamlit.testing.v1 import AppTest

from experiments import screenshots
from experiments.ui_demo import start_live_daemon
from policyd.daemon.demo import DemoRun
from policyd.daemon.server import start_daemon
from policyd.daemon.settings import DaemonSettings
from ui import charts
from ui.client import Client, DaemonRejectedError
from ui.views.sql import EXAMPLES

APP = Path(__file__).resolve().parents[1] / "ui" / "app.py"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DemoRun, list[str]]]:
    db = tmp_path_factory.mktemp("ui-live") / "history.duckdb"
    run, active = start_live_daemon(db, workflows=16, seconds=8.0, active=6)
    try:
        yield run, active
    finally:
        run.stop()


@pytest.fixture
def api(live: tuple[DemoRun, list[str]]) -> Client:
    run, _ = live
    assert run.http_url is not None
    return Client(run.http_url)


@pytest.fixture
def app(api: Client, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("POLICYD_API_URL", api.base_url)
    monkeypatch.setenv("POLICYD_UI_TIMEOUT_S", "20")  # a loaded CI machine is slow, not down
    return AppTest.from_file(str(APP), default_timeout=30).run()


def page(at: AppTest, name: str) -> AppTest:
    at.switch_page(f"views/{name}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def chart_data(at: AppTest) -> list[tuple[dict[str, Any], list[list[dict[str, Any]]]]]:
    """Each Vega-Lite chart on the page: its spec and its datasets as rows."""
    out = []
    for element in at.get("vega_lite_chart"):
        proto = element.proto
        datasets = [
            pa.ipc.open_stream(io.BytesIO(d.data.data)).read_all().to_pylist()
            for d in proto.datasets
        ]
        out.append((json.loads(proto.spec), datasets))
    return out


def chart_titled(at: AppTest, title: str) -> list[list[dict[str, Any]]]:
    for spec, datasets in chart_data(at):
        if spec.get("title") == title:
            return datasets
    raise AssertionError(
        f"no chart titled {title!r}: {[s.get('title') for s, _ in chart_data(at)]}"
    )


def test_overview_shows_the_daemons_counters(app: AppTest, api: Client) -> None:
    assert not app.exception and not app.error, [e.value for e in app.error]
    stats = api.stats()
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["requests"] == f"{stats['requests']:,}"
    assert metrics["policy"] == stats["policy"]
    assert metrics["GPU hit ratio"] == f"{stats['hit_ratio']['gpu']:.1%}"
    # the demo's history keeps every block row: its writer is never behind
    assert metrics["block rows kept"] == f"{stats['history']['block_sample_rate']:.1%}" == "100.0%"
    assert metrics["history rows dropped"] == "0"
    assert any("connected" in c.value for c in app.sidebar.caption)
    assert stats["guard"] is None and "guard publishes" not in metrics  # pbkv has no guard


def test_predictions_page_lists_the_active_workflows(
    app: AppTest, api: Client, live: tuple[DemoRun, list[str]]
) -> None:
    _, active = live
    at = page(app, "predictions")
    assert not at.error, [e.value for e in at.error]
    payload = api.predictions()
    reported = {wf["workflow_id"] for wf in payload["workflows"]}
    assert set(active) <= reported
    table = at.dataframe[0].value
    assert set(table["workflow_id"]) == reported
    k = payload["k"]
    assert [f"step {n}" for n in range(1, k + 1)] == [
        c for c in table.columns if c.startswith("step")
    ]
    # the heatmap holds every predicted (workflow, step, agent) probability
    heat = chart_titled(at, "Next-agent probabilities per workflow")[0]
    expected = sum(len(s["agents"]) for wf in payload["workflows"] for s in wf["steps"])
    assert len(heat) == expected
    bars = chart_titled(at, "Rolling top-1 accuracy per step")[0]
    assert {row["step"]: row["accuracy"] for row in bars} == {
        int(s): pytest.approx(a) for s, a in payload["accuracy"].items() if a is not None
    }
    calibration = chart_titled(at, "Calibration (top-1 predictions)")
    assert sum(row["n"] for row in calibration[1]) > 0
    recent = at.dataframe[1].value
    assert len(recent) == len(payload["recent"]) > 0
    assert {"predicted_agent", "actual_agent", "correct"} <= set(recent.columns)


def test_cache_page_charts_the_history(app: AppTest, api: Client) -> None:
    at = page(app, "cache")
    assert not at.error, [e.value for e in at.error]
    rows = api.timeseries(60)
    hit = chart_titled(at, "Prompt blocks by where they came from")[0]
    with_blocks = [r for r in rows if r["prompt_blocks"]]
    assert len(hit) == 3 * len(with_blocks) > 0  # gpu, host, recomputed per interval
    gpu = sorted(r["ratio"] for r in hit if r["tier"] == "gpu")
    assert gpu == pytest.approx(sorted(r["gpu_hit_ratio"] for r in with_blocks))
    traffic = chart_titled(at, "Host-tier traffic per interval")[0]
    written = sum(r["mib"] for r in traffic if r["direction"] == "written to host")
    assert written * 2**20 == pytest.approx(sum(r["host_written_bytes"] for r in rows))
    # the daemon's LRU counterfactual (from its online MRC) gives a "saved vs LRU" figure
    counterfactual = [r for r in with_blocks if r["lru_recomputed_blocks"] is not None]
    assert counterfactual
    saved = sum(r["lru_recomputed_blocks"] - r["recomputed_blocks"] for r in counterfactual)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["tokens saved vs LRU (60 min)"] == f"{saved * 16:,.0f}"
    assert chart_titled(at, "Recomputed tokens saved vs LRU (cumulative)")


def test_sizing_page_marks_current_and_recommended_on_the_mrc(app: AppTest, api: Client) -> None:
    at = page(app, "sizing")
    assert not at.error, [e.value for e in at.error]
    sizing = api.sizing()
    curve, marks = chart_titled(at, "Miss-ratio curve (as hit ratio)")  # labels share marks
    assert len(sizing["mrc"]) > 1
    assert len([r for r in curve if r["curve"] == "hit ratio (all tiers)"]) == len(sizing["mrc"])
    assert {m["mark"]: m["capacity_gib"] for m in marks} == {
        "current": pytest.approx(sizing["current_host_gib"]),
        "recommended": pytest.approx(sizing["recommended_host_gib"]),
    }
    working_set = chart_titled(at, "Working set over time")[0]
    assert working_set and all(r["working_set_blocks"] > 0 for r in working_set)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["recommended"] == f"{sizing['recommended_host_gib']:,.2f} GiB"


def test_decisions_page_searches(app: AppTest, api: Client) -> None:
    at = page(app, "decisions")
    assert not at.error, [e.value for e in at.error]
    everything = api.decisions(limit=500)
    assert len(at.dataframe[0].value) == len(everything) > 1
    target = next(d["workflow_id"] for d in everything if d["workflow_id"])
    at.text_input(key="decisions_q").input(target).run()
    found = at.dataframe[0].value
    assert len(found) == len(api.decisions(limit=500, q=target)) >= 1
    assert all(
        target in str(w) or target in str(r)
        for w, r in zip(found["workflow_id"], found["reason"], strict=True)
    )
    at.text_input(key="decisions_q").input("no decision says this").run()
    assert not at.dataframe and any("No decisions match" in i.value for i in at.info)


def test_tuning_applies_a_change_and_shows_the_daemons_refusal(app: AppTest, api: Client) -> None:
    at = page(app, "tuning")
    assert not at.error, [e.value for e in at.error]
    before = {s["key"]: s["value"] for s in api.settings()}
    new_k = 4 if before["lookahead_k"] != 4 else 5
    at.number_input(key="setting:lookahead_k").set_value(new_k)
    at.button[0].click().run()  # the form's submit button
    assert not at.error, [e.value for e in at.error]
    assert any("lookahead_k" in s.value for s in at.success)
    assert {s["key"]: s["value"] for s in api.settings()}["lookahead_k"] == new_k
    history = at.dataframe[0].value
    latest = history[history["key"] == "lookahead_k"].iloc[0]
    assert (json.loads(latest["old_value"]), json.loads(latest["new_value"])) == (
        before["lookahead_k"],
        new_k,
    )

    # discount must be in (0, 1]: the form sends 0 and shows the daemon's own words
    with pytest.raises(DaemonRejectedError) as refused:
        api.update_settings({"discount": 0.0})
    at.number_input(key="setting:discount").set_value(0.0)
    at.button[0].click().run()
    errors = " ".join(e.value for e in at.error)
    assert str(refused.value) in errors
    assert {s["key"]: s["value"] for s in api.settings()}["discount"] == before["discount"]


def test_sql_page_runs_examples_and_shows_refusals(app: AppTest, tmp_path: Path) -> None:
    at = page(app, "sql")
    assert not at.error, [e.value for e in at.error]
    assert len(at.dataframe[0].value) > 0  # the first example runs on the first visit
    for name in EXAMPLES:
        at.selectbox(key="sql_example").set_value(name).run()
        assert at.text_area(key="sql_text").value == EXAMPLES[name]
        at.button(key="sql_run").click().run()
        assert not at.error, (name, [e.value for e in at.error])
        assert len(at.dataframe[0].value) > 0, name
    target = tmp_path / "exfiltrated.csv"
    at.text_area(key="sql_text").input(f"COPY (SELECT * FROM requests) TO '{target}'").run()
    at.button(key="sql_run").click().run()
    assert any("Query refused" in e.value for e in at.error), [e.value for e in at.error]
    assert not at.dataframe and not target.exists()


@pytest.mark.slow
def test_every_page_renders_in_headless_chromium(api: Client, tmp_path: Path) -> None:
    if screenshots.chromium_path() is None:
        pytest.fail("chromium is not installed: apt-get install -y chromium (see .ci/run)")
    out = Path(os.environ.get("POLICYD_UI_SCREENSHOTS_DIR") or tmp_path / "screenshots")
    shots = screenshots.capture_all(api.base_url, out, log_path=tmp_path / "streamlit.log")
    assert set(shots) == set(screenshots.page_paths())
    for name, png in shots.items():
        measured = screenshots.measure(png)
        assert not measured.blank(), (name, measured, png)
    # each chart draws in a colour of its own; a page without its chart lacks that colour
    must_show = {
        "sizing": [charts.MARK_COLORS["recommended"], charts.MRC_COLORS["hit ratio (all tiers)"]],
        "cache": [charts.TIER_COLORS["gpu"]],  # the gpu hit-ratio line
        "predictions": [charts.ACCURACY_COLOR],
        "decisions": [charts.COUNT_COLOR],
    }
    for name, colors in must_show.items():
        for color in colors:
            assert screenshots.color_pixels(shots[name], color) > 200, (name, color, shots[name])


@pytest.mark.slow
def test_a_page_that_never_finishes_is_an_error_naming_its_state(tmp_path: Path) -> None:
    """The harness waits for Streamlit's own end-of-script mark; a page that never shows it (here
    a plain file, not a Streamlit app) is a ScreenshotError, not a capture of whatever is drawn."""
    if screenshots.chromium_path() is None:
        pytest.fail("chromium is not installed: apt-get install -y chromium (see .ci/run)")
    plain = tmp_path / "plain.html"
    plain.write_text("<html><body><h1>not a dashboard</h1></body></html>")
    out = tmp_path / "plain.png"
    with (
        screenshots.chromium_browser() as browser,
        pytest.raises(screenshots.ScreenshotError, match="script state 'no app element'"),
    ):
        screenshots.capture_page(browser.new_page(), plain.as_uri(), out, timeout_s=2)
    assert not out.exists()


def loopback_settings(db: Path, **settings: Any) -> DaemonSettings:
    """A daemon of its own on ephemeral loopback ports."""
    return DaemonSettings(
        db=db,
        events="tcp://127.0.0.1:*",
        snapshots="tcp://127.0.0.1:*",
        http_port=0,
        **settings,
    )


def test_tuning_needs_the_daemons_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon with a token refuses a change from a dashboard without it (401, in a banner,
    nothing applied) and accepts it once the dashboard is given the token."""
    with start_daemon(loopback_settings(tmp_path / "token.duckdb", token="s3cret")) as daemon:
        monkeypatch.setenv("POLICYD_API_URL", daemon.http_url)
        monkeypatch.setenv("POLICYD_UI_TIMEOUT_S", "20")
        monkeypatch.delenv("POLICYD_API_TOKEN", raising=False)
        at = page(AppTest.from_file(str(APP), default_timeout=30).run(), "tuning")
        at.number_input(key="setting:prefetch_budget_blocks").set_value(7)
        at.button[0].click().run()
        assert any("HTTP 401" in e.value for e in at.error), [e.value for e in at.error]
        current = {s["key"]: s["value"] for s in Client(daemon.http_url).settings()}
        assert current["prefetch_budget_blocks"] != 7

        monkeypatch.setenv("POLICYD_API_TOKEN", "s3cret")
        at = page(AppTest.from_file(str(APP), default_timeout=30).run(), "tuning")
        at.number_input(key="setting:prefetch_budget_blocks").set_value(7)
        at.button[0].click().run()
        assert not at.error, [e.value for e in at.error]
        current = {s["key"]: s["value"] for s in Client(daemon.http_url).settings()}
        assert current["prefetch_budget_blocks"] == 7
        assert any("prefetch_budget_blocks" in s.value for s in at.success)


def test_overview_shows_agentkvs_guard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon running agentkv: the overview says what its recency guard publishes (vLLM's
    default until the learned decisions win on the sampled shadows) and its switches."""
    with start_daemon(loopback_settings(tmp_path / "guard.duckdb", policy="agentkv")) as daemon:
        monkeypatch.setenv("POLICYD_API_URL", daemon.http_url)
        at = AppTest.from_file(str(APP), default_timeout=30).run()
        assert not at.exception and not at.error, [e.value for e in at.error]
        guard = Client(daemon.http_url).stats()["guard"]
        metrics = {m.label: m.value for m in at.metric}
        assert guard["mode"] == "recency" and metrics["guard publishes"] == "vLLM's default"
        assert metrics["shadow hits, learned / default"] == "—"  # nothing sampled yet
        assert metrics["switches to learned"] == "0" == metrics["switches to default"]
