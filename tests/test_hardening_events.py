"""Issue #32, point 2: events are checked against their schema's ranges before the Engine (and
the history); a bad one is counted by reason and dropped, the rest of its batch applied.
Duplicate and backwards sequence numbers are counted apart from gaps and not applied; the
per-source table is bounded; oversize frames are counted. A real daemon, real sockets."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from policyd.core.types import (
    BATCH_CODEC,
    BlocksStored,
    Event,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.core.validate import MAX_BLOCKS_PER_EVENT, check_event, clean_batch
from policyd.daemon import views
from policyd.daemon.server import RunningDaemon, start_daemon
from tests.test_daemon import settings_for, wait_for, workflow_events

NAN, INF = float("nan"), float("inf")


def hit(rid: str, gpu: int, host: int = 0, rec: int = 0, ts: float = 0.0) -> PrefixHit:
    return PrefixHit(ts=ts, request_id=rid, gpu_blocks=gpu, host_blocks=host, recomputed_blocks=rec)


def test_each_out_of_range_event_has_a_reason() -> None:
    start = RequestStarted(ts=0.0, request_id="r", workflow_id="w", agent="a")
    cases: list[tuple[Event, str]] = [
        (hit("r", -1), "negative_count"),
        (hit("r", 0, 0, -5), "negative_count"),
        (hit("r", 2**64 - 1), "count_too_large"),
        (WorkflowFinished(ts=NAN, workflow_id="w"), "non_finite_ts"),
        (WorkflowFinished(ts=-INF, workflow_id="w"), "non_finite_ts"),
        (BlocksStored(ts=0.0, tier="gpu", block_hashes=(1, -2)), "bad_block_hash"),
        (BlocksStored(ts=0.0, tier="gpu", block_hashes=(0,) * (MAX_BLOCKS_PER_EVENT + 1)),
         "too_many_blocks"),
        (RequestFinished(ts=0.0, request_id="r", output_tokens=-1), "negative_count"),
        (RequestStarted(ts=0.0, request_id="r" * 5000, workflow_id="w", agent="a"),
         "id_too_long"),
        (RequestStarted(ts=0.0, request_id="r", workflow_id="w", agent="a", prompt_tokens=-3),
         "negative_count"),
        (RequestStarted(ts=0.0, request_id="r", workflow_id="w", agent="a",
                        hints={"x": NAN}), "bad_hints"),
    ]  # fmt: skip
    for event, reason in cases:
        assert check_event(event) == reason, event
    assert check_event(start) is None
    rejected: Counter[str] = Counter()
    batch = EventBatch("s", 1, (start, cases[0][0], hit("r", 1)))
    cleaned = clean_batch(batch, rejected)
    assert cleaned.events == (start, hit("r", 1)) and rejected == {"negative_count": 1}


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    running = start_daemon(settings_for(tmp_path, max_frame_bytes=64 * 1024))
    yield running
    running.stop()


def push_to(daemon: RunningDaemon) -> tuple[zmq.Context[zmq.Socket[bytes]], zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(daemon.events_endpoint)
    return ctx, push


def test_poisoned_events_are_dropped_counted_and_stats_stay_sane(daemon: RunningDaemon) -> None:
    """The attack of issue #32: prefix hits with negative or huge counts, NaN / inf times."""
    good = workflow_events(1)
    rid = "w1.0"  # its first request names 4 prompt blocks
    poison: list[Event] = [
        hit(rid, -1000, 0, 0),
        hit(rid, 2**63, 0, 0),
        hit(rid, 2**64 - 1, 2**64 - 1, 2**64 - 1),
        hit(rid, 3, 3, 3),  # 9 blocks of a 4-block prompt
        WorkflowFinished(ts=NAN, workflow_id="w1"),
        RequestFinished(ts=INF, request_id=rid),
    ]
    events = good[:1] + poison + good[1:]
    ctx, push = push_to(daemon)
    push.send(BATCH_CODEC.encode(EventBatch(source="attacker", seq=1, events=tuple(events))))
    service = daemon.service
    assert wait_for(lambda: views.stats(service)["requests"] == 3)
    assert wait_for(lambda: views.stats(service)["events_invalid"] == len(poison))
    stats = views.stats(service)
    assert stats["events"] == len(good)
    assert stats["events_invalid_by_reason"] == {
        "negative_count": 1,
        "count_too_large": 2,
        "hit_exceeds_prompt": 1,
        "non_finite_ts": 2,
    }
    for tier in ("gpu", "host", "total"):
        assert 0.0 <= stats["hit_ratio"][tier] <= 1.0
    assert stats["gpu_hit_blocks"] == 6 and stats["prompt_blocks"] == 4 + 5 + 6
    with httpx.Client(base_url=daemon.http_url) as http:
        text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(s.value >= 0 for s in families["policyd_hit_blocks"].samples)
    by_reason = {
        s.labels["reason"]: s.value
        for s in families["policyd_events_invalid_by_reason"].samples
        if s.name.endswith("_total")
    }
    assert by_reason["non_finite_ts"] == 2
    # the history took the same events without a rejected row
    service.cache_stats.record()
    service.history.flush()
    hist = service.history.stats()
    assert hist["rows_rejected"] == 0
    assert hist["events_invalid"] == 5  # stateless checks there (no request table)
    rows = service.history.query_live(
        "select min(gpu_hit_blocks), max(prompt_blocks) from cache_stats", []
    )
    low, high = rows[0]
    assert isinstance(low, int) and isinstance(high, int) and low >= 0 and high <= 15
    push.close(0)
    ctx.term()


