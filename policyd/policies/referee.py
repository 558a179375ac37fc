"""Which of several block rankings keeps what is reused: an online referee.

Each ranking scores the same keys (a workflow's private prompt of one agent) at every snapshot.
When a key is referenced again (the agent is called again in that workflow), the referee records,
per ranking, the key's lowest *percentile* over the snapshots since its previous reference: the
share of the scored blocks that ranking would have evicted before this key's blocks, in the
tiers' order (lowest score first, ties least recently referenced first). The lowest, because a
block is lost at the moment it ranks low, not on average. A ranking that keeps what is about to
be reused puts it high. The referee prefers the ranking with the higher block-weighted mean over
a rolling window.

Why: PBKV's lookahead is only as good as the predictor, and its rolling top-1 accuracy says
little about the value ranking (a 0.5-accurate forecast can still rank well, or badly). Judging
the ranking itself on the references that follow makes the degradation measured, not assumed.

>>> referee = RankingReferee(("lookahead", "steps"), window=8, min_samples=1)
>>> referee.publish({"a": 10, "b": 10}, {"lookahead": {"a": 2.0, "b": 1.0}, "steps": {"b": 1.0}})
>>> referee.referenced("a")
>>> referee.best(), referee.means()
('lookahead', {'lookahead': 0.75, 'steps': 0.25})
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from typing import Any


class RankingReferee:
    """Rolling, block-weighted mean percentile of referenced keys under each ranking."""

    def __init__(self, names: Sequence[str], *, window: int = 256, min_samples: int = 32) -> None:
        if not names:
            raise ValueError("at least one ranking is needed")
        if window < 1 or min_samples < 0:
            raise ValueError(
                f"window must be >= 1 and min_samples >= 0, got {window}, {min_samples}"
            )
        self.names = tuple(names)
        self.min_samples = min_samples
        # key -> (size, lowest percentile per ranking since the key's last reference)
        self._table: dict[Hashable, tuple[int, tuple[float, ...]]] = {}
        self._last_ref: dict[Hashable, int] = {}  # key -> sequence of its last reference
        self._seq = 0
        self._samples: deque[tuple[int, tuple[float, ...]]] = deque(maxlen=window)

    def publish(
        self,
        sizes: Mapping[Any, int],
        rankings: Mapping[str, Mapping[Any, float]],
        capacity_blocks: int | None = None,
    ) -> None:
        """The keys (with their sizes in blocks) and each ranking's scores at this snapshot;
        a key a ranking leaves out scores 0 there. With ``capacity_blocks`` (the cache space
        the keys compete for) a key's mark is the share of it that ranking keeps, not its
        percentile."""
        total = sum(sizes.values())
        if total <= 0 or any(name not in rankings for name in self.names):
            self._table = {}
            return
        last = self._last_ref
        self._last_ref = {key: last.get(key, -1) for key in sizes}
        columns = [
            _percentiles(sizes, rankings[name], self._last_ref, total, capacity_blocks)
            for name in self.names
        ]
        old = self._table
        table: dict[Hashable, tuple[int, tuple[float, ...]]] = {}
        for key, size in sizes.items():
            pcts = tuple(col[key] for col in columns)
            before = old.get(key)
            if before is not None:
                pcts = tuple(map(min, pcts, before[1]))
            table[key] = (size, pcts)
        self._table = table

    def referenced(self, key: Hashable) -> None:
        """``key`` was referenced again: record its lowest percentiles since the last time."""
        self._seq += 1
        self._last_ref[key] = self._seq
        entry = self._table.pop(key, None)
        if entry is not None:
            self._samples.append(entry)

    def means(self) -> dict[str, float]:
        weight = sum(size for size, _ in self._samples)
        if weight <= 0:
            return {}
        return {
            name: sum(size * pcts[i] for size, pcts in self._samples) / weight
            for i, name in enumerate(self.names)
        }

    def best(self) -> str:
        """The ranking with the higher mean; the first one until ``min_samples`` references
        (and on a tie)."""
        return preferred(self.names, self.means(), len(self._samples) >= self.min_samples)


def preferred(names: Sequence[str], marks: Mapping[str, float], judged: bool) -> str:
    """The name with the highest mark; the first of ``names`` until enough has been ``judged``,
    and on a tie (a referee keeps what it started with until the evidence says otherwise)."""
    if not judged:
        return names[0]
    return max(names, key=lambda name: (marks.get(name, 0.0), -names.index(name)))


def _percentiles(
    sizes: Mapping[Hashable, int],
    scores: Mapping[Hashable, float],
    recency: Mapping[Hashable, int],
    total: int,
    capacity_blocks: int | None,
) -> dict[Hashable, float]:
    """Per key, in the order a tier evicts (lowest score first, least recently referenced
    first among equal scores): without a capacity, (blocks evicted before it + half its own) /
    all blocks; with one, the share of its blocks still within the ``capacity_blocks``
    best-ranked (what a cache of that size would keep)."""
    order = sorted(sizes, key=lambda key: (scores.get(key, 0.0), recency.get(key, -1)))
    out: dict[Hashable, float] = {}
    if capacity_blocks is None:
        below = 0
        for key in order:
            size = sizes[key]
            out[key] = (below + size / 2) / total
            below += size
        return out
    above = 0
    for key in reversed(order):
        size = sizes[key]
        out[key] = min(1.0, max(0.0, (capacity_blocks - above) / size))
        above += size
    return out
