"""Orchestrator-style group chats: one planner routes a conversation among a few workers.

The shape of Magentic-One / AutoGen group chats and of the Who&When logs: every call re-sends
the chat's whole transcript after the speaker's own system prompt, so a speaker's next prompt
extends only its *own* previous one (the prefixes of two speakers differ from their first
block). The orchestrator speaks every ``orchestrator_every`` turns; the turns between go to the
workers, chosen by a Zipf-like mix (``speaker_skew`` 0: uniform; larger: one worker does most
of the work, the others are called rarely and their prefixes wait long for reuse). Messages
are log-normal; the transcript grows by every message until ``max_prompt_tokens``.

Why it matters: an LRU keeps the transcript of whoever spoke last, which in a routed chat is
usually who speaks next-but-one (the orchestrator); a ranking that spreads the cache over all
agents of a chat can lose to it (docs/RESULTS.md, *The recency guard: never behind vLLM's
default*).

>>> w = group_chat(seed=1, chats=2, min_calls=6, max_calls=6)
>>> [c.agent for c in w.streams[0]][:4]
['orchestrator', 'worker-0', 'orchestrator', 'worker-1']
>>> a, b = w.streams[0][0], w.streams[0][2]  # the orchestrator's next prompt extends its first
>>> b.block_hashes[: len(a.block_hashes)] == a.block_hashes
True
"""

from __future__ import annotations

import dataclasses
import random

from policyd.workloads.agents import lognormal
from policyd.workloads.calls import Call, PromptBuilder, Workload


def group_chat(
    *,
    seed: int = 0,
    chats: int = 32,
    min_calls: int = 20,
    max_calls: int = 80,
    workers: int = 4,
    orchestrator_every: int = 2,
    speaker_skew: float = 1.0,
    system_tokens: int = 1200,
    task_tokens: int = 400,
    message_median_tokens: int = 350,
    message_sigma: float = 1.0,
    median_gap_s: float = 2.0,
    max_prompt_tokens: int = 65_536,
) -> Workload:
    if workers < 1 or orchestrator_every < 1 or min_calls < 1 or max_calls < min_calls:
        raise ValueError("workers, orchestrator_every, min_calls >= 1 and max_calls >= min_calls")
    if speaker_skew < 0 or message_median_tokens < 1 or max_prompt_tokens < 1:
        raise ValueError("speaker_skew >= 0, message_median_tokens and max_prompt_tokens >= 1")
    rng = random.Random(seed)
    names = [f"worker-{i}" for i in range(workers)]
    weights = [1.0 / (i + 1) ** speaker_skew for i in range(workers)]
    streams: list[list[Call]] = []
    for c in range(chats):
        wid = f"chat{seed}-{c}"
        n_calls = rng.randint(min_calls, max_calls)
        transcript: list[tuple[str, int]] = [(f"task:{wid}", task_tokens)]
        speakers: dict[str, tuple[PromptBuilder, int]] = {}  # agent -> prompt, messages in it
        calls: list[Call] = []
        for turn in range(n_calls):
            if turn % orchestrator_every == 0:
                agent = "orchestrator"
            else:
                agent = rng.choices(names, weights)[0]
            builder, seen = speakers.get(agent) or (_system(agent, system_tokens), 0)
            for segment, tokens in transcript[seen:]:  # what was said since it last spoke
                builder.extend(segment, tokens)
            output = round(lognormal(rng, message_median_tokens, message_sigma, 8, 8192))
            if builder.tokens + output > max_prompt_tokens:
                break
            prompt = tuple(builder.hashes)
            prompt_tokens = builder.tokens
            message = f"msg:{wid}:{turn}"
            out_blocks = tuple(builder.extend(message, output))  # its message, as it will see it
            transcript.append((message, output))
            speakers[agent] = (builder, len(transcript))
            calls.append(
                Call(
                    workflow_id=wid,
                    agent=agent,
                    block_hashes=prompt,
                    prompt_tokens=prompt_tokens,
                    output_tokens=output,
                    gap_s=lognormal(rng, median_gap_s, 1.0, 0.05, 120.0) if calls else 0.0,
                    workflow_type="group-chat",
                    output_block_hashes=out_blocks,
                    hints={"step": turn},
                    last=turn == n_calls - 1,
                )
            )
        if calls and not calls[-1].last:  # cut short by max_prompt_tokens
            calls[-1] = dataclasses.replace(calls[-1], last=True)
        streams.append(calls)
    return Workload(
        "group-chat",
        streams,
        f"{chats} orchestrator-routed group chats ({workers} workers, {min_calls}-{max_calls} "
        f"calls, transcript re-sent after each speaker's system prompt)",
    )


def _system(agent: str, tokens: int) -> PromptBuilder:
    """A speaker's prompt before the transcript: its system prompt, the same in every chat."""
    builder = PromptBuilder()
    builder.extend(f"sys:group-chat:{agent}", tokens)
    return builder
