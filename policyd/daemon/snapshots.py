"""The daemon's snapshot publisher: builds the policy's snapshot (plus the shell's staging) and
PUBs it every ``snapshot_interval_s``, or at once when woken."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import msgspec
import zmq

from policyd.core.engine import Engine
from policyd.core.types import SNAPSHOT_CODEC, PolicySnapshot
from policyd.core.wire import SNAPSHOT_TOPIC
from policyd.daemon.decisions import DecisionLog
from policyd.daemon.ingest import IngestQueue
from policyd.daemon.policy_holder import PolicyHolder

log = logging.getLogger(__name__)


def bind_snapshot_socket(endpoint: str) -> zmq.Socket[bytes]:
    """A PUB socket bound to ``endpoint`` (send buffer of 16 snapshots, no linger on close);
    one that cannot be bound is a ``ValueError`` naming it (the socket closed)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 16)
    try:
        pub.bind(endpoint)
    except zmq.ZMQError as exc:
        pub.close()
        raise ValueError(f"cannot bind the snapshot endpoint {endpoint}: {exc}") from None
    return pub


class SnapshotPublisher:
    """Builds snapshots (``build_snapshot``, under the service's lock, from any thread) and
    publishes them (``run``: the ``policyd-publisher`` thread's loop, which owns the PUB socket
    and closes it when it returns).

    ``snapshot`` is the last one built, ``snapshot_published_s`` (``clock`` time) and
    ``snapshots_published`` count what went out; a snapshot whose pinned or staged blocks
    changed logs ``pin`` / ``prefetch`` decisions. ``wake`` (any thread) makes the loop publish
    now; ``publish_snapshot_now`` (an HTTP thread) waits for quiet ingestion, wakes the loop and
    waits for the snapshot to go out."""

    def __init__(
        self,
        lock: AbstractContextManager[Any],
        engine: Engine,
        holder: PolicyHolder,
        decisions: DecisionLog,
        queue: IngestQueue,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.lock = lock
        self.engine = engine
        self.holder = holder
        self.decisions = decisions
        self.queue = queue
        self.clock = clock
        self.snapshot: PolicySnapshot | None = None
        self.snapshot_published_s: float | None = None
        self.snapshots_published = 0
        self._pin_stage: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._publish_now = threading.Event()

    def wake(self) -> None:
        """Publish now (and, once ``run``'s ``stop`` is set, for the last time)."""
        self._publish_now.set()

    def build_snapshot(self) -> PolicySnapshot:
        """The policy's snapshot plus the shell's write filter and staging (under the lock)."""
        with self.lock:
            snap = self.engine.snapshot()
            changes: dict[str, object] = {}
            budget = self.holder.int_setting("prefetch_budget_blocks")
            if budget > 0 and not snap.stage:
                changes["stage"] = tuple(self.engine.prefetch(budget))
            if changes:
                snap = msgspec.structs.replace(snap, **changes)
            self.snapshot = snap
        pin_stage = (snap.pin, snap.stage)
        if pin_stage != self._pin_stage:
            self._pin_stage = pin_stage
            if snap.pin:
                self.decisions.record(
                    "pin",
                    tier="gpu",
                    n_blocks=len(snap.pin),
                    reason=f"snapshot {snap.version}: pinned on the GPU",
                )
            if snap.stage:
                self.decisions.record(
                    "prefetch",
                    tier="host",
                    n_blocks=len(snap.stage),
                    reason=f"snapshot {snap.version}: staged for predicted agents",
                )
        return snap

    def run(self, sock: zmq.Socket[bytes], stop: threading.Event) -> None:
        """Publish on ``sock`` until ``stop`` is set (a final snapshot goes out then)."""
        try:
            while True:
                try:
                    snap = self.build_snapshot()
                    sock.send_multipart([SNAPSHOT_TOPIC, SNAPSHOT_CODEC.encode(snap)], zmq.NOBLOCK)
                    self.snapshot_published_s = self.clock()
                    self.snapshots_published += 1
                except zmq.Again:
                    pass
                except Exception:
                    log.exception("building or publishing a snapshot failed")
                if stop.is_set():
                    return  # the final snapshot went out above
                interval = self.holder.float_setting("snapshot_interval_s")
                self._publish_now.wait(interval)
                self._publish_now.clear()
        finally:
            sock.close()

    def publish_snapshot_now(self, quiet_s: float = 0.2, timeout_s: float = 30.0) -> dict[str, Any]:
        """Publish a snapshot once ingestion is quiet: no running request, nothing queued, and
        no event applied for ``quiet_s``. For runs that step the daemon between batches of
        requests (the simulator-vs-engine differential); a live service publishes on its timer.
        Raises ``TimeoutError`` if ingestion never goes quiet."""
        deadline = time.monotonic() + timeout_s
        last_events, quiet_since = -1, time.monotonic()
        while True:
            with self.lock:
                events = self.engine.state.counters.events
                running = len(self.engine.state.requests)
            now = time.monotonic()
            if events != last_events or running or len(self.queue):
                last_events, quiet_since = events, now
            elif now - quiet_since >= quiet_s:
                break
            if now > deadline:
                raise TimeoutError(f"ingestion not quiet after {timeout_s:.0f} s")
            time.sleep(0.02)
        before = self.snapshots_published
        self._publish_now.set()
        while self.snapshots_published <= before:
            if time.monotonic() > deadline:
                raise TimeoutError("no snapshot published")
            time.sleep(0.01)
        snap = self.snapshot
        return {"version": snap.version if snap else None, "events": events}
