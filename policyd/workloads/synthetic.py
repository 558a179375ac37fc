"""A seeded synthetic multi-agent workload: each workflow's agents follow a Markov chain.

Each workflow is a task (its shared context) worked on by agents chosen by a Markov chain. An
agent's prompt is its system prompt (shared by every workflow that calls it), the task, then its
own growing history in this workflow (previous messages and outputs), then the new message - so
calls of one agent share a prefix and different agents diverge at the system prompt.
"""

from __future__ import annotations

import random

from policyd.workloads.calls import Call, PromptBuilder, Workload

AGENTS = ("planner", "researcher", "coder", "tester", "writer")
# row: from-agent, columns: to-agent (same order as AGENTS)
TRANSITIONS = (
    (0.05, 0.45, 0.35, 0.05, 0.10),
    (0.15, 0.30, 0.35, 0.05, 0.15),
    (0.05, 0.10, 0.15, 0.60, 0.10),
    (0.10, 0.05, 0.55, 0.10, 0.20),
    (0.30, 0.20, 0.20, 0.10, 0.20),
)


def synthetic_agents(
    *,
    seed: int = 0,
    workflows: int = 200,
    min_steps: int = 4,
    max_steps: int = 12,
    system_tokens: tuple[int, int] = (600, 2400),
    context_tokens: tuple[int, int] = (300, 3000),
    message_tokens: tuple[int, int] = (40, 600),
    output_tokens: tuple[int, int] = (30, 300),
    mean_gap_s: float = 1.0,
) -> Workload:
    rng = random.Random(seed)
    system = {a: rng.randint(*system_tokens) for a in AGENTS}
    streams: list[list[Call]] = []
    for w in range(workflows):
        wid = f"wf{w}"
        context = rng.randint(*context_tokens)
        steps = rng.randint(min_steps, max_steps)
        builders: dict[str, PromptBuilder] = {}
        agent = AGENTS[0]
        calls: list[Call] = []
        for k in range(steps):
            builder = builders.get(agent)
            if builder is None:
                builder = builders[agent] = PromptBuilder()
                builder.extend(f"sys:{agent}", system[agent])
                builder.extend(f"ctx:{wid}", context)
            builder.extend(f"msg:{wid}:{k}", rng.randint(*message_tokens))
            prompt_blocks = tuple(builder.hashes)
            prompt_tokens = builder.tokens
            n_out = rng.randint(*output_tokens)
            output_blocks = tuple(builder.extend(f"out:{wid}:{k}", n_out))
            calls.append(
                Call(
                    workflow_id=wid,
                    agent=agent,
                    block_hashes=prompt_blocks,
                    prompt_tokens=prompt_tokens,
                    output_tokens=n_out,
                    gap_s=rng.expovariate(1.0 / mean_gap_s) if k else 0.0,
                    workflow_type="synthetic",
                    output_block_hashes=output_blocks,
                    hints={"step": k},
                    last=k == steps - 1,
                )
            )
            agent = rng.choices(AGENTS, weights=TRANSITIONS[AGENTS.index(agent)])[0]
        streams.append(calls)
    return Workload(
        name="synthetic",
        streams=streams,
        description=f"{workflows} synthetic multi-agent workflows, seed {seed}",
    )
