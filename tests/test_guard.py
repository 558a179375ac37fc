"""The recency guard (policyd/policies/guard.py): its shadow LRU against a reference LRU, its
windows, and agentkv publishing vLLM's default while the guard holds it."""

from __future__ import annotations

from collections import OrderedDict
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policyd.core.engine import Engine
from policyd.core.types import PrefixHit, RequestFinished, RequestStarted
from policyd.policies.agentkv import AgentKV
from policyd.policies.guard import RecencyGuard


def started(rid: str, blocks: tuple[int, ...], wf: str = "w") -> RequestStarted:
    return RequestStarted(
        ts=0.0, request_id=rid, workflow_id=wf, agent="a", block_hashes=blocks, prompt_tokens=0
    )


def hit(rid: str, blocks: int) -> PrefixHit:
    return PrefixHit(ts=0.0, request_id=rid, gpu_blocks=blocks, host_blocks=0, recomputed_blocks=0)


def reference_prefix_hits(requests: list[tuple[int, ...]], capacity: int) -> list[int]:
    """Prefix hits of a plain LRU of ``capacity`` blocks, every block of a request touched, its
    first block last (vLLM frees a request's blocks tail first)."""
    stack: OrderedDict[int, None] = OrderedDict()
    out = []
    for blocks in requests:
        n = 0
        for b in blocks:
            if b not in stack:
                break
            n += 1
        out.append(n)
        for b in reversed(blocks):
            stack[b] = None
            stack.move_to_end(b)
        while len(stack) > capacity:
            stack.popitem(last=False)
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True), max_size=40),
    st.integers(1, 30),
)
def test_unsampled_shadow_is_exactly_a_reference_lru(
    requests: list[list[int]], capacity: int
) -> None:
    guard = RecencyGuard(window=10**9)
    guard.configure(gpu_blocks=capacity, host_blocks=0)
    assert guard.rate == 1.0
    reqs = [tuple(r) for r in requests]
    expected = reference_prefix_hits(reqs, capacity)
    for i, (blocks, want) in enumerate(zip(reqs, expected, strict=True)):
        guard.observe(started(f"r{i}", blocks))
        assert guard._pending[f"r{i}"][1] == want


def test_the_shadow_samples_both_tiers_past_its_size() -> None:
    guard = RecencyGuard(max_shadow_blocks=1000)
    guard.configure(gpu_blocks=500, host_blocks=4000)
    assert guard.rate == pytest.approx(1000 / 4500)
    guard.observe(started("r", tuple(range(100_000))))
    assert (len(guard._gpu), len(guard._host)) == (111, 889)  # each tier's sampled size
    assert 0.20 < len(guard._pending["r"][0]) / 100_000 < 0.245


_request_ids = count()


def feed(guard: RecencyGuard, n: int, real: int, shadow_blocks: tuple[int, ...]) -> None:
    """``n`` requests re-sending ``shadow_blocks`` (the shadow hits them all after the first);
    the real tier hits ``real`` of them."""
    for _ in range(n):
        rid = f"q{next(_request_ids)}"
        guard.observe(started(rid, shadow_blocks))
        guard.observe(hit(rid, real))


def test_losing_windows_hold_recency_longer_each_time_and_winning_keeps_learning() -> None:
    blocks = tuple(range(100))
    guard = RecencyGuard(window=100, min_window_requests=1, hold=1, max_hold=4, tolerance=0.05)
    guard.configure(gpu_blocks=1000, host_blocks=0)
    feed(guard, 1, 0, blocks)  # warm the shadow (a cold miss for both)
    assert not guard.learned  # starts in recency: a window calibrates
    feed(guard, 1, 100, blocks)  # vLLM's default hits what the shadow says
    assert guard.learned and guard.calibration == pytest.approx(1.0)
    feed(guard, 1, 100, blocks)  # learned ties: stays
    assert guard.learned
    feed(guard, 1, 50, blocks)  # learned loses by half: beyond tolerance and noise
    assert not guard.learned and guard.counters.switches_to_recency == 1
    feed(guard, 1, 100, blocks)  # one window of recency, then a probe
    assert guard.learned and guard.counters.probes == 2
    feed(guard, 1, 50, blocks)  # the probe loses: hold 2 now
    feed(guard, 1, 100, blocks)
    assert not guard.learned
    feed(guard, 1, 100, blocks)
    assert guard.learned
    feed(guard, 3, 97, blocks)  # 3% short: within tolerance, the learned decisions stay
    assert guard.learned and guard.counters.switches_to_recency == 2


def test_calibration_absorbs_the_shadows_bias() -> None:
    blocks = tuple(range(100))
    guard = RecencyGuard(window=100, min_window_requests=1, hold=1, tolerance=0.05)
    guard.configure(gpu_blocks=1000, host_blocks=0)
    feed(guard, 1, 0, blocks)
    feed(guard, 1, 80, blocks)  # vLLM's default hits 80 where the shadow says 100
    assert guard.calibration == pytest.approx(0.8) and guard.learned
    feed(guard, 3, 80, blocks)  # the learned decisions do as well as the default: no switch
    assert guard.learned and guard.counters.switches_to_recency == 0


def test_a_request_without_a_hit_report_is_forgotten() -> None:
    guard = RecencyGuard(window=10)
    guard.configure(gpu_blocks=100, host_blocks=0)
    guard.observe(started("r", (1, 2, 3)))
    guard.observe(RequestFinished(ts=0.0, request_id="r", output_tokens=0))
    assert "r" not in guard._pending


def test_agentkv_publishes_vllms_default_while_the_guard_holds_it() -> None:
    policy = AgentKV(gpu_blocks=64, host_blocks=0)
    engine = Engine(policy)
    assert policy.guard is not None and not policy.guard.learned
    for i in range(3):
        engine.apply_event(started(f"r{i}", (1, 2, 3, 4), wf=f"w{i}"))
    snap = engine.snapshot()
    assert snap.scores == () and snap.retired_workflows == () and snap.pin == ()
    assert snap.write_filter.mode == "none" and snap.host_scores is None
    assert policy.prefetch(8, engine.state) == []
    unguarded = AgentKV(gpu_blocks=64, host_blocks=0, guard=False)
    assert unguarded.guard is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RecencyGuard(window=0)
    with pytest.raises(ValueError):
        RecencyGuard(tolerance=1.0)
    with pytest.raises(ValueError):
        RecencyGuard(hold=4, max_hold=2)
