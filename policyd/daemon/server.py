"""Running a daemon: the service plus uvicorn, in-process (tests, the demo, the dashboard's
tests) or as ``policyd serve`` (signals: SIGTERM/SIGINT flush the history, checkpoint the
models and publish a final snapshot before exiting)."""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

import uvicorn

from policyd.daemon.api import create_app
from policyd.daemon.service import Service
from policyd.daemon.settings import DaemonSettings

log = logging.getLogger(__name__)

READY_PREFIX = "POLICYD_READY "


@dataclass
class RunningDaemon:
    """A started daemon: its service, HTTP URL and endpoints; ``stop()`` shuts it down."""

    service: Service
    http_url: str
    server: uvicorn.Server
    thread: threading.Thread
    _stopped: bool = field(default=False)

    @property
    def events_endpoint(self) -> str:
        return self.service.events_endpoint

    @property
    def snapshots_endpoint(self) -> str:
        return self.service.snapshots_endpoint

    @property
    def db_path(self) -> str:
        return str(self.service.settings.db)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.should_exit = True
        self.thread.join(timeout=10.0)
        self.service.stop()

    def __enter__(self) -> RunningDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_daemon(settings: DaemonSettings) -> RunningDaemon:
    """Start the service and its HTTP API on a background thread; returns once both listen.

    ``http_port=0`` and ZeroMQ endpoints like ``tcp://127.0.0.1:*`` pick free ports (see
    ``RunningDaemon.http_url`` / ``events_endpoint`` / ``snapshots_endpoint``)."""
    settings.check()  # (settings made with replace() skip load()'s check: the bind rule too)
    service = Service(settings)
    service.start()
    family = socket.AF_INET6 if ":" in settings.http_host else socket.AF_INET
    # proto given explicitly: asyncio sets TCP_NODELAY only on sockets whose proto is TCP, and
    # without it small responses wait ~40 ms for delayed ACKs (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.http_host, settings.http_port))
    except OSError as exc:
        sock.close()
        service.stop()
        raise ValueError(
            f"cannot bind the HTTP API to {settings.http_host}:{settings.http_port}: {exc}"
        ) from None
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        create_app(service),
        log_level="warning",
        access_log=False,
        lifespan="off",
        # clients poll every few seconds: uvicorn's 5 s default races their reuse of the idle
        # connection (the server closes it as the client sends: connection reset)
        timeout_keep_alive=75,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="policyd-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 15.0
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    if not server.started:
        service.stop()
        raise RuntimeError("the HTTP server did not start")
    shown = f"[{host}]" if ":" in host else host
    return RunningDaemon(service, f"http://{shown}:{port}", server, thread)


def serve(settings: DaemonSettings) -> int:
    """``policyd serve``: run until SIGTERM/SIGINT, then shut down cleanly."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.warning("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    daemon = start_daemon(settings)
    ready = {
        "http_url": daemon.http_url,
        "events": daemon.events_endpoint,
        "snapshots": daemon.snapshots_endpoint,
        "db": daemon.db_path,
        "checkpoint": str(settings.checkpoint_path),
        "restored": daemon.service.checkpoint_info["restored"],
    }
    print(READY_PREFIX + json.dumps(ready), flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        daemon.stop()
        problems = daemon.service.stop_problems
        last = "; ".join(problems) if problems else "history flushed, models checkpointed"
        print(f"policyd stopped: {last}", file=sys.stderr, flush=True)
    return 0
