"""The compiled cache model against the Python one: the same replay, the same report.

``simulate(..., model="compiled")`` (policyd.sim.kernel) and ``model="python"``
(policyd.sim.replay.Simulator) must agree on every field of the report but the wall time - hits
per tier, evictions, declined writes, bytes, recomputed tokens, makespan, latencies - and on
every request's record, in order. Random closed-loop workloads cover what the named generators
may not: fan-out steps, gaps, prompts that end inside a block, outputs with and without given
hashes, streams continuing their own output, several streams sharing system prompts; any
concurrency, both running spaces, both tiers, and the settings that change what is cached.
"""

from __future__ import annotations

import dataclasses
from itertools import count
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyd.core.types import BLOCK_SIZE_TOKENS
from policyd.sim import compiled
from policyd.sim.replay import CacheModel, SimConfig, simulate
from policyd.sim.report import Report
from policyd.workloads import make_workload
from policyd.workloads.calls import ROOT_HASH, Call, Workload, chain_hash

POLICIES = ("lru", "belady")


def outcome(workload: Workload, policy: str, config: SimConfig, model: CacheModel) -> Any:
    """The report's fields (all but timings of this machine) and records, or the error."""
    try:
        report = simulate(workload, policy, config, model=model)
    except (ValueError, RuntimeError) as error:
        return type(error).__name__, str(error)
    return _fields(report), report.records


def _fields(report: Report) -> dict[str, Any]:
    fields = report.to_json()
    del fields["wall_s"], fields["refs_per_s"]
    return fields


def assert_same(workload: Workload, policy: str, config: SimConfig) -> None:
    python = outcome(workload, policy, config, "python")
    fast = outcome(workload, policy, config, "compiled")
    assert fast == python, f"{policy} on {workload.name} with {config}"


