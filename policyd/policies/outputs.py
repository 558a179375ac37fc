"""A call's output blocks, ranked as the prompt that produced them.

An agent's next prompt in a workflow starts with its latest prompt there and the blocks that
call's output completed, so the output is worth what the prompt is. PBKV and KVFlow leave
output blocks unscored (below every live prompt): the first thing a contended GPU evicts,
though the next call starts with them.
"""

from __future__ import annotations

from policyd.core.state import EngineState
from policyd.core.types import BlocksStored, Event, ScoredBlocks, WorkflowFinished
from policyd.policies.rankings import Key


class CallOutputs:
    """Per (workflow, agent), the latest call's prompt and the blocks it stored on the GPU
    beyond that prompt; forgotten when the workflow finishes."""

    def __init__(self) -> None:
        self._latest: dict[Key, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def observe(self, event: Event, state: EngineState) -> None:
        kind = type(event)
        if kind is BlocksStored:
            assert isinstance(event, BlocksStored)
            req = state.requests.get(event.request_id or "")
            if event.tier == "gpu" and req is not None:
                prompt = set(req.block_hashes)
                out = tuple(b for b in event.block_hashes if b not in prompt)
                if out:
                    self._latest[req.workflow_id, req.agent] = (req.block_hashes, out)
        elif kind is WorkflowFinished:
            assert isinstance(event, WorkflowFinished)
            for key in [k for k in self._latest if k[0] == event.workflow_id]:
                del self._latest[key]

    def scored(self, groups: list[ScoredBlocks], state: EngineState) -> list[ScoredBlocks]:
        """``groups`` followed by each output whose prompt is still its agent's latest in the
        workflow, at the score of the group ending with that prompt's last block (outputs of
        prompts no group ends with stay unscored). ``groups`` itself is not changed."""
        if not self._latest:
            return groups
        by_last = {g.block_hashes[-1]: g.score for g in groups}
        extra: list[ScoredBlocks] = []
        for (wid, agent), (prompt, out) in self._latest.items():
            wf = state.workflows.get(wid)
            if wf is None or wf.agent_blocks.get(agent) != prompt or not prompt:
                continue
            score = by_last.get(prompt[-1])
            if score is not None:
                extra.append(ScoredBlocks(score, out))
        return groups + extra
