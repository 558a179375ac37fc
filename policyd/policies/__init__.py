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


def policy_variant(label: str) -> tuple[str, dict[str, object]]:
    """A policy as ``--policies`` names it: ``name``, or ``name[param=value,...]`` for a variant
    run side by side with the default (its label is the whole text). Values are read as int,
    float, true/false, or else text.

    >>> policy_variant("agentkv[guard=false,discount=0.5]")
    ('agentkv', {'guard': False, 'discount': 0.5})
    """
    name, bracket, rest = label.partition("[")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; valid policies: {', '.join(sorted(POLICIES))}")
    if not bracket:
        return name, {}
    if not rest.endswith("]"):
        raise ValueError(f"policy variant {label!r}: expected name[param=value,...]")
    accepted = set(inspect.signature(POLICIES[name].__init__).parameters) - {"self"}
    params: dict[str, object] = {}
    for item in filter(None, rest[:-1].split(",")):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or key not in accepted:
            raise ValueError(
                f"policy variant {label!r}: {item!r} is not param=value with a parameter of "
                f"{name}; valid: {', '.join(sorted(accepted))}"
            )
        params[key] = _value(text.strip())
    return name, params


def _value(text: str) -> object:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


__all__ = [
    "POLICIES",
    "Belady",
    "FutureIndex",
    "Ordering",
    "Policy",
    "make_policy",
    "policy_variant",
]
