"""Applying the daemon's newest policy snapshot inside the connector (DESIGN.md §3, §6).

A ``PolicySnapshot`` is compiled once into a ``SnapshotView`` (dict and set lookups), so that
every per-block question vLLM's hot paths ask - score, retired?, staged?, pin? - costs O(1).
``None`` stands for "no fresh snapshot": the connector then behaves exactly like vLLM's default,
LRU eviction and store-everything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
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

    def ranked(self, excluded: frozenset[int] = frozenset()) -> Iterator[int]:
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
    """EfficientAgent's write filter, decided once per request (DESIGN.md §2).

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
    retired: frozenset[int],
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
    lifecycle rule. Memory is bounded by forgetting the oldest workflows first. Each block's
    number of owners is kept, so the retired blocks cost O(blocks of the retired workflows).
    """

    def __init__(self, max_workflows: int = MAX_TRACKED_WORKFLOWS) -> None:
        self.max_workflows = max_workflows
        self._blocks: OrderedDict[str, set[int]] = OrderedDict()
        self._owners: dict[int, int] = {}

    def record(self, workflow_id: str, blocks: Iterable[int]) -> None:
        owned = self._blocks.get(workflow_id)
        if owned is None:
            owned = self._blocks[workflow_id] = set()
            while len(self._blocks) > self.max_workflows:
                self._forget(self._blocks.popitem(last=False)[1])
        else:
            self._blocks.move_to_end(workflow_id)
        owners = self._owners
        for block in blocks:
            if block not in owned:
                owned.add(block)
                owners[block] = owners.get(block, 0) + 1

    def _forget(self, blocks: set[int]) -> None:
        owners = self._owners
        for block in blocks:
            left = owners[block] - 1
            if left:
                owners[block] = left
            else:
                del owners[block]

    def workflows(self) -> list[str]:
        return list(self._blocks)

    def retired_blocks(self, retired_workflows: frozenset[str]) -> frozenset[int]:
        """Blocks owned only by retired workflows (run once per snapshot)."""
        retired_owners: dict[int, int] = {}
        for workflow_id in retired_workflows:
            for block in self._blocks.get(workflow_id, ()):
                retired_owners[block] = retired_owners.get(block, 0) + 1
        owners = self._owners
        return frozenset(b for b, n in retired_owners.items() if n == owners[b])


def ordered_unique(blocks: Sequence[int]) -> list[int]:
    return list(dict.fromkeys(blocks))
