"""The vocabulary and its wire codec: round trips, and ``CodecError`` (only it) for bad frames."""

from __future__ import annotations

import gc
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from policyd.core.types import (
    BATCH_CODEC,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    SNAPSHOT_CODEC,
    BlocksStored,
    Codec,
    CodecError,
    Event,
    EventBatch,
    PolicySnapshot,
    ScoredBlocks,
    WorkflowFinished,
)
from policyd.policies import POLICIES, make_policy
from tests.conftest import EVENT_STRATEGIES, batches, events, snapshots

CODEC_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
EVENT_CODEC: Codec[Event] = Codec(Event)  # type: ignore[arg-type]  # a union, not a class
ENCODER = msgspec.msgpack.Encoder()


def frame_of(payload: Any, version: Any = PROTOCOL_VERSION) -> bytes:
    """A frame with a hand-made payload (plain msgpack values)."""
    return ENCODER.encode([version, payload])


def builtins_of(message: object) -> Any:
    return msgspec.to_builtins(message)


def decode_or_codec_error(codec: Codec[Any], frame: bytes) -> object | None:
    """Decode; a ``CodecError`` returns None, any other exception fails the test."""
    try:
        decoded: object = codec.decode(frame)
    except CodecError:
        return None
    return decoded


SAMPLE_BATCH = EventBatch(
    source="vllm-0",
    seq=7,
    events=(
        BlocksStored(ts=1.5, tier="gpu", block_hashes=(1, 2**64 - 1), request_id="r1"),
        WorkflowFinished(ts=2.0, workflow_id="w1", reason="idle"),
    ),
)
SAMPLE_SNAPSHOT = PolicySnapshot(
    version=3, ts=1.0, ttl_s=5.0, policy="lru", scores=(ScoredBlocks(0.5, (1, 2)),)
)


# ---- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(EVENT_STRATEGIES), ids=lambda k: k.__name__)
@CODEC_SETTINGS
@given(data=st.data())
def test_every_event_type_round_trips(kind: type, data: st.DataObject) -> None:
    event = data.draw(EVENT_STRATEGIES[kind])
    decoded = EVENT_CODEC.decode(EVENT_CODEC.encode(event))
    assert type(decoded) is kind
    assert decoded == event


@CODEC_SETTINGS
@given(batch=batches)
def test_event_batches_round_trip(batch: EventBatch) -> None:
    assert BATCH_CODEC.decode(BATCH_CODEC.encode(batch)) == batch


@CODEC_SETTINGS
@given(batch=batches)
def test_decoded_batches_are_not_tracked_by_the_garbage_collector(batch: EventBatch) -> None:
    """A queued backlog of events costs a full collection nothing: decoded batches and their
    events are untracked (their hints dicts, when any, are tracked on their own)."""
    decoded = BATCH_CODEC.decode(BATCH_CODEC.encode(batch))
    assert not gc.is_tracked(decoded)
    assert not any(gc.is_tracked(event) for event in decoded.events)


@CODEC_SETTINGS
@given(snapshot=snapshots)
def test_snapshots_round_trip(snapshot: PolicySnapshot) -> None:
    assert SNAPSHOT_CODEC.decode(SNAPSHOT_CODEC.encode(snapshot)) == snapshot


def test_a_frame_is_a_version_and_a_payload() -> None:
    frame = BATCH_CODEC.encode(SAMPLE_BATCH)
    version, payload = msgspec.msgpack.decode(frame)
    assert version == PROTOCOL_VERSION
    assert payload["source"] == "vllm-0"
    assert payload["events"][0]["type"] == "BlocksStored"
    assert BATCH_CODEC.decode(memoryview(frame)) == SAMPLE_BATCH
    assert BATCH_CODEC.decode(bytearray(frame)) == SAMPLE_BATCH


# ---- malformed frames ----------------------------------------------------------------------------


@CODEC_SETTINGS
@given(batch=batches)
def test_every_truncation_of_a_frame_is_a_codec_error(batch: EventBatch) -> None:
    frame = BATCH_CODEC.encode(batch)
    for end in range(len(frame)):
        with pytest.raises(CodecError):
            BATCH_CODEC.decode(frame[:end])


