"""A replica's history as Parquet segments in a shared place, for fleet-wide SQL (``fleet_sql``).

A *segment* is the rows one export added to one history table, as one Parquet file named
``<replica>/<table>/<seq>-<first>-<last>.parquet``: ``seq`` counts that table's exports, and
``first`` / ``last`` are the smallest and largest key (``id``, from the table's sequence, so
it only grows) of its rows. The names are the export's whole state:

* **idempotent**: an export reads the rows whose ``id`` is past the largest ``last`` already in
  the destination; with nothing new it writes nothing, so running it twice adds no row twice;
* **resumable**: every segment is written under a temporary name and renamed (a directory), or
  becomes visible only once its last chunk and its metadata are stored (a JetStream object
  store), so a crash between files leaves whole segments only, and the next export goes on from
  the last one that is there;
* **compaction** (the retention chosen): past ``max_segments`` segments of a replica's table the
  oldest are merged into one segment covering their whole range (named with the last merged
  one's ``seq``), which is written before the merged ones are deleted; a reader drops any
  segment whose range another one covers (``live_segments``), so a crash in between duplicates
  nothing. Nothing is dropped: how long the fleet keeps rows is each replica's own retention,
  applied before export.

Rows are read from the replica's published snapshot (a consistent copy; never the live writer).
``requests`` rows are updated after they are written (hits, finish): an unfinished request
younger than ``settle_s`` holds back itself and every later row of that table until it finishes
or ages past ``settle_s``, so a segment holds requests as they ended.

Two destinations behind ``SegmentStore``: a shared directory (``file:///path`` or a plain
path, ``DirectoryStore``) and a JetStream object store bucket
(``nats://host:port[,host:port...]/bucket``, ``ObjectStoreBucket``: the object's name is the
segment's name). ``open_store`` picks one from the string.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol, TypeVar
from urllib.parse import unquote, urlsplit

import duckdb

from policyd.history.revisions import HistoryError

if TYPE_CHECKING:
    from nats.js.object_store import ObjectStore

T = TypeVar("T")

SEGMENT_SUFFIX: Final = ".parquet"
REPLICA_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SEGMENT: Final = re.compile(
    r"(?P<replica>[A-Za-z0-9][A-Za-z0-9_.-]{0,63})/(?P<table>[a-z_][a-z0-9_]*)/"
    r"(?P<seq>\d+)-(?P<first>\d+)-(?P<last>\d+)\.parquet"
)
DEFAULT_MAX_SEGMENTS: Final = 64
DEFAULT_SETTLE_S: Final = 600.0
NATS_TIMEOUT_S: Final = 5.0
_SNAPSHOT_ALIAS: Final = "policyd_export"


class SegmentStoreError(HistoryError):
    """The destination cannot be reached, listed, written or read (its message says which)."""


def check_replica(name: str) -> str:
    """``name`` if it is a valid replica name (letters, digits, ``_.-``, at most 64), else
    ValueError: it is a path component and an SQL literal."""
    if not REPLICA_NAME.fullmatch(name):
        raise ValueError(
            f"replica name must match {REPLICA_NAME.pattern} (letters, digits, '_.-'), got {name!r}"
        )
    return name


@dataclass(frozen=True, order=True)
class Segment:
    """One segment's name, parsed: rows ``first..last`` (by ``id``) of ``replica``'s ``table``,
    the ``seq``-th export of it."""

    replica: str
    table: str
    seq: int
    first: int
    last: int

    @property
    def name(self) -> str:
        return (
            f"{self.replica}/{self.table}/{self.seq:08d}-{self.first:012d}-{self.last:012d}.parquet"
        )

    @classmethod
    def parse(cls, name: str) -> Segment | None:
        """The segment a name stands for; None for anything else (temporary files, strangers)."""
        found = _SEGMENT.fullmatch(name)
        if found is None:
            return None
        first, last = int(found["first"]), int(found["last"])
        if first > last:
            return None
        return cls(found["replica"], found["table"], int(found["seq"]), first, last)

    def covers(self, other: Segment) -> bool:
        """Another segment of the same replica and table whose rows are all in this one's."""
        return (
            self != other
            and (self.replica, self.table) == (other.replica, other.table)
            and self.first <= other.first
            and other.last <= self.last
        )


