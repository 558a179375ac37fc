"""A daemon's link to its fleet on NATS JetStream: shared learning, exactly once.

One thread runs an asyncio loop with one NATS connection (nats-py, reconnecting forever). Every
``interval_s`` it seals this replica's learning (``FleetOutbox.seal``) and publishes the sealed
deltas in order on ``agentkv.learn.<replica>`` of the ``AGENTKV_LEARN`` stream, each with its
``Nats-Msg-Id`` (JetStream drops a republished one inside its duplicate window); a delta leaves
the outbox once JetStream acknowledged it. It reads every replica's deltas from its durable pull
consumer ``learn-<replica>``, in stream order, and merges each (``FleetLearning.merge``) that the
``OriginLedger`` admits: another replica's, never applied before. Merges happen under the
daemon's lock, in batches; the ledger (the stream sequence applied through) and the outbox are
saved with the model checkpoint (``state``), so after a restart the consumer restarts right
after the last message the restored models hold.

NATS away: the daemon keeps deciding with its local models (the link never holds the daemon's
lock while waiting on the network); learning accumulates in the predictor's journal (one count
per distinct transition) and is sealed at each checkpoint, published when NATS returns; the
durable consumer (replicated with the stream) resumes where it was.

``extra_publish`` lets other fleet parts publish on the same connection: each tick it returns
(subject, payload) pairs sent as plain NATS messages (at most once, e.g. residency updates);
one larger than the servers' ``max_payload`` (1 MiB by default) is counted and not sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from policyd.fleet.deltas import (
    SUBJECT_PREFIX,
    FleetLearning,
    FleetOutbox,
    FleetState,
    OriginLedger,
    decode,
    new_incarnation,
    subject_of,
)

log = logging.getLogger(__name__)

STREAM: Final = "AGENTKV_LEARN"
DUPLICATE_WINDOW_S: Final = 600.0
FETCH_BATCH: Final = 256


def parse_servers(url: str) -> list[str]:
    """``nats://a:4222,nats://b:4222`` (or ``a:4222,b:4222``) -> the server URLs."""
    servers = [s.strip() for s in url.split(",") if s.strip()]
    if not servers:
        raise ValueError("--fleet needs at least one NATS server URL (nats://host:port)")
    return [s if "://" in s else f"nats://{s}" for s in servers]


def valid_replica_name(name: str) -> str:
    """A replica name usable in a NATS subject token and a consumer name."""
    if not name or any(c in name for c in " .*>\t\r\n/\\") or len(name) > 64:
        raise ValueError(
            f"replica name {name!r}: 1-64 characters, none of space . * > / \\ (a NATS token)"
        )
    return name


