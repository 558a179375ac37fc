"""The simulator's side of its engine: what it asks of one (``SimEngine``) and how it sends it
events (``EventOutbox``)."""

from __future__ import annotations

from itertools import count
from typing import Protocol

from policyd.core.types import BATCH_CODEC, Event, EventBatch, PolicySnapshot


class EventCounts(Protocol):
    events: int


class EngineCounters(Protocol):
    @property
    def counters(self) -> EventCounts: ...


class SimEngine(Protocol):
    """What the simulator asks of its engine: ``policyd.core.engine.Engine`` in-process by default,
    or a stand-in given as ``engine=`` (the demo's, which forwards the events to a daemon)."""

    @property
    def state(self) -> EngineCounters: ...

    def apply(self, batch: EventBatch) -> object: ...

    def snapshot(self) -> PolicySnapshot: ...

    def prefetch(self, budget_blocks: int) -> list[int]: ...


class EventOutbox:
    """Events gathered in the order they happened, sent to the engine by ``flush`` as one
    ``EventBatch`` (source ``"sim"``, ``seq`` 1, 2, ...; no batch when none are pending),
    through the wire codec when ``codec_roundtrip``."""

    __slots__ = ("_seq", "codec_roundtrip", "engine", "events")

    def __init__(self, engine: SimEngine, *, codec_roundtrip: bool) -> None:
        self.engine = engine
        self.codec_roundtrip = codec_roundtrip
        self.events: list[Event] = []
        self._seq = count(1)

    def add(self, event: Event) -> None:
        self.events.append(event)

    def flush(self) -> None:
        if not self.events:
            return
        batch = EventBatch(source="sim", seq=next(self._seq), events=tuple(self.events))
        self.events.clear()
        if self.codec_roundtrip:
            batch = BATCH_CODEC.decode(BATCH_CODEC.encode(batch))
        self.engine.apply(batch)
