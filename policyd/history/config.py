"""How a history is kept: ``HistoryConfig``, validated when made (a bad value is a ValueError
naming the field), every field with its production default."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from policyd.history.files import default_snapshot_path

_MEMORY_LIMIT: Final = re.compile(r"[0-9]+(\.[0-9]+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)")


@dataclass(frozen=True)
class HistoryConfig:
    """How the history is kept. Every field has a production default."""

    db_path: Path
    """The live DuckDB file (created and migrated on start)."""
    snapshot_path: Path | None = None
    """Where snapshots are published; default: ``db_path`` with suffix ``.snapshot.duckdb``."""
    block_sample_rate: float = 1.0
    """Fraction of block-level rows kept, chosen by block hash (a kept block keeps all rows).
    With ``adaptive_sampling`` this is the most that is kept."""
    adaptive_sampling: bool = True
    """Halve the block rows' sample rate while the writer falls behind (its queue past half of
    ``queue_max_rows`` and growing; ``policyd.history.sampling``) and double it back, up to
    ``block_sample_rate``, once it has caught up:
    a smaller, still hash-consistent sample instead of whole batches dropped at the bound.
    Every block row records the rate it was sampled at (``sample_rate``)."""
    min_block_sample_rate: float = 2.0**-10
    """The adaptive rate is not halved below this."""
    retention_s: float | None = None
    """Drop rows whose ``ts`` is older than this many seconds; None keeps them."""
    retention_rows: int | None = None
    """Keep at most this many rows per table (the newest by ``ts``); None = no cap."""
    flush_interval_s: float = 0.5
    """How often pending rows are appended to the file."""
    queue_max_rows: int = 1_000_000
    """Rows queued in memory beyond which ``record`` drops (and counts) instead of blocking."""
    retention_interval_s: float = 60.0
    """How often the writer applies the retention rules."""
    snapshot_interval_s: float | None = 60.0
    """How often the writer publishes a snapshot by itself; None = only on request and close."""
    snapshot_storage_version: str | None = "v1.0.0"
    """DuckDB storage version of snapshots, so older DuckDB clients read them; None = this one."""
    cpu_budget: float | None = 0.25
    """Share of one core the writer thread may use on rows (fanning events out, DuckDB's
    appends; snapshots, retention and calls are not counted: fewer rows would not make them
    cheaper) before it halves the block rows' sample rate, as if it were behind
    (``adaptive_sampling``; doubled back only under half of it); None: no budget. It keeps a
    busy history from taking the machine from the daemon's Engine."""
    memory_limit: str = "512MB"
    """DuckDB's buffer-pool cap for the writer connection (its default is 80% of the machine's
    memory, which lets a long-running daemon's RSS grow with the file)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.block_sample_rate <= 1.0:
            raise ValueError(f"block_sample_rate must be in [0, 1], got {self.block_sample_rate}")
        if not 0.0 < self.min_block_sample_rate <= 1.0:
            raise ValueError(
                f"min_block_sample_rate must be in (0, 1], got {self.min_block_sample_rate}"
            )
        for name in ("retention_s", "retention_rows", "snapshot_interval_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None, got {value}")
        if self.flush_interval_s <= 0 or self.retention_interval_s <= 0:
            raise ValueError("flush_interval_s and retention_interval_s must be positive")
        if self.queue_max_rows < 1:
            raise ValueError(f"queue_max_rows must be >= 1, got {self.queue_max_rows}")
        if self.cpu_budget is not None and self.cpu_budget <= 0.0:
            raise ValueError(f"cpu_budget must be positive or None, got {self.cpu_budget}")
        if not _MEMORY_LIMIT.fullmatch(self.memory_limit):
            raise ValueError(
                f"memory_limit must look like '512MB' or '2GiB', got {self.memory_limit!r}"
            )
        if Path(self.resolved_snapshot_path).resolve() == Path(self.db_path).resolve():
            raise ValueError("snapshot_path must differ from db_path")

    @property
    def resolved_snapshot_path(self) -> Path:
        return self.snapshot_path or default_snapshot_path(self.db_path)
