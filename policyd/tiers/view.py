"""Applying the daemon's newest policy snapshot inside the connector.

A ``PolicySnapshot`` is compiled once into a ``SnapshotView`` (dict and set lookups), so that
every per-block question vLLM's hot paths ask - score, retired?, staged?, pin? - costs O(1).
``None`` stands for "no fresh snapshot": the connector then behaves exactly like vLLM's default,
LRU eviction and store-everything.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from itertools import chain, count, filterfalse, repeat
from operator import add
from typing import Final

from policyd.core.types import PolicySnapshot, ScoredBlocks, WriteFilter, score_map

DEFAULT_TOP_BLOCKS: Final = 8192  # ranked blocks a view lists for the GPU plan
MAX_TRACKED_WORKFLOWS: Final = 4096  # ownership memory: the oldest workflows are forgotten
MAX_FRESH_RETIRED: Final = 65_536  # newly retired blocks queued for the GPU plan
RECOUNT_CHUNK: Final = 4  # blocks recounted per unit of a plan's budget (about one move's cost)


@dataclass(frozen=True, slots=True)
class SnapshotView:
    """One snapshot, indexed for O(1) questions."""

    version: int
    policy: str
    scores: Mapping[int, float]
    host_scores: Mapping[int, float]  # the host tier's order: ``scores`` unless the snapshot
    default_score: float  # gives its own (``PolicySnapshot.host_scores``)
    retired_workflows: frozenset[str]
    write_filter: WriteFilter
    pin: tuple[int, ...]
    stage: frozenset[int]
    top: tuple[int, ...] = ()  # the blocks scored above ``default_score``, highest first

    @classmethod
    def of(cls, snap: PolicySnapshot, top_blocks: int = DEFAULT_TOP_BLOCKS) -> SnapshotView:
        """Index ``snap``; ``top_blocks``: how many of its highest-ranked blocks to list in
        ``top`` (at least the GPU plan's rank and pin caps). Runs on the connector's client
        thread, so the GPU plan on vLLM's thread starts from a ready ranking."""
        scores = score_map(snap.scores)
        host = snap.host_scores  # (one tuple for both tiers: one index)
        host_scores = scores if host is None or host is snap.scores else score_map(host)
        return cls(
            version=snap.version,
            policy=snap.policy,
            scores=scores,
            host_scores=host_scores,
            default_score=snap.default_score,
            retired_workflows=frozenset(snap.retired_workflows),
            write_filter=snap.write_filter,
            pin=snap.pin,
            stage=frozenset(snap.stage),
            top=_top(snap.scores, scores, snap.default_score, top_blocks),
        )

    def score(self, block: int) -> float:
        """Lower = evict first; blocks the snapshot does not name get ``default_score``."""
        return self.scores.get(block, self.default_score)

    def host_score(self, block: int) -> float:
        """The same for the host tier, in the snapshot's host order when it gives one."""
        return self.host_scores.get(block, self.default_score)

    @property
    def orders_host(self) -> bool:
        """Whether the view gives the host tier an order (``HostOrder``: scores, staged or
        retired blocks); one that does not (vLLM's default, a write filter alone) keeps it LRU."""
        return bool(self.host_scores or self.stage or self.retired_workflows)


def _top(
    groups: Sequence[ScoredBlocks], scores: Mapping[int, float], floor: float, limit: int
) -> tuple[int, ...]:
    """Up to ``limit`` blocks scored above ``floor``, highest first (a group's blocks in its
    order), each once at its own score."""
    top: dict[int, None] = {}
    for group in sorted(groups, key=lambda g: -g.score):
        if group.score <= floor or len(top) >= limit:
            break
        for block in group.block_hashes:
            if scores[block] == group.score:
                top[block] = None
    return tuple(top)[:limit]


def write_allowed(view: SnapshotView | None, new_blocks: int, staged: bool = False) -> bool:
    """EfficientAgent's write filter, decided once per request.

    ``new_blocks`` is what the request would add to the host tier. No snapshot: store
    everything (vLLM's default). A request carrying a staged (predicted) block is always stored.

    >>> wf = WriteFilter(mode="conditioned", max_new_blocks=8, pressure=True)
    >>> snap = PolicySnapshot(version=1, ts=0.0, ttl_s=5.0, policy="agentkv", write_filter=wf)
    >>> write_allowed(SnapshotView.of(snap), 9), write_allowed(SnapshotView.of(snap), 8)
    (False, True)
    >>> write_allowed(None, 1000)
    True
    """
    if view is None or staged:
        return True
    wf = view.write_filter
    if wf.mode == "none":
        return True
    if wf.mode == "conditioned" and not wf.pressure:
        return True
    return new_blocks <= wf.max_new_blocks


def select_pins(
    view: SnapshotView | None,
    retired: AbstractSet[int],
    cap_blocks: int,
    then: Iterable[int] = (),
) -> Iterator[int]:
    """The blocks to pin on the GPU: the snapshot's list in its order, then ``then`` (the
    highest-ranked blocks), never a retired block, at most ``cap_blocks`` (pinned blocks are
    memory vLLM cannot allocate).

    >>> snap = PolicySnapshot(version=1, ts=0.0, ttl_s=5.0, policy="t", pin=(3, 1, 3))
    >>> list(select_pins(SnapshotView.of(snap), frozenset({1}), 3, then=[7, 3, 8]))
    [3, 7, 8]
    """
    if view is None or cap_blocks <= 0:
        return
    seen: set[int] = set()
    for block in chain(view.pin, then):  # lazily: ``then`` may list thousands
        if block in retired or block in seen:
            continue
        seen.add(block)
        yield block
        if len(seen) >= cap_blocks:
            return


@dataclass(slots=True)
class Retirement:
    """A retired set being brought up to date, for the GPU plan to consume lazily.

    ``blocks``: the retired blocks (a live set: it follows later recounts and records).
    ``work``: the recount still to do, one item per ``RECOUNT_CHUNK`` blocks (the plan performs
    it first, under its budget). ``fresh``: blocks that became retired and have not been handed
    to a plan yet (the plan pops them; a block in it may have left ``blocks`` since).
    """

    blocks: AbstractSet[int]
    work: Iterator[None]
    fresh: deque[int]

    @classmethod
    def settled(cls, blocks: AbstractSet[int]) -> Retirement:
        """A retired set with nothing to recount, every block fresh (tests, one-off plans)."""
        return cls(blocks, iter(()), deque(blocks))


class Ownership:
    """Which workflows' requests used which blocks, as seen by this connector.

    A block is *retired* when every workflow that used it is retired (finished): PBKV's
    lifecycle rule. Memory is bounded by forgetting the oldest workflows first. The retired set
    is kept up to date as requests are recorded and workflows retire; a new retired list is
    recounted lazily (``retire``), ``RECOUNT_CHUNK`` blocks at a time, so no single call on
    vLLM's thread pays for a whole workflow's blocks. Blocks that become retired are also
    queued in ``fresh`` (bounded), so the GPU plan walks only what changed, not the whole set.
    """

    def __init__(self, max_workflows: int = MAX_TRACKED_WORKFLOWS) -> None:
        self.max_workflows = max_workflows
        self._blocks: OrderedDict[str, set[int]] = OrderedDict()
        # each tracked workflow's place in ``_blocks`` (the order they were last seen in), so a
        # recount can take a list's workflows in that order without walking every tracked one
        self._seen: dict[str, int] = {}
        self._clock = count()
        self._owners: dict[int, int] = {}  # block -> tracked workflows that used it
        self._retired_owners: dict[int, int] = {}  # block -> how many of those are retired
        self._retired_workflows: set[str] = set()
        self._dead: set[int] = set()  # blocks whose every owner is retired
        self.fresh: deque[int] = deque(maxlen=MAX_FRESH_RETIRED)
        # the workflow whose blocks are being recounted: (id, its blocks then, done so far, +-1)
        self._recounting: tuple[str, tuple[int, ...], int, int] | None = None
        self._epoch = 0  # bumps at each ``retire``: an older recount stops
        self._listed: AbstractSet[str] = frozenset()  # the newest retired list
        # the connector records requests on its deferred-work thread while vLLM's thread
        # recounts: every mutation runs under this lock (readers of ``dead`` and ``fresh`` only
        # test membership and pop, which are atomic)
        self._lock = threading.Lock()

    def copy(self) -> Ownership:
        """An independent copy of what it knows now (a shadow forked from another's)."""
        new = Ownership(self.max_workflows)
        with self._lock:
            new._blocks = OrderedDict((w, set(b)) for w, b in self._blocks.items())
            new._seen = dict(self._seen)
            new._clock = count(max(self._seen.values(), default=-1) + 1)
            new._owners = dict(self._owners)
            new._retired_owners = dict(self._retired_owners)
            new._retired_workflows = set(self._retired_workflows)
            new._dead = set(self._dead)
            new.fresh = deque(self.fresh, maxlen=self.fresh.maxlen)
            new._recounting = self._recounting
            new._epoch = self._epoch
            new._listed = self._listed
        return new

    @property
    def dead(self) -> AbstractSet[int]:
        """The retired blocks now (a live set)."""
        return self._dead

    def record(self, workflow_id: str, blocks: Iterable[int]) -> None:
        """A request of ``workflow_id`` used ``blocks``. Thread-safe against the recount."""
        with self._lock:
            self._record(workflow_id, blocks)

    def _record(self, workflow_id: str, blocks: Iterable[int]) -> None:
        owned = self._blocks.get(workflow_id)
        self._seen[workflow_id] = next(self._clock)
        if owned is None:
            owned = self._blocks[workflow_id] = set()
            while len(self._blocks) > self.max_workflows:
                self._forget(*self._blocks.popitem(last=False))
            if workflow_id in self._listed:  # listed before its first request was seen
                self._retired_workflows.add(workflow_id)
        else:
            self._blocks.move_to_end(workflow_id)
        # in the request's order: a set's iteration order depends on its insertion order, and
        # the recount walks ``owned`` (and ``fresh`` is queued) in that order
        new = list(dict.fromkeys(filterfalse(owned.__contains__, blocks)))
        if not new:
            return
        owned.update(new)
        _add_one(self._owners, new)
        if workflow_id in self._retired_workflows:  # rare: listed before this request was seen
            _add_one(self._retired_owners, new)
            for block in new:
                self._settle(block)
        else:  # a block with an owner not retired is not retired
            self._dead.difference_update(new)

    def _settle(self, block: int) -> None:
        n = self._owners.get(block, 0)
        if n and self._retired_owners.get(block, 0) == n:
            if block not in self._dead:
                self._dead.add(block)
                self.fresh.append(block)
        else:
            self._dead.discard(block)

    def _count_retired(self, blocks: Iterable[int], step: int) -> None:
        """Add ``step`` retired owners to each block and settle it (``_settle``, inlined: the
        recount's inner loop)."""
        counts, owners, dead, fresh = self._retired_owners, self._owners, self._dead, self.fresh
        for block in blocks:
            left = counts.get(block, 0) + step
            if left:
                counts[block] = left
            else:
                counts.pop(block, None)
            n = owners.get(block, 0)
            if n and left == n:
                if block not in dead:
                    dead.add(block)
                    fresh.append(block)
            else:
                dead.discard(block)

    def _finish_recount(self) -> None:
        """Complete the recount in progress at once (its workflow is being forgotten)."""
        if self._recounting is not None:
            _, blocks, done, step = self._recounting
            self._recounting = None
            self._count_retired(blocks[done:], step)

    def _forget(self, workflow_id: str, blocks: set[int]) -> None:
        del self._seen[workflow_id]
        if self._recounting is not None and self._recounting[0] == workflow_id:
            self._finish_recount()
        if workflow_id in self._retired_workflows:
            self._retired_workflows.discard(workflow_id)
            self._count_retired(blocks, -1)
        owners = self._owners
        for block in blocks:
            left = owners[block] - 1
            if left:
                owners[block] = left
            else:
                del owners[block]
            self._settle(block)

    def workflows(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    def retire(self, retired_workflows: AbstractSet[str]) -> Retirement:
        """Make ``retired_workflows`` (a snapshot's list) the retired ones. The recount happens
        as the returned ``work`` is consumed, starting with what an earlier recount left
        unfinished, so the set is never left half-counted however often lists arrive."""
        with self._lock:
            self._epoch += 1
            self._listed = retired_workflows
        return Retirement(self._dead, self._recount(retired_workflows, self._epoch), self.fresh)

    def _recount(self, retired_workflows: AbstractSet[str], epoch: int) -> Iterator[None]:
        with self._lock:
            left = self._recounting
        if left is not None:  # left unfinished by the previous list
            workflow_id, blocks, done, step = left
            yield from self._recount_blocks(workflow_id, blocks, done, step, epoch)
            if epoch != self._epoch:
                return
        with self._lock:
            # in the order the workflows were last seen, not a set's: that order decides which
            # blocks a budgeted recount settles first, so it must not depend on string hashing
            seen, was = self._seen, self._retired_workflows
            tracked = {w for w in retired_workflows if w in seen}
            changes = [(w, +1) for w in sorted(tracked - was, key=seen.__getitem__)]
            changes += [(w, -1) for w in sorted(was - tracked, key=seen.__getitem__)]
        yield None
        for workflow_id, step in changes:
            with self._lock:
                if epoch != self._epoch:
                    return  # a newer list superseded this one
                owned = self._blocks.get(workflow_id)
                if owned is None or (workflow_id in self._retired_workflows) == (step > 0):
                    continue  # forgotten, or already counted meanwhile
                if step > 0:
                    self._retired_workflows.add(workflow_id)
                else:
                    self._retired_workflows.discard(workflow_id)
                blocks = tuple(owned)
            yield from self._recount_blocks(workflow_id, blocks, 0, step, epoch)

    def _recount_blocks(
        self, workflow_id: str, blocks: tuple[int, ...], start: int, step: int, epoch: int
    ) -> Iterator[None]:
        """Count ``blocks[start:]`` of one workflow, a chunk per item. ``_recounting`` always
        says what is left, so a newer list (or forgetting the workflow) can take over."""
        for done in range(start, len(blocks), RECOUNT_CHUNK):
            with self._lock:
                self._recounting = (workflow_id, blocks, done, step)
            yield None
            with self._lock:
                if epoch != self._epoch or self._recounting is None:
                    return  # a newer list continues it, or it was completed (forgotten)
                self._recounting = None
                self._count_retired(blocks[done : done + RECOUNT_CHUNK], step)

    def retired_blocks(self, retired_workflows: AbstractSet[str]) -> AbstractSet[int]:
        """``retire`` with the whole recount done now; the live retired set."""
        for _ in self.retire(retired_workflows).work:
            pass
        return self._dead


def _add_one(counts: dict[int, int], blocks: Sequence[int]) -> None:
    """Add one to each block's count (the blocks distinct), in C: no per-block bytecode."""
    counts.update(zip(blocks, map(add, map(counts.get, blocks, repeat(0)), repeat(1)), strict=True))


def ordered_unique(blocks: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(blocks))
