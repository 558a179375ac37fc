"""Turning what the connector sees inside vLLM into AgentKV events.

vLLM names a block by a 32-byte sha256 digest chained over its parent and its tokens (an offload
key appends a 4-byte KV-group index); on the wire AgentKV keeps the first 8 bytes, big-endian,
as ``BlockHash`` (policyd.core.types). Every function here is pure: the adapter calls them and hands
the events to the daemon client.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Final

from connector.params import RequestTags
from policyd.core.types import (
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    PrefixHit,
    RequestFinished,
    RequestStarted,
    Tier,
    WorkflowFinished,
)

HASH_BYTES: Final = 8


def block_hash_int(digest: bytes) -> int:
    """The 64-bit wire hash of a vLLM block hash or offload key (its first 8 bytes).

    >>> block_hash_int(bytes(range(32)))
    283686952306183
    """
    return int.from_bytes(digest[:HASH_BYTES], "big")


def block_hash_ints(digests: Sequence[bytes]) -> tuple[int, ...]:
    """The wire hashes of a request's digests, in order. One C-level unpack when the digests
    have one length (one hash function, as in vLLM), else one conversion per digest: this
    runs on vLLM's thread for every request.

    >>> block_hash_ints([bytes(range(32)), bytes(32)])
    (283686952306183, 0)
    """
    n = len(digests)
    if n == 0:
        return ()
    joined = b"".join(digests)
    width = len(digests[0])
    if width < HASH_BYTES or len(joined) != n * width or len(digests[-1]) != width:
        return tuple(block_hash_int(d) for d in digests)
    return _unpacker(n, width).unpack(joined)


@lru_cache(maxsize=4096)
def _unpacker(n: int, width: int) -> struct.Struct:
    """Reads the first 8 bytes, big-endian, of each of ``n`` records of ``width`` bytes."""
    return struct.Struct(">" + f"Q{width - HASH_BYTES}x" * n)


def request_started(
    tags: RequestTags, block_hashes: Sequence[int], prompt_tokens: int, ts: float
) -> RequestStarted:
    return RequestStarted(
        ts=ts,
        request_id=tags.request_id,
        workflow_id=tags.workflow_id,
        agent=tags.agent,
        workflow_type=tags.workflow_type,
        block_hashes=tuple(block_hashes),
        prompt_tokens=prompt_tokens,
        hints=dict(tags.hints),
        session_id=tags.session_id,
    )


def prefix_hit(
    request_id: str,
    *,
    prompt_blocks: int,
    gpu_tokens: int,
    host_tokens: int,
    tokens_per_block: int,
    ts: float,
) -> PrefixHit:
    """How a request's full prompt blocks were served: GPU prefix, host prefix, the rest recomputed.

    >>> prefix_hit("r", prompt_blocks=5, gpu_tokens=64, host_tokens=32, tokens_per_block=32, ts=0)
    PrefixHit(ts=0, request_id='r', gpu_blocks=2, host_blocks=1, recomputed_blocks=2)
    """
    gpu = min(gpu_tokens // tokens_per_block, prompt_blocks)
    host = min(host_tokens // tokens_per_block, prompt_blocks - gpu)
    return PrefixHit(
        ts=ts,
        request_id=request_id,
        gpu_blocks=gpu,
        host_blocks=host,
        recomputed_blocks=prompt_blocks - gpu - host,
    )


def blocks_stored(
    tier: Tier, block_hashes: Sequence[int], ts: float, request_id: str | None = None
) -> BlocksStored:
    return BlocksStored(ts=ts, tier=tier, block_hashes=tuple(block_hashes), request_id=request_id)


def blocks_removed(tier: Tier, block_hashes: Sequence[int], ts: float) -> BlocksRemoved:
    return BlocksRemoved(ts=ts, tier=tier, block_hashes=tuple(block_hashes))


def blocks_loaded(
    block_hashes: Sequence[int], ts: float, request_id: str | None = None
) -> BlocksLoaded:
    return BlocksLoaded(ts=ts, block_hashes=tuple(block_hashes), request_id=request_id)


def request_finished(
    tags: RequestTags, output_tokens: int, ts: float
) -> list[RequestFinished | WorkflowFinished]:
    """The request's end, followed by its workflow's end when the client said ``workflow_done``."""
    out: list[RequestFinished | WorkflowFinished] = [
        RequestFinished(ts=ts, request_id=tags.request_id, output_tokens=output_tokens)
    ]
    if tags.workflow_done:
        out.append(WorkflowFinished(ts=ts, workflow_id=tags.workflow_id, reason="client"))
    return out