@CODEC_SETTINGS
@given(snapshot=snapshots)
def test_every_truncation_of_a_snapshot_frame_is_a_codec_error(snapshot: PolicySnapshot) -> None:
    frame = SNAPSHOT_CODEC.encode(snapshot)
    for end in range(len(frame)):
        with pytest.raises(CodecError):
            SNAPSHOT_CODEC.decode(frame[:end])


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=64))
def test_garbage_bytes_raise_only_codec_errors(garbage: bytes) -> None:
    for codec in (BATCH_CODEC, SNAPSHOT_CODEC):
        decoded = decode_or_codec_error(codec, garbage)
        assert decoded is None or isinstance(decoded, codec.kind)
    # the same garbage as the payload of a well-versioned frame
    framed = frame_of(msgspec.Raw(garbage)) if _is_msgpack(garbage) else b"\x92\x01" + garbage
    for codec in (BATCH_CODEC, SNAPSHOT_CODEC):
        decoded = decode_or_codec_error(codec, framed)
        assert decoded is None or isinstance(decoded, codec.kind)


def _is_msgpack(data: bytes) -> bool:
    try:
        msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return False
    return True


@CODEC_SETTINGS
@given(batch=batches, flip=st.data())
def test_corrupted_bytes_raise_only_codec_errors(batch: EventBatch, flip: st.DataObject) -> None:
    frame = bytearray(BATCH_CODEC.encode(batch))
    at = flip.draw(st.integers(0, len(frame) - 1))
    frame[at] = flip.draw(st.integers(0, 255))
    decoded = decode_or_codec_error(BATCH_CODEC, bytes(frame))
    assert decoded is None or isinstance(decoded, EventBatch)


@pytest.mark.parametrize("depth", [10, 2_000, 100_000])
def test_deeply_nested_frames_raise_codec_errors(depth: int) -> None:
    """A hostile frame of nested arrays (a few KB) must not escape as ``RecursionError``."""
    nested = b"\x91" * depth + b"\xc0"
    for frame in (b"\x92\x01" + nested, b"\x92" + nested + b"\xc0", nested):
        with pytest.raises(CodecError):
            BATCH_CODEC.decode(frame)


@pytest.mark.parametrize("version", [0, 2, -1, 2**64 - 1, "1", 1.0, True, None, [1]])
def test_a_wrong_protocol_version_is_a_codec_error(version: object) -> None:
    with pytest.raises(CodecError):
        BATCH_CODEC.decode(frame_of(builtins_of(SAMPLE_BATCH), version=version))
    with pytest.raises(CodecError):
        SNAPSHOT_CODEC.decode(frame_of(builtins_of(SAMPLE_SNAPSHOT), version=version))


def test_the_version_error_names_both_versions() -> None:
    with pytest.raises(CodecError, match=r"version 2 .* speaks 1"):
        BATCH_CODEC.decode(frame_of(builtins_of(SAMPLE_BATCH), version=2))


@pytest.mark.parametrize(
    "frame",
    [
        ENCODER.encode(1),
        ENCODER.encode([]),
        ENCODER.encode([PROTOCOL_VERSION]),
        ENCODER.encode({"version": 1, "payload": {}}),
        ENCODER.encode("not a frame"),
        BATCH_CODEC.encode(SAMPLE_BATCH) + b"\xc0",  # trailing bytes
    ],
    ids=["int", "empty-array", "no-payload", "map", "str", "trailing"],
)
def test_frames_of_the_wrong_shape_are_codec_errors(frame: bytes) -> None:
    with pytest.raises(CodecError):
        BATCH_CODEC.decode(frame)


def test_a_frame_with_an_extra_element_is_a_codec_error() -> None:
    """The frame is exactly ``[version, payload]``: a third element is not silently dropped."""
    with pytest.raises(CodecError):
        BATCH_CODEC.decode(frame_of_extra(builtins_of(SAMPLE_BATCH)))


def frame_of_extra(payload: Any) -> bytes:
    return ENCODER.encode([PROTOCOL_VERSION, payload, "extra"])


