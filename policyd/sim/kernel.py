"""The compiled cache model: the simulator's closed loop and both tiers, in numba.

``replay`` runs what ``policyd.sim.replay.Simulator`` runs for the policies that make no
snapshot decision - ``lru`` (vLLM's default: LRU free queue on the GPU, LRU host tier that
stores everything) and ``belady`` (the offline oracle) - on a ``DenseTrace``, and counts the
same hits: the differential tests hold it to the Python model bit for bit (hits, evictions,
bytes, simulated times). It is the same model, not an approximation: the same timers in the
same order (``Timeline``: by time, then by the order they were set), the same admission
(``RequestScheduler``), host writes (``HostWrites``), stream scheduling (``StreamScheduler``)
and costs (``CostModel``). Only the containers change: dense block ids index arrays.

The tiers' eviction queues:

* LRU (both tiers under ``lru``): a doubly linked list over block ids, ``LruQueue``'s order.
* Keyed (both tiers under ``belady``): ``KeyedQueue``'s order, (key at push, push order), with
  lazy deletion, as sorted runs of entries under a heap of their heads (see ``make_queue``); the
  key packs Belady's (farthest next use, deepest block) into one int64.

State that helper functions change lives in small arrays (``st``: integers, ``ft``: floats),
indexed by the ``S_*`` / ``F_*`` constants; numba functions cannot rebind their caller's
scalars.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from policyd.core.jit import compiled, compiled_inline

# timers (policyd.sim.timeline's kinds; SNAPSHOT never occurs here)
ARRIVE, PREFILLED, FINISH = 0, 1, 2

# report counters (``Counters``)
(
    C_REQUESTS,
    C_PROMPT_BLOCKS,
    C_PROMPT_TOKENS,
    C_GPU_HIT,
    C_HOST_HIT,
    C_RECOMPUTED_TOKENS,
    C_HOST_WRITE_BYTES,
    C_HOST_READ_BYTES,
    C_HOST_DECLINED,
    C_HOST_EVICTED,
    C_GPU_EVICTED,
) = range(11)
N_COUNTERS = 11

# integer state
(
    S_CACHED,  # GPU blocks cached (referenced or queued)
    S_SCRATCH,  # GPU blocks allocated to running requests, not cached
    S_RUNNING,
    S_WAIT_HEAD,
    S_WAIT_TAIL,
    S_TIMERS,  # timers pending
    S_TIMER_SEQ,
    S_NEXT_STREAM,
    S_STAMP,  # marks a host store's protected blocks
    S_ADMITTED,
    S_FINISHED,
    S_ERROR,
    S_ERROR_CALL,
) = range(13)
N_STATE = 13

# float state (CostModel's resources, the clock)
F_NOW, F_COMPUTE_FREE, F_H2D_FREE, F_D2H_FREE, F_LAST_FINISH = range(5)
N_FSTATE = 5

ERROR_NONE, ERROR_TOO_LARGE, ERROR_NEVER_ADMITTED = 0, 1, 2

POLICY_LRU, POLICY_BELADY = 0, 1
DEPTH_LIMIT = 1 << 24  # a call's blocks the keyed queue can rank (deeper: the Python model)

IntArray = npt.NDArray[np.int64]


# A tier's eviction queue is one int64 array (numba passes one array cheaply; a record of
# arrays costs reference counting per array at every call). Its first slots (``Q_*``) hold the
# state and the offsets of its regions: for LRU a doubly linked list (``prev``, ``next``), for
# keyed queues the regions below; both kinds have ``queued`` (1: block b is in the queue).
#
# A keyed queue pops in ``KeyedQueue``'s order, (key at push, push number) ascending, with lazy
# deletion (``live``: the push number of each block's live entry). Its entries (key, push
# number, block) are appended to one array in push order and cut into *runs*: a push whose
# entry does not come before the last one extends the run being pushed, else it starts a new
# run, so every run is sorted. A 4-ary heap holds one entry per run (the key and push number
# of its head, and the run). Releasing a call's blocks pushes them deepest first, which for
# blocks with the same next use is Belady's order: a release is one run, and evicting along it
# only moves its head, so most pops touch the heap's top alone. A run whose head was deleted
# keeps a smaller key than its first live entry until it reaches the top, where its head moves
# on: the top, once its head is live, is the least live entry. When the entries' array is
# full, the live entries are packed and the heap is rebuilt.
(
    Q_HEAD,
    Q_TAIL,
    Q_LEN,
    Q_HEAP_SIZE,
    Q_CAP,  # entries the array holds
    Q_NEXT_SEQ,
    Q_KEYED,
    Q_END,  # entries used
    Q_RUNS,  # runs numbered so far
    Q_OPEN,  # the run that the next push may extend (-1: none)
    Q_PREV,
    Q_NEXT,
    Q_LIVE,
    Q_QUEUED,
    Q_ENTRIES,
    Q_RUN_HEAD,
    Q_RUN_TAIL,
    Q_HEAP,
) = range(18)
Q_SLOTS = 18
STRIDE = 3  # an entry: key, push number, block (a heap entry: key, push number, run)
HEAP_ARITY = 4

Queue = IntArray


def make_queue(n_ids: int, capacity: int, keyed: bool) -> Queue:
    """An empty queue over ``n_ids`` block ids holding at most ``capacity`` of them."""
    cap = 2 * min(capacity, n_ids) + 64 if keyed else 0
    if keyed:
        regions = (0, 0, n_ids, n_ids, STRIDE * cap, cap + 1, cap + 1, STRIDE * (cap + 1))
    else:
        regions = (n_ids, n_ids, 0, n_ids, 0, 0, 0, 0)
    q = np.zeros(Q_SLOTS + sum(regions), dtype=np.int64)
    q[Q_HEAD] = q[Q_TAIL] = q[Q_OPEN] = -1
    q[Q_CAP] = cap
    q[Q_KEYED] = int(keyed)
    at = Q_SLOTS
    for slot, size in zip(range(Q_PREV, Q_HEAP + 1), regions, strict=True):
        q[slot] = at
        at += size
    if keyed:
        q[q[Q_LIVE] : q[Q_LIVE] + n_ids] = -1
    return q


@compiled_inline
def q_has(q: Queue, b: int) -> bool:
    return bool(q[q[Q_QUEUED] + b] != 0)


# ---- the keyed queue: sorted runs under a heap of their heads -----------------------------------
# Entry i starts at slot q[Q_ENTRIES] + STRIDE * i, heap entry i at q[Q_HEAP] + STRIDE * i;
# helpers address both by that slot.


@compiled_inline
def _less(q: Queue, at: int, key: int, seq: int) -> bool:
    """Whether the (heap) entry at slot ``at`` comes before (``key``, ``seq``)."""
    k = q[at]
    return bool(k < key or (k == key and q[at + 1] < seq))


@compiled_inline
def _copy(q: Queue, to: int, at: int) -> None:
    """The entry at slot ``at`` written at slot ``to``."""
    q[to], q[to + 1], q[to + 2] = q[at], q[at + 1], q[at + 2]


@compiled
def _sift_down(q: Queue, i: int, size: int) -> None:
    """Move heap entry ``i`` down to its place among entries ``0 .. size - 1``."""
    base = q[Q_HEAP]
    at = base + STRIDE * i
    key, seq, run = q[at], q[at + 1], q[at + 2]
    while True:
        first = HEAP_ARITY * i + 1
        if first >= size:
            break
        best = first
        best_at = base + STRIDE * first
        for child in range(first + 1, min(first + HEAP_ARITY, size)):
            child_at = base + STRIDE * child
            if _less(q, child_at, q[best_at], q[best_at + 1]):
                best, best_at = child, child_at
        if not _less(q, best_at, key, seq):
            break
        _copy(q, at, best_at)
        i, at = best, best_at
    q[at], q[at + 1], q[at + 2] = key, seq, run


@compiled
def _sift_up(q: Queue, i: int) -> None:
    """Move heap entry ``i`` up to its place."""
    base = q[Q_HEAP]
    at = base + STRIDE * i
    key, seq, run = q[at], q[at + 1], q[at + 2]
    while i > 0:
        parent = (i - 1) // HEAP_ARITY
        parent_at = base + STRIDE * parent
        if _less(q, parent_at, key, seq):  # (push numbers differ: never equal)
            break
        _copy(q, at, parent_at)
        i, at = parent, parent_at
    q[at], q[at + 1], q[at + 2] = key, seq, run


@compiled_inline
def _is_live(q: Queue, at: int) -> bool:
    return bool(q[q[Q_LIVE] + q[at + 2]] == q[at + 1])


@compiled
def _pack(q: Queue) -> None:
    """Keep only live entries, each run's packed in place (runs in the order of the array),
    renumber the runs, rebuild the heap; no run is open after."""
    heap, entries = q[Q_HEAP], q[Q_ENTRIES]
    run_head, run_tail = q[Q_RUN_HEAD], q[Q_RUN_TAIL]
    size = q[Q_HEAP_SIZE]
    runs = np.empty(size, dtype=np.int64)
    starts = np.empty(size, dtype=np.int64)
    for i in range(size):
        runs[i] = q[heap + STRIDE * i + 2]
        starts[i] = q[run_head + runs[i]]
    end, kept = 0, 0
    for i in np.argsort(starts):  # left to right: an entry never moves right
        r = runs[i]
        first = end
        for j in range(q[run_head + r], q[run_tail + r]):
            at = entries + STRIDE * j
            if _is_live(q, at):
                _copy(q, entries + STRIDE * end, at)
                end += 1
        if end > first:
            q[run_head + kept], q[run_tail + kept] = first, end
            h, e = heap + STRIDE * kept, entries + STRIDE * first
            q[h], q[h + 1], q[h + 2] = q[e], q[e + 1], kept
            kept += 1
    q[Q_END], q[Q_RUNS], q[Q_HEAP_SIZE], q[Q_OPEN] = end, kept, kept, -1
    for i in range((kept - 2) // HEAP_ARITY, -1, -1):
        _sift_down(q, i, kept)


@compiled
def _keyed_push(q: Queue, b: int, key: int) -> None:
    if q[Q_END] >= q[Q_CAP]:
        _pack(q)
    seq = q[Q_NEXT_SEQ]
    q[Q_NEXT_SEQ] = seq + 1
    q[q[Q_LIVE] + b] = seq
    end = q[Q_END]
    at = q[Q_ENTRIES] + STRIDE * end
    q[at], q[at + 1], q[at + 2] = key, seq, b
    q[Q_END] = end + 1
    r = q[Q_OPEN]
    if r >= 0 and key >= q[at - STRIDE]:  # extends the open run (its last entry is the one
        q[q[Q_RUN_TAIL] + r] = end + 1  # before; a later push number breaks an equal key)
        return
    r = q[Q_RUNS]
    q[Q_RUNS] = r + 1
    q[q[Q_RUN_HEAD] + r], q[q[Q_RUN_TAIL] + r] = end, end + 1
    q[Q_OPEN] = r
    i = q[Q_HEAP_SIZE]
    q[Q_HEAP_SIZE] = i + 1
    h = q[Q_HEAP] + STRIDE * i
    q[h], q[h + 1], q[h + 2] = key, seq, r
    _sift_up(q, i)


@compiled
def _keyed_top(q: Queue) -> int:
    """The least live entry's block (the queue is not empty): the top run's head, once dead
    entries have been skipped and emptied runs dropped."""
    heap, entries = q[Q_HEAP], q[Q_ENTRIES]
    run_head, run_tail = q[Q_RUN_HEAD], q[Q_RUN_TAIL]
    while True:
        r = q[heap + 2]
        j, tail = q[run_head + r], q[run_tail + r]
        while j < tail and not _is_live(q, entries + STRIDE * j):
            j += 1
        if j == q[run_head + r]:
            return int(q[entries + STRIDE * j + 2])
        q[run_head + r] = j
        if j < tail:  # the run's head moved: its new key, then its place
            e = entries + STRIDE * j
            q[heap], q[heap + 1] = q[e], q[e + 1]
        else:  # the run is empty: the heap's last entry takes its place
            if r == q[Q_OPEN]:
                q[Q_OPEN] = -1
            size = q[Q_HEAP_SIZE] - 1
            q[Q_HEAP_SIZE] = size
            _copy(q, heap, heap + STRIDE * size)
        _sift_down(q, 0, q[Q_HEAP_SIZE])


# ---- queue operations (both kinds) ------------------------------------------------------------


@compiled_inline
def q_push(q: Queue, b: int, key: int) -> None:
    """Queue block ``b`` (not queued) at the tail / with ``key``."""
    q[q[Q_QUEUED] + b] = 1
    q[Q_LEN] += 1
    if q[Q_KEYED]:
        _keyed_push(q, b, key)
        return
    tail = q[Q_TAIL]
    q[q[Q_PREV] + b] = tail
    q[q[Q_NEXT] + b] = -1
    if tail >= 0:
        q[q[Q_NEXT] + tail] = b
    else:
        q[Q_HEAD] = b
    q[Q_TAIL] = b


@compiled_inline
def q_remove(q: Queue, b: int) -> None:
    """Take queued block ``b`` out of the queue."""
    q[q[Q_QUEUED] + b] = 0
    q[Q_LEN] -= 1
    if q[Q_KEYED]:
        q[q[Q_LIVE] + b] = -1
        return
    prev, nxt = q[Q_PREV], q[Q_NEXT]
    p, n = q[prev + b], q[nxt + b]
    if p >= 0:
        q[nxt + p] = n
    else:
        q[Q_HEAD] = n
    if n >= 0:
        q[prev + n] = p
    else:
        q[Q_TAIL] = p


@compiled_inline
def q_peek(q: Queue) -> int:
    """The next victim, or -1."""
    if q[Q_LEN] == 0:
        return -1
    if q[Q_KEYED]:
        return _keyed_top(q)
    return int(q[Q_HEAD])


@compiled_inline
def q_pop(q: Queue) -> int:
    """Remove and return the next victim, or -1."""
    b = q_peek(q)
    if b >= 0:
        q_remove(q, b)
    return b


@compiled_inline
def q_after(q: Queue, b: int) -> int:
    """LRU queues: the block after ``b`` in eviction order, or -1."""
    return int(q[q[Q_NEXT] + b])


# ---- the oracle's keys -----------------------------------------------------------------------


@compiled_inline
def belady_key(next_use: IntArray, depth: IntArray, never: int, b: int) -> int:
    """``Belady.oracle_keys`` packed: farthest next use first, then the deepest block."""
    return int((never - next_use[b]) * DEPTH_LIMIT + (DEPTH_LIMIT - 1 - depth[b]))


Slices = tuple[npt.NDArray[np.int32], IntArray]  # block ids, and call c's from off[c] to off[c + 1]


class Trace(NamedTuple):
    """A ``DenseTrace``'s arrays, as the kernel reads them."""

    prompt: npt.NDArray[np.int32]
    prompt_off: IntArray
    cached_out: npt.NDArray[np.int32]
    cached_out_off: IntArray
    physical_blocks: IntArray
    prompt_tokens: IntArray
    output_tokens: IntArray
    gap_s: npt.NDArray[np.float64]
    parallel: npt.NDArray[np.bool_]
    stream_first: IntArray
    stream_of: IntArray
    hit_limit: IntArray


