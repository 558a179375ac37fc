"""The history process itself: ``python -m policyd.history.process`` (started by
``HistoryProcess``) runs a ``History`` and feeds it what the link brings (``policyd.history.link``).

It reads the run's secret from its stdin, ignores SIGINT (the daemon decides when it stops: a
Ctrl-C reaches the whole process group), runs at nice ``NICE`` (the Engine first: on a busy
machine the writer gets the CPU the daemon leaves, falls behind and samples fewer block rows
instead of slowing the daemon), reports its counters every ``STATS_INTERVAL_S``, and exits after
flushing when told to close or when the daemon's process goes away. A malformed message is
counted (``link_malformed``) and dropped; the writer goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

import zmq

from policyd.core.memory import rss_bytes
from policyd.core.ratelog import RateLimitedLog, quote
from policyd.core.types import BATCH_CODEC
from policyd.history.link import SEND_HWM, STATS_INTERVAL_S, config_from_json, decode, encode
from policyd.history.store import CLOSE_FLUSH_TIMEOUT_S, History

log = logging.getLogger(__name__)

NICE: Final = 10  # the child's scheduling priority, below the daemon's


class ChildLoop:
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
        self.outbox.send_multipart((self.secret, kind, encode(body)))

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
                table, rows = decode(parts[1].buffer)
                self.history.record(table, rows)
            elif kind == b"c":
                call_id, op, args = decode(parts[1].buffer)
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


def heartbeat(
    ctx: zmq.Context[zmq.Socket[bytes]], outbox: str, secret: bytes, stop: threading.Event
) -> None:
    """Tell the daemon this process lives, from a thread and socket of its own, so that a long
    call (publishing a large snapshot) does not read as a dead link; a hung or stopped process
    stops beating (``REPORT_STALE_S``)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(outbox)
    beat = (secret, b"beat", encode(None))
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
    history = History(config_from_json(args.config))
    try:
        history.start()
    except Exception as exc:
        outbox.send_multipart((secret, b"ready", encode((False, [type(exc).__name__, str(exc)]))))
        outbox.close()
        return 1
    outbox.send_multipart((secret, b"ready", encode((True, None))))
    child = ChildLoop(history, inbox, outbox, secret)
    beating = threading.Event()
    heart = threading.Thread(
        target=heartbeat, args=(ctx, args.outbox, secret, beating), name="heartbeat", daemon=True
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