def live_segments(names: Iterable[str]) -> dict[tuple[str, str], list[Segment]]:
    """The segments to read, by (replica, table), oldest first: every parsed name but those
    another segment covers (what a compaction interrupted before its deletes left behind)."""
    grouped: dict[tuple[str, str], list[Segment]] = {}
    for name in names:
        segment = Segment.parse(name)
        if segment is not None:
            grouped.setdefault((segment.replica, segment.table), []).append(segment)
    live: dict[tuple[str, str], list[Segment]] = {}
    for key, segments in grouped.items():
        widest = sorted(set(segments), key=lambda s: (s.first, -s.last))
        kept: list[Segment] = []
        for segment in widest:
            if kept and kept[-1].covers(segment):
                continue
            kept.append(segment)
        live[key] = sorted(kept, key=lambda s: (s.seq, s.first))
    return live


class SegmentStore(Protocol):
    """Where segments live. Names are segment names (``Segment.name``); a name, once listed, is
    a whole file that never changes."""

    def describe(self) -> str:
        """Where this is, without credentials (for logs and errors)."""
        ...

    def names(self) -> list[str]:
        """Every stored segment name (others, e.g. temporary files, left out)."""
        ...

    def put(self, name: str, local: Path) -> None:
        """Store the file ``local`` as ``name``, all at once: a reader sees all of it or none."""
        ...

    def delete(self, names: Sequence[str]) -> None:
        """Remove these segments (a missing one is no error)."""
        ...

    def fetch(self, names: Sequence[str], cache_dir: Path) -> dict[str, Path]:
        """A local, readable file for each name (the stored file itself, or a copy under
        ``cache_dir``, fetched only when not there yet)."""
        ...


