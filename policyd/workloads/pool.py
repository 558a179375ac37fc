"""A pool of concurrent tool-using coding agents: EfficientAgent's setting, generated.

Each task is one agent's append-only conversation (mini-swe-agent style): the shared system
prompt, the task's issue text, then per step the agent's output (a thought and a command) and the
tool's observation. A task runs 20-150 calls and its prompt grows to 20-100k tokens; tool time
between calls is heavy-tailed. The number of agents running at once is the simulator's
``concurrency``: with A agents the reuse working set is about (A - 1) prompts.

Shapes (modelled, in line with the 200 mini-swe-agent SWE-bench trajectories of ``policyd trace
get``, whose README gives ~40 calls per task and ~16.5k prompt tokens per call on average): steps
log-normal with median 36 clipped to [20, 150]; outputs median 160 tokens; observations median
200 tokens, sigma 1.3 (a long test log now and then); tool time median 1.5 s, sigma 1.3, up to 5
minutes.
"""

from __future__ import annotations

import random

from policyd.workloads.agents import AgentSpec, WorkflowPrompts, lognormal
from policyd.workloads.calls import Call, Workload

SWE_AGENT = AgentSpec("swe-agent", system_tokens=2300, output_median_tokens=160, output_sigma=0.6)


def coding_pool(
    *,
    seed: int = 0,
    tasks: int = 64,
    min_calls: int = 20,
    max_calls: int = 150,
    max_prompt_tokens: int = 100_000,
    median_tool_s: float = 1.5,
) -> Workload:
    rng = random.Random(seed)
    repos = ("django", "sympy", "astropy", "sphinx", "matplotlib", "scikit-learn", "pytest")
    streams: list[list[Call]] = []
    for t in range(tasks):
        wid = f"swe{seed}-{t}"
        steps = round(lognormal(rng, 36, 0.55, min_calls, max_calls))
        issue = round(lognormal(rng, 700, 0.6, 150, 5000))
        wp = WorkflowPrompts(
            wid, "coding-agent", f"issue:{wid}", issue, {"repo": rng.choice(repos)}
        )
        observation = 60  # the first message: the task instructions
        tool_s = 0.0
        for _ in range(steps):
            output = SWE_AGENT.output_tokens(rng)
            call = wp.call(SWE_AGENT, observation, output, tool_s)
            if call.prompt_tokens + output >= max_prompt_tokens:
                break
            observation = round(lognormal(rng, 200, 1.3, 20, 12_000))
            tool_s = lognormal(rng, median_tool_s, 1.3, 0.05, 300.0)
        streams.append(wp.finish())
    return Workload(
        "coding-pool",
        streams,
        f"{tasks} mini-swe-agent-style coding tasks (20-150 calls each, prompts up to 100k)",
    )
