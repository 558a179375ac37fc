"""The history writer in a process of its own: ``HistoryProcess`` has ``History``'s interface,
and a child process (``python -m policyd.history.process``, ``policyd.history.child``) runs the
``History`` itself.

Why: the daemon's threads share one interpreter lock. Turning event batches into rows (a Python
step per event and a numpy conversion per block hash) and DuckDB's statements (~4-6 ms of CPU
each, measured) took ~25% of a core at 500k block events/s even with one block row in 1,024
kept, and up to ~45% at higher sample rates - time the Engine waited for. The child has an
interpreter lock of its own; the daemon only hands it bytes, over the link described in
``policyd.history.link`` (private IPC sockets, a per-run secret on every message).

Nothing blocks a caller: records are sent without waiting, and what the socket's bound
(``SEND_HWM`` messages) does not take is dropped and counted in ``rows_dropped``, like the
in-process writer's queue bound. Calls wait for their reply (with a time limit). The child
exits, after flushing, when told to close or when the daemon's process goes away. A link that
dies (the listener thread, or no report from the child for ``REPORT_STALE_S``) makes
``writer_alive`` false (so /readyz fails) and every call fail at once instead of waiting for a
reply that cannot come.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import zmq

from policyd.core.types import BATCH_CODEC, EventBatch
from policyd.history.config import HistoryConfig
from policyd.history.fanout import rows_estimate
from policyd.history.link import (
    CALL_SEND_TIMEOUT_S,
    SECRET_BYTES,
    DaemonLink,
    config_json,
    encode,
    encode_ts,
)
from policyd.history.reports import ChildReports
from policyd.history.revisions import HistoryError, migrate
from policyd.history.schema import check_rows
from policyd.history.store import CLOSE_FLUSH_TIMEOUT_S

log = logging.getLogger(__name__)

START_TIMEOUT_S: Final = 120.0  # for the child to import, migrate and open the file
# nothing from the child for this long: the link is dead (its heartbeat thread beats every 0.5 s,
# through long calls too; a hung or stopped child does not)
REPORT_STALE_S: Final = 30.0
CLOSE_WAIT_S: Final = 5.0  # a child told to close over a dead link: this long to exit


class HistoryProcess:
    """``History``'s interface, its writer in a child process (see the module's docstring).

    ``stats()`` are the child's latest counters (at most ``STATS_INTERVAL_S`` old) plus what the
    daemon side dropped, and ``pid`` / ``rss_bytes`` of the child."""

    def __init__(
        self,
        config: HistoryConfig,
        *,
        start_timeout_s: float = START_TIMEOUT_S,
        python: str = sys.executable,
        stale_s: float = REPORT_STALE_S,
    ) -> None:
        self.config = config
        self.stale_s = stale_s  # nothing from the child for this long: the link is dead
        self.start_timeout_s = start_timeout_s
        self.python = python
        self._proc: subprocess.Popen[bytes] | None = None
        self._link: DaemonLink | None = None
        self._reports = ChildReports()
        self._drop_lock = threading.Lock()
        self._dropped = 0  # rows not handed over: the socket was full or the child gone
        self._frames_dropped = 0  # frames not handed over (their rows are not known)
        self._last_error: str | None = None
        self._closed = False
        self._rate = config.block_sample_rate
        self._secret = secrets.token_bytes(SECRET_BYTES)

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Migrate the file here (a file of a newer schema raises ``SchemaTooNew`` as the
        in-process writer does), start the child and wait until it has opened the file."""
        if self._proc is not None:
            raise HistoryError("HistoryProcess.start() called twice")
        migrate(self.config.db_path)
        link = self._link = DaemonLink(
            self._secret,
            on_message=self._reports.received,
            on_quiet=self._check_child,
            on_down=lambda: self._reports.fail_pending(
                HistoryError("the link to the history process is down")
            ),
        )
        command = [
            self.python, "-m", "policyd.history.process",
            "--inbox", link.inbox, "--outbox", link.outbox,
            "--config", config_json(self.config), "--parent", str(os.getpid()),
        ]  # fmt: skip
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE)
        assert self._proc.stdin is not None
        self._proc.stdin.write(self._secret.hex().encode() + b"\n")  # never on argv (ps)
        self._proc.stdin.close()
        link.listen()
        try:
            self._reports.ready.result(timeout=self.start_timeout_s)
        except TimeoutError:
            self._abandon("the history process did not start")
            raise HistoryError(
                f"the history process did not open {self.config.db_path} within "
                f"{self.start_timeout_s:.0f} s"
            ) from None
        except HistoryError:
            self._abandon("the history process failed to start")
            raise

    def close(self) -> None:
        """Flush, publish a final snapshot, stop the child. Idempotent."""
        if self._closed:
            return
        self._closed = True
        proc = self._proc
        if proc is None:
            return
        exit_wait_s = 30.0
        problem: str | None = None
        try:
            if proc.poll() is None and self.link_alive:
                self._call("close", (), CLOSE_FLUSH_TIMEOUT_S + 60.0)
            elif proc.poll() is None:  # no reply can come: tell it, give it a little to exit
                exit_wait_s = CLOSE_WAIT_S
                problem = "its link was down"
                if self._link is not None:
                    self._link.send((b"c", encode((0, "close", []))))
        except HistoryError as exc:
            log.warning("closing the history process: %s", exc)
            problem = str(exc)
        finally:
            try:
                proc.wait(timeout=exit_wait_s)
            except subprocess.TimeoutExpired:
                log.warning("the history process did not exit: killing it")
                proc.kill()
                proc.wait(timeout=10.0)
                problem = f"{problem or 'it did not exit'}; killed, rows not yet flushed are lost"
            self._close_link()
        if problem is not None:  # the caller says so (Service.stop: the last word)
            raise HistoryError(f"the history process did not close cleanly: {problem}")

    def _abandon(self, why: str) -> None:
        self._closed = True
        self._last_error = why
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10.0)
        self._close_link()

    def _close_link(self) -> None:
        if self._link is not None:
            self._link.stop_listening()
            self._link.close()

    def _check_child(self) -> None:
        """On the listener thread, while the link is quiet: a child that exited fails every
        call waiting for a reply."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            error = HistoryError(f"the history process exited with code {proc.returncode}")
            self._reports.fail_pending(error)
            if self._link is not None:
                self._link.wait_stopping(0.2)

    @property
    def link_dir(self) -> str | None:
        """The private directory of the link's IPC sockets (None before start / after close)."""
        return None if self._link is None else self._link.dir

    @property
    def link_alive(self) -> bool:
        """The listener thread runs and the child reported within ``stale_s``."""
        return self._link is not None and self._link.alive(self.stale_s)

    @property
    def link_malformed_received(self) -> int:
        """Messages from "the child" that were not its (counted and dropped)."""
        return 0 if self._link is None else self._link.malformed_received

    def __enter__(self) -> HistoryProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- records (never block) ---------------------------------------------------------------

    def _send(self, parts: Sequence[bytes | memoryview | zmq.Frame]) -> bool:
        """Hand a message over without waiting; False when it cannot go now (the caller counts
        what was dropped: ``_count_dropped``)."""
        link = self._link
        return link is not None and not self._closed and link.send(parts)

    def _count_dropped(self, *, rows: int = 0, frames: int = 0) -> None:
        with self._drop_lock:
            self._dropped += rows
            self._frames_dropped += frames

    def record(self, table: str, rows: Sequence[Mapping[str, object]]) -> bool:
        """``History.record``: unknown table or column -> ValueError; rows the child cannot take
        now are dropped and counted (False)."""
        check_rows(table, rows)
        if not rows:
            return True
        if self._send((b"r", encode((table, list(rows))))):
            return True
        self._count_dropped(rows=len(rows))
        return False

    def record_frame(self, frame: zmq.Frame | bytes, received_ts: float) -> bool:
        """An event frame as a connector sent it: the child decodes it (a malformed one is
        counted there, ``link_malformed``), so that the daemon spends nothing on it but the
        hand-over. One the socket cannot take is counted in ``frames_dropped`` (its rows are
        not known without decoding it)."""
        if self._send((b"f", encode_ts(received_ts), frame)):
            return True
        self._count_dropped(frames=1)
        return False

    def record_batch(self, batch: EventBatch, *, received_ts: float) -> None:
        """``History.record_batch``, for batches that did not come as frames (vLLM's KV-event
        stream): encoded here."""
        if not self._send((b"b", encode_ts(received_ts), BATCH_CODEC.encode(batch))):
            self._count_dropped(rows=rows_estimate(batch).rows(self._rate))

    # ---- calls -----------------------------------------------------------------------------

    def _call(self, op: str, args: Sequence[object], timeout_s: float) -> Any:
        proc, link = self._proc, self._link
        if proc is None or proc.poll() is not None or link is None or not link.is_open:
            raise HistoryError(
                f"the history process is not running ({self._last_error or 'stopped'})"
            )
        if not self.link_alive and self._reports.ready.done():  # no reply could come: fail now
            raise HistoryError("the link to the history process is down")
        call_id, future = self._reports.expect_reply()
        try:
            link.send_waiting((b"c", encode((call_id, op, list(args)))))
        except zmq.Again:
            self._reports.forget(call_id)
            raise HistoryError(
                f"the history process took no call within {CALL_SEND_TIMEOUT_S} s"
            ) from None
        deadline = time.monotonic() + timeout_s
        try:
            while True:  # in slices: a link that dies meanwhile fails the call at once
                try:
                    return future.result(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise HistoryError(
                            f"the history process did not answer within {timeout_s} s"
                        ) from None
                    if not self.link_alive:
                        raise HistoryError(
                            "the link to the history process went down during the call"
                        ) from None
        finally:
            self._reports.forget(call_id)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until everything handed over so far is on disk."""
        self._call("flush", (), timeout_s)

    def publish_snapshot(self, timeout_s: float = 600.0) -> Path:
        return Path(self._call("publish_snapshot", (), timeout_s))

    def apply_retention(self, timeout_s: float = 60.0) -> dict[str, int]:
        return dict(self._call("apply_retention", (), timeout_s))

    def query_live(self, sql: str, params: Sequence[object] = ()) -> list[tuple[object, ...]]:
        """Daemon-internal read on the writer's connection (never for user SQL)."""
        return [tuple(row) for row in self._call("query_live", (sql, list(params)), 30.0)]

    @property
    def block_sample_rate(self) -> float:
        rate = self._reports.stats.get("block_sample_rate")
        return float(rate) if isinstance(rate, (int, float)) else self._rate

    def set_block_sample_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"block_sample_rate must be in [0, 1], got {rate}")
        self._call("set_block_sample_rate", (rate,), 10.0)
        self._rate = rate

    def stats(self) -> dict[str, object]:
        """The child's counters, as ``History.stats``, with the rows dropped on this side added
        to ``rows_dropped``, and the child's ``pid``, ``rss_bytes`` and age of the report."""
        stats: dict[str, object] = dict(self._reports.stats)
        path = self.config.db_path
        stats.setdefault("rows_written", {})
        stats.setdefault("snapshot_path", str(self.config.resolved_snapshot_path))
        stats.setdefault("db_path", str(path))
        dropped = stats.get("rows_dropped")
        stats["rows_dropped"] = (dropped if isinstance(dropped, int) else 0) + self._dropped
        stats["frames_dropped"] = self._frames_dropped
        proc = self._proc
        alive = proc is not None and proc.poll() is None and self._reports.ready.done()
        alive = alive and (self._closed or self.link_alive)
        stats["writer_alive"] = bool(alive and stats.get("writer_alive", True))
        stats["link_alive"] = self.link_alive
        stats["link_malformed_received"] = self.link_malformed_received
        stats["process_pid"] = None if proc is None else proc.pid
        received = self._reports.stats_received_s
        stats["process_report_age_s"] = None if received is None else time.monotonic() - received
        if proc is not None and proc.poll() is not None and not self._closed:
            stats["last_error"] = f"the history process exited with code {proc.returncode}"
        elif self._last_error and not stats.get("last_error"):
            stats["last_error"] = self._last_error
        return stats


if __name__ == "__main__":
    from policyd.history.child import main

    raise SystemExit(main())
