"""EfficientAgent's Proposition 1, checked on replay (``policyd.sim.audit.DeclineAudit``).

The proposition: declining the host write of a block whose next reuse distance (in the
unfiltered reference stream) is at least the tier's capacity loses no hit - LRU would evict it
before the reuse. It holds only under that condition, so the tests encode it:

* a filter that declines exactly the blocks meeting the condition (found by a first replay in
  which everything is declined and the write-all counterfactual says which blocks it would have
  evicted before their reuse) loses no hit: no declined block is referenced while the
  counterfactual tier still holds it, and the real tier's hits are no fewer than write-all's;
* a filter that ignores the condition does lose hits, and the audit sees them (so the audit can
  fail);
* EfficientAgent's conditioned filter meets the condition trivially on a tier larger than the
  working set (it declines nothing: the "no blow-up" case), while its fixed filter there declines
  blocks that would have been hit - the paper's 4.3x blow-up.

The stream is a pool of coding agents in a fixed order (each call its own stream, concurrency
1), so every replay sees the same references and only the host tier's contents differ.
"""

from __future__ import annotations

import dataclasses
from functools import cache

from rich.console import Console

from experiments.efficientagent_eval import Row, results_table
from experiments.mrc_eval import interleave
from policyd.core.policy import Policy
from policyd.policies import make_policy
from policyd.sim.audit import DeclineAudit
from policyd.sim.replay import SimConfig, Simulator
from policyd.sim.report import Report
from policyd.workloads import make_workload
from policyd.workloads.calls import Workload, sequential

GPU_BLOCKS = 1536
SMALL_HOST_BLOCKS = 1500  # below the pool's reuse working set: LRU thrashes
LARGE_HOST_BLOCKS = 60_000  # above it


@cache
def pool_stream() -> Workload:
    pool = make_workload("coding-pool", seed=3, tasks=6, max_prompt_tokens=12_000)
    calls = interleave(pool, 4, decode_s_per_token=0.008)
    return sequential(calls, name="pool-in-order")


class DeclineSet:
    """An offline admission (LRU otherwise) declining exactly the ``(request, block)`` host
    writes in ``declined`` (None: all): the audit's instrument, not a policy a connector serves."""

    def __init__(self, declined: set[tuple[str, int]] | None) -> None:
        self.declined = declined

    def __call__(self, request_id: str, block_hashes: list[int]) -> list[int]:
        if self.declined is None:
            return []
        declined = self.declined
        return [b for b in block_hashes if (request_id, b) not in declined]


def replay(policy: Policy | DeclineSet, host_blocks: int) -> tuple[Report, DeclineAudit]:
    config = SimConfig(concurrency=1, gpu_blocks=GPU_BLOCKS, host_blocks=host_blocks)
    if isinstance(policy, DeclineSet):
        sim = Simulator(pool_stream(), make_policy("lru"), config, offline_admission=policy)
    else:
        sim = Simulator(pool_stream(), policy, config)
    sim.audit = DeclineAudit(host_blocks, keep_blocks=True)
    return sim.run(), sim.audit


def test_declining_only_blocks_evicted_before_reuse_loses_no_hit() -> None:
    write_all, _ = replay(make_policy("lru"), SMALL_HOST_BLOCKS)
    _, probe = replay(DeclineSet(None), SMALL_HOST_BLOCKS)
    # Proposition 1's condition: next reuse distance >= capacity (or never reused)
    condition = probe.late_blocks | probe.pending_blocks
    assert probe.lost_blocks and condition  # the stream has both kinds at this capacity
    filtered, audit = replay(DeclineSet(condition), SMALL_HOST_BLOCKS)
    assert audit.counts.declined_blocks > 0
    assert audit.counts.lost_hits == 0, audit.counts.lost_examples
    assert filtered.host_hit_blocks >= write_all.host_hit_blocks
    assert filtered.host_write_bytes < write_all.host_write_bytes


def test_the_audit_sees_a_filter_that_ignores_the_condition() -> None:
    _, audit = replay(DeclineSet(None), LARGE_HOST_BLOCKS)
    assert audit.counts.lost_hits > 0
    assert (
        audit.counts.lost_hits + audit.counts.reused_late + audit.counts.never_reused
        == audit.counts.declined_blocks
    )


def test_conditioned_admission_declines_nothing_on_a_tier_above_the_working_set() -> None:
    report, audit = replay(make_policy("efficientagent", mode="conditioned"), LARGE_HOST_BLOCKS)
    assert audit.counts.declined_blocks == 0
    assert report.host_declined_blocks == 0
    fixed, fixed_audit = replay(
        make_policy("efficientagent", mode="fixed", kappa_chunks=0), LARGE_HOST_BLOCKS
    )
    assert fixed_audit.counts.lost_hits > 0  # the blow-up: refills declined that would hit
    assert fixed.recomputed_tokens > report.recomputed_tokens


def test_agentkv_declines_nothing_while_the_tier_has_room() -> None:
    """On a tier above the working set no write can evict anything, so agentkv writes every
    block (write-all's hits, no Proposition 1 loss possible) - whatever its predictions say."""
    write_all, _ = replay(make_policy("lru"), LARGE_HOST_BLOCKS)
    ours, audit = replay(make_policy("agentkv"), LARGE_HOST_BLOCKS)
    assert audit.counts.declined_blocks == 0 and ours.host_declined_blocks == 0
    assert ours.host_write_bytes == write_all.host_write_bytes


def test_the_experiment_prints_the_audits_classes_of_reused_declines() -> None:
    """``policyd eval-efficientagent --audit`` prints Proposition 1's two classes of declined
    blocks referenced again, as the replay's report counts them; without the audit, neither."""
    report, audit = replay(
        make_policy("efficientagent", mode="fixed", kappa_chunks=0), LARGE_HOST_BLOCKS
    )
    assert report.declined_lost_hits == audit.counts.lost_hits > 0
    assert report.declined_reused_late == audit.counts.reused_late
    meta = {"kv_bytes_per_block": 2 << 20}
    row = Row("large", LARGE_HOST_BLOCKS, "efficientagent-fixed", report)
    console = Console(width=400, record=True)
    console.print(results_table([row], meta))
    text = console.export_text()
    assert "declined, reused while write-all held them" in text
    assert f"{report.declined_lost_hits:,}" in text
    unaudited = dataclasses.replace(report, declined_lost_hits=None, declined_reused_late=None)
    console.print(results_table([Row("large", LARGE_HOST_BLOCKS, "x", unaudited)], meta))
    assert "reused after" not in console.export_text()
