"""Trace readers: SWE-bench trajectories, Who&When group chats, our call JSONL, format detection,
trace statistics, and the offline tokenizer.

Expectations are computed from the excerpts themselves (their recorded usage, their raw text
tokenized independently of the readers), never copied from a reader's output.
"""

from __future__ import annotations

import dataclasses
import doctest
import io
import itertools
import json
import socket
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from rich.console import Console

from policyd.core.types import BLOCK_SIZE_TOKENS
from policyd.traces import (
    READERS,
    detect_format,
    load_trace,
    read_calls,
    read_swe,
    read_whowhen,
    render_stats,
    trace_stats,
    write_calls,
)
from policyd.traces import tokens as tokens_module
from policyd.traces.jsonl import HEADER, calls_workload, format_call
from policyd.traces.location import SWE_TRAJECTORIES, local_trace
from policyd.traces.stats import Spread
from policyd.traces.swe import parse_trajectory, swe_workload
from policyd.traces.tokens import MessageTokenizer, chat_message, cl100k, encode
from policyd.traces.whowhen import parse_chat, whowhen_workload
from policyd.workloads.calls import Call, PromptBuilder, Workload
from tests.conftest import workloads

DATA = Path(__file__).parent / "data"
SWE_EXCERPT = DATA / "swebench_excerpt.tar.gz"
WHOWHEN_EXCERPT = DATA / "whowhen_excerpt.json"
MOONCAKE_EXCERPT = DATA / "mooncake_excerpt.jsonl"
SWE_ARCHIVE = local_trace(SWE_TRAJECTORIES)  # the public trace, when $AGENTKV_TRACES holds it

# Calibrated prompt tokens of an excerpt call vs usage.prompt_tokens. The per-trajectory factor
# is fitted on the four calls kept, so they land within ~1%; 2% leaves room, not slack.
EXCERPT_TOLERANCE = 0.02


def raw_trajectories(path: Path) -> list[dict[str, Any]]:
    """The excerpt's JSON, read without the reader."""
    out = []
    with tarfile.open(path) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            file = archive.extractfile(member)
            if file is not None and member.name.endswith(".traj.json"):
                out.append(json.load(file))
    return out


def is_prefix(prefix: tuple[int, ...], whole: tuple[int, ...]) -> bool:
    return whole[: len(prefix)] == prefix


# ---- tokens ------------------------------------------------------------------------------------


def test_cl100k_known_ids_and_doctests() -> None:
    assert encode("hello world") == [15339, 1917]  # cl100k_base's published ids
    assert encode("<|endoftext|>") != [100257]  # special-token text counts as plain text
    assert doctest.testmod(tokens_module).failed == 0


def test_vocabulary_loads_offline_without_writing(monkeypatch, tmp_path) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tokenizer opened a socket")

    cache = tmp_path / "tiktoken-cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    cl100k.cache_clear()
    try:
        assert encode("def f(x):\n    return x") == cl100k().encode_ordinary(
            "def f(x):\n    return x"
        )
    finally:
        cl100k.cache_clear()
    assert not cache.exists()


def test_chat_message_adds_role_markers_and_memo_encodes_once() -> None:
    text = "some tool output\nwith two lines"
    assert len(chat_message("user", text)) == len(encode(text)) + 5
    calls = []

    def counting(header: str, content: str) -> list[int]:
        calls.append(content)
        return chat_message(header, content)

    tokenizer = MessageTokenizer(counting, memo_messages=2)
    first = tokenizer("user", text)
    assert tokenizer("user", text) == first and len(calls) == 1
    assert tokenizer("assistant", text).key != first.key  # the header is part of the message
    tokenizer("user", "a")
    tokenizer("user", "b")  # evicts the oldest
    tokenizer("user", text)
    assert len(calls) == 5 and tokenizer.encoded == 5


# ---- SWE-bench trajectories ---------------------------------------------------------------------


