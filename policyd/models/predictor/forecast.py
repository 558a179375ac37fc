"""What the predictor answers: a workflow's next K steps, as probabilities.

``agents[k]`` is the distribution of the agent called at step ``k + 1`` *given that the workflow
is still running then*; ``alive[k]`` is the probability that it is. The joint probability that
step ``k + 1`` calls agent ``a`` is ``alive[k] * agents[k][a]`` (``Forecast.prob``), and
``1 - alive[k]`` is the probability that the workflow has ended by then (the pseudo-agent
``END``). ``alive`` never increases with ``k``: an ended workflow stays ended.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

END: Final = "<end>"  # the pseudo-agent that follows a workflow's last call
START: Final = "<start>"  # the pseudo-agent before a workflow's first call


@dataclass(frozen=True, slots=True)
class Forecast:
    """P(agent at step k) and P(still running at step k) for k = 1..K (index 0 is step 1).

    >>> f = Forecast(agents=[{"coder": 0.75, "tester": 0.25}, {"tester": 1.0}], alive=[1.0, 0.4])
    >>> f.k, f.top(1), f.top(2), round(f.prob("tester", 2), 2)
    (2, 'coder', '<end>', 0.4)
    """

    agents: list[dict[str, float]]
    alive: list[float]

    @property
    def k(self) -> int:
        return len(self.alive)

    def prob(self, agent: str, step: int) -> float:
        """Joint probability that step ``step`` (1-based) calls ``agent``; ``END`` is allowed."""
        alive = self.alive[step - 1]
        if agent == END:
            return 1.0 - alive
        return alive * self.agents[step - 1].get(agent, 0.0)

    def top(self, step: int) -> str:
        """The most likely label of step ``step`` (1-based), ``END`` included."""
        alive = self.alive[step - 1]
        dist = self.agents[step - 1]
        if not dist:
            return END
        agent = max(dist, key=dist.__getitem__)
        return agent if alive * dist[agent] >= 1.0 - alive else END


def random_forecast(labels: Sequence[str], k: int, rng: random.Random) -> Forecast:
    """A confidently wrong-or-right forecast: each step names one label drawn uniformly from
    ``labels`` (``END`` among them) with probability 1; once ``END`` is drawn the workflow stays
    ended. Used to inject prediction noise in experiments.

    >>> f = random_forecast(["a", "b", END], 3, random.Random(1))
    >>> len(f.agents), all(sum(d.values()) in (0.0, 1.0) for d in f.agents)
    (3, True)
    """
    agents: list[dict[str, float]] = []
    alive: list[float] = []
    ended = not labels
    for _ in range(k):
        if not ended:
            label = labels[rng.randrange(len(labels))]
            ended = label == END
        if ended:
            agents.append({})
            alive.append(0.0)
        else:
            agents.append({label: 1.0})
            alive.append(1.0)
    return Forecast(agents, alive)
