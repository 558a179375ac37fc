"""The history writer in a process of its own: ``HistoryProcess`` has ``History``'s interface,
and a child process (``python -m policyd.history.process``) runs the ``History`` itself.

Why: the daemon's threads share one interpreter lock. Turning event batches into rows (a Python
step per event and a numpy conversion per block hash) and DuckDB's statements (~4-6 ms of CPU
each, measured) took ~25% of a core at 500k block events/s even with one block row in 1,024
kept, and up to ~45% at higher sample rates - time the Engine waited for. The child has an
interpreter lock of its own; the daemon only hands it bytes.

The wire (ZeroMQ over IPC sockets in a private directory, the daemon binding both ends):

* the directory is made by ``tempfile.mkdtemp`` (mode 0700) and removed at close, so no other
  local user can connect to either socket (over loopback TCP any local process could: a third
  PULL took half the event frames, and one forged message killed the link, issue #32);
* every message starts with a per-run secret (``secrets.token_bytes``, handed to the child on
  its stdin, never on its command line); a message without it, or otherwise malformed, is
  counted and dropped on either side (``link_malformed`` / ``link_malformed_received``), its
  log line rate-limited;
* daemon -> child, one PUSH socket, in order:
  ``[b"f", ts, frame]`` an event frame as received (already validated by the receiver's codec),
  ``[b"b", ts, frame]`` an event batch the daemon encoded (the vLLM KV-event stream's),
  ``[b"r", msgpack (table, rows)]`` rows for a table,
  ``[b"c", msgpack (call id, operation, arguments)]`` a call (flush, publish_snapshot, ...);
* child -> daemon, one PUSH socket: ``[b"ready", msgpack (ok, error)]`` once, then
  ``[b"stats", msgpack stats]`` every ``STATS_INTERVAL_S`` and ``[b"reply", msgpack (call id,
  ok, result or error)]``.

Nothing blocks a caller: records are sent without waiting, and what the socket's bound
(``SEND_HWM`` messages) does not take is dropped and counted in ``rows_dropped``, like the
in-process writer's queue bound. Calls wait for their reply (with a time limit). The child
ignores SIGINT (the daemon decides when it stops: a Ctrl-C reaches the whole process group) and
exits, after flushing, when the daemon's process goes away. A link that dies (the listener
thread, or no report from the child for ``REPORT_STALE_S``) makes ``writer_alive`` false (so
/readyz fails) and every call fail at once instead of waiting for a reply that cannot come.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Final

import msgspec
import zmq

from policyd.core.memory import rss_bytes
from policyd.core.ratelog import RateLimitedLog, quote
from policyd.core.types import BATCH_CODEC, EventBatch
from policyd.history.fanout import rows_estimate
from policyd.history.revisions import HistoryError, migrate
from policyd.history.schema import check_rows
from policyd.history.store import CLOSE_FLUSH_TIMEOUT_S, History, HistoryConfig

log = logging.getLogger(__name__)

SEND_HWM: Final = 1024  # messages queued for the child (a frame: ~55 KB) before records drop
STATS_INTERVAL_S: Final = 0.5  # how often the child reports its counters
START_TIMEOUT_S: Final = 120.0  # for the child to import, migrate and open the file
CALL_SEND_TIMEOUT_S: Final = 10.0  # a call waits this long for room on the socket
NICE: Final = 10  # the child's scheduling priority, below the daemon's
SECRET_BYTES: Final = 32
# nothing from the child for this long: the link is dead (its heartbeat thread beats every 0.5 s,
# through long calls too; a hung or stopped child does not)
REPORT_STALE_S: Final = 30.0
LINK_PREFIX: Final = "policyd-link-"  # then the daemon's pid: a killed daemon's is removed later
IPC_DIR_MAX_CHARS: Final = 90  # the directory plus "/outbox" within sockaddr_un's 107 bytes
CLOSE_WAIT_S: Final = 5.0  # a child told to close over a dead link: this long to exit


def _enc_hook(obj: Any) -> Any:
    """Values msgpack has no type for: numpy scalars (their Python value), paths."""
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the history process")


def _encode(obj: object) -> bytes:
    """msgpack (the function, not a shared ``Encoder``: callers are on several threads)."""
    return msgspec.msgpack.encode(obj, enc_hook=_enc_hook)


def _decode(data: bytes | memoryview) -> Any:
    return msgspec.msgpack.decode(data)


def _config_json(config: HistoryConfig) -> str:
    return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()})


def _config_from_json(text: str) -> HistoryConfig:
    raw: dict[str, Any] = json.loads(text)
    paths = {"db_path", "snapshot_path"}
    known = {f.name for f in fields(HistoryConfig)}
    values: dict[str, Any] = {
        k: Path(v) if k in paths and v is not None else v for k, v in raw.items() if k in known
    }
    return HistoryConfig(**values)


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
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._out: zmq.Socket[bytes] | None = None
        self._in: zmq.Socket[bytes] | None = None
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._listener: threading.Thread | None = None
        self._ready: Future[None] = Future()
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._calls_lock = threading.Lock()
        self._stats: dict[str, Any] = {}
        self._stats_received_s: float | None = None
        self._heard_s: float | None = None  # the child's last message of any kind (liveness)
        self._dropped = 0  # rows not handed over: the socket was full or the child gone
        self._frames_dropped = 0  # frames not handed over (their rows are not known)
        self._last_error: str | None = None
        self._closed = False
        self._stopping = threading.Event()
        self._rate = config.block_sample_rate
        self._secret = secrets.token_bytes(SECRET_BYTES)
        self._link_dir: str | None = None
        self.link_malformed_received = 0  # messages from "the child" that were not its
        self._ratelog = RateLimitedLog(log)

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
        out = self._ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, SEND_HWM)
        out.setsockopt(zmq.SNDTIMEO, int(CALL_SEND_TIMEOUT_S * 1000))
        inbound = self._ctx.socket(zmq.PULL)
        inbound.setsockopt(zmq.LINGER, 0)
        prefix = f"{LINK_PREFIX}{os.getpid()}-"
        self._link_dir = tempfile.mkdtemp(prefix=prefix)  # 0700: this user only
        if len(self._link_dir) > IPC_DIR_MAX_CHARS and os.path.isdir("/tmp"):
            os.rmdir(self._link_dir)  # a socket path must fit sockaddr_un (~107 bytes)
            self._link_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
        remove_stale_link_dirs(Path(self._link_dir).parent)
        out.bind(f"ipc://{self._link_dir}/inbox")
        inbound.bind(f"ipc://{self._link_dir}/outbox")
        out_endpoint = out.getsockopt_string(zmq.LAST_ENDPOINT)
        in_endpoint = inbound.getsockopt_string(zmq.LAST_ENDPOINT)
        self._out, self._in = out, inbound
        command = [
            self.python, "-m", "policyd.history.process",
            "--inbox", out_endpoint, "--outbox", in_endpoint,
            "--config", _config_json(self.config), "--parent", str(os.getpid()),
        ]  # fmt: skip
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE)
        assert self._proc.stdin is not None
        self._proc.stdin.write(self._secret.hex().encode() + b"\n")  # never on argv (ps)
        self._proc.stdin.close()
        self._listener = threading.Thread(
            target=self._listen, name="policyd-history-link", daemon=True
        )
        self._listener.start()
        try:
            self._ready.result(timeout=self.start_timeout_s)
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
                with self._send_lock, contextlib.suppress(zmq.Again):
                    if self._out is not None:
                        close = (self._secret, b"c", _encode((0, "close", [])))
                        self._out.send_multipart(close, flags=zmq.NOBLOCK)
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
            self._stopping.set()
            if self._listener is not None:
                self._listener.join(timeout=5.0)
            self._close_sockets()
        if problem is not None:  # the caller says so (Service.stop: the last word)
            raise HistoryError(f"the history process did not close cleanly: {problem}")

    def _abandon(self, why: str) -> None:
        self._closed = True
        self._last_error = why
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10.0)
        self._stopping.set()
        if self._listener is not None:
            self._listener.join(timeout=5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        with self._send_lock:
            for sock in (self._out, self._in):
                if sock is not None:
                    sock.close(linger=0)
            self._out = self._in = None
        if self._link_dir is not None:
            shutil.rmtree(self._link_dir, ignore_errors=True)
            self._link_dir = None

    @property
    def link_dir(self) -> str | None:
        """The private directory of the link's IPC sockets (None before start / after close)."""
        return self._link_dir

    @property
    def link_alive(self) -> bool:
        """The listener thread runs and the child reported within ``REPORT_STALE_S``."""
        listener = self._listener
        if listener is None or not listener.is_alive():
            return False
        heard = self._heard_s
        return heard is not None and time.monotonic() - heard < self.stale_s

    def __enter__(self) -> HistoryProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- records (never block) ---------------------------------------------------------------

    def _send(self, parts: Sequence[bytes | memoryview | zmq.Frame]) -> bool:
        """Hand a message over without waiting; False when the socket cannot take it now (the
        caller counts what was dropped: ``_count_dropped``)."""
        with self._send_lock:
            sock = self._out
            if sock is None or self._closed:
                return False
            try:
                sock.send_multipart((self._secret, *parts), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            return True

    def _send_now(self, parts: Sequence[bytes]) -> None:
        """A message sent waiting for room (at most the socket's send timeout)."""
        with self._send_lock:
            if self._out is None:
                raise HistoryError("the history process is stopping")
            self._out.send_multipart((self._secret, *parts))

    def _count_dropped(self, *, rows: int = 0, frames: int = 0) -> None:
        with self._send_lock:
            self._dropped += rows
            self._frames_dropped += frames

    def record(self, table: str, rows: Sequence[Mapping[str, object]]) -> bool:
        """``History.record``: unknown table or column -> ValueError; rows the child cannot take
        now are dropped and counted (False)."""
        check_rows(table, rows)
        if not rows:
            return True
        if self._send((b"r", _encode((table, list(rows))))):
            return True
        self._count_dropped(rows=len(rows))
        return False

    def record_frame(self, frame: zmq.Frame | bytes, received_ts: float) -> bool:
        """An event frame as a connector sent it: the child decodes it (a malformed one is
        counted there, ``link_malformed``), so that the daemon spends nothing on it but the
        hand-over. One the socket cannot take is counted in ``frames_dropped`` (its rows are
        not known without decoding it)."""
        if self._send((b"f", _ts(received_ts), frame)):
            return True
        self._count_dropped(frames=1)
        return False

    def record_batch(self, batch: EventBatch, *, received_ts: float) -> None:
        """``History.record_batch``, for batches that did not come as frames (vLLM's KV-event
        stream): encoded here."""
        if not self._send((b"b", _ts(received_ts), BATCH_CODEC.encode(batch))):
            self._count_dropped(rows=rows_estimate(batch).rows(self._rate))

    # ---- calls -----------------------------------------------------------------------------

    def _call(self, op: str, args: Sequence[object], timeout_s: float) -> Any:
        proc = self._proc
        if proc is None or proc.poll() is not None or self._out is None:
            raise HistoryError(
                f"the history process is not running ({self._last_error or 'stopped'})"
            )
        if not self.link_alive and self._ready.done():  # no reply could come: fail now
            raise HistoryError("the link to the history process is down")
        call_id = next(self._call_ids)
        future: Future[Any] = Future()
        with self._calls_lock:
            self._calls[call_id] = future
        try:
            self._send_now((b"c", _encode((call_id, op, list(args)))))
        except zmq.Again:
            with self._calls_lock:
                self._calls.pop(call_id, None)
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
            with self._calls_lock:
                self._calls.pop(call_id, None)

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
        rate = self._stats.get("block_sample_rate")
        return float(rate) if isinstance(rate, (int, float)) else self._rate

    def set_block_sample_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"block_sample_rate must be in [0, 1], got {rate}")
        self._call("set_block_sample_rate", (rate,), 10.0)
        self._rate = rate

    def stats(self) -> dict[str, object]:
        """The child's counters, as ``History.stats``, with the rows dropped on this side added
        to ``rows_dropped``, and the child's ``pid``, ``rss_bytes`` and age of the report."""
        stats: dict[str, object] = dict(self._stats)
        path = self.config.db_path
        stats.setdefault("rows_written", {})
        stats.setdefault("snapshot_path", str(self.config.resolved_snapshot_path))
        stats.setdefault("db_path", str(path))
        dropped = stats.get("rows_dropped")
        stats["rows_dropped"] = (dropped if isinstance(dropped, int) else 0) + self._dropped
        stats["frames_dropped"] = self._frames_dropped
        proc = self._proc
        alive = proc is not None and proc.poll() is None and self._ready.done()
        alive = alive and (self._closed or self.link_alive)
        stats["writer_alive"] = bool(alive and stats.get("writer_alive", True))
        stats["link_alive"] = self.link_alive
        stats["link_malformed_received"] = self.link_malformed_received
        stats["process_pid"] = None if proc is None else proc.pid
        received = self._stats_received_s
        stats["process_report_age_s"] = None if received is None else time.monotonic() - received
        if proc is not None and proc.poll() is not None and not self._closed:
            stats["last_error"] = f"the history process exited with code {proc.returncode}"
        elif self._last_error and not stats.get("last_error"):
            stats["last_error"] = self._last_error
        return stats

    # ---- the link thread -------------------------------------------------------------------

    def _listen(self) -> None:
        try:
            self._listen_loop()
        finally:  # whatever ends the loop, no call waits for a reply that cannot come
            self._fail_pending(HistoryError("the link to the history process is down"))

    def _listen_loop(self) -> None:
        sock, proc = self._in, self._proc
        assert sock is not None and proc is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(200):
                if proc.poll() is not None:
                    self._child_gone(proc.returncode)
                    if self._stopping.wait(0.2):
                        return
                continue
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                return
            try:
                if len(parts) != 3 or not hmac.compare_digest(parts[0], self._secret):
                    raise ValueError(f"not a message of this run's child ({len(parts)} parts)")
                self._heard_s = time.monotonic()
                self._received(parts[1], _decode(parts[2]))
            except Exception as exc:  # counted and dropped: the link goes on
                self.link_malformed_received += 1
                self._ratelog.warning(
                    "link-malformed",
                    "history link: dropped a malformed message (%d so far): %s",
                    self.link_malformed_received,
                    quote(str(exc)),
                )

    def _received(self, kind: bytes, body: Any) -> None:
        if kind == b"beat":  # the child's heartbeat thread: alive, even inside a long call
            return
        if kind == b"stats":
            if not isinstance(body, dict):
                raise ValueError("stats that are not a mapping")
            self._stats = body
            self._stats_received_s = time.monotonic()
        elif kind == b"reply":
            call_id, ok, value = body
            if not isinstance(call_id, int):
                raise ValueError("a reply without a call id")
            with self._calls_lock:
                future = self._calls.get(call_id)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(HistoryError(str(value)))
        elif kind == b"ready":
            if self._ready.done():
                return
            ok, error = body
            if ok:
                self._stats_received_s = time.monotonic()  # its first report follows
                self._ready.set_result(None)
            else:
                self._ready.set_exception(_start_error(error))
        else:
            raise ValueError(f"unknown message kind {quote(kind, 40)}")

    def _child_gone(self, code: int | None) -> None:
        self._fail_pending(HistoryError(f"the history process exited with code {code}"))

    def _fail_pending(self, error: HistoryError) -> None:
        if not self._ready.done():
            self._ready.set_exception(error)
        with self._calls_lock:
            pending = list(self._calls.values())
        for future in pending:
            if not future.done():
                future.set_exception(error)


