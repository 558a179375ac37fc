"""The mixed workload: the four generators on one server, in proportions, seeded."""

from __future__ import annotations

from collections import Counter

import pytest

from policyd.sim.replay import SimConfig, simulate
from policyd.workloads import make_workload
from policyd.workloads.mixed import parse_proportions


def test_proportions_seed_and_agent_names() -> None:
    work = make_workload("mixed", seed=4, streams=40)
    kinds = Counter(stream[0].workflow_type for stream in work)
    assert kinds == {"fact-checking": 12, "code-writing": 12, "financial": 8, "coding-agent": 8}
    # interleaved: the first slots already hold more than one kind
    assert len({stream[0].workflow_type for stream in work.streams[:8]}) > 1
    assert all(c.agent.startswith(f"{c.workflow_type}/") for s in work for c in s)
    again = make_workload("mixed", seed=4, streams=40)
    assert [c.block_hashes for s in again for c in s] == [c.block_hashes for s in work for c in s]
    other = make_workload("mixed", seed=5, streams=40)
    assert [s[0].workflow_id for s in other] != [s[0].workflow_id for s in work]


def test_proportions_are_configurable_and_checked() -> None:
    only = make_workload("mixed", streams=10, proportions="financial=1,coding-pool=0")
    assert {s[0].workflow_type for s in only} == {"financial"}
    assert parse_proportions("fact-checking=3, code-writing=1") == {
        "fact-checking": 3.0,
        "code-writing": 1.0,
    }
    with pytest.raises(ValueError, match="valid parts"):
        make_workload("mixed", proportions={"poker": 1.0})
    with pytest.raises(ValueError, match="name=share"):
        parse_proportions("financial")
    with pytest.raises(ValueError, match="positive sum"):
        make_workload("mixed", proportions={"financial": 0.0})


def test_mixed_replays_under_every_kind_of_policy() -> None:
    work = make_workload("mixed", seed=1, streams=6, proportions="fact-checking=1,financial=1")
    config = SimConfig(concurrency=4, gpu_blocks=4096, host_blocks=2048)
    for policy in ("lru", "agentkv", "belady"):
        report = simulate(work, policy, config)
        assert report.requests == work.calls
