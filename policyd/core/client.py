"""The non-blocking daemon client a connector embeds.

``DaemonClient.send`` appends to a bounded in-memory queue and returns at once: it never blocks
and never raises, whatever the daemon does. A sender thread drains the queue into sequenced
``EventBatch`` frames of up to ``MAX_EVENTS_PER_BATCH`` events and PUSHes them without blocking
(``zmq.NOBLOCK``, a small send high-water mark, ZeroMQ reconnecting by itself); while the daemon is
unreachable the unsent frame is retried and new events pile up in the queue until it is full,
after which they are dropped and counted. A subscriber thread keeps the newest valid
``PolicySnapshot``; ``snapshot(now)`` hands it out only while it is younger than its ``ttl_s``
(by receive time on the client's clock), else ``None`` - the connector then falls back to LRU.

This module imports only msgspec, pyzmq and the vocabulary (``policyd.core.types``,
``policyd.core.wire``): the vLLM connector loads it inside vLLM's processes. Every method is
thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final

import zmq

from policyd.core.types import (
    BATCH_CODEC,
    SNAPSHOT_CODEC,
    CodecError,
    Event,
    EventBatch,
    PolicySnapshot,
)
from policyd.core.wire import MAX_EVENTS_PER_BATCH, SNAPSHOT_TOPIC, Endpoints

log = logging.getLogger(__name__)

SEND_HWM_FRAMES: Final = 64  # frames ZeroMQ may buffer toward the daemon before NOBLOCK fails
FLUSH_INTERVAL_S: Final = 0.005  # longest an event waits for a batch to fill
LOG_INTERVAL_S: Final = 10.0  # a repeated send error is logged at most this often
POLL_MS: Final = 100


class DaemonClient:
    """Streams events to the daemon and receives its policy snapshots, never blocking the caller.

    ``source`` names this sender in every batch (the daemon counts sequence gaps per source);
    ``endpoints`` default to ``Endpoints.from_env()``; ``clock`` dates received snapshots.
    """

    def __init__(
        self,
        source: str,
        endpoints: Endpoints | None = None,
        *,
        queue_max_events: int = 65536,
        clock: Callable[[], float] = time.monotonic,
        compile_snapshot: Callable[[PolicySnapshot], object] | None = None,
    ) -> None:
        if queue_max_events < 1:
            raise ValueError(f"queue_max_events must be >= 1, got {queue_max_events}")
        self.source = source
        self.endpoints = endpoints or Endpoints.from_env()
        self.queue_max_events = queue_max_events
        self.clock = clock
        # run on the receiving thread, so that a large snapshot is indexed off the caller's path
        self.compile_snapshot = compile_snapshot
        self._retired_compiled: object | None = None
        # (snapshot, compiled, received), replaced whole by the subscriber thread: ``snapshot``
        # and ``compiled`` read it without the lock (one attribute read is atomic), so vLLM's
        # thread never waits for the sender thread, which holds the lock while it builds a batch
        self._newest: tuple[PolicySnapshot | None, object | None, float] = (None, None, 0.0)
        self._lock = threading.Lock()
        self._queue: deque[Event] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._counts = {
            "accepted_events": 0,
            "dropped_events": 0,
            "sent_events": 0,
            "sent_batches": 0,
            "send_errors": 0,
            "snapshots_received": 0,
            "malformed_snapshots": 0,
        }
        self._seq = 0
        self._pending_frame: tuple[bytes, int] | None = None  # (frame, events in it)
        self._in_flight = 0  # events taken off the queue, not yet sent, retried or dropped
        self._last_log_s: dict[str, float] = {}
        self._context = zmq.Context()
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"agentkv-push-{source}", daemon=True),
            threading.Thread(target=self._sub_loop, name=f"agentkv-sub-{source}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the caller's side: never blocks, never raises ------------------------------------------

    def send(self, event: Event) -> bool:
        """Queue one event; False (and counted) when the queue is full or the client closed."""
        with self._lock:
            if self._stop.is_set() or len(self._queue) >= self.queue_max_events:
                self._counts["dropped_events"] += 1
                return False
            self._queue.append(event)
            self._counts["accepted_events"] += 1
            full = len(self._queue) >= MAX_EVENTS_PER_BATCH
        if full:
            self._wake.set()
        return True

    def send_many(self, events: Iterable[Event]) -> int:
        """Queue events in order; returns how many were accepted (the rest are counted drops)."""
        items = list(events)
        with self._lock:
            room = 0 if self._stop.is_set() else self.queue_max_events - len(self._queue)
            accepted = items[: max(room, 0)]
            self._queue.extend(accepted)
            self._counts["accepted_events"] += len(accepted)
            self._counts["dropped_events"] += len(items) - len(accepted)
            full = len(self._queue) >= MAX_EVENTS_PER_BATCH
        if full:
            self._wake.set()
        return len(accepted)

    def snapshot(self, now: float | None = None) -> PolicySnapshot | None:
        """The newest snapshot while it is fresh (received less than its ``ttl_s`` ago)."""
        fresh = self._fresh(now)
        return None if fresh is None else fresh[0]

    def compiled(self, now: float | None = None) -> object | None:
        """What ``compile_snapshot`` made of the newest snapshot, while that is fresh."""
        fresh = self._fresh(now)
        return None if fresh is None else fresh[1]

    def _fresh(self, now: float | None) -> tuple[PolicySnapshot, object | None] | None:
        snap, compiled, received = self._newest
        if snap is None:
            return None
        now = self.clock() if now is None else now
        return (snap, compiled) if now - received <= snap.ttl_s else None

    def stats(self) -> dict[str, int]:
        """Counters: accepted / dropped / sent events, batches, send errors, snapshots."""
        with self._lock:
            out = dict(self._counts)
            out["queued_events"] = len(self._queue)
            out["seq"] = self._seq
        return out

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until the queue is empty (events handed to ZeroMQ); False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and not self._pending_frame and not self._in_flight:
                    return True
            self._wake.set()
            time.sleep(0.002)
        return False

    def close(self, flush_timeout_s: float = 1.0) -> None:
        """Try to send what is queued (for at most ``flush_timeout_s``), then stop the threads."""
        if self._stop.is_set():
            return
        self.flush(flush_timeout_s)
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._context.term()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the sender thread ---------------------------------------------------------------------

    def _send_loop(self) -> None:
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM_FRAMES)
        sock.setsockopt(zmq.LINGER, 200)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.connect(self.endpoints.events)
        try:
            while not self._stop.is_set():
                self._wake.wait(FLUSH_INTERVAL_S)
                self._wake.clear()
                while self._drain_once(sock):
                    pass
        finally:
            sock.close()

    def _drain_once(self, sock: zmq.Socket[bytes]) -> bool:
        """Send the pending frame or the next batch; True when more may be sent now."""
        with self._lock:
            pending = self._pending_frame
            if pending is None:
                if not self._queue:
                    return False
                n = min(len(self._queue), MAX_EVENTS_PER_BATCH)
                events = tuple(self._queue.popleft() for _ in range(n))
                self._seq += 1
                seq = self._seq
                self._in_flight = n
            else:
                events = ()
                seq = 0
        if pending is None:
            try:
                frame = BATCH_CODEC.encode(EventBatch(source=self.source, seq=seq, events=events))
            except Exception as exc:  # an event the codec cannot carry: drop it, never raise
                self._count_error("encode", exc, dropped=len(events))
                with self._lock:
                    self._in_flight = 0
                return True
            pending = (frame, len(events))
        try:
            sock.send(pending[0], zmq.NOBLOCK)
        except zmq.Again:  # no daemon connected, or its queue is full: retry later
            with self._lock:
                self._pending_frame = pending
                self._in_flight = 0
            self._count_error("send", "daemon not reachable or not draining (HWM)", dropped=0)
            return False
        except zmq.ZMQError as exc:
            with self._lock:
                self._pending_frame = None
                self._in_flight = 0
            self._count_error("send", exc, dropped=pending[1])
            return False
        with self._lock:
            self._pending_frame = None
            self._in_flight = 0
            self._counts["sent_batches"] += 1
            self._counts["sent_events"] += pending[1]
        return True

    def _count_error(self, what: str, detail: object, *, dropped: int) -> None:
        with self._lock:
            self._counts["send_errors"] += 1
            self._counts["dropped_events"] += dropped
            errors = self._counts["send_errors"]
        now = time.monotonic()
        if now - self._last_log_s.get(what, -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
            self._last_log_s[what] = now
            log.warning(
                "agentkv client %s: %s error (%s); %d errors so far, events keep queueing",
                self.source,
                what,
                detail,
                errors,
            )

    # -- the subscriber thread -----------------------------------------------------------------

    def _sub_loop(self) -> None:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, 16)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.SUBSCRIBE, SNAPSHOT_TOPIC)
        sock.connect(self.endpoints.snapshots)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(POLL_MS):
                    continue
                while True:  # drain what arrived; the last valid one is kept
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._take_snapshot(frames)
        finally:
            sock.close()

    def _take_snapshot(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 2 or frames[0] != SNAPSHOT_TOPIC:
                raise CodecError(f"expected [topic, snapshot], got {len(frames)} frames")
            snap = SNAPSHOT_CODEC.decode(frames[1])
        except CodecError as exc:
            with self._lock:
                self._counts["malformed_snapshots"] += 1
            now = time.monotonic()
            if now - self._last_log_s.get("snapshot", -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
                self._last_log_s["snapshot"] = now
                log.warning("agentkv client %s: ignored a malformed snapshot: %s", self.source, exc)
            return
        compiled: object | None = None
        if self.compile_snapshot is not None:
            try:
                compiled = self.compile_snapshot(snap)
            except Exception as exc:
                with self._lock:
                    self._counts["malformed_snapshots"] += 1
                log.warning("agentkv client %s: could not index a snapshot: %r", self.source, exc)
                return
        received = self.clock()
        with self._lock:
            # the replaced one is kept until the next arrives: the caller's thread, which
            # adopts the new one, then drops its last reference to the old one cheaply, and
            # freeing a large index happens here, off the caller's hot path
            self._retired_compiled = self._newest[1]
            self._newest = (snap, compiled, received)
            self._counts["snapshots_received"] += 1
