"""Docstring examples run as doctests: the modules no other test file runs them for."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest

import experiments.bench
import policyd.arguments
import policyd.cli_bench
import policyd.daemon.ingest
import policyd.daemon.settings
import policyd.history.safe_sql
import policyd.policies.guard
import policyd.policies.referee
import policyd.policies.stepgraph
import policyd.policies.virtual
import policyd.ratelog
import policyd.types
import policyd.validate
import policyd.workload
import policyd.workloads.chats


@pytest.mark.parametrize(
    "module",
    [
        experiments.bench,
        policyd.arguments,
        policyd.cli_bench,
        policyd.daemon.ingest,
        policyd.daemon.settings,
        policyd.history.safe_sql,
        policyd.policies.guard,
        policyd.policies.referee,
        policyd.policies.stepgraph,
        policyd.policies.virtual,
        policyd.ratelog,
        policyd.types,
        policyd.validate,
        policyd.workload,
        policyd.workloads.chats,
    ],
    ids=lambda module: module.__name__,
)
def test_doctests(module: ModuleType) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
