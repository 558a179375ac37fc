"""The daemon's shell, in-process with real sockets and a real DuckDB file: malformed frames are
rejected and counted while the daemon keeps serving; overload sheds block-level events only,
counted; ingest coalescing preserves outcomes; checkpoints survive and corrupt ones are set
aside; settings are validated before anything is applied."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from policyd.core.engine import Engine
from policyd.core.types import (
    BATCH_CODEC,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.daemon import checkpoint, views
from policyd.daemon.ingest import IngestQueue, block_events, coalesce, keep_rate, shed
from policyd.daemon.predictions import PredictionLog
from policyd.daemon.server import RunningDaemon, start_daemon
from policyd.daemon.service import Service
from policyd.daemon.settings import DaemonSettings, validate_tunables
from policyd.history import History
from policyd.history.process import HistoryProcess
from policyd.models.predictor import Predictor
from policyd.policies import make_policy


def wait_for(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def settings_for(tmp_path: Path, **extra: object) -> DaemonSettings:
    values: dict[str, object] = {
        "db": tmp_path / "history.duckdb",
        "events": "tcp://127.0.0.1:*",
        "snapshots": "tcp://127.0.0.1:*",
        "http_port": 0,
        "stats_interval_s": 0.5,
        "sizing_interval_s": 1.0,
    }
    values.update(extra)
    return DaemonSettings.load(values)


def workflow_events(
    w: int, agents: tuple[str, ...] = ("planner", "coder", "tester")
) -> list[Event]:
    """One workflow: a request per agent (start, hit, stored, finish), then its end."""
    out: list[Event] = []
    for i, agent in enumerate(agents):
        rid = f"w{w}.{i}"
        blocks = tuple(range(w * 1000, w * 1000 + 4 + i))
        out += [
            RequestStarted(ts=float(i), request_id=rid, workflow_id=f"w{w}", agent=agent,
                           workflow_type="code", block_hashes=blocks,
                           prompt_tokens=16 * len(blocks)),
            PrefixHit(ts=float(i), request_id=rid, gpu_blocks=2, host_blocks=1,
                      recomputed_blocks=len(blocks) - 3),
            BlocksStored(ts=float(i), tier="gpu", block_hashes=blocks, request_id=rid),
            RequestFinished(ts=float(i), request_id=rid, output_tokens=4),
        ]  # fmt: skip
    out.append(WorkflowFinished(ts=9.0, workflow_id=f"w{w}"))
    return out


# ---- shedding and coalescing (units on the real queue) -----------------------------------------


def block(i: int) -> BlocksStored:
    return BlocksStored(ts=0.0, tier="gpu", block_hashes=(i,))


def test_keep_rate_falls_linearly_between_the_bounds() -> None:
    assert keep_rate(0, 10, 20) == 1.0
    assert keep_rate(10, 10, 20) == 1.0
    assert keep_rate(15, 10, 20) == pytest.approx(0.5)
    assert keep_rate(20, 10, 20) == 0.0


def test_shedding_samples_block_events_and_never_request_events() -> None:
    request_events = workflow_events(1)
    events: list[Event] = [*request_events, *(block(i) for i in range(2000))]
    batch = EventBatch(source="s", seq=1, events=tuple(events))
    cut = shed(batch, 0.25)
    kept, dropped = cut.batch, cut.events
    assert 0 < dropped < 2000
    assert cut.block_events >= dropped  # the workflows' BlocksStored carry several hashes
    assert block_events(kept) + cut.block_events == block_events(batch)
    assert len(kept.events) + dropped == len(events)
    kinds = [type(e) for e in kept.events]
    for kind in (RequestStarted, PrefixHit, RequestFinished, WorkflowFinished):
        assert kinds.count(kind) == sum(type(e) is kind for e in request_events)
    assert 0.15 < (2000 - dropped) / 2000 < 0.35  # about the rate
    # the same block is kept or shed alike at one rate (hash sampling)
    assert shed(batch, 0.25).batch.events == kept.events


def test_overloaded_queue_sheds_counts_and_keeps_every_batch() -> None:
    queue = IngestQueue(max_frames=20, shed_above=5)
    for seq in range(1, 41):  # nobody drains: the queue grows past both bounds
        events: tuple[Event, ...] = (
            *(block(seq * 1000 + i) for i in range(50)),
            WorkflowFinished(ts=0.0, workflow_id=f"w{seq}"),
        )
        queue.offer(EventBatch(source="s", seq=seq, events=events), received_ts=0.0)
    c = queue.counters
    assert c.events_received == 40 * 51
    assert c.events_shed > 0
    items = queue.take(100, 0.0)
    assert [it.batch.seq for it in items] == list(range(1, 41))  # no seq gap is made up
    assert sum(isinstance(e, WorkflowFinished) for it in items for e in it.batch.events) == 40
    # past max_frames every block event is shed
    assert all(not any(isinstance(e, BlocksStored) for e in it.batch.events) for it in items[20:])


def test_frames_are_queued_undecoded_and_decoded_when_taken() -> None:
    """The receiver's work per frame does not grow with the backlog: frames are queued as
    bytes (weighed by size) and decoded by the worker at the depth behind them then; past the
    last resort they are dropped undecoded, and a malformed one is counted when taken."""
    queue = IngestQueue(max_frames=4, shed_above=1)
    frames = [
        BATCH_CODEC.encode(
            EventBatch(source="s", seq=seq, events=tuple(block(seq * 100 + i) for i in range(8)))
        )
        for seq in range(1, 4)
    ]
    queue.offer_frame(frames[0], 1.0)
    queue.offer_frame(b"\xc1", 2.0)  # not msgpack
    queue.offer_frame(frames[1], 3.0, recorded=True)
    assert queue.depth == 3 and queue.counters.frames == 3
    assert queue.counters.events_received == 0  # nothing decoded yet
    first, second = queue.take(100, 0.0)  # decoded when taken; the malformed one left out
    assert queue.depth == 0 and queue.counters.malformed_frames == 1
    assert first.batch.seq == 1 and first.received_ts == 1.0 and first.block_events == 8
    assert not first.recorded and second.recorded and queue.counters.events_received == 16
    # a backlog behind a frame is what sheds it, when it is taken
    for _ in range(3):
        queue.offer_frame(frames[2], 4.0)
    (behind,) = queue.take(1, 0.0)
    assert behind.block_events < 8 and queue.counters.block_events_shed > 0
    # past LAST_RESORT_FACTOR x max_frames of depth: dropped undecoded
    while queue.depth < 4 * queue.max_frames:
        queue.offer_frame(frames[2], 5.0)
    before = queue.counters.frames_dropped
    queue.offer_frame(frames[2], 6.0)
    assert queue.counters.frames_dropped == before + 1
    assert queue.counters.frames_dropped_undecoded == 1


def test_coalescing_runs_gives_the_engine_the_same_state() -> None:
    events: list[Event] = []
    for w in range(3):
        events += workflow_events(w)
    events += [block(i) for i in range(5)]
    events += [BlocksRemoved(ts=0.0, tier="gpu", block_hashes=(i,)) for i in range(3)]
    events += [BlocksStored(ts=0.0, tier="host", block_hashes=(i,)) for i in range(4)]
    batch = EventBatch(source="s", seq=1, events=tuple(events))
    merged = coalesce(batch)
    assert len(merged.events) < len(batch.events)
    plain, fused = (
        Engine(make_policy("lru"), clock=lambda: 0.0),
        Engine(make_policy("lru"), clock=lambda: 0.0),
    )
    plain.apply(batch)
    fused.apply(merged)
    assert plain.state.resident == fused.state.resident
    assert plain.state.recency.keys() == fused.state.recency.keys()


# ---- settings ------------------------------------------------------------------------------------


def test_tunables_are_validated_with_clear_messages() -> None:
    good, errors = validate_tunables(
        {"lookahead_k": 4, "discount": 0.0, "policy": "nope", "bogus": 1, "write_filter_mode": 3,
         "host_tier_gib": 12}
    )  # fmt: skip
    assert good == {"lookahead_k": 4, "host_tier_gib": 12.0}
    assert "discount must be in (0, 1]" in errors["discount"]
    assert "policy must be one of" in errors["policy"]
    assert "unknown setting 'bogus'" in errors["bogus"]
    assert "must be a string" in errors["write_filter_mode"]
    _, errors = validate_tunables({"lookahead_k": True, "snapshot_interval_s": float("nan")})
    assert set(errors) == {"lookahead_k", "snapshot_interval_s"}


def test_env_settings_are_read_once_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLICYD_HTTP_PORT", "9999")
    monkeypatch.setenv("POLICYD_API_TOKEN", "t0k")
    settings = DaemonSettings.load({"http_port": None})
    assert settings.http_port == 9999 and settings.token == "t0k"
    assert DaemonSettings.load({"http_port": 1234}).http_port == 1234  # flags win
    monkeypatch.setenv("POLICYD_HTTP_PORT", "many")
    with pytest.raises(ValueError, match="POLICYD_HTTP_PORT"):
        DaemonSettings.load()
    monkeypatch.delenv("POLICYD_HTTP_PORT")
    with pytest.raises(ValueError, match="unknown policy"):
        DaemonSettings.load({"policy": "belady"})  # an offline oracle cannot serve
    assert all(help_text for _, _, help_text in DaemonSettings.describe())


# ---- checkpoints ---------------------------------------------------------------------------------


def test_checkpoint_round_trip_and_corrupt_files_are_set_aside(tmp_path: Path) -> None:
    path = tmp_path / "m.ckpt"
    predictor = Predictor(k=2)
    for w in range(10):
        for a in ("a", "b"):
            predictor.observe_call(f"w{w}", "t", a, {}, 0.0)
        predictor.observe_finished(f"w{w}")
    checkpoint.save(path, {"predictor": predictor})
    restored = checkpoint.load(path)
    assert restored.models is not None
    again = restored.models["predictor"]
    assert isinstance(again, Predictor)
    assert again.tracker.checked == predictor.tracker.checked
    assert not list(tmp_path.glob(".*tmp*"))  # written via a temporary file + os.replace

    for bad in (b"not a pickle", pickle.dumps({"format": 999, "models": {}}), b""):
        path.write_bytes(bad)
        result = checkpoint.load(path)
        assert result.models is None and result.error
        assert not path.exists()
        assert result.moved_to is not None and result.moved_to.exists()
        assert ".corrupt-" in result.moved_to.name
    assert checkpoint.load(tmp_path / "missing.ckpt").models is None  # fresh start, no error


def test_a_daemon_starts_fresh_beside_a_corrupt_checkpoint(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    settings.checkpoint_path.write_bytes(b"\x80\x04garbage")
    running = start_daemon(settings)
    try:
        info = views.stats(running.service)["checkpoint"]
        assert info["restored"] is False and info["error"]
        assert ".corrupt-" in str(info["moved_to"])
        assert running.service.ready()["ready"]
    finally:
        running.stop()
    assert list(tmp_path.glob("*.model.ckpt.corrupt-*"))
    assert settings.checkpoint_path.exists()  # a fresh checkpoint was written at shutdown
    assert Service(settings).checkpoint_info["restored"] is True


def test_a_failed_shutdown_step_is_reported_not_claimed_done(tmp_path: Path) -> None:
    """Scenario: a file takes the checkpoint directory's place while the daemon runs, so the
    final checkpoint cannot be written: stop() still closes the history, and says what failed
    (the server prints it instead of "models checkpointed")."""
    settings = settings_for(tmp_path, checkpoint_dir=tmp_path / "ckpt")
    running = start_daemon(settings)
    (tmp_path / "ckpt").write_text("not a directory")
    running.stop()
    problems = running.service.stop_problems
    assert len(problems) == 1 and problems[0].startswith("final checkpoint failed")
    assert running.service.history.stats()["writer_alive"] is False  # closed all the same


# ---- the running daemon: malformed frames --------------------------------------------------------


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    running = start_daemon(settings_for(tmp_path, max_frame_bytes=64 * 1024))
    yield running
    running.stop()


def test_malformed_frames_are_rejected_counted_and_the_daemon_keeps_serving(
    daemon: RunningDaemon,
) -> None:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(daemon.events_endpoint)
    good = BATCH_CODEC.encode(EventBatch(source="t", seq=1, events=tuple(workflow_events(1))))
    encoder = msgspec.msgpack.Encoder()
    bad = [
        good[: len(good) // 2],  # truncated
        encoder.encode((2, {"source": "t", "seq": 1, "events": []})),  # wrong version
        encoder.encode((1, {"source": "t", "seq": "one", "events": []})),  # wrong types
        encoder.encode((1, {"source": "t", "seq": 1, "events": [{"type": "Nope", "ts": 0}]})),
        b"\xc1",  # not msgpack
        encoder.encode((1, {"source": "t", "seq": 1, "events": [], "x": b"0" * 100_000})),  # huge
    ]
    for frame in bad:
        push.send(frame)
    push.send(good)
    service = daemon.service
    assert wait_for(lambda: views.stats(service)["requests"] == 3)
    stats = views.stats(service)
    assert stats["malformed_frames"] == len(bad)
    assert stats["events"] == len(workflow_events(1))
    assert stats["last_malformed"]
    assert service.ready()["ready"]
    push.close(0)
    ctx.term()


def test_shedding_is_reported_in_stats_and_metrics(tmp_path: Path) -> None:
    service = Service(settings_for(tmp_path, ingest_queue_frames=10, shed_above_frames=2))
    for seq in range(1, 31):  # the engine worker is not running: the queue overflows
        events = tuple(block(seq * 100 + i) for i in range(40))
        service.queue.offer(EventBatch(source="s", seq=seq, events=events), received_ts=0.0)
    stats = views.stats(service)
    assert stats["events_received"] == 30 * 40
    assert stats["events_shed"] > 0
    assert stats["shed_rate"] == pytest.approx(stats["events_shed"] / (30 * 40))
    metrics = service.metrics.render().decode()
    assert f"policyd_events_shed_total {float(stats['events_shed'])}" in metrics
    assert not service.queue.wait_for_room(0.0)  # full: a receiver would stop reading
    stats = views.stats(service)
    assert stats["receiver_waits"] == 1
    assert "policyd_receiver_waits_total 1.0" in service.metrics.render().decode()


def test_the_history_writer_is_told_to_step_aside_while_the_engine_is_behind(
    tmp_path: Path,
) -> None:
    service = Service(
        settings_for(tmp_path, ingest_queue_frames=64, shed_above_frames=8, history_writer="thread")
    )
    assert isinstance(service.history, History)  # (in the daemon's process, sharing its lock)
    assert service.history.config.cpu_budget == 0.25  # history_cpu_budget's default
    unbudgeted = Service(settings_for(tmp_path / "u", history_cpu_budget=0.0))
    assert isinstance(unbudgeted.history, HistoryProcess)  # history_writer's default
    assert unbudgeted.history.config.cpu_budget is None
    with pytest.raises(ValueError, match="history_writer"):
        settings_for(tmp_path, history_writer="fork")
    defer = service.history.defer
    assert defer is not None and not defer()
    for seq in range(1, 6):  # five batches of one frame each: past half the shedding depth
        service.queue.offer(EventBatch(source="s", seq=seq, events=(block(seq),)), 0.0)
    assert service.queue.depth == 5 and defer()
    service.queue.take(10**9, 0.0)
    assert not defer()


def test_an_endpoint_in_use_is_a_clear_error(daemon: RunningDaemon, tmp_path: Path) -> None:
    other = settings_for(tmp_path / "other", events=daemon.events_endpoint)
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match="cannot bind the events endpoint"):
        start_daemon(other)
    again = settings_for(tmp_path / "other", snapshots=daemon.snapshots_endpoint)
    with pytest.raises(ValueError, match="cannot bind the snapshot endpoint"):
        start_daemon(again)
    assert daemon.service.ready()["ready"]
    # the failed starts released the history file: a third start on it works
    start_daemon(settings_for(tmp_path / "other")).stop()


def test_an_empty_prefetch_answer_is_logged_as_a_decision_with_its_reason(
    tmp_path: Path,
) -> None:
    service = Service(settings_for(tmp_path, policy="lru"))
    service.history.start()
    try:
        empty = service.decide_prefetch(8)
        zero = service.decide_prefetch(0)
        service.history.flush()
        rows = service.history.query_live(
            "select kind, tier, n_blocks, reason, policy from decisions order by ts"
        )
    finally:
        service.history.close()
    assert empty["prefetch"] == [] and zero["prefetch"] == []
    assert [r[:3] for r in rows] == [("prefetch", "gpu", 0), ("prefetch", "gpu", 0)]
    assert rows[0][3] == empty["reason"] and "nothing to prefetch" in empty["reason"]
    assert "does not prefetch" in empty["reason"] and "budget of 0" in zero["reason"]
    assert {r[4] for r in rows} == {"lru"}
    assert service.decision_counts["prefetch"] == 2


@pytest.mark.parametrize(("policy", "own_host_order"), [("agentkv", True), ("lru", False)])
def test_stats_count_the_blocks_of_the_snapshots_own_host_order(
    tmp_path: Path, policy: str, own_host_order: bool
) -> None:
    service = Service(settings_for(tmp_path, policy=policy))
    service.history.start()
    try:
        # the learned decisions (the guard would publish vLLM's default until it has evidence)
        assert service.update_settings({"recency_guard": "off"}) == {}
        prompt = tuple(range(1, 9))
        events = (
            RequestStarted(ts=0.0, request_id="r1", workflow_id="w1", agent="a",
                           block_hashes=prompt, prompt_tokens=16 * len(prompt)),
            BlocksStored(ts=0.0, tier="gpu", block_hashes=prompt, request_id="r1"),
            BlocksStored(ts=0.0, tier="host", block_hashes=prompt[:4], request_id="r1"),
            RequestFinished(ts=0.0, request_id="r1"),
        )  # fmt: skip
        service.engine.apply(EventBatch("c", 1, events))
        snap = service.build_snapshot()
        scored = views.stats(service)["snapshot"]["host_blocks_scored"]
    finally:
        service.history.close()
    if own_host_order:  # agentkv orders the host tier on its own: its copies are ranked
        assert snap.host_scores is not None
        assert scored == sum(len(g.block_hashes) for g in snap.host_scores) > 0
    else:  # scores order both tiers
        assert snap.host_scores is None and scored is None


def test_the_prediction_log_keeps_to_its_budget_of_forecasts_per_second() -> None:
    """Per workflow one forecast per MIN_FORECAST_INTERVAL_S; all workflows together at most
    ``max_forecasts_per_s``, with one second's worth of burst - the rest is counted."""
    log = PredictionLog(lambda: 0.0, max_forecasts_per_s=10.0)

    def call(wid: str, now: float) -> bool:
        wanted = log.wants_forecast(wid, now)
        log.on_call(wid, "t", "a", None)
        return wanted

    first = [call(f"w{i}", 0.0) for i in range(25)]
    assert sum(first) == 10 and first[:10] == [True] * 10
    assert not call("w0", 0.1)  # its own interval, not the budget
    later = [call(f"w{i}", 0.5) for i in range(10, 25)]
    assert sum(later) == 5  # half a second refilled five
    assert log.forecasts_skipped == 15 + 10
    restored = pickle.loads(pickle.dumps(log))
    assert restored.forecasts_skipped == log.forecasts_skipped
