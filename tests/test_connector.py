"""The connector's vLLM-free parts: request tags, event translation, snapshot application, the
host tier's eviction order, the copy plan, and the runtime against a real daemon client on
loopback (an in-test PULL / PUB peer standing in for the daemon)."""

from __future__ import annotations

import json
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.copy_plan import plan_rows
from connector.events import block_hash_int, block_hash_ints, prefix_hit
from connector.params import UNKNOWN_AGENT, parse_request_tags
from connector.runtime import MAX_QUEUED_HOOKS, ConnectorRuntime, Guard
from connector.trace_file import TraceFile
from policyd.core.client import DaemonClient
from policyd.core.types import (
    BATCH_CODEC,
    SNAPSHOT_CODEC,
    BlocksRemoved,
    BlocksStored,
    Event,
    PolicySnapshot,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    ScoredBlocks,
    WorkflowFinished,
    WriteFilter,
)
from policyd.core.wire import SNAPSHOT_TOPIC, Endpoints
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import Ownership, SnapshotView, select_pins, write_allowed
from tests.peers import Sockets, daemon_peer, wait_for

# ---- request tags ------------------------------------------------------------------------------


def test_tags_read_every_field_and_session_id_wins() -> None:
    params = {
        "workflow_id": "wf-1",
        "agent": "coder",
        "workflow_type": "code",
        "workflow_done": "true",
        "hints": {"step": 3, "tool": "pytest", "nested": {"x": 1}},
        "session_id": "inner",
    }
    tags = parse_request_tags("r1", params, session_id="outer")
    assert (tags.workflow_id, tags.agent, tags.workflow_type) == ("wf-1", "coder", "code")
    assert tags.workflow_done is True
    assert tags.hints == {"step": 3, "tool": "pytest"}  # non-scalar hints dropped
    assert tags.session_id == "outer"


@pytest.mark.parametrize(
    "params",
    [None, {}, {"workflow_id": None, "agent": 5.5}, {"hints": "x"}, {"workflow_id": ""}, "junk"],
)
def test_tags_never_fail_on_bad_params(params: object) -> None:
    tags = parse_request_tags("req", params)  # type: ignore[arg-type]
    assert tags.workflow_id == "wf-req"
    assert tags.agent == UNKNOWN_AGENT
    assert tags.workflow_done is False


def test_missing_workflow_falls_back_to_session() -> None:
    assert parse_request_tags("r", {"agent": "a"}, session_id="s9").workflow_id == "s9"


# ---- event translation -------------------------------------------------------------------------


def test_block_hash_int_is_the_big_endian_prefix() -> None:
    digest = bytes([0xAB] * 8 + [1] * 24)
    assert block_hash_int(digest) == 0xABABABABABABABAB
    assert block_hash_int(digest + b"\x00\x00\x00\x01") == block_hash_int(digest)  # offload key


@given(st.integers(8, 40), st.lists(st.binary(min_size=40, max_size=40), max_size=200))
def test_block_hash_ints_equals_one_digest_at_a_time(width: int, raw: list[bytes]) -> None:
    digests = [r[:width] for r in raw]  # one hash function: one length (the unpacked path)
    assert block_hash_ints(digests) == tuple(block_hash_int(d) for d in digests)


@given(st.lists(st.binary(min_size=8, max_size=40), max_size=50))
def test_block_hash_ints_of_mixed_lengths_falls_back(digests: list[bytes]) -> None:
    if len({len(d) for d in digests}) > 1 and len(digests[0]) != len(digests[-1]):
        assert block_hash_ints(digests) == tuple(block_hash_int(d) for d in digests)


def test_trace_file_writes_every_record_in_order_off_the_callers_thread(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    trace = TraceFile(str(path))
    for i in range(500):
        trace({"request_id": f"r{i}", "block_hashes": (i, i + 1)})
    trace({"bad": object()})  # not JSON: lost alone, counted
    trace({"request_id": "last"})
    trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["request_id"] for r in lines] == [*(f"r{i}" for i in range(500)), "last"]
    assert lines[7]["block_hashes"] == [7, 8]
    assert trace.write_errors == 1
    trace.close()  # twice: nothing left to do


