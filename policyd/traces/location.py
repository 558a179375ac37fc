"""Where the public traces are on this machine.

The repository ships no real trace (docs/BENCHMARKS.md names each one's public source). Commands
and tests find a local copy through ``AGENTKV_TRACES``, a folder holding them under their
published names, else in the folder ``policyd trace get NAME`` fills by default
(``CACHE_DIR``); a command also takes an explicit path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

TRACES_ENV: Final = "AGENTKV_TRACES"
SWE_TRAJECTORIES: Final = "swebench_minisweagent_200.tar.gz"
WHO_AND_WHEN: Final = "who_and_when_captainagent"
MOONCAKE: Final = "mooncake/synthetic_trace.jsonl"
CACHE_DIR: Final = Path.home() / ".cache" / "agentkv" / "traces"


def traces_folder(dest: Path | None = None) -> Path:
    """The traces' folder: ``dest``, else ``$AGENTKV_TRACES``, else ``CACHE_DIR`` (where
    ``policyd trace get`` writes by default)."""
    if dest is not None:
        return dest
    root = os.environ.get(TRACES_ENV)
    return Path(root) if root else CACHE_DIR


def local_trace(name: str) -> Path | None:
    """``$AGENTKV_TRACES/name`` when the variable is set; else ``CACHE_DIR/name`` when
    ``policyd trace get`` put it there; else None."""
    path = traces_folder() / name
    return path if os.environ.get(TRACES_ENV) or path.exists() else None


def missing_trace_message(option: str, name: str) -> str:
    return (
        f"no {name}: pass {option} PATH, fetch it with `policyd trace get NAME` "
        f"(`policyd trace list` names them), or set {TRACES_ENV} to a folder holding it"
    )
