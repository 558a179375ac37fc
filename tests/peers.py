"""An in-test daemon peer: the two sockets ``policyd serve`` binds, on ephemeral loopback ports."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zmq

from policyd.core.wire import Endpoints

Sockets = tuple[zmq.Socket[bytes], zmq.Socket[bytes], Endpoints]


@contextmanager
def daemon_peer() -> Iterator[Sockets]:
    """A PULL (events in) and a PUB (snapshots out) bound as the daemon binds them."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pub = ctx.socket(zmq.PUB)
    endpoints = Endpoints(
        events=f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}",
        snapshots=f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}",
    )
    try:
        yield pull, pub, endpoints
    finally:
        pull.close(0)
        pub.close(0)
        ctx.term()


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``cond`` until it holds or ``timeout_s`` passes; its last answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()