def remove_stale_link_dirs(parent: Path) -> None:
    """Remove the link directories of daemons that are gone (killed: nothing removed them)."""
    try:
        entries = list(parent.glob(LINK_PREFIX + "*"))
    except OSError:
        return
    for entry in entries:
        pid = entry.name.removeprefix(LINK_PREFIX).split("-", 1)[0]
        try:
            if not pid.isdigit() or int(pid) == os.getpid() or entry.stat().st_uid != os.geteuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue


def _start_error(error: Any) -> HistoryError:
    """The child's start-up failure, as the exception the in-process writer would raise."""
    from policyd.history.revisions import SchemaTooNew  # noqa: PLC0415

    kind, message = error if isinstance(error, list) and len(error) == 2 else ("", str(error))
    return SchemaTooNew(message) if kind == "SchemaTooNew" else HistoryError(message)


def _ts(value: float) -> bytes:
    return repr(float(value)).encode()


# ---- the child ---------------------------------------------------------------------------------


class _Child:
    """The child's loop: takes messages in order and hands them to its ``History``."""

    def __init__(
        self,
        history: History,
        inbox: zmq.Socket[bytes],
        outbox: zmq.Socket[bytes],
        secret: bytes = b"",
    ):
        self.history = history
        self.inbox = inbox
        self.outbox = outbox
        self.secret = secret
        self.malformed = 0
        self.ratelog = RateLimitedLog(log)
        self._ops: dict[str, Callable[..., object]] = {
            "flush": lambda: history.flush(CLOSE_FLUSH_TIMEOUT_S),
            "publish_snapshot": lambda: str(history.publish_snapshot()),
            "apply_retention": history.apply_retention,
            "query_live": lambda sql, params: [list(r) for r in history.query_live(sql, params)],
            "set_block_sample_rate": history.set_block_sample_rate,
        }

    def send(self, kind: bytes, body: object) -> None:
        self.outbox.send_multipart((self.secret, kind, _encode(body)))

    def report(self) -> None:
        stats = self.history.stats()
        stats["rss_bytes"] = rss_bytes()
        stats["link_malformed"] = self.malformed
        self.send(b"stats", stats)

    def run(self, parent: int) -> None:
        next_report = 0.0
        while True:
            now = time.monotonic()
            if now >= next_report:
                self.report()
                next_report = now + STATS_INTERVAL_S
                if os.getppid() != parent:  # the daemon is gone: flush what came and stop
                    log.warning("history process: the daemon exited; closing the history")
                    return
            if not self.inbox.poll(int(STATS_INTERVAL_S * 1000)):
                continue
            for _ in range(256):
                try:
                    parts = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if self.handle(parts):
                    return

    def handle(self, parts: list[zmq.Frame]) -> bool:
        """One message (the run's secret first); True once told to close."""
        kind = b"?"
        try:
            if len(parts) < 2 or not hmac.compare_digest(parts[0].bytes, self.secret):
                raise ValueError("not a message of this run's daemon")
            parts = parts[1:]
            kind = parts[0].bytes
            if kind in (b"f", b"b"):
                batch = BATCH_CODEC.decode(parts[2].buffer)
                self.history.record_batch(batch, received_ts=float(parts[1].bytes))
            elif kind == b"r":
                table, rows = _decode(parts[1].buffer)
                self.history.record(table, rows)
            elif kind == b"c":
                call_id, op, args = _decode(parts[1].buffer)
                if op == "close":
                    self.history.close()
                    self.report()
                    self.send(b"reply", (call_id, True, None))
                    return True
                self.call(call_id, op, args)
            else:
                raise ValueError(f"unknown message kind {kind!r}")
        except Exception as exc:  # a bad message is counted; the writer goes on
            self.malformed += 1
            self.ratelog.warning(
                "malformed",
                "history process: rejected a %s message (%d so far): %s",
                quote(kind, 20),
                self.malformed,
                quote(str(exc)),
            )
        return False

    def call(self, call_id: int, op: str, args: list[object]) -> None:
        fn = self._ops.get(op)
        try:
            if fn is None:
                raise ValueError(f"unknown history call {op!r}")
            value = fn(*args)
        except Exception as exc:
            self.report()
            self.send(b"reply", (call_id, False, f"{type(exc).__name__}: {exc}"))
            return
        self.report()  # first: the daemon's stats() are fresh once the call returns
        self.send(b"reply", (call_id, True, value))


