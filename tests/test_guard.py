"""The recency guard (policyd/policies/guard.py) and its shadows (policies/shadow.py): the
default shadow against a reference two-tier LRU, the learned shadow applying snapshots as the
connector does, the paired verdict, and agentkv publishing vLLM's default while the guard holds
it."""

from __future__ import annotations

import random
from collections import OrderedDict
from itertools import count

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.guard_fidelity import FidelityPoint, measure, published_throughout, table
from experiments.matrix import Source, largest_request
from policyd.core.engine import Engine
from policyd.core.types import (
    PolicySnapshot,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    ScoredBlocks,
    WriteFilter,
    score_map,
)
from policyd.policies import make_policy
from policyd.policies.agentkv import AgentKV
from policyd.policies.guard import FILTER, LEARNED, RECENCY, RecencyGuard
from policyd.policies.shadow import BlockSampler, LruOrder, ShadowTiers
from policyd.sim.replay import SimConfig, Simulator
from policyd.tiers.host_order import HostOrder
from policyd.tiers.view import SnapshotView
from policyd.workloads import make_workload

_request_ids = count()


def started(blocks: tuple[int, ...], wf: str = "w", rid: str | None = None) -> RequestStarted:
    return RequestStarted(
        ts=0.0,
        request_id=rid or f"q{next(_request_ids)}",
        workflow_id=wf,
        agent="a",
        block_hashes=blocks,
        prompt_tokens=0,
    )


def reference_two_tier_lru(
    requests: list[tuple[int, ...]], gpu_capacity: int, host_capacity: int
) -> list[int]:
    """Prefix hits of vLLM's default written plainly: a GPU LRU (a request's blocks touched, its
    first block last, at its start and again at its finish) and vLLM's offloading connector on
    its LRU manager: a request offers every block (after a host load, the blocks past the loaded
    run) and those not stored yet are written, all or none, evicting the least recent blocks it
    does not offer; at its finish the blocks it offered or loaded become the most recent, its
    first block last."""
    gpu: OrderedDict[int, None] = OrderedDict()
    host: OrderedDict[int, None] = OrderedDict()

    def touch(tier: OrderedDict[int, None], blocks: tuple[int, ...], capacity: int) -> None:
        for b in reversed(blocks):
            tier[b] = None
            tier.move_to_end(b)
        while len(tier) > capacity:
            tier.popitem(last=False)

    out = []
    for blocks in requests:
        on_gpu = 0
        while on_gpu < len(blocks) and blocks[on_gpu] in gpu:
            on_gpu += 1
        hits = on_gpu
        while hits < len(blocks) and blocks[hits] in host:
            hits += 1
        out.append(hits)
        if host_capacity:
            loaded = hits > on_gpu
            offered = blocks[hits:] if loaded else blocks
            new = [b for b in offered if b not in host]
            excess = max(0, len(host) + len(new) - host_capacity)
            victims = [b for b in host if b not in offered][:excess]
            if len(victims) == excess:
                for b in victims:
                    del host[b]
                host.update(dict.fromkeys(new))
            for b in reversed(blocks[on_gpu:] if loaded else offered):  # at its finish
                if b in host:
                    host.move_to_end(b)
        touch(gpu, blocks, gpu_capacity)  # started
        touch(gpu, blocks, gpu_capacity)  # finished
    return out


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True), max_size=40),
    st.integers(1, 30),
    st.integers(0, 30),
)
def test_the_default_shadow_unsampled_is_exactly_a_reference_two_tier_lru(
    requests: list[list[int]], gpu_capacity: int, host_capacity: int
) -> None:
    shadow = ShadowTiers()
    shadow.configure(gpu_capacity=gpu_capacity, host_capacity=host_capacity, rate=1.0)
    reqs = [tuple(r) for r in requests]
    expected = reference_two_tier_lru(reqs, gpu_capacity, host_capacity)
    for blocks, want in zip(reqs, expected, strict=True):
        assert shadow.start("r", "w", blocks, tuple(range(len(blocks))), len(blocks)) == want
        shadow.finish("r", blocks)