@given(
    st.integers(0, 40),
    st.integers(0, 2000),
    st.integers(0, 2000),
    st.sampled_from([16, 32, 64]),
)
def test_prefix_hit_partitions_the_prompt(blocks: int, gpu: int, host: int, bs: int) -> None:
    hit = prefix_hit("r", prompt_blocks=blocks, gpu_tokens=gpu, host_tokens=host,
                     tokens_per_block=bs, ts=0.0)  # fmt: skip
    assert hit.gpu_blocks + hit.host_blocks + hit.recomputed_blocks == blocks
    assert min(hit.gpu_blocks, hit.host_blocks, hit.recomputed_blocks) >= 0


# ---- snapshot application ----------------------------------------------------------------------


def snap(version: int = 1, **kw: object) -> PolicySnapshot:
    return PolicySnapshot(version=version, ts=0.0, ttl_s=5.0, policy="agentkv", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("wf", "new_blocks", "staged", "allowed"),
    [
        (WriteFilter(mode="none"), 100, False, True),
        (WriteFilter(mode="fixed", max_new_blocks=8), 9, False, False),
        (WriteFilter(mode="fixed", max_new_blocks=8), 8, False, True),
        (WriteFilter(mode="conditioned", max_new_blocks=8, pressure=False), 100, False, True),
        (WriteFilter(mode="conditioned", max_new_blocks=8, pressure=True), 9, False, False),
        (WriteFilter(mode="fixed", max_new_blocks=8), 100, True, True),
    ],
)
def test_write_filter(wf: WriteFilter, new_blocks: int, staged: bool, allowed: bool) -> None:
    assert write_allowed(SnapshotView.of(snap(write_filter=wf)), new_blocks, staged) is allowed


def test_pins_skip_retired_and_respect_the_cap() -> None:
    view = SnapshotView.of(snap(pin=(5, 6, 6, 7, 8, 9)))
    assert list(select_pins(view, frozenset({6}), 3)) == [5, 7, 8]
    assert list(select_pins(view, frozenset(), 0)) == []
    assert list(select_pins(None, frozenset(), 10)) == []


def test_retired_blocks_exclude_blocks_shared_with_live_workflows() -> None:
    own = Ownership()
    own.record("done", [1, 2, 3])
    own.record("live", [1, 4])
    assert own.retired_blocks(frozenset({"done"})) == {2, 3}
    assert own.retired_blocks(frozenset({"done", "live"})) == {1, 2, 3, 4}


def test_a_workflow_listed_retired_before_its_request_queues_its_blocks_in_order() -> None:
    own = Ownership()
    own.retired_blocks(frozenset({"done"}))  # listed before its first request was seen
    own.record("live", [7])
    own.record("done", [5, 3, 5, 7, 9])
    assert list(own.fresh) == [5, 3, 9]  # in the request's order; 7 has a live owner
    assert own.dead == {3, 5, 9}


def test_a_recount_settles_workflows_in_the_order_they_were_last_seen() -> None:
    """A budgeted recount settles the newly retired workflows one after another, so which
    blocks a step finds retired depends on that order: the workflows' last-seen order, never a
    set's (string hashing differs from process to process, and the replays with it)."""
    own = Ownership()
    names = [f"wf-{i}" for i in range(24)]
    for i, name in enumerate(names):
        own.record(name, [100 + i])
    own.record("wf-3", [103])  # seen again: last in the order
    order = [n for n in names if n != "wf-3"] + ["wf-3"]
    retired = frozenset(names[::2])
    for _ in own.retire(retired).work:
        pass
    assert list(own.fresh) == [100 + names.index(n) for n in order if n in retired]
    for _ in own.retire(frozenset()).work:  # all live again, in the same order
        pass
    assert own.dead == set()


