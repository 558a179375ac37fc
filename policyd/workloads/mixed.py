"""The mixed workload: PBKV's three workflows and the coding-agent pool on one server at once.

None of the papers measures it, yet it is the realistic case: one vLLM instance serving a
fact-checking pipeline, a code-writing crew, a financial-analysis DAG and a pool of SWE coding
agents together. Streams of the four generators are drawn in ``proportions`` (by stream count)
and shuffled with the seed, so the simulator's ``concurrency`` slots hold a mix of them at every
moment: short multi-agent workflows with shared system prompts beside long single-agent
conversations whose contexts grow to tens of thousands of tokens.

Agents are named ``<workflow type>/<agent>``: two applications each calling their own "planner"
send different system prompts, and a client names its agents per application (the Engine learns
an agent's shared prefix by name).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping

from policyd.workloads.calls import Call, Stream, Workload
from policyd.workloads.pbkv import code_writing, fact_checking, financial
from policyd.workloads.pool import coding_pool

DEFAULT_PROPORTIONS: Mapping[str, float] = {
    "fact-checking": 0.3,
    "code-writing": 0.3,
    "financial": 0.2,
    "coding-pool": 0.2,
}

_PARTS: dict[str, tuple[Callable[..., Workload], str]] = {
    "fact-checking": (fact_checking, "workflows"),
    "code-writing": (code_writing, "workflows"),
    "financial": (financial, "workflows"),
    "coding-pool": (coding_pool, "tasks"),
}


def parse_proportions(text: str) -> dict[str, float]:
    """``"fact-checking=3,coding-pool=1"`` -> shares by name (normalised by ``mixed``)."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"proportion {item!r}: expected name=share")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"proportion {item!r}: share {value!r} is not a number") from None
    return out


def _namespaced(stream: Stream) -> list[Call]:
    return [dataclasses.replace(c, agent=f"{c.workflow_type}/{c.agent}") for c in stream]


def mixed(
    *,
    seed: int = 0,
    streams: int = 200,
    proportions: Mapping[str, float] | str = DEFAULT_PROPORTIONS,
) -> Workload:
    """``streams`` streams in all, drawn from the four generators by ``proportions``."""
    shares = parse_proportions(proportions) if isinstance(proportions, str) else dict(proportions)
    unknown = sorted(set(shares) - set(_PARTS))
    if unknown:
        raise ValueError(f"unknown parts {unknown}; valid parts: {', '.join(sorted(_PARTS))}")
    if any(v < 0 for v in shares.values()) or sum(shares.values()) <= 0:
        raise ValueError(f"proportions must be >= 0 with a positive sum, got {shares}")
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    total = sum(shares.values())
    counts = {name: round(streams * share / total) for name, share in shares.items()}
    pool: list[list[Call]] = []
    for i, (name, n) in enumerate(sorted(counts.items())):
        if n <= 0:
            continue
        factory, count_param = _PARTS[name]
        part = factory(seed=seed * 7919 + i, **{count_param: n})
        pool.extend(_namespaced(s) for s in part.streams)
    random.Random(seed).shuffle(pool)
    described = ", ".join(f"{counts[n]} {n}" for n in sorted(counts) if counts[n])
    return Workload("mixed", pool, f"mixed on one server: {described}")