def test_the_shadows_sample_both_tiers_past_their_size() -> None:
    guard = RecencyGuard(max_shadow_blocks=1000)
    guard.configure(gpu_blocks=500, host_blocks=4000)
    assert guard.rate == pytest.approx(1000 / 4500)
    for i in range(50):  # 100,000 distinct blocks, each request smaller than the host tier
        event = started(tuple(range(2000 * i, 2000 * (i + 1))))
        guard.observe(event)
        if i == 0:  # held while it runs
            assert len(guard.default.gpu.refs) == guard.counters.sampled_refs
        guard.observe(RequestFinished(ts=0.0, request_id=event.request_id, output_tokens=0))
    assert 0.20 < guard.counters.sampled_refs / 100_000 < 0.245
    for shadow in (guard.default, guard.follower):  # each tier's sampled size
        assert (len(shadow.gpu), len(shadow.host)) == (111, 889)


@pytest.mark.parametrize("arm", [RECENCY, LEARNED])
@pytest.mark.parametrize("workload", ["financial", "code-writing", "synthetic"])
def test_the_published_arms_shadow_unsampled_hits_what_the_simulators_tiers_hit(
    workload: str, arm: str
) -> None:
    """The guard judges arms by their shadows, so a shadow must read its arm's real tiers: here
    the simulator's (vLLM's two tiers, checked against the engine), following every block, with
    ``arm`` published throughout, 8 workflows at a time, both tiers as large as the largest
    request. The shadow writes a request's blocks to the host when it finishes, vLLM when its
    prefill ends: close, not equal (within 3.4% at these points)."""
    work = make_workload(workload, seed=0, workflows=8)
    size = largest_request(work)
    policy = published_throughout(arm, 2 * size)
    config = SimConfig(concurrency=8, gpu_blocks=size, host_blocks=size)
    Simulator(work, policy, config).run()
    assert policy.guard is not None
    c = policy.guard.counters
    assert policy.guard.rate == 1.0 and c.real_hits > 1000
    assert c.shadow_hits == pytest.approx(c.real_hits, rel=0.05)


def _drive(shadow: ShadowTiers, requests: list[tuple[int, ...]], prefix: str) -> list[int]:
    hits = []
    for i, blocks in enumerate(requests):
        rid = f"{prefix}{i}"
        hits.append(shadow.start(rid, "w", blocks, tuple(range(len(blocks))), len(blocks)))
        shadow.finish(rid, blocks)
    return hits


@pytest.mark.parametrize("host_ordered", [False, True])
def test_a_forked_shadow_holds_what_its_source_holds_and_goes_on_as_it_would(
    host_ordered: bool,
) -> None:
    """A fork is the real tiers as a switch finds them: the source's GPU blocks in their free
    queue's order, its host blocks from least to most recent (in either host order), a running
    request's blocks and its pending host write. Under vLLM's default it then hits what the
    source hits, request by request."""
    rng = random.Random(5)
    requests = [tuple(rng.sample(range(60), rng.randint(1, 10))) for _ in range(300)]
    source = ShadowTiers(host_ordered=False)
    source.configure(gpu_capacity=24, host_capacity=40, rate=1.0)
    _drive(source, requests[:100], "a")
    running = requests[100]
    source.start("running", "w", running, tuple(range(len(running))), len(running))
    fork = ShadowTiers.forked(source, host_ordered=host_ordered)
    assert list(fork.gpu.free_queue) == list(source.gpu.free_queue)
    assert fork.gpu.refs == source.gpu.refs
    held = list(fork.host.peek_order() if isinstance(fork.host, HostOrder) else fork.host)
    assert held == list(source.host)
    for shadow in (source, fork):
        shadow.finish("running", running)  # its host write, made in both
    assert set(fork.host) == set(source.host)
    assert _drive(fork, requests[101:], "b") == _drive(source, requests[101:], "b")


def test_a_forked_shadow_lets_its_sources_pins_go() -> None:
    """Pins are an arm's own: a fork for another arm holds none of them (they go to the free
    queue's tail, as the connector releases them), and the source keeps its own."""
    source = ShadowTiers()
    source.configure(gpu_capacity=10, host_capacity=0, rate=1.0)
    _drive(source, [(1, 2, 3), (4, 5, 6)], "r")
    source.applier.max_pinned_blocks = 2
    pin = PolicySnapshot(version=1, ts=0.0, ttl_s=5.0, policy="agentkv", pin=(1, 4))
    source.adopt(pin, {})
    source.start("q", "w", (7,), (0,), 1)  # lookups: the plan (its pins) runs
    source.start("q2", "w", (8,), (0,), 1)
    assert source.applier.pinned.keys() == {1, 4} and source.gpu.refs[1] == 1
    fork = ShadowTiers.forked(source, host_ordered=False)
    assert 1 not in fork.gpu.refs and 4 not in fork.gpu.refs and fork.gpu.refs[7] == 1
    assert list(fork.gpu.free_queue)[-2:] == [1, 4] and not fork.applier.pinned
    assert source.applier.pinned.keys() == {1, 4}


