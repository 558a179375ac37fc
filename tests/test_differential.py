"""Differential tests: our simulator's single-tier LRU and Belady hit counts equal independent
references' exactly.

The setting is the references' abstraction: concurrency 1 (calls reach the cache in trace
order), the GPU tier only, no last-token recompute, block-aligned calls (``cache_view``). LRU
runs in vLLM's shared running space (and the separate one); Belady in the separate one, where
capacity counts cached blocks and a computed block may bypass the cache. ``kvcache_sim`` counts
hits over a window that starts after the cache first fills; we sum our per-request records over
the same window. Every comparison also checks that the cache evicted, so equality is not
vacuous.

Traces: seeded synthetic agent workloads, random prefix trees (shared system prompts,
divergence, exact repeats, continuations through cached output blocks), equal-size documents
for libCacheSim's plain LRU, and the last 210 requests of Mooncake's synthetic trace, where its
reuse concentrates (slow; ``POLICYD_TEST_MOONCAKE_CALLS=all`` replays the whole trace, which
takes about fifteen minutes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from policyd.core.types import BLOCK_SIZE_TOKENS
from policyd.sim.cache import RunningSpace
from policyd.sim.replay import SimConfig, simulate
from policyd.sim.report import Report
from policyd.traces.location import MOONCAKE, TRACES_ENV, local_trace
from policyd.traces.mooncake import SUB_BLOCKS, mooncake_workload, read_mooncake
from policyd.workloads import make_workload
from policyd.workloads.calls import ROOT_HASH, Call, chain_hash, sequential
from tests.reference import (
    KvcacheReference,
    WindowHits,
    cache_view,
    cached_blocks,
    check_aligned,
    flatten,
    libcachesim_lru_hits,
    max_cached_blocks,
)

MOONCAKE_TRACE = local_trace(MOONCAKE)  # the public trace, when $AGENTKV_TRACES holds it
MOONCAKE_CALLS = os.environ.get("POLICYD_TEST_MOONCAKE_CALLS", "210")  # the last ones, or "all"
MOONCAKE_LARGEST_CALL_BLOCKS = 11_961  # line 3,792: input_length 191,378 tokens
EXCERPT = Path(__file__).parent / "data" / "mooncake_excerpt.jsonl"

# ---- running both sides ------------------------------------------------------------------------

REFERENCE_POLICY = {"lru": "lru", "belady": "optimal"}


@dataclass(frozen=True, slots=True)
class Outcome:
    """One policy at one capacity: our hits over the reference's window, and the reference's."""

    policy: str
    running_space: RunningSpace
    ours_hit_blocks: int
    ours_window_blocks: int
    ours_evicted_blocks: int
    reference: WindowHits

    def check(self) -> None:
        ref = self.reference
        where = f"{self.policy}/{self.running_space} at {ref.capacity_blocks} blocks"
        assert ref.mode == "fixed_window", f"{where}: reference {ref.mode}"
        assert self.ours_window_blocks == ref.total_blocks, f"{where}: windows differ"
        assert self.ours_evicted_blocks > 0, f"{where}: no eviction, the comparison is vacuous"
        assert self.ours_hit_blocks == ref.hit_blocks, (
            f"{where}: ours {self.ours_hit_blocks} hit blocks, reference {ref.hit_blocks} "
            f"(window from call {ref.warmup_requests}, {ref.total_blocks} blocks)"
        )


def replay(
    calls: Sequence[Call], policy: str, capacity_blocks: int, running_space: RunningSpace
) -> Report:
    """Our simulator on ``calls`` in order, one tier of ``capacity_blocks``."""
    config = SimConfig(
        concurrency=1,
        gpu_blocks=capacity_blocks,
        host_blocks=0,
        recompute_last_token=False,
        running_space=running_space,
        record_requests=True,
    )
    report = simulate(sequential(calls), policy, config)
    assert [r.prompt_blocks for r in report.records] == [len(c.block_hashes) for c in calls]
    return report


def compare(
    ref: KvcacheReference,
    policy: str,
    capacity_blocks: int,
    running_space: RunningSpace | None = None,
) -> Outcome:
    space: RunningSpace = running_space or ("separate" if policy == "belady" else "shared")
    report = replay(ref.calls, policy, capacity_blocks, space)
    reference = ref.hits(capacity_blocks, REFERENCE_POLICY[policy])
    window = ref.calls[reference.warmup_requests :]
    return Outcome(
        policy=policy,
        running_space=space,
        ours_hit_blocks=sum(r.gpu_hit_blocks for r in report.records[reference.warmup_requests :]),
        ours_window_blocks=sum(len(cached_blocks(c)) for c in window),
        ours_evicted_blocks=report.gpu_evicted_blocks,
        reference=reference,
    )


# ---- traces ------------------------------------------------------------------------------------


def synthetic_calls(seed: int, workflows: int = 16) -> list[Call]:
    """The seeded synthetic agent workload, workflow after workflow, block-aligned."""
    return cache_view(flatten(make_workload("synthetic", seed=seed, workflows=workflows)))


SYSTEM_PROMPT_BLOCKS = (3, 1, 6)
Op = tuple[str, int, int, int, int]  # kind, pick, cut, new blocks, output blocks
KINDS = ("fresh", "repeat", "continue", "diverge")


def tree_calls(ops: Sequence[Op], max_blocks: int = 24) -> list[Call]:
    """Prompts built the way agent traffic reuses context, one per op:

    * ``fresh``: a system prompt (``pick``) and ``new`` blocks of its own;
    * ``repeat``: an earlier prompt (``pick``) exactly;
    * ``continue``: an earlier prompt, its output, then ``new`` blocks (a conversation);
    * ``diverge``: the first ``cut`` blocks of an earlier prompt, then ``new`` blocks.

    Prompts are cut to ``max_blocks``; each call outputs ``out`` fresh blocks (cached at its
    end; a later ``continue`` may reuse them).
    """
    keys = count()

    def grow(prefix: tuple[int, ...], n: int) -> tuple[int, ...]:
        parent = prefix[-1] if prefix else ROOT_HASH
        new: list[int] = []
        for _ in range(n):
            parent = chain_hash(parent, f"tree:{next(keys)}".encode())
            new.append(parent)
        return prefix + tuple(new)

    systems = [grow((), n) for n in SYSTEM_PROMPT_BLOCKS]
    history: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # (prompt, output)
    calls: list[Call] = []
    for i, (kind, pick, cut, new, out) in enumerate(ops):
        if not history or kind == "fresh":
            prompt = grow(systems[pick % len(systems)], max(1, new))
        else:
            earlier, output = history[pick % len(history)]
            if kind == "repeat":
                prompt = earlier
            elif kind == "continue":
                prompt = grow(earlier + output, new)
            else:
                prompt = grow(earlier[: cut % len(earlier)], max(1, new))
        prompt = prompt[:max_blocks]
        output = grow(prompt, out)[len(prompt) :]
        history.append((prompt, output))
        calls.append(
            Call(
                workflow_id=f"t{i}",
                agent="tree",
                block_hashes=prompt,
                prompt_tokens=BLOCK_SIZE_TOKENS * len(prompt),
                output_tokens=BLOCK_SIZE_TOKENS * len(output) + (1 if output else 0),
                output_block_hashes=output,
            )
        )
    return calls


def random_ops(seed: int, n_calls: int) -> list[Op]:
    rng = random.Random(seed)
    return [
        (
            rng.choices(KINDS, weights=(2, 3, 3, 3))[0],
            rng.randrange(1 << 16),
            rng.randrange(1 << 16),
            rng.randint(0, 8),
            rng.choice((0, 0, 1, 2)),
        )
        for _ in range(n_calls)
    ]


def document_calls(seed: int, documents: int, document_blocks: int, n_calls: int) -> list[Call]:
    """Calls that each send one of ``documents`` disjoint prompts of ``document_blocks``
    blocks, popular ones more often (Zipf-like): with a capacity that is a multiple of
    ``document_blocks``, LRU caches or evicts a whole document at once."""
    rng = random.Random(seed)
    docs: list[tuple[int, ...]] = []
    for d in range(documents):
        parent, blocks = ROOT_HASH, []
        for j in range(document_blocks):
            parent = chain_hash(parent, f"doc:{d}:{j}".encode())
            blocks.append(parent)
        docs.append(tuple(blocks))
    weights = [1 / (d + 1) for d in range(documents)]
    return [
        Call(
            workflow_id=f"d{i}",
            agent="doc",
            block_hashes=doc,
            prompt_tokens=BLOCK_SIZE_TOKENS * document_blocks,
        )
        for i, doc in enumerate(rng.choices(docs, weights=weights, k=n_calls))
    ]


# ---- (a) seeded synthetic and random traces ---------------------------------------------------

SYNTHETIC_SEEDS = (0, 1, 2)
CAPACITY_FACTORS = (1, 2, 4, 8)  # x the largest call: tight to roomy


@pytest.fixture(scope="module", params=SYNTHETIC_SEEDS, ids=lambda s: f"seed{s}")
def synthetic(request: pytest.FixtureRequest) -> KvcacheReference:
    return KvcacheReference(synthetic_calls(request.param))


@pytest.mark.parametrize("factor", CAPACITY_FACTORS)
@pytest.mark.parametrize("running_space", ["shared", "separate"])
def test_synthetic_lru_equals_reference(synthetic, running_space, factor):
    capacity = factor * max_cached_blocks(synthetic.calls)
    compare(synthetic, "lru", capacity, running_space).check()


@pytest.mark.parametrize("factor", CAPACITY_FACTORS)
def test_synthetic_belady_equals_reference(synthetic, factor):
    capacity = factor * max_cached_blocks(synthetic.calls)
    compare(synthetic, "belady", capacity).check()


TREE_SEEDS = (10, 11, 12)


@pytest.fixture(scope="module", params=TREE_SEEDS, ids=lambda s: f"seed{s}")
def tree(request: pytest.FixtureRequest) -> KvcacheReference:
    return KvcacheReference(tree_calls(random_ops(request.param, 300)))


def tree_capacities(ref: KvcacheReference) -> list[int]:
    """From the largest call to a third of the distinct blocks."""
    low, high = max_cached_blocks(ref.calls), ref.distinct_blocks // 3
    return sorted({low, low + 1, (2 * low + high) // 3, high})


def test_tree_traces_exercise_prefix_reuse(tree):
    """The generator makes what the comparison needs: partial prefix hits and reused outputs."""
    calls = tree.calls
    report = replay(calls, "lru", tree.distinct_blocks, "shared")  # never evicts
    partial = [r for r in report.records if 0 < r.gpu_hit_blocks < r.prompt_blocks]
    full = [r for r in report.records if r.gpu_hit_blocks == r.prompt_blocks]
    outputs = {b for c in calls for b in c.output_block_hashes}
    assert len(partial) > 10
    assert len(full) > 10
    assert any(outputs.intersection(c.block_hashes) for c in calls)


@pytest.mark.parametrize("running_space", ["shared", "separate"])
def test_tree_lru_equals_reference(tree, running_space):
    for capacity in tree_capacities(tree):
        compare(tree, "lru", capacity, running_space).check()


def test_tree_belady_equals_reference(tree):
    for capacity in tree_capacities(tree):
        compare(tree, "belady", capacity).check()


@st.composite
def tree_cases(draw: st.DrawFn) -> tuple[KvcacheReference, int]:
    """A small random prefix-tree trace and a capacity between its largest call and its
    distinct blocks, leaving calls after the cache fills."""
    op = st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 63),
        st.integers(0, 63),
        st.integers(0, 6),
        st.integers(0, 2),
    )
    calls = tree_calls(draw(st.lists(op, min_size=3, max_size=40)), max_blocks=10)
    ref = KvcacheReference(calls)
    low = max_cached_blocks(calls)
    assume(ref.distinct_blocks > low)
    capacity = draw(st.integers(low, ref.distinct_blocks - 1))
    fill = ref.fill_request(capacity)
    assume(fill is not None and fill + 1 < len(calls))
    return ref, capacity


def check_case(ref: KvcacheReference, capacity: int, policy: str, space: RunningSpace) -> None:
    outcome = compare(ref, policy, capacity, space)
    assume(outcome.ours_evicted_blocks > 0)
    outcome.check()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=tree_cases(), space=st.sampled_from(["shared", "separate"]))
def test_lru_equals_reference_on_any_small_tree(case, space):
    ref, capacity = case
    check_case(ref, capacity, "lru", space)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(case=tree_cases())
def test_belady_equals_reference_on_any_small_tree(case):
    ref, capacity = case
    check_case(ref, capacity, "belady", "separate")


def one_block_calls(*contents: str) -> list[Call]:
    blocks = [chain_hash(ROOT_HASH, c.encode()) for c in contents]
    return [
        Call(workflow_id=f"r{i}", agent="a", block_hashes=(b,), prompt_tokens=BLOCK_SIZE_TOKENS)
        for i, b in enumerate(blocks)
    ]


def test_belady_caches_a_first_seen_block_that_is_reused():
    """Scenario: a cache of 2 blocks sees one-block prompts A, B, C, C. A and B are never used
    again, so at the first C Belady evicts one of them to cache C, and the second C hits. The
    reference counts that hit; ours bypasses C the first time (its next use looks "never") and
    caches it the second time, evicting A (one eviction, no hit)."""
    calls = one_block_calls("A", "B", "C", "C")
    reference = KvcacheReference(calls).hits(2, "optimal")
    assert (reference.warmup_requests, reference.hit_blocks) == (2, 1)
    report = replay(calls, "belady", 2, "separate")
    assert [r.gpu_hit_blocks for r in report.records] == [0, 0, 0, 1]


# ---- libCacheSim: plain LRU where prefixes do not matter ---------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("documents_cached", [1, 3, 8])
def test_lru_equals_libcachesim_per_call_on_whole_documents(seed, documents_cached):
    document_blocks = 7
    calls = document_calls(seed, documents=24, document_blocks=document_blocks, n_calls=400)
    capacity = documents_cached * document_blocks
    expected = libcachesim_lru_hits(calls, capacity)
    report = replay(calls, "lru", capacity, "shared")
    assert [r.gpu_hit_blocks for r in report.records] == expected
    assert report.gpu_evicted_blocks > 0
    assert 0 < sum(expected) < sum(len(c.block_hashes) for c in calls)
    # the third opinion, on the same trace
    compare(KvcacheReference(calls), "lru", capacity).check()


def test_libcachesim_is_not_a_prefix_reference():
    """Why libCacheSim gets whole documents only. Scenario: a cache of 3 blocks; prompts
    A1 A2, B, A1 A2 A3. After B, the queue (least recent first) is A2 A1 B. The third prompt
    hits A1 A2 in our model (a request takes its prefix before anything is evicted). A plain LRU
    fed the blocks tail first inserts A3 by evicting A2, then misses A2 and evicts A1, then
    misses A1: no hit."""
    a = one_block_calls("A1")[0].block_hashes[0]
    a2 = chain_hash(a, b"A2")
    a3 = chain_hash(a2, b"A3")
    b = one_block_calls("B")[0]
    calls = [
        Call(workflow_id="r0", agent="a", block_hashes=(a, a2), prompt_tokens=32),
        b,
        Call(workflow_id="r2", agent="a", block_hashes=(a, a2, a3), prompt_tokens=48),
    ]
    assert libcachesim_lru_hits(calls, 3) == [0, 0, 0]
    assert [r.gpu_hit_blocks for r in replay(calls, "lru", 3, "shared").records] == [0, 0, 2]


def test_reference_adapters_refuse_unaligned_calls():
    call = one_block_calls("A")[0]
    with pytest.raises(ValueError, match="not block-aligned"):
        check_aligned([dataclasses.replace(call, prompt_tokens=20)])
    with pytest.raises(ValueError, match="not block-aligned"):
        check_aligned([dataclasses.replace(call, output_tokens=16)])  # output blocks not given
    first = dataclasses.replace(call, output_tokens=33, output_block_hashes=(1, 2))
    again = dataclasses.replace(call, output_tokens=17, output_block_hashes=(2,))
    with pytest.raises(ValueError, match="outputs blocks referenced before"):
        check_aligned([first, again])
    check_aligned(cache_view([dataclasses.replace(call, prompt_tokens=20, output_tokens=5)]))


# ---- the Mooncake reader -----------------------------------------------------------------------


def expected_hashes(ids: Sequence[int], input_tokens: int) -> tuple[int, ...]:
    """The documented scheme, spelled out: sub-block j of 512-block x is
    chain_hash(previous, b"mooncake:x:j"); full 16-token blocks within input_length only."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for x in ids:
        for j in range(SUB_BLOCKS):
            parent = chain_hash(parent, f"mooncake:{x}:{j}".encode())
            hashes.append(parent)
    return tuple(hashes[: input_tokens // BLOCK_SIZE_TOKENS])


def test_mooncake_reader_makes_vllm_blocks():
    records = [json.loads(line) for line in EXCERPT.read_text().splitlines()]
    calls = list(read_mooncake(EXCERPT))
    assert len(calls) == len(records) == 9
    for i, (call, record) in enumerate(zip(calls, records, strict=True)):
        assert call.block_hashes == expected_hashes(record["hash_ids"], record["input_length"])
        assert len(call.block_hashes) == record["input_length"] // BLOCK_SIZE_TOKENS
        assert call.prompt_tokens == record["input_length"]
        assert call.output_tokens == record["output_length"]
        assert call.hints == {"timestamp_ms": record["timestamp"]}
        assert (call.workflow_id, call.agent) == (f"req{i}", "mooncake")
    # 28, 42, 2752, 44, 2754, 2752, 2758, 44, 13 tokens
    assert [len(c.block_hashes) for c in calls] == [1, 2, 172, 2, 172, 172, 172, 2, 0]
    assert calls[2].block_hashes == calls[5].block_hashes  # the same prompt, twice
    assert calls[3].block_hashes == calls[7].block_hashes
    shared = 5 * SUB_BLOCKS  # five equal 512-blocks, then a different sixth
    for other in (calls[4], calls[6]):
        assert other.block_hashes[:shared] == calls[2].block_hashes[:shared]
        assert other.block_hashes[shared] != calls[2].block_hashes[shared]


def test_mooncake_workload_is_one_stream_per_call():
    workload = mooncake_workload(EXCERPT, limit=4)
    assert [len(s) for s in workload] == [1, 1, 1, 1]
    assert [s[0].workflow_id for s in workload] == ["req0", "req1", "req2", "req3"]
    assert list(read_mooncake(EXCERPT, limit=0)) == []


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "'input_length'"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "'input"),
        ('{"timestamp": 0, "input_length": 16, "output_length": 1.5, "hash_ids": [1]}', "'outp"),
        ('{"input_length": 16, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
        ('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": 1}', "'hash_"),
        ('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [true]}', "'ha"),
        ('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": ["a"]}', "'ha"),
        ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1]}', "needs 2"),
        ('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1, 2]}', "needs 1"),
    ],
)
def test_mooncake_reader_names_the_malformed_line(tmp_path, line, problem):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{good}\n\n{line}\n{good}\n")  # a blank line still counts
    reader = read_mooncake(path)
    assert next(reader).prompt_tokens == 600  # streamed: the good line comes first
    with pytest.raises(ValueError, match="line 3") as info:
        next(reader)
    assert problem in str(info.value)


