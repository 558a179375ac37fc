"""The history writer on real DuckDB files: events and rows in, snapshot out, read back through
the locked-down query path and by plain DuckDB connections."""

from __future__ import annotations

import doctest
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import numpy as np
import pytest

from policyd.core.types import (
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.history import (
    DEFAULT_DB_PATH,
    History,
    HistoryConfig,
    SchemaTooNew,
    default_db_path,
    default_snapshot_path,
    migrate,
    run_readonly_query,
    sampling,
    writer,
)
from policyd.history.fanout import block_keep_mask
from policyd.history.sampling import AdaptiveRate
from policyd.sim.replay import SimConfig
from policyd.workloads.synthetic import synthetic_agents
from tests.conftest import replay

NOW = 1_800_000_000.0


class FakeClock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def config(tmp_path: Path, **kw: object) -> HistoryConfig:
    kw.setdefault("snapshot_interval_s", None)
    kw.setdefault("cpu_budget", None)  # exact contents: no sampling for the budget's sake
    return HistoryConfig(db_path=tmp_path / "h.duckdb", **kw)  # type: ignore[arg-type]


@pytest.fixture
def history(tmp_path: Path) -> Iterator[History]:
    h = History(config(tmp_path), clock=FakeClock())
    h.start()
    yield h
    h.close()


def started(rid: str, hashes: tuple[int, ...], ts: float = 1.0) -> RequestStarted:
    return RequestStarted(
        ts=ts,
        request_id=rid,
        workflow_id="w1",
        agent="planner",
        workflow_type="fact-check",
        block_hashes=hashes,
        prompt_tokens=16 * len(hashes),
    )


def test_event_batches_round_trip_through_a_snapshot(history: History) -> None:
    first = EventBatch(
        source="vllm-0",
        seq=1,
        events=(
            started("r1", (11, 12, 13, 2**64 - 1)),
            PrefixHit(ts=1.1, request_id="r1", gpu_blocks=1, host_blocks=2, recomputed_blocks=1),
            BlocksStored(ts=1.2, tier="gpu", block_hashes=(21, 22), request_id="r1"),
            started("r2", (11, 31)),
        ),
    )
    history.record_batch(first, received_ts=NOW)
    history.flush()  # r1 and r2 are on disk before their finish arrives: a real UPDATE
    second = EventBatch(
        source="vllm-0",
        seq=2,
        events=(
            RequestFinished(ts=2.0, request_id="r1", output_tokens=5),
            BlocksRemoved(ts=2.1, tier="host", block_hashes=(12,)),
            BlocksLoaded(ts=2.2, block_hashes=(13,), request_id="r2"),
            WorkflowFinished(ts=2.3, workflow_id="w1"),
            RequestFinished(ts=2.4, request_id="never-started"),
        ),
    )
    history.record_batch(second, received_ts=NOW + 1)
    history.record(
        "decisions",
        [{"ts": NOW, "kind": "evict", "tier": "gpu", "n_blocks": 2, "reason": "retired"}],
    )
    snapshot = history.publish_snapshot()
    assert snapshot == default_snapshot_path(history.config.db_path)

    requests = run_readonly_query(
        snapshot,
        "SELECT request_id, source, agent, prompt_blocks, gpu_hit_blocks, host_hit_blocks, "
        "recomputed_blocks, finished_ts, output_tokens FROM requests ORDER BY request_id",
    )
    assert requests.rows == [
        ("r1", "vllm-0", "planner", 4, 1, 2, 1, NOW + 1, 5),
        ("r2", "vllm-0", "planner", 2, None, None, None, None, None),
    ]
    blocks = run_readonly_query(
        snapshot, "SELECT kind, tier, block_hash, request_id FROM block_accesses ORDER BY id"
    )
    assert blocks.rows == [
        ("hit", "gpu", 11, "r1"),
        ("hit", "host", 12, "r1"),
        ("hit", "host", 13, "r1"),
        ("stored", "gpu", 21, "r1"),
        ("stored", "gpu", 22, "r1"),
        ("removed", "host", 12, None),
        ("loaded", "host", 13, "r2"),
    ]
    assert run_readonly_query(snapshot, "SELECT reason FROM decisions").rows == [("retired",)]
    stats = history.stats()
    assert stats["rows_written"]["block_accesses"] == 7  # type: ignore[index]
    assert stats["request_updates_unmatched"] == 1
    assert stats["rows_dropped"] == 0 and stats["queue_rows"] == 0


def test_block_hashes_are_stored_as_signed_64_bit(history: History) -> None:
    hashes = (0, 1, 2**63 - 1, 2**63, 2**64 - 1)
    history.record_batch(
        EventBatch(
            source="s", seq=1, events=(BlocksStored(ts=0, tier="gpu", block_hashes=hashes),)
        ),
        received_ts=NOW,
    )
    rows = history.query_live("SELECT block_hash FROM block_accesses ORDER BY id")
    assert [r[0] for r in rows] == [0, 1, 2**63 - 1, -(2**63), -1]
    assert [int(r[0]) & (2**64 - 1) for r in rows] == list(hashes)  # type: ignore[call-overload]


def test_every_table_takes_rows_and_bad_rows_are_refused_or_counted(history: History) -> None:
    rows: dict[str, dict[str, object]] = {
        "predictions": {"ts": NOW, "workflow_id": "w", "step": 1, "probability": 0.5},
        "mrc_points": {"ts": NOW, "capacity_blocks": 10, "hit_ratio": 0.3, "source": "shards"},
        "sizing": {"ts": NOW, "working_set_blocks": 5, "reason": "fits"},
        "cache_stats": {"ts": NOW, "interval_s": 1.0, "requests": 3, "events_shed": 0},
        "settings_changes": {"ts": NOW, "key": "k", "old_value": "1", "new_value": "2"},
        "requests": {"ts": NOW, "request_id": "direct"},
    }
    for table, row in rows.items():
        assert history.record(table, [row])
    with pytest.raises(ValueError, match="unknown history table 'nope'"):
        history.record("nope", [{"ts": 1.0}])
    with pytest.raises(ValueError, match="unknown column"):
        history.record("sizing", [{"ts": 1.0, "colour": "red"}])
    # a value of the wrong type and a row missing its NOT NULL ts: rejected, counted, and the
    # good rows queued beside them are kept
    history.record("mrc_points", [{"ts": "yesterday"}])
    history.record("settings_changes", [{"key": "no-ts"}])
    history.record("mrc_points", [{"ts": NOW + 1, "capacity_blocks": 20}])
    history.flush()
    for table in rows:
        count = history.query_live(f"SELECT count(*) FROM {table}")[0][0]
        assert count == (2 if table == "mrc_points" else 1), table
    assert history.stats()["rows_rejected"] == 2
    assert "settings_changes" in str(history.stats()["last_error"])


def test_retention_by_age_and_by_row_cap(tmp_path: Path) -> None:
    clock = FakeClock()
    h = History(config(tmp_path, retention_s=100.0, retention_rows=3), clock=clock)
    with h:
        h.record(
            "decisions", [{"ts": NOW - age, "kind": "evict"} for age in (500, 150, 50, 40, 30, 20)]
        )
        h.record("sizing", [{"ts": NOW - 500}, {"ts": NOW - 1}])
        deleted = h.apply_retention()
        assert deleted["decisions"] == 3 and deleted["sizing"] == 1
        ages = [NOW - r[0] for r in h.query_live("SELECT ts FROM decisions ORDER BY ts")]  # type: ignore[operator]
        assert ages == [40, 30, 20]  # two too old, then the oldest beyond the cap of 3
        clock.now += 25  # the next pass drops what has aged past 100 s since
        assert h.apply_retention()["decisions"] == 0
        clock.now += 50
        assert h.apply_retention()["decisions"] == 2
        assert h.query_live("SELECT count(*) FROM sizing") == [(1,)]


def test_block_rows_are_sampled_by_hash_at_the_configured_rate(tmp_path: Path) -> None:
    rate = 0.25
    hashes = tuple(range(20_000))  # sequential: the mixing step makes them uniform
    h = History(config(tmp_path, block_sample_rate=rate), clock=FakeClock())
    with h:
        h.record_batch(
            EventBatch(
                source="s",
                seq=1,
                events=(
                    BlocksStored(ts=0, tier="gpu", block_hashes=hashes),
                    BlocksRemoved(ts=1, tier="gpu", block_hashes=hashes),
                ),
            ),
            received_ts=NOW,
        )
        stored = {
            r[0]
            for r in h.query_live("SELECT block_hash FROM block_accesses WHERE kind = 'stored'")
        }
        removed = {
            r[0]
            for r in h.query_live("SELECT block_hash FROM block_accesses WHERE kind = 'removed'")
        }
    # binomial sd at n=20000 is 0.003: 0.02 is over six of them
    assert abs(len(stored) / len(hashes) - rate) < 0.02
    assert stored == removed  # a kept block keeps its whole history
    keep = block_keep_mask(np.array(hashes, dtype=np.uint64), rate)
    assert stored == {int(x) for x in np.array(hashes)[keep]}


def test_sampled_block_rows_keep_the_event_order_and_label_each_event(tmp_path: Path) -> None:
    """Block-level events and a prefix hit's blocks, interleaved with request events in one
    batch, sampled at 1/4: the rows are each segment's kept hashes, segment after segment in
    event order, with that segment's kind, tier and request."""
    rate = 0.25
    prompt = tuple(range(1000, 1600))
    segments = [
        ("stored", "gpu", "r0", tuple(range(0, 400))),
        ("hit", "gpu", "r1", prompt[:200]),
        ("hit", "host", "r1", prompt[200:500]),
        ("removed", "gpu", None, tuple(range(0, 300))),
        ("loaded", "host", "r1", prompt[500:]),
    ]
    events = (
        BlocksStored(ts=0, tier="gpu", block_hashes=segments[0][3], request_id="r0"),
        started("r1", prompt),
        PrefixHit(ts=0, request_id="r1", gpu_blocks=200, host_blocks=300, recomputed_blocks=100),
        BlocksRemoved(ts=0, tier="gpu", block_hashes=segments[3][3]),
        BlocksLoaded(ts=0, block_hashes=segments[4][3], request_id="r1"),
    )
    h = History(config(tmp_path, block_sample_rate=rate), clock=FakeClock())
    with h:
        h.record_batch(EventBatch(source="s", seq=1, events=events), received_ts=NOW)
        rows = h.query_live(
            "SELECT kind, tier, request_id, block_hash, sample_rate FROM block_accesses ORDER BY id"
        )
    expected = []
    for kind, tier, request, hashes in segments:
        keep = block_keep_mask(np.array(hashes, dtype=np.uint64), rate)
        expected += [(kind, tier, request, int(b), rate) for b in np.array(hashes)[keep]]
    assert 0 < len(expected) < 1900 and rows == expected


def test_the_writer_steps_aside_before_each_batch_while_told_to_and_loses_nothing(
    tmp_path: Path,
) -> None:
    behind = threading.Event()
    h = History(config(tmp_path), clock=FakeClock(), defer=behind.is_set)
    batch = EventBatch(
        source="s", seq=1, events=(BlocksStored(ts=0, tier="gpu", block_hashes=(1, 2, 3)),)
    )
    with h:
        h.record_batch(batch, received_ts=NOW)
        h.flush()
        assert h.stats()["deferrals"] == 0
        behind.set()
        for _ in range(3):
            h.record_batch(batch, received_ts=NOW)
        h.record("decisions", [{"ts": NOW, "kind": "evict"}])  # not a batch: never deferred
        h.flush()
        stats = h.stats()
        assert stats["deferrals"] == 3
        assert h.query_live("SELECT count(*) FROM block_accesses") == [(12,)]
        assert stats["rows_dropped"] == 0


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path: Path) -> None:
    # a monotonic clock that stands still: the adaptive rate never gets its second to halve
    h = History(config(tmp_path, queue_max_rows=100), clock=FakeClock(), monotonic=lambda: 0.0)
    # not started yet: nothing drains the queue, so the bound is all that stops it
    accepted = [h.record("decisions", [{"ts": NOW + i, "kind": "evict"}] * 30) for i in range(5)]
    assert accepted == [True, True, True, False, False]
    batch = EventBatch(
        source="s", seq=1, events=(BlocksStored(ts=0, tier="gpu", block_hashes=(1,) * 50),)
    )
    h.record_batch(batch, received_ts=NOW)
    stats = h.stats()
    # no room for its 50 block rows; it has no request rows, so nothing of it is queued
    assert stats["queue_rows"] == 90 and stats["rows_dropped"] == 2 * 30 + 50
    with h:
        h.flush()
        assert h.query_live("SELECT count(*) FROM decisions") == [(90,)]
        assert h.stats()["queue_rows"] == 0
        # the first write read DuckDB's own memory use: a table's blocks in its buffer pool
        memory = h.stats()["duckdb_memory_bytes"]
        assert isinstance(memory, int) and memory > 0
    assert not h.record("decisions", [{"ts": NOW, "kind": "evict"}])  # closed: dropped, counted