class Setup(NamedTuple):
    """The replay's settings, as numbers."""

    policy: int  # POLICY_LRU / POLICY_BELADY
    separate: bool  # running_space == "separate"
    offload_prompt_only: bool
    concurrency: int
    gpu_capacity: int
    host_capacity: int
    block_tokens: int
    kv_bytes_per_block: int
    prefill_tokens_per_s: float
    decode_s_per_token: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float


class Oracle(NamedTuple):
    """Belady's knowledge: the position of each call in the order it will reach the cache
    (-1: none), and per position its blocks with their next use; each block's depth."""

    position: IntArray
    future_off: IntArray
    future_blocks: npt.NDArray[np.int32]
    future_next: IntArray
    depth: IntArray
    never: int


class Run(NamedTuple):
    """Everything the replay changes."""

    st: IntArray
    ft: npt.NDArray[np.float64]
    counters: IntArray
    refs: npt.NDArray[np.int32]  # GPU: -1 not cached, else running requests referencing it
    gpu: Queue
    host: Queue
    next_use: IntArray  # belady: what the oracle has been told (RequestStarted)
    protect: IntArray  # host store: the stamp of the store protecting block b
    buf: npt.NDArray[np.int32]  # scratch for one store's candidates and victims
    held: npt.NDArray[np.int32]  # call c's referenced GPU blocks from held_off[c], held_n[c] long
    held_off: IntArray
    held_n: IntArray
    req_scratch: IntArray
    gpu_hit: IntArray
    host_hit: IntArray
    arrival_s: npt.NDArray[np.float64]
    waiting: IntArray
    outstanding: IntArray  # per stream: calls of its current step running
    next_step: IntArray
    timer_when: npt.NDArray[np.float64]
    timer_seq: IntArray
    timer_kind: IntArray
    timer_call: IntArray
    admitted: IntArray  # records: call c admitted k-th
    latency: npt.NDArray[np.float64]  # finish order


