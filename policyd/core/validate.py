"""Events checked against their schema's ranges before they reach the Engine or the history.

The codec (policyd/core/types.py) checks types; this checks values. An event out of range is
dropped and counted by reason; the rest of its batch goes on. ``check_event`` is stateless (the
history process runs it too); ``Validator.clean`` adds what needs the Engine's state: a
prefix hit's block counts within its request's prompt blocks.

The ranges (``REASONS`` names what each refusal means):

* every timestamp is a finite number (no NaN, no infinity);
* block hashes are 64-bit unsigned integers; at most ``MAX_BLOCKS_PER_EVENT`` per event;
* a prefix hit's counts are non-negative, each at most ``MAX_BLOCKS_PER_EVENT``, and together at
  most the request's prompt blocks when the request is known;
* token counts are non-negative and at most ``MAX_TOKENS``;
* ids, agent names and workflow types are at most ``MAX_ID_CHARS`` characters; hints at most
  ``MAX_HINTS`` entries of finite numbers or strings of at most ``MAX_ID_CHARS``.

>>> from policyd.core.types import PrefixHit, WorkflowFinished
>>> check_event(PrefixHit(ts=0.0, request_id="r", gpu_blocks=-1, host_blocks=0,
...                       recomputed_blocks=0))
'negative_count'
>>> check_event(WorkflowFinished(ts=float("nan"), workflow_id="w"))
'non_finite_ts'
>>> check_event(WorkflowFinished(ts=1.0, workflow_id="w")) is None
True
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from policyd.core.types import (
    AllBlocksCleared,
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)

if TYPE_CHECKING:
    from policyd.core.state import EngineState

MAX_BLOCKS_PER_EVENT: Final = 1 << 20  # a 16M-token prompt in 16-token blocks
MAX_TOKENS: Final = 1 << 30
MAX_ID_CHARS: Final = 1024
MAX_HINTS: Final = 64
MAX_HASH: Final = (1 << 64) - 1

REASONS: Final[dict[str, str]] = {
    "non_finite_ts": "a timestamp that is NaN or infinite",
    "negative_count": "a negative block or token count",
    "count_too_large": "a block or token count past its bound",
    "hit_exceeds_prompt": "a prefix hit naming more blocks than its request's prompt",
    "bad_block_hash": "a block hash outside 64-bit unsigned",
    "too_many_blocks": f"more than {MAX_BLOCKS_PER_EVENT} block hashes in one event",
    "id_too_long": f"an id, agent or workflow type over {MAX_ID_CHARS} characters",
    "bad_hints": f"hints of more than {MAX_HINTS} entries, a non-finite number or a long string",
}


def _bad_hashes(hashes: tuple[int, ...]) -> str | None:
    if len(hashes) > MAX_BLOCKS_PER_EVENT:
        return "too_many_blocks"
    if hashes and (min(hashes) < 0 or max(hashes) > MAX_HASH):
        return "bad_block_hash"
    return None


def _bad_id(*values: str | None) -> bool:
    return any(v is not None and len(v) > MAX_ID_CHARS for v in values)


def _bad_hints(hints: Mapping[str, object]) -> bool:
    if len(hints) > MAX_HINTS:
        return True
    for key, value in hints.items():
        if len(key) > MAX_ID_CHARS:
            return True
        if isinstance(value, float) and not math.isfinite(value):
            return True
        if isinstance(value, str) and len(value) > MAX_ID_CHARS:
            return True
    return False


def check_event(event: Event) -> str | None:
    """The reason ``event`` is out of range (a key of ``REASONS``), or None when it is valid."""
    if not math.isfinite(event.ts):
        return "non_finite_ts"
    kind = type(event)
    if kind is BlocksStored or kind is BlocksRemoved or kind is BlocksLoaded:
        bad = _bad_hashes(event.block_hashes)  # type: ignore[union-attr]
        if bad is None and _bad_id(getattr(event, "request_id", None)):
            bad = "id_too_long"
        return bad
    if kind is RequestStarted:
        assert isinstance(event, RequestStarted)
        if _bad_id(event.request_id, event.workflow_id, event.agent, event.workflow_type):
            return "id_too_long"
        if event.session_id is not None and _bad_id(event.session_id):
            return "id_too_long"
        bad = _bad_hashes(event.block_hashes)
        if bad is not None:
            return bad
        if event.prompt_tokens < 0:
            return "negative_count"
        if event.prompt_tokens > MAX_TOKENS:
            return "count_too_large"
        if event.hints and _bad_hints(event.hints):
            return "bad_hints"
        return None
    if kind is PrefixHit:
        assert isinstance(event, PrefixHit)
        counts = (event.gpu_blocks, event.host_blocks, event.recomputed_blocks)
        if min(counts) < 0:
            return "negative_count"
        if max(counts) > MAX_BLOCKS_PER_EVENT:
            return "count_too_large"
        return "id_too_long" if _bad_id(event.request_id) else None
    if kind is RequestFinished:
        assert isinstance(event, RequestFinished)
        if event.output_tokens < 0:
            return "negative_count"
        if event.output_tokens > MAX_TOKENS:
            return "count_too_large"
        return "id_too_long" if _bad_id(event.request_id) else None
    if kind is WorkflowFinished:
        assert isinstance(event, WorkflowFinished)
        return "id_too_long" if _bad_id(event.workflow_id) else None
    assert kind is AllBlocksCleared
    return None


_BLOCK_EVENTS: Final = frozenset((BlocksStored, BlocksRemoved, BlocksLoaded))


def clean_batch(batch: EventBatch, rejected: Counter[str]) -> EventBatch:
    """The batch without its out-of-range events (stateless checks), each counted by reason in
    ``rejected``; the same object when all are valid.

    Block events, the bulk of the stream, pass ``check_event``'s tests inline (``ts - ts`` is
    0.0 for a finite time only); one that fails any of them goes through ``check_event`` for
    its reason."""
    kept: list[Event] | None = None
    for i, event in enumerate(batch.events):
        if type(event) in _BLOCK_EVENTS:
            hashes = event.block_hashes  # type: ignore[union-attr]
            ts = event.ts
            rid = getattr(event, "request_id", None)
            if (
                ts - ts == 0.0
                and len(hashes) <= MAX_BLOCKS_PER_EVENT
                and (not hashes or (min(hashes) >= 0 and max(hashes) <= MAX_HASH))
                and (rid is None or len(rid) <= MAX_ID_CHARS)
            ):
                if kept is not None:
                    kept.append(event)
                continue
        reason = check_event(event)
        if reason is None:
            if kept is not None:
                kept.append(event)
            continue
        rejected[reason] += 1
        if kept is None:
            kept = list(batch.events[:i])
    if kept is None:
        return batch
    return EventBatch(source=batch.source, seq=batch.seq, events=tuple(kept))


class Validator:
    """Counts refusals by reason (``rejected``; thread-safe). ``clean`` is ``clean_batch``;
    ``check_hits`` the checks that need the Engine's state (call under the lock that guards
    it, just before ``Engine.apply``)."""

    def __init__(self) -> None:
        self.rejected: Counter[str] = Counter()
        self._lock = threading.Lock()

    def clean(self, batch: EventBatch) -> EventBatch:
        found: Counter[str] = Counter()
        out = clean_batch(batch, found)
        if found:
            with self._lock:
                self.rejected.update(found)
        return out

    def check_hits(self, batch: EventBatch, state: EngineState) -> EventBatch:
        """The batch without prefix hits naming more blocks than their request's prompt (the
        request started earlier in the batch, or known to ``state``)."""
        events = batch.events
        if not any(type(e) is PrefixHit for e in events):
            return batch
        requests = state.requests
        bad: set[int] = set()
        started: dict[str, int] = {}  # requests started earlier in this batch
        for event in events:
            if type(event) is RequestStarted:
                started[event.request_id] = len(event.block_hashes)
            elif type(event) is PrefixHit:
                assert isinstance(event, PrefixHit)
                rid = event.request_id
                req = requests.get(rid)
                prompt = started.get(rid, len(req.block_hashes) if req is not None else None)
                total = event.gpu_blocks + event.host_blocks + event.recomputed_blocks
                if prompt is not None and total > prompt:
                    bad.add(id(event))
        if not bad:
            return batch
        with self._lock:
            self.rejected["hit_exceeds_prompt"] += len(bad)
        kept = tuple(e for e in events if id(e) not in bad)
        return EventBatch(source=batch.source, seq=batch.seq, events=kept)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.rejected.values())

    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self.rejected)