# ---- random closed-loop workloads ---------------------------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Streams of calls as agents make them: a shared system prompt, then each call re-sends the
    stream's previous prompt and output plus new blocks (or starts over from a system prompt)."""
    keys = count()

    def grow(prefix: tuple[int, ...], n: int) -> tuple[int, ...]:
        parent = prefix[-1] if prefix else ROOT_HASH
        new = []
        for _ in range(n):
            parent = chain_hash(parent, f"k{next(keys)}".encode())
            new.append(parent)
        return prefix + tuple(new)

    systems = [grow((), draw(st.integers(1, 5))) for _ in range(draw(st.integers(1, 3)))]
    streams = []
    for s in range(draw(st.integers(1, 6))):
        calls: list[Call] = []
        context: tuple[int, ...] = ()
        for i in range(draw(st.integers(1, 6))):
            if not context or draw(st.integers(0, 3)) == 0:
                context = systems[draw(st.integers(0, len(systems) - 1))]
            prompt = grow(context, draw(st.integers(0, 6)))
            output_tokens = draw(st.sampled_from((0, 1, 5, 17, 33, 48)))
            given = grow(prompt, max(0, output_tokens - 1) // BLOCK_SIZE_TOKENS)[len(prompt) :]
            if draw(st.booleans()):
                given = given[: draw(st.integers(0, len(given)))]  # content partly unknown
            calls.append(
                Call(
                    workflow_id=f"w{s}",
                    agent=f"a{i % 2}",
                    block_hashes=prompt,
                    prompt_tokens=BLOCK_SIZE_TOKENS * len(prompt) + draw(st.integers(0, 15)),
                    output_tokens=output_tokens,
                    gap_s=draw(st.sampled_from((0.0, 0.0, 0.01, 0.5))),
                    output_block_hashes=given,
                    parallel=i > 0 and draw(st.integers(0, 3)) == 0,
                )
            )
            context = prompt + given
        streams.append(tuple(calls))
    return Workload(name="random", streams=streams)


@st.composite
def configs(draw: st.DrawFn) -> SimConfig:
    return SimConfig(
        concurrency=draw(st.integers(1, 4)),
        gpu_blocks=draw(st.integers(4, 60)),
        host_blocks=draw(st.sampled_from((0, 0, 6, 20, 80))),
        running_space=draw(st.sampled_from(("shared", "separate"))),
        recompute_last_token=draw(st.booleans()),
        offload_prompt_only=draw(st.booleans()),
        record_requests=True,
    )


@settings(max_examples=300, deadline=None, derandomize=True)
@given(workload=workloads(), config=configs(), policy=st.sampled_from(POLICIES))
def test_compiled_equals_python_on_any_small_workload(workload, config, policy):
    assert_same(workload, policy, config)


# ---- the generators ----------------------------------------------------------------------------

GENERATED = {
    "synthetic": {"workflows": 24},
    "group-chat": {"chats": 6, "max_calls": 30},
    "coding-pool": {},
    "fact-checking": {"workflows": 12},
}


@pytest.mark.parametrize("name", sorted(GENERATED))
@pytest.mark.parametrize("host_blocks", [0, 6000])
def test_compiled_equals_python_on_generated_workloads(name, host_blocks):
    workload = make_workload(name, seed=3, **GENERATED[name])
    largest = max(compiled.dense_trace(workload, BLOCK_SIZE_TOKENS).physical_blocks)
    config = SimConfig(
        concurrency=4,
        gpu_blocks=int(largest) + 1500,
        host_blocks=host_blocks,
        record_requests=True,
    )
    for policy in POLICIES:
        assert_same(workload, policy, config)
    fast = simulate(workload, "lru", config, model="compiled")
    assert fast.gpu_evicted_blocks > 0, "no eviction: the comparison is vacuous"


# ---- where the compiled model does not apply -------------------------------------------------


def test_auto_replays_snapshot_policies_on_the_python_model():
    workload = make_workload("synthetic", seed=1, workflows=6)
    config = SimConfig(concurrency=2, gpu_blocks=3000, host_blocks=3000)
    assert compiled.unsupported(workload, "agentkv", config, None) is not None
    with pytest.raises(ValueError, match="compiled cache model does not replay agentkv"):
        simulate(workload, "agentkv", config, model="compiled")
    assert simulate(workload, "agentkv", config).policy == "agentkv"


def test_a_call_naming_a_block_twice_is_replayed_by_the_python_model():
    block = chain_hash(ROOT_HASH, b"x")
    twice = Call("w", "a", (block, block), prompt_tokens=2 * BLOCK_SIZE_TOKENS)
    workload = Workload("repeats", [(twice, twice)])
    config = SimConfig(concurrency=1, gpu_blocks=8)
    assert compiled.unsupported(workload, "lru", config, None) == "a call naming one block twice"
    assert (
        simulate(workload, "lru", config).gpu_hit_blocks
        == simulate(workload, "lru", config, model="python").gpu_hit_blocks
    )


@pytest.mark.parametrize(
    "change",
    [
        {"audit_declines": True},
        {"prefetch_budget_blocks": 4},
        {"codec_roundtrip": True},
    ],
)
def test_settings_the_kernel_does_not_model_fall_back(change):
    workload = make_workload("synthetic", seed=1, workflows=4)
    config = dataclasses.replace(SimConfig(concurrency=1, gpu_blocks=3000), **change)
    assert compiled.unsupported(workload, "lru", config, None) is not None


def test_too_large_a_request_fails_alike():
    workload = make_workload("synthetic", seed=1, workflows=4)
    config = SimConfig(concurrency=1, gpu_blocks=10)
    python = outcome(workload, "lru", config, "python")
    assert python[0] == "ValueError" and "raise the GPU capacity" in python[1]
    assert outcome(workload, "lru", config, "compiled") == python


# ---- Belady's passes -----------------------------------------------------------------------------


def _belady_passes(monkeypatch: pytest.MonkeyPatch, workload: Workload, config: SimConfig) -> int:
    """Belady's passes on the compiled model with up to 3 allowed (each replay is counted, not
    replaced), checked equal to the Python model's report."""
    compiled.warm_up()  # (its replays are not counted)
    passes: list[bool] = []
    replay = compiled._replay

    def counted(trace, config, belady_order, started):
        passes.append(belady_order is not None)
        return replay(trace, config, belady_order, started)

    monkeypatch.setattr(compiled, "_replay", counted)
    fast = simulate(workload, "belady", config, belady_passes=3, model="compiled")
    python = simulate(workload, "belady", config, belady_passes=3, model="python")
    assert _fields(fast) == _fields(python)
    assert fast.records == python.records
    return sum(passes)


def test_belady_stops_at_a_fixed_point_of_the_order(monkeypatch):
    # one call per stream: calls are admitted in stream order whatever hits, so pass 1's order
    # is the one it was told and a second pass would replay it
    calls = [c for stream in make_workload("synthetic", seed=2, workflows=12) for c in stream]
    single = Workload("one call per stream", [(c,) for c in calls])
    config = SimConfig(concurrency=4, gpu_blocks=900, host_blocks=0, record_requests=True)
    assert _belady_passes(monkeypatch, single, config) == 1


def test_belady_passes_again_while_the_order_moves(monkeypatch):
    # chats in a closed loop: pass 1 admits calls in another order than LRU's, pass 2 in pass
    # 1's (so a third would replay pass 2)
    workload = make_workload("group-chat", seed=3, chats=6, max_calls=30)
    largest = max(compiled.dense_trace(workload, BLOCK_SIZE_TOKENS).physical_blocks)
    config = SimConfig(concurrency=4, gpu_blocks=int(largest) + 300, record_requests=True)
    assert _belady_passes(monkeypatch, workload, config) == 2
