"""Issue #32, point 1: no setting can brick the daemon. Every numeric tunable has a declared
range; an out-of-range PUT is a 400 naming it (the bad value quoted, never echoed whole); a
persisted value out of range is reported at start and its default used. Also the API's odd
inputs of point 6: a non-ASCII bearer token, a deeply nested body."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from policyd.core.ratelog import quote
from policyd.daemon import checkpoint, views
from policyd.daemon.server import RunningDaemon, start_daemon
from policyd.daemon.service import Service
from policyd.daemon.settings import DaemonSettings, tunables, validate_tunables
from tests.test_daemon import settings_for


def test_every_numeric_tunable_declares_a_range() -> None:
    for t in tunables().values():
        if t.choices is None:
            assert t.min is not None and t.max is not None, t.key
            assert t.min <= float(str(t.default)) <= t.max, t.key


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("host_tier_gib", 1e308),
        ("snapshot_interval_s", 1e308),
        ("snapshot_interval_s", 1e-300),
        ("history_publish_interval_s", 1e-300),
        ("prefetch_budget_blocks", 10**30),
        ("write_filter_kappa_chunks", 2**63),
    ],
)
def test_values_that_bricked_the_daemon_are_refused_naming_the_range(
    key: str, value: object
) -> None:
    good, errors = validate_tunables({key: value})
    assert not good
    assert "must be in [" in errors[key] or "must be in (" in errors[key]


def test_a_bad_value_is_quoted_to_about_200_characters() -> None:
    _, errors = validate_tunables({"policy": "x" * 10_000_000, "y" * 5000: 1})
    assert all(len(k) <= 200 and len(v) < 600 for k, v in errors.items())
    assert len(quote(list(range(10**6)))) < 300
    deep: object = 1
    for _ in range(5000):
        deep = [deep]
    assert len(quote(deep)) < 300


def test_daemon_settings_refuse_intervals_that_spin_or_overflow() -> None:
    for name, value in (("tick_interval_s", 0.0), ("checkpoint_interval_s", 1e308)):
        with pytest.raises(ValueError, match=name):
            DaemonSettings.load({"db": Path("x.duckdb"), name: value})
    with pytest.raises(ValueError, match="finite"):
        DaemonSettings.load({"db": Path("x.duckdb"), "shards_rate": float("nan")})


@pytest.fixture
def open_daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    """No token (the default): what the attacker of issue #32 used."""
    running = start_daemon(settings_for(tmp_path))
    yield running
    running.stop()


def test_out_of_range_puts_are_400_and_the_daemon_keeps_working(
    open_daemon: RunningDaemon,
) -> None:
    with httpx.Client(base_url=open_daemon.http_url, timeout=30.0) as http:
        for body in (
            {"host_tier_gib": 1e308},
            {"snapshot_interval_s": 1e308},
            {"snapshot_interval_s": 1e-300},
        ):
            r = http.put("/api/settings", json=body)
            assert r.status_code == 400, r.text
            assert "must be in" in r.json()["error"]
        huge = http.put("/api/settings", json={"policy": "p" * 10_000_000})
        assert huge.status_code in (400, 413)
        assert len(huge.content) < 2000
        deep = "[" * 2000 + "]" * 2000
        r = http.put("/api/settings", content=b'{"policy": ' + deep.encode() + b"}")
        assert r.status_code == 400
        r = http.put("/api/settings", content=b"[" * 100_000)
        assert r.status_code in (400, 413)
        assert http.get("/readyz").status_code == 200
    service = open_daemon.service
    assert service.tunables["host_tier_gib"] == 256.0
    assert service.ready()["snapshots"]


def test_a_non_ascii_bearer_token_is_401_not_500(tmp_path: Path) -> None:
    running = start_daemon(settings_for(tmp_path, token="s3cret"))
    try:
        with httpx.Client(base_url=running.http_url, timeout=30.0) as http:
            for given in ("Bearer sécret".encode(), b"Bearer \xff\xfe", "Bearer ☃".encode()):
                r = http.post("/api/checkpoint", headers=[(b"Authorization", given)])
                assert r.status_code == 401, r.text
            ok = http.post("/api/checkpoint", headers={"Authorization": "Bearer s3cret"})
            assert ok.status_code == 200
    finally:
        running.stop()


def test_invalid_persisted_settings_are_reported_and_defaults_used(tmp_path: Path) -> None:
    """The restart of issue #32: the values were persisted by an older daemon (or a hand-edited
    file); the daemon starts, says which it ignored, and runs on the defaults."""
    settings = settings_for(tmp_path)
    bad = {"host_tier_gib": 1e308, "snapshot_interval_s": 1e308, "lookahead_k": 4}
    checkpoint.save(settings.checkpoint_path, {"tunables": bad})
    running = start_daemon(settings)
    try:
        service = running.service
        assert service.ready()["ready"]
        assert service.tunables["host_tier_gib"] == 256.0
        assert service.tunables["snapshot_interval_s"] == 0.5
        assert service.tunables["lookahead_k"] == 4  # the valid one is kept
        rejected = views.stats(service)["checkpoint"]["rejected_settings"]
        assert set(rejected) == {"host_tier_gib", "snapshot_interval_s"}
        assert "must be in" in json.dumps(rejected)
    finally:
        running.stop()
    assert Service(settings).checkpoint_info["rejected_settings"] == {}  # rewritten clean


def test_a_long_bad_environment_value_is_quoted_not_echoed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POLICYD_HTTP_PORT", "9" * 100_000 + "x")
    with pytest.raises(ValueError, match="POLICYD_HTTP_PORT") as info:
        DaemonSettings.load()
    assert len(str(info.value)) < 600
    monkeypatch.delenv("POLICYD_HTTP_PORT")
    with pytest.raises(ValueError, match="unknown policy") as info:
        DaemonSettings.load({"policy": "p" * 100_000})
    assert len(str(info.value)) < 600