# ---- timers ------------------------------------------------------------------------------------


@compiled_inline
def _timer_before(r: Run, i: int, j: int) -> bool:
    wi, wj = r.timer_when[i], r.timer_when[j]
    return bool(wi < wj or (wi == wj and r.timer_seq[i] < r.timer_seq[j]))


@compiled_inline
def _timer_swap(r: Run, i: int, j: int) -> None:
    r.timer_when[i], r.timer_when[j] = r.timer_when[j], r.timer_when[i]
    r.timer_seq[i], r.timer_seq[j] = r.timer_seq[j], r.timer_seq[i]
    r.timer_kind[i], r.timer_kind[j] = r.timer_kind[j], r.timer_kind[i]
    r.timer_call[i], r.timer_call[j] = r.timer_call[j], r.timer_call[i]


@compiled
def timer_at(r: Run, when: float, kind: int, call: int) -> None:
    i = r.st[S_TIMERS]
    r.st[S_TIMERS] = i + 1
    r.timer_when[i], r.timer_kind[i], r.timer_call[i] = when, kind, call
    r.timer_seq[i] = r.st[S_TIMER_SEQ]
    r.st[S_TIMER_SEQ] += 1
    while i > 0:
        parent = (i - 1) >> 1
        if not _timer_before(r, i, parent):
            break
        _timer_swap(r, i, parent)
        i = parent


