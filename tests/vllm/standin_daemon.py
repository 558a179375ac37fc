"""A stand-in daemon process for the engine tests: the real wire, scripted decisions.

It binds the PULL and PUB sockets exactly as ``policyd serve`` does (policyd.core.wire), appends
every event it receives to ``events_path`` as one JSON line, and every 50 ms publishes the snapshot
found in ``snapshot_path`` (a JSON ``PolicySnapshot``), or random bytes when that file says
``GARBAGE``. The tests write the file to script the decisions and kill the process to test a
daemon that dies; ``policyd serve`` computes its own decisions, which a test cannot pin down.

    python tests/vllm/standin_daemon.py EVENTS_ENDPOINT SNAPSHOT_ENDPOINT EVENTS_PATH SNAPSHOT_PATH
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgspec
import zmq

from policyd.core.types import BATCH_CODEC, SNAPSHOT_CODEC, CodecError, PolicySnapshot
from policyd.core.wire import SNAPSHOT_TOPIC


def main(argv: list[str]) -> None:
    events_ep, snapshots_ep, events_path, snapshot_path = argv
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(events_ep)
    pub = ctx.socket(zmq.PUB)
    pub.bind(snapshots_ep)
    out = Path(events_path).open("ab")  # noqa: SIM115 - open for the process's life
    encoder = msgspec.json.Encoder()
    snap_file = Path(snapshot_path)
    next_pub = 0.0
    while True:
        if pull.poll(20):
            try:
                batch = BATCH_CODEC.decode(pull.recv())
            except CodecError:
                continue
            out.write(b"".join(encoder.encode(ev) + b"\n" for ev in batch.events))
            out.flush()
        now = time.monotonic()
        if now >= next_pub and snap_file.exists():
            next_pub = now + 0.05
            raw = snap_file.read_bytes()
            if raw.startswith(b"GARBAGE"):
                pub.send_multipart([SNAPSHOT_TOPIC, os.urandom(64)])
            elif raw:
                try:
                    snap = msgspec.json.decode(raw, type=PolicySnapshot)
                except msgspec.DecodeError:
                    continue
                pub.send_multipart([SNAPSHOT_TOPIC, SNAPSHOT_CODEC.encode(snap)])


if __name__ == "__main__":
    main(sys.argv[1:])
