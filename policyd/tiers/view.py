"""Applying the daemon's newest policy snapshot inside the connector.

A ``PolicySnapshot`` is compiled once into a ``SnapshotView`` (dict and set lookups), so that
every per-block question vLLM's hot paths ask - score, retired?, staged?, pin? - costs O(1).
``None`` stands for "no fresh snapshot": the connector then behaves exactly like vLLM's default,
LRU eviction and store-everything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Final

from policyd.types import PolicySnapshot, ScoredBlocks, WriteFilter, score_map

MAX_TRACKED_WORKFLOWS: Final = 4096  # ownership memory: the oldest workflows are forgotten


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
    groups: tuple[ScoredBlocks, ...] = ()  # the GPU order's groups, highest score first

    @classmethod
    def of(cls, snap: PolicySnapshot) -> SnapshotView:
        scores = score_map(snap.scores)
        host_scores = scores if snap.host_scores is None else score_map(snap.host_scores)
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
            groups=tuple(sorted(snap.scores, key=lambda g: -g.score)),
        )

    def score(self, block: int) -> float:
        """Lower = evict first; blocks the snapshot does not name get ``default_score``."""
        return self.scores.get(block, self.default_score)

    def ranked(self, excluded: AbstractSet[int] = frozenset()) -> Iterator[int]:
        """The blocks scored above ``default_score``, highest first (a group's blocks in its
        order), each once at its own score, none in ``excluded``; lazily, so a caller that
        stops early pays for what it took (sorting the groups was done in ``of``)."""
        scores, floor = self.scores, self.default_score
        seen: set[int] = set()
        for group in self.groups:
            if group.score <= floor:
                return
            for block in group.block_hashes:
                if scores[block] == group.score and block not in excluded and block not in seen:
                    seen.add(block)
                    yield block

    def host_score(self, block: int) -> float:
        """The same for the host tier, in the snapshot's host order when it gives one."""
        return self.host_scores.get(block, self.default_score)


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
    for block in (*view.pin, *then):
        if block in retired or block in seen:
            continue
        seen.add(block)
        yield block
        if len(seen) >= cap_blocks:
            return


class Ownership:
    """Which workflows' requests used which blocks, as seen by this connector.

    A block is *retired* when every workflow that used it is retired (finished): PBKV's
    lifecycle rule. Memory is bounded by forgetting the oldest workflows first. The retired set
    is kept up to date as requests are recorded and workflows retire, so a new snapshot costs
    O(blocks of the workflows it newly retires), not O(every block seen).
    """

    def __init__(self, max_workflows: int = MAX_TRACKED_WORKFLOWS) -> None:
        self.max_workflows = max_workflows
        self._blocks: OrderedDict[str, set[int]] = OrderedDict()
        self._owners: dict[int, int] = {}  # block -> tracked workflows that used it
        self._retired_owners: dict[int, int] = {}  # block -> how many of those are retired
        self._retired_workflows: set[str] = set()
        self._dead: set[int] = set()  # blocks whose every owner is retired

    def record(self, workflow_id: str, blocks: Iterable[int]) -> None:
        owned = self._blocks.get(workflow_id)
        if owned is None:
            owned = self._blocks[workflow_id] = set()
            while len(self._blocks) > self.max_workflows:
                self._forget(*self._blocks.popitem(last=False))
        else:
            self._blocks.move_to_end(workflow_id)
        owners = self._owners
        retired = workflow_id in self._retired_workflows
        for block in blocks:
            if block not in owned:
                owned.add(block)
                owners[block] = owners.get(block, 0) + 1
                if retired:
                    self._retired_owners[block] = self._retired_owners.get(block, 0) + 1
                self._settle(block)

    def _settle(self, block: int) -> None:
        n = self._owners.get(block, 0)
        if n and self._retired_owners.get(block, 0) == n:
            self._dead.add(block)
        else:
            self._dead.discard(block)

    def _count_retired(self, blocks: Iterable[int], step: int) -> None:
        counts = self._retired_owners
        for block in blocks:
            left = counts.get(block, 0) + step
            if left:
                counts[block] = left
            else:
                counts.pop(block, None)
            self._settle(block)

    def _forget(self, workflow_id: str, blocks: set[int]) -> None:
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
        return list(self._blocks)

    def retired_blocks(self, retired_workflows: AbstractSet[str]) -> AbstractSet[int]:
        """Blocks owned only by retired workflows, once ``retired_workflows`` are the retired
        ones (a snapshot's list). A live view: it follows later ``record`` calls (a block a
        live workflow uses again leaves it); copy it to iterate while recording."""
        tracked = {w for w in retired_workflows if w in self._blocks}
        for workflow_id in tracked - self._retired_workflows:
            self._retired_workflows.add(workflow_id)
            self._count_retired(self._blocks[workflow_id], +1)
        for workflow_id in self._retired_workflows - tracked:
            self._retired_workflows.discard(workflow_id)
            self._count_retired(self._blocks[workflow_id], -1)
        return self._dead


def ordered_unique(blocks: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(blocks))