class FleetLink:
    """Publishes this replica's learning and merges the fleet's (see the module docstring).

    ``lock`` is the daemon's lock, taken to seal and to merge. ``state`` is what a checkpoint
    restored (None: a fresh replica, which reads the stream from its first message).
    ``stream_replicas`` is the stream's replication factor (3 on a 3-node cluster)."""

    def __init__(
        self,
        servers: Sequence[str],
        replica: str,
        learning: FleetLearning,
        lock: AbstractContextManager[Any],
        *,
        state: FleetState | None = None,
        interval_s: float = 1.0,
        stream_replicas: int = 1,
        extra_publish: Callable[[], list[tuple[str, bytes]]] | None = None,
    ) -> None:
        self.servers = list(servers)
        self.replica = valid_replica_name(replica)
        self.learning = learning
        self.lock = lock
        self.interval_s = interval_s
        self.stream_replicas = stream_replicas
        self.extra_publish = extra_publish
        self.ledger = state.ledger if state else OriginLedger()
        incarnation = new_incarnation()
        sealed = list(state.outbox.sealed) if state else []
        self.outbox = FleetOutbox(self.replica, incarnation, sealed=sealed)
        self.published = 0
        self.publish_duplicates = 0  # JetStream said it had the id already
        self.extra_too_large = 0  # extra messages over the servers' max_payload: not sent
        self.connected = False
        self.connects = 0
        self.errors = 0
        self.last_error: str | None = None
        self.last_merge_s: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- what the daemon calls -------------------------------------------------------------

    def state(self) -> FleetState:
        """The link's state for the model checkpoint (called under the daemon's lock): what
        was learnt since the last seal is sealed first, so the checkpoint holds it by id."""
        self.outbox.seal(self.learning)
        return FleetState(self.ledger, self.outbox, self.learning.baseline)

    def stats(self) -> dict[str, Any]:
        ledger = self.ledger
        return {
            "replica": self.replica,
            "servers": self.servers,
            "connected": self.connected,
            "connects": self.connects,
            "incarnation": self.outbox.incarnation,
            "published": self.published,
            "publish_duplicates": self.publish_duplicates,
            "outbox": len(self.outbox.sealed),
            "applied_through": ledger.applied_through,
            "applied": ledger.applied,
            "duplicates": ledger.duplicates,
            "own": ledger.own,
            "gaps": ledger.gaps,
            "undecodable": ledger.undecodable,
            "origins": {f"{r}/{i}": n for (r, i), n in ledger.last_number.items()},
            "merged_transitions": self.learning.merged_transitions,
            "merged_histograms": self.learning.merged_histograms,
            "extra_too_large": self.extra_too_large,
            "errors": self.errors,
            "last_error": self.last_error,
        }

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="policyd-fleet", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after one last publish attempt (bounded by ``timeout_s``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    # ---- the loop --------------------------------------------------------------------------

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                await self._session()
                backoff = 0.2
            except Exception as exc:  # the network, NATS or JetStream: retried
                self._fail(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _fail(self, exc: BaseException) -> None:
        self.connected = False
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"[:300]
        log.warning("fleet link: %s", self.last_error)

    async def _session(self) -> None:
        nc = await nats.connect(
            servers=self.servers,
            name=f"policyd-{self.replica}",
            connect_timeout=2,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            ping_interval=5,
            max_outstanding_pings=2,
        )
        try:
            js = nc.jetstream(timeout=5.0)
            await self._ensure_stream(js)
            sub = await self._subscribe(js)
            self.connected, self.connects = True, self.connects + 1
            while not self._stop.is_set():
                started = time.monotonic()
                await self._publish(js, nc)
                await self._consume(sub)
                self.connected = nc.is_connected
                left = self.interval_s - (time.monotonic() - started)
                if left > 0:
                    await asyncio.sleep(min(left, 0.05) if self._stop.is_set() else left)
            await self._publish(js, nc)  # the last learning, if NATS takes it now
        finally:
            self.connected = False
            with contextlib.suppress(Exception):  # closing a broken connection: nothing kept
                await asyncio.wait_for(nc.close(), timeout=2.0)

    async def _ensure_stream(self, js: Any) -> None:
        config = StreamConfig(
            name=STREAM,
            subjects=[f"{SUBJECT_PREFIX}.>"],
            storage=StorageType.FILE,
            num_replicas=self.stream_replicas,
            duplicate_window=DUPLICATE_WINDOW_S,
        )
        try:
            await js.stream_info(STREAM)
        except nats.js.errors.NotFoundError:
            try:
                await js.add_stream(config)
            except nats.js.errors.BadRequestError:  # another replica created it meanwhile
                await js.stream_info(STREAM)

    async def _subscribe(self, js: Any) -> Any:
        """The durable consumer, positioned right after the last message this replica's models
        hold (recreated when its position on the server differs, e.g. after a restore)."""
        durable = f"learn-{self.replica}"
        start = self.ledger.applied_through + 1
        try:
            info = await js.consumer_info(STREAM, durable)
            if info.ack_floor.stream_seq != self.ledger.applied_through:
                await js.delete_consumer(STREAM, durable)
                raise nats.js.errors.NotFoundError
        except nats.js.errors.NotFoundError:
            await js.add_consumer(
                STREAM,
                ConsumerConfig(
                    durable_name=durable,
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=start,
                    ack_policy=AckPolicy.EXPLICIT,
                    ack_wait=30.0,
                    max_ack_pending=10_000,
                    filter_subject=f"{SUBJECT_PREFIX}.>",
                ),
            )
        return await js.pull_subscribe_bind(durable, stream=STREAM)

    async def _publish(self, js: Any, nc: Any) -> None:
        with self.lock:
            self.outbox.seal(self.learning)
            pending = list(self.outbox.sealed)
        for msg_id, payload in pending:
            ack = await js.publish(
                subject_of(self.replica), payload, headers={"Nats-Msg-Id": msg_id}
            )
            self.published += 1
            self.publish_duplicates += int(bool(ack.duplicate))
            with self.lock:
                self.outbox.acknowledged(msg_id)
        if self.extra_publish is not None:
            for subject, payload in self.extra_publish():
                if len(payload) > nc.max_payload:  # (a replica's full residency, say)
                    self.extra_too_large += 1
                    continue
                await nc.publish(subject, payload)

    async def _consume(self, sub: Any) -> None:
        """Merge what the consumer has (batches until it has none for a moment)."""
        while not self._stop.is_set():
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=0.2)
            except nats.errors.TimeoutError:
                return
            with self.lock:
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    if seq <= self.ledger.applied_through:
                        self.ledger.duplicates += 1
                        continue
                    try:
                        delta = decode(msg.data)
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        self.ledger.undecodable += 1
                    else:
                        if self.ledger.admit(delta, self.replica):
                            self.learning.merge(delta)
                    self.ledger.applied_through = seq
                self.last_merge_s = time.monotonic()
            for msg in msgs:
                await msg.ack()