def test_swe_calls_follow_the_assistant_messages() -> None:
    raws = raw_trajectories(SWE_EXCERPT)
    trajectories = list(read_swe(SWE_EXCERPT))
    assert [t.instance_id for t in trajectories] == [r["instance_id"] for r in raws]
    for raw, trajectory in zip(raws, trajectories, strict=True):
        assistant = [m for m in raw["messages"] if m["role"] == "assistant"]
        assert len(trajectory.calls) == len(assistant) == 4
        for k, call in enumerate(trajectory.calls):
            assert call.workflow_id == raw["instance_id"]
            assert (call.agent, call.workflow_type) == ("swe-agent", "swe-bench")
            assert call.hints == {"step": k}
            assert call.last == (k == 3)
            usage = assistant[k]["extra"]["response"]["usage"]
            assert call.output_tokens == usage["completion_tokens"]


def test_swe_token_counts_are_calibrated_to_recorded_usage() -> None:
    raws = raw_trajectories(SWE_EXCERPT)
    for raw, trajectory in zip(raws, read_swe(SWE_EXCERPT), strict=True):
        messages = raw["messages"]
        ours, recorded = [], []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                ours.append(sum(len(chat_message(m["role"], m["content"])) for m in messages[:i]))
                recorded.append(message["extra"]["response"]["usage"]["prompt_tokens"])
        assert list(trajectory.tokenizer_prompt_tokens) == ours
        assert list(trajectory.recorded_prompt_tokens) == recorded
        assert trajectory.calibration == pytest.approx(sum(recorded) / sum(ours))
        assert 1.0 < trajectory.calibration < 1.3  # Gemini 3 counts more tokens than cl100k
        for call, uncalibrated, usage in zip(trajectory.calls, ours, recorded, strict=True):
            assert call.prompt_tokens == round(trajectory.calibration * uncalibrated)
            assert call.prompt_tokens == pytest.approx(usage, rel=EXCERPT_TOLERANCE)
            assert len(call.block_hashes) == call.prompt_tokens // BLOCK_SIZE_TOKENS


def test_swe_history_is_an_append_only_chain_of_blocks() -> None:
    raws = raw_trajectories(SWE_EXCERPT)
    trajectories = list(read_swe(SWE_EXCERPT))
    branches = set()
    for raw, trajectory in zip(raws, trajectories, strict=True):
        reasoning = [
            m["extra"]["response"]["usage"]["completion_tokens_details"]["reasoning_tokens"]
            for m in raw["messages"]
            if m["role"] == "assistant"
        ]
        calls = trajectory.calls
        for k, (call, following) in enumerate(itertools.pairwise(calls)):
            assert is_prefix(call.block_hashes, following.block_hashes)
            if reasoning[k]:  # reasoning came first: nothing generated is in a later prompt
                assert call.output_block_hashes == ()
            else:
                assert call.output_block_hashes
                assert is_prefix(
                    call.block_hashes + call.output_block_hashes, following.block_hashes
                )
            branches.add(bool(reasoning[k]))
    assert branches == {True, False}
    # every task starts with the same system prompt, then its own instance
    firsts = {t.calls[0].block_hashes[0] for t in trajectories}
    seconds = {t.calls[0].block_hashes[len(t.calls[0].block_hashes) - 1] for t in trajectories}
    assert len(firsts) == 1 and len(seconds) == len(trajectories)


def test_swe_gaps_are_created_differences() -> None:
    raws = raw_trajectories(SWE_EXCERPT)
    slow = list(read_swe(SWE_EXCERPT, decode_tokens_per_s=50.0))
    for raw, trajectory, decoded in zip(raws, read_swe(SWE_EXCERPT), slow, strict=True):
        responses = [m["extra"]["response"] for m in raw["messages"] if m["role"] == "assistant"]
        created = [r["created"] for r in responses]
        expected = [0.0] + [b - a for a, b in itertools.pairwise(created)]
        assert [c.gap_s for c in trajectory.calls] == expected
        minus_decode = [0.0] + [
            max(0.0, b - a - r["usage"]["completion_tokens"] / 50.0)
            for (a, b), r in zip(itertools.pairwise(created), responses, strict=False)
        ]
        assert [c.gap_s for c in decoded.calls] == pytest.approx(minus_decode)