@compiled
def timer_pop(r: Run) -> tuple[int, int]:
    """The next timer's (kind, call); the clock moves to its time."""
    r.ft[F_NOW] = r.timer_when[0]
    kind, call = int(r.timer_kind[0]), int(r.timer_call[0])
    size = r.st[S_TIMERS] - 1
    r.st[S_TIMERS] = size
    if size > 0:
        _timer_swap(r, 0, size)
        i = 0
        while True:
            child = 2 * i + 1
            if child >= size:
                break
            if child + 1 < size and _timer_before(r, child + 1, child):
                child += 1
            if not _timer_before(r, child, i):
                break
            _timer_swap(r, i, child)
            i = child
    return kind, call


# ---- streams (StreamScheduler) ----------------------------------------------------------------


@compiled
def _issue_step(t: Trace, r: Run, stream: int, index: int) -> None:
    """Issue the step of ``stream`` starting at call ``index``: it and the ``parallel`` calls
    after it arrive together."""
    first, n = t.stream_first[stream], t.stream_first[stream + 1] - t.stream_first[stream]
    end = index + 1
    while end < n and t.parallel[first + end]:
        end += 1
    r.outstanding[stream] = end - index
    r.next_step[stream] = end
    now = r.ft[F_NOW]
    for i in range(index, end):
        c = first + i
        when = now + (t.gap_s[c] if i > 0 else 0.0)
        r.arrival_s[c] = when
        timer_at(r, when, ARRIVE, c)


