"""The orchestrator-routed group chat generator (policyd/workloads/chats.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from policyd.workloads import make_workload


def test_every_speakers_prompt_extends_its_own_previous_one_and_no_other() -> None:
    work = make_workload("group-chat", seed=3, chats=4, min_calls=12, max_calls=20)
    for chat in work.streams:
        last: dict[str, tuple[int, ...]] = {}
        for call in chat:
            previous = last.get(call.agent)
            if previous is not None:
                assert call.block_hashes[: len(previous)] == previous
            for agent, prompt in last.items():
                if agent != call.agent and prompt and call.block_hashes:
                    assert prompt[0] != call.block_hashes[0]  # system prompts differ
            last[call.agent] = call.block_hashes
        assert chat[-1].last and not any(c.last for c in chat[:-1])


def test_the_orchestrator_speaks_every_other_turn_and_skew_concentrates_the_workers() -> None:
    flat = make_workload("group-chat", seed=1, chats=20, speaker_skew=0.0, max_prompt_tokens=10**7)
    steep = make_workload("group-chat", seed=1, chats=20, speaker_skew=2.0, max_prompt_tokens=10**7)
    for work in (flat, steep):
        for chat in work.streams:
            assert all(c.agent == "orchestrator" for c in chat[::2])

    def top_share(work: object) -> float:
        counts = Counter(c.agent for s in work.streams for c in s if c.agent != "orchestrator")  # type: ignore[attr-defined]
        return counts.most_common(1)[0][1] / sum(counts.values())

    assert top_share(steep) > top_share(flat) + 0.2


def test_prompts_stay_within_the_limit_and_bad_parameters_are_refused() -> None:
    work = make_workload("group-chat", seed=2, chats=6, max_prompt_tokens=8000)
    assert max(c.prompt_tokens + c.output_tokens for s in work.streams for c in s) <= 8000
    with pytest.raises(ValueError):
        make_workload("group-chat", workers=0)
    with pytest.raises(ValueError):
        make_workload("group-chat", min_calls=10, max_calls=5)