def test_swe_reads_a_directory_and_a_single_file_like_the_archive(tmp_path) -> None:
    with tarfile.open(SWE_EXCERPT) as archive:
        archive.extractall(tmp_path, filter="data")
    from_archive = swe_workload(SWE_EXCERPT)
    from_directory = swe_workload(tmp_path)
    assert list(from_directory.streams) == list(from_archive.streams)
    single = sorted(tmp_path.rglob("*.traj.json"))[0]
    (only,) = list(read_swe(single))
    assert only.calls == from_archive.streams[0]
    assert "x1.0" in from_archive.description


def test_swe_without_usage_keeps_tokenizer_counts() -> None:
    raw = raw_trajectories(SWE_EXCERPT)[0]
    for message in raw["messages"]:
        message.pop("extra", None)
    trajectory = parse_trajectory(raw, "bare.traj.json")
    assert not trajectory.calibrated and trajectory.calibration == 1.0
    assert [c.prompt_tokens for c in trajectory.calls] == list(trajectory.tokenizer_prompt_tokens)
    assert all(c.gap_s == 0.0 for c in trajectory.calls)
    # output = the message itself, so its blocks continue into the next prompt
    for call, following in itertools.pairwise(trajectory.calls):
        assert is_prefix(call.block_hashes + call.output_block_hashes, following.block_hashes)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("messages"), "'messages' must be a non-empty list"),
        (lambda d: d["messages"][2].pop("role"), "messages[2]: 'role'"),
        (lambda d: d["messages"][3].update(content=7), "messages[3]: 'content'"),
        (
            lambda d: d["messages"][4]["extra"]["response"]["usage"].update(prompt_tokens=-1),
            "messages[4]: usage.prompt_tokens",
        ),
        (
            lambda d: d["messages"][2]["extra"]["response"].update(created="noon"),
            "messages[2]: response.created",
        ),
        (lambda d: d.update(messages=d["messages"][:2]), "no assistant message"),
    ],
)
def test_swe_malformed_trajectory_names_file_and_message(mutate, message) -> None:
    raw = raw_trajectories(SWE_EXCERPT)[0]
    mutate(raw)
    with pytest.raises(ValueError, match=r"^task\.traj\.json: ") as error:
        parse_trajectory(raw, "task.traj.json")
    assert message in str(error.value)


def test_swe_malformed_json_in_an_archive_names_the_member(tmp_path) -> None:
    archive_path = tmp_path / "bad.tar.gz"
    with tarfile.open(archive_path, "w:gz") as archive:
        data = b'{"instance_id": "x", "messages": ['
        info = tarfile.TarInfo("trajs/x.traj.json")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    with pytest.raises(ValueError, match=r"bad\.tar\.gz:trajs/x\.traj\.json: not JSON"):
        list(read_swe(archive_path))


# ---- Who&When group chats ------------------------------------------------------------------------


def whowhen_raw() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(WHOWHEN_EXCERPT.read_text(encoding="utf-8"))
    return data


def test_whowhen_one_call_per_llm_entry() -> None:
    raw = whowhen_raw()
    (chat,) = list(read_whowhen(WHOWHEN_EXCERPT))
    llm = [
        (i, h["name"]) for i, h in enumerate(raw["history"]) if h["name"] in raw["system_prompt"]
    ]
    assert [(c.hints["step"], c.agent) for c in chat.calls] == llm
    assert len(chat.calls) == 7 and chat.tool_entries == 1 and chat.unattributed == 0
    assert {c.workflow_id for c in chat.calls} == {"whowhen_excerpt"}
    assert {c.workflow_type for c in chat.calls} == {"who-and-when"}
    assert [c.last for c in chat.calls] == [False] * 6 + [True]
    assert all(c.gap_s == 0.0 for c in chat.calls)

    (everyone,) = list(read_whowhen(WHOWHEN_EXCERPT, calls_from="all"))
    assert [c.agent for c in everyone.calls] == [h["name"] for h in raw["history"]]