@compiled
def _start_next_stream(t: Trace, r: Run) -> bool:
    """Start the next stream that has calls; False when none is left."""
    n_streams = len(t.stream_first) - 1
    while r.st[S_NEXT_STREAM] < n_streams:
        s = r.st[S_NEXT_STREAM]
        r.st[S_NEXT_STREAM] = s + 1
        if t.stream_first[s + 1] > t.stream_first[s]:
            _issue_step(t, r, s, 0)
            return True
    return False


@compiled
def _call_finished(t: Trace, r: Run, c: int) -> None:
    s = t.stream_of[c]
    r.outstanding[s] -= 1
    if r.outstanding[s] > 0:
        return
    if r.next_step[s] < t.stream_first[s + 1] - t.stream_first[s]:
        _issue_step(t, r, s, r.next_step[s])
        return
    _start_next_stream(t, r)


# ---- the GPU pool (GpuTier) -------------------------------------------------------------------


@compiled_inline
def _push(q: Queue, next_use: IntArray, depth: IntArray, never: int, b: int) -> None:
    """Queue ``b``: at the tail (LRU), or under the oracle's key for it now."""
    key = 0
    if q[Q_KEYED]:
        key = belady_key(next_use, depth, never, b)
    q_push(q, b, key)


@compiled
def _commit(s: Setup, r: Run, c: int, blocks: npt.NDArray[np.int32]) -> None:
    """``GpuTier.commit`` of ``blocks`` for call ``c`` (its earlier blocks cached)."""
    refs, held, gpu, next_use = r.refs, r.held, r.gpu, r.next_use
    held_at = r.held_off[c] + r.held_n[c]
    if not s.separate:
        cached = 0
        for b in blocks:
            if refs[b] < 0:
                refs[b] = 1
                held[held_at + cached] = b
                cached += 1
        r.held_n[c] += cached
        r.st[S_CACHED] += cached
        r.st[S_SCRATCH] -= cached
        r.req_scratch[c] -= cached
        return
    for b in blocks:
        if refs[b] >= 0:
            continue
        if r.st[S_CACHED] >= s.gpu_capacity:
            victim = q_peek(gpu)
            if victim < 0 or (s.policy == POLICY_BELADY and next_use[victim] <= next_use[b]):
                break
            q_remove(gpu, victim)
            refs[victim] = -1
            r.st[S_CACHED] -= 1
            r.counters[C_GPU_EVICTED] += 1
        refs[b] = 1
        r.st[S_CACHED] += 1
        held[held_at] = b
        held_at += 1
        r.held_n[c] += 1