# ---- (b) the Mooncake trace --------------------------------------------------------------------

# from the largest call to where LRU still misses reuse that Belady keeps (at 80K they meet)
MOONCAKE_CAPACITIES = (12_000, 36_000, 64_000)


@pytest.fixture(scope="module")
def mooncake_trace() -> list[Call]:
    """Every call of the trace (read once: ~4 s)."""
    if MOONCAKE_TRACE is None or not MOONCAKE_TRACE.exists():
        pytest.skip(f"the Mooncake trace is not here (${TRACES_ENV}/{MOONCAKE})")
    return list(read_mooncake(MOONCAKE_TRACE))


@pytest.fixture(scope="module")
def mooncake(mooncake_trace: list[Call]) -> KvcacheReference:
    """The last ``POLICYD_TEST_MOONCAKE_CALLS`` calls, block-aligned (the last 210: 306K block
    references, 115K distinct, 62% reusable; the largest call, 11,961 blocks, is among them)."""
    start = 0 if MOONCAKE_CALLS == "all" else len(mooncake_trace) - int(MOONCAKE_CALLS)
    return KvcacheReference(cache_view(mooncake_trace[start:]))


@pytest.mark.slow
def test_mooncake_reader_reads_the_whole_trace(mooncake_trace):
    refs = sum(len(c.block_hashes) for c in mooncake_trace)
    largest = max(len(c.block_hashes) for c in mooncake_trace)
    assert (len(mooncake_trace), refs, largest) == (3_993, 3_822_794, MOONCAKE_LARGEST_CALL_BLOCKS)
    assert sum(not c.block_hashes for c in mooncake_trace) == 36  # under 16 tokens


@pytest.mark.slow
@pytest.mark.parametrize("capacity", MOONCAKE_CAPACITIES)
def test_mooncake_lru_equals_reference(mooncake, capacity):
    assert max_cached_blocks(mooncake.calls) <= MOONCAKE_LARGEST_CALL_BLOCKS <= capacity
    compare(mooncake, "lru", capacity).check()


@pytest.mark.slow
@pytest.mark.parametrize("capacity", MOONCAKE_CAPACITIES)
def test_mooncake_belady_equals_reference(mooncake, capacity):
    compare(mooncake, "belady", capacity).check()
