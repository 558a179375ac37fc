"""The wire between connectors and the daemon: endpoints and framing.

Events travel connector -> daemon over ZeroMQ PUSH/PULL: the daemon *binds* a PULL socket on
``events_endpoint`` and every connector *connects* a PUSH socket to it. Each message is one frame,
``BATCH_CODEC.encode(EventBatch(...))``; batching (up to ``MAX_EVENTS_PER_BATCH`` events) is what
makes the transport cheap per event: one message and one decode per batch, not per event.

Policy snapshots travel daemon -> connector over PUB/SUB: the daemon *binds* a PUB socket on
``snapshot_endpoint`` and publishes two-frame messages ``[SNAPSHOT_TOPIC,
SNAPSHOT_CODEC.encode(PolicySnapshot(...))]``; connectors *connect* a SUB socket subscribed to
``SNAPSHOT_TOPIC`` and keep only the newest snapshot.

The HTTP API listens on ``http_host:http_port``. Everything binds to loopback unless configured
otherwise. The environment variables below override the defaults for both sides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_EVENTS = "AGENTKV_EVENTS_ENDPOINT"
ENV_SNAPSHOTS = "AGENTKV_SNAPSHOT_ENDPOINT"
ENV_HTTP = "AGENTKV_HTTP_URL"

DEFAULT_EVENTS_ENDPOINT = "tcp://127.0.0.1:5557"
DEFAULT_SNAPSHOT_ENDPOINT = "tcp://127.0.0.1:5558"
DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8470
SNAPSHOT_TOPIC = b"agentkv.snapshot"
MAX_EVENTS_PER_BATCH = 256


@dataclass(frozen=True, slots=True)
class Endpoints:
    events: str = DEFAULT_EVENTS_ENDPOINT
    snapshots: str = DEFAULT_SNAPSHOT_ENDPOINT
    http_url: str = f"http://{DEFAULT_HTTP_HOST}:{DEFAULT_HTTP_PORT}"

    @classmethod
    def from_env(cls) -> Endpoints:
        return cls(
            events=os.environ.get(ENV_EVENTS, DEFAULT_EVENTS_ENDPOINT),
            snapshots=os.environ.get(ENV_SNAPSHOTS, DEFAULT_SNAPSHOT_ENDPOINT),
            http_url=os.environ.get(ENV_HTTP, f"http://{DEFAULT_HTTP_HOST}:{DEFAULT_HTTP_PORT}"),
        )