@compiled
def _release(r: Run, o: Oracle, c: int) -> None:
    """``GpuTier.release``: the call's blocks are freed tail first."""
    refs, held, gpu, next_use, depth, never = r.refs, r.held, r.gpu, r.next_use, o.depth, o.never
    start = r.held_off[c]
    for j in range(start + r.held_n[c] - 1, start - 1, -1):
        b = held[j]
        refs[b] -= 1
        if refs[b] == 0:
            _push(gpu, next_use, depth, never, b)
    r.st[S_SCRATCH] -= r.req_scratch[c]
    r.st[S_RUNNING] -= 1


# ---- the host tier (HostTier, HostWrites) -------------------------------------------------------


@compiled
def _offered(t: Trace, r: Run, c: int) -> tuple[int, int]:
    """The prompt slice vLLM offers the host tier: every block, or after a host load the
    blocks past the loaded ones."""
    lo, hi = t.prompt_off[c], t.prompt_off[c + 1]
    if r.host_hit[c]:
        lo += r.gpu_hit[c] + r.host_hit[c]
    return lo, hi


@compiled
def _collect_candidates(t: Trace, s: Setup, r: Run, c: int) -> int:
    """Offered blocks not host-resident into ``buf``; marks the resident ones protected."""
    stamp = r.st[S_STAMP] + 1
    r.st[S_STAMP] = stamp
    lo, hi = _offered(t, r, c)
    host, protect, buf, prompt = r.host, r.protect, r.buf, t.prompt
    n = 0
    for j in range(lo, hi):
        b = prompt[j]
        if q_has(host, b):
            protect[b] = stamp
        else:
            buf[n] = b
            n += 1
    if not s.offload_prompt_only:
        for j in range(t.cached_out_off[c], t.cached_out_off[c + 1]):
            b = t.cached_out[j]
            if q_has(r.host, b):
                r.protect[b] = stamp
            else:
                r.buf[n] = b
                n += 1
    return n


@compiled
def _store_all_or_nothing(s: Setup, r: Run, o: Oracle, n_new: int) -> int:
    """vLLM's ``prepare_store`` on an LRU host tier: evict the least recent unprotected
    blocks to make room, or store nothing. Returns the blocks stored."""
    q, buf, protect = r.host, r.buf, r.protect
    n_evict = q[Q_LEN] + n_new - s.host_capacity
    if n_evict > 0:
        stamp, chosen = r.st[S_STAMP], 0
        b = q[Q_HEAD]
        while b >= 0 and chosen < n_evict:
            if protect[b] != stamp:
                buf[n_new + chosen] = b
                chosen += 1
            b = q_after(q, b)
        if chosen < n_evict:
            return 0
        for k in range(chosen):
            q_remove(q, buf[n_new + k])
        r.counters[C_HOST_EVICTED] += chosen
    for k in range(n_new):
        q_push(q, buf[k], 0)
    return n_new


@compiled
def _store_admitted(s: Setup, r: Run, o: Oracle, n_new: int) -> int:
    """The oracle's store: each block decided alone against the next victim."""
    q, stamp, stored = r.host, r.st[S_STAMP], 0
    next_use, protect = r.next_use, r.protect
    for k in range(n_new):
        b = r.buf[k]
        if q[Q_LEN] >= s.host_capacity:
            victim = q_peek(q)
            if victim < 0 or protect[victim] == stamp or next_use[victim] <= next_use[b]:
                continue
            q_remove(q, victim)
            r.counters[C_HOST_EVICTED] += 1
        _push(q, next_use, o.depth, o.never, b)
        stored += 1
    return stored


@compiled
def _prefilled(t: Trace, s: Setup, r: Run, o: Oracle, c: int) -> None:
    """The prompt's KV exists: write what the call offers to the host tier, then decode."""
    now = r.ft[F_NOW]
    if s.host_capacity > 0:
        n_new = _collect_candidates(t, s, r, c)
        if n_new:
            if s.policy == POLICY_BELADY:
                stored = _store_admitted(s, r, o, n_new)
            else:
                stored = _store_all_or_nothing(s, r, o, n_new)
            r.counters[C_HOST_DECLINED] += n_new - stored
            if stored:
                nbytes = stored * s.kv_bytes_per_block
                r.counters[C_HOST_WRITE_BYTES] += nbytes
                start = max(now, r.ft[F_D2H_FREE])
                r.ft[F_D2H_FREE] = start + nbytes / s.d2h_bytes_per_s
    timer_at(r, now + t.output_tokens[c] * s.decode_s_per_token, FINISH, c)