class ReferenceOwnership:
    """The retired set by its definition, recomputed from scratch: blocks whose every tracked
    owner (the 4 most recently seen workflows) is retired."""

    def __init__(self) -> None:
        self.tracked: dict[str, set[int]] = {}  # in ``Ownership``'s order

    def record(self, workflow_id: str, blocks: list[int]) -> None:
        self.tracked.setdefault(workflow_id, set()).update(blocks)
        self.tracked[workflow_id] = self.tracked.pop(workflow_id)  # most recent last
        while len(self.tracked) > 4:
            del self.tracked[next(iter(self.tracked))]

    def retired(self, retired_workflows: frozenset[str]) -> set[int]:
        owners: dict[int, set[str]] = {}
        for wf, owned in self.tracked.items():
            for b in owned:
                owners.setdefault(b, set()).add(wf)
        return {b for b, ws in owners.items() if ws <= retired_workflows}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("record"), st.integers(0, 5), st.lists(st.integers(0, 12), max_size=4)
            ),
            st.tuples(st.just("retire"), st.frozensets(st.integers(0, 6)), st.just([])),
        ),
        max_size=40,
    )
)
def test_the_retired_set_kept_up_to_date_equals_its_definition(
    ops: list[tuple[str, object, list[int]]],
) -> None:
    """Blocks whose every tracked owner is in the last retired list, recomputed from scratch
    after every step, equal what ``Ownership`` keeps incrementally (forgetting included)."""
    own = Ownership(max_workflows=4)
    reference = ReferenceOwnership()
    retired_now: frozenset[str] = frozenset()
    for kind, arg, blocks in ops:
        if kind == "record":
            own.record(f"w{arg}", blocks)
            reference.record(f"w{arg}", blocks)
        else:
            assert isinstance(arg, frozenset)
            retired_now = frozenset(f"w{i}" for i in arg)
        assert set(own.retired_blocks(retired_now)) == reference.retired(retired_now)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("record"), st.integers(0, 5), st.lists(st.integers(0, 12), max_size=6)
            ),
            st.tuples(st.just("retire"), st.frozensets(st.integers(0, 6)), st.integers(0, 4)),
            st.tuples(st.just("work"), st.just(0), st.integers(0, 4)),
        ),
        max_size=40,
    )
)
def test_a_lazy_recount_interleaved_with_records_ends_at_the_definition(
    ops: list[tuple[str, object, object]],
) -> None:
    """``retire`` recounts lazily while requests are recorded, workflows forgotten and newer
    lists arrive; whenever the newest recount has run out, and at the end, the retired set is
    the definition's, and every block that became retired was queued as fresh."""
    own = Ownership(max_workflows=4)
    reference = ReferenceOwnership()
    retired_now: frozenset[str] = frozenset()
    work: Iterator[None] = iter(())
    done = True
    end = object()
    fresh_seen: set[int] = set()

    def check() -> None:
        expected = reference.retired(retired_now)
        assert set(own.dead) == expected
        fresh_seen.update(own.fresh)
        own.fresh.clear()
        assert expected <= fresh_seen  # nothing retired without being queued

    for kind, arg, n in ops:
        if kind == "record":
            assert isinstance(n, list)
            own.record(f"w{arg}", n)
            reference.record(f"w{arg}", n)
            continue
        assert isinstance(n, int)
        if kind == "retire":
            assert isinstance(arg, frozenset)
            retired_now = frozenset(f"w{i}" for i in arg)
            work = own.retire(retired_now).work
            done = False
        for _ in range(n):
            if next(work, end) is end:
                done = True
                break
        if done:
            check()
    for _ in work:
        pass
    check()


def test_ownership_memory_is_bounded() -> None:
    own = Ownership(max_workflows=3)
    for i in range(10):
        own.record(f"w{i}", [i])
    assert own.workflows() == ["w7", "w8", "w9"]


