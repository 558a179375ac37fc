"""The host tier's own order (``PolicySnapshot.host_scores``), apart from the GPU's.

A host copy is used only after the GPU dropped its block, and the GPU keeps what its order ranks
highest: under the GPU's order the host tier would mostly duplicate the GPU. Its order instead:

* the sum of the steps and lookahead rankings (``rankings.summed``); in a *flat* type (one
  agent per workflow) the workflow's pace (``WorkflowPacing.pace``) takes the lookahead's place
  - there the lookahead is only a survival forecast, while the pace sets a host copy's reuse
  distance; the shared prefixes of flat types take ``steps`` alone;
* retired blocks lowest (``Lifecycle``);
* while the tier thrashes (EfficientAgent's pressure), a block already in the tier raised by
  the factor ``1 + RESIDENCY_BONUS`` over a newcomer of about the same value: replacing equals
  by equals would evict each copy just before its reuse.

The order of the last publication is kept (``published``): admission compares a write's value
with what it would displace in the same order (docs/RESULTS.md, *agentkv vs every policy* and
*The host tier ordered by pace*).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import filterfalse

from policyd.core.state import EngineState
from policyd.core.types import ScoredBlocks
from policyd.policies.lifecycle import RetiredMark
from policyd.policies.lookahead import Lookahead
from policyd.policies.pacing import WorkflowPacing
from policyd.policies.rankings import Ranked, Values, added, disjoint
from policyd.policies.steps import StepsRanking

RESIDENCY_BONUS = 0.2  # a resident copy's score is raised by this share while the tier thrashes


class HostOrder:
    """The host tier's ranking, its publication, and the value it gives one prompt."""

    def __init__(self, steps: StepsRanking, lookahead: Lookahead, pacing: WorkflowPacing) -> None:
        self.steps = steps
        self.lookahead = lookahead
        self.pacing = pacing
        self.published: Mapping[int, float] = {}  # block -> host score in the last snapshot

    def ranking(
        self, steps: Values, ahead: Values, both: Values, state: EngineState, *, host_tier: bool
    ) -> Values:
        """The host tier's ranking, given ``steps``, ``ahead`` and their sum ``both``:
        ``both`` itself (the same object) unless a host tier and a flat type are live; then
        steps plus, per workflow, its pace in a flat type and its lookahead in another."""
        if not host_tier:
            return both
        flat = self.steps.flat_types(steps.private, state)
        if not flat:
            return both
        workflows = state.workflows
        structured = self.steps.structured(ahead, state)
        private = added(steps.private, structured.private)
        for key in steps.private:
            if workflows[key[0]].workflow_type in flat:
                private[key] += self.pacing.pace(key[0])
        return Values(private, added(steps.shared, structured.shared))

    def publish(
        self,
        groups: Sequence[ScoredBlocks],
        state: EngineState,
        *,
        retired: RetiredMark,
        pressure: bool,
        ranked: Ranked | None = None,
    ) -> Ranked:
        """The ranking's ``groups`` as the snapshot's ``host_scores``: resident copies raised
        under ``pressure``, the blocks ``retired`` (a lifecycle's mark, taken now) that no group
        names lowest, each block said once; its scores kept as ``published``. ``ranked``:
        ``disjoint(groups, retired)`` when the caller has it (the GPU's order is the same
        groups), taken as it is unless ``pressure`` re-orders the groups."""
        if pressure:
            ranked = disjoint(self._resident_first(groups, state), retired)
        elif ranked is None:
            ranked = disjoint(groups, retired)
        self.published = ranked.scores
        return ranked

    def _resident_first(
        self, groups: Sequence[ScoredBlocks], state: EngineState
    ) -> list[ScoredBlocks]:
        """``groups`` with their host-resident blocks' positive scores raised by the factor
        ``1 + RESIDENCY_BONUS``: a copy already in the tier keeps its place against a newcomer
        of about the same value (values further apart keep their order)."""
        is_resident = state.resident["host"].__contains__
        out: list[ScoredBlocks] = []
        for group in groups:
            kept = tuple(filter(is_resident, group.block_hashes))
            if not kept or group.score <= 0.0:
                out.append(group)
                continue
            out.append(ScoredBlocks(group.score * (1.0 + RESIDENCY_BONUS), kept))
            rest = tuple(filterfalse(is_resident, group.block_hashes))
            if rest:
                out.append(ScoredBlocks(group.score, rest))
        return out

    def value(
        self, workflow_id: str, agent: str, state: EngineState, *, degraded: bool
    ) -> float | None:
        """The value this order gives ``agent``'s private prompt in the workflow now (None: an
        unknown workflow): ``1 / steps`` plus the pace in a flat type or the lookahead in
        another; steps alone while the predictor is ``degraded`` (what is published then)."""
        wf = state.workflows.get(workflow_id)
        if wf is None:
            return None
        ahead = 0.0
        if not degraded:
            if self.steps.flat(wf.workflow_type):
                ahead = self.pacing.pace(workflow_id)
            else:
                ahead = self.lookahead.mass(workflow_id, agent)
        return ahead + self.steps.value(workflow_id, agent, state)

    def displaced_below(self, value: float, n_blocks: int, state: EngineState) -> bool:
        """Would writing ``n_blocks`` into the host tier evict only blocks ranked below
        ``value``? The tier evicts its lowest-scored blocks first (the published scores,
        unscored blocks at 0), so it is enough that ``n_blocks`` of them score below."""
        if n_blocks <= 0:
            return True
        scores = self.published
        below = 0
        for b in state.resident["host"]:
            if scores.get(b, 0.0) < value:
                below += 1
                if below >= n_blocks:
                    return True
        return False
