"""DaemonClient against real ZeroMQ sockets on loopback: batching, sequence numbers, bounded
queue with counted drops, never blocking without a daemon, snapshot freshness and malformed
snapshot frames."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from policyd.core.client import DaemonClient
from policyd.core.types import (
    BATCH_CODEC,
    SNAPSHOT_CODEC,
    BlocksStored,
    EventBatch,
    PolicySnapshot,
    WorkflowFinished,
)
from policyd.core.wire import MAX_EVENTS_PER_BATCH, SNAPSHOT_TOPIC, Endpoints
from tests.peers import Sockets, daemon_peer, wait_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def daemon_sockets() -> Iterator[Sockets]:
    """A PULL and a PUB bound on ephemeral loopback ports, as the daemon binds them."""
    with daemon_peer() as sockets:
        yield sockets


def receive_batches(
    pull: zmq.Socket[bytes], events: int, timeout_s: float = 10.0
) -> list[EventBatch]:
    got: list[EventBatch] = []
    deadline = time.monotonic() + timeout_s
    while sum(len(b.events) for b in got) < events and time.monotonic() < deadline:
        if pull.poll(100):
            got.append(BATCH_CODEC.decode(pull.recv()))
    return got


def stored(i: int) -> BlocksStored:
    return BlocksStored(ts=float(i), tier="gpu", block_hashes=(i,))


def test_events_arrive_batched_in_order_with_increasing_seq(
    daemon_sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], Endpoints],
) -> None:
    pull, _, endpoints = daemon_sockets
    n = 3 * MAX_EVENTS_PER_BATCH + 17
    with DaemonClient("conn-a", endpoints) as client:
        assert client.send(WorkflowFinished(ts=0.0, workflow_id="w0"))
        assert client.send_many(stored(i) for i in range(1, n)) == n - 1
        batches = receive_batches(pull, n)
        # the last frame can reach the daemon before the sender thread counts it: flush waits
        # for every event taken off the queue to be sent and counted
        assert client.flush()
        stats = client.stats()
    events = [e for b in batches for e in b.events]
    assert len(events) == n
    assert events[0] == WorkflowFinished(ts=0.0, workflow_id="w0")
    assert [e.block_hashes[0] for e in events[1:] if isinstance(e, BlocksStored)] == list(
        range(1, n)
    )
    assert all(b.source == "conn-a" for b in batches)
    assert all(len(b.events) <= MAX_EVENTS_PER_BATCH for b in batches)
    seqs = [b.seq for b in batches]
    assert seqs == list(range(1, len(batches) + 1))
    assert stats["sent_events"] == n and stats["dropped_events"] == 0


def test_without_a_daemon_send_never_blocks_and_drops_are_counted() -> None:
    endpoints = Endpoints(events="tcp://127.0.0.1:9", snapshots="tcp://127.0.0.1:9")
    client = DaemonClient("lonely", endpoints, queue_max_events=100)
    try:
        accepted = [client.send(stored(i)) for i in range(250)]
        accepted_many = client.send_many(stored(i) for i in range(50))
        stats = client.stats()
        assert client.snapshot() is None
    finally:
        started = time.monotonic()
        client.close(flush_timeout_s=0.2)
    assert time.monotonic() - started < 5.0  # close gives up instead of hanging
    # the sender may have taken one batch out of the queue (it stays pending for a retry)
    assert sum(accepted) + accepted_many == stats["accepted_events"]
    assert stats["accepted_events"] + stats["dropped_events"] == 300
    assert 100 <= stats["accepted_events"] <= 100 + MAX_EVENTS_PER_BATCH
    assert stats["sent_events"] == 0
    assert client.send(stored(1)) is False  # closed: refused, counted, no exception


def test_events_queued_before_the_daemon_binds_are_delivered() -> None:
    ctx = zmq.Context()
    probe = ctx.socket(zmq.PULL)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)  # a free port, nobody listening yet
    endpoints = Endpoints(events=f"tcp://127.0.0.1:{port}", snapshots="tcp://127.0.0.1:9")
    client = DaemonClient("early", endpoints)
    try:
        client.send_many(stored(i) for i in range(10))
        time.sleep(0.2)
        pull = ctx.socket(zmq.PULL)
        pull.bind(endpoints.events)
        batches = receive_batches(pull, 10)
        assert [
            e.block_hashes[0] for b in batches for e in b.events if isinstance(e, BlocksStored)
        ] == list(range(10))
        pull.close(0)
    finally:
        client.close(flush_timeout_s=0.2)
        ctx.term()


def test_concurrent_senders_lose_nothing_when_the_queue_has_room(
    daemon_sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], Endpoints],
) -> None:
    pull, _, endpoints = daemon_sockets
    per_thread, threads = 2000, 4
    with DaemonClient("many", endpoints, queue_max_events=per_thread * threads) as client:

        def produce(t: int) -> None:
            for i in range(per_thread):
                client.send(stored(t * per_thread + i))

        workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        batches = receive_batches(pull, per_thread * threads)
    hashes = sorted(
        e.block_hashes[0] for b in batches for e in b.events if isinstance(e, BlocksStored)
    )
    assert hashes == list(range(per_thread * threads))


def publish_until(
    pub: zmq.Socket[bytes], frames: list[bytes], cond: Callable[[], bool], timeout_s: float = 10.0
) -> bool:
    """PUB/SUB drops what is sent before the subscription lands: repeat until seen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pub.send_multipart(frames)
        if wait_for(cond, 0.05):
            return True
    return False


def test_snapshot_is_kept_while_fresh_and_malformed_frames_are_ignored(
    daemon_sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes], Endpoints],
) -> None:
    _, pub, endpoints = daemon_sockets
    clock = FakeClock()
    with DaemonClient("sub", endpoints, clock=clock) as client:
        first = PolicySnapshot(version=1, ts=0.0, ttl_s=5.0, policy="pbkv", pin=(7,))
        frames = [SNAPSHOT_TOPIC, SNAPSHOT_CODEC.encode(first)]
        assert publish_until(pub, frames, lambda: client.snapshot() is not None)
        assert client.snapshot() == first
        # malformed: garbage, wrong version, wrong type, one frame only
        bad = [
            [SNAPSHOT_TOPIC, b"\xc1garbage"],
            [SNAPSHOT_TOPIC, b"\x92\x63\x80"],  # [99, {}]
            [SNAPSHOT_TOPIC, SNAPSHOT_CODEC._encoder.encode((1, {"version": "x"}))],
            [SNAPSHOT_TOPIC],
        ]
        for frames_bad in bad:
            pub.send_multipart(frames_bad)
        assert wait_for(lambda: client.stats()["malformed_snapshots"] == len(bad))
        assert client.snapshot() == first  # still the last valid one
        clock.now = 5.0
        assert client.snapshot() == first
        clock.now = 5.01
        assert client.snapshot() is None  # stale: the connector falls back to LRU
        second = PolicySnapshot(version=2, ts=1.0, ttl_s=5.0, policy="pbkv")
        assert publish_until(
            pub,
            [SNAPSHOT_TOPIC, SNAPSHOT_CODEC.encode(second)],
            lambda: client.snapshot() == second,
        )
        assert client.snapshot(now=clock.now + 6.0) is None
