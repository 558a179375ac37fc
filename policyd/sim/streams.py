"""The closed loop: which calls of the workload arrive, and when.

``concurrency`` streams run at once, in the workload's order (empty streams skipped). A stream
issues its calls a step at a time: a call and the calls after it marked ``parallel`` (a fan-out)
arrive together, and the next step arrives ``gap_s`` after the last of them finished. When a
stream's last call finishes, the next stream starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count

from policyd.sim.requests import SimRequest, computed_tokens, request_id
from policyd.sim.timeline import ARRIVE, Timeline
from policyd.workloads.calls import Call, Stream, Workload

_SYNTHETIC_BIT = 1 << 63  # hashes for output blocks whose content the workload does not give


class StreamScheduler:
    """Sets an ``ARRIVE`` timer for each call when its step is issued; ``call_finished`` is told
    of every finished call and issues what follows it."""

    def __init__(
        self, workload: Workload, *, concurrency: int, block_tokens: int, timeline: Timeline
    ) -> None:
        self.workload = workload
        self.concurrency = concurrency
        self.block_tokens = block_tokens
        self.timeline = timeline
        self._streams: Iterator[tuple[int, Stream]] = iter(())
        self._outstanding: dict[int, int] = {}  # stream -> calls of its current step running
        self._next_step: dict[int, int] = {}  # stream -> index of its next step's first call
        self._synthetic = count()

    def start(self) -> None:
        """Start the first ``concurrency`` streams."""
        self._streams = enumerate(self.workload)
        active = 0
        for stream_index, stream in self._streams:
            if stream:
                self._arrive(stream_index, stream, 0)
                active += 1
                if active >= self.concurrency:
                    break

    def call_finished(self, req: SimRequest) -> bool:
        """``req`` finished: issue its stream's next step once its step is done, or the next
        stream once its stream is; True when it was its stream's last call."""
        self._outstanding[req.stream] -= 1
        if self._outstanding[req.stream] > 0:
            return False  # other calls of this fan-out step still run
        stream = self.workload.streams[req.stream]
        if (nxt := self._next_step[req.stream]) < len(stream):
            self._arrive(req.stream, stream, nxt)
            return False
        del self._outstanding[req.stream], self._next_step[req.stream]
        for stream_index, following in self._streams:
            if following:
                self._arrive(stream_index, following, 0)
                break
        return True

    def _arrive(self, stream_index: int, stream: Stream, index: int) -> None:
        """Issue the step starting at call ``index``: that call and the calls after it marked
        ``parallel`` (a fan-out); the stream's next step waits for all of them."""
        end = index + 1
        while end < len(stream) and stream[end].parallel:
            end += 1
        self._outstanding[stream_index] = end - index
        self._next_step[stream_index] = end
        for i in range(index, end):
            self._issue(stream_index, stream[i], i)

    def _issue(self, stream_index: int, call: Call, index: int) -> None:
        total_tokens = computed_tokens(call)
        physical = -(-total_tokens // self.block_tokens)
        n_out = total_tokens // self.block_tokens - len(call.block_hashes)
        output = call.output_block_hashes[:n_out]
        if len(output) < n_out:  # content unknown: unique blocks nobody will reuse
            output += tuple(
                _SYNTHETIC_BIT | next(self._synthetic) for _ in range(n_out - len(output))
            )
        when = self.timeline.now + (call.gap_s if index > 0 else 0.0)
        rid = request_id(stream_index, index)
        req = SimRequest(rid, call, stream_index, index, when, physical, output)
        self.timeline.at(when, ARRIVE, req)
