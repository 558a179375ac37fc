"""Shared machinery of the agent workload generators: how an agent's prompt is built.

In every framework we model (LangChain, AutoGen, CrewAI, mini-swe-agent) an agent's prompt is its
system prompt - the same text in every workflow that calls the agent - then the workflow's shared
context (the claim, the issue, the filing), then the agent's own history in this workflow, then
the new message. ``WorkflowPrompts`` keeps one append-only ``PromptBuilder`` per agent of a
workflow, so two calls of one agent share a prefix and two agents diverge at the system prompt,
exactly as chained block hashes see it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from policyd.core.types import HintValue
from policyd.workloads.calls import Call, PromptBuilder


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """Token sizes of one agent: system prompt, and log-normal output length (median, sigma)."""

    name: str
    system_tokens: int
    output_median_tokens: int
    output_sigma: float = 0.5
    output_max_tokens: int = 4096

    def output_tokens(self, rng: random.Random) -> int:
        drawn = rng.lognormvariate(math.log(self.output_median_tokens), self.output_sigma)
        return max(8, min(self.output_max_tokens, round(drawn)))


def lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    """A log-normal draw clipped to [lo, hi]: tool times and message sizes are heavy-tailed."""
    return max(lo, min(hi, rng.lognormvariate(math.log(median), sigma)))


class WorkflowPrompts:
    """Builds the calls of one workflow, one append-only prompt per agent."""

    def __init__(
        self,
        workflow_id: str,
        workflow_type: str,
        context_segment: str,
        context_tokens: int,
        hints: dict[str, HintValue],
    ) -> None:
        self.workflow_id = workflow_id
        self.workflow_type = workflow_type
        self.context_segment = context_segment
        self.context_tokens = context_tokens
        self.hints = hints
        self.calls: list[Call] = []
        self._builders: dict[str, PromptBuilder] = {}

    def call(
        self,
        agent: AgentSpec,
        message_tokens: int,
        output_tokens: int,
        gap_s: float,
        *,
        parallel: bool = False,
        extra_hints: dict[str, HintValue] | None = None,
    ) -> Call:
        """Append a call of ``agent`` with a new message; its output joins its history."""
        builder = self._builders.get(agent.name)
        if builder is None:
            builder = self._builders[agent.name] = PromptBuilder()
            builder.extend(f"sys:{self.workflow_type}:{agent.name}", agent.system_tokens)
            builder.extend(self.context_segment, self.context_tokens)
        step = len(self.calls)
        builder.extend(f"msg:{self.workflow_id}:{step}", message_tokens)
        prompt_blocks = tuple(builder.hashes)
        prompt_tokens = builder.tokens
        output_blocks = tuple(builder.extend(f"out:{self.workflow_id}:{step}", output_tokens))
        hints: dict[str, HintValue] = {**self.hints, "step": step}
        if extra_hints:
            hints.update(extra_hints)
        call = Call(
            workflow_id=self.workflow_id,
            agent=agent.name,
            block_hashes=prompt_blocks,
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            gap_s=gap_s if self.calls else 0.0,
            workflow_type=self.workflow_type,
            output_block_hashes=output_blocks,
            hints=hints,
            parallel=parallel,
        )
        self.calls.append(call)
        return call

    def finish(self) -> list[Call]:
        """The workflow's calls, the last one marked ``last`` (the client's ``workflow_done``)."""
        if self.calls:
            self.calls[-1] = dataclasses.replace(self.calls[-1], last=True)
        return self.calls
