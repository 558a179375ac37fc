"""What a request tells AgentKV through vLLM's ``kv_transfer_params``.

Clients name the workflow and the agent of every call; the connector reads them once, when vLLM
first sees the request. Unknown or malformed fields never fail a request: a request without a
workflow id becomes its own one-call workflow (``wf-<request id>``), agent ``"unknown"``.

>>> tags = parse_request_tags("r1", {"workflow_id": "w7", "agent": "planner", "workflow_done": 1})
>>> (tags.workflow_id, tags.agent, tags.workflow_done)
('w7', 'planner', True)
>>> parse_request_tags("r2", None).workflow_id
'wf-r2'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from policyd.core.types import HintValue

UNKNOWN_AGENT: Final = "unknown"
MAX_ID_CHARS: Final = 256  # longer ids are cut: they travel in every event
MAX_HINTS: Final = 32
KNOWN_KEYS: Final = frozenset(
    {"workflow_id", "agent", "workflow_type", "workflow_done", "hints", "session_id"}
)
_TRUE: Final = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True, slots=True)
class RequestTags:
    """A request's place in an agent workflow, as its client declared it."""

    request_id: str
    workflow_id: str
    agent: str
    workflow_type: str = ""
    workflow_done: bool = False
    hints: dict[str, HintValue] = field(default_factory=dict)
    session_id: str | None = None


def _text(value: object, default: str) -> str:
    if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
        return str(value)[:MAX_ID_CHARS]
    return default


def _flag(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value != 0
    return isinstance(value, str) and value.strip().lower() in _TRUE


def _hints(value: object) -> dict[str, HintValue]:
    """Scalar hints only (what the wire carries); anything else is dropped, not fatal."""
    if not isinstance(value, Mapping):
        return {}
    out: dict[str, HintValue] = {}
    for key, item in value.items():
        if len(out) >= MAX_HINTS:
            break
        if isinstance(key, str) and (item is None or isinstance(item, str | int | float | bool)):
            out[key[:MAX_ID_CHARS]] = item[:MAX_ID_CHARS] if isinstance(item, str) else item
    return out


def parse_request_tags(
    request_id: str, params: Mapping[str, object] | None, session_id: str | None = None
) -> RequestTags:
    """Read workflow / agent / type / done flag / hints (and the session id) of one request.

    ``session_id`` from vLLM (body field or ``X-Session-ID`` header) wins over one inside the
    params; a missing workflow id falls back to the session id, then to the request itself.
    """
    p: Mapping[str, object] = params if isinstance(params, Mapping) else {}
    session = session_id or (_text(p.get("session_id"), "") or None)
    default_workflow = session or f"wf-{request_id}"
    return RequestTags(
        request_id=request_id,
        workflow_id=_text(p.get("workflow_id"), default_workflow),
        agent=_text(p.get("agent"), UNKNOWN_AGENT),
        workflow_type=_text(p.get("workflow_type"), ""),
        workflow_done=_flag(p.get("workflow_done", False)),
        hints=_hints(p.get("hints")),
        session_id=session,
    )
