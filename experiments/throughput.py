"""``policyd throughput``: how fast the simulator replays, in block references per second.

One seeded synthetic trace of at least ``refs`` prompt-block references is replayed under lru and
belady, GPU tier only and GPU + host, in one process on one core. The figure includes everything a
benchmark pays for: the cache model, the Engine fed with every event, the cost model. Belady's
figure covers its final pass only (it also needs an LRU pass and, in a closed loop, a second
oracle pass to learn the order of calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from policyd.policies import make_policy
from policyd.sim.replay import SimConfig, Simulator, simulate
from policyd.workloads.calls import Workload
from policyd.workloads.synthetic import synthetic_agents

TARGET_REFS_PER_S = 1_000_000


@dataclass(frozen=True, slots=True)
class ThroughputRow:
    policy: str
    tiers: str
    refs: int
    wall_s: float

    @property
    def refs_per_s(self) -> float:
        return self.refs / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ThroughputResult:
    workload: Workload
    rows: list[ThroughputRow]


def trace_of(refs: int, seed: int) -> Workload:
    """The first synthetic workflows (seeded) that together reference at least ``refs`` blocks."""
    sample = synthetic_agents(seed=seed, workflows=50)
    per_workflow = max(1, sample.block_refs // 50)
    full = synthetic_agents(seed=seed, workflows=int(refs / per_workflow * 1.2) + 1)
    streams, total = [], 0
    for stream in full.streams:
        if total >= refs:
            break
        streams.append(stream)
        total += sum(len(c.block_hashes) for c in stream)
    return Workload(name=f"synthetic-{total}refs", streams=streams)


def measure_throughput(*, refs: int, concurrency: int, seed: int) -> ThroughputResult:
    workload = trace_of(refs, seed)
    gpu_blocks = 8192
    rows: list[ThroughputRow] = []
    for host_blocks, tiers in ((0, "GPU"), (4 * gpu_blocks, "GPU+host")):
        config = SimConfig(concurrency=concurrency, gpu_blocks=gpu_blocks, host_blocks=host_blocks)
        lru = Simulator(workload, make_policy("lru"), config).run()
        rows.append(ThroughputRow("lru", tiers, lru.prompt_blocks, lru.wall_s))
        belady = simulate(workload, "belady", config)
        rows.append(ThroughputRow("belady", tiers, belady.prompt_blocks, belady.wall_s))
    return ThroughputResult(workload, rows)


def render_throughput(result: ThroughputResult) -> Table:
    table = Table(
        title=f"simulator throughput on {result.workload.name} "
        f"({result.workload.calls:,} calls), one core",
        title_justify="left",
    )
    for column in ("policy", "tiers", "block refs", "wall s", "refs/s", "of 1M/s target"):
        table.add_column(column, justify="right")
    for row in result.rows:
        table.add_row(
            row.policy,
            row.tiers,
            f"{row.refs:,}",
            f"{row.wall_s:.2f}",
            f"{row.refs_per_s:,.0f}",
            f"{row.refs_per_s / TARGET_REFS_PER_S:.2f}x",
        )
    return table