def test_duplicate_and_backwards_sequence_numbers_are_counted_apart_and_not_applied(
    daemon: RunningDaemon,
) -> None:
    ctx, push = push_to(daemon)

    def send(seq: int, w: int) -> None:
        batch = EventBatch(source="s", seq=seq, events=tuple(workflow_events(w)))
        push.send(BATCH_CODEC.encode(batch))

    for seq, w in ((5, 1), (6, 2), (6, 3), (4, 4), (8, 5)):
        send(seq, w)
    service = daemon.service
    assert wait_for(lambda: views.stats(service)["batches"] == 3)
    assert wait_for(lambda: views.stats(service)["stale_batches_dropped"] == 2)
    stats = views.stats(service)
    assert (stats["seq_gaps"], stats["seq_duplicates"], stats["seq_regressions"]) == (1, 1, 1)
    assert stats["requests"] == 9  # workflows 1, 2 and 5; not 3 (duplicate) nor 4 (backwards)
    push.close(0)
    ctx.term()


def test_many_source_names_keep_the_table_bounded(tmp_path: Path) -> None:
    running = start_daemon(settings_for(tmp_path, max_sources=50))
    try:
        ctx, push = push_to(running)
        for i in range(2000):
            push.send(BATCH_CODEC.encode(EventBatch(source=f"src{i}", seq=1, events=())))
        service = running.service
        assert wait_for(lambda: views.stats(service)["batches"] == 2000)
        stats = views.stats(service)
        assert stats["sources_tracked"] == 50 and stats["sources_forgotten"] == 1950
        push.close(0)
        ctx.term()
    finally:
        running.stop()


def test_oversize_frames_are_counted_even_past_zeromqs_cap(daemon: RunningDaemon) -> None:
    ctx, push = push_to(daemon)
    push.send(b"\x00" * (100 * 1024))  # over max_frame_bytes (64 KiB): refused by the codec
    push.send(b"\x00" * (1024 * 1024))  # over ZeroMQ's cap (4 x): the transport drops it
    service = daemon.service
    assert wait_for(lambda: views.stats(service)["oversize_frames"] == 1)
    assert wait_for(lambda: views.stats(service)["connections_closed"] >= 1)
    assert views.stats(service)["malformed_frames"] == 1
    assert service.ready()["ready"]
    push.close(0)
    ctx.term()