def _stored(seq: int, hashes: range) -> EventBatch:
    return EventBatch(
        source="s", seq=seq, events=(BlocksStored(ts=0, tier="gpu", block_hashes=tuple(hashes)),)
    )


def test_the_block_rate_halves_while_the_writer_is_behind_and_doubles_back(
    tmp_path: Path,
) -> None:
    """Adaptive sampling: the queue past half its bound halves the block rows' rate (at most
    once a second); ten seconds with it below a fifth doubles it back, up to the setting. Each
    row records its rate, and the rows kept are exactly the hash sample at that rate (a lower
    rate keeps a subset of a higher one's blocks)."""
    clock = FakeClock(0.0)
    h = History(config(tmp_path, queue_max_rows=10_000), clock=FakeClock(), monotonic=clock)
    sent: list[tuple[range, float]] = []

    def send(at: float) -> float:
        clock.now = at
        hashes = range(len(sent) * 1000, len(sent) * 1000 + 1000)
        h.record_batch(_stored(len(sent), hashes), received_ts=NOW)
        sent.append((hashes, h.block_sample_rate))
        return sent[-1][1]

    # not started: nothing drains the queue. Six batches fill it to 0.6 within the first second
    assert [send(0.1 * i) for i in range(6)] == [1.0] * 6
    assert send(1.0) == 0.5  # past half, a second after the start
    assert send(1.5) == 0.5  # still past half, but the last halving is half a second old
    assert send(2.0) == 0.25
    h.start()
    try:

        def caught_up(at: float) -> float:  # the writer has written everything queued
            h.flush()
            return send(at)

        assert caught_up(3.0) == 0.25  # low since 3.0
        assert caught_up(12.9) == 0.25
        assert caught_up(13.0) == 0.5  # ten seconds low
        assert caught_up(22.9) == 0.5  # ten seconds since that change, not since 3.0
        assert caught_up(23.0) == 1.0
        assert caught_up(40.0) == 1.0  # never above the setting
        h.flush()
        rows = set(h.query_live("SELECT block_hash, sample_rate FROM block_accesses"))
        stats = h.stats()
    finally:
        h.close()
    expected = set()
    for hashes, rate in sent:
        keep = block_keep_mask(np.array(hashes, dtype=np.uint64), rate)
        expected |= {(int(b), rate) for b in np.array(hashes)[keep]}
    assert rows == expected
    assert {rate for _, rate in rows} == {1.0, 0.5, 0.25}
    assert stats["block_sample_rate_changes"] == 4 and stats["rows_dropped"] == 0
    assert stats["block_sample_rate"] == stats["block_sample_rate_max"] == 1.0