# ---- the host tier's eviction order ------------------------------------------------------------


class ReferenceLRU:
    """vLLM's LRUCachePolicy order, written plainly: touched keys' tails get older ranks."""

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()
        self.pinned: set[int] = set()

    def insert(self, key: int) -> None:
        self.order[key] = None

    def touch(self, keys: list[int]) -> None:
        for key in reversed(keys):
            if key in self.order:
                self.order.move_to_end(key)

    def evict(self, n: int, protected: set[int]) -> list[int] | None:
        out = [k for k in self.order if k not in protected and k not in self.pinned][:n]
        if len(out) < n:
            return None
        for k in out:
            del self.order[k]
        return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_without_snapshot_the_order_is_exactly_lru(seed: int) -> None:
    """Differential: HostOrder with no snapshot == a reference LRU, on a random op sequence."""
    rng = random.Random(seed)
    order: HostOrder[int] = HostOrder(lambda k: k)
    ref = ReferenceLRU()
    next_key = 0
    for _ in range(200):
        op = rng.random()
        if op < 0.4:
            order.insert(next_key, evictable=True)
            ref.insert(next_key)
            next_key += 1
        elif op < 0.6 and ref.order:
            keys = rng.sample(list(ref.order), min(len(ref.order), rng.randint(1, 4)))
            order.touch(keys)
            ref.touch(keys)
        elif op < 0.7 and ref.order:
            key = rng.choice(list(ref.order))
            if key in ref.pinned:
                ref.pinned.discard(key)
                order.mark_evictable(key)
            else:
                ref.pinned.add(key)
                order.mark_non_evictable(key)
        else:
            n = rng.randint(0, 3)
            protected = set(rng.sample(list(ref.order), min(2, len(ref.order))))
            assert order.evict(n, protected) == ref.evict(n, protected)
        assert len(order) == len(ref.order)


def test_snapshot_order_retired_first_then_score_then_recency() -> None:
    order: HostOrder[int] = HostOrder(lambda k: k)
    for key in range(6):
        order.insert(key, evictable=True)
    view = SnapshotView.of(
        snap(scores=(ScoredBlocks(5.0, (0, 1)), ScoredBlocks(-1.0, (4,))), stage=(2,))
    )
    order.set_view(view, retired=frozenset({5}))
    order.rekey_all()
    # retired 5; then scored below default 0.0: 4; then unscored by recency 3; then 0,1 (5.0);
    # the staged block 2 goes last
    assert order.peek_order() == [5, 4, 3, 0, 1, 2]
    assert order.evict(2, protected={5}) == [4, 3]
    order.set_view(None)
    order.rekey_all()
    assert order.peek_order() == [0, 1, 2, 5]  # stale snapshot: plain LRU again


def test_a_view_without_a_host_order_is_lru_at_once_before_any_rekeying() -> None:
    """The guard publishes vLLM's default (or a write filter alone) after a learned order, or
    the snapshot goes stale: the tier is LRU from that moment, not once the walk has re-keyed
    the keys that still carry the learned scores."""
    for plain in (SnapshotView.of(snap()), None):
        order: HostOrder[int] = HostOrder(lambda k: k)
        for key in range(6):
            order.insert(key, evictable=True)
        learned = SnapshotView.of(snap(scores=(ScoredBlocks(5.0, (0, 1, 2)),)))
        order.set_view(learned, retired=frozenset({4}))
        order.rekey_all()
        assert order.peek_order() == [4, 3, 5, 0, 1, 2]
        order.insert(6, evictable=True)  # written under the learned view, unnamed: score 0
        order.set_view(plain)
        assert order.rekeying  # the walk has not started: every key keeps its learned priority
        assert order.peek_order() == [0, 1, 2, 3, 4, 5, 6]
        assert order.evict(3, protected={1}) == [0, 2, 3]
        order.rekey_all()
        assert order.evict(4) == [1, 4, 5, 6]