def test_whowhen_prompt_is_system_question_and_conversation() -> None:
    raw = whowhen_raw()
    history = raw["history"]
    entry_tokens = [len(chat_message(f"{h['role']} {h['name']}", h["content"])) for h in history]
    question = len(chat_message("user", raw["question"]))
    (chat,) = list(read_whowhen(WHOWHEN_EXCERPT))
    for call in chat.calls:
        step = int(call.hints["step"])  # type: ignore[arg-type]
        system = len(chat_message("system", raw["system_prompt"][call.agent]))
        assert call.prompt_tokens == system + question + sum(entry_tokens[:step])
        assert call.output_tokens == entry_tokens[step]
        assert len(call.block_hashes) == call.prompt_tokens // BLOCK_SIZE_TOKENS
        completed = (call.prompt_tokens + call.output_tokens) // BLOCK_SIZE_TOKENS
        assert len(call.output_block_hashes) == completed - len(call.block_hashes)


def test_whowhen_each_agent_has_its_own_growing_prefix() -> None:
    (chat,) = list(read_whowhen(WHOWHEN_EXCERPT))
    by_agent: dict[str, list[Call]] = {}
    for call in chat.calls:
        by_agent.setdefault(call.agent, []).append(call)
    assert sorted(len(v) for v in by_agent.values()) == [2, 2, 3]
    for calls in by_agent.values():
        for call, following in itertools.pairwise(calls):
            assert is_prefix(call.block_hashes + call.output_block_hashes, following.block_hashes)
    firsts = [calls[0].block_hashes[0] for calls in by_agent.values()]
    assert len(set(firsts)) == len(firsts)  # diverge at the system prompt
    # Filmography_Expert speaks twice in a row: its output is exactly the next prompt's growth
    first, second = chat.calls[0], chat.calls[1]
    assert second.block_hashes == first.block_hashes + first.output_block_hashes
    assert second.prompt_tokens == first.prompt_tokens + first.output_tokens


def test_whowhen_role_names_the_speaker_without_names_or_system_prompts() -> None:
    chat = parse_chat(
        {
            "question": "Which is the tallest tower in the world, and in which city does it stand?",
            "history": [
                {"role": "human", "content": "Which is the tallest tower?"},
                {"role": "Orchestrator (thought)", "content": "Plan: ask the WebSurfer. " * 9},
                {"role": "WebSurfer", "content": "I searched: the Burj Khalifa. " * 9},
                {"role": "", "content": "(lost attribution)"},
                {"role": "Orchestrator (thought)", "content": "Done: Burj Khalifa."},
            ],
        },
        "magentic.json",
    )
    assert [c.agent for c in chat.calls] == [
        "human",
        "Orchestrator (thought)",
        "WebSurfer",
        "Orchestrator (thought)",
    ]
    assert chat.unattributed == 1 and chat.tool_entries == 0
    # no system prompts: every agent's prompt starts with the question, so the first block is shared
    assert len({c.block_hashes[0] for c in chat.calls}) == 1
    orchestrator = [c for c in chat.calls if c.agent == "Orchestrator (thought)"]
    assert is_prefix(orchestrator[0].block_hashes, orchestrator[1].block_hashes)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(history={"a": 1}), "'history' must be a list"),
        (lambda d: d["history"][3].update(content=["x"]), "history[3]: 'content'"),
        (lambda d: d["history"].__setitem__(2, "text"), "history[2]: expected an object"),
        (lambda d: d.update(system_prompt=["x"]), "'system_prompt' must be an object"),
    ],
)
def test_whowhen_malformed_chat_names_file_and_entry(mutate, message) -> None:
    raw = whowhen_raw()
    mutate(raw)
    with pytest.raises(ValueError, match=r"^chat\.json: ") as error:
        parse_chat(raw, "chat.json")
    assert message in str(error.value)