def test_the_rate_is_not_halved_again_while_the_queue_drains() -> None:
    """A halving shows once the backlog queued before it is written: a queue past half its
    bound but shrinking keeps the rate; one still growing halves it again; the floor holds."""
    assert doctest.testmod(sampling).failed == 0
    rate = AdaptiveRate(ceiling=1.0, floor=0.25, now=0.0)
    assert rate.update(0.9, 1.0) == 0.5  # past half and growing (from nothing)
    assert [rate.update(fill, t) for fill, t in [(0.95, 2.0), (0.9, 3.0), (0.8, 4.0)]] == [
        0.25,  # still growing a second later
        0.25,  # draining: held (and 0.125 would be under the floor anyway)
        0.25,
    ]
    rate = AdaptiveRate(ceiling=0.5, floor=2.0**-10, now=0.0)
    assert [rate.update(fill, t) for fill, t in [(0.7, 1.0), (0.6, 2.0), (0.55, 3.0)]] == [
        0.25,
        0.25,  # the queue shrinks at the halved rate: no second halving
        0.25,
    ]
    assert rate.update(0.65, 4.0) == 0.125  # growing again
    rate.set_ceiling(1.0)
    assert rate.rate == 1.0 and rate.changes == 2
    fixed = AdaptiveRate(ceiling=0.5, floor=2.0**-10, now=0.0, adaptive=False)
    assert {fixed.update(1.0, float(t)) for t in range(10)} == {0.5}


