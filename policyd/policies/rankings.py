"""Rankings of the live prompts: their values, and the block groups a snapshot publishes.

A ranking (``Values``) values each live workflow's agents' *private* prompts (the agent's
latest prompt in the workflow past its shared prefix, keyed ``(workflow, agent)``) and each
agent's *shared* prefix (its system prompt, keyed by agent). Higher is kept longer; a prompt a
ranking leaves out scores 0, below every prompt it names and above retired blocks. The groups
these make are disjoint by construction (a private tail never holds its agent's prefix), but
two workflows' prompts may share blocks: ``disjoint`` says each block once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, TypeVar

from policyd.core.state import EngineState
from policyd.core.types import ScoredBlocks, score_map

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


def disjoint(
    groups: Sequence[ScoredBlocks],
) -> tuple[tuple[ScoredBlocks, ...], dict[int, float]]:
    """``groups`` with each block said once, and every block's score. A block in two groups
    (prompts sharing blocks across workflows, a retired block still in a live agent's prompt)
    takes the later group's score, as a tier applying the groups in order would.

    >>> disjoint([ScoredBlocks(1.0, (1, 2)), ScoredBlocks(2.0, (2, 3))])[0]
    (ScoredBlocks(score=1.0, block_hashes=(1,)), ScoredBlocks(score=2.0, block_hashes=(2, 3)))
    """
    scores = score_map(groups)
    if len(scores) == sum(len(g.block_hashes) for g in groups):
        return tuple(groups), scores
    claimed: set[int] = set()
    unique: list[ScoredBlocks] = []
    for group in reversed(groups):
        blocks = tuple(b for b in dict.fromkeys(group.block_hashes) if b not in claimed)
        claimed.update(blocks)
        if blocks:
            unique.append(ScoredBlocks(group.score, blocks))
    return tuple(reversed(unique)), scores