def test_whowhen_directory_in_natural_order(tmp_path) -> None:
    text = WHOWHEN_EXCERPT.read_text(encoding="utf-8")
    for name in ("10.json", "2.json", "1.json"):
        (tmp_path / name).write_text(text, encoding="utf-8")
    workload = whowhen_workload(tmp_path)
    assert [s[0].workflow_id for s in workload.streams] == ["1", "2", "10"]
    assert workload.streams[0][0].block_hashes == workload.streams[2][0].block_hashes
    (tmp_path / "3.json").write_text("{", encoding="utf-8")
    with pytest.raises(ValueError, match=r"3\.json: not JSON"):
        whowhen_workload(tmp_path)


# ---- our call JSONL ------------------------------------------------------------------------------


def test_calls_round_trip_real_workloads(tmp_path) -> None:
    for workload in (swe_workload(SWE_EXCERPT), whowhen_workload(WHOWHEN_EXCERPT)):
        path = tmp_path / "calls.jsonl"
        assert write_calls(path, workload) == workload.calls
        first = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
        assert first == HEADER
        back = calls_workload(path)
        assert [list(s) for s in back.streams] == [list(s) for s in workload.streams]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(workload=workloads)
def test_calls_round_trip_any_workload(tmp_path, workload: Workload) -> None:
    path = tmp_path / "any.jsonl"
    write_calls(path, workload)
    assert [list(s) for s in calls_workload(path).streams] == [list(s) for s in workload.streams]


def test_calls_group_interleaved_workflows_by_first_appearance(tmp_path) -> None:
    def call(wid: str, step: int) -> Call:
        return Call(wid, "a", (step,), 16 + step, hints={"step": step})

    lines = [json.dumps(HEADER)] + [
        format_call(call(wid, step), ts=float(n))
        for n, (wid, step) in enumerate([("b", 0), ("a", 0), ("b", 1), ("a", 1), ("b", 2)])
    ]
    path = tmp_path / "live.jsonl"
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    workload = calls_workload(path)
    assert [[(c.workflow_id, c.hints["step"]) for c in s] for s in workload.streams] == [
        [("b", 0), ("b", 1), ("b", 2)],
        [("a", 0), ("a", 1)],
    ]


BASE = '{"workflow_id": "w", "agent": "a", "block_hashes": [], "prompt_tokens": 0'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        (
            '{"workflow_id": "w", "agent": "a", "block_hashes": []}',
            "missing fields ['prompt_tokens']",
        ),
        (
            BASE + ', "x": 1}',
            "unknown fields ['x']",
        ),
        (
            '{"workflow_id": "w", "agent": "a", "block_hashes": [1, 2], "prompt_tokens": 20}',
            "2 blocks",
        ),
        ('{"workflow_id": "w", "agent": "a", "block_hashes": [-1], "prompt_tokens": 20}', "64-bit"),
        ('{"workflow_id": "w", "agent": "a", "block_hashes": [], "prompt_tokens": 1.5}', "integer"),
        (
            BASE + ', "gap_s": -1}',
            "'gap_s'",
        ),
        (
            BASE + ', "last": 1}',
            "'last'",
        ),
        (
            BASE + ', "hints": []}',
            "'hints'",
        ),
        (
            '{"workflow_id": "w", "agent": "a", "block_hashes": [], "prompt_tokens": 0, "ts": "x"}',
            "'ts'",
        ),
    ],
)
def test_calls_malformed_line_names_file_and_line(tmp_path, line, message) -> None:
    good = '{"workflow_id": "w", "agent": "a", "block_hashes": [7], "prompt_tokens": 16}'
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{json.dumps(HEADER)}\n{good}\n\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:4: ") as error:
        list(read_calls(path))
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ('{"format": "other"}', "expected the header"),
        ('{"format": "agentkv-calls", "version": 2, "block_size": 16}', "version 2"),
        ('{"format": "agentkv-calls", "version": 1, "block_size": 32}', "block_size 32"),
    ],
)
def test_calls_header_is_checked(tmp_path, header, message) -> None:
    path = tmp_path / "h.jsonl"
    path.write_text(header + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"h\.jsonl:1: ") as error:
        list(read_calls(path))
    assert message in str(error.value)
    path.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty"):
        list(read_calls(path))


# ---- format detection ----------------------------------------------------------------------------