def financial_with_journal(*, seed: int, concurrency: int) -> tuple[RecencyGuard, float, float]:
    """Financial, 8 workflows, both tiers of 2,108 blocks: agentkv's guard (its windows
    journalled), agentkv's hit rate and LRU's."""
    work = make_workload("financial", seed=seed, workflows=8)
    config = SimConfig(concurrency=concurrency, gpu_blocks=2108, host_blocks=2108)
    policy = AgentKV()
    assert policy.guard is not None
    policy.guard.journal = []
    report = Simulator(work, policy, config).run()
    lru = Simulator(work, make_policy("lru"), config).run()
    return policy.guard, report.hit_rate, lru.hit_rate


def test_a_nominated_arm_is_published_only_after_its_trial_wins() -> None:
    """Financial, 8 workflows at a time, both tiers of 2,108 blocks, seed 0: the learned arm's
    shadow wins two windows on what it kept while vLLM's default was published, then loses on
    what it let go. Nominated, it is tried from the default's tiers, where the trial never wins,
    so it is never published: agentkv hits exactly what LRU hits (0.802x LRU when the nominee
    was published at once)."""
    guard, agentkv, lru = financial_with_journal(seed=0, concurrency=8)
    c = guard.counters
    learned_won = [w for w in guard.journal or () if w.hits[LEARNED] > w.hits[RECENCY]]
    assert learned_won and c.trials >= 1
    assert c.switches_to_learned == c.switches_to_filter == 0
    assert agentkv == lru


def test_two_winning_arms_taking_turns_at_the_lead_each_keep_their_trial() -> None:
    """Financial, 8 workflows, C=4, both tiers of 2,108 blocks, seed 1: the filter and the
    learned shadows both beat vLLM's default, and the one ahead changes from window to window.
    Each nominated arm has a trial of its own, so one of them wins it and is published (with one
    trial at a time, for the arm furthest ahead, each change of lead restarted it: seven trials
    and no switch in the run's 14 windows)."""
    guard, agentkv, lru = financial_with_journal(seed=1, concurrency=4)
    before = [w for w in guard.journal or () if w.published == RECENCY]
    ahead = {max((FILTER, LEARNED), key=w.hits.__getitem__) for w in before
             if max(w.hits[FILTER], w.hits[LEARNED]) > w.hits[RECENCY]}  # fmt: skip
    assert ahead == {FILTER, LEARNED}
    c = guard.counters
    assert c.switches_to_filter + c.switches_to_learned >= 1
    assert agentkv > 1.05 * lru


def test_the_published_shadow_follows_the_real_tiers_across_a_switch() -> None:
    """At a switch the new arm's shadow is forked from the published one's: the real tiers'
    contents, not what the arm built while it was not published. Financial, seed 1, both tiers
    of 4,216 blocks, every block followed: the published shadow's hits read the real tiers'
    within 5% over the run (28% above them when the arms' own shadows were kept)."""
    work = make_workload("financial", seed=1, workflows=8)
    config = SimConfig(concurrency=8, gpu_blocks=4216, host_blocks=4216)
    policy = AgentKV()
    Simulator(work, policy, config).run()
    assert policy.guard is not None
    c = policy.guard.counters
    assert c.switches_to_learned + c.switches_to_filter >= 1 and c.real_hits > 5000
    assert c.shadow_hits == pytest.approx(c.real_hits, rel=0.05)


def test_the_learned_shadow_ranks_only_what_its_gpu_caches_highest_first() -> None:
    shadow = ShadowTiers()
    shadow.configure(gpu_capacity=10, host_capacity=0, rate=1.0)
    shadow.start("r", "w", (1, 2, 3), (0, 1, 2), 3)
    shadow.finish("r", (1, 2, 3))
    snap = PolicySnapshot(version=1, ts=0.0, ttl_s=5.0, policy="agentkv")
    shadow.adopt(snap, {1: 0.5, 3: 2.0, 99: 9.0, 2: -1.0})
    assert shadow.view is not None and shadow.view.top == (3, 1)


