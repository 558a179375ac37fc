"""The history writer in a process of its own (``HistoryProcess``): the same rows as the
in-process writer, bad input refused or counted, and neither side stuck when the other goes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest

from policyd.core.types import (
    BATCH_CODEC,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    PrefixHit,
    RequestFinished,
)
from policyd.history import HistoryError, SchemaTooNew, migrate
from policyd.history.process import HistoryProcess
from tests.test_history import NOW, config, started


@pytest.fixture
def history(tmp_path: Path) -> Iterator[HistoryProcess]:
    h = HistoryProcess(config(tmp_path))
    h.start()
    yield h
    h.close()


def batch(seq: int, rid: str, hashes: tuple[int, ...]) -> EventBatch:
    return EventBatch(
        source="vllm-0",
        seq=seq,
        events=(
            started(rid, hashes),
            PrefixHit(ts=1.1, request_id=rid, gpu_blocks=1, host_blocks=0, recomputed_blocks=1),
            BlocksStored(ts=1.2, tier="gpu", block_hashes=hashes[1:], request_id=rid),
            RequestFinished(ts=1.3, request_id=rid, output_tokens=3),
            BlocksRemoved(ts=1.4, tier="gpu", block_hashes=hashes[:1]),
        ),
    )


def test_frames_batches_and_rows_land_as_the_in_process_writer_writes_them(
    history: HistoryProcess,
) -> None:
    assert history.pid is not None and history.pid != os.getpid()
    history.record_frame(BATCH_CODEC.encode(batch(1, "r1", (11, 12))), NOW)  # as received
    history.record_batch(batch(2, "r2", (21, 22, 2**64 - 1)), received_ts=NOW + 1)  # encoded
    assert history.record(
        "decisions", [{"ts": NOW, "kind": "evict", "tier": "gpu", "n_blocks": 2, "reason": "x"}]
    )
    history.flush()
    assert history.query_live(
        "SELECT request_id, ts, gpu_hit_blocks, finished_ts, output_tokens FROM requests "
        "ORDER BY request_id"
    ) == [("r1", NOW, 1, NOW, 3), ("r2", NOW + 1, 1, NOW + 1, 3)]
    assert history.query_live(
        "SELECT kind, block_hash, request_id FROM block_accesses ORDER BY id"
    ) == [
        ("hit", 11, "r1"),
        ("stored", 12, "r1"),
        ("removed", 11, None),
        ("hit", 21, "r2"),
        ("stored", 22, "r2"),
        ("stored", -1, "r2"),  # 2**64 - 1 as signed 64-bit, as the in-process writer stores it
        ("removed", 21, None),
    ]
    stats = history.stats()
    assert stats["writer_alive"] is True and stats["process_pid"] == history.pid
    assert stats["rows_written"] == {  # fresh once a call returns
        "requests": 2,
        "block_accesses": 7,
        "decisions": 1,
        "predictions": 0,
        "mrc_points": 0,
        "sizing": 0,
        "settings_changes": 0,
        "cache_stats": 0,
    }
    assert stats["rows_dropped"] == 0 and isinstance(stats["rss_bytes"], int)
    snapshot = history.publish_snapshot()
    with duckdb.connect(str(snapshot), read_only=True) as conn:
        assert conn.execute("SELECT count(*) FROM block_accesses").fetchone() == (7,)


def test_settings_and_bad_input_reach_the_child_without_stopping_it(
    history: HistoryProcess,
) -> None:
    history.set_block_sample_rate(0.25)
    assert history.block_sample_rate == 0.25 and history.stats()["block_sample_rate_max"] == 0.25
    with pytest.raises(ValueError, match="block_sample_rate"):
        history.set_block_sample_rate(2.0)
    with pytest.raises(ValueError, match="unknown history table"):
        history.record("nope", [{"ts": 1.0}])  # refused on the daemon's side, as in-process
    history.record_frame(b"\x93not a frame", NOW)  # (the receiver validates frames first)
    with pytest.raises(HistoryError, match=r"Catalog|Binder"):
        history.query_live("SELECT * FROM no_such_table")
    history.record("decisions", [{"ts": NOW, "kind": "evict", "n_blocks": 1}])
    history.flush()
    assert history.query_live("SELECT count(*) FROM decisions") == [(1,)]
    assert history.stats()["link_malformed"] == 1


def test_a_dead_child_is_reported_and_never_blocks_the_daemon(tmp_path: Path) -> None:
    history = HistoryProcess(config(tmp_path))
    history.start()
    assert history.pid is not None
    os.kill(history.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while history.stats()["writer_alive"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = history.stats()
    assert stats["writer_alive"] is False
    assert "exited with code -9" in str(stats["last_error"])
    started = time.monotonic()
    for seq in range(1, 2000):  # past the socket's bound: dropped and counted, never blocking
        history.record_batch(batch(seq, f"r{seq}", (seq, seq + 1)), received_ts=NOW)
    assert time.monotonic() - started < 30.0  # (a stuck send would wait forever, not slowly)
    with pytest.raises(HistoryError, match="not running"):
        history.flush()
    history.close()  # returns: nothing to wait for


def test_a_newer_schema_is_refused_before_any_child_starts(tmp_path: Path) -> None:
    db = tmp_path / "h.duckdb"
    migrate(db)
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099'")
    history = HistoryProcess(config(tmp_path))
    with pytest.raises(SchemaTooNew):
        history.start()
    assert history.pid is None


def test_the_child_flushes_and_exits_when_the_daemon_dies(tmp_path: Path) -> None:
    """The daemon killed (no close): its child closes its history (the final snapshot is
    published then: the only one, with periodic snapshots off) and exits."""
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from policyd.history import HistoryConfig\n"
        "from policyd.history.process import HistoryProcess\n"
        f"h = HistoryProcess(HistoryConfig(db_path=Path({str(tmp_path / 'h.duckdb')!r}), "
        "snapshot_interval_s=None, cpu_budget=None))\n"
        "h.start()\n"
        "h.record('decisions', [{'ts': 1.0, 'kind': 'evict', 'n_blocks': 1}])\n"
        "h.flush()\n"  # (messages in flight when a process dies are lost with it)
        "print(h.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    child = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 60.0
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)
    snapshot = tmp_path / "h.snapshot.duckdb"
    with duckdb.connect(str(snapshot), read_only=True) as conn:
        assert conn.execute("SELECT count(*) FROM decisions").fetchone() == (1,)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
