"""Event ingest: a PULL socket drained into a bounded queue, with load shedding.

Senders are never blocked (they send without blocking, ``policyd.core.client``): the receiver
thread takes frames off the socket as fast as they arrive and queues them as received; the
engine worker decodes each when it takes it (a malformed frame - truncated, wrong protocol
version, wrong types - is counted and dropped then, one too large already by the receiver; the
daemon keeps serving). The receiver's work per frame is a socket read and an append, the same
however far behind the worker is, and while the queue is full (``max_frames`` of depth) it
reads nothing: the frames wait on the socket and at the senders, whose high-water marks hold or
drop the rest there, at no cost to the daemon. So an overload cannot take the interpreter lock
from the Engine (receive livelock; Mogul & Ramakrishnan, "Eliminating receive livelock in an
interrupt-driven kernel", 1997; docs/DAEMON.md, *Overload*): a flood from the socket keeps the
queue at the edge of the shedding band, where block stores are shed and request-level events
kept, instead of past the hard bound below, where the Engine would get closing events alone. A
queued backlog is bytes, not Python objects, and a frame is applied right after it is decoded.
Overload is handled as frames are taken, before the Engine, by the depth behind them (the
bounds below are reached by batches offered in-process, the vLLM subscriber's):

* above ``shed_above_frames`` queued batches, block stores (BlocksStored / BlocksLoaded events,
  whole) are kept with a probability that falls linearly to 0 at ``max_frames``; removals
  (BlocksRemoved) are not shed, so the Engine never believes an evicted block cached (short of
  the hard bound below);
* request-level events (RequestStarted, PrefixHit, RequestFinished, WorkflowFinished,
  AllBlocksCleared) are never shed, and every batch is queued (if only for its sequence
  number);
* past ``HARD_BOUND_FACTOR x max_frames`` of depth (request-level events alone outrun the
  Engine) a frame keeps only its closing events - RequestFinished, WorkflowFinished,
  AllBlocksCleared, which free the Engine's state - and the rest is dropped and counted: state
  that is never closed would otherwise stay until the idle timeout. Past
  ``LAST_RESORT_FACTOR x max_frames`` frames are dropped whole as they arrive, undecoded, so
  the queue stays bounded;
* the keep decision is a hash of the event's first block: the same frame is cut the same way
  every time; an event of 16 hashes is 16 block events, counted and shed together.

While shedding, the Engine's view of residency is a subset of the truth; the stats say how much
was shed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Final

import msgspec
import zmq

from policyd.core.ratelog import RateLimitedLog, quote
from policyd.core.types import (
    BLOCK_LEVEL,
    AllBlocksCleared,
    BlocksLoaded,
    BlocksStored,
    Codec,
    CodecError,
    Event,
    EventBatch,
    RequestFinished,
    WorkflowFinished,
)
from policyd.core.validate import Validator
from policyd.core.wire import MAX_EVENTS_PER_BATCH

log = logging.getLogger(__name__)

_MASK: Final = (1 << 64) - 1
HARD_BOUND_FACTOR: Final = 2  # past this many times max_frames, frames keep closing events only
LAST_RESORT_FACTOR: Final = 4  # past this many times max_frames, frames are dropped whole
CLOSING: Final = (RequestFinished, WorkflowFinished, AllBlocksCleared)
_GOLDEN: Final = 0x9E3779B97F4A7C15


def keep_rate(depth: int, shed_above: int, max_frames: int) -> float:
    """Share of block-level events kept at queue ``depth``: 1 up to ``shed_above``, then
    falling linearly to 0 at ``max_frames``.

    >>> keep_rate(10, 100, 200), keep_rate(150, 100, 200), keep_rate(250, 100, 200)
    (1.0, 0.5, 0.0)
    """
    if depth <= shed_above:
        return 1.0
    return max(0.0, 1.0 - (depth - shed_above) / max(1, max_frames - shed_above))


@dataclass(frozen=True, slots=True)
class Shed:
    """A batch after sampling, and what sampling took out of it."""

    batch: EventBatch
    events: int  # block-level events dropped whole (none of their hashes kept)
    block_events: int  # block hashes dropped (one block event per hash)


def shed(batch: EventBatch, rate: float) -> Shed:
    """The batch with block stores sampled at ``rate``: a ``BlocksStored`` or ``BlocksLoaded``
    event is kept whole when ``first hash * golden mod 2^64 < rate * 2^64`` (deterministic)
    and dropped whole otherwise; ``BlocksRemoved`` and request-level events always stay.

    Removing a block the Engine was not told of is a no-op, so whatever is shed the Engine's
    resident blocks stay a subset of what the tiers hold - no block is believed cached after
    it was evicted. A decision per event, not per hash, costs a multiplication per event and
    never rebuilds an event, so under overload shedding stays cheap beside the Engine's work it
    saves."""
    if rate >= 1.0:
        return Shed(batch, 0, 0)
    threshold = int(rate * 2.0**64)
    kept: list[Event] = []
    dropped_events = dropped_blocks = 0
    for event in batch.events:
        if type(event) in _SHEDDABLE:
            hashes = event.block_hashes  # type: ignore[union-attr]
            if hashes and ((hashes[0] * _GOLDEN) & _MASK) >= threshold:
                dropped_events += 1
                dropped_blocks += len(hashes)
                continue
        kept.append(event)
    if not dropped_events:
        return Shed(batch, 0, 0)
    return Shed(
        EventBatch(source=batch.source, seq=batch.seq, events=tuple(kept)),
        dropped_events,
        dropped_blocks,
    )


_SHEDDABLE: Final = frozenset((BlocksStored, BlocksLoaded))


def _block_level(batch: EventBatch) -> int:
    return sum([isinstance(e, BLOCK_LEVEL) for e in batch.events])


def block_events(batch: EventBatch) -> int:
    """Block events a batch stands for: one per hash named by a block-level event (a
    ``BlocksStored`` of a request's 16 new blocks is 16 block events).

    >>> from policyd.core.types import BlocksStored as S, WorkflowFinished as W
    >>> block_events(EventBatch("s", 1, (S(ts=0.0, tier="gpu", block_hashes=(1, 2, 3)),
    ...                                 W(ts=0.0, workflow_id="w"))))
    3
    """
    return sum([len(e.block_hashes) for e in batch.events if isinstance(e, BLOCK_LEVEL)])


def coalesce(batch: EventBatch) -> EventBatch:
    """Merge runs of consecutive block-level events of one kind, tier and request into one
    event (their hashes concatenated in order). The Engine's handlers are set operations, so a
    run of single-block events costs one call instead of one per block; the outcome is the
    same because nothing else happens between the events of a run.

    >>> from policyd.core.types import BlocksStored as S
    >>> b = EventBatch("s", 1, (S(ts=1.0, tier="gpu", block_hashes=(1,)),
    ...                         S(ts=2.0, tier="gpu", block_hashes=(2, 3))))
    >>> coalesce(b).events
    (BlocksStored(ts=2.0, tier='gpu', block_hashes=(1, 2, 3), request_id=None),)
    """
    events = batch.events
    if not _has_run(events):
        return batch
    out: list[Event] = []
    run: list[Event] = []
    key: tuple[object, ...] | None = None
    for event in events:
        k = _run_key(event) if type(event) in BLOCK_LEVEL else None
        if k is not None and k == key:
            run.append(event)
            continue
        _close_run(run, out)
        run = [event] if k is not None else []
        key = k
        if k is None:
            out.append(event)
    _close_run(run, out)
    if len(out) == len(events):
        return batch
    return EventBatch(source=batch.source, seq=batch.seq, events=tuple(out))


def _run_key(event: object) -> tuple[object, ...]:
    """What consecutive block-level events share to be one run (``coalesce``)."""
    return (type(event), getattr(event, "tier", None), getattr(event, "request_id", None))


def _has_run(events: tuple[Event, ...]) -> bool:
    """Whether two consecutive events would merge (``coalesce``'s common case is none: then
    it returns the batch, building a key only for neighbours of one kind)."""
    previous: Event | None = None
    previous_kind: type | None = None
    for event in events:
        kind = type(event)
        if kind is previous_kind and kind in BLOCK_LEVEL and _run_key(event) == _run_key(previous):
            return True
        previous, previous_kind = event, kind
    return False


def _close_run(run: list[Event], out: list[Event]) -> None:
    if len(run) == 1:
        out.append(run[0])
    elif run:
        hashes = tuple(chain.from_iterable([e.block_hashes for e in run]))  # type: ignore[union-attr]
        out.append(msgspec.structs.replace(run[-1], block_hashes=hashes))


@dataclass(slots=True)
class IngestCounters:
    frames: int = 0
    malformed_frames: int = 0
    events_received: int = 0
    events_shed: int = 0  # block-level events dropped whole (sampled, or past the hard bound)
    frames_dropped: int = 0  # frames cut past the hard bound (their request events too)
    events_dropped: int = 0  # request-level events in those frames that were not kept
    block_events_received: int = 0  # hashes named by block-level events received
    block_events_shed: int = 0  # of them, sampled away
    frames_dropped_undecoded: int = 0  # of frames_dropped, past the last resort: not decoded
    events_invalid: int = 0  # events out of their schema's ranges, dropped (policyd.core.validate)
    oversize_frames: int = 0  # of malformed_frames, over max_frame_bytes
    connections_closed: int = 0  # sender connections closed (by the sender, or by ZeroMQ for a
    # frame over its transport cap, 4 x max_frame_bytes: such a frame never reaches the queue)
    receiver_waits: int = 0  # times the receiver found the queue full and stopped reading
    receiver_wait_s: float = 0.0  # seconds it waited for room (frames left at the senders)
    last_malformed: str = ""


@dataclass(slots=True)
class Received:
    batch: EventBatch
    received_ts: float  # wall clock, for the history
    events: int  # events it stands for (after shedding, before coalescing)
    block_events: int  # block events it stands for (after shedding)
    weight: int = 1  # in the queue's bounds (see ``weight``)
    recorded: bool = False  # its frame went to the history as received (``Receiver.forward``)


@dataclass(slots=True)
class _Frame:
    """A frame queued as received (``IngestQueue.offer_frame``), decoded when taken."""

    frame: memoryview | bytes
    received_ts: float
    weight: int
    recorded: bool


INGEST_MAX_FRAME_BYTES: Final = 8 * 1024 * 1024  # the daemon's default limit (types: 64 MiB)
FRAME_BYTES_PER_WEIGHT: Final = 3 * 1024  # a frame of 256 events of 16 hashes is ~55 KB


def frame_weight(nbytes: int) -> int:
    """A frame's weight before it is decoded, from its size: ~3 KB of msgpack per 256 block
    events (a hash is 9 bytes), so that it weighs about what ``weight`` gives it decoded.

    >>> frame_weight(55_000), frame_weight(100)
    (18, 1)
    """
    return max(1, -(-nbytes // FRAME_BYTES_PER_WEIGHT))


def weight(events: int, blocks: int) -> int:
    """A batch's weight in the queue, in frames of ``MAX_EVENTS_PER_BATCH`` events: a frame of
    256 events of 16 hashes (4,096 block events) weighs 16, so the queue's bounds hold the
    same memory and backlog whatever the senders' packaging.

    >>> weight(256, 256), weight(256, 4096), weight(3, 0)
    (1, 16, 1)
    """
    return max(1, -(-max(events, blocks) // MAX_EVENTS_PER_BATCH))


class IngestQueue:
    """A bounded hand-off between the receiver and the engine worker (thread-safe). Its depth
    is the queued batches' total ``weight`` (frames of up to 256 events or block events)."""

    def __init__(
        self, max_frames: int, shed_above: int, *, max_frame_bytes: int = INGEST_MAX_FRAME_BYTES
    ) -> None:
        self.max_frames = max_frames
        self.shed_above = shed_above
        self.codec = Codec(EventBatch, max_frame_bytes=max_frame_bytes)
        self._items: deque[Received | _Frame] = deque()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # items queued (the taker waits on it)
        self._room = threading.Condition(lock)  # depth taken off (``wait_for_room`` waits on it)
        self._waiting = False  # the last wait for room timed out (the queue is still full)
        self.depth = 0  # sum of the queued items' weights
        self.counters = IngestCounters()
        # counters change on the receiver's thread, the engine worker's (frames it decodes)
        # and the vLLM subscriber's (batches it offers): one at a time
        self._counting = threading.Lock()
        self.validator = Validator()
        self.ratelog = RateLimitedLog(log)

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, batch: EventBatch, received_ts: float, *, recorded: bool = False) -> None:
        """Queue a decoded batch, shedding block-level events under load (never blocks; see
        ``admit``). ``recorded``: the history has the batch already."""
        item = self.admit(batch, received_ts, recorded=recorded)
        if item is not None:
            self._append(item)

    def offer_frame(
        self, frame: memoryview | bytes, received_ts: float, *, recorded: bool = False
    ) -> bool:
        """Queue a frame as received, to be decoded by the worker when it takes it
        (``take``): the receiver's work per frame stays the same however far behind the
        worker is, so that an overload cannot starve the worker of the interpreter lock
        (receive livelock), and a backlog is compact bytes, not Python objects. Past
        ``LAST_RESORT_FACTOR x max_frames`` of depth the frame is dropped undecoded (counted
        in ``frames_dropped`` and ``frames_dropped_undecoded``; its events are not known).
        False for a frame over the codec's size limit: refused and counted as malformed now,
        not queued."""
        c = self.counters
        try:
            self.codec.check_size(frame)
        except CodecError as exc:
            with self._counting:
                c.frames += 1
            self.malformed(exc, oversize=True)
            return False
        with self._counting:
            c.frames += 1
            if self.depth >= LAST_RESORT_FACTOR * self.max_frames:
                c.frames_dropped += 1
                c.frames_dropped_undecoded += 1
                return True
        self._append(_Frame(frame, received_ts, frame_weight(len(frame)), recorded))
        return True

    def _decode(self, item: _Frame) -> Received | None:
        """A taken frame decoded and admitted (``admit``, at the depth now: the backlog behind
        it), or None for a malformed frame (counted and logged) or one dropped whole."""
        try:
            batch = self.codec.decode(item.frame)
        except CodecError as exc:
            self.malformed(exc)
            return None
        return self.admit(batch, item.received_ts, recorded=item.recorded)

    def malformed(self, exc: Exception, *, oversize: bool = False) -> None:
        """Count a rejected frame, and log it (rate-limited: ``RateLimitedLog``)."""
        c = self.counters
        text = str(exc)[:200]
        with self._counting:
            c.malformed_frames += 1
            c.oversize_frames += oversize
            c.last_malformed = text
        self.ratelog.warning(
            "malformed-frame",
            "rejected a malformed event frame (%d so far): %s",
            c.malformed_frames,
            text,
        )

    def admit(
        self, batch: EventBatch, received_ts: float, *, recorded: bool = False
    ) -> Received | None:
        """A decoded batch counted, sampled for the depth now, and coalesced; None when it is
        dropped whole. Above ``shed_above`` block stores are sampled (``keep_rate``). Past
        ``HARD_BOUND_FACTOR x max_frames`` of depth - block events are all shed long before,
        so request-level events alone outrun the Engine - the frame keeps only its closing
        events (whole past ``LAST_RESORT_FACTOR x``); what goes is counted, and a frame
        dropped whole leaves a sequence gap the Engine counts. What is kept is then checked
        against the schema's ranges (``Validator``: an event out of range is dropped and
        counted in ``events_invalid``); what overload cut is counted as shed or dropped
        without that check, so an overload costs no check of the events it saves the Engine.
        Every event received is counted once: applied, invalid, shed or dropped."""
        with self._counting:
            return self._admit(batch, received_ts, recorded)

    def _admit(self, batch: EventBatch, received_ts: float, recorded: bool) -> Received | None:
        c = self.counters
        c.events_received += len(batch.events)
        if self.depth >= HARD_BOUND_FACTOR * self.max_frames:
            c.frames_dropped += 1
            block_level = _block_level(batch)
            c.events_shed += block_level
            cut_blocks = block_events(batch)
            c.block_events_received += cut_blocks
            c.block_events_shed += cut_blocks
            closing: tuple[Event, ...] = ()
            if self.depth < LAST_RESORT_FACTOR * self.max_frames:
                closing = tuple(e for e in batch.events if isinstance(e, CLOSING))
            c.events_dropped += len(batch.events) - block_level - len(closing)
            if not closing:
                return None
            batch = EventBatch(source=batch.source, seq=batch.seq, events=closing)
        else:
            rate = keep_rate(self.depth, self.shed_above, self.max_frames)
            if rate < 1.0:
                cut = shed(batch, rate)
                batch = cut.batch
                c.events_shed += cut.events
                c.block_events_received += cut.block_events
                c.block_events_shed += cut.block_events
        # what is kept is checked (what overload cut is counted as shed or dropped, unchecked)
        batch = self._valid(batch)
        blocks = block_events(batch)
        c.block_events_received += blocks
        n = len(batch.events)
        batch = coalesce(batch)
        # a batch shed to nothing is still kept: the Engine must see its seq (no false gap)
        return Received(batch, received_ts, n, blocks, weight(n, blocks), recorded)

    def _valid(self, batch: EventBatch) -> EventBatch:
        """``batch`` without its out-of-range events, counted by reason and logged."""
        n = len(batch.events)
        batch = self.validator.clean(batch)
        if len(batch.events) != n:
            c = self.counters
            c.events_invalid += n - len(batch.events)
            self.ratelog.warning(
                "invalid-event",
                "dropped %d out-of-range event(s) from source %s (%d so far; by reason: %s)",
                n - len(batch.events),
                quote(batch.source, 80),
                c.events_invalid,
                self.validator.by_reason(),
            )
        return batch

    def _append(self, item: Received | _Frame) -> None:
        with self._cond:
            self._items.append(item)
            self.depth += item.weight
            self._cond.notify()

    @property
    def full(self) -> bool:
        """The depth has reached ``max_frames``: a frame queued now would lose every block
        store (or more, past the hard bound) when it is taken."""
        return self.depth >= self.max_frames

    def wait_for_room(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the depth to fall below ``max_frames``; whether it
        has. The waits are counted (``receiver_waits``: one per stretch of full queue, and
        ``receiver_wait_s``)."""
        if not self.full:
            self._waiting = False
            return True
        started = time.monotonic()
        with self._room:
            room = self._room.wait_for(lambda: not self.full, timeout_s)
        c = self.counters
        with self._counting:
            c.receiver_waits += not self._waiting
            c.receiver_wait_s += time.monotonic() - started
        self._waiting = not room
        return room

    def take(self, max_weight: int, timeout_s: float) -> list[Received]:
        """Queued batches up to a total weight of ``max_weight`` (at least one), waiting at
        most ``timeout_s`` for the first. What the worker holds is not queued: a small budget
        keeps the depth, and so shedding, honest about the backlog. Frames queued as received
        are decoded here, on the taker's thread and outside the lock (a malformed one is
        counted and left out)."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout_s)
            items = self._items
            popped: list[Received | _Frame] = []
            taken = 0
            while items and (not popped or taken + items[0].weight <= max_weight):
                item = items.popleft()
                taken += item.weight
                popped.append(item)
            self.depth -= taken
            self._room.notify_all()
        out: list[Received] = []
        for item in popped:
            ready = self._decode(item) if isinstance(item, _Frame) else item
            if ready is not None:
                out.append(ready)
        return out