def test_a_snapshot_with_its_own_host_order_orders_the_host_tier_by_it() -> None:
    order: HostOrder[int] = HostOrder(lambda k: k)
    for key in range(4):
        order.insert(key, evictable=True)
    gpu = (ScoredBlocks(1.0, (0,)), ScoredBlocks(3.0, (1,)), ScoredBlocks(2.0, (2, 3)))
    order.set_view(SnapshotView.of(snap(scores=gpu)))
    order.rekey_all()
    assert order.peek_order() == [0, 2, 3, 1]  # no host order given: the GPU's
    host = (ScoredBlocks(5.0, (0,)), ScoredBlocks(-1.0, (1,)))  # 2, 3 unnamed: default 0.0
    view = SnapshotView.of(snap(scores=gpu, host_scores=host))
    assert view.score(0) == 1.0 and view.host_score(0) == 5.0 and view.host_score(2) == 0.0
    order.set_view(view)
    order.rekey_all()
    assert order.peek_order() == [1, 2, 3, 0]
    assert order.evict(1) == [1]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_budgeted_rekey_walk_keeps_evictions_in_priority_order(seed: int) -> None:
    """Snapshots arrive while inserts, touches, pins and evictions go on, and the re-keying
    walk advances a few units at a time: every eviction takes the keys with the lowest priority
    each key has now, and once the walk is done every key has its priority under the newest
    view (the heap machinery - two heaps, stale entries, the swap, the freed old heap - against
    the plain definition)."""
    rng = random.Random(seed)
    order: HostOrder[int] = HostOrder(lambda k: k)
    live: set[int] = set()
    for step in range(300):
        op = rng.random()
        if op < 0.35:
            key = rng.randrange(60)
            order.insert(key, evictable=rng.random() < 0.9)
            live.add(key)
        elif op < 0.5 and live:
            order.touch(rng.sample(sorted(live), min(len(live), 3)))
        elif op < 0.6 and live:
            key = rng.choice(sorted(live))
            (order.mark_evictable if rng.random() < 0.5 else order.mark_non_evictable)(key)
        elif op < 0.7:
            named = rng.sample(range(60), 12)
            groups = tuple(ScoredBlocks(rng.uniform(-2, 2), (b,)) for b in named)
            view = SnapshotView.of(snap(scores=groups, stage=(rng.randrange(60),)))
            pick = rng.random()
            plain = SnapshotView.of(snap())  # vLLM's default: no host order
            order.set_view(
                view if pick < 0.7 else plain if pick < 0.85 else None,
                set(rng.sample(range(60), 5)) if pick < 0.7 else frozenset(),
            )
        elif op < 0.85:
            order.rekey(rng.randint(1, 3))
        else:
            n = rng.randint(1, 3)
            protected = set(rng.sample(range(60), 3))
            expected = [k for k in order.peek_order() if k not in protected]
            got = order.evict(n, protected)
            assert got == (expected[:n] if len(expected) >= n else None), step
            live -= set(got or ())
    order.rekey_all()
    evictable = order.peek_order()
    assert evictable == sorted(evictable, key=order._priority)
    assert not order.rekeying


