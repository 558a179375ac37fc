"""The fleet simulation (experiments/fleet_sim.py): routers on hand-built calls, the split of a
workload over replicas, N=1 against one replica, and the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.fleet_sim import (
    FleetRouter,
    FleetSpec,
    LoadWindow,
    Routing,
    ShadowCache,
    arrivals,
    main,
    route_workload,
    run_fleet,
    split,
)
from experiments.matrix import Source, largest_request
from policyd.fleet.routing import ROUTERS, PrefixIndex
from policyd.sim.replay import SimConfig, simulate
from policyd.workloads import make_workload
from policyd.workloads.calls import Call, Workload

BIG = 10_000  # blocks: no shadow eviction in the hand-built cases


def _call(workflow: str, hashes: range | tuple[int, ...], agent: str = "a") -> Call:
    blocks = tuple(hashes)
    return Call(workflow, agent, blocks, prompt_tokens=16 * len(blocks))


def _fleet(router: str, n: int, window: int = 64) -> FleetRouter:
    return FleetRouter(router, n, gpu_blocks=BIG, host_blocks=BIG, window=window, slack=100.0)


def test_sticky_keeps_each_workflow_on_one_replica() -> None:
    fleet = _fleet("sticky", 4)
    placed: dict[str, set[int]] = {}
    for step in range(5):
        for wf in ("w1", "w2", "w3", "w4", "w5", "w6"):
            replica = fleet.route(_call(wf, range(step * 10, step * 10 + 3)))
            placed.setdefault(wf, set()).add(replica)
    assert all(len(replicas) == 1 for replicas in placed.values())
    assert len({next(iter(r)) for r in placed.values()}) > 1  # not all on one replica


def test_round_robin_takes_the_replicas_in_turn() -> None:
    fleet = _fleet("round-robin", 3)
    assert [fleet.route(_call("w", (i,))) for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_prefix_aware_picks_the_replica_with_the_longest_cached_prefix() -> None:
    fleet = _fleet("prefix", 3)
    fleet.shadows[1].touch(tuple(range(100, 104)))  # 4 blocks of the prompt
    fleet.shadows[2].touch(tuple(range(100, 110)))  # 10 blocks
    fleet.shadows[0].touch((100,))  # 1 block
    assert fleet.route(_call("new", range(100, 120))) == 2
    # nothing cached anywhere: the least loaded (replica 2 now carries the last call's tokens)
    assert fleet.route(_call("other", range(500, 503))) != 2


def test_workflow_aware_follows_the_previous_prompts_holder_and_spreads_new_workflows() -> None:
    fleet = _fleet("workflow", 4)
    workflows = ("w0", "w1", "w2", "w3")
    first = {
        wf: fleet.route(_call(wf, range(1000 * i, 1000 * i + 8)))
        for i, wf in enumerate(workflows, 1)
    }
    assert sorted(first.values()) == [0, 1, 2, 3]  # new workflows spread by load
    for i, wf in enumerate(workflows, 1):
        # the next call of another agent: its own blocks are new, the transcript's are not
        grown = _call(wf, (*range(1000 * i, 1000 * i + 8), 77_000 + i), agent="other")
        assert fleet.route(grown) == first[wf]
    assert fleet.reasons["workflow-prefix"] == len(workflows)  # by the index, not by memory


def test_shadow_cache_keeps_the_most_recent_blocks_and_evicts_a_prompts_tail_first() -> None:
    index = PrefixIndex()
    shadow = ShadowCache("r", index, gpu_blocks=2, host_blocks=2)
    shadow.touch((1, 2, 3))
    assert len(shadow) == 3
    assert index.replicas["r"].gpu == {1, 2} and index.replicas["r"].host == {3}
    shadow.touch((9, 8))
    assert index.replicas["r"].gpu == {9, 8} and index.replicas["r"].host == {1, 2}
    assert index.longest_prefix((1, 2, 3))["r"] == 2


def test_load_window_forgets_calls_older_than_the_window() -> None:
    load = LoadWindow(["a", "b"], window=2)
    load.routed("a", 100)
    load.routed("b", 10)
    load.routed("b", 10)
    assert load.loads == {"a": 0.0, "b": 20.0}


def test_arrivals_issue_every_call_once_keeping_each_streams_order() -> None:
    work = make_workload("code-writing", seed=1, workflows=6)
    order = list(arrivals(work, active=3))
    assert sorted(order) == [(s, k) for s, st in enumerate(work.streams) for k in range(len(st))]
    for s, stream in enumerate(work.streams):
        mine = [k for t, k in order if t == s]
        if not any(c.parallel for c in stream):
            assert mine == sorted(mine)


@pytest.mark.parametrize("router", ROUTERS)
def test_sub_workloads_partition_the_calls_in_order(router: str) -> None:
    work = make_workload("coding-pool", seed=0, tasks=6)
    largest = largest_request(work)
    routing = route_workload(
        work, router, 3, concurrency=2, gpu_blocks=largest, host_blocks=largest
    )
    parts = split(work, routing)
    assert len(parts) == 3
    where = {id(c): (s, k) for s, stream in enumerate(work.streams) for k, c in enumerate(stream)}
    seen = [where[id(c)] for part in parts for stream in part.streams for c in stream]
    assert sorted(seen) == sorted(where.values())  # nothing lost, nothing twice
    for r, part in enumerate(parts):
        for sub in part.streams:
            positions = [where[id(c)] for c in sub]
            assert len({s for s, _ in positions}) == 1  # one workload stream per sub-stream
            assert positions == sorted(positions)  # in the stream's order
            assert all(routing.replica_of[p] == r for p in positions)


def test_split_keeps_a_sub_stream_per_stream_and_replica() -> None:
    calls = [_call("w", (i,)) for i in range(4)]
    work = Workload("w", [tuple(calls)])
    routing = Routing(2, {(0, 0): 0, (0, 1): 1, (0, 2): 0, (0, 3): 1})
    a, b = split(work, routing)
    assert list(a.streams) == [(calls[0], calls[2])]
    assert list(b.streams) == [(calls[1], calls[3])]


@pytest.mark.parametrize("router", ROUTERS)
def test_one_replica_is_the_whole_workload_on_one_simulator(router: str) -> None:
    work = make_workload("code-writing", seed=0, workflows=6)
    largest = largest_request(work)
    spec = FleetSpec(Source("code-writing"), router, 1, 2, largest * 2, largest)
    fleet = run_fleet(work, spec)
    config = SimConfig(concurrency=2, gpu_blocks=largest * 2, host_blocks=largest)
    alone = simulate(work, "lru", config)
    assert (fleet.gpu_hit_blocks, fleet.host_hit_blocks, fleet.prompt_blocks) == (
        alone.gpu_hit_blocks,
        alone.host_hit_blocks,
        alone.prompt_blocks,
    )
    assert fleet.recomputed_tokens == alone.recomputed_tokens
    assert fleet.makespan_s == alone.makespan_s
    assert fleet.imbalance == 1.0


def test_the_command_writes_every_router_at_every_fleet_size(tmp_path: Path) -> None:
    out, png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    argv = ["--quick", "--workloads", "code-writing", "--replicas", "1,2,4", "--jobs", "1"]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    payload = json.loads(out.read_text())
    runs = payload["runs"]
    assert {(r["router"], r["replicas"]) for r in runs} == {
        (router, n) for router in ROUTERS for n in (1, 2, 4)
    }
    assert "--quick" in payload["command"]
    for r in runs:
        assert 0.0 <= r["hit_rate"] <= 1.0
        assert len(r["routed_tokens"]) == r["replicas"]
        assert sum(r["replica_calls"]) == r["calls"]
    one = {r["router"]: r["hit_rate"] for r in runs if r["replicas"] == 1}
    assert len(set(one.values())) == 1  # one replica: the router cannot matter
    assert png.stat().st_size > 0
