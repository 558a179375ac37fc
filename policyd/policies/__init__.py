"""The policy registry: names to factories. An unknown name is a ``ValueError`` listing the
valid ones, an unknown parameter a ``TypeError`` listing the policy's. Oracle policies need the
future and take it as a keyword argument."""

from __future__ import annotations

import inspect
from typing import Any

from policyd.core.policy import Ordering, Policy
from policyd.policies.agentkv import AgentKV
from policyd.policies.belady import Belady, FutureIndex
from policyd.policies.efficientagent import EfficientAgent
from policyd.policies.kvflow import KVFlow
from policyd.policies.lru import LRU
from policyd.policies.pbkv import PBKV

POLICIES: dict[str, type[Policy]] = {
    LRU.name: LRU,
    PBKV.name: PBKV,
    KVFlow.name: KVFlow,
    EfficientAgent.name: EfficientAgent,
    AgentKV.name: AgentKV,
    Belady.name: Belady,
}


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build the policy registered as ``name`` with the parameters ``kwargs``.

    >>> make_policy("lru", nope=1)
    Traceback (most recent call last):
    ...
    TypeError: lru takes no parameter nope; valid: (none)
    """
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}"
        ) from None
    if factory.ordering == "oracle" and "future" not in kwargs:
        raise ValueError(
            f"{name!r} is an offline oracle: it needs the future (future=FutureIndex(...)); "
            "the simulator builds it from the trace"
        )
    accepted = set(inspect.signature(factory.__init__).parameters) - {"self", "args", "kwargs"}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise TypeError(
            f"{name} takes no parameter {', '.join(unknown)}; "
            f"valid: {', '.join(sorted(accepted)) or '(none)'}"
        )
    return factory(**kwargs)


__all__ = ["POLICIES", "Belady", "FutureIndex", "Ordering", "Policy", "make_policy"]
