"""The dashboard against a daemon that is down or too slow: every page shows a banner naming the
problem, never an exception (Streamlit AppTest; real sockets: a closed port and a listener that
never answers). The client's typed errors and the address resolution are checked here too."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from ui import tables
from ui.client import Client, DaemonTimeoutError, DaemonUnreachableError
from ui.connection import resolve_target

APP = Path(__file__).resolve().parents[1] / "ui" / "app.py"
PAGES = ("predictions", "cache", "sizing", "decisions", "tuning", "overview")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A socket that accepts connections (the kernel's backlog) but never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


def run_page(at: AppTest, page: str) -> AppTest:
    if page == "overview":
        return at.run()
    return at.switch_page(f"views/{page}.py").run()


def test_daemon_down_every_page_shows_a_banner(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("POLICYD_API_URL", url)
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    for page in PAGES:
        run_page(at, page)
        assert not at.exception, (page, [e.value for e in at.exception])
        messages = [e.value for e in at.error]
        assert messages, page
        assert all("Daemon unreachable" in m and url in m for m in messages), (page, messages)


def test_daemon_down_sql_page_shows_a_banner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLICYD_API_URL", f"http://127.0.0.1:{closed_port()}")
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    at.switch_page("views/sql.py").run()  # the first visit runs the first example
    assert not at.exception
    assert any("Daemon unreachable" in e.value for e in at.error)
    at.button(key="sql_run").click().run()
    assert not at.exception
    assert [e.value for e in at.error if "Daemon unreachable" in e.value]


def test_slow_daemon_shows_a_timeout_banner(
    monkeypatch: pytest.MonkeyPatch, silent_listener: int
) -> None:
    monkeypatch.setenv("POLICYD_API_URL", f"http://127.0.0.1:{silent_listener}")
    monkeypatch.setenv("POLICYD_UI_TIMEOUT_S", "0.3")
    at = AppTest.from_file(str(APP), default_timeout=30).run()
    at.switch_page("views/sizing.py").run()
    assert not at.exception
    assert any("Daemon too slow" in e.value for e in at.error), [e.value for e in at.error]


def test_client_turns_socket_faults_into_typed_errors(silent_listener: int) -> None:
    with pytest.raises(DaemonUnreachableError, match="cannot reach"):
        Client(f"http://127.0.0.1:{closed_port()}").stats()
    with pytest.raises(DaemonTimeoutError, match=r"within 0\.2 s"):
        Client(f"http://127.0.0.1:{silent_listener}", read_timeout_s=0.2).sizing()
    with pytest.raises(DaemonUnreachableError):
        Client("not a url").stats()


def test_target_resolution_order() -> None:
    env = {"POLICYD_API_URL": "http://env:1/", "POLICYD_API_TOKEN": "t-env"}
    assert resolve_target([], {}).url == "http://127.0.0.1:8470"
    from_env = resolve_target(["-q", "tests"], env)
    assert (from_env.url, from_env.token) == ("http://env:1", "t-env")
    from_args = resolve_target(["--api", "http://arg:2", "--token", "t-arg"], env)
    assert (from_args.url, from_args.token) == ("http://arg:2", "t-arg")
    assert resolve_target(["--refresh-s", "0.1"], {}).refresh_s == 1.0  # floor
    assert resolve_target([], {"POLICYD_UI_TIMEOUT_S": "nope"}).timeout_s > 0


def test_mrc_reading_interpolates_and_clamps() -> None:
    sizing = {
        "mrc": [
            {"capacity_gib": 0.0, "hit_ratio": 0.1, "host_hit_ratio": 0.0},
            {"capacity_gib": 2.0, "hit_ratio": 0.5, "host_hit_ratio": 0.4},
        ]
    }
    assert tables.hit_ratio_at(sizing, 1.0) == pytest.approx(0.3)
    assert tables.hit_ratio_at(sizing, 1.0, "host_hit_ratio") == pytest.approx(0.2)
    assert tables.hit_ratio_at(sizing, 9.0) == pytest.approx(0.5)  # flat beyond the curve
    assert tables.hit_ratio_at({"mrc": []}, 1.0) is None


def test_reasons_group_by_what_they_say() -> None:
    a = "workflow finished (client): its 4146 cached blocks are retired"
    b = "workflow finished (client): its 12 cached blocks are retired"
    assert tables.reason_shape(a) == tables.reason_shape(b) != tables.reason_shape("store all")


def test_cache_frame_says_when_there_is_no_lru_counterfactual() -> None:
    rows = [
        {"ts": 1.0, "prompt_blocks": 10, "gpu_hit_blocks": 4, "host_hit_blocks": 1,
         "recomputed_blocks": 5, "lru_recomputed_blocks": None},
        {"ts": 2.0, "prompt_blocks": 0, "gpu_hit_blocks": 0, "host_hit_blocks": 0,
         "recomputed_blocks": 0, "lru_recomputed_blocks": None},
    ]  # fmt: skip
    frame = tables.cache_frame(rows)
    assert tables.saved_tokens(frame) is None
    long = tables.hit_ratio_long(frame)
    assert len(long) == 3  # the empty interval has no ratio
    assert dict(zip(long["tier"], long["ratio"], strict=True))["gpu"] == pytest.approx(0.4)
    rows[0]["lru_recomputed_blocks"] = 7
    assert tables.saved_tokens(tables.cache_frame(rows, block_tokens=16)) == 2 * 16
