"""A call of the workload as the simulator runs it: ``SimRequest``, and ``computed_tokens``."""

from __future__ import annotations

from dataclasses import dataclass, field

from policyd.workloads.calls import Call


def request_id(stream: int, index: int) -> str:
    """The simulator's id of call ``index`` of stream ``stream``; ``call_of`` reads it back."""
    return f"{stream}.{index}"


def call_of(rid: str) -> tuple[int, int]:
    """The stream and the index in it of request ``rid`` (``request_id``'s)."""
    stream, index = rid.split(".")
    return int(stream), int(index)


def computed_tokens(call: Call) -> int:
    """The tokens vLLM computes KV for: the prompt and every generated token but the last
    (sampled, never fed back). Those are the slots it allocates while the call runs (their
    blocks, rounded up) and the full blocks it caches."""
    return call.prompt_tokens + max(0, call.output_tokens - 1)


@dataclass(slots=True)
class SimRequest:
    """One call in flight: ``rid`` is ``"<stream>.<index>"``; ``physical_blocks`` the GPU blocks
    it occupies while running; ``output_blocks`` the hashes of its full output blocks. The
    scheduler fills the rest at admission: the GPU blocks it holds (``held``) and its scratch
    blocks, its prefix hits, when its prefill ends and the write filter's decision."""

    rid: str
    call: Call
    stream: int
    index: int
    arrival_s: float
    physical_blocks: int
    output_blocks: tuple[int, ...]
    held: list[int] = field(default_factory=list)
    scratch: int = 0
    gpu_hit: int = 0
    host_hit: int = 0
    prefill_end_s: float = 0.0
    may_store: bool = True  # the write filter's decision, taken at the prefix lookup
