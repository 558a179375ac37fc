"""mini-swe-agent trajectories (``*.traj.json``, SWE-bench runs): one stream of calls per task.

A trajectory is ``{instance_id, info{exit_status, ...}, messages[{role, content,
extra{response{created, usage{prompt_tokens, completion_tokens, completion_tokens_details{
reasoning_tokens}}}}}]}``.
The history is append-only: the prompt of the k-th assistant message is every message before it,
and its output is that message, which the next prompt repeats.

*Tokens.* Messages are counted with cl100k (``tokens.py``, ChatML markers included), then
calibrated per trajectory to the model's own counts: ``f`` = recorded ``usage.prompt_tokens``
over cl100k prompt tokens, summed over the calls that have usage. Message ``m`` gets
``round(f*C[m+1]) - round(f*C[m])`` tokens, ``C`` the cumulative cl100k count, so call k's
``prompt_tokens`` is ``round(f*C[k])``: summed over the calls with usage, calibrated and recorded
counts agree up to rounding (docs/RESULTS.md, *Workloads and traces*, gives the factors and the
per-call error). No per-call fit is exact: the recorded counts are not a function of the history
(in some calls the recorded prompt shrinks although messages were appended). Blocks come from
``PromptBuilder`` segments named by each message's content digest, so equal messages at equal
positions share blocks (the system prompt across tasks) and no token list is materialised.

*Outputs.* ``output_tokens`` is the recorded ``completion_tokens`` (hidden reasoning included:
that is the decode work), else the message's calibrated count. ``output_block_hashes`` are the
blocks that appending the message to the prompt completes; none when the call reasoned
(``reasoning_tokens > 0``): its generated sequence starts with reasoning no later prompt holds.

*Gaps.* ``created`` is the request time in whole seconds. The gap before call k is
``created[k] - created[k-1]``, which includes call k-1's generation time (nothing else is
recorded); given ``decode_tokens_per_s``, call k-1's ``completion_tokens / decode_tokens_per_s``
is subtracted. Clamped at 0; 0 where a timestamp is missing.

Sources: a ``*.traj.json`` file, a directory holding them (recursively, sorted by path), or a
tar archive of them (read as a stream, one trajectory in memory at a time).
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from policyd.core.types import HintValue
from policyd.traces.tokens import Message, MessageTokenizer
from policyd.workloads.calls import Call, PromptBuilder, Workload

TRAJ_SUFFIX = ".traj.json"
AGENT = "swe-agent"
WORKFLOW_TYPE = "swe-bench"


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One task's calls, with the counts they were calibrated against."""

    instance_id: str
    calls: tuple[Call, ...]
    recorded_prompt_tokens: tuple[int | None, ...]  # usage.prompt_tokens per call
    tokenizer_prompt_tokens: tuple[int, ...]  # uncalibrated cl100k count per call
    calibration: float  # recorded over cl100k prompt tokens; 1.0 without recorded usage

    @property
    def calibrated(self) -> bool:
        return any(p is not None for p in self.recorded_prompt_tokens)


@dataclass(frozen=True, slots=True)
class _Response:
    created: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int


