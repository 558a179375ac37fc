"""agentkv's host-tier admission: EfficientAgent's write filter, generalised.

Per request, on the daemon's synchronous path (``POST /api/decide/admit``), ``HostAdmission``
asks whether each written block is reused before the tier would evict it, and whether it is
worth more than what it displaces. In order:

1. lifecycle: the workflow finished - only the agent's shared prefix is written;
2. room: the tier holds the write without evicting anything - written (it can cost no hit:
   Proposition 1's loss needs an eviction);
3. value: everything the write would evict ranks below the request's private prompt in the
   host tier's order (``HostOrder``, by which the tier also evicts) - written;
4. prediction: that order values the prompt below ``MIN_REUSE`` - only the shared prefix;
5. EfficientAgent's rule with its threshold replaced by Proposition 1's condition estimated
   online: no pressure, a small extension (at most ``max_new_blocks``), or an expected stack
   distance below the capacity (``WorkflowPacing``: it survives until reused) - written;
   otherwise declined.

The connector and the simulator decide locally, from the snapshot (no call into the daemon from
inside vLLM): EfficientAgent's rule, ``write_filter``. ``decisions`` counts the outcomes.
"""

from __future__ import annotations

from collections.abc import Sequence

from policyd.core.state import EngineState
from policyd.core.types import BLOCK_SIZE_TOKENS, Admit, WriteFilter
from policyd.policies.efficientagent import WorkingSet, declined_refill
from policyd.policies.host_order import HostOrder
from policyd.policies.pacing import WorkflowPacing

MIN_REUSE = 0.05  # a prompt the host order values below this is not expected to be reused


class HostAdmission:
    """The admission decisions (``admit``), the snapshot's write filter, and their counts.

    ``kappa_chunks`` chunks of ``chunk_tokens`` tokens are a small extension; the tier is under
    pressure when EfficientAgent's test holds with occupancy threshold ``theta``."""

    def __init__(
        self,
        *,
        host_order: HostOrder,
        pacing: WorkflowPacing,
        working_set: WorkingSet,
        kappa_chunks: int = 8,
        chunk_tokens: int = 1024,
        theta: float = 0.95,
    ) -> None:
        if kappa_chunks < 0:
            raise ValueError(f"kappa_chunks must be >= 0, got {kappa_chunks}")
        if not 0.0 <= theta <= 1.0:
            raise ValueError(f"theta must be in [0, 1], got {theta}")
        self.host_order = host_order
        self.pacing = pacing
        self.working_set = working_set
        self.max_new_blocks = kappa_chunks * (chunk_tokens // BLOCK_SIZE_TOKENS)
        self.theta = theta
        self.decisions = {
            "room": 0,
            "value": 0,
            "all": 0,
            "dead": 0,
            "extension": 0,
            "survives": 0,
            "declined": 0,
        }

    def pressure(self, state: EngineState, now: float) -> bool:
        """EfficientAgent's pressure: the tier full, evicting, a working set above it."""
        return self.working_set.pressure(state, now, theta=self.theta, source="shards")

    def write_filter(self, pressure: bool) -> WriteFilter:
        """EfficientAgent's rule for a connector that applies snapshots only."""
        return WriteFilter(
            mode="conditioned", max_new_blocks=self.max_new_blocks, pressure=pressure
        )

    def admit_by_filter(
        self, request_id: str, block_hashes: Sequence[int], state: EngineState
    ) -> Admit:
        """The write filter alone (``write_filter``'s rule, EfficientAgent's): a request
        adding more than ``max_new_blocks`` new blocks is declined under pressure."""
        blocks = tuple(block_hashes)
        new = len(set(blocks).difference(state.resident["host"]))
        if new > self.max_new_blocks and self.pressure(state, self.pacing.now_ts):
            self.decisions["declined"] += 1
            return declined_refill(request_id, blocks, new, self.max_new_blocks)
        self.decisions["all"] += 1
        return Admit(request_id=request_id, block_hashes=blocks, reason="write filter: save")

    def admit(
        self, request_id: str, block_hashes: Sequence[int], state: EngineState, *, degraded: bool
    ) -> Admit:
        """The decision for the request's blocks (steps 1-5 above; ``degraded``: the host
        order values by steps alone). An unknown request stores everything, as vLLM does."""
        blocks = tuple(block_hashes)
        req = state.requests.get(request_id)
        if req is None:
            return Admit(request_id=request_id, block_hashes=blocks, reason="unknown request")
        wf = state.workflows.get(req.workflow_id)
        shared = set(state.agent_prefix.get(req.agent, ()))
        ws = self.working_set
        if wf is not None and wf.done:
            return self._dead(request_id, blocks, shared, "workflow finished (lifecycle)")
        resident = state.resident["host"]
        new = len(set(blocks).difference(resident))
        overflow = len(resident) + new - ws.host_blocks
        if overflow <= 0:
            self.decisions["room"] += 1
            return Admit(request_id=request_id, block_hashes=blocks, reason="room in the tier")
        value = self.host_order.value(req.workflow_id, req.agent, state, degraded=degraded)
        if value is not None and self.host_order.displaced_below(value, overflow, state):
            self.decisions["value"] += 1
            return Admit(
                request_id=request_id,
                block_hashes=blocks,
                reason=f"displaces only blocks ranked below {value:.2f}",
            )
        if value is not None and value < MIN_REUSE:
            return self._dead(request_id, blocks, shared, "no reuse expected (prediction)")
        if not self.pressure(state, self.pacing.now_ts):
            self.decisions["all"] += 1
            return Admit(request_id=request_id, block_hashes=blocks, reason="no pressure")
        if len(blocks) <= self.max_new_blocks:
            self.decisions["extension"] += 1
            return Admit(request_id=request_id, block_hashes=blocks, reason="small extension")
        pacing = self.pacing
        distance = pacing.reference_rate_blocks_per_s() * pacing.expected_reuse_s(req.workflow_id)
        if distance < ws.host_blocks:
            self.decisions["survives"] += 1
            return Admit(
                request_id=request_id,
                block_hashes=blocks,
                reason=f"expected distance {distance:.0f} < host {ws.host_blocks}",
            )
        self.decisions["declined"] += 1
        return Admit(
            request_id=request_id,
            block_hashes=(),
            declined=blocks,
            reason="refill under pressure, evicted before reuse",
        )

    def _dead(self, request_id: str, blocks: tuple[int, ...], shared: set[int], why: str) -> Admit:
        self.decisions["dead"] += 1
        return Admit(
            request_id=request_id,
            block_hashes=tuple(b for b in blocks if b in shared),
            declined=tuple(b for b in blocks if b not in shared),
            reason=why,
        )