A = (1, 2, 3, 4, 5)  # a prompt re-sent now and then
_fresh = count(1000)


def scan(blocks: int = 5) -> tuple[int, ...]:
    return tuple(next(_fresh) for _ in range(blocks))


def run(
    guard: RecencyGuard,
    snapshot: PolicySnapshot,
    rounds: int,
    *,
    resend: bool = False,
    arm: str = "learned",
    scan_blocks: int = 5,
) -> None:
    """``snapshot`` adopted by ``arm``, then rounds of: ``A``, two scans of ``scan_blocks`` new
    blocks (``resend``: a new prompt, sent twice)."""
    host = None if snapshot.host_scores is None else score_map(snapshot.host_scores)
    guard.adopt(snapshot, score_map(snapshot.scores), host, arm=arm)
    for _ in range(rounds):
        fresh = scan()
        for blocks in (fresh, fresh) if resend else (A, scan(scan_blocks), scan(scan_blocks)):
            event = started(blocks)
            guard.observe(event)
            guard.observe(RequestFinished(ts=0.0, request_id=event.request_id, output_tokens=0))


def small_guard(arms: tuple[str, ...] = ("learned",), pinned: str | None = None) -> RecencyGuard:
    guard = RecencyGuard(arms=arms, window=5, min_window_requests=1, pinned=pinned)
    guard.configure(gpu_blocks=1, host_blocks=10)  # the host tier holds A and one scan, not two
    return guard


KEEP_A = PolicySnapshot(
    version=1, ts=0.0, ttl_s=5.0, policy="agentkv", host_scores=(ScoredBlocks(1.0, A),)
)
DECLINE_LARGE = PolicySnapshot(  # a write filter alone: A's five new blocks, never a larger scan
    version=3,
    ts=0.0,
    ttl_s=5.0,
    policy="agentkv",
    write_filter=WriteFilter(mode="fixed", max_new_blocks=len(A)),
)
DECLINE_ALL = PolicySnapshot(
    version=2,
    ts=0.0,
    ttl_s=5.0,
    policy="agentkv",
    write_filter=WriteFilter(mode="fixed", max_new_blocks=0),
)


def test_the_learned_shadow_applies_the_host_order_and_wins_the_learned_snapshots() -> None:
    guard = small_guard()
    assert not guard.learned  # vLLM's default until the sample says the learned decisions win
    run(guard, KEEP_A, rounds=6)
    c = guard.counters
    # the scans push A out of the default's host tier; the learned order keeps it
    assert c.learned_shadow_hits >= 4 * len(A) and c.default_shadow_hits == 0
    assert guard.learned and c.switches_to_learned == 1 and c.recency_windows >= 2


def test_a_losing_write_filter_switches_to_recency_and_back_when_it_wins_again() -> None:
    guard = small_guard()
    run(guard, KEEP_A, rounds=6)
    assert guard.learned
    run(guard, DECLINE_ALL, rounds=1, resend=True)  # one losing window alone switches nothing
    assert guard.learned
    run(guard, DECLINE_ALL, rounds=5, resend=True)  # the learned shadow stores no new prompt
    assert not guard.learned and guard.counters.switches_to_recency == 1
    run(guard, KEEP_A, rounds=8)  # followed while recency is published: back without a probe
    assert guard.learned and guard.counters.switches_to_learned == 2


def test_past_wins_do_not_shield_a_new_loss() -> None:
    guard = small_guard()
    run(guard, KEEP_A, rounds=30)
    wins = guard.counters.learned_shadow_hits - guard.counters.default_shadow_hits
    assert wins > 100 and guard.learned
    run(guard, DECLINE_ALL, rounds=4, resend=True)
    assert not guard.learned


def test_a_tie_keeps_vllms_default() -> None:
    guard = small_guard()
    empty = PolicySnapshot(version=1, ts=0.0, ttl_s=5.0, policy="agentkv")
    run(guard, empty, rounds=10)
    c = guard.counters
    assert c.learned_shadow_hits == c.default_shadow_hits and not guard.learned
    assert c.windows >= 10 and c.switches_to_learned == 0


