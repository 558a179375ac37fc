"""Which ranking orders the GPU tier: the one an online referee judges best.

Three rankings compete (``RANKINGS``): ``steps`` (the learned step graph), ``lookahead`` (the
predictor) and ``both`` (their sum). At every snapshot each is given to a ``RankingReferee``,
which marks it, when an agent is called again in a workflow, by where it kept that agent's
private prompt since the previous call; the GPU takes the ranking with the best rolling mean,
``steps`` until there is evidence. While the predictor is degraded only ``steps`` is published
(and given to the referee in the others' places).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from policyd.core.state import EngineState
from policyd.policies.rankings import Key, Values
from policyd.policies.referee import RankingReferee

RANKINGS = ("steps", "lookahead", "both")


class GpuRanking:
    """The referee (``referee``) and the name of the ranking it chose last (``ranking``)."""

    def __init__(self) -> None:
        self.referee = RankingReferee(RANKINGS)
        self.ranking = "steps"

    def referenced(self, key: Key) -> None:
        """The agent of ``key`` was called again in its workflow: the referee marks."""
        self.referee.referenced(key)

    def choose(self, rankings: Mapping[str, Values], state: EngineState) -> str:
        """Give the referee every ranking in ``RANKINGS``; the one it prefers now."""
        self._publish(state, {name: values.private for name, values in rankings.items()})
        self.ranking = self.referee.best()
        return self.ranking

    def choose_degraded(self, steps: Values, state: EngineState) -> str:
        """``steps``, the only ranking while the predictor is degraded (judged alone)."""
        self.ranking = "steps"
        self._publish(state, {"steps": steps.private, "lookahead": {}, "both": steps.private})
        return self.ranking

    def _publish(self, state: EngineState, rankings: dict[str, dict[Key, float]]) -> None:
        """The live private prompts (sized in blocks past their agent's prefix) and each
        ranking's values of them, to the referee."""
        prefixes = state.agent_prefix
        sizes: dict[Hashable, int] = {}
        for wf in state.active_workflows():
            for agent, blocks in wf.agent_blocks.items():
                size = len(blocks) - len(prefixes.get(agent, ()))
                if size > 0:
                    sizes[wf.workflow_id, agent] = size
        self.referee.publish(sizes, rankings)
