"""The connector's scheduler-side state, without vLLM: requests, ownership, snapshot, events.

The vLLM adapter (connector/vllm_adapter.py) forwards what it sees here and asks it questions;
everything here is plain Python over injected parts (an event sink with ``send_many``, a snapshot
source, a clock), so the same code runs in unit tests with a real ``DaemonClient`` on loopback.

Nothing here may fail a request: ``Guard`` wraps every call the adapter makes from inside vLLM,
counts what it caught and logs it at most once per interval.
"""

from __future__ import annotations

import gc
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, Protocol, TypeVar

from connector import events as ev
from connector.deferred import Job, immediate
from connector.params import RequestTags, parse_request_tags
from policyd.core.types import Event, PolicySnapshot
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import Ownership, Retirement, SnapshotView, write_allowed

log = logging.getLogger("agentkv.connector")

LOG_INTERVAL_S: Final = 30.0
MAX_OPEN_REQUESTS: Final = 65536  # requests vLLM never finished are forgotten past this
MAX_QUEUED_HOOKS: Final = 1024  # hooks ``Guard.later`` holds before it runs them unasked
T = TypeVar("T")


class EventSink(Protocol):
    def send_many(self, events: Sequence[Event]) -> int: ...


class GcClock:
    """Wall time spent in Python's cyclic collector, process-wide (``gc.callbacks``). The
    collector runs on whichever thread allocates past its threshold, so a pause can land inside
    a hook; ``Guard`` reports that part apart from the hook's own time."""

    def __init__(self) -> None:
        self.total_ns = 0
        self._started_ns = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_ns = time.perf_counter_ns()
        elif self._started_ns:
            self.total_ns += time.perf_counter_ns() - self._started_ns
            self._started_ns = 0


GC_CLOCK: Final = GcClock()
GC_HOOK: Final = "(collector pauses inside hooks)"