def test_a_full_queue_that_drops_or_a_writer_over_its_cpu_budget_halves_the_rate() -> None:
    """A queue at its bound does not grow, but drops: that halves the rate as growth does. A
    writer over its CPU budget halves it whatever its queue, and the rate is doubled back only
    under half the budget."""
    rate = AdaptiveRate(ceiling=1.0, floor=2.0**-10, now=0.0)
    assert rate.update(1.0, 1.0) == 0.5  # growing from nothing
    assert rate.update(1.0, 2.0) == 0.5  # full, not growing, nothing dropped: held
    assert rate.update(1.0, 3.0, dropped=10) == 0.25  # full and dropping
    assert rate.update(1.0, 4.0, dropped=10) == 0.25  # no new drops: held
    busy = AdaptiveRate(ceiling=1.0, floor=2.0**-10, now=0.0)
    assert [busy.update(0.0, t, busy=True, idle=False) for t in (1.0, 1.5, 2.0)] == [
        0.5,
        0.5,  # (checks at least a second apart)
        0.25,
    ]
    # an empty queue with the writer between half its budget and the budget: held
    assert {busy.update(0.0, float(t), idle=False) for t in range(3, 30)} == {0.25}
    assert busy.update(0.0, 30.0) == 0.25  # under half of it from now ...
    assert busy.update(0.0, 40.0) == 0.5  # ... for UP_AFTER_S


