"""What a workload is: streams of agent calls, each call a prompt of chained-hash KV blocks.

A *stream* is one closed loop of calls: a workflow (planner -> coder -> tester ...) or one agent's
conversation. Call k+1 of a stream is issued ``gap_s`` seconds (tool time) after call k finished;
calls marked ``parallel`` are issued together with the call before them (a fan-out step) and the
next step waits for all of them.
The simulator keeps ``concurrency`` streams active and starts the next one when one ends.

Blocks are 16-token units identified by a chained hash, exactly as vLLM's prefix cache does:
a block's hash covers its parent's hash and its own tokens, so equal hashes mean equal prefixes.
``block_hashes`` lists the prompt's full blocks first, then (``output_block_hashes``) the full
blocks the call's output completes, which vLLM also caches and a later prompt may reuse.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from policyd.core.types import BLOCK_SIZE_TOKENS, HintValue

ROOT_HASH = 0


def chain_hash(parent: int, key: bytes) -> int:
    """A block's 64-bit hash from its parent's hash and its content (token bytes or an id)."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little") + key, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash_tokens(
    tokens: Sequence[int], parent: int = ROOT_HASH, *, block_tokens: int = BLOCK_SIZE_TOKENS
) -> list[int]:
    """Chained hashes of the full ``block_tokens`` blocks of ``tokens`` (a partial tail block is
    not cached by vLLM and gets no hash)."""
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        chunk = tokens[start : start + block_tokens]
        parent = chain_hash(parent, b"".join(t.to_bytes(4, "little") for t in chunk))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class Call:
    """One LLM request of an agent inside a stream."""

    workflow_id: str
    agent: str
    block_hashes: tuple[int, ...]
    prompt_tokens: int
    output_tokens: int = 0
    gap_s: float = 0.0
    workflow_type: str = ""
    output_block_hashes: tuple[int, ...] = ()
    hints: dict[str, HintValue] = field(default_factory=dict)
    last: bool = False
    parallel: bool = False  # issued together with the previous call (a fan-out step)

    def __post_init__(self) -> None:
        if self.prompt_tokens < len(self.block_hashes) * BLOCK_SIZE_TOKENS:
            raise ValueError(
                f"call of {self.workflow_id}/{self.agent}: {len(self.block_hashes)} blocks need at "
                f"least {len(self.block_hashes) * BLOCK_SIZE_TOKENS} prompt tokens, "
                f"got {self.prompt_tokens}"
            )


Stream = Sequence[Call]


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, re-iterable source of streams."""

    name: str
    streams: Sequence[Stream]
    description: str = ""

    def __iter__(self) -> Iterator[Stream]:
        return iter(self.streams)

    @property
    def calls(self) -> int:
        return sum(len(s) for s in self.streams)

    @property
    def block_refs(self) -> int:
        return sum(len(c.block_hashes) for s in self.streams for c in s)

    def reordered(self, seed: int) -> Workload:
        """The same streams in another order of arrival: seed 0 keeps the recorded order,
        any other seed shuffles it (reproducibly). For a trace whose streams are independent
        workflows (SWE-bench trajectories, group chats), whose order in the file says nothing
        about when they ran: several orders measure how much a comparison owes to one of them.

        >>> w = Workload("w", [(Call("a", "x", (), 0),), (Call("b", "x", (), 0),),
        ...                    (Call("c", "x", (), 0),)])
        >>> [s[0].workflow_id for s in w.reordered(0)], [s[0].workflow_id for s in w.reordered(1)]
        (['a', 'b', 'c'], ['b', 'c', 'a'])
        """
        if seed == 0:
            return self
        streams = list(self.streams)
        random.Random(seed).shuffle(streams)
        return Workload(self.name, streams, f"{self.description} (order: seed {seed})".lstrip())


def arrival_order(stream: Stream) -> list[Call]:
    """The stream's calls in the order they start. A step (a call and the ``parallel`` calls
    after it) is issued at once and each of its calls starts ``gap_s`` later (its own tool
    time; the stream's first call at once), so a fan-out's calls start in the order of their
    gaps, ties in stream order - as the simulator issues them. A stream without fan-outs is
    its own arrival order.

    >>> calls = [Call("w", a, (), 0, gap_s=g, parallel=p)
    ...          for a, g, p in (("plan", 0.0, False), ("x", 0.9, False), ("y", 0.2, True))]
    >>> [c.agent for c in arrival_order(calls)]
    ['plan', 'y', 'x']
    """
    steps: list[list[Call]] = []
    for call in stream:
        if call.parallel and steps:
            steps[-1].append(call)
        else:
            steps.append([call])
    first = stream[0] if stream else None
    return [
        call
        for step in steps
        for call in sorted(step, key=lambda c: 0.0 if c is first else c.gap_s)
    ]


def sequential(calls: Iterable[Call], name: str = "sequential") -> Workload:
    """Every call its own stream: with concurrency 1 the simulator replays them in order."""
    return Workload(name=name, streams=[(c,) for c in calls])


class PromptBuilder:
    """An append-only token sequence made of named segments, hashed into chained blocks.

    Token ``i`` of segment ``s`` is identified by ``(s, i)``, so two prompts built from the
    same segments in the same order share exactly the blocks vLLM would share, without
    materialising tokens. ``extend`` returns the hashes of the blocks it completed.
    """

    __slots__ = ("_parent", "_pending", "hashes", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.hashes: list[int] = []
        self._parent = ROOT_HASH
        self._pending: list[tuple[str, int, int]] = []  # pieces of the partial tail block

    def copy(self) -> PromptBuilder:
        other = PromptBuilder()
        other.tokens = self.tokens
        other.hashes = list(self.hashes)
        other._parent = self._parent
        other._pending = list(self._pending)
        return other

    def extend(self, segment: str, n_tokens: int) -> list[int]:
        if n_tokens < 0:
            raise ValueError(f"segment {segment!r}: negative length {n_tokens}")
        new: list[int] = []
        offset = 0
        while offset < n_tokens:
            filled = self.tokens % BLOCK_SIZE_TOKENS
            take = min(BLOCK_SIZE_TOKENS - filled, n_tokens - offset)
            self._pending.append((segment, offset, take))
            offset += take
            self.tokens += take
            if filled + take == BLOCK_SIZE_TOKENS:
                key = repr(self._pending).encode()
                self._parent = chain_hash(self._parent, key)
                new.append(self._parent)
                self._pending.clear()
        self.hashes.extend(new)
        return new
