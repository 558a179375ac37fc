"""Where a workflow is - really, or hypothetically during a roll-out - and what that position
says about each candidate next agent, relative to the workflow (the context model's features
whose weights are shared across agents).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from policyd.models.predictor.context import MAX_LOG, Features
from policyd.models.predictor.forecast import END

RANKS: Final = 4  # recent distinct agents told apart (the copy expert's ranks)
MAX_BUCKET: Final = 16  # call counts and positions past this share a one-hot feature
_CALLS: Final = tuple(f"calls={n}" for n in range(MAX_BUCKET + 1))
_END_POS: Final = tuple(f"end_pos={n}" for n in range(MAX_BUCKET + 1))
_RANK: Final = tuple(f"rank{j}" for j in range(RANKS + 1))


@dataclass(slots=True)
class Position:
    """What the models condition on.

    >>> p = Position("t", ("<start>",), (), 0, {}, 0, {}, {}).then("a", 3).then("b", 3)
    >>> p.then("b", 3).history, p.then("b", 3).run, p.then("a", 3).recent
    (('a', 'b', 'b'), 2, ('a', 'b'))
    """

    kind: str
    history: tuple[str, ...]  # the last labels, most recent last (START before the first call)
    recent: tuple[str, ...]  # distinct agents, most recent first, at most RANKS
    pos: int  # calls so far
    calls: dict[str, int]  # calls so far per agent
    run: int  # consecutive calls of the last agent
    numeric: Features  # numeric hints of the last request
    onehot: Features  # one-hot string hints of the last request

    def then(self, agent: str, order: int) -> Position:
        """The position after ``agent`` is called (hints unchanged; ``order`` labels kept)."""
        calls = self.calls.copy()
        calls[agent] = calls.get(agent, 0) + 1
        history = self.history
        run = self.run + 1 if history[-1] == agent else 1
        recent = self.recent
        if not recent or recent[0] != agent:  # (a repeat keeps the order as it is)
            if agent in recent:
                recent = (agent, *[a for a in recent if a != agent])
            else:
                recent = (agent, *recent)[:RANKS]
        return Position(
            self.kind,
            (*history, agent)[-order:],
            recent,
            self.pos + 1,
            calls,
            run,
            self.numeric,
            self.onehot,
        )


def counted_features(
    position: Position, label: str, markov: dict[str, float], copy: dict[str, float]
) -> Features:
    """What the count models think of ``label`` and its rank among the recent agents: the part
    of a candidate's features that a cached position can reuse."""
    features: Features = {
        "log_markov": max(-MAX_LOG, math.log(markov.get(label, 0.0) or 1e-12)) / MAX_LOG,
        "log_copy": max(-MAX_LOG, math.log(copy.get(label, 0.0) or 1e-12)) / MAX_LOG,
    }
    if label == END:
        features["is_end"] = 1.0
    else:
        recent = position.recent
        rank = recent.index(label) + 1 if label in recent else 0
        features[_RANK[rank] if rank <= RANKS else f"rank{rank}"] = 1.0
    return features


class PathFeatures:
    """``counted_features`` completed with what depends on the workflow's own path: how often
    the candidate ran (retries: its n-th call, as a shared and a per-agent one-hot), whether it
    repeats the last call and how long that run is; for ``END``, the position (length).

    That part depends on the candidate and a few small numbers only, which recur from call to
    call: it is built once per (candidate, calls, run) or (``END``, position) and reused (each
    completed set of features is a new dict; the shared parts are never modified).

    >>> features = PathFeatures()
    >>> p = Position("t", ("a",), ("a",), 2, {"a": 2}, 2, {}, {})
    >>> sorted(features(p, "a", {}))
    ['a|calls=2', 'calls=2', 'repeat_run']
    """

    def __init__(self, max_names: int = 100_000) -> None:
        self.max_names = max_names
        self._names: dict[tuple[str, int], str] = {}  # interned per-agent feature names
        self._parts: dict[tuple[str, int, int], Features] = {}

    def __setstate__(self, state: dict[str, object]) -> None:
        """Restore a pickle, one made before the parts were cached included."""
        self.__dict__.update(state)
        self.__dict__.setdefault("_parts", {})

    def __call__(self, position: Position, label: str, counted: Features) -> Features:
        if label == END:
            key = (label, position.pos, 0)
        else:
            calls = position.calls.get(label, 0)
            key = (label, calls, position.run if label == position.history[-1] else 0)
        part = self._parts.get(key)
        if part is None:
            part = self._part(*key)
        return {**counted, **part}

    def _part(self, label: str, count: int, run: int) -> Features:
        """The path's features of ``label``: ``count`` is the position for ``END``, else the
        candidate's calls so far; ``run`` the last agent's run when the candidate is that agent
        (0 otherwise)."""
        parts = self._parts
        if len(parts) >= self.max_names:
            parts.clear()
        features: Features = {}
        if label == END:
            features["end_pos"] = math.log1p(count)
            features[_END_POS[min(count, MAX_BUCKET)]] = 1.0
            parts[label, count, run] = features
            return features
        calls = min(count, MAX_BUCKET)
        name = self._names.get((label, calls))
        if name is None:
            if len(self._names) >= self.max_names:
                self._names.clear()
            name = self._names[label, calls] = f"{label}|calls={calls}"
        features[name] = 1.0
        features[_CALLS[calls]] = 1.0
        if run:
            features["repeat_run"] = math.log1p(run)
        parts[label, count, run] = features
        return features