def _heartbeat(
    ctx: zmq.Context[zmq.Socket[bytes]], outbox: str, secret: bytes, stop: threading.Event
) -> None:
    """Tell the daemon this process lives, from a thread and socket of its own, so that a long
    call (publishing a large snapshot) does not read as a dead link; a hung or stopped process
    stops beating (``REPORT_STALE_S``)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(outbox)
    beat = (secret, b"beat", _encode(None))
    try:
        while not stop.wait(STATS_INTERVAL_S):
            with contextlib.suppress(zmq.Again):
                sock.send_multipart(beat, zmq.NOBLOCK)
    finally:
        sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m policyd.history.process")
    parser.add_argument("--inbox", required=True)
    parser.add_argument("--outbox", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    secret = bytes.fromhex(sys.stdin.readline().strip())  # the run's secret, never on argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon says when to stop
    # the Engine first: on a busy machine the writer gets the CPU the daemon leaves, falls
    # behind and samples fewer block rows (adaptive_sampling) instead of slowing the daemon
    os.nice(NICE)
    logging.basicConfig(
        level=os.environ.get("POLICYD_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s [history process]: %(message)s",
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.setsockopt(zmq.RCVHWM, SEND_HWM)
    inbox.connect(args.inbox)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)
    outbox.connect(args.outbox)
    history = History(_config_from_json(args.config))
    try:
        history.start()
    except Exception as exc:
        outbox.send_multipart((secret, b"ready", _encode((False, [type(exc).__name__, str(exc)]))))
        outbox.close()
        return 1
    outbox.send_multipart((secret, b"ready", _encode((True, None))))
    child = _Child(history, inbox, outbox, secret)
    beating = threading.Event()
    heart = threading.Thread(
        target=_heartbeat, args=(ctx, args.outbox, secret, beating), name="heartbeat", daemon=True
    )
    heart.start()
    try:
        child.run(args.parent)
    finally:
        beating.set()
        heart.join(timeout=2.0)
        history.close()
        inbox.close()
        outbox.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
