"""The HTTP API over a real in-process daemon (uvicorn on an ephemeral port, real ZeroMQ
ingest, a real DuckDB file): ingest -> history -> SQL round trip, settings validation and live
apply recorded in the history, the bearer token, decisions, predictions, sizing, /metrics."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from policyd.core.client import DaemonClient
from policyd.core.types import Event
from policyd.core.wire import Endpoints
from policyd.daemon.server import RunningDaemon, start_daemon
from policyd.daemon.settings import DaemonSettings
from policyd.models.predictor import BUILD
from tests.test_daemon import workflow_events

TOKEN = "s3cret"
WORKFLOWS = 24


def wait_for(cond: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("api")
    settings = DaemonSettings.load(
        {
            "db": tmp / "history.duckdb",
            "events": "tcp://127.0.0.1:*",
            "snapshots": "tcp://127.0.0.1:*",
            "http_port": 0,
            "token": TOKEN,
            "stats_interval_s": 0.3,
            "sizing_interval_s": 0.5,
        }
    )
    running = start_daemon(settings)
    client = DaemonClient(
        "api-test", Endpoints(events=running.events_endpoint, snapshots=running.snapshots_endpoint)
    )
    events: list[Event] = []
    for w in range(WORKFLOWS):
        events += workflow_events(w)
    events += workflow_events(WORKFLOWS)[:-1]  # one workflow still running
    client.send_many(events)
    client.flush()
    assert wait_for(lambda: running.service.counts["events"] == len(events))
    client.close()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(daemon: RunningDaemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.http_url, timeout=30) as client:
        yield client


ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def test_health_and_readiness(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["ready"] is True
    assert http.get("/openapi.json").json()["info"]["title"]


def test_stats_count_what_was_sent(http: httpx.Client) -> None:
    stats = http.get("/api/stats").json()
    assert stats["requests"] == 3 * (WORKFLOWS + 1)
    assert stats["workflows_active"] == 1
    assert stats["malformed_frames"] == 0 and stats["events_shed"] == 0
    total = 3 * (WORKFLOWS + 1) * 4 + WORKFLOWS
    assert stats["events"] == total and stats["events_received"] == total
    assert stats["seq_gaps"] == 0
    blocks = stats["prompt_blocks"]
    assert stats["hit_ratio"]["gpu"] == pytest.approx(stats["gpu_hit_blocks"] / blocks)
    assert stats["snapshot"]["version"] >= 1
    assert stats["predictor_build"] == BUILD in ("compiled", "interpreted")


def test_ingest_history_sql_round_trip(http: httpx.Client) -> None:
    assert http.post("/api/history/publish").status_code == 401  # admin route
    published = http.post("/api/history/publish", headers=ADMIN)
    assert published.status_code == 200
    assert Path(published.json()["snapshot_path"]).exists()
    answer = http.post(
        "/api/sql",
        json={"sql": "select agent, count(*) as n from requests group by agent order by agent"},
        headers=ADMIN,
    ).json()
    assert answer["columns"] == ["agent", "n"]
    assert answer["rows"] == [["coder", WORKFLOWS + 1], ["planner", WORKFLOWS + 1],
                              ["tester", WORKFLOWS + 1]]  # fmt: skip
    assert answer["truncated"] is False
    capped = http.post(
        "/api/sql", json={"sql": "select * from requests", "max_rows": 5}, headers=ADMIN
    ).json()
    assert len(capped["rows"]) == 5 and capped["truncated"] is True
    retire = http.post(
        "/api/sql",
        json={"sql": "select count(*) from decisions where kind = 'retire'"},
        headers=ADMIN,
    ).json()
    assert retire["rows"] == [[WORKFLOWS]]


def test_sql_refusals_are_400_with_a_message(http: httpx.Client) -> None:
    for sql in ("delete from requests", "select * from read_csv('/etc/passwd')", "selec 1"):
        r = http.post("/api/sql", json={"sql": sql}, headers=ADMIN)
        assert r.status_code == 400, sql
        assert r.json()["error"]
    assert http.post("/api/sql", json={"sql": ""}, headers=ADMIN).status_code == 422
    # a token is set: SQL needs it too (issue #32)
    assert http.post("/api/sql", json={"sql": "select 1"}).status_code == 401


def test_admin_routes_need_the_token(http: httpx.Client) -> None:
    assert http.put("/api/settings", json={"discount": 0.5}).status_code == 401
    wrong = http.put("/api/settings", json={"discount": 0.5}, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401 and "Bearer" in wrong.json()["error"]
    assert http.post("/api/checkpoint").status_code == 401
    ok = http.post("/api/checkpoint", headers=ADMIN)
    assert ok.status_code == 200 and ok.json()["bytes"] > 0


def settings_map(http: httpx.Client) -> dict[str, object]:
    return {s["key"]: s["value"] for s in http.get("/api/settings").json()["settings"]}


def test_bad_settings_are_refused_and_nothing_is_applied(http: httpx.Client) -> None:
    before = settings_map(http)
    r = http.put(
        "/api/settings",
        json={"discount": 0.5, "lookahead_k": 99, "bogus": 1, "policy": "belady"},
        headers=ADMIN,
    )
    assert r.status_code == 400
    body = r.json()
    assert "nothing applied" in body["error"]
    assert set(body["errors"]) == {"lookahead_k", "bogus", "policy"}
    assert settings_map(http) == before  # the good key was not applied either
    assert http.put("/api/settings", content=b"[1]", headers=ADMIN).status_code == 400
    listing = http.get("/api/settings").json()["settings"]
    k = next(s for s in listing if s["key"] == "lookahead_k")
    assert (k["type"], k["min"], k["max"]) == ("int", 1, 8)
    assert all(s["help"] for s in listing)


def test_settings_carry_their_schema_and_the_change_body_is_documented(
    http: httpx.Client,
) -> None:
    body = http.get("/api/settings").json()
    properties = body["schema"]["properties"]
    assert [s["key"] for s in body["settings"]] == list(properties)
    assert (properties["discount"]["exclusiveMinimum"], properties["discount"]["maximum"]) == (0, 1)
    put = http.get("/openapi.json").json()["paths"]["/api/settings"]["put"]
    change = put["requestBody"]["content"]["application/json"]["schema"]
    assert change["additionalProperties"] is False and "required" not in change
    assert list(change["properties"]) == list(properties)


def test_the_block_sample_rate_setting_reaches_the_history(http: httpx.Client) -> None:
    """The setting is the most the history keeps (it halves it by itself while behind)."""
    for rate in (0.25, 1.0):
        r = http.put("/api/settings", json={"block_sample_rate": rate}, headers=ADMIN)
        assert r.status_code == 200
        history = http.get("/api/stats").json()["history"]
        assert history["block_sample_rate"] == history["block_sample_rate_max"] == rate


def test_live_settings_apply_and_are_recorded(daemon: RunningDaemon, http: httpx.Client) -> None:
    service = daemon.service
    checked_before = list(service.predictor.tracker.checked)
    r = http.put(
        "/api/settings", json={"discount": 0.5, "lookahead_k": 2, "policy": "lru"}, headers=ADMIN
    )
    assert r.status_code == 200
    values = {s["key"]: s["value"] for s in r.json()["settings"]}
    assert values["discount"] == 0.5 and values["lookahead_k"] == 2 and values["policy"] == "lru"
    assert service.engine.policy.name == "lru"
    # back to pbkv: the same predictor, its counters kept for the steps that remain
    r = http.put("/api/settings", json={"policy": "pbkv"}, headers=ADMIN)
    assert r.status_code == 200
    policy = service.engine.policy
    assert getattr(policy, "predictor", None) is service.predictor
    lookahead = getattr(policy, "lookahead", None)  # PBKV's score holds the discount
    assert getattr(lookahead, "discount", None) == 0.5 and service.predictor.k == 2
    assert service.predictor.tracker.checked == checked_before[:2]
    changes = http.get("/api/settings/history").json()["changes"]
    keys = [c["key"] for c in changes]
    assert {"discount", "lookahead_k", "policy"} <= set(keys)
    policy_changes = [(c["old_value"], c["new_value"]) for c in changes if c["key"] == "policy"]
    assert ('"lru"', '"pbkv"') in policy_changes and ('"agentkv"', '"lru"') in policy_changes
    assert all(c["actor"] == "api" for c in changes)


def test_decisions_are_answered_and_recorded(http: httpx.Client) -> None:
    evict = http.post("/api/decide/evict", json={"tier": "gpu", "candidates": [0, 1, 2, 5000],
                                                 "n_blocks": 2})  # fmt: skip
    assert evict.status_code == 200
    body = evict.json()
    assert len(body["evict"]) == 2 and set(body["evict"]) <= {0, 1, 2, 5000}
    assert body["reason"]
    admit = http.post("/api/decide/admit", json={"request_id": "x", "block_hashes": [7, 8]}).json()
    assert sorted(admit["admit"] + admit["declined"]) == [7, 8] and admit["reason"]
    assert "prefetch" in http.post("/api/decide/prefetch", json={"budget_blocks": 4}).json()
    bad = http.post("/api/decide/evict", json={"tier": "ssd", "candidates": [-1], "n_blocks": 1})
    assert bad.status_code == 422 and "tier" in bad.json()["error"]
    assert wait_for(lambda: len(http.get("/api/decisions?kind=evict").json()["decisions"]) >= 1)
    rows = http.get("/api/decisions", params={"limit": 5}).json()["decisions"]
    assert rows and rows == sorted(rows, key=lambda r: -r["ts"])
    assert http.get("/api/decisions", params={"kind": "", "q": ""}).status_code == 200
    assert http.get("/api/decisions", params={"kind": "nope"}).status_code == 422
    found = http.get("/api/decisions", params={"q": "W3"}).json()["decisions"]
    assert found and all("w3" in (r["workflow_id"] or "") + r["reason"] for r in found)


def test_predictions_sizing_timeseries_snapshot(daemon: RunningDaemon, http: httpx.Client) -> None:
    pred = http.get("/api/predictions").json()
    assert pred["k"] == daemon.service.predictor.k
    live = [w for w in pred["workflows"] if w["workflow_id"] == f"w{WORKFLOWS}"]
    assert live and live[0]["last_agent"] == "tester" and live[0]["workflow_type"] == "code"
    assert [s["step"] for s in live[0]["steps"]] == list(range(1, pred["k"] + 1))
    assert pred["accuracy"]["1"] is not None and pred["accuracy"]["1"] > 0.5
    assert pred["recent"] and {"predicted_agent", "actual_agent", "correct"} <= set(
        pred["recent"][0]
    )
    daemon.service.refresh_sizing()
    sizing = http.get("/api/sizing").json()
    assert sizing["mrc"] and sizing["working_set_blocks"] > 0
    assert sizing["estimator"]["accesses"] > 0
    assert wait_for(lambda: bool(http.get("/api/timeseries?minutes=5").json()["rows"]))
    rows = http.get("/api/timeseries?minutes=5").json()["rows"]
    assert sum(r["requests"] for r in rows) == 3 * (WORKFLOWS + 1)
    snap = http.get("/api/snapshot").json()
    assert snap["policy"] in {"pbkv", "lru"} and snap["version"] >= 1


def test_metrics_parse_and_match_stats(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    events = families["policyd_events"].samples[0].value
    assert events == http.get("/api/stats").json()["events"]
    assert "policyd_decision_latency_seconds" in families
    tiers = {s.labels["tier"] for s in families["policyd_hit_blocks"].samples}
    assert tiers == {"gpu", "host", "recomputed"}
    history = http.get("/api/stats").json()["history"]
    rate = families["policyd_history_block_sample_rate"].samples[0].value
    assert rate == history["block_sample_rate"] == history["block_sample_rate_max"] == 1.0
    assert families["policyd_history_deferrals"].samples[0].value == history["deferrals"]