def _mutations() -> list[tuple[str, Any]]:
    """(id, mutate(batch builtins) -> payload) pairs, each a wrong type or an unknown field."""

    def at_event(key: str, value: Any) -> Any:
        def mutate(b: dict[str, Any]) -> dict[str, Any]:
            b["events"][0][key] = value
            return b

        return mutate

    def at_batch(key: str, value: Any) -> Any:
        def mutate(b: dict[str, Any]) -> dict[str, Any]:
            b[key] = value
            return b

        return mutate

    return [
        ("seq-str", at_batch("seq", "7")),
        ("seq-float", at_batch("seq", 7.5)),
        ("source-bytes", at_batch("source", b"vllm")),
        ("source-none", at_batch("source", None)),
        ("events-map", at_batch("events", {})),
        ("events-of-ints", at_batch("events", [1, 2])),
        ("batch-extra-field", at_batch("extra", 1)),
        ("ts-str", at_event("ts", "now")),
        ("tier-unknown", at_event("tier", "disk")),
        ("hash-str", at_event("block_hashes", ["1"])),
        ("hash-float", at_event("block_hashes", [1.5])),
        ("hash-not-a-list", at_event("block_hashes", 1)),
        ("request-id-int", at_event("request_id", 3)),
        ("event-extra-field", at_event("priority", 1)),
        ("unknown-tag", at_event("type", "BlocksEvaporated")),
        ("tag-int", at_event("type", 1)),
        ("missing-tag", lambda b: {**b, "events": [{"ts": 1.0, "tier": "gpu"}]}),
        ("missing-field", lambda b: {k: v for k, v in b.items() if k != "seq"}),
        ("payload-list", lambda b: list(b.values())),
    ]


@pytest.mark.parametrize("mutate", [m for _, m in _mutations()], ids=[i for i, _ in _mutations()])
def test_wrong_types_unknown_tags_and_extra_fields_are_codec_errors(mutate: Any) -> None:
    payload = mutate(builtins_of(SAMPLE_BATCH))
    with pytest.raises(CodecError):
        BATCH_CODEC.decode(frame_of(payload))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("extra", 1),
        ("version", "3"),
        ("ttl_s", "5"),
        ("scores", [[0.5, [1, 2], "extra"]]),
        ("scores", [[0.5]]),
        ("scores", [{"score": 0.5, "block_hashes": [1]}]),
        ("write_filter", {"mode": "sometimes"}),
        ("write_filter", {"mode": "fixed", "unknown": 1}),
        ("pin", [1.5]),
        ("retired_workflows", [1]),
    ],
    ids=[
        "extra-field",
        "version-str",
        "ttl-str",
        "scored-blocks-extra-element",
        "scored-blocks-short",
        "scored-blocks-map",
        "write-filter-mode",
        "write-filter-extra-field",
        "pin-float",
        "retired-int",
    ],
)
def test_malformed_snapshots_are_codec_errors(field: str, value: object) -> None:
    payload = builtins_of(SAMPLE_SNAPSHOT)
    payload[field] = value
    with pytest.raises(CodecError):
        SNAPSHOT_CODEC.decode(frame_of(payload))


@CODEC_SETTINGS
@given(batch=batches, key=st.text(min_size=1, max_size=8), value=st.integers(0, 2**32))
def test_any_unknown_field_is_a_codec_error(batch: EventBatch, key: str, value: int) -> None:
    assume(batch.events)
    payload = builtins_of(batch)
    assume(key not in payload["events"][0])
    payload["events"][0][key] = value
    with pytest.raises(CodecError):
        BATCH_CODEC.decode(frame_of(payload))


@settings(max_examples=40, deadline=None)
@given(event=events)
def test_a_frame_one_byte_over_the_limit_is_a_codec_error(event: Event) -> None:
    frame = BATCH_CODEC.encode(EventBatch(source="s", seq=1, events=(event,)))
    exact = Codec(EventBatch, max_frame_bytes=len(frame))
    assert exact.decode(frame).events == (event,)
    tight = Codec(EventBatch, max_frame_bytes=len(frame) - 1)
    with pytest.raises(CodecError, match="exceeds"):
        tight.decode(frame)


def test_the_default_limit_rejects_oversized_frames_before_parsing() -> None:
    assert BATCH_CODEC.max_frame_bytes == MAX_FRAME_BYTES
    with pytest.raises(CodecError, match="exceeds"):
        BATCH_CODEC.decode(b"\x00" * (MAX_FRAME_BYTES + 1))


def test_codec_error_is_a_value_error() -> None:
    assert issubclass(CodecError, ValueError)


# ---- the policy registry -------------------------------------------------------------------------


def test_an_unknown_policy_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown policy 'fifo'") as info:
        make_policy("fifo")
    for name in POLICIES:
        assert name in str(info.value)


def test_an_oracle_without_the_future_is_refused() -> None:
    oracles = [name for name, cls in POLICIES.items() if cls.ordering == "oracle"]
    assert "belady" in oracles
    for name in oracles:
        with pytest.raises(ValueError, match="future"):
            make_policy(name)


def test_registered_names_match_the_policies() -> None:
    for name, cls in POLICIES.items():
        assert cls.name == name
