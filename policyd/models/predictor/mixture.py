"""How much to trust each expert: mixture weights learnt online, per workflow type and last agent.

Exponentiated gradient on the log loss of the mixture (Helmbold et al.): after each transition
every expert's weight is multiplied by ``exp(rate * p_i(y) / p_mix(y))`` and renormalised, then a
``floor`` share is spread uniformly so that an expert that got better can win weight back. Where a
hint decides the branch, the context expert takes over; where the path alone decides, the counts
keep their say. A last agent seen for the first time starts from its type's weights.

>>> mix = Mixture(3)
>>> for _ in range(50):
...     mix.learn("planner", [0.5, 0.5, 0.95])
>>> [round(w, 2) for w in mix.weights("planner")]
[0.03, 0.03, 0.94]
>>> mix.weights("someone new") == mix.typewide
True
"""

from __future__ import annotations

import math
from operator import mul


class Mixture:
    """Weights of ``n`` experts: one set for the type, one per last agent."""

    def __init__(self, n: int, *, rate: float = 0.5, floor: float = 0.02) -> None:
        self.n = n
        self.rate = rate
        self.floor = floor
        self.typewide = [1.0 / n] * n
        self._local: dict[str, list[float]] = {}

    def weights(self, last: str) -> list[float]:
        return self._local.get(last, self.typewide)

    def learn(self, last: str, said: list[float]) -> None:
        """``said``: each expert's probability of the label that followed ``last``."""
        step = self._step3 if self.n == 3 and len(said) == 3 else self._step
        self._local[last] = step(self._local.get(last, self.typewide), said)
        self.typewide = step(self.typewide, said)

    def reset(self) -> None:
        self.typewide = [1.0 / self.n] * self.n
        self._local.clear()

    def _step(self, weights: list[float], said: list[float]) -> list[float]:
        if len(said) != len(weights):
            raise ValueError(f"{len(said)} experts' probabilities for {len(weights)} weights")
        mixed = sum(map(mul, weights, said)) or 1e-12
        rate = self.rate / mixed
        exp = math.exp
        new = [w * exp(rate * p) for w, p in zip(weights, said, strict=True)]
        norm = sum(new)
        floor = self.floor / self.n
        keep = 1.0 - self.floor
        return [keep * w / norm + floor for w in new]

    def _step3(self, weights: list[float], said: list[float]) -> list[float]:
        """``_step`` for three experts, unrolled: the same operations in the same order."""
        w0, w1, w2 = weights
        s0, s1, s2 = said
        rate = self.rate / (w0 * s0 + w1 * s1 + w2 * s2 or 1e-12)
        exp = math.exp
        n0, n1, n2 = w0 * exp(rate * s0), w1 * exp(rate * s1), w2 * exp(rate * s2)
        norm = n0 + n1 + n2
        floor = self.floor / 3
        keep = 1.0 - self.floor
        return [keep * n0 / norm + floor, keep * n1 / norm + floor, keep * n2 / norm + floor]
