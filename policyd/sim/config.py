"""One replay's settings (``SimConfig``); every part of the simulator reads them, none changes
them."""

from __future__ import annotations

from dataclasses import dataclass

from policyd.core.profiles import HardwareProfile
from policyd.core.types import BLOCK_SIZE_TOKENS
from policyd.sim.cache import RunningSpace
from policyd.tiers.gpu import DEFAULT_STEP_OPS


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One replay's settings. ``gpu_blocks``/``host_blocks`` default to the profile's sizes."""

    concurrency: int = 8
    gpu_blocks: int | None = None
    host_blocks: int | None = None
    profile: str = "h200-llama3.1-8b"
    running_space: RunningSpace = "shared"
    recompute_last_token: bool = True
    snapshot_interval_s: float = 1.0
    codec_roundtrip: bool = False
    prefetch_budget_blocks: int = 0
    # the connector's GPU-tier caps (agentkv_max_pinned_blocks / agentkv_max_ranked_blocks);
    # None: the connector's defaults, fractions of the GPU pool
    max_pinned_blocks: int | None = None
    max_ranked_blocks: int | None = None
    step_ops: int | None = DEFAULT_STEP_OPS  # plan operations a scheduling round (None: all)
    offload_prompt_only: bool = True  # vLLM 0.32's default: decode blocks are not offloaded
    record_requests: bool = False
    audit_declines: bool = False  # check declined host writes against Proposition 1 (audit.py)
    block_tokens: int = BLOCK_SIZE_TOKENS  # vLLM's block size (the workload's hashes use it)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.snapshot_interval_s <= 0:
            raise ValueError("snapshot_interval_s must be > 0")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")

    def tier_blocks(self, profile: HardwareProfile) -> tuple[int, int]:
        """The GPU and host tiers' sizes in blocks: as set, else the profile's."""
        gpu = self.gpu_blocks if self.gpu_blocks is not None else profile.gpu_blocks()
        host = self.host_blocks if self.host_blocks is not None else profile.host_blocks()
        return gpu, host