def test_the_writer_reports_its_cpu_share_and_samples_less_over_its_budget(
    tmp_path: Path,
) -> None:
    """With a budget no writer can keep, the rate falls as soon as the share is measured."""
    with History(config(tmp_path, cpu_budget=1e-9, flush_interval_s=0.05)) as h:
        deadline = time.monotonic() + 30.0
        seq = 0
        while h.block_sample_rate == 1.0 and time.monotonic() < deadline:
            seq += 1
            h.record_batch(_stored(seq, range(seq * 64, seq * 64 + 64)), received_ts=NOW)
            time.sleep(0.05)
        stats = h.stats()
    assert stats["block_sample_rate"] == 0.5 and stats["cpu_budget"] == 1e-9
    assert isinstance(stats["cpu_share"], float) and stats["cpu_share"] > 1e-9
    assert HistoryConfig(db_path=tmp_path / "x.duckdb").cpu_budget == 0.25  # the default
    with pytest.raises(ValueError, match="cpu_budget"):
        HistoryConfig(db_path=tmp_path / "x.duckdb", cpu_budget=0.0)


def test_without_adaptive_sampling_the_rate_is_the_setting_and_a_full_queue_drops(
    tmp_path: Path,
) -> None:
    clock = FakeClock(0.0)
    cfg = config(tmp_path, queue_max_rows=5_000, adaptive_sampling=False, block_sample_rate=0.5)
    h = History(cfg, clock=FakeClock(), monotonic=clock)
    for i in range(12):
        clock.now = float(i)
        h.record_batch(_stored(i, range(i * 1000, i * 1000 + 1000)), received_ts=NOW)
        assert h.block_sample_rate == 0.5
    stats = h.stats()
    # the bound counts what a batch holds (all 1,000 hashes), not the 500 rows it makes
    assert stats["queue_rows"] == 5_000 and stats["rows_dropped"] == 7 * 500
    assert stats["block_sample_rate_changes"] == 0
    h.set_block_sample_rate(0.125)
    assert h.block_sample_rate == h.stats()["block_sample_rate_max"] == 0.125
    with pytest.raises(ValueError, match="block_sample_rate must be in"):
        h.set_block_sample_rate(1.5)
    h.close()


