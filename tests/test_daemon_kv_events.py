"""vLLM's native KV event stream (vLLM 0.32) into the daemon: frames published
with real pyzmq + msgpack exactly as vLLM sends them - ``[topic, 8-byte big-endian seq,
msgpack [ts, [events], dp_rank]]`` - with events as maps tagged by ``"type"`` and in
vLLM's array_like form; a sequence gap is recovered from a ROUTER replay endpoint."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from policyd.core.types import AllBlocksCleared, BlocksRemoved, BlocksStored
from policyd.daemon import views
from policyd.daemon.kv_events import KvEventError, block_key, translate_payload
from policyd.daemon.server import RunningDaemon, start_daemon
from policyd.daemon.settings import DaemonSettings

encode = msgspec.msgpack.Encoder().encode
TOPIC = b"kv-events"


def digest(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def key(i: int) -> int:
    return int.from_bytes(digest(i)[:8], "big")


def stored_map(ids: list[int], medium: str | None) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [digest(i) for i in ids],
            "parent_block_hash": None, "token_ids": list(range(16 * len(ids))),
            "block_size": 16, "lora_id": None, "medium": medium}  # fmt: skip


def payload(events: list[object], ts: float = 1.0) -> bytes:
    return encode([ts, events, 0])


def test_block_keys_are_the_first_eight_bytes_big_endian() -> None:
    d = digest(1)
    assert block_key(d) == int.from_bytes(d[:8], "big")
    assert block_key(2**70 + 5) == 5  # ints reduced modulo 2^64
    with pytest.raises(KvEventError):
        block_key(b"short")
    with pytest.raises(KvEventError):
        block_key(1.5)


def test_translation_of_both_encodings_and_media() -> None:
    events: list[object] = [
        stored_map([1, 2], "GPU"),
        stored_map([3], "CPU"),
        ["BlockStored", [digest(4)], None, [], 16, None, "GPU"],  # vLLM's array_like form
        {"type": "BlockRemoved", "block_hashes": [digest(1)], "medium": "GPU"},
        ["BlockRemoved", [digest(3)], "CPU"],
        {"type": "AllBlocksCleared"},
        stored_map([5], "DISK"),  # a medium we do not model: skipped, counted
        {"type": "SomethingNew"},
    ]
    tr = translate_payload(payload(events), now=7.0)
    assert tr.skipped == 2
    assert tr.events == [
        BlocksStored(ts=7.0, tier="gpu", block_hashes=(key(1), key(2))),
        BlocksStored(ts=7.0, tier="host", block_hashes=(key(3),)),
        BlocksStored(ts=7.0, tier="gpu", block_hashes=(key(4),)),
        BlocksRemoved(ts=7.0, tier="gpu", block_hashes=(key(1),)),
        BlocksRemoved(ts=7.0, tier="host", block_hashes=(key(3),)),
        AllBlocksCleared(ts=7.0, tier="gpu"),
    ]


@pytest.mark.parametrize(
    "bad",
    [b"\xc1", encode({"ts": 1}), encode([1.0, "events", 0]), encode([1.0, [7], 0]),
     encode([1.0, [{"type": "BlockStored", "block_hashes": [b"x"], "medium": "GPU"}], 0]),
     encode([1.0, [{"type": "BlockStored", "block_hashes": [digest(1)], "medium": 5}], 0])],
)  # fmt: skip
def test_malformed_payloads_raise(bad: bytes) -> None:
    with pytest.raises(KvEventError):
        translate_payload(bad, now=0.0)


class FakeVllmPublisher:
    """vLLM's side with real sockets: a PUB for the stream and a ROUTER that answers replay
    requests ``[identity, b"", start_seq]`` with ``[identity, b"", seq, payload]`` frames and an
    end marker (seq -1, empty payload), as vLLM's ZmqEventPublisher does."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: dict[int, bytes] = {}
        self.replays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, _, start = self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for seq in sorted(s for s in self.buffer if s >= first):
                self.router.send_multipart(
                    [identity, b"", seq.to_bytes(8, "big"), self.buffer[seq]]
                )
            self.router.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def publish(self, seq: int, body: bytes, *, send: bool = True) -> None:
        self.buffer[seq] = body
        if send:
            self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), body])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()


@pytest.fixture
def vllm() -> Iterator[FakeVllmPublisher]:
    publisher = FakeVllmPublisher()
    yield publisher
    publisher.close()


def wait_for(cond: Callable[[], bool], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_daemon_subscribes_translates_and_replays_a_gap(
    tmp_path: Path, vllm: FakeVllmPublisher
) -> None:
    settings = DaemonSettings.load({
        "db": tmp_path / "h.duckdb", "events": "tcp://127.0.0.1:*",
        "snapshots": "tcp://127.0.0.1:*", "http_port": 0, "vllm_events": vllm.endpoint,
        "vllm_replay": vllm.replay_endpoint, "vllm_topic": TOPIC.decode(),
    })  # fmt: skip
    daemon: RunningDaemon = start_daemon(settings)
    try:
        service = daemon.service
        resident = service.engine.state.resident
        # PUB/SUB drops messages until the subscription lands: publish seq 1 until it is seen
        first = payload([stored_map([1, 2], "GPU")])

        def first_seen() -> bool:
            vllm.publish(1, first)
            return key(1) in resident["gpu"]

        assert wait_for(first_seen)
        vllm.publish(2, payload([stored_map([3], "CPU")]), send=False)  # lost on the wire
        vllm.publish(3, payload([{"type": "BlockRemoved", "block_hashes": [digest(1)],
                                  "medium": "GPU"}]))  # fmt: skip
        assert wait_for(lambda: key(1) not in resident["gpu"])
        assert key(3) in resident["host"]  # recovered through the replay endpoint
        assert key(2) in resident["gpu"]
        counters = views.stats(service)["kv_events"]
        assert counters["seq_gaps"] == 1 and counters["replayed_batches"] >= 1
        assert counters["malformed"] == 0 and vllm.replays == 1
        vllm.pub.send_multipart([TOPIC, b"\x00\x01", b"x"])  # a bad seq frame: counted only
        vllm.publish(4, b"\xc1")  # a bad payload
        assert wait_for(lambda: views.stats(service)["kv_events"]["malformed"] == 2)
        assert service.ready()["ready"]
    finally:
        daemon.stop()
