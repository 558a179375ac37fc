"""One user SQL statement over every replica's history: ``query_fleet``.

The replicas export their history as Parquet segments (``policyd.history.segments``) into one
destination. A fleet query:

1. lists the destination's segments (the live ones: ``live_segments``) and has a local file
   for each (a shared directory's own files; an object store's downloaded once, by name, into
   the cache directory);
2. builds, once per set of segments, a DuckDB file in the cache directory with one table per
   history table: the declared columns (``policyd.history.tables``) and ``replica`` (VARCHAR),
   holding every replica's rows (``read_parquet(..., union_by_name = true)``: a segment of an
   older schema has NULL in a column it lacks); a table no replica exported yet is there,
   empty. The file is written under a temporary name and renamed, and reused while the
   segments stay the same;
3. runs the statement on that file with ``safe_sql.run_readonly_query``: exactly the lockdown,
   limits, refusals and messages of ``policyd sql`` (the user's SQL sees only the tables, never
   the segment files: external access is off).

The time limit covers the statement, as in ``policyd sql``; gathering and building come
before it (``FleetInfo.prepare_ms``).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import duckdb

from policyd.history.revisions import HistoryError
from policyd.history.safe_sql import QueryResult, run_readonly_query
from policyd.history.segments import (
    Segment,
    SegmentStore,
    SegmentStoreError,
    live_segments,
    open_store,
)

FLEET_ENV: Final = "POLICYD_FLEET_HISTORY"
REPLICA_COLUMN: Final = "replica"
BUILD_MEMORY_LIMIT: Final = "512MB"
_FLEET_FILE_PREFIX: Final = "fleet-"
_build_lock = threading.Lock()

# the declared columns' SQLAlchemy types (by class name) as DuckDB spells them
_DUCKDB_TYPES: Final = {
    "Double": "DOUBLE",
    "BigInteger": "BIGINT",
    "String": "VARCHAR",
    "Boolean": "BOOLEAN",
}


@dataclass(frozen=True)
class FleetInfo:
    """What a fleet query read: the replicas with at least one segment, how many segments,
    where from, and the time spent gathering and building before the statement ran."""

    source: str
    replicas: list[str]
    segments: int
    prepare_ms: float

    def as_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "replicas": self.replicas,
            "segments": self.segments,
            "prepare_ms": self.prepare_ms,
        }


def declared_columns() -> dict[str, list[tuple[str, str]]]:
    """Each history table's columns, in order, as (name, DuckDB type), from the declaration."""
    from policyd.history.tables import METADATA  # noqa: PLC0415 - SQLAlchemy only when used

    return {
        name: [(c.name, _DUCKDB_TYPES[type(c.type).__name__]) for c in table.columns]
        for name, table in METADATA.tables.items()
    }


def default_cache_dir(source: str) -> Path:
    """A private directory per source under the system's temporary directory."""
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"policyd-fleet-{os.getuid()}-{digest}"


