"""Block events as the daemon counts and sheds them, and the bench's frame stream: an event of
N hashes is N block events, received, shed (stores whole, never removals, so the Engine never
believes an evicted block cached) and applied; the pre-encoded frames decode to valid,
sequenced batches whose removals name blocks stored before, with bounded residency."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import zmq

from experiments.ingest_bench import (
    CONCURRENT_WORKFLOWS,
    RESIDENT_WINDOW_BLOCKS,
    FrameSource,
    StreamShape,
    kept_up,
    plot_rss,
    render,
    render_sweep,
    run_bench,
)
from experiments.ingest_cost import stage_costs
from policyd.core.client import DaemonClient
from policyd.core.engine import Engine
from policyd.core.types import (
    BATCH_CODEC,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.core.wire import Endpoints
from policyd.daemon import views
from policyd.daemon.ingest import (
    HARD_BOUND_FACTOR,
    LAST_RESORT_FACTOR,
    IngestQueue,
    Receiver,
    block_events,
    shed,
)
from policyd.daemon.service import Service
from policyd.daemon.settings import DaemonSettings
from policyd.policies import make_policy


def stored(hashes: Sequence[int]) -> BlocksStored:
    return BlocksStored(ts=0.0, tier="gpu", block_hashes=tuple(hashes))


def kept_hashes(batch: EventBatch, kind: type) -> set[int]:
    return {h for e in batch.events if type(e) is kind for h in e.block_hashes}  # type: ignore[union-attr]


def test_a_multi_hash_event_is_as_many_block_events() -> None:
    events: tuple[Event, ...] = (
        stored(range(16)),
        BlocksRemoved(ts=0.0, tier="host", block_hashes=(1, 2, 3)),
        BlocksLoaded(ts=0.0, block_hashes=(4,)),
        RequestStarted(ts=0.0, request_id="r", workflow_id="w", agent="a", block_hashes=(9, 9)),
        WorkflowFinished(ts=0.0, workflow_id="w"),
    )
    assert block_events(EventBatch("s", 1, events)) == 16 + 3 + 1  # a prompt is no block event


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_shedding_drops_whole_stores_and_never_removals(rate: float) -> None:
    """Stores are kept or dropped whole (16 hashes: 16 block events counted), about ``rate``
    of them kept, the same way every time; removals all stay."""
    hashes = [(i * 7919) ** 2 + i for i in range(4096)]
    groups = EventBatch("s", 1, tuple(stored(hashes[i : i + 16]) for i in range(0, 4096, 16)))
    removals = EventBatch(
        "s", 2, tuple(BlocksRemoved(ts=0.0, tier="gpu", block_hashes=tuple(hashes[i : i + 5]))
                      for i in range(0, 4096, 5))
    )  # fmt: skip
    cut = shed(groups, rate)
    kept = [e for e in cut.batch.events if isinstance(e, BlocksStored)]
    assert all(len(e.block_hashes) == 16 for e in kept)  # whole events
    assert 0.6 * rate * 256 < len(kept) < 1.4 * rate * 256
    assert cut.events == 256 - len(kept) and cut.block_events == 16 * cut.events
    assert block_events(cut.batch) == 16 * len(kept)
    assert shed(groups, rate) == cut  # deterministic
    assert shed(removals, rate).batch == removals and shed(removals, 0.0).events == 0


def test_whatever_is_shed_the_engine_believes_no_evicted_block_cached() -> None:
    """Scenario: a random stream of stores, loads and removals (hashes regrouped between them),
    cut at a varying rate before the Engine, is replayed beside the truth: the Engine's GPU
    blocks are always a subset of what is really there."""
    rng = random.Random(7)
    engine = Engine(make_policy("lru"))
    truth: set[int] = set()
    for seq in range(1, 400):
        events: list[Event] = []
        for _ in range(rng.randrange(1, 12)):
            if truth and rng.random() < 0.45:
                gone = rng.sample(sorted(truth), min(len(truth), rng.randrange(1, 20)))
                truth.difference_update(gone)
                events.append(BlocksRemoved(ts=0.0, tier="gpu", block_hashes=tuple(gone)))
            else:
                new = [rng.randrange(-(2**63), 2**64) for _ in range(rng.randrange(1, 20))]
                truth.update(new)
                if rng.random() < 0.8:
                    events.append(stored(new))
                else:
                    events.append(BlocksLoaded(ts=0.0, block_hashes=tuple(new)))
        engine.apply(shed(EventBatch("s", seq, tuple(events)), rng.random()).batch)
        assert engine.state.resident["gpu"] <= truth
    assert 0 < len(engine.state.resident["gpu"]) < len(truth)


def test_the_keep_rule_is_the_first_hash_rule_outside_uint64_too() -> None:
    golden, mask = 0x9E3779B97F4A7C15, (1 << 64) - 1
    rate = 0.5
    threshold = int(rate * 2.0**64)
    hashes = [i * 0x1234567 for i in range(1, 500)] + [-5, -(2**63), 2**64 + 3]
    cut = shed(EventBatch("s", 1, tuple(stored((h, 1)) for h in hashes)), rate)
    expected = {h for h in hashes if ((h * golden) & mask) < threshold}
    assert kept_hashes(cut.batch, BlocksStored) - {1} == expected


def test_the_queue_counts_block_events_received_and_shed() -> None:
    queue = IngestQueue(max_frames=8, shed_above=2)
    for seq in range(1, 13):  # nobody drains: the queue goes past both bounds
        batch = EventBatch("s", seq, (stored(range(seq * 100, seq * 100 + 16)),
                                      RequestFinished(ts=0.0, request_id=f"r{seq}")))  # fmt: skip
        queue.offer(batch, received_ts=0.0)
    c = queue.counters
    assert c.events_received == 12 * 2 and c.block_events_received == 12 * 16
    items = queue.take(100, 0.0)
    assert c.block_events_shed > 0
    assert sum(it.block_events for it in items) == c.block_events_received - c.block_events_shed
    assert sum(block_events(it.batch) for it in items) == sum(it.block_events for it in items)


def test_block_events_reach_the_engine_and_the_stats(tmp_path: Path) -> None:
    settings = DaemonSettings.load(
        {"db": tmp_path / "h.duckdb", "events": "tcp://127.0.0.1:*",
         "snapshots": "tcp://127.0.0.1:*", "http_port": 0, "policy": "lru"}
    )  # fmt: skip
    service = Service(settings)
    service.queue.offer(EventBatch("s", 1, (stored(range(16)), stored(range(16, 20)))), 0.0)
    service.worker.drain()  # the engine worker's step, on this thread
    stats = views.stats(service)
    assert stats["block_events_received"] == stats["block_events_applied"] == 20
    assert stats["block_events_shed"] == 0 and stats["block_shed_rate"] == 0.0
    assert service.engine.state.resident["gpu"] == set(range(20))
    metrics = service.metrics.render().decode()
    assert "policyd_block_events_applied_total 20.0" in metrics
    service.history.close()


@pytest.mark.parametrize("blocks_per_event", [1, 16, 64])
def test_bench_frames_are_valid_sequenced_and_keep_residency_bounded(
    blocks_per_event: int,
) -> None:
    shape = StreamShape(blocks_per_event=blocks_per_event, events_per_frame=64)
    source = FrameSource(shape, sender=3)
    resident: set[int] = set()
    bad_removals = blocks = requests = 0
    frames = 3 * len(source.ring) + 1  # wraps the ring: hashes come round again
    for seq in range(1, frames + 1):
        frame, n_events, n_blocks = source.next()
        batch = BATCH_CODEC.decode(frame)  # the daemon's own decoder accepts it
        assert (batch.source, batch.seq, len(batch.events)) == ("bench-3", seq, n_events)
        assert block_events(batch) == n_blocks == 64 * blocks_per_event
        for e in batch.events:
            if isinstance(e, BlocksStored):
                assert len(e.block_hashes) == blocks_per_event
                assert resident.isdisjoint(e.block_hashes)  # stored while not resident: no
                resident.update(e.block_hashes)
            elif isinstance(e, BlocksRemoved):
                bad_removals += not resident.issuperset(e.block_hashes)
                resident.difference_update(e.block_hashes)
            requests += isinstance(e, RequestStarted)
        blocks += n_blocks
        assert len(resident) <= RESIDENT_WINDOW_BLOCKS + 16 + blocks_per_event
    # only the first window's removals name blocks not stored yet
    assert bad_removals * blocks_per_event <= RESIDENT_WINDOW_BLOCKS
    assert requests == blocks // shape.blocks_per_request


def test_a_bad_stream_shape_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="blocks_per_event must be >= 1"):
        StreamShape(blocks_per_event=0)


def test_the_queue_depth_weighs_a_frame_by_its_block_events() -> None:
    queue = IngestQueue(max_frames=64, shed_above=16)
    big = EventBatch("s", 1, tuple(stored(range(i * 16, i * 16 + 16)) for i in range(256)))
    queue.offer(big, 0.0)  # 4,096 block events: 16 frames' worth
    assert len(queue) == 1 and queue.depth == 16
    queue.offer(EventBatch("s", 2, tuple(stored(range(10**6 + i * 16, 10**6 + i * 16 + 16))
                                         for i in range(256))), 0.0)  # fmt: skip
    assert queue.counters.block_events_shed == 0  # at depth 16: not above shed_above yet
    for seq in range(3, 6):  # now above: the next frames are sampled
        queue.offer(EventBatch("s", seq, big.events), 0.0)
    assert queue.counters.block_events_shed > 0
    first = queue.take(16, 0.0)  # a weight budget: one 16-weight frame
    assert [it.batch.seq for it in first] == [1]
    rest = queue.take(1000, 0.0)
    assert [it.batch.seq for it in rest] == [2, 3, 4, 5] and queue.depth == 0


def test_past_the_hard_bound_frames_keep_their_closing_events_then_go_whole() -> None:
    queue = IngestQueue(max_frames=4, shed_above=1)
    for seq in range(1, 41):  # request-level events alone: shedding cannot relieve the queue
        events = (
            RequestStarted(ts=0.0, request_id=f"r{seq}", workflow_id="w", agent="a"),
            RequestFinished(ts=0.0, request_id=f"r{seq - 1}"),
            stored((seq,)),
        )
        queue.offer(EventBatch("s", seq, events), 0.0)
    c = queue.counters
    assert queue.depth == len(queue) == LAST_RESORT_FACTOR * 4  # bounded
    cut = 40 - HARD_BOUND_FACTOR * 4  # frames that arrived past the hard bound
    closing_only = (LAST_RESORT_FACTOR - HARD_BOUND_FACTOR) * 4
    assert c.frames_dropped == cut
    # every cut frame lost its start; those past the last resort lost their finish too
    assert c.events_dropped == cut + (cut - closing_only)
    kept = queue.take(100, 0.0)
    queued = sum(len(it.batch.events) for it in kept)
    assert c.events_received == queued + c.events_shed + c.events_dropped  # every event counted
    assert sum(block_events(it.batch) for it in kept) == 40 - c.block_events_shed
    tail = kept[HARD_BOUND_FACTOR * 4 :]
    assert all(type(e) is RequestFinished for it in tail for e in it.batch.events)
    # the closing-only frames keep their seq; the frames dropped whole leave a real gap
    assert [it.batch.seq for it in kept] == list(range(1, len(kept) + 1))


def test_a_full_queue_waits_for_room_until_the_worker_takes() -> None:
    queue = IngestQueue(max_frames=2, shed_above=1)
    queue.offer(EventBatch("s", 1, (stored((1,)),)), 0.0)
    assert not queue.full and queue.wait_for_room(0.0)
    queue.offer(EventBatch("s", 2, (stored((2,)),)), 0.0)
    assert queue.full and not queue.wait_for_room(0.01)
    assert not queue.wait_for_room(0.01)  # the same stretch of full queue: one wait counted
    assert queue.counters.receiver_waits == 1 and queue.counters.receiver_wait_s >= 0.02
    taker = threading.Timer(0.05, queue.take, args=(1, 0.0))
    taker.start()
    assert queue.wait_for_room(5.0) and not queue.full  # woken by the take, not timed out
    taker.join()


def test_a_full_queue_leaves_frames_on_the_socket_instead_of_dropping_them() -> None:
    """Receive livelock at the socket: a flood that outruns the Engine used to be received
    whole and cut (past the hard bound frames keep their closing events alone, so the Engine
    applied almost nothing). Now the receiver stops reading while the queue is full, the frames
    wait on the socket and at the sender, and what is read is decoded whole: nothing cut,
    nothing dropped, every frame arrives in order once the worker makes room."""
    queue = IngestQueue(max_frames=8, shed_above=4)
    receiver = Receiver("tcp://127.0.0.1:*", queue)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 16)
    push.setsockopt(zmq.SNDTIMEO, 10_000)
    push.connect(receiver.endpoint)
    frames = 200

    def send_all() -> None:  # blocking sends: the sender waits while the daemon does not read
        for seq in range(1, frames + 1):
            event = RequestStarted(ts=0.0, request_id=f"r{seq}", workflow_id="w", agent="a")
            push.send(BATCH_CODEC.encode(EventBatch("s", seq, (event,))))

    sender = threading.Thread(target=send_all)
    receiver.start()
    sender.start()
    try:
        deadline = time.monotonic() + 10.0
        while not queue.full and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # more frames are there to read; the receiver reads none of them
        assert queue.full and len(queue) == queue.max_frames
        seqs: list[int] = []
        while len(seqs) < frames and time.monotonic() < deadline:
            seqs += [it.batch.seq for it in queue.take(4, 0.05)]
        assert seqs == list(range(1, frames + 1))  # every frame, in order, decoded whole
        c = queue.counters
        assert c.frames == frames and c.frames_dropped == c.events_dropped == c.events_shed == 0
        assert c.receiver_waits >= 1 and c.receiver_wait_s > 0.0
    finally:
        sender.join(timeout=15.0)
        receiver.stop()
        push.close()


def test_the_connectors_client_never_waits_on_a_daemon_whose_queue_is_full() -> None:
    """The connector's own client against a receiver that stops reading (its queue full,
    nobody draining it): every ``send`` returns; once the sockets toward the daemon hold all
    they take, the client's bounded queue fills and further events are dropped there and
    counted, and none of it reaches past the daemon's bound.

    The test sends until the client drops (the sockets' buffering varies with the kernel and
    with how fast the sender thread keeps up), so it does not depend on a fixed event count."""
    queue = IngestQueue(max_frames=4, shed_above=2)
    receiver = Receiver("tcp://127.0.0.1:*", queue)
    receiver.start()
    client = DaemonClient(
        "vllm-0",
        Endpoints(events=receiver.endpoint, snapshots="tcp://127.0.0.1:1"),
        queue_max_events=2_000,
    )
    try:
        sent = 0
        deadline = time.monotonic() + 60.0
        # the receiver's socket alone buffers 1,024 frames of up to 256 events; keep sending
        # until the client's own queue is full and it drops
        while client.stats()["dropped_events"] == 0 and time.monotonic() < deadline:
            for _ in range(10_000):
                client.send(
                    RequestStarted(ts=0.0, request_id=f"r{sent}", workflow_id="w", agent="a")
                )
                sent += 1
        while (not queue.full or client.stats()["sent_batches"] < 2) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
        counts = client.stats()
        assert counts["accepted_events"] + counts["dropped_events"] == sent
        assert counts["dropped_events"] > 0  # dropped at the client, counted
        # the receiver read until the queue was full and no further: what it read is queued,
        # the rest of what was sent waits in the sockets
        assert queue.full and queue.counters.frames == len(queue) < counts["sent_batches"]
        assert queue.counters.frames_dropped == 0  # nothing cut at the daemon
    finally:
        client.close(flush_timeout_s=0.0)
        receiver.stop()


def test_overload_cuts_before_the_range_checks_and_every_event_is_counted_once() -> None:
    """Frames mixing valid and out-of-range events (NaN times, negative hashes) into a queue
    nobody drains, through both bounds: what overload keeps is checked (its out-of-range
    events dropped and counted invalid), what it cuts is counted shed or dropped; each event
    received lands in exactly one of applied, invalid, shed or dropped, and each hash of a kept
    or shed event in the block counts."""
    queue = IngestQueue(max_frames=8, shed_above=2)
    nan = float("nan")
    for seq in range(1, 41):
        events = (
            stored(range(seq * 100, seq * 100 + 16)),
            BlocksStored(ts=0.0, tier="gpu", block_hashes=(-seq, seq)),  # a negative hash
            RequestStarted(ts=nan, request_id=f"r{seq}", workflow_id="w", agent="a"),
            RequestFinished(ts=0.0, request_id=f"r{seq - 1}"),
            WorkflowFinished(ts=nan, workflow_id="w"),
        )
        queue.offer(EventBatch("s", seq, events), 0.0)
    c = queue.counters
    kept = queue.take(1000, 0.0)
    applied = sum(it.events for it in kept)
    assert c.events_received == 40 * 5
    assert c.events_received == applied + c.events_invalid + c.events_shed + c.events_dropped
    assert c.events_invalid == queue.validator.total > 0
    assert c.events_invalid < 40 * 3  # those of the frames overload cut were not checked
    assert c.frames_dropped > 0 and c.events_shed > 0  # both bounds were passed
    # no out-of-range event is queued for the Engine
    for it in kept:
        for e in it.batch.events:
            assert e.ts == e.ts and min(getattr(e, "block_hashes", (0,))) >= 0
    assert sum(it.block_events for it in kept) == c.block_events_received - c.block_events_shed


def test_the_bench_drives_a_real_daemon_and_accounts_for_every_block_event(
    tmp_path: Path,
) -> None:
    """A short, rate-limited bench-ingest against a real ``policyd serve`` process: every block
    event sent is received and applied (nothing to shed at this rate), no sequence gap."""
    lines: list[str] = []
    r = run_bench(seconds=2.0, shape=StreamShape(blocks_per_event=16), rate=100_000.0,
                  db=tmp_path / "bench.duckdb", policy="lru", decisions=20, sample_s=0.5,
                  say=lines.append)  # fmt: skip
    assert r["sent_block_events"] > 0
    assert r["received_block_events"] == r["sent_block_events"]
    assert r["applied_block_events"] == r["received_block_events"]
    assert r["shed_block_events"] == 0 and r["frames_dropped"] == 0 and r["seq_gaps"] == 0
    assert r["history_rows_rejected"] == 0 and r["history_last_error"] is None
    assert r["malformed_frames"] == 0 and r["rss_after_mib"] > 0
    assert len(r["rss_series"]) >= 3 and r["decision"]["requests"] == 20 + 5
    # a bench workflow ends after CALLS_PER_WORKFLOW calls and caches nothing of its own: the
    # daemon holds at most the round-robin's live workflows, however long the run
    state = r["rss_series"][-1]["state"]
    assert 0 < state["workflows"] <= CONCURRENT_WORKFLOWS
    assert state["predictor_workflows"] <= CONCURRENT_WORKFLOWS
    assert "daemon state" in render(r)
    assert "block events/s" in render(r) and any("RSS" in line for line in lines)
    plot_rss(r, tmp_path / "rss.png")
    assert (tmp_path / "rss.png").stat().st_size > 0
    # a --rates sweep's verdict: this run kept up; the same run with shedding, or with a
    # backlog left long after the senders stopped, did not
    assert kept_up(r) and "x the 500,000 target" in render_sweep([r])
    shed_some = {**r, "block_shed_rate": 0.01}
    backlog = {**r, "drained_s": r["window_s"] + 30.0}
    assert not kept_up(shed_some) and not kept_up(backlog)
    assert "sustained: none" in render_sweep([shed_some, backlog])
    # the history kept its block rows at the setting here; a run where the writer fell behind
    # says how low the adaptive rate went
    assert r["history_block_rate_min"] == r["history_block_rate_end"] == 1.0
    assert "sampled at 1;" in render(r)
    behind = {**r, "history_block_rate_min": 0.125, "history_block_rate_end": 0.5}
    assert "1 (min 0.125, end 0.5)" in render_sweep([behind])


def test_stage_costs_measure_every_stage() -> None:
    costs = stage_costs(StreamShape(blocks_per_event=16, events_per_frame=64), frames=8)
    assert list(costs["cpu_s"]) == [
        "decode", "hand-over to the history process", "offer (count, coalesce)",
        "Engine + service hooks", "history fan-out", "history DuckDB append",
    ]  # fmt: skip
    assert costs["block_events"] == 8 * 64 * 16 and costs["requests"] == 8 * 64 * 16 // 512
    assert costs["all_stages_block_events_per_cpu_s"] > 0