class Receiver:
    """Owns the PULL socket and queues what arrives, on its own thread.

    It only takes frames off the socket and queues them (``IngestQueue.offer_frame``): the
    engine worker decodes them. While the queue is full it reads nothing until the worker makes
    room (``IngestQueue.wait_for_room``). ``forward``, when given, is handed every frame within
    the size limit as received, with its arrival time (the history in a process of its own:
    ``HistoryProcess.record_frame``, which decodes and validates it there)."""

    def __init__(
        self,
        endpoint: str,
        queue: IngestQueue,
        *,
        wall_clock: Callable[[], float] = time.time,
        forward: Callable[[zmq.Frame, float], object] | None = None,
    ) -> None:
        self.queue = queue
        self.forward = forward
        self.wall_clock = wall_clock
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 1024)
        # far beyond the codec's limit ZeroMQ drops the message (and the peer's connection) at
        # the transport, before buffering it; in between, the queue's codec rejects and counts it
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * queue.codec.max_frame_bytes)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="policyd-ingest", daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def close(self) -> None:
        """Release the socket of a receiver that was never started."""
        if not self._thread.is_alive():
            self._sock.close()

    def _run(self) -> None:
        sock, queue, forward = self._sock, self.queue, self.forward
        recorded = forward is not None
        # ZeroMQ drops a message over MAXMSGSIZE at the transport and closes the sender's
        # connection, telling the socket nothing but DISCONNECTED on its monitor: those are
        # counted (``connections_closed``; a sender closing its socket is one too)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if monitor in ready:
                    self._drain_monitor(monitor)
                if sock not in ready:
                    continue
                if not queue.wait_for_room(0.1):  # (at once while not full)
                    continue  # left on the socket: the senders' high-water marks drop the rest
                now = self.wall_clock()
                for _ in range(1024):  # drain what is there, then look at the stop flag
                    if queue.full:
                        break
                    try:
                        frame = sock.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    # a frame over the size limit is refused (and not forwarded)
                    if queue.offer_frame(frame.buffer, now, recorded=recorded) and forward:
                        forward(frame, now)
        finally:
            sock.disable_monitor()
            monitor.close(0)
            self._sock.close()

    def _drain_monitor(self, monitor: zmq.Socket[bytes]) -> None:
        while True:
            try:
                event = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = int.from_bytes(event[0][:2], "little") if event and len(event[0]) >= 2 else 0
            if kind == zmq.EVENT_DISCONNECTED:
                with self.queue._counting:
                    self.queue.counters.connections_closed += 1