def _held_state(order: HostOrder[int]) -> tuple[object, ...]:
    return (
        order._rank,
        order._prio,
        order._slots,
        order._slot_of,
        order._free_slots,
        order._heap,
        order._next_heap,
        order._next_rank,
    )


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_insert_many_and_remove_many_are_the_calls_one_key_at_a_time(
    seed: int, rekeyed: bool
) -> None:
    """The batched calls the simulator's host tier makes (a request's blocks at once) leave
    the order exactly as ``insert``/``touch`` and ``remove`` key by key: the same ranks, slots
    and heap entries, so the same evictions - under views, walks, compactions in progress and
    (``rekeyed`` False: nobody runs ``rekey``) the compaction done at once."""
    rng = random.Random(seed)
    batched: HostOrder[int] = HostOrder(lambda k: k)
    single: HostOrder[int] = HostOrder(lambda k: k)
    space = 80 if rekeyed else 24  # few keys touched often: stale entries pile up
    for step in range(600):
        op = rng.random()
        if op < 0.45:
            keys = [rng.randrange(space) for _ in range(rng.randint(1, 20))]
            batched.insert_many(keys)
            for key in keys:
                if key in single:
                    single.touch([key])
                else:
                    single.insert(key, evictable=True)
        elif op < 0.55:
            keys = [rng.randrange(space) for _ in range(rng.randint(1, 6))]
            batched.remove_many(keys)
            for key in keys:
                single.remove(key)
        elif op < 0.6:
            key = rng.randrange(space)
            for order in (batched, single):
                order.mark_non_evictable(key)
        elif op < 0.62:
            named = rng.sample(range(space), 12)
            groups = tuple(ScoredBlocks(rng.uniform(-2, 2), (b,)) for b in named)
            pick = rng.random()
            view = SnapshotView.of(snap(scores=groups, stage=(rng.randrange(space),)))
            chosen = view if pick < 0.6 else SnapshotView.of(snap()) if pick < 0.8 else None
            retired = set(rng.sample(range(space), 5)) if pick < 0.6 else frozenset()
            for order in (batched, single):
                order.set_view(chosen, retired)
        elif op < 0.85:
            if rekeyed:
                units = rng.randint(1, 4)
                assert batched.rekey(units) == single.rekey(units)
        elif op < 0.9 or rekeyed:
            n = rng.randint(1, 3)
            protected = set(rng.sample(range(space), 3))
            assert batched.evict(n, protected) == single.evict(n, protected), step
        assert _held_state(batched) == _held_state(single), step


def test_a_compacted_heap_goes_to_release_and_the_order_is_unchanged() -> None:
    """Touches leave stale heap entries; the compaction that drops them hands the replaced
    heap to ``release`` (the connector frees it off vLLM's thread), costing no unit for it."""
    order: HostOrder[int] = HostOrder(lambda k: k)
    released: list[int] = []
    order.release = lambda heap: released.append(len(heap))
    for key in range(50):
        order.insert(key, evictable=True)
    for _ in range(6):
        order.touch(range(50))
    before = order.peek_order()
    assert order.rekeying  # 350 entries for 50 keys: a compaction is due
    used = order.rekey(None)
    assert used == 25  # two keys a unit, nothing for the freeing
    # the heap was replaced and handed over
    assert released == [350] and order.peek_order() == before and not order.rekeying


def test_evict_is_atomic() -> None:
    order: HostOrder[int] = HostOrder(lambda k: k)
    for key in range(3):
        order.insert(key, evictable=True)
    order.mark_non_evictable(1)
    assert order.evict(3) is None
    assert order.peek_order() == [0, 2]
    assert order.evict(2) == [0, 2]


# ---- the copy plan -----------------------------------------------------------------------------