class Guard:
    """Runs a hook; an exception becomes ``default``, a count and a rate-limited log line.
    Its time is counted per hook, less any collector pause inside it (counted as ``GC_HOOK``).

    A hook that only records a fact and returns nothing to vLLM can be queued with ``later``
    instead: it runs first in the next ``call`` (or ``drain``), in the order queued, each
    guarded on its own. Its time is counted in that call's: a timed call reads the thread's CPU
    clock twice, which costs more than such a hook's own work, so a step that admits several
    requests pays for one timed call per lookup, not three per request; what is not timed is
    one list append (docs/RESULTS.md, *The connector's time per scheduler step*)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.errors: dict[str, int] = {}
        self.spent_ns = 0  # wall time inside guarded calls: what AgentKV adds to vLLM's hooks
        self.cpu_ns = 0  # the same, in the calling thread's CPU time (no GIL waits, no preemption)
        self._last_log_s: dict[str, float] = {}
        self.cpu_ns_by_hook: dict[str, int] = {}  # where that CPU time went
        self.calls_by_hook: dict[str, int] = {}
        self.call_started_ns = 0  # perf_counter_ns when the running call began (0: none)
        self.queued_by_hook: dict[str, int] = {}  # hooks run through ``later``
        self._later: list[tuple[str, Callable[[], object]]] = []

    def later(self, what: str, fn: Callable[[], object]) -> None:
        """Queue ``fn`` (hook ``what``) to run first in the next ``call`` or ``drain``; at
        ``MAX_QUEUED_HOOKS`` queued (no timed call for that long) they run now."""
        self._later.append((what, fn))
        if len(self._later) >= MAX_QUEUED_HOOKS:
            self.drain()

    def drain(self) -> None:
        """Run the queued hooks now, in one timed call (nothing if none is queued)."""
        if self._later:
            self.call("queued", _nothing, None)

    def _run_later(self) -> None:
        queued, self._later = self._later, []
        counts = self.queued_by_hook
        for what, fn in queued:
            counts[what] = counts.get(what, 0) + 1
            try:
                fn()
            except Exception as exc:  # one queued hook's failure loses only that hook
                self._failed(what, exc)

    def call(self, what: str, fn: Callable[[], T], default: T) -> T:
        g0 = GC_CLOCK.total_ns
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        self.call_started_ns = t0
        try:
            if self._later:
                self._run_later()
            return fn()
        except Exception as exc:  # never into vLLM: degrade, count, log once per interval
            self._failed(what, exc)
            return default
        finally:
            self.call_started_ns = 0
            self.spent_ns += time.perf_counter_ns() - t0
            cpu = time.thread_time_ns() - c0
            self.cpu_ns += cpu
            paused = GC_CLOCK.total_ns - g0  # (another thread's collection may land here too)
            if paused:
                paused = min(paused, cpu)
                self.cpu_ns_by_hook[GC_HOOK] = self.cpu_ns_by_hook.get(GC_HOOK, 0) + paused
                self.calls_by_hook[GC_HOOK] = self.calls_by_hook.get(GC_HOOK, 0) + 1
                cpu -= paused
            self.cpu_ns_by_hook[what] = self.cpu_ns_by_hook.get(what, 0) + cpu
            self.calls_by_hook[what] = self.calls_by_hook.get(what, 0) + 1

    def _failed(self, what: str, exc: Exception) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1
        now = self.clock()
        if now - self._last_log_s.get(what, -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
            self._last_log_s[what] = now
            log.warning(
                "agentkv connector: %s failed (%r); %d so far, falling back to vLLM defaults",
                what,
                exc,
                self.errors[what],
            )


def _nothing() -> None:
    return None


class StepTimes:
    """AgentKV's time per vLLM scheduler step (us), wall and CPU: what a ``Guard`` spent since
    the previous step closed. Keeps the newest ``keep`` steps, and for the ``worst`` costliest
    steps (CPU) where their time went, hook by hook."""

    def __init__(self, guard: Guard, keep: int = 200_000, worst: int = 64) -> None:
        self.guard = guard
        self.steps_us: deque[float] = deque(maxlen=keep)
        self.steps_cpu_us: deque[float] = deque(maxlen=keep)
        self.worst = worst
        self._worst: list[tuple[float, int, dict[str, int]]] = []  # a min-heap on CPU us
        self._mark_ns = guard.spent_ns
        self._mark_cpu_ns = guard.cpu_ns
        self._mark_by_hook = dict(guard.cpu_ns_by_hook)

    def so_far_ns(self) -> int:
        """What the step has spent in guarded calls: the finished calls' CPU time, and the
        running call's wall time so far (the wall clock is the cheaper read; a wait inside the
        running call only makes this larger)."""
        guard = self.guard
        running = guard.call_started_ns
        now = time.perf_counter_ns() - running if running else 0
        return guard.cpu_ns - self._mark_cpu_ns + now

    def close_step(self) -> None:
        spent, cpu = self.guard.spent_ns, self.guard.cpu_ns
        cpu_us = (cpu - self._mark_cpu_ns) / 1e3
        self.steps_us.append((spent - self._mark_ns) / 1e3)
        self.steps_cpu_us.append(cpu_us)
        self._mark_ns, self._mark_cpu_ns = spent, cpu
        by_hook = self.guard.cpu_ns_by_hook
        if len(self._worst) < self.worst or cpu_us > self._worst[0][0]:
            mark = self._mark_by_hook
            hooks = {h: d for h, ns in by_hook.items() if (d := ns - mark.get(h, 0))}
            entry = (cpu_us, len(self.steps_cpu_us), hooks)
            if len(self._worst) < self.worst:
                heapq.heappush(self._worst, entry)
            else:
                heapq.heapreplace(self._worst, entry)
        self._mark_by_hook = dict(by_hook)

    def worst_steps(self) -> list[dict[str, object]]:
        """The costliest steps, costliest first: CPU us, and CPU us by hook."""
        return [
            {"cpu_us": round(cpu_us, 1), "by_hook_us": {h: ns / 1e3 for h, ns in hooks.items()}}
            for cpu_us, _, hooks in sorted(self._worst, reverse=True)
        ]


@dataclass(slots=True)
class _Request:
    digests: Sequence[bytes]  # vLLM's block hashes when the request arrived
    prompt_tokens: int
    tags: RequestTags | None = None  # these two are filled in by the deferred ``started`` job
    blocks: tuple[int, ...] | None = None  # the digests' wire hashes
    gpu_tokens: int = 0  # the latest lookup's hit (vLLM looks a waiting request up again)
    host_tokens: int = 0
    looked_up: bool = False
    reported: bool = False
    may_store: bool = True

    def wire_blocks(self) -> tuple[int, ...]:
        """The request's blocks as wire hashes (computed here if the deferred job has not yet)."""
        blocks = self.blocks
        return ev.block_hash_ints(self.digests) if blocks is None else blocks


