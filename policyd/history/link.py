"""The link between the daemon and its history process: ZeroMQ over IPC sockets in a private
directory, the daemon binding both ends.

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
  ``[b"stats", msgpack stats]`` every ``STATS_INTERVAL_S``, ``[b"reply", msgpack (call id,
  ok, result or error)]``, and ``[b"beat", msgpack None]`` every ``STATS_INTERVAL_S`` from a
  thread of its own (alive, even inside a long call).

``DaemonLink`` is the daemon's end; the child's is ``policyd.history.child``.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Final

import msgspec
import zmq

from policyd.core.ratelog import RateLimitedLog, quote
from policyd.history.config import HistoryConfig
from policyd.history.revisions import HistoryError, SchemaTooNew

log = logging.getLogger(__name__)

SEND_HWM: Final = 1024  # messages queued for the child (a frame: ~55 KB) before records drop
STATS_INTERVAL_S: Final = 0.5  # how often the child reports its counters (and beats)
CALL_SEND_TIMEOUT_S: Final = 10.0  # a call waits this long for room on the socket
SECRET_BYTES: Final = 32
LINK_PREFIX: Final = "policyd-link-"  # then the daemon's pid: a killed daemon's is removed later
IPC_DIR_MAX_CHARS: Final = 90  # the directory plus "/outbox" within sockaddr_un's 107 bytes


def _enc_hook(obj: Any) -> Any:
    """Values msgpack has no type for: numpy scalars (their Python value), paths."""
    item = getattr(obj, "item", None)
    if callable(item):
        return item()
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot send a {type(obj).__name__} to the history process")


def encode(obj: object) -> bytes:
    """msgpack (the function, not a shared ``Encoder``: callers are on several threads)."""
    return msgspec.msgpack.encode(obj, enc_hook=_enc_hook)


def decode(data: bytes | memoryview) -> Any:
    return msgspec.msgpack.decode(data)


def encode_ts(value: float) -> bytes:
    """A timestamp as a message part (``float(part)`` reads it back exactly)."""
    return repr(float(value)).encode()


def config_json(config: HistoryConfig) -> str:
    """The config as the child's ``--config`` argument."""
    return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()})


def config_from_json(text: str) -> HistoryConfig:
    """``config_json``'s inverse; fields this code does not know are left out."""
    raw: dict[str, Any] = json.loads(text)
    paths = {"db_path", "snapshot_path"}
    known = {f.name for f in fields(HistoryConfig)}
    values: dict[str, Any] = {
        k: Path(v) if k in paths and v is not None else v for k, v in raw.items() if k in known
    }
    return HistoryConfig(**values)


def start_error(error: Any) -> HistoryError:
    """The child's start-up failure, ``[kind, message]``, as the exception the in-process
    writer would raise (``SchemaTooNew`` stays itself)."""
    kind, message = error if isinstance(error, list) and len(error) == 2 else ("", str(error))
    return SchemaTooNew(message) if kind == "SchemaTooNew" else HistoryError(message)


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


def _make_link_dir() -> str:
    """A fresh private directory (mode 0700) whose socket paths fit ``sockaddr_un``."""
    prefix = f"{LINK_PREFIX}{os.getpid()}-"
    link_dir = tempfile.mkdtemp(prefix=prefix)  # 0700: this user only
    if len(link_dir) > IPC_DIR_MAX_CHARS and os.path.isdir("/tmp"):
        os.rmdir(link_dir)  # a socket path must fit sockaddr_un (~107 bytes)
        link_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    remove_stale_link_dirs(Path(link_dir).parent)
    return link_dir


class DaemonLink:
    """The daemon's end of the link (see the module): binds both sockets in a private
    directory, sends with the run's secret, and runs the listener thread, which hands each
    authentic message to ``on_message(kind, body)``, counts and drops any other
    (``malformed_received``), calls ``on_quiet()`` after each 200 ms without a message and
    ``on_down()`` once it ends, whatever ends it."""

    def __init__(
        self,
        secret: bytes,
        *,
        on_message: Callable[[bytes, Any], None],
        on_quiet: Callable[[], None],
        on_down: Callable[[], None],
    ) -> None:
        self._secret = secret
        self._on_message = on_message
        self._on_quiet = on_quiet
        self._on_down = on_down
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._send_lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: threading.Thread | None = None
        self.heard_s: float | None = None  # the child's last message of any kind
        self.malformed_received = 0  # messages from "the child" that were not its
        self._ratelog = RateLimitedLog(log)
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.setsockopt(zmq.SNDHWM, SEND_HWM)
        out.setsockopt(zmq.SNDTIMEO, int(CALL_SEND_TIMEOUT_S * 1000))
        inbound = ctx.socket(zmq.PULL)
        inbound.setsockopt(zmq.LINGER, 0)
        self.dir: str | None = _make_link_dir()
        out.bind(f"ipc://{self.dir}/inbox")
        inbound.bind(f"ipc://{self.dir}/outbox")
        self.inbox = out.getsockopt_string(zmq.LAST_ENDPOINT)  # the child's inbox
        self.outbox = inbound.getsockopt_string(zmq.LAST_ENDPOINT)
        self._out: zmq.Socket[bytes] | None = out
        self._in: zmq.Socket[bytes] | None = inbound

    @property
    def is_open(self) -> bool:
        """Its sockets are open (until ``close``)."""
        return self._out is not None

    def listen(self) -> None:
        """Start the listener thread."""
        self._listener = threading.Thread(
            target=self._listen, name="policyd-history-link", daemon=True
        )
        self._listener.start()

    def alive(self, stale_s: float) -> bool:
        """The listener thread runs and the child was heard within ``stale_s``."""
        listener = self._listener
        if listener is None or not listener.is_alive():
            return False
        heard = self.heard_s
        return heard is not None and time.monotonic() - heard < stale_s

    def send(self, parts: Sequence[bytes | memoryview | zmq.Frame]) -> bool:
        """Hand a message over without waiting; False when the socket cannot take it now (or is
        closed)."""
        with self._send_lock:
            if self._out is None:
                return False
            try:
                self._out.send_multipart((self._secret, *parts), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            return True

    def send_waiting(self, parts: Sequence[bytes]) -> None:
        """A message sent waiting for room, at most ``CALL_SEND_TIMEOUT_S`` (then ``zmq.Again``);
        ``HistoryError`` once closed."""
        with self._send_lock:
            if self._out is None:
                raise HistoryError("the history process is stopping")
            self._out.send_multipart((self._secret, *parts))

    def stop_listening(self) -> None:
        """End the listener thread (waiting a little for it)."""
        self._stopping.set()
        if self._listener is not None:
            self._listener.join(timeout=5.0)

    def wait_stopping(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True as soon as the listener is told to stop."""
        return self._stopping.wait(timeout_s)

    def close(self) -> None:
        """Close both sockets and remove the directory (the listener stopped first)."""
        with self._send_lock:
            for sock in (self._out, self._in):
                if sock is not None:
                    sock.close(linger=0)
            self._out = self._in = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def _listen(self) -> None:
        try:
            self._listen_loop()
        finally:  # whatever ends the loop, no call waits for a reply that cannot come
            self._on_down()

    def _listen_loop(self) -> None:
        sock = self._in
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(200):
                self._on_quiet()
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
                self.heard_s = time.monotonic()
                self._on_message(parts[1], decode(parts[2]))
            except Exception as exc:  # counted and dropped: the link goes on
                self.malformed_received += 1
                self._ratelog.warning(
                    "link-malformed",
                    "history link: dropped a malformed message (%d so far): %s",
                    self.malformed_received,
                    quote(str(exc)),
                )