def test_load_trace_detects_each_format(tmp_path) -> None:
    calls_path = tmp_path / "recorded.jsonl"
    write_calls(calls_path, whowhen_workload(WHOWHEN_EXCERPT))
    swe_dir = tmp_path / "trajs"
    with tarfile.open(SWE_EXCERPT) as archive:
        archive.extractall(swe_dir, filter="data")
    chats = tmp_path / "chats"
    chats.mkdir()
    (chats / "1.json").write_bytes(WHOWHEN_EXCERPT.read_bytes())
    cases = {
        SWE_EXCERPT: "swe",
        swe_dir: "swe",
        sorted(swe_dir.rglob("*.traj.json"))[0]: "swe",
        WHOWHEN_EXCERPT: "who-and-when",
        chats: "who-and-when",
        MOONCAKE_EXCERPT: "mooncake",
        calls_path: "calls",
    }
    for path, name in cases.items():
        assert detect_format(path) == name, path
        assert load_trace(path).calls > 0
    assert load_trace(MOONCAKE_EXCERPT).calls == 9
    assert [list(s) for s in load_trace(calls_path).streams] == [
        list(s) for s in load_trace(WHOWHEN_EXCERPT).streams
    ]
    assert set(READERS) == {"swe", "who-and-when", "mooncake", "calls"}


def test_a_seed_replays_a_traces_workflows_in_another_order_and_loses_none() -> None:
    def order(workload: Workload) -> list[str]:
        return [stream[0].workflow_id for stream in workload.streams]

    recorded = load_trace(SWE_EXCERPT)
    assert load_trace(SWE_EXCERPT, seed=0).streams == recorded.streams
    orders = {seed: order(load_trace(SWE_EXCERPT, seed=seed)) for seed in range(1, 6)}
    assert any(o != order(recorded) for o in orders.values())
    assert all(sorted(o) == sorted(order(recorded)) for o in orders.values())
    by_id = {stream[0].workflow_id: stream for stream in recorded.streams}
    for stream in load_trace(SWE_EXCERPT, seed=3).streams:  # each workflow's calls untouched
        assert stream == by_id[stream[0].workflow_id]
    assert order(load_trace(SWE_EXCERPT, seed=3)) == orders[3]  # reproducible
    # single requests in time order have no order of workflows to change
    with pytest.raises(ValueError, match="recorded time order"):
        load_trace(MOONCAKE_EXCERPT, seed=1)
    assert load_trace(MOONCAKE_EXCERPT, seed=0).calls == 9