@given(st.integers(1, 4), st.lists(st.integers(0, 9), min_size=1, max_size=3), st.data())
def test_copy_plan_rows_are_the_chunks_sub_blocks(
    bpc: int, sizes: list[int], data: st.DataObject
) -> None:
    firsts = [data.draw(st.integers(0, 20)) for _ in sizes]
    n_chunks = [
        0 if s == 0 else -(-(s + f % bpc) // bpc) for s, f in zip(sizes, firsts, strict=True)
    ]
    host = list(range(100, 100 + sum(n_chunks)))
    gpu = list(range(sum(sizes)))
    plans = plan_rows(gpu, host, sizes, firsts, bpc)
    assert [len(g) for g, _ in plans] == sizes
    off = 0
    for (g, h), f, n in zip(plans, firsts, n_chunks, strict=True):
        assert len(g) == len(h)
        if len(h):
            assert h[0] == host[off] * bpc + f % bpc  # skipped the first chunk's leading rows
            assert np.all(np.diff(h) == 1)  # consecutive blocks fill consecutive rows
        off += n


def test_copy_plan_rejects_inconsistent_specs() -> None:
    with pytest.raises(ValueError, match="groups add up"):
        plan_rows([1, 2], [1], [3], [0], 1)
    with pytest.raises(ValueError, match="host chunks"):
        plan_rows([1, 2], [1], [2], [0], 1)


# ---- the runtime against a real client and an in-test daemon peer ------------------------------


@pytest.fixture
def peer() -> Iterator[Sockets]:
    with daemon_peer() as sockets:
        yield sockets


def drain(pull: zmq.Socket[bytes], want: int, timeout_s: float = 10.0) -> list[Event]:
    out: list[Event] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        if pull.poll(100):
            out.extend(BATCH_CODEC.decode(pull.recv()).events)
    return out


def digests(*ids: int) -> list[bytes]:
    return [i.to_bytes(8, "big") + bytes(24) for i in ids]


def publish_until(
    pub: zmq.Socket[bytes], snapshot: PolicySnapshot, cond: Callable[[], bool]
) -> None:
    frame = SNAPSHOT_CODEC.encode(snapshot)
    assert wait_for(lambda: pub.send_multipart([SNAPSHOT_TOPIC, frame]) is None and cond())


def test_runtime_streams_a_request_lifecycle(
    peer: tuple[zmq.Socket[bytes], zmq.Socket[bytes], Endpoints],
) -> None:
    pull, _, endpoints = peer
    with DaemonClient("t", endpoints) as client:
        rt = ConnectorRuntime(client, client.snapshot, tokens_per_block=32)
        params = {"workflow_id": "w1", "agent": "planner", "workflow_done": True}
        rt.request_started("r1", params, None, digests(1, 2, 3), prompt_tokens=100)
        rt.lookup_done("r1", gpu_tokens=0, host_tokens=0)  # the request waits: looked up again
        rt.lookup_done("r1", gpu_tokens=32, host_tokens=32)
        rt.allocated("r1")  # reported once, with the lookup that got it its blocks
        rt.lookup_done("r1", gpu_tokens=0, host_tokens=0)
        rt.allocated("r1")
        rt.host_stored(digests(3))
        rt.request_finished("r1", output_tokens=4)
        got = drain(pull, 6)
    kinds = [type(e) for e in got]
    assert kinds == [RequestStarted, PrefixHit, BlocksStored, BlocksStored, RequestFinished,
                     WorkflowFinished]  # fmt: skip
    started, hit = got[0], got[1]
    assert isinstance(started, RequestStarted) and started.block_hashes == (1, 2, 3)
    assert (started.workflow_id, started.agent) == ("w1", "planner")
    assert isinstance(hit, PrefixHit)
    assert (hit.gpu_blocks, hit.host_blocks, hit.recomputed_blocks) == (1, 1, 1)
    gpu_stored = got[3]
    assert isinstance(gpu_stored, BlocksStored) and gpu_stored.tier == "gpu"


def test_runtime_applies_the_snapshot_and_falls_back_when_stale(
    peer: tuple[zmq.Socket[bytes], zmq.Socket[bytes], Endpoints],
) -> None:
    _, pub, endpoints = peer
    now = [0.0]
    with DaemonClient("t", endpoints, clock=lambda: now[0]) as client:
        rt = ConnectorRuntime(client, client.snapshot, tokens_per_block=32)
        rt.request_started("old", {"workflow_id": "done"}, None, digests(7, 8), 64)
        rt.request_started("new", {"workflow_id": "live"}, None, digests(7, 9, 10, 11), 128)
        s = snap(
            retired_workflows=("done",),
            write_filter=WriteFilter(mode="fixed", max_new_blocks=2),
            pin=(9, 10),
        )
        publish_until(pub, s, lambda: client.snapshot() is not None)
        rt.lookup_done("new", gpu_tokens=0, host_tokens=0)  # 4 new blocks > 2: declined
        assert rt.may_store("new") is False
        assert rt.may_store("unknown-request") is True
        assert rt.retired_blocks == set()  # recounted later, as the GPU plan's first work
        for _ in rt.retirement.work:
            pass
        assert rt.retired_blocks == {8}  # 7 is shared with a live workflow
        assert list(select_pins(rt.view, rt.retired_blocks, 1)) == [9]  # capped at one
        generation = rt.generation
        now[0] = 100.0  # the snapshot is now older than its ttl: LRU, store everything
        assert rt.refresh() is None
        assert rt.generation == generation + 1
        assert rt.retired_blocks == frozenset()


def test_runtime_without_daemon_never_blocks_and_stores_everything() -> None:
    unreachable = Endpoints(events="tcp://127.0.0.1:1", snapshots="tcp://127.0.0.1:2")
    with DaemonClient("t", unreachable, queue_max_events=8) as client:
        rt = ConnectorRuntime(client, client.snapshot, tokens_per_block=32)
        t0 = time.monotonic()
        for i in range(200):
            rt.request_started(f"r{i}", {"workflow_id": "w"}, None, digests(i), 32)
            rt.lookup_done(f"r{i}", 0, 0)
            assert rt.may_store(f"r{i}")
        elapsed_s = time.monotonic() - t0
        assert client.stats()["dropped_events"] > 0
    assert elapsed_s < 30  # generous: it must not wait on the daemon at all


def test_guard_turns_exceptions_into_defaults() -> None:
    guard = Guard()

    def boom() -> int:
        raise RuntimeError("daemon sent garbage")

    assert guard.call("x", boom, 7) == 7
    assert guard.call("x", lambda: 3, 7) == 3
    assert guard.errors == {"x": 1}


def test_queued_hooks_run_first_in_the_next_call_in_order_each_guarded() -> None:
    guard, seen = Guard(), []

    def boom() -> None:
        raise RuntimeError("bad request")

    guard.later("started", lambda: seen.append("started"))
    guard.later("broken", boom)
    guard.later("allocated", lambda: seen.append("allocated"))
    assert seen == []  # queued, not run

    def lookup() -> int:
        seen.append("lookup")
        return 5

    assert guard.call("lookup", lookup, 0) == 5
    assert seen == ["started", "allocated", "lookup"]  # the failure lost only itself
    assert guard.errors == {"broken": 1}
    assert guard.queued_by_hook == {"started": 1, "broken": 1, "allocated": 1}
    assert guard.calls_by_hook == {"lookup": 1}  # one timed call
    guard.drain()  # nothing queued: no call
    assert guard.calls_by_hook == {"lookup": 1}
    guard.later("allocated", lambda: seen.append("allocated"))
    guard.drain()
    assert seen[-1] == "allocated" and guard.calls_by_hook["queued"] == 1
    for _ in range(MAX_QUEUED_HOOKS):  # never an unbounded queue
        guard.later("allocated", lambda: None)
    assert guard.calls_by_hook["queued"] == 2


def test_host_removed_event_names_the_tier(
    peer: tuple[zmq.Socket[bytes], zmq.Socket[bytes], Endpoints],
) -> None:
    pull, _, endpoints = peer
    with DaemonClient("t", endpoints) as client:
        rt = ConnectorRuntime(client, client.snapshot, tokens_per_block=32)
        rt.host_removed(digests(1, 2))
        rt.gpu_removed([3])
        got = drain(pull, 2)
    assert [(e.tier, e.block_hashes) for e in got if isinstance(e, BlocksRemoved)] == [
        ("host", (1, 2)),
        ("gpu", (3,)),
    ]


@pytest.mark.parametrize(
    "module", ["connector.params", "connector.events", "policyd.tiers.view", "connector.copy_plan"]
)
def test_docstring_examples(module: str) -> None:
    import doctest  # noqa: PLC0415
    import importlib  # noqa: PLC0415

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0
