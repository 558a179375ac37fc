"""Rankings of the live prompts: their values, and the block groups a snapshot publishes.

A ranking (``Values``) values each live workflow's agents' *private* prompts (the agent's
latest prompt in the workflow past its shared prefix, keyed ``(workflow, agent)``) and each
agent's *shared* prefix (its system prompt, keyed by agent). Higher is kept longer; a prompt a
ranking leaves out scores 0, below every prompt it names and above retired blocks. The groups
these make are disjoint by construction (a private tail never holds its agent's prefix), but
two workflows' prompts may share blocks: ``disjoint`` says each block once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import chain
from typing import NamedTuple, TypeVar, overload

from policyd.core.state import EngineState
from policyd.core.types import ScoredBlocks, score_map
from policyd.policies.lifecycle import RETIRED_SCORE, Lifecycle, RetiredMark

Key = tuple[str, str]  # (workflow, agent): one agent's private prompt in one workflow
_K = TypeVar("_K")


class Values(NamedTuple):
    """One ranking: a value per private prompt and per shared prefix."""

    private: dict[Key, float]
    shared: dict[str, float]


def added(a: Mapping[_K, float], b: Mapping[_K, float]) -> dict[_K, float]:
    """The keys of both, each valued by the sum of its values (a missing one counts 0); ``a``'s
    keys first, in its order.

    >>> added({"x": 1.0, "y": 2.0}, {"y": 0.5, "z": 3.0})
    {'x': 1.0, 'y': 2.5, 'z': 3.0}
    """
    out = dict(a)
    for key, value in b.items():
        out[key] = out.get(key, 0.0) + value
    return out


def summed(a: Values, b: Values) -> Values:
    """The ranking valuing every prompt by the sum of what ``a`` and ``b`` give it."""
    return Values(added(a.private, b.private), added(a.shared, b.shared))


def to_groups(values: Values, state: EngineState) -> list[ScoredBlocks]:
    """The blocks ``values`` ranks, as groups: each private prompt's tail past its agent's
    prefix (the private prompts first, in ``values``' order), then each shared prefix. A prompt
    no live workflow holds, or an empty one, makes no group."""
    private, shared = values
    prefixes = state.agent_prefix
    workflows = state.workflows
    groups: list[ScoredBlocks] = []
    for (wid, agent), score in private.items():
        wf = workflows.get(wid)
        blocks = None if wf is None else wf.agent_blocks.get(agent)
        if blocks is not None:
            tail = blocks[len(prefixes.get(agent, ())) :]
            if tail:
                groups.append(ScoredBlocks(score, tail))
    for agent, score in shared.items():
        prefix = prefixes.get(agent)
        if prefix:
            groups.append(ScoredBlocks(score, prefix))
    return groups


class Ranked:
    """A snapshot's order: its live groups (each block once) and every block's score
    (``scores``: the groups', ``RETIRED_SCORE`` for the retired blocks no group names).

    ``groups`` is said once only when asked (``published``): most snapshots are not
    published as they are computed (the guard publishes another arm), and only a published
    one needs its blocks said once, an O(blocks) walk where prompts share blocks."""

    __slots__ = ("_groups", "_once", "scores")

    def __init__(self, groups: tuple[ScoredBlocks, ...], scores: ScoreMap, *, once: bool) -> None:
        self._groups = groups
        self._once = once  # each block is in one group already
        self.scores = scores

    @property
    def groups(self) -> tuple[ScoredBlocks, ...]:
        if not self._once:
            self._groups, self._once = _said_once(self._groups), True
        return self._groups

    def published(self, lifecycle: Lifecycle) -> tuple[ScoredBlocks, ...]:
        """The order as a snapshot says it: the groups, then the retired blocks no group names
        (``lifecycle.group``, which can hold every block a tier keeps: built only for a
        snapshot that is published, when it is taken)."""
        groups = self.groups
        retired = lifecycle.group(groups)
        return groups if retired is None else (*groups, retired)


def disjoint(groups: Sequence[ScoredBlocks], retired: RetiredMark) -> Ranked:
    """``groups`` with each block said once, and every block's score: a block in two groups
    (prompts sharing blocks across workflows) takes the later group's score, as a tier applying
    the groups in order would; a block ``retired`` (a lifecycle's mark, taken now) that no
    group names ``RETIRED_SCORE``.

    >>> lifecycle = Lifecycle()
    >>> lifecycle.retired = {9, 2}
    >>> ranked = disjoint([ScoredBlocks(1.0, (1, 2)), ScoredBlocks(2.0, (2, 3))], lifecycle.mark())
    >>> ranked.published(lifecycle)
    (ScoredBlocks(score=1.0, block_hashes=(1,)), ScoredBlocks(score=2.0, block_hashes=(2, 3)), \
ScoredBlocks(score=-1.0, block_hashes=(9,)))
    >>> ranked.scores[2], ranked.scores[9], ranked.scores.get(4, 0.0), sorted(ranked.scores)
    (2.0, -1.0, 0.0, [1, 2, 3, 9])
    """
    live = score_map(groups)
    once = len(live) == sum(len(g.block_hashes) for g in groups)
    return Ranked(tuple(groups), ScoreMap(live, retired), once=once)


def _said_once(groups: tuple[ScoredBlocks, ...]) -> tuple[ScoredBlocks, ...]:
    """``groups`` with each block in the last group naming it, at its first place there
    (groups left empty dropped)."""
    claimed: set[int] = set()
    unique: list[ScoredBlocks] = []
    for group in reversed(groups):
        blocks = tuple(b for b in dict.fromkeys(group.block_hashes) if b not in claimed)
        claimed.update(blocks)
        if blocks:
            unique.append(ScoredBlocks(group.score, blocks))
    return tuple(reversed(unique))


_D = TypeVar("_D")


class ScoreMap(Mapping[int, float]):
    """A snapshot's scores, looked up: the live groups' (``live``, a ``score_map``), and
    ``RETIRED_SCORE`` for a block retired at the snapshot (``retired``, a lifecycle's mark)
    that no group names. The same answers as one dict of every block, for as long as it is
    held (a tier may keep a view past the next snapshot), without building one over the
    retired blocks per snapshot: they outnumber the live ones where workflows are short, and
    building, collecting and freeing that dict was most of a snapshot's cost."""

    __slots__ = ("_mark", "live")

    def __init__(self, live: dict[int, float], retired: RetiredMark) -> None:
        self.live: Mapping[int, float] = live  # the live groups' scores (above RETIRED_SCORE)
        self._mark = retired

    @overload
    def get(self, key: int, /) -> float | None: ...
    @overload
    def get(self, key: int, default: float | _D, /) -> float | _D: ...
    def get(self, key: int, default: float | _D | None = None, /) -> float | _D | None:
        score = self.live.get(key)
        if score is not None:
            return score
        mark = self._mark  # ``RetiredMark.retired``, inlined
        was = mark.was.get(key)
        if key in mark.then if was is None else was:
            return RETIRED_SCORE
        return default

    def __getitem__(self, key: int) -> float:
        score = self.get(key)
        if score is None:
            raise KeyError(key)
        return score

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.get(key) is not None

    def __iter__(self) -> Iterator[int]:
        """Every block it scores (a walk over the retired blocks: for tests and tools)."""
        live = self.live
        return chain(live, (b for b in self._mark.blocks() if b not in live))

    def __len__(self) -> int:
        """A walk, as ``__iter__``: the hot paths only look scores up."""
        return sum(1 for _ in self)

    def __bool__(self) -> bool:
        """Whether it scores any block, without the walk ``__len__`` takes (a tier asks this
        of every view it adopts)."""
        return bool(self.live) or self._mark.any_retired()