@compiled
def _host_touch(r: Run, o: Oracle, blocks: npt.NDArray[np.int32]) -> None:
    """``HostTier.touch`` of ``blocks`` reversed: resident ones become most recent."""
    q, next_use, depth, never = r.host, r.next_use, o.depth, o.never
    for j in range(len(blocks) - 1, -1, -1):
        b = blocks[j]
        if q_has(q, b):
            q_remove(q, b)
            _push(q, next_use, depth, never, b)


@compiled
def _finished_host(t: Trace, s: Setup, r: Run, o: Oracle, c: int) -> None:
    """``HostWrites.finished``: the loaded and offered keys re-ranked, tail first."""
    lo, hi = t.prompt_off[c], t.prompt_off[c + 1]
    if r.host_hit[c]:
        _host_touch(r, o, t.prompt[lo + r.gpu_hit[c] : hi])
        return
    if not s.offload_prompt_only:  # offered = prompt + outputs; touched last first
        _host_touch(r, o, t.cached_out[t.cached_out_off[c] : t.cached_out_off[c + 1]])
    _host_touch(r, o, t.prompt[lo:hi])


# ---- admission (RequestScheduler) -----------------------------------------------------------


@compiled
def _start(t: Trace, s: Setup, r: Run, o: Oracle, c: int) -> None:
    """Admit call ``c`` (its GPU prefix hit looked up): find its host hit, take its blocks,
    evict for them, cache them; book its load and prefill."""
    now = r.ft[F_NOW]
    gpu_hit = r.gpu_hit[c]
    new_blocks = t.physical_blocks[c] - gpu_hit
    lo, hi = t.prompt_off[c], t.prompt_off[c + 1]
    prompt, refs, held, gpu, host = t.prompt, r.refs, r.held, r.gpu, r.host
    host_hit = 0
    if host[Q_LEN] > 0:
        k = lo + gpu_hit
        while k < hi and q_has(host, prompt[k]):
            k += 1
        host_hit = k - lo - gpu_hit
    r.host_hit[c] = host_hit
    if s.policy == POLICY_BELADY and o.position[c] >= 0:  # the oracle sees RequestStarted
        p = o.position[c]
        for j in range(o.future_off[p], o.future_off[p + 1]):
            r.next_use[o.future_blocks[j]] = o.future_next[j]
    # acquire the prefix
    held_at = r.held_off[c]
    for j in range(lo, lo + gpu_hit):
        b = prompt[j]
        if refs[b] == 0:
            q_remove(gpu, b)
        refs[b] += 1
        held[held_at] = b
        held_at += 1
    r.held_n[c] = gpu_hit
    if not s.separate:  # allocate: evict from the queue's head what free space lacks
        free = s.gpu_capacity - r.st[S_CACHED] - r.st[S_SCRATCH]
        for _ in range(new_blocks - free):
            refs[q_pop(gpu)] = -1
            r.st[S_CACHED] -= 1
            r.counters[C_GPU_EVICTED] += 1
        r.st[S_SCRATCH] += new_blocks
        r.req_scratch[c] = new_blocks
    load_bytes = host_hit * s.kv_bytes_per_block
    load_end = now
    if load_bytes:
        load_end = max(now, r.ft[F_H2D_FREE]) + load_bytes / s.h2d_bytes_per_s
        r.ft[F_H2D_FREE] = load_end
    _commit(s, r, c, prompt[lo + gpu_hit : hi])
    computed = max(1, t.prompt_tokens[c] - (gpu_hit + host_hit) * s.block_tokens)
    prefill_end = max(now, r.ft[F_COMPUTE_FREE], load_end) + computed / s.prefill_tokens_per_s
    r.ft[F_COMPUTE_FREE] = prefill_end
    cn = r.counters
    cn[C_REQUESTS] += 1
    cn[C_PROMPT_BLOCKS] += hi - lo
    cn[C_PROMPT_TOKENS] += t.prompt_tokens[c]
    cn[C_GPU_HIT] += gpu_hit
    cn[C_HOST_HIT] += host_hit
    cn[C_RECOMPUTED_TOKENS] += computed
    cn[C_HOST_READ_BYTES] += load_bytes
    r.admitted[r.st[S_ADMITTED]] = c
    r.st[S_ADMITTED] += 1
    timer_at(r, prefill_end, PREFILLED, c)


@compiled
def _gpu_prefix(
    prompt: npt.NDArray[np.int32], refs: npt.NDArray[np.int32], lo: int, limit: int
) -> tuple[int, int]:
    """The GPU prefix hit (at most ``limit`` blocks from ``prompt[lo]``) and how many of its
    blocks are queued (cached, unreferenced)."""
    hit, queued = 0, 0
    while hit < limit and refs[prompt[lo + hit]] >= 0:
        if refs[prompt[lo + hit]] == 0:
            queued += 1
        hit += 1
    return hit, queued