def test_the_arm_that_wins_is_published_and_a_losing_one_never() -> None:
    guard = small_guard(arms=("filter", "learned"))
    run(guard, DECLINE_ALL, rounds=0)  # the learned arm stores no new prompt: it loses
    # scans of 8 blocks push A out of vLLM's LRU host tier; the filter arm declines them and
    # keeps A: it wins
    run(guard, DECLINE_LARGE, rounds=8, arm="filter", scan_blocks=8)
    c = guard.counters
    assert guard.published == "filter" and not guard.learned
    assert c.switches_to_filter == 1 and c.switches_to_learned == 0
    assert c.filter_shadow_hits > c.default_shadow_hits >= c.learned_shadow_hits
    assert guard.state()["mode"] == "filter"
    # now the learned arm keeps A too (by its host order), and hits what the filter hits
    run(guard, KEEP_A, rounds=12, scan_blocks=8)
    assert guard.published == "filter"  # a tie with the published arm switches nothing


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_lru_order_evicts_what_host_order_evicts_under_views_that_give_the_host_no_order(
    seed: int,
) -> None:
    """Differential: ``LruOrder`` (the guard's default and filter shadows) against ``HostOrder``
    under no view or a write filter alone, set and partly re-keyed at random times: the same
    evictions, keys inserted again and touched included."""
    rng = random.Random(seed)
    order: HostOrder[int] = HostOrder(lambda k: k)
    lru = LruOrder()
    views = [None, SnapshotView.of(DECLINE_LARGE)]  # no order, or a write filter alone
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            key = rng.randrange(40)
            order.insert(key, evictable=True)
            lru.insert(key)
        elif op < 0.6:
            keys = rng.sample(range(40), rng.randint(1, 5))
            order.touch(keys)
            lru.touch(keys)
        elif op < 0.7:
            order.set_view(rng.choice(views))
            order.rekey(rng.randint(0, 3))
        else:
            n = rng.randint(0, 4)
            protected = set(rng.sample(range(40), rng.randint(0, 3)))
            assert lru.evict(n, protected) == order.evict(n, protected)
        assert len(lru) == len(order) and all(key in lru for key in order)


def test_only_the_learned_shadow_orders_its_host_tier() -> None:
    """vLLM's default and the write filter alone never order the host tier: their shadows keep
    it in ``LruOrder`` (the same evictions: the differential test above) and refuse a snapshot that
    would order it; the learned arm's shadow applies its host order (``HostOrder``)."""
    guard = small_guard(arms=("filter", "learned"))
    kinds = {arm: type(shadow.host) for arm, shadow in guard.shadows.items()}
    assert kinds == {"recency": LruOrder, "filter": LruOrder, "learned": HostOrder}
    guard.adopt(DECLINE_LARGE, {}, arm="filter")  # a write filter alone: followed
    assert guard.shadows["filter"].view is not None
    with pytest.raises(ValueError, match="does not order the host tier"):
        guard.adopt(KEEP_A, {}, score_map(KEEP_A.host_scores or ()), arm="filter")


def test_a_pinned_guard_publishes_its_arm_whatever_the_windows_say() -> None:
    guard = small_guard(pinned="recency")
    run(guard, KEEP_A, rounds=6)  # the learned shadow wins, as in the test above
    c = guard.counters
    assert c.learned_shadow_hits >= 4 * len(A) and c.default_shadow_hits == 0
    assert guard.published == "recency" and c.switches_to_learned == 0
    with pytest.raises(ValueError, match="pinned"):
        RecencyGuard(arms=("learned",), pinned="filter")


def test_the_arms_of_a_guard_are_checked() -> None:
    for arms in ((), ("recency",), ("learned", "learned"), ("bandit",)):
        with pytest.raises(ValueError, match="arms"):
            RecencyGuard(arms=arms)


def test_the_retired_blocks_leave_the_learned_shadows_gpu_first() -> None:
    shadow = ShadowTiers()
    shadow.configure(gpu_capacity=10, host_capacity=0, rate=1.0)
    shadow.start("r1", "done", (1, 2, 3), (0, 1, 2), 3)
    shadow.finish("r1", (1, 2, 3))
    shadow.start("r2", "live", (7, 8), (0, 1), 2)  # still running
    retire = PolicySnapshot(
        version=1, ts=0.0, ttl_s=5.0, policy="agentkv", retired_workflows=("done",)
    )
    shadow.adopt(retire, {})
    for i in range(3):  # the plan runs at the next lookups, within the connector's budget
        shadow.start(f"r{3 + i}", "other", (20 + i,), (0,), 1)
    assert {1, 2, 3}.isdisjoint(shadow.gpu.free_queue) and {7, 8} <= shadow.gpu.refs.keys()
    assert shadow.applier.counters.retired_evicted_blocks == 3


