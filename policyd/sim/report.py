"""What a replay measured, per policy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's prefix hit, in the order requests were admitted."""

    request_id: str
    workflow_id: str
    agent: str
    prompt_blocks: int
    gpu_hit_blocks: int
    host_hit_blocks: int


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


@dataclass(slots=True)
class Report:
    policy: str
    workload: str
    profile: str
    concurrency: int
    gpu_blocks: int
    host_blocks: int
    requests: int = 0
    prompt_blocks: int = 0
    prompt_tokens: int = 0
    gpu_hit_blocks: int = 0
    host_hit_blocks: int = 0
    recomputed_tokens: int = 0
    host_write_bytes: int = 0
    host_read_bytes: int = 0
    host_declined_blocks: int = 0
    host_evicted_blocks: int = 0
    gpu_evicted_blocks: int = 0
    prefetched_blocks: int = 0
    makespan_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    wall_s: float = 0.0
    belady_fraction: float | None = None
    # with SimConfig.audit_declines: declined host writes referenced again while the
    # counterfactual (written) copy would still have been resident / after it was evicted
    declined_lost_hits: int | None = None
    declined_reused_late: int | None = None
    records: list[RequestRecord] = field(default_factory=list)

    def finish(self, makespan_s: float, latencies_s: list[float], wall_s: float) -> None:
        latencies_s.sort()
        self.makespan_s = makespan_s
        self.latency_p50_s = percentile(latencies_s, 50)
        self.latency_p99_s = percentile(latencies_s, 99)
        self.wall_s = wall_s

    @property
    def gpu_hit_rate(self) -> float:
        return self.gpu_hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.host_hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        return self.gpu_hit_rate + self.host_hit_rate

    @property
    def refs_per_s(self) -> float:
        return self.prompt_blocks / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("records")
        out.update(
            gpu_hit_rate=self.gpu_hit_rate,
            host_hit_rate=self.host_hit_rate,
            hit_rate=self.hit_rate,
            refs_per_s=self.refs_per_s,
        )
        return out