class DirectoryStore:
    """Segments as files under ``root`` (a directory every replica and reader can reach)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return f"directory {self.root}"

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.glob(f"*/*/*{SEGMENT_SUFFIX}"):
            name = path.relative_to(self.root).as_posix()
            if Segment.parse(name) is not None:
                found.append(name)
        return sorted(found)

    def put(self, name: str, local: Path) -> None:
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            shutil.copyfile(local, tmp)
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SegmentStoreError(f"cannot write {name} to {self.describe()}: {exc}") from None

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            (self.root / name).unlink(missing_ok=True)

    def fetch(self, names: Sequence[str], cache_dir: Path) -> dict[str, Path]:
        return {name: self.root / name for name in names}


def _said(exc: BaseException) -> str:
    """An exception as one line: its type and its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _run(work: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to its end from synchronous code (a thread with no event loop running)."""
    return asyncio.run(work())  # type: ignore[arg-type]


class ObjectStoreBucket:
    """Segments as objects in a JetStream object store bucket (created on first write), one
    connection per call: an export or a query is a handful of calls every few seconds at most.
    Its methods block (each runs its own event loop): call them from a thread with no event loop
    running (the daemon's housekeeping thread, the HTTP API's threadpool, the command line).
    """

    def __init__(self, servers: Sequence[str], bucket: str, *, timeout_s: float = NATS_TIMEOUT_S):
        if not servers or not bucket:
            raise ValueError("an object store needs at least one server and a bucket")
        self.servers = list(servers)
        self.bucket = bucket
        self.timeout_s = timeout_s

    def describe(self) -> str:
        hosts = ",".join(urlsplit(s).hostname or "?" for s in self.servers)
        return f"JetStream object store {self.bucket!r} on {hosts}"

    async def _session(self, create: bool, work: Callable[[ObjectStore], Awaitable[T]]) -> T:
        import nats  # noqa: PLC0415 - only a NATS destination needs it
        from nats.js.errors import BucketNotFoundError  # noqa: PLC0415

        async def quiet(exc: Exception) -> None:
            """Connection errors surface as SegmentStoreError, not as nats-py's log lines."""

        try:
            nc = await asyncio.wait_for(
                nats.connect(
                    servers=self.servers,
                    connect_timeout=self.timeout_s,
                    allow_reconnect=False,
                    max_reconnect_attempts=1,  # 0 means "forever" in nats-py
                    reconnect_time_wait=0.1,
                    error_cb=quiet,
                ),
                timeout=self.timeout_s * (len(self.servers) + 1),
            )
        except Exception as exc:
            raise SegmentStoreError(f"cannot reach {self.describe()}: {_said(exc)}") from None
        try:
            js = nc.jetstream(timeout=self.timeout_s)
            try:
                store = await js.object_store(self.bucket)
            except BucketNotFoundError:
                if not create:
                    raise
                store = await js.create_object_store(self.bucket)
            return await work(store)
        finally:
            await nc.close()

    def _call(self, create: bool, work: Callable[[ObjectStore], Awaitable[T]]) -> T:
        from nats.js.errors import BucketNotFoundError  # noqa: PLC0415

        try:
            return _run(lambda: self._session(create, work))
        except SegmentStoreError:
            raise
        except BucketNotFoundError:
            raise
        except Exception as exc:
            raise SegmentStoreError(f"{self.describe()}: {_said(exc)}") from None

    def names(self) -> list[str]:
        from nats.js.errors import BucketNotFoundError, NotFoundError  # noqa: PLC0415

        async def listing(store: ObjectStore) -> list[str]:
            try:
                infos = await store.list(ignore_deletes=True)
            except NotFoundError:
                return []
            return [info.name for info in infos if info.name and not info.deleted]

        try:
            found = self._call(False, listing)
        except BucketNotFoundError:
            return []
        return sorted(name for name in found if Segment.parse(name) is not None)

    def put(self, name: str, local: Path) -> None:
        async def upload(store: ObjectStore) -> None:
            with open(local, "rb") as data:
                await store.put(name, data)

        self._call(True, upload)

    def delete(self, names: Sequence[str]) -> None:
        from nats.js.errors import NotFoundError  # noqa: PLC0415

        async def remove(store: ObjectStore) -> None:
            for name in names:
                with contextlib.suppress(NotFoundError):
                    await store.delete(name)

        if names:
            self._call(True, remove)

    def fetch(self, names: Sequence[str], cache_dir: Path) -> dict[str, Path]:
        """Download the names not yet in ``cache_dir`` (each to a temporary name, then renamed);
        cached files no longer named are removed."""
        cache_dir = Path(cache_dir)
        paths = {name: cache_dir / "segments" / name for name in names}
        missing = [name for name, path in paths.items() if not path.is_file()]

        async def download(store: ObjectStore) -> None:
            for name in missing:
                target = paths[name]
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                try:
                    with open(tmp, "wb") as out:
                        await store.get(name, writeinto=out)
                    os.replace(tmp, target)
                finally:
                    tmp.unlink(missing_ok=True)

        if missing:
            self._call(False, download)
        _prune(cache_dir / "segments", set(paths.values()))
        return paths


def _prune(root: Path, keep: set[Path]) -> None:
    """Remove the cached segment files under ``root`` that are not in ``keep``."""
    if not root.is_dir():
        return
    for path in root.glob(f"*/*/*{SEGMENT_SUFFIX}"):
        if path not in keep:
            path.unlink(missing_ok=True)


def open_store(destination: str | Path) -> SegmentStore:
    """The store a destination names: ``nats://host:port[,host:port...]/bucket`` (or
    ``tls://``) a JetStream object store bucket; ``file:///path`` or a plain path a directory."""
    if isinstance(destination, Path):
        return DirectoryStore(destination)
    text = destination.strip()
    if not text:
        raise ValueError("empty segment destination")
    scheme, sep, rest = text.partition("://")
    if not sep:
        return DirectoryStore(Path(text))
    scheme = scheme.lower()
    if scheme == "file":
        return DirectoryStore(Path(unquote(urlsplit(text).path)))
    if scheme in ("nats", "tls"):
        hosts, _, bucket = rest.partition("/")
        bucket = bucket.strip("/")
        if not hosts or not bucket or "/" in bucket:
            raise ValueError(f"expected {scheme}://host:port[,host:port...]/bucket, got {text!r}")
        return ObjectStoreBucket([f"{scheme}://{h}" for h in hosts.split(",") if h], bucket)
    raise ValueError(f"unknown segment destination scheme {scheme!r} (nats://, tls://, file://)")


def _quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _quote_ident(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


def history_tables() -> tuple[str, ...]:
    """The declared history tables (``policyd.history.tables``), in declaration order."""
    from policyd.history.tables import METADATA  # noqa: PLC0415 - SQLAlchemy only when used

    return tuple(METADATA.tables)


class SegmentExporter:
    """Exports the rows a replica's history added since the last export, one segment per table
    that has new rows, into a ``SegmentStore``; see the module's docstring for the contract.

    One caller at a time per replica (the daemon's housekeeping thread); any number of replicas
    may export into one destination at once, each under its own ``replica`` name.
    """

    def __init__(
        self,
        snapshot_path: Path,
        replica: str,
        destination: str | Path | SegmentStore,
        *,
        max_segments: int = DEFAULT_MAX_SEGMENTS,
        settle_s: float = DEFAULT_SETTLE_S,
        clock: Callable[[], float] = time.time,
        tables: Sequence[str] | None = None,
    ) -> None:
        if max_segments < 2:
            raise ValueError(f"max_segments must be >= 2, got {max_segments}")
        self.snapshot_path = Path(snapshot_path)
        self.replica = check_replica(replica)
        self.store = open_store(destination) if isinstance(destination, str | Path) else destination
        self.max_segments = max_segments
        self.settle_s = settle_s
        self.clock = clock
        self.tables = tuple(tables) if tables is not None else history_tables()

    @classmethod
    def from_history(
        cls, history: Any, replica: str, destination: str, **kw: Any
    ) -> SegmentExporter:
        """An exporter of ``history``'s published snapshot (a ``History`` or a
        ``HistoryProcess``: its config's ``resolved_snapshot_path``)."""
        return cls(history.config.resolved_snapshot_path, replica, destination, **kw)

    def export(self) -> dict[str, object]:
        """Export what is new; returns ``{"replica", "destination", "segments": [names
        written], "rows": {table: rows exported}, "compacted": {table: segments merged},
        "elapsed_ms"}`` (``"skipped"`` says why when there is no snapshot yet). Raises
        SegmentStoreError when the destination fails, HistoryError when the snapshot cannot
        be read; what was stored before the failure stays, and the next call goes on from it."""
        started = time.perf_counter()
        result: dict[str, object] = {
            "replica": self.replica,
            "destination": self.store.describe(),
            "segments": [],
            "rows": {},
            "compacted": {},
        }
        if not self.snapshot_path.is_file():
            result["skipped"] = "no published history snapshot yet"
            return result
        live = live_segments(self.store.names())
        written: list[str] = []
        rows: dict[str, int] = {}
        compacted: dict[str, int] = {}
        with tempfile.TemporaryDirectory(prefix="policyd-segments-") as staging:
            conn = self._open_snapshot()
            try:
                present = self._present_tables(conn)
                for table in self.tables:
                    if table not in present:
                        continue
                    segments = live.get((self.replica, table), [])
                    made = self._export_table(conn, table, segments, Path(staging))
                    if made is None:
                        continue
                    segment, count = made
                    written.append(segment.name)
                    rows[table] = count
                    segments = [*segments, segment]
                    merged = self._compact(conn, table, segments, Path(staging))
                    if merged:
                        compacted[table] = merged
            finally:
                conn.close()
        result.update(segments=written, rows=rows, compacted=compacted)
        result["elapsed_ms"] = (time.perf_counter() - started) * 1000.0
        return result

    def _open_snapshot(self) -> duckdb.DuckDBPyConnection:
        conn = duckdb.connect(":memory:", config={"threads": 2, "memory_limit": "256MB"})
        try:
            conn.execute(
                f"ATTACH {_quote_literal(str(self.snapshot_path))} AS {_SNAPSHOT_ALIAS} (READ_ONLY)"
            )
        except duckdb.Error as exc:
            conn.close()
            raise HistoryError(f"cannot read the snapshot {self.snapshot_path}: {exc}") from None
        return conn

    @staticmethod
    def _present_tables(conn: duckdb.DuckDBPyConnection) -> set[str]:
        rows = conn.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [_SNAPSHOT_ALIAS]
        ).fetchall()
        return {str(r[0]) for r in rows}

    def _new_rows(self, table: str, after: int) -> str:
        """The predicate of ``table``'s rows to export now (ids past ``after``)."""
        where = f"id > {int(after)}"
        if table == "requests":
            cutoff = self.clock() - self.settle_s
            where += (
                f" AND id < coalesce((SELECT min(id) FROM {_SNAPSHOT_ALIAS}.requests "
                f"WHERE id > {int(after)} AND finished_ts IS NULL AND ts > {cutoff!r}), "
                f"{2**63 - 1})"
            )
        return where

    def _export_table(
        self,
        conn: duckdb.DuckDBPyConnection,
        table: str,
        segments: list[Segment],
        staging: Path,
    ) -> tuple[Segment, int] | None:
        after = max((s.last for s in segments), default=0)
        source = f"{_SNAPSHOT_ALIAS}.{_quote_ident(table)}"
        where = self._new_rows(table, after)
        row = conn.execute(
            f"SELECT min(id), max(id), count(*) FROM {source} WHERE {where}"
        ).fetchone()
        if row is None or row[0] is None:
            return None
        first, last, count = int(row[0]), int(row[1]), int(row[2])
        seq = max((s.seq for s in segments), default=0) + 1
        segment = Segment(self.replica, table, seq, first, last)
        local = staging / f"{table}-{seq}{SEGMENT_SUFFIX}"
        conn.execute(
            f"COPY (SELECT * FROM {source} WHERE id BETWEEN {first} AND {last} ORDER BY id) "
            f"TO {_quote_literal(str(local))} (FORMAT PARQUET)"
        )
        self.store.put(segment.name, local)
        return segment, count

    def _compact(
        self,
        conn: duckdb.DuckDBPyConnection,
        table: str,
        segments: list[Segment],
        staging: Path,
    ) -> int:
        """Merge the oldest segments into one when there are more than ``max_segments``;
        returns how many were merged (0: none)."""
        if len(segments) <= self.max_segments:
            return 0
        oldest = segments[: len(segments) - self.max_segments + 1]
        local = self.store.fetch([s.name for s in oldest], staging / "fetched")
        merged = Segment(self.replica, table, oldest[-1].seq, oldest[0].first, oldest[-1].last)
        files = ", ".join(_quote_literal(str(local[s.name])) for s in oldest)
        out = staging / f"{table}-merged{SEGMENT_SUFFIX}"
        conn.execute(
            f"COPY (SELECT * FROM read_parquet([{files}], union_by_name = true) ORDER BY id) "
            f"TO {_quote_literal(str(out))} (FORMAT PARQUET)"
        )
        self.store.put(merged.name, out)
        self.store.delete([s.name for s in oldest if s != merged])
        return len(oldest)