def _quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _quote_ident(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


class FleetBuilder:
    """Builds the fleet's DuckDB file from local segment files (one job: step 2 above)."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = Path(cache_dir)

    def path_for(self, segments: Sequence[Segment]) -> Path:
        """The fleet file of exactly these segments (and this schema)."""
        key = hashlib.sha256()
        for table, columns in sorted(declared_columns().items()):
            key.update(f"{table}:{columns}\n".encode())
        for name in sorted(s.name for s in segments):
            key.update(name.encode() + b"\n")
        return self.cache_dir / f"{_FLEET_FILE_PREFIX}{key.hexdigest()[:24]}.duckdb"

    def build(
        self, grouped: Mapping[tuple[str, str], Sequence[Segment]], files: Mapping[str, Path]
    ) -> Path:
        """The fleet file of ``grouped``'s segments (built now unless it is there already);
        older fleet files are removed (a query still reading one keeps its inode)."""
        segments = [s for group in grouped.values() for s in group]
        target = self.path_for(segments)
        with _build_lock:
            if not target.is_file():
                self.cache_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                tmp.unlink(missing_ok=True)
                try:
                    self._write(tmp, grouped, files)
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)
                    tmp.with_name(tmp.name + ".wal").unlink(missing_ok=True)
            for old in self.cache_dir.glob(f"{_FLEET_FILE_PREFIX}*.duckdb"):
                if old != target:
                    old.unlink(missing_ok=True)
        return target

    @staticmethod
    def _write(
        path: Path,
        grouped: Mapping[tuple[str, str], Sequence[Segment]],
        files: Mapping[str, Path],
    ) -> None:
        config = {"threads": 2, "memory_limit": BUILD_MEMORY_LIMIT}
        conn = duckdb.connect(str(path), config=config)  # type: ignore[arg-type]
        try:
            for table, columns in declared_columns().items():
                if any(name == REPLICA_COLUMN for name, _ in columns):
                    raise HistoryError(f"{table} declares a column named {REPLICA_COLUMN!r}")
                ddl = ", ".join(f"{_quote_ident(n)} {t}" for n, t in columns)
                conn.execute(
                    f"CREATE TABLE {_quote_ident(table)} ({ddl}, {REPLICA_COLUMN} VARCHAR)"
                )
                for (replica, of_table), segments in sorted(grouped.items()):
                    if of_table != table or not segments:
                        continue
                    paths = ", ".join(_quote_literal(str(files[s.name])) for s in segments)
                    conn.execute(
                        f"INSERT INTO {_quote_ident(table)} BY NAME SELECT *, "
                        f"{_quote_literal(replica)} AS {REPLICA_COLUMN} "
                        f"FROM read_parquet([{paths}], union_by_name = true)"
                    )
            conn.execute("CHECKPOINT")
        except duckdb.Error as exc:
            raise HistoryError(f"cannot build the fleet history: {exc}") from None
        finally:
            conn.close()


def _gather_and_build(
    store: SegmentStore, cache: Path
) -> tuple[dict[tuple[str, str], list[Segment]], Path]:
    """List, fetch and build; once more from a fresh listing when the build fails (a
    compaction deleted a listed segment before it was read)."""
    for attempt in (1, 2):
        grouped = live_segments(store.names())
        names = [s.name for group in grouped.values() for s in group]
        files = store.fetch(names, cache)
        try:
            return grouped, FleetBuilder(cache).build(grouped, files)
        except SegmentStoreError:
            raise
        except HistoryError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def prepare_fleet(
    source: str | Path | SegmentStore, cache_dir: Path | None = None
) -> tuple[Path, FleetInfo]:
    """Gather the segments of ``source`` and build (or reuse) the fleet file; returns its path
    and what it holds. Raises SegmentStoreError / HistoryError."""
    started = time.perf_counter()
    store = open_store(source) if isinstance(source, str | Path) else source
    described = store.describe()
    key = str(source) if isinstance(source, str | Path) else described
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(key)
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    grouped, path = _gather_and_build(store, cache)
    info = FleetInfo(
        source=described,
        replicas=sorted({replica for replica, _ in grouped}),
        segments=sum(len(group) for group in grouped.values()),
        prepare_ms=(time.perf_counter() - started) * 1000.0,
    )
    return path, info


def query_fleet(
    sql: str,
    source: str | Path | SegmentStore,
    *,
    cache_dir: Path | None = None,
    max_rows: int = 10_000,
    timeout_s: float = 5.0,
    memory_limit: str = "256MB",
) -> tuple[QueryResult, FleetInfo]:
    """Run one user statement over every replica's segments in ``source`` (a directory, a
    ``nats://`` URL or a store), each table with a ``replica`` column, under exactly
    ``run_readonly_query``'s lockdown and limits. Raises SqlRefused (the statement, as
    ``policyd sql`` would), SegmentStoreError (the source) or HistoryError (the build)."""
    path, info = prepare_fleet(source, cache_dir)
    return run_readonly_query(
        path, sql, max_rows=max_rows, timeout_s=timeout_s, memory_limit=memory_limit
    ), info