def test_past_the_bound_a_batch_keeps_its_request_rows(tmp_path: Path) -> None:
    """A batch whose block rows do not fit still queues its request rows while they do: the
    requests table stays whole, the block rows are dropped and counted."""
    h = History(config(tmp_path, queue_max_rows=100), clock=FakeClock(), monotonic=lambda: 0.0)
    assert h.record("decisions", [{"ts": NOW, "kind": "evict"}] * 55)
    prompt = tuple(range(1000, 1040))
    batch = EventBatch(
        source="s",
        seq=1,
        events=(
            RequestStarted(ts=0, request_id="r1", workflow_id="w", agent="a",
                           workflow_type="t", block_hashes=prompt, prompt_tokens=640),
            BlocksStored(ts=0, tier="gpu", block_hashes=prompt, request_id="r1"),
            RequestFinished(ts=1, request_id="r1", output_tokens=3),
        ),
    )  # fmt: skip
    h.record_batch(batch, received_ts=NOW)
    # it holds 82 (2 request events, 2 x 40 hashes) against room for 45: cut to the request
    # events (holding 42, the prompt's hashes included), its 40 stored rows dropped
    stats = h.stats()
    assert stats["rows_dropped"] == 40 and stats["queue_rows"] == 55 + 42
    with h:
        h.flush()
        assert h.query_live("SELECT request_id, output_tokens FROM requests") == [("r1", 3)]
        assert h.query_live("SELECT count(*) FROM block_accesses") == [(0,)]


def test_reading_duckdbs_memory_between_writes_leaves_the_connection_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory probe after a write reads its result to the end: a half-read result makes
    DuckDB refuse the next write's ``register`` on that connection (a bug once)."""
    monkeypatch.setattr(writer, "MEMORY_PROBE_S", 0.0)  # probe after every write, not every 5 s
    with History(config(tmp_path), clock=FakeClock()) as h:
        for i in range(3):  # write, probe, write, ...
            assert h.record("decisions", [{"ts": NOW + i, "kind": "evict"}] * 10)
            h.flush()
        assert h.query_live("SELECT count(*) FROM decisions") == [(30,)]
        stats = h.stats()
        assert stats["rows_rejected"] == 0 and stats["last_error"] is None
        assert isinstance(stats["duckdb_memory_bytes"], int)


def test_snapshot_is_readable_by_plain_duckdb_while_the_writer_keeps_writing(
    tmp_path: Path,
) -> None:
    h = History(config(tmp_path, flush_interval_s=0.05), clock=FakeClock())
    stop = threading.Event()
    written = [0]

    def produce() -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            hashes = tuple(range(seq * 100, seq * 100 + 100))
            batch = EventBatch(
                source="s", seq=seq, events=(BlocksStored(ts=0, tier="gpu", block_hashes=hashes),)
            )
            h.record_batch(batch, received_ts=NOW + seq)
            written[0] = seq
            stop.wait(0.002)

    with h:
        producer = threading.Thread(target=produce)
        producer.start()
        try:
            while written[0] < 20:
                stop.wait(0.01)
            first = h.publish_snapshot()
            reader = duckdb.connect(str(first), read_only=True)
            n1 = reader.execute("SELECT count(*) FROM block_accesses").fetchone()
            while written[0] < 60:
                stop.wait(0.01)
            second = h.publish_snapshot()  # replaced while `reader` still has the old one open
            assert n1 is not None and n1[0] > 0 and n1[0] % 100 == 0  # whole batches only
            assert reader.execute("SELECT count(*) FROM block_accesses").fetchone() == n1
            reader.close()
            with duckdb.connect(str(second), read_only=True) as fresh:
                n2 = fresh.execute("SELECT count(*) FROM block_accesses").fetchone()
                assert fresh.execute("SELECT version_num FROM alembic_version").fetchone() == (
                    "0003",
                )
            assert n2 is not None and n2[0] > n1[0]
        finally:
            stop.set()
            producer.join()
    assert not list(tmp_path.glob(".*.tmp*"))  # no temporary snapshot left behind
    with duckdb.connect(str(h.config.db_path), read_only=True) as live:
        assert live.execute("SELECT count(*) FROM block_accesses").fetchone() == (written[0] * 100,)


