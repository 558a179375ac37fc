"""Who&When group chats (ag2ai/Agents_Failure_Attribution): one stream of calls per file.

A file is ``{question, system_prompt{agent: text}, history[{name, role, content}], ...}``. The
speaker of a history entry is its ``name``; in files without ``name`` the ``role`` names it (e.g.
"Orchestrator (thought)", "WebSurfer"), and ``system_prompt`` may be absent.

In a group chat every agent's prompt is its own system prompt, then the question, then the whole
conversation so far, so each agent has its own append-only prompt (one ``PromptBuilder``),
reused when that agent speaks again, and two agents' prompts diverge at the system prompt. An
entry spoken by an agent is one call of that agent: its prompt is everything before the entry,
its output the entry itself (so its output blocks continue into the agent's next prompt).

Not every speaker is an LLM. CaptainAgent's ``Computer_terminal`` runs the code the experts write
and has no system prompt. By default (``calls_from="system_prompt"``), when a file names system
prompts, a speaker without one makes no call: its messages only join the conversation. With
``calls_from="all"``, or in a file without system prompts, every speaker's entry is a call.
Entries with no speaker make no call either; their text stays in the conversation and they are
counted (``ChatFile.unattributed``).

Token counts are cl100k's (``tokens.py``, ChatML markers included): these files record no usage
to calibrate against. An entry is rendered with header ``"{role} {speaker}"`` (the speaker alone
where the role names it), a system prompt with ``"system"``, the question with ``"user"``. No
timing is recorded: gaps are 0. Hints: ``step``, the entry's index in the history.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Literal

from policyd.traces.tokens import Message, MessageTokenizer
from policyd.workloads.calls import Call, PromptBuilder, Workload

WORKFLOW_TYPE = "who-and-when"
CallsFrom = Literal["system_prompt", "all"]


@dataclass(frozen=True, slots=True)
class ChatFile:
    """One group chat's calls, and the entries that made none."""

    workflow_id: str
    calls: tuple[Call, ...]
    tool_entries: int  # spoken by a non-LLM speaker (no system prompt)
    unattributed: int  # no speaker: skipped


@dataclass(slots=True)
class _AgentPrompt:
    builder: PromptBuilder
    seen: int  # history entries already in the prompt


def _string(value: object, what: str, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: {what} must be a string, got {value!r:.60}")
    return value


def parse_chat(
    data: object,
    source: str,
    workflow_id: str | None = None,
    tokenizer: MessageTokenizer | None = None,
    calls_from: CallsFrom = "system_prompt",
) -> ChatFile:
    """The calls of one parsed group chat; malformed content raises ``ValueError`` naming
    ``source`` and the history index."""
    if calls_from not in ("system_prompt", "all"):
        raise ValueError(f"calls_from must be 'system_prompt' or 'all', got {calls_from!r}")
    tokenizer = tokenizer or MessageTokenizer()
    workflow_id = workflow_id or Path(source).stem
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    question = _string(data.get("question", ""), "'question'", source)
    system_prompts = data.get("system_prompt") or {}
    if not isinstance(system_prompts, dict):
        raise ValueError(f"{source}: 'system_prompt' must be an object of agent: text")
    history = data.get("history")
    if not isinstance(history, list):
        raise ValueError(f"{source}: 'history' must be a list")

    systems = {
        agent: tokenizer("system", _string(text, f"system_prompt[{agent!r}]", source))
        for agent, text in system_prompts.items()
    }
    question_message = tokenizer("user", question) if question else None
    entries: list[Message] = []
    speakers: list[str] = []
    for index, entry in enumerate(history):
        where = f"{source}: history[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        name = entry.get("name")
        role = entry.get("role")
        speaker = _string(name if name else (role or ""), "the speaker", where)
        content = _string(entry.get("content") or "", "'content'", where)
        header = f"{role} {speaker}" if isinstance(role, str) and role != speaker else speaker
        entries.append(tokenizer(header.strip(), content))
        speakers.append(speaker.strip())

    prompts: dict[str, _AgentPrompt] = {}
    calls: list[Call] = []
    tool_entries = unattributed = 0
    for index, speaker in enumerate(speakers):
        if not speaker:
            unattributed += 1
            continue
        if calls_from == "system_prompt" and systems and speaker not in systems:
            tool_entries += 1
            continue
        prompt = prompts.get(speaker)
        if prompt is None:
            builder = PromptBuilder()
            system = systems.get(speaker)
            if system is not None:
                builder.extend(system.key, system.tokens)
            if question_message is not None:
                builder.extend(question_message.key, question_message.tokens)
            prompt = prompts[speaker] = _AgentPrompt(builder, 0)
        for message in entries[prompt.seen : index]:
            prompt.builder.extend(message.key, message.tokens)
        prompt_blocks = tuple(prompt.builder.hashes)
        prompt_tokens = prompt.builder.tokens
        output = entries[index]
        output_blocks = prompt.builder.extend(output.key, output.tokens)
        prompt.seen = index + 1
        calls.append(
            Call(
                workflow_id=workflow_id,
                agent=speaker,
                block_hashes=prompt_blocks,
                prompt_tokens=prompt_tokens,
                output_tokens=output.tokens,
                workflow_type=WORKFLOW_TYPE,
                output_block_hashes=tuple(output_blocks),
                hints={"step": index},
            )
        )
    if calls:
        calls[-1] = dataclasses.replace(calls[-1], last=True)
    return ChatFile(workflow_id, tuple(calls), tool_entries, unattributed)


def _natural(path: Path) -> tuple[object, ...]:
    """Sort key: ``2.json`` before ``10.json``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path.name))


def chat_files(path: str | Path) -> list[Path]:
    """The ``*.json`` files of a directory (natural order), or the file itself."""
    path = Path(path)
    if path.is_dir():
        return sorted(path.glob("*.json"), key=_natural)
    return [path]


def read_whowhen(
    path: str | Path,
    *,
    limit: int | None = None,
    tokenizer: MessageTokenizer | None = None,
    calls_from: CallsFrom = "system_prompt",
) -> Iterator[ChatFile]:
    """The group chats of a ``.json`` file or a directory of them, at most ``limit``."""
    tokenizer = tokenizer or MessageTokenizer()
    for file in islice(chat_files(path), limit):
        try:
            data = json.loads(file.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{file}: not JSON ({exc})") from None
        yield parse_chat(data, str(file), file.stem, tokenizer, calls_from)


def whowhen_workload(
    path: str | Path, *, limit: int | None = None, calls_from: CallsFrom = "system_prompt"
) -> Workload:
    """The group chats under ``path`` as a workload, one stream per file (chats whose entries
    made no call are left out)."""
    streams: list[tuple[Call, ...]] = []
    tools = unattributed = 0
    for chat in read_whowhen(path, limit=limit, calls_from=calls_from):
        if chat.calls:
            streams.append(chat.calls)
        tools += chat.tool_entries
        unattributed += chat.unattributed
    return Workload(
        name=f"who-and-when:{Path(path).name}",
        streams=streams,
        description=(
            f"{len(streams)} Who&When group chats; {tools} tool entries and "
            f"{unattributed} entries without a speaker made no call"
        ),
    )