def _text(content: object, where: str) -> str:
    """A message's text: a string, or a list of parts whose ``text`` fields are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            text = part.get("text", "") if isinstance(part, dict) else None
            if not isinstance(text, str):
                raise ValueError(f"{where}: content parts must be objects with a text field")
            parts.append(text)
        return "".join(parts)
    raise ValueError(f"{where}: 'content' must be a string or a list of parts, got {content!r:.60}")


def _count(value: object, name: str, where: str) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return value


def _response(message: dict[str, object], where: str) -> _Response:
    extra = message.get("extra")
    response = extra.get("response") if isinstance(extra, dict) else None
    if not isinstance(response, dict):
        return _Response(None, None, None, 0)
    created = response.get("created")
    if created is not None and (isinstance(created, bool) or not isinstance(created, int | float)):
        raise ValueError(f"{where}: response.created must be a number, got {created!r}")
    usage = response.get("usage") or {}
    if not isinstance(usage, dict):
        raise ValueError(f"{where}: response.usage must be an object, got {usage!r:.60}")
    details = usage.get("completion_tokens_details") or {}
    reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else None
    return _Response(
        created=created,
        prompt_tokens=_count(usage.get("prompt_tokens"), "usage.prompt_tokens", where),
        completion_tokens=_count(usage.get("completion_tokens"), "usage.completion_tokens", where),
        reasoning_tokens=_count(reasoning, "reasoning_tokens", where) or 0,
    )


def parse_trajectory(
    data: object,
    source: str,
    tokenizer: MessageTokenizer | None = None,
    decode_tokens_per_s: float | None = None,
) -> Trajectory:
    """The calls of one parsed trajectory; malformed content raises ``ValueError`` naming
    ``source`` and the message index."""
    tokenizer = tokenizer or MessageTokenizer()
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    instance_id = data.get("instance_id", Path(source).name.removesuffix(TRAJ_SUFFIX))
    if not isinstance(instance_id, str) or not instance_id:
        raise ValueError(f"{source}: 'instance_id' must be a non-empty string")
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{source}: 'messages' must be a non-empty list")

    messages: list[Message] = []
    responses: dict[int, _Response] = {}  # message index -> response of an assistant message
    for index, message in enumerate(raw):
        where = f"{source}: messages[{index}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: expected an object, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where}: 'role' must be a non-empty string, got {role!r}")
        messages.append(tokenizer(role, _text(message.get("content"), where)))
        if role == "assistant":
            responses[index] = _response(message, where)
    if not responses:
        raise ValueError(f"{source}: no assistant message, so no call")

    cumulative = [0]  # cl100k tokens of messages[:m]
    for message in messages:
        cumulative.append(cumulative[-1] + message.tokens)
    recorded = [(cumulative[i], r.prompt_tokens) for i, r in responses.items()]
    recorded_sum = sum(p for _, p in recorded if p is not None)
    ours_sum = sum(c for c, p in recorded if p is not None)
    factor = recorded_sum / ours_sum if recorded_sum and ours_sum else 1.0

    def scaled(m: int) -> int:
        return round(factor * cumulative[m])

    builder = PromptBuilder()
    calls: list[Call] = []
    done = 0  # messages already in the builder
    previous: _Response | None = None
    for index, response in responses.items():
        while done < index:
            builder.extend(messages[done].key, scaled(done + 1) - scaled(done))
            done += 1
        prompt_blocks = tuple(builder.hashes)
        prompt_tokens = builder.tokens
        message_tokens = scaled(index + 1) - scaled(index)
        output = builder.copy().extend(messages[index].key, message_tokens)
        gap_s = 0.0
        if previous is not None and previous.created is not None and response.created is not None:
            gap_s = response.created - previous.created
            if decode_tokens_per_s and previous.completion_tokens is not None:
                gap_s -= previous.completion_tokens / decode_tokens_per_s
            gap_s = max(0.0, float(gap_s))
        hints: dict[str, HintValue] = {"step": len(calls)}
        calls.append(
            Call(
                workflow_id=instance_id,
                agent=AGENT,
                block_hashes=prompt_blocks,
                prompt_tokens=prompt_tokens,
                output_tokens=(
                    message_tokens
                    if response.completion_tokens is None
                    else response.completion_tokens
                ),
                gap_s=gap_s,
                workflow_type=WORKFLOW_TYPE,
                output_block_hashes=() if response.reasoning_tokens else tuple(output),
                hints=hints,
                last=len(calls) == len(responses) - 1,
            )
        )
        previous = response
    return Trajectory(
        instance_id=instance_id,
        calls=tuple(calls),
        recorded_prompt_tokens=tuple(p for _, p in recorded),
        tokenizer_prompt_tokens=tuple(c for c, _ in recorded),
        calibration=factor,
    )


def _load(raw: bytes, source: str) -> object:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{source}: not JSON ({exc})") from None


def trajectory_files(path: str | Path) -> Iterator[tuple[str, object]]:
    """``(source, parsed JSON)`` of each trajectory under ``path``: a ``*.traj.json`` file, a
    directory of them, or a tar archive (any compression) of them, one at a time."""
    path = Path(path)
    if path.is_dir():
        for file in sorted(path.rglob(f"*{TRAJ_SUFFIX}")):
            yield str(file), _load(file.read_bytes(), str(file))
    elif path.name.endswith(TRAJ_SUFFIX):
        yield str(path), _load(path.read_bytes(), str(path))
    elif tarfile.is_tarfile(path):
        with tarfile.open(path, "r|*") as archive:  # a stream: no seeking, nothing extracted
            for member in archive:
                if not (member.isfile() and member.name.endswith(TRAJ_SUFFIX)):
                    continue
                source = f"{path}:{member.name}"
                member_file = archive.extractfile(member)
                if member_file is None:
                    raise ValueError(f"{source}: cannot be read")
                yield source, _load(member_file.read(), source)
    else:
        raise ValueError(f"{path}: not a {TRAJ_SUFFIX} file, a directory or a tar archive of them")


def read_swe(
    path: str | Path,
    *,
    limit: int | None = None,
    tokenizer: MessageTokenizer | None = None,
    decode_tokens_per_s: float | None = None,
) -> Iterator[Trajectory]:
    """The trajectories under ``path`` (see ``trajectory_files``), at most ``limit``, parsed
    one at a time."""
    tokenizer = tokenizer or MessageTokenizer()
    for source, data in islice(trajectory_files(path), limit):
        yield parse_trajectory(data, source, tokenizer, decode_tokens_per_s)


def swe_workload(
    path: str | Path,
    *,
    limit: int | None = None,
    decode_tokens_per_s: float | None = None,
) -> Workload:
    """The trajectories under ``path`` as a workload, one stream per task."""
    streams: list[tuple[Call, ...]] = []
    factors: list[float] = []
    for trajectory in read_swe(path, limit=limit, decode_tokens_per_s=decode_tokens_per_s):
        streams.append(trajectory.calls)
        if trajectory.calibrated:
            factors.append(trajectory.calibration)
    calibration = (
        f"token counts x{sum(factors) / len(factors):.3f} (mean calibration to recorded usage)"
        if factors
        else "uncalibrated cl100k token counts"
    )
    return Workload(
        name=f"swe:{Path(path).name}",
        streams=streams,
        description=f"{len(streams)} mini-swe-agent trajectories; {calibration}",
    )