@compiled
def _admit_waiting(t: Trace, s: Setup, r: Run, o: Oracle) -> None:
    """Admit waiting calls in order while the GPU pool can hold the head's blocks."""
    while r.st[S_WAIT_HEAD] < r.st[S_WAIT_TAIL]:
        c = r.waiting[r.st[S_WAIT_HEAD]]
        gpu_hit, queued = _gpu_prefix(t.prompt, r.refs, t.prompt_off[c], t.hit_limit[c])
        new_blocks = t.physical_blocks[c] - gpu_hit
        if not s.separate:
            available = s.gpu_capacity - r.st[S_CACHED] - r.st[S_SCRATCH] + r.gpu[Q_LEN]
            if available < new_blocks + queued:
                if r.st[S_RUNNING] == 0:
                    r.st[S_ERROR] = ERROR_TOO_LARGE
                    r.st[S_ERROR_CALL] = c
                return
        r.st[S_WAIT_HEAD] += 1
        r.st[S_RUNNING] += 1
        r.gpu_hit[c] = gpu_hit
        _start(t, s, r, o, c)


@compiled
def _finish(t: Trace, s: Setup, r: Run, o: Oracle, c: int) -> None:
    """The last token is out: cache the output blocks, re-rank the host keys, free the GPU
    blocks; then admit what now fits and issue what follows in the stream."""
    lo, hi = t.cached_out_off[c], t.cached_out_off[c + 1]
    if hi > lo:
        _commit(s, r, c, t.cached_out[lo:hi])
    if s.host_capacity > 0:
        _finished_host(t, s, r, o, c)
    now = r.ft[F_NOW]
    r.latency[r.st[S_FINISHED]] = now - r.arrival_s[c]
    r.st[S_FINISHED] += 1
    r.ft[F_LAST_FINISH] = now
    _release(r, o, c)
    _admit_waiting(t, s, r, o)
    _call_finished(t, r, c)


@compiled
def replay(t: Trace, s: Setup, r: Run, o: Oracle) -> None:
    """Run the closed loop to the end (or to the first error, in ``r.st[S_ERROR]``)."""
    for _ in range(s.concurrency):
        if not _start_next_stream(t, r):
            break
    while r.st[S_TIMERS] > 0:
        kind, c = timer_pop(r)
        if kind == ARRIVE:
            r.waiting[r.st[S_WAIT_TAIL]] = c
            r.st[S_WAIT_TAIL] += 1
            _admit_waiting(t, s, r, o)
        elif kind == PREFILLED:
            _prefilled(t, s, r, o, c)
        else:
            _finish(t, s, r, o, c)
        if r.st[S_ERROR] != ERROR_NONE:
            return
    if r.st[S_WAIT_HEAD] < r.st[S_WAIT_TAIL]:
        r.st[S_ERROR] = ERROR_NEVER_ADMITTED


@compiled
def future_of(
    order: IntArray, prompts: Slices, outputs: Slices, n_ids: int
) -> tuple[IntArray, npt.NDArray[np.int32], IntArray, IntArray]:
    """``FutureIndex`` of calls in ``order``: per position its blocks (its prompt, then every
    output block the workload gives) with their next use (``len(order) + 1``: never), and each
    block's depth (its index in the last call holding it; 0 if none)."""
    prompt, prompt_off = prompts
    given_out, given_out_off = outputs
    n = len(order)
    off = np.zeros(n + 1, dtype=np.int64)
    for p in range(n):
        c = order[p]
        off[p + 1] = (
            off[p] + prompt_off[c + 1] - prompt_off[c] + given_out_off[c + 1] - given_out_off[c]
        )
    blocks = np.empty(off[n], dtype=np.int32)
    for p in range(n):
        c = order[p]
        at = off[p]
        for j in range(prompt_off[c], prompt_off[c + 1]):
            blocks[at] = prompt[j]
            at += 1
        for j in range(given_out_off[c], given_out_off[c + 1]):
            blocks[at] = given_out[j]
            at += 1
    never = n + 1
    nxt = np.empty(off[n], dtype=np.int64)
    last = np.full(n_ids, never, dtype=np.int64)
    for p in range(n - 1, -1, -1):
        for j in range(off[p], off[p + 1]):
            nxt[j] = last[blocks[j]]
        for j in range(off[p], off[p + 1]):
            last[blocks[j]] = p
    depth = np.zeros(n_ids, dtype=np.int64)
    for p in range(n):
        for j in range(off[p], off[p + 1]):
            depth[blocks[j]] = j - off[p]
    return off, blocks, nxt, depth
