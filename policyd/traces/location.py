"""Where the public traces are on this machine.

The repository ships no real trace (docs/RESULTS.md names each one's public source). Commands
and tests find a local copy through ``AGENTKV_TRACES``, a folder holding them under their
published names; a command also takes an explicit path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

TRACES_ENV: Final = "AGENTKV_TRACES"
SWE_TRAJECTORIES: Final = "swebench_minisweagent_200.tar.gz"
WHO_AND_WHEN: Final = "who_and_when_captainagent"
MOONCAKE: Final = "mooncake/synthetic_trace.jsonl"


def local_trace(name: str) -> Path | None:
    """``$AGENTKV_TRACES/name``, or None when the variable is unset."""
    root = os.environ.get(TRACES_ENV)
    return Path(root) / name if root else None


def missing_trace_message(option: str, name: str) -> str:
    return f"no {name}: pass {option} PATH or set {TRACES_ENV} to a folder holding it"
