"""Registry names the command line needs, without importing what they name, and how
``--policies`` splits its labels.

Every parser ``policyd`` builds lists and validates these, and importing the registries
themselves costs seconds (the policies load River and the predictor; the trace readers NumPy).
Contract: each tuple equals its registry's names - ``policyd.policies.POLICIES`` (and which of
them are offline oracles) and ``policyd.traces.READERS``; a test holds them in step.
"""

from __future__ import annotations

from typing import Final

POLICY_NAMES: Final = ("lru", "pbkv", "kvflow", "efficientagent", "agentkv", "belady")
ORACLE_POLICY_NAMES: Final = ("belady",)  # need the future: the simulator only
ONLINE_POLICY_NAMES: Final = tuple(sorted(set(POLICY_NAMES) - set(ORACLE_POLICY_NAMES)))
TRACE_FORMATS: Final = ("calls", "mooncake", "swe", "who-and-when")


def split_policies(text: str) -> list[str]:
    """``--policies``: comma-separated, a variant's brackets kept whole.

    >>> split_policies("lru,agentkv,agentkv[guard=false,discount=0.5]")
    ['lru', 'agentkv', 'agentkv[guard=false,discount=0.5]']
    """
    out: list[str] = []
    depth, start = 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [label.strip() for label in out if label.strip()]
