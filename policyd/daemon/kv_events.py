"""vLLM's native KV event stream, translated into our events (vLLM 0.32).

vLLM's ZMQ publisher (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": ..., "replay_endpoint": ..., "topic": ...}'``) sends three-frame messages
``[topic, seq (8 bytes, big-endian), payload]``; the payload is msgpack ``[ts, [events],
dp_rank]``. An event is a BlockStored / BlockRemoved / AllBlocksCleared record with a ``medium``
("GPU" or "CPU"). Two encodings of a record are accepted: a map tagged by ``"type"`` (the
documented form) and vLLM's own msgspec ``array_like`` form ``["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, ...]`` / ``["BlockRemoved",
block_hashes, medium, ...]`` / ``["AllBlocksCleared", ...]`` (vLLM's
``examples/online_serving/kv_events_subscriber.py`` declares them ``array_like=True, tag=True``).

When the sequence number jumps, a DEALER on the replay endpoint asks for the missed batches: it
sends ``[b"", start_seq]`` and receives ``[b"", seq, payload]`` frames until an empty payload.

Mapping to our vocabulary:

* block hash: vLLM's ``ExternalBlockHash`` is a 32-byte sha256 digest (or an int with the
  builtin hash): we keep the **first 8 bytes, big-endian, as an unsigned 64-bit int** (an int is
  reduced modulo 2^64) - the same key our connector derives from the same digest
  (policyd/core/types.py), so both streams name a block alike;
* ``medium``: ``"GPU"`` (or absent) -> tier ``gpu``; ``"CPU"`` -> tier ``host``; anything else is
  counted as ``unknown_medium`` and skipped;
* BlockStored -> ``BlocksStored``, BlockRemoved -> ``BlocksRemoved``, AllBlocksCleared ->
  ``AllBlocksCleared`` (tier from its medium, GPU when absent).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import msgspec
import zmq

from policyd.core.ratelog import RateLimitedLog, quote
from policyd.core.types import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    Tier,
)

log = logging.getLogger(__name__)

U64_MASK: Final = (1 << 64) - 1
MEDIUM_TIERS: Final[dict[str | None, Tier]] = {None: "gpu", "GPU": "gpu", "CPU": "host"}
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
MAX_PAYLOAD_BYTES: Final = 16 * 1024 * 1024

_decoder = msgspec.msgpack.Decoder()


class KvEventError(ValueError):
    """A vLLM KV event message we cannot read."""


def block_key(block_hash: object) -> int:
    """Our 64-bit key of a vLLM block hash: the first 8 bytes of the digest, big-endian."""
    if isinstance(block_hash, bytes | bytearray):
        if len(block_hash) < 8:
            raise KvEventError(f"block hash of {len(block_hash)} bytes, expected >= 8")
        return int.from_bytes(block_hash[:8], "big")
    if isinstance(block_hash, int) and not isinstance(block_hash, bool):
        return block_hash & U64_MASK
    raise KvEventError(f"block hash must be bytes or int, got {type(block_hash).__name__}")


@dataclass(slots=True)
class _Record:
    kind: str
    block_hashes: Sequence[object]
    medium: object


def _record(raw: object) -> _Record:
    if isinstance(raw, Mapping):
        kind = raw.get("type")
        return _Record(str(kind), raw.get("block_hashes") or (), raw.get("medium"))
    if isinstance(raw, list | tuple) and raw and isinstance(raw[0], str):
        kind = raw[0]
        if kind == "BlockStored":
            return _Record(kind, raw[1] if len(raw) > 1 else (), raw[6] if len(raw) > 6 else None)
        if kind == "BlockRemoved":
            return _Record(kind, raw[1] if len(raw) > 1 else (), raw[2] if len(raw) > 2 else None)
        if kind == "AllBlocksCleared":
            return _Record(kind, (), raw[1] if len(raw) > 1 else None)
        return _Record(kind, (), None)
    raise KvEventError(f"an event must be a map or a tagged array, got {type(raw).__name__}")


@dataclass(slots=True)
class Translation:
    events: list[Event]
    skipped: int  # records of an unknown type or medium


def translate_payload(payload: bytes, now: float) -> Translation:
    """One vLLM payload ``[ts, [events], dp_rank]`` -> our events, stamped ``now`` (the daemon's
    monotonic clock; vLLM's ``ts`` is wall time). Raises ``KvEventError`` on a malformed one."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KvEventError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        body = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise KvEventError(f"not msgpack: {exc}") from exc
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise KvEventError("expected [ts, [events], dp_rank]")
    out: list[Event] = []
    skipped = 0
    for raw in body[1]:
        rec = _record(raw)
        if not isinstance(rec.medium, str | None):
            raise KvEventError(f"medium must be a string, got {rec.medium!r}")
        tier = MEDIUM_TIERS.get(rec.medium)
        if tier is None or rec.kind not in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            skipped += 1
            continue
        if not isinstance(rec.block_hashes, list | tuple):
            raise KvEventError("block_hashes must be a list")
        hashes = tuple(block_key(h) for h in rec.block_hashes)
        if rec.kind == "BlockStored":
            out.append(BlocksStored(ts=now, tier=tier, block_hashes=hashes))
        elif rec.kind == "BlockRemoved":
            out.append(BlocksRemoved(ts=now, tier=tier, block_hashes=hashes))
        else:
            out.append(AllBlocksCleared(ts=now, tier=tier))
    return Translation(out, skipped)


class KvEventSubscriber:
    """Subscribes to vLLM's KV events and hands translated ``EventBatch``es to ``sink``.

    Runs on its own thread (``start``/``stop``); owns its SUB and DEALER sockets. ``counters``
    are read by the service's stats (batches, events, seq_gaps, replayed_batches, malformed,
    translated_events, skipped).
    """

    def __init__(
        self,
        endpoint: str,
        sink: Callable[[EventBatch], None],
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        clock: Callable[[], float],
        source: str = "vllm-kv-events",
        replay_timeout_ms: int = 500,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.sink = sink
        self.clock = clock
        self.source = source
        self.replay_timeout_ms = replay_timeout_ms
        self.counters = dict.fromkeys(
            (
                "batches",
                "events",
                "seq_gaps",
                "replayed_batches",
                "malformed",
                "translated_events",
                "skipped",
            ),
            0,
        )
        self._last_seq: int | None = None
        self._out_seq = 0
        self._ratelog = RateLimitedLog(log)  # bad batches: a line per 10 s, with a count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self.running = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        replay: zmq.Socket[bytes] | None = None
        if self.replay_endpoint:
            replay = ctx.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(self.replay_endpoint)
        self.running = True
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                try:
                    frames = sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self.handle(frames, replay)
        finally:
            self.running = False
            sub.close()
            if replay is not None:
                replay.close()

    def handle(self, frames: list[bytes], replay: zmq.Socket[bytes] | None) -> None:
        """One published message: recover a gap through ``replay``, then deliver it."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters["malformed"] += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self._last_seq
        if last is not None and seq > last + 1:
            self.counters["seq_gaps"] += 1
            if replay is not None:
                self._replay(replay, last + 1)
        if self._last_seq is not None and seq <= self._last_seq:
            return  # already delivered by a replay
        self._deliver(seq, frames[2])

    def _deliver(self, seq: int, payload: bytes) -> None:
        try:
            tr = translate_payload(payload, self.clock())
        except KvEventError as exc:
            self.counters["malformed"] += 1
            self._ratelog.warning(
                "kv-event", "vLLM KV event batch %d rejected (%d so far): %s",
                seq, self.counters["malformed"], quote(str(exc)),
            )  # fmt: skip
            self._last_seq = seq
            return
        self._last_seq = seq
        self.counters["batches"] += 1
        self.counters["skipped"] += tr.skipped
        self.counters["events"] += len(tr.events) + tr.skipped
        if tr.events:
            self.counters["translated_events"] += len(tr.events)
            self._out_seq += 1
            self.sink(EventBatch(source=self.source, seq=self._out_seq, events=tuple(tr.events)))

    def _replay(self, replay: zmq.Socket[bytes], start: int) -> None:
        """Ask for the batches from ``start`` on and deliver those that come back in time (vLLM
        answers everything it still buffers from ``start``, then an empty payload)."""
        while replay.poll(0):  # answers to an earlier request that timed out
            replay.recv_multipart()
        replay.send_multipart([b"", start.to_bytes(8, "big")])
        while replay.poll(self.replay_timeout_ms):
            frames = replay.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) != 2 or not frames[1] or frames[0] == END_SEQ:
                break
            seq = int.from_bytes(frames[0], "big", signed=True)
            if self._last_seq is None or seq > self._last_seq:
                self._deliver(seq, frames[1])
                self.counters["replayed_batches"] += 1