def test_the_real_hits_are_compared_with_the_published_shadow() -> None:
    guard = RecencyGuard(window=10**9)
    guard.configure(gpu_blocks=100, host_blocks=0)
    for i in range(3):
        event = started((1, 2, 3, 4), rid=f"r{i}")
        guard.observe(event)
        guard.observe(
            PrefixHit(ts=0.0, request_id=f"r{i}", gpu_blocks=2, host_blocks=0, recomputed_blocks=2)
        )
        guard.observe(RequestFinished(ts=0.0, request_id=f"r{i}", output_tokens=0))
    assert (guard.counters.real_hits, guard.counters.shadow_hits) == (6, 8)


def test_a_request_without_a_hit_report_is_forgotten() -> None:
    guard = RecencyGuard(window=10)
    guard.configure(gpu_blocks=100, host_blocks=0)
    guard.observe(started((1, 2, 3), rid="r"))
    guard.observe(RequestFinished(ts=0.0, request_id="r", output_tokens=0))
    assert "r" not in guard._pending and "r" not in guard._running


def test_agentkv_publishes_vllms_default_while_the_guard_holds_it() -> None:
    policy = AgentKV(gpu_blocks=64, host_blocks=0)
    engine = Engine(policy)
    assert policy.guard is not None and not policy.guard.learned
    for i in range(3):
        engine.apply_event(started((1, 2, 3, 4), wf=f"w{i}", rid=f"r{i}"))
    snap = engine.snapshot()
    assert snap.scores == () and snap.retired_workflows == () and snap.pin == ()
    assert snap.write_filter.mode == "none" and snap.host_scores is None
    assert policy.prefetch(8, engine.state) == []
    assert policy.guard.follower.view is not None  # the learned shadow follows it all the same
    unguarded = AgentKV(gpu_blocks=64, host_blocks=0, guard=False)
    assert unguarded.guard is None


def test_agentkv_publishes_the_write_filter_alone_in_the_filter_arm(monkeypatch) -> None:
    policy = AgentKV(gpu_blocks=64, host_blocks=64)
    engine = Engine(policy)
    assert policy.guard is not None and policy.guard.arms == ("recency", "filter", "learned")
    for i in range(3):
        engine.apply_event(started((1, 2, 3, 4), wf=f"w{i}", rid=f"r{i}"))
    learned = engine.snapshot()
    assert learned.write_filter.mode == "none"  # vLLM's default, published so far
    policy.guard.published = "filter"  # (as a window's verdict would set it)
    snap = engine.snapshot()
    assert snap.write_filter.mode == "conditioned" and snap.write_filter.max_new_blocks > 0
    assert snap.scores == () and snap.host_scores is None and snap.retired_workflows == ()
    assert policy.prefetch(8, engine.state) == []
    refill, extension = tuple(range(100, 10_100)), (1, 2, 3, 4, 5)
    for pressure in (False, True):  # (the pressure signal forced: the rule is under test)
        monkeypatch.setattr(policy.admission, "pressure", lambda state, now, p=pressure: p)
        assert policy.admit("r0", extension, engine.state).block_hashes == extension
        refilled = policy.admit("r0", refill, engine.state)
        assert refilled.block_hashes == (() if pressure else refill)
    assert policy.guard.shadows["filter"].view is not None  # its shadow follows its snapshots


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RecencyGuard(window=0)
    with pytest.raises(ValueError):
        RecencyGuard(tolerance=1.0)
    with pytest.raises(ValueError):
        RecencyGuard(confidence=-1.0)
    with pytest.raises(ValueError):
        BlockSampler().configure(0.0)


def test_guard_fidelity_reports_each_arm_against_lru_and_its_shadow() -> None:
    """``policyd guard-fidelity``'s measurement: vLLM's default published throughout is LRU
    exactly, and each shadow's reading is a ratio of real hits."""
    row = measure(FidelityPoint(Source("synthetic"), 4), streams=4, seed=0)
    assert row.vs_lru[RECENCY] == 1.0
    assert set(row.read) == set(row.vs_lru) == {RECENCY, FILTER, LEARNED}
    assert all(0.9 < r < 1.1 for r in row.read.values()), row.read
    assert "synthetic" in str(table([row]).columns[0]._cells)
