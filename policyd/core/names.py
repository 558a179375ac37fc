"""Registry names the command line needs, without importing what they name.

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