def test_close_publishes_a_final_snapshot(tmp_path: Path) -> None:
    h = History(config(tmp_path), clock=FakeClock())
    with h:
        h.record("settings_changes", [{"ts": NOW, "key": "k", "actor": "test"}])
    snapshot = default_snapshot_path(h.config.db_path)
    assert run_readonly_query(snapshot, "SELECT actor FROM settings_changes").rows == [("test",)]
    h.close()  # idempotent
    # written in the v1.0.0 storage format, so DuckDB clients older than 2.0 can open it
    with duckdb.connect(str(snapshot), read_only=True) as conn:
        tags = conn.execute(
            "SELECT tags FROM duckdb_databases() WHERE NOT internal AND database_name = 'h'"
        ).fetchone()
    assert tags is not None and tags[0]["storage_version"].startswith("v1.0.0")


def test_start_refuses_a_newer_schema(tmp_path: Path) -> None:
    db = tmp_path / "h.duckdb"
    migrate(db)
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0999'")
    with pytest.raises(SchemaTooNew, match="'0999'"):
        History(config(tmp_path)).start()


def test_default_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("POLICYD_DB", raising=False)
    assert default_db_path() == DEFAULT_DB_PATH == Path("policyd-history.duckdb")
    monkeypatch.setenv("POLICYD_DB", str(tmp_path / "x.duckdb"))
    assert default_db_path() == tmp_path / "x.duckdb"
    assert default_snapshot_path(Path("/d/x.duckdb")) == Path("/d/x.snapshot.duckdb")
    with pytest.raises(ValueError, match="block_sample_rate"):
        HistoryConfig(db_path=tmp_path / "a.duckdb", block_sample_rate=1.5)
    with pytest.raises(ValueError, match="differ"):
        HistoryConfig(db_path=tmp_path / "a.duckdb", snapshot_path=tmp_path / "a.duckdb")


def test_a_simulated_workload_lands_whole(tmp_path: Path) -> None:
    """The simulator's own event batches (every event type it emits) become exactly the rows
    their events describe."""
    workload = synthetic_agents(seed=3, workflows=12, min_steps=2, max_steps=5, mean_gap_s=0.1)
    run = replay(workload, "lru", SimConfig(concurrency=4, gpu_blocks=400, host_blocks=800))
    events = run.events
    starts = [e for e in events if isinstance(e, RequestStarted)]
    hits = [e for e in events if isinstance(e, PrefixHit)]
    per_kind = {
        "stored": sum(len(e.block_hashes) for e in events if isinstance(e, BlocksStored)),
        "removed": sum(len(e.block_hashes) for e in events if isinstance(e, BlocksRemoved)),
        "loaded": sum(len(e.block_hashes) for e in events if isinstance(e, BlocksLoaded)),
        "hit": sum(e.gpu_blocks + e.host_blocks for e in hits),
    }
    assert starts and per_kind["stored"] and per_kind["removed"]
    with History(config(tmp_path), clock=FakeClock()) as h:
        for i, batch in enumerate(run.engine.batches):
            h.record_batch(batch, received_ts=NOW + i)
        rows = h.query_live("SELECT kind, count(*) FROM block_accesses GROUP BY 1")
        counts = {str(kind): n for kind, n in rows}
        requests = h.query_live(
            "SELECT count(*), count(gpu_hit_blocks), count(finished_ts), "
            "sum(gpu_hit_blocks + host_hit_blocks + recomputed_blocks) FROM requests"
        )[0]
    assert counts == {kind: n for kind, n in per_kind.items() if n}
    assert requests[:3] == (len(starts), len(hits), len(starts))
    assert requests[3] == sum(e.gpu_blocks + e.host_blocks + e.recomputed_blocks for e in hits)


def test_the_writer_connection_caps_duckdb_memory(tmp_path: Path) -> None:
    """DuckDB's buffer pool defaults to 80% of the machine; the writer's is capped (bounded RSS)."""
    h = History(HistoryConfig(db_path=tmp_path / "h.duckdb", memory_limit="256MB"))
    h.start()
    try:
        (limit,) = h.query_live("select current_setting('memory_limit')")[0]
        assert str(limit).replace(" ", "") in {"256.0MB", "244.1MiB"}
    finally:
        h.close()
    with pytest.raises(ValueError, match="memory_limit"):
        HistoryConfig(db_path=tmp_path / "x.duckdb", memory_limit="lots; drop table requests")
