"""The shape of a trace: how many calls, how long the prompts, how much of them was seen before.

``reuse_share`` is the fraction of prompt block references whose block already appeared earlier
in the trace (in an earlier call's prompt or output, the streams taken one after the other): the
hit rate of an unbounded prefix cache, the ceiling any eviction policy works under. Gaps are
those of every call but a stream's first (which has none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from rich.table import Table

from policyd.workloads.calls import Workload

TOP_AGENTS = 10  # agents listed by name in the table; the rest are summed


@dataclass(frozen=True, slots=True)
class Spread:
    """Mean and percentiles of one per-call (or per-stream) quantity over ``count`` values."""

    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    max: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls()
        array = np.asarray(values, dtype=float)
        p50, p90 = np.percentile(array, [50, 90])
        return cls(float(array.mean()), float(p50), float(p90), float(array.max()), len(values))


@dataclass(frozen=True, slots=True)
class TraceStats:
    name: str
    calls: int
    streams: int
    calls_per_agent: dict[str, int]
    calls_per_stream: Spread
    prompt_tokens: Spread
    output_tokens: Spread
    gap_s: Spread
    prompt_blocks: int  # prompt block references
    unique_blocks: int  # distinct blocks, prompt and output
    reuse_share: float
    workflow_types: dict[str, int] = field(default_factory=dict)  # calls per workflow type

    @property
    def agents(self) -> int:
        return len(self.calls_per_agent)


def trace_stats(workload: Workload) -> TraceStats:
    """One pass over ``workload``: counts, token and gap spreads, prefix reuse."""
    per_agent: Counter[str] = Counter()
    per_type: Counter[str] = Counter()
    stream_lengths: list[float] = []
    prompt_tokens: list[float] = []
    output_tokens: list[float] = []
    gaps: list[float] = []
    seen: set[int] = set()
    prompt_blocks = reused = 0
    for stream in workload:
        stream_lengths.append(len(stream))
        for index, call in enumerate(stream):
            per_agent[call.agent] += 1
            per_type[call.workflow_type] += 1
            prompt_tokens.append(call.prompt_tokens)
            output_tokens.append(call.output_tokens)
            if index:
                gaps.append(call.gap_s)
            prompt_blocks += len(call.block_hashes)
            reused += sum(1 for h in call.block_hashes if h in seen)
            seen.update(call.block_hashes)
            seen.update(call.output_block_hashes)
    return TraceStats(
        name=workload.name,
        calls=len(prompt_tokens),
        streams=len(stream_lengths),
        calls_per_agent=dict(per_agent.most_common()),
        calls_per_stream=Spread.of(stream_lengths),
        prompt_tokens=Spread.of(prompt_tokens),
        output_tokens=Spread.of(output_tokens),
        gap_s=Spread.of(gaps),
        prompt_blocks=prompt_blocks,
        unique_blocks=len(seen),
        reuse_share=reused / prompt_blocks if prompt_blocks else 0.0,
        workflow_types=dict(per_type.most_common()),
    )


def _spread(spread: Spread, digits: int = 0) -> str:
    if not spread.count:
        return "-"
    return " / ".join(f"{v:,.{digits}f}" for v in (spread.mean, spread.p50, spread.p90, spread.max))


def render_stats(stats: TraceStats) -> Table:
    """A two-column table of ``stats`` for the terminal."""
    table = Table(title=f"trace {stats.name}", show_header=True)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("calls", f"{stats.calls:,}")
    table.add_row("streams", f"{stats.streams:,}")
    table.add_row("calls per stream (mean / p50 / p90 / max)", _spread(stats.calls_per_stream, 1))
    table.add_row("prompt tokens per call (mean / p50 / p90 / max)", _spread(stats.prompt_tokens))
    table.add_row("output tokens per call (mean / p50 / p90 / max)", _spread(stats.output_tokens))
    table.add_row("gap s after the previous call (mean / p50 / p90 / max)", _spread(stats.gap_s, 2))
    blocks = f"{stats.prompt_blocks:,} / {stats.unique_blocks:,}"
    table.add_row("prompt block references / unique blocks", blocks)
    table.add_row("reuse share (prompt blocks seen before)", f"{stats.reuse_share:.1%}")
    for workflow_type, calls in stats.workflow_types.items():
        table.add_row(f"calls of workflow type {workflow_type or '(none)'}", f"{calls:,}")
    table.add_row("agents", f"{stats.agents:,}")
    agents = list(stats.calls_per_agent.items())
    for agent, calls in agents[:TOP_AGENTS]:
        table.add_row(f"  calls of {agent}", f"{calls:,}")
    if len(agents) > TOP_AGENTS:
        rest = sum(calls for _, calls in agents[TOP_AGENTS:])
        table.add_row(f"  calls of {len(agents) - TOP_AGENTS} other agents", f"{rest:,}")
    return table
