"""Docstring examples run as doctests: the modules no other test file runs them for."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest

import connector.replay
import experiments.bench
import policyd.cli.arguments
import policyd.core.names
import policyd.core.ratelog
import policyd.core.types
import policyd.core.validate
import policyd.daemon.ingest
import policyd.daemon.settings
import policyd.history.safe_sql
import policyd.models.stepgraph
import policyd.policies
import policyd.policies.guard
import policyd.policies.pacing
import policyd.policies.rankings
import policyd.policies.referee
import policyd.policies.shadow
import policyd.policies.steps
import policyd.workloads.calls
import policyd.workloads.chats


@pytest.mark.parametrize(
    "module",
    [
        connector.replay,
        experiments.bench,
        policyd.cli.arguments,
        policyd.core.names,
        policyd.daemon.ingest,
        policyd.daemon.settings,
        policyd.history.safe_sql,
        policyd.policies,
        policyd.policies.guard,
        policyd.policies.pacing,
        policyd.policies.rankings,
        policyd.policies.referee,
        policyd.policies.shadow,
        policyd.policies.steps,
        policyd.models.stepgraph,
        policyd.core.ratelog,
        policyd.core.types,
        policyd.core.validate,
        policyd.workloads.calls,
        policyd.workloads.chats,
    ],
    ids=lambda module: module.__name__,
)
def test_doctests(module: ModuleType) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