def test_load_trace_rejects_what_it_cannot_read(tmp_path) -> None:
    other = tmp_path / "x.jsonl"
    other.write_text('{"timestamp": 1}\n', encoding="utf-8")
    unknown = tmp_path / "x.csv"
    unknown.write_text("TIMESTAMP,ContextTokens\n", encoding="utf-8")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, message in [
        (other, "neither"),
        (unknown, "unknown trace format"),
        (empty, "neither"),
        (tmp_path / "missing", "no such file"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_trace(path)
    with pytest.raises(ValueError, match="valid formats: calls, mooncake, swe, who-and-when"):
        load_trace(SWE_EXCERPT, format="csv")


# ---- statistics ----------------------------------------------------------------------------------


def test_trace_stats_of_a_hand_built_workload() -> None:
    def call(wid: str, agent: str, segments: list[tuple[str, int]], out: int, gap_s: float) -> Call:
        builder = PromptBuilder()
        for name, n in segments:
            builder.extend(name, n)
        prompt = tuple(builder.hashes)
        tokens = builder.tokens
        output = tuple(builder.extend(f"out:{wid}", out))
        return Call(wid, agent, prompt, tokens, out, gap_s, "t", output)

    first = call("w0", "a", [("sys", 32)], 32, 0.0)  # 2 new blocks, outputs 2
    second = call("w0", "b", [("sys", 32), ("out:w0", 32), ("m", 16)], 0, 3.0)
    other = call("w1", "a", [("sys", 48)], 0, 0.0)  # 3 blocks: 2 seen (sys prefix), 1 new
    workload = Workload("hand", [(first, second), (other,)])
    stats = trace_stats(workload)
    # second: sys (2 seen) + out:w0 (2 seen as first's output) + m (1 new) = 5 blocks, 4 seen
    assert [len(c.block_hashes) for c in (first, second, other)] == [2, 5, 3]
    assert stats.prompt_blocks == 10
    assert stats.reuse_share == pytest.approx((0 + 4 + 2) / 10)
    assert stats.unique_blocks == 2 + 2 + 1 + 1
    assert (stats.calls, stats.streams, stats.agents) == (3, 2, 2)
    assert stats.calls_per_agent == {"a": 2, "b": 1}
    assert stats.calls_per_stream == Spread.of([2, 1])
    assert stats.prompt_tokens.mean == pytest.approx((32 + 80 + 48) / 3)
    assert stats.prompt_tokens.max == 80
    assert stats.gap_s == Spread(3.0, 3.0, 3.0, 3.0, count=1)  # a stream's first call has none


def test_spread_uses_numpy_percentiles() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 100.0]
    spread = Spread.of(values)
    assert spread.p50 == 3.0 and spread.p90 == pytest.approx(np.percentile(values, 90))
    assert spread.count == 5 and Spread.of([]) == Spread()


def test_render_stats_shows_every_figure() -> None:
    stats = trace_stats(whowhen_workload(WHOWHEN_EXCERPT))
    console = Console(record=True, width=120)
    console.print(render_stats(stats))
    text = console.export_text()
    for needle in ("calls", "reuse share", "IMDB_Ratings_Expert", f"{stats.reuse_share:.1%}"):
        assert needle in text
    wide = dataclasses.replace(stats, calls_per_agent={f"agent{i}": 1 for i in range(12)})
    console.print(render_stats(wide))
    assert "2 other agents" in console.export_text()


# ---- the full SWE-bench run ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    SWE_ARCHIVE is None or not SWE_ARCHIVE.exists(),
    reason="the SWE-bench trajectories are not here ($AGENTKV_TRACES)",
)
def test_full_swe_archive_matches_recorded_figures() -> None:
    assert SWE_ARCHIVE is not None
    recorded: list[int] = []  # usage.prompt_tokens of every assistant call, read without us
    tasks = 0
    with tarfile.open(SWE_ARCHIVE, "r|gz") as archive:
        for member in archive:
            file = archive.extractfile(member)
            if file is None or not member.name.endswith(".traj.json"):
                continue
            tasks += 1
            for message in json.load(file)["messages"]:
                if message["role"] == "assistant":
                    recorded.append(message["extra"]["response"]["usage"]["prompt_tokens"])
    recorded_calls_per_task = len(recorded) / tasks
    recorded_mean_tokens = sum(recorded) / len(recorded)

    errors: list[float] = []
    factors: list[float] = []
    streams = []
    for trajectory in read_swe(SWE_ARCHIVE):
        factors.append(trajectory.calibration)
        streams.append(trajectory.calls)
        for call, usage in zip(trajectory.calls, trajectory.recorded_prompt_tokens, strict=True):
            assert usage is not None
            errors.append(abs(call.prompt_tokens - usage) / usage)
    stats = trace_stats(Workload("swe", streams))

    assert tasks == stats.streams == 200
    assert stats.calls_per_stream.mean == pytest.approx(recorded_calls_per_task, rel=0.10)
    assert stats.prompt_tokens.mean == pytest.approx(recorded_mean_tokens, rel=0.10)
    assert stats.calls_per_stream.mean == pytest.approx(40, rel=0.10)  # the traces' README
    assert stats.prompt_tokens.mean == pytest.approx(16_500, rel=0.10)
    # per call, not only on average: the factor is fitted per task, the errors are not
    assert np.percentile(errors, 50) < 0.01
    assert np.percentile(errors, 90) < 0.05
    assert max(errors) < 0.25
    assert 1.1 < float(np.mean(factors)) < 1.25
    assert stats.reuse_share > 0.9  # append-only history: nearly every prompt block was seen