@dataclass(slots=True)
class Counters:
    requests: int = 0
    lookups: int = 0
    write_declined_requests: int = 0
    write_declined_blocks: int = 0
    host_stored_blocks: int = 0
    host_removed_blocks: int = 0
    host_loaded_blocks: int = 0
    gpu_pinned_blocks: int = 0
    gpu_retired_evicted_blocks: int = 0
    snapshots_applied: int = 0
    stale_fallbacks: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class ConnectorRuntime:
    """Request bookkeeping, the applied snapshot and event emission for one vLLM scheduler.

    Threads: every public method is called on vLLM's scheduler thread and does only what must
    be decided there (the snapshot in force, a lookup's hit, the write filter); the rest - tags,
    wire hashes, ownership, events, the trace - is handed to ``defer`` as jobs that run in
    order (``connector.deferred.Deferred`` in vLLM, ``immediate`` in tests and benchmarks).
    ``remember``, when set, is called from those jobs with each request's digests and wire
    hashes (the GPU tier's lookup table), before the request's event is sent: a snapshot that
    names a block always comes after its mapping is known.
    """

    def __init__(
        self,
        sink: EventSink,
        snapshots: Callable[[], PolicySnapshot | SnapshotView | None],
        *,
        tokens_per_block: int,
        clock: Callable[[], float] = time.monotonic,
        trace: Callable[[dict[str, object]], None] | None = None,
        defer: Callable[[Job], None] = immediate,
    ) -> None:
        self.sink = sink
        self.snapshots = snapshots
        self.tokens_per_block = tokens_per_block
        self.clock = clock
        self.trace = trace  # one record per request at allocation (kv_connector_extra_config
        # agentkv_trace_path): what the connector saw and decided, for audits and differentials
        self.defer = defer
        self.remember: Callable[[Sequence[bytes], Sequence[int]], None] | None = None
        self.counters = Counters()
        self.ownership = Ownership()
        self.generation = 0  # bumps whenever the applied view changes (new snapshot or stale)
        self._requests: dict[str, _Request] = {}
        self._view: SnapshotView | None = None
        self._retirement = Retirement.settled(frozenset())
        # the host tier's order (the manager attaches it), for the GPU tier's step budget
        self.host_order: HostOrder[Any] | None = None

    # -- events ------------------------------------------------------------------------------

    def _emit(self, *events: Event) -> None:
        self.sink.send_many(events)

    # -- the snapshot ------------------------------------------------------------------------

    def refresh(self) -> SnapshotView | None:
        """The view to apply now; ``None`` (LRU, store everything) when stale or missing.
        O(1): a new view's retired list is recounted later, as the GPU plan's first work
        (``retirement``)."""
        snap = self.snapshots()
        current = self._view
        if snap is None:
            if current is not None:
                self._view = None
                self._retirement = Retirement.settled(frozenset())
                self.generation += 1
                self.counters.stale_fallbacks += 1
            return None
        if current is None or snap.version != current.version:
            view = snap if isinstance(snap, SnapshotView) else SnapshotView.of(snap)
            self._view = view
            self._retirement = self.ownership.retire(view.retired_workflows)
            self.generation += 1
            self.counters.snapshots_applied += 1
        return self._view

    @property
    def view(self) -> SnapshotView | None:
        return self._view

    @property
    def retirement(self) -> Retirement:
        """The current view's retired set and the recount still to do for it."""
        return self._retirement

    @property
    def retired_blocks(self) -> AbstractSet[int]:
        """The retired blocks now (live; empty without a view)."""
        return self._retirement.blocks

    # -- requests ----------------------------------------------------------------------------

    def request_started(
        self,
        request_id: str,
        params: Mapping[str, object] | None,
        session_id: str | None,
        block_hashes: Sequence[bytes],
        prompt_tokens: int,
    ) -> None:
        """A request vLLM just received (``block_hashes``: a copy the caller will not change):
        track it; its tags, wire hashes, owner record and event are deferred."""
        if len(self._requests) >= MAX_OPEN_REQUESTS:
            self._requests.pop(next(iter(self._requests)))
        req = self._requests[request_id] = _Request(block_hashes, prompt_tokens)
        self.counters.requests += 1
        now = self.clock()
        self.defer(lambda: self._started(request_id, req, params, session_id, now))

    def _started(
        self,
        request_id: str,
        req: _Request,
        params: Mapping[str, object] | None,
        session_id: str | None,
        now: float,
    ) -> None:
        tags = parse_request_tags(request_id, params, session_id)
        blocks = req.blocks = req.wire_blocks()
        req.tags = tags
        if self.remember is not None:
            self.remember(req.digests, blocks)
        self.ownership.record(tags.workflow_id, blocks)
        self._emit(ev.request_started(tags, blocks, req.prompt_tokens, now))

    def lookup_done(
        self, request_id: str, gpu_tokens: int, host_tokens: int, refresh: bool = True
    ) -> None:
        """A prefix lookup for the request (vLLM repeats it while the request waits): keep its
        hit and take the write filter's decision with the snapshot held now (``refresh=False``:
        the caller has just refreshed it). Reported once, at ``allocated``, with the hit of the
        lookup that got the request its blocks."""
        req = self._requests.get(request_id)
        if req is None or req.reported:
            return
        if not req.looked_up:
            req.looked_up = True
            self.counters.lookups += 1
        req.gpu_tokens, req.host_tokens = gpu_tokens, host_tokens
        view = self.refresh() if refresh else self._view
        recomputed = len(req.digests) - (gpu_tokens + host_tokens) // self.tokens_per_block
        allowed = write_allowed(view, recomputed)
        if not allowed and view is not None and view.stage:  # a staged block is always stored
            allowed = not view.stage.isdisjoint(req.wire_blocks())
        req.may_store = allowed

    def allocated(self, request_id: str) -> None:
        """vLLM gave the request its blocks: report the prefix hit (once) and trace it."""
        req = self._requests.get(request_id)
        if req is None or req.reported or not req.looked_up:
            return
        req.reported = True
        view = self._view
        version = None if view is None else view.version
        now = self.clock()
        self.defer(lambda: self._report_hit(request_id, req, version, now))

    def _report_hit(self, request_id: str, req: _Request, version: int | None, now: float) -> None:
        if not req.may_store:
            self.counters.write_declined_requests += 1
        hit = ev.prefix_hit(
            request_id,
            prompt_blocks=req.prompt_tokens // self.tokens_per_block,
            gpu_tokens=req.gpu_tokens,
            host_tokens=req.host_tokens,
            tokens_per_block=self.tokens_per_block,
            ts=now,
        )
        if self.trace is not None:
            self.trace(
                {
                    "request_id": request_id,
                    "workflow_id": None if req.tags is None else req.tags.workflow_id,
                    "prompt_tokens": req.prompt_tokens,
                    "block_hashes": req.wire_blocks(),
                    "gpu_tokens": req.gpu_tokens,
                    "host_tokens": req.host_tokens,
                    "may_store": req.may_store,
                    "view_version": version,
                }
            )
        self._emit(hit)

    def may_store(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        return True if req is None else req.may_store

    def store_declined(self, n_blocks: int) -> None:
        self.counters.write_declined_blocks += n_blocks

    def request_finished(
        self, request_id: str, output_tokens: int, block_hashes: Sequence[bytes] = ()
    ) -> None:
        """The request ended; ``block_hashes`` (traced only; a copy) are all its full blocks
        now, the ones its generated tokens completed included."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        now = self.clock()
        self.defer(lambda: self._finished(request_id, req, output_tokens, block_hashes, now))

    def _finished(
        self,
        request_id: str,
        req: _Request,
        output_tokens: int,
        block_hashes: Sequence[bytes],
        now: float,
    ) -> None:
        if self.trace is not None:
            full = ev.block_hash_ints(block_hashes)
            self.trace({"request_id": request_id, "finished": True, "block_hashes": full})
        tags = req.tags
        if tags is None:  # its ``started`` job was lost: nothing to finish on the daemon
            return
        # the prompt's full blocks are now cached on the GPU (prefix caching)
        gpu_blocks = req.wire_blocks()[: req.prompt_tokens // self.tokens_per_block]
        events: list[Event] = []
        if gpu_blocks:
            events.append(ev.blocks_stored("gpu", gpu_blocks, now, request_id))
        events.extend(ev.request_finished(tags, output_tokens, now))
        self._emit(*events)

    def tags(self, request_id: str) -> RequestTags | None:
        """The request's tags, once its deferred ``started`` job has run."""
        req = self._requests.get(request_id)
        return None if req is None else req.tags

    def release(self, entries: list[Any]) -> None:
        """Free a large list off vLLM's thread (the host order's replaced heap): a deferred job
        deletes it a chunk at a time, letting vLLM's thread take the GIL between chunks."""
        self.defer(lambda: _free_in_chunks(entries))

    # -- host and GPU tier facts -------------------------------------------------------------
    # ``keys``: vLLM's offload keys (digest + group), a list the caller hands over; converted to
    # wire hashes and sent by a deferred job

    def host_stored(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._later(partial(self._stored_on_host, keys))

    def host_removed(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._later(partial(self._removed_from_host, keys))

    def host_loaded(self, keys: Sequence[bytes], request_id: str | None) -> None:
        if keys:
            self._later(partial(self._loaded_from_host, keys, request_id))

    def _later(self, job: Callable[[float], None]) -> None:
        """Defer ``job``, handing it the time now (taken here, on the hook's thread)."""
        now = self.clock()
        self.defer(lambda: job(now))

    def _stored_on_host(self, keys: Sequence[bytes], now: float) -> None:
        blocks = ev.block_hash_ints(keys)
        self.counters.host_stored_blocks += len(blocks)
        self._emit(ev.blocks_stored("host", blocks, now))

    def _removed_from_host(self, keys: Sequence[bytes], now: float) -> None:
        blocks = ev.block_hash_ints(keys)
        self.counters.host_removed_blocks += len(blocks)
        self._emit(ev.blocks_removed("host", blocks, now))

    def _loaded_from_host(self, keys: Sequence[bytes], request_id: str | None, now: float) -> None:
        blocks = ev.block_hash_ints(keys)
        self.counters.host_loaded_blocks += len(blocks)
        self._emit(ev.blocks_loaded(blocks, now, request_id))

    def gpu_removed(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.counters.gpu_retired_evicted_blocks += len(blocks)
            self._later(lambda now: self._emit(ev.blocks_removed("gpu", blocks, now)))


FREE_CHUNK: Final = 256  # list entries freed between two chances for vLLM's thread to run


def _free_in_chunks(entries: list[Any]) -> None:
    while entries:
        del entries[-FREE_CHUNK:]
        time.sleep(0)  # releases the GIL: a waiting vLLM thread goes first
