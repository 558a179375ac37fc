"""A workload as arrays: what the compiled cache model (``policyd.sim.kernel``) replays.

Every block hash becomes a dense id (0..n-1), so each tier is a handful of arrays indexed by
block id instead of dicts. Calls are numbered stream after stream; a call's prompt blocks,
the output blocks the simulator caches for it and the output blocks the workload gives are three
slices of flat id arrays (``*_off[c]`` to ``*_off[c + 1]``). Output blocks whose content the
workload does not give get ids of their own, never referenced again (as ``StreamScheduler``
makes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import numpy.typing as npt

from policyd.core.jit import compiled
from policyd.sim.requests import computed_tokens, request_id
from policyd.workloads.calls import Call, Workload

Ids = npt.NDArray[np.int32]
Offsets = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, eq=False)
class DenseTrace:
    """``workload`` in arrays, for vLLM blocks of ``block_tokens`` tokens."""

    workload: Workload
    block_tokens: int
    calls: list[Call]  # call c, stream after stream
    prompt: Ids  # prompt block ids, call after call
    prompt_off: Offsets
    cached_out: Ids  # the full output blocks the simulator caches when a call finishes
    cached_out_off: Offsets
    given_out: Ids  # every output block the workload gives (the oracle's view of a call)
    given_out_off: Offsets
    physical_blocks: npt.NDArray[np.int64]  # GPU blocks a call occupies while it runs
    prompt_tokens: npt.NDArray[np.int64]
    output_tokens: npt.NDArray[np.int64]
    gap_s: npt.NDArray[np.float64]
    parallel: npt.NDArray[np.bool_]
    stream_first: Offsets  # calls of stream s: stream_first[s] .. stream_first[s + 1] - 1
    stream_of: npt.NDArray[np.int64]
    n_ids: int
    # a call naming one block twice: the compiled model counts references per occurrence, the
    # Python model per distinct block, so such a trace is replayed by the Python model
    repeats_a_block: bool

    @classmethod
    def of(cls, workload: Workload, block_tokens: int) -> DenseTrace:
        calls = [call for stream in workload for call in stream]
        stream_lens = [len(stream) for stream in workload]
        prompt_len = np.fromiter((len(c.block_hashes) for c in calls), np.int64, len(calls))
        given_len = np.fromiter((len(c.output_block_hashes) for c in calls), np.int64, len(calls))
        total = computed_tokens_of(calls)
        n_out = total // block_tokens - prompt_len
        hashes = np.fromiter(
            chain(
                chain.from_iterable(c.block_hashes for c in calls),
                chain.from_iterable(c.output_block_hashes for c in calls),
            ),
            np.uint64,
            int(prompt_len.sum() + given_len.sum()),
        )
        _, inverse = np.unique(hashes, return_inverse=True)
        ids = inverse.astype(np.int32)
        n_known = int(ids.max()) + 1 if len(ids) else 0
        n_prompt = int(prompt_len.sum())
        prompt, given = ids[:n_prompt], ids[n_prompt:]
        given_off = _offsets(given_len)
        cached, n_ids = _cached_outputs(given, given_off, given_len, n_out, n_known)
        prompt_off, cached_off = _offsets(prompt_len), _offsets(n_out)
        return cls(
            workload=workload,
            block_tokens=block_tokens,
            calls=calls,
            prompt=prompt,
            prompt_off=prompt_off,
            cached_out=cached,
            cached_out_off=cached_off,
            given_out=given,
            given_out_off=given_off,
            physical_blocks=-(-total // block_tokens),
            prompt_tokens=np.fromiter((c.prompt_tokens for c in calls), np.int64, len(calls)),
            output_tokens=np.fromiter((c.output_tokens for c in calls), np.int64, len(calls)),
            gap_s=np.fromiter((c.gap_s for c in calls), np.float64, len(calls)),
            parallel=np.fromiter((c.parallel for c in calls), np.bool_, len(calls)),
            stream_first=_offsets(np.asarray(stream_lens, dtype=np.int64)),
            stream_of=np.repeat(np.arange(len(stream_lens), dtype=np.int64), stream_lens),
            n_ids=n_ids,
            repeats_a_block=bool(n_ids)
            and has_repeats(prompt, prompt_off, cached, cached_off, n_ids),
        )

    @property
    def n_calls(self) -> int:
        return len(self.calls)

    def request_id(self, call: int) -> str:
        """The simulator's request id of call ``call`` (``policyd.sim.requests.request_id``)."""
        stream = int(self.stream_of[call])
        return request_id(stream, call - int(self.stream_first[stream]))

    def hit_limits(self, recompute_last_token: bool) -> npt.NDArray[np.int64]:
        """The longest GPU prefix hit each call may take (vLLM always computes the last prompt
        token, so a fully cached prompt loses a block when ``recompute_last_token``)."""
        n = np.diff(self.prompt_off)
        if not recompute_last_token:
            return n
        return np.minimum(n, (self.prompt_tokens - 1) // self.block_tokens)


def computed_tokens_of(calls: list[Call]) -> npt.NDArray[np.int64]:
    """``computed_tokens`` of every call."""
    return np.fromiter(map(computed_tokens, calls), np.int64, len(calls))


def _offsets(lengths: npt.NDArray[np.int64]) -> Offsets:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _cached_outputs(
    given: Ids, given_off: Offsets, given_len: npt.NDArray[np.int64], n_out: Offsets, n_known: int
) -> tuple[Ids, int]:
    """The output blocks cached per call: the first ``n_out`` the workload gives, then fresh
    ids for the rest. Returns them and the number of ids in all."""
    cached = np.empty(int(n_out.sum()), dtype=np.int32)
    next_id = n_known
    at = 0
    for c in np.flatnonzero(n_out).tolist():
        want, have = int(n_out[c]), int(min(n_out[c], given_len[c]))
        start = int(given_off[c])
        cached[at : at + have] = given[start : start + have]
        fresh = want - have
        cached[at + have : at + want] = np.arange(next_id, next_id + fresh, dtype=np.int32)
        next_id += fresh
        at += want
    return cached, next_id


@compiled
def has_repeats(
    prompt: Ids, prompt_off: Offsets, cached_out: Ids, cached_out_off: Offsets, n_ids: int
) -> bool:
    """Whether any call names a block twice (prompt and cached outputs together)."""
    seen = np.full(n_ids, -1, dtype=np.int64)
    for c in range(len(prompt_off) - 1):
        for j in range(prompt_off[c], prompt_off[c + 1]):
            if seen[prompt[j]] == c:
                return True
            seen[prompt[j]] = c
        for j in range(cached_out_off[c], cached_out_off[c + 1]):
            if seen[cached_out[j]] == c:
                return True
            seen[cached_out[j]] = c
    return False
