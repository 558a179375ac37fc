"""Online next-agent prediction (PBKV's predictor): ``Predictor`` answers a ``Forecast``.

* ``forecast`` - the answer: P(agent at step k | running) and P(running at step k), k = 1..K;
* ``backoff`` - workflow structure: back-off counts over the last agents (a River classifier);
* ``context`` - the request's own context: hints, position, retries (River logistic model);
* ``position`` - where a workflow is, and what that says about each candidate next agent;
* ``mixture`` - how much to trust each expert, learnt online;
* ``nodes`` - what the one-step model computes at a position, and its caches;
* ``onestep`` - the experts fused into the next label's distribution at a position;
* ``rollout`` - K-step forecasts from the one-step model (a beam);
* ``learning`` - the experts and their mixture taught one observed transition;
* ``tracking`` - online accuracy per step, calibration, drift (River metrics and ADWIN);
* ``scoring`` - a workflow's forecasts scored as the calls they forecast arrive;
* ``serving`` - the forecast served at a workflow's position (noise injected if asked);
* ``kinds`` - what is learnt per workflow type, aliasing, forgetting a type after a drift;
* ``workflows`` - per active workflow: its position, what was computed and forecast there;
* ``parts`` - the predictor's settings and learnt state; ``restore`` - older checkpoints;
* ``fusion`` - the ``Predictor``: the facade over those parts, learning as calls are observed.

Installed with ``AGENTKV_COMPILE=1`` (``setup.py``: the Docker image is), those modules are
compiled with Cython from this same source - the same arithmetic, about a quarter less CPU per
call (``make bench-predictor``). ``BUILD`` says which runs. A compiled module whose source has
changed since it was compiled (an edited editable checkout) is never run: every module is then
loaded from its source, with a warning, as with ``AGENTKV_INTERPRETED=1``.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

SOURCES = "compiled-sources.json"  # written by setup.py: module -> SHA-256 of its source


def compiled_modules(directory: Path) -> tuple[list[str], list[str]]:
    """The modules of ``directory`` with an extension module built beside their source, and
    those of them whose source differs from what was compiled (or was not recorded)."""
    names = sorted(
        {
            path.name[: -len(suffix)]
            for suffix in importlib.machinery.EXTENSION_SUFFIXES
            for path in directory.glob(f"*{suffix}")
            if (directory / f"{path.name[: -len(suffix)]}.py").exists()
        }
    )
    if not names:
        return [], []
    try:
        recorded = json.loads((directory / SOURCES).read_text())
    except (OSError, ValueError):
        recorded = {}
    stale = [
        name
        for name in names
        if recorded.get(name) != hashlib.sha256((directory / f"{name}.py").read_bytes()).hexdigest()
    ]
    return names, stale


class _FromSource(importlib.abc.MetaPathFinder):
    """Finds the named modules' source, ahead of their extension modules."""

    def __init__(self, directory: Path, names: Sequence[str]) -> None:
        self.directory = directory
        self.names = {f"{__name__}.{name}" for name in names}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in self.names:
            return None
        return importlib.util.spec_from_file_location(
            fullname, self.directory / f"{fullname.rpartition('.')[2]}.py"
        )


def _choose_build() -> None:
    directory = Path(__file__).parent
    names, stale = compiled_modules(directory)
    if not names:
        return
    if stale:
        warnings.warn(
            f"policyd.models.predictor: {', '.join(stale)} changed since compiled: running the "
            "source (recompile with AGENTKV_COMPILE=1 pip install -e .)",
            RuntimeWarning,
            stacklevel=2,
        )
    elif os.environ.get("AGENTKV_INTERPRETED", "0") in ("", "0"):
        return
    sys.meta_path.insert(0, _FromSource(directory, names))


_choose_build()

from policyd.models.predictor import fusion  # noqa: E402
from policyd.models.predictor.forecast import END, START, Forecast  # noqa: E402
from policyd.models.predictor.fusion import Predictor  # noqa: E402
from policyd.models.predictor.rollout import MIN_BRANCH  # noqa: E402

# which build runs: "compiled" (Cython extension modules) or "interpreted" (the source)
BUILD = "interpreted" if (fusion.__file__ or "").endswith(".py") else "compiled"

__all__ = ["BUILD", "END", "MIN_BRANCH", "START", "Forecast", "Predictor"]
