"""Workload generators. ``WORKLOADS`` maps a name to a factory ``(seed, **params) -> Workload``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from policyd.workloads.calls import Workload
from policyd.workloads.chats import group_chat
from policyd.workloads.mixed import mixed
from policyd.workloads.pbkv import code_writing, fact_checking, financial
from policyd.workloads.pool import coding_pool
from policyd.workloads.synthetic import synthetic_agents

WORKLOADS: dict[str, Callable[..., Workload]] = {
    "fact-checking": fact_checking,
    "code-writing": code_writing,
    "financial": financial,
    "coding-pool": coding_pool,
    "synthetic": synthetic_agents,
    "mixed": mixed,
    "group-chat": group_chat,
}


def make_workload(name: str, *, seed: int = 0, **params: Any) -> Workload:
    try:
        factory = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; valid workloads: {', '.join(sorted(WORKLOADS))}"
        ) from None
    return factory(seed=seed, **params)


__all__ = ["WORKLOADS", "make_workload"]
