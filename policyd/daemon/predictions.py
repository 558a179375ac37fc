"""Next-agent predictions as the daemon serves and audits them.

After each call of a workflow the daemon asks the predictor for its K-step forecast and keeps
the top agent per step as *pending*. The forecast made after call ``n`` for step ``k`` is
resolved by call ``n + k`` of the same workflow (its agent is what actually happened), or by the
workflow's end when ``n + k`` is the position right after its last call (``END``); steps past
the end are not scored - the predictor's own ``Tracker`` counts the same way. Resolved rows go to
the history's ``predictions`` table; pending ones are written with ``actual_agent`` NULL when the
daemon stops.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from policyd.models.predictor import END, Forecast, Predictor

MAX_WORKFLOWS: Final = 100_000
MIN_FORECAST_INTERVAL_S: Final = 0.2  # per workflow: faster call bursts are logged sampled
# all workflows together (a token bucket, one second's worth of burst): past it calls are logged
# sampled - each logged forecast is a K-step roll-out on the Engine's thread
MAX_FORECASTS_PER_S: Final = 100.0
TOP_AGENTS: Final = 5


@dataclass(slots=True)
class _Pending:
    ts: float  # wall clock when made
    made_at: int  # the call count of the workflow when made
    step: int
    predicted: str
    probability: float
    p_alive: float


@dataclass(slots=True)
class _Workflow:
    workflow_type: str
    calls: int = 0
    last_agent: str | None = None
    logged_s: float = -1e18  # the daemon's clock when a forecast was last logged
    pending: list[_Pending] = field(default_factory=list)


class PredictionLog:
    """Pending and resolved predictions; ``take_rows()`` hands resolved rows to the history."""

    def __init__(
        self,
        wall_clock: Callable[[], float],
        recent_max: int = 500,
        max_forecasts_per_s: float = MAX_FORECASTS_PER_S,
    ) -> None:
        self.wall_clock = wall_clock
        self.max_forecasts_per_s = max_forecasts_per_s
        self._tokens = max_forecasts_per_s
        self._tokens_s: float | None = None  # when the bucket was last filled
        self.forecasts_skipped = 0  # calls not logged for the budget
        self._workflows: OrderedDict[str, _Workflow] = OrderedDict()
        self._rows: list[dict[str, object]] = []
        self._first_logged: dict[str, float] = {}
        self.recent: deque[dict[str, object]] = deque(maxlen=recent_max)
        self.resolved = 0
        self.correct = 0

    def __len__(self) -> int:
        """Workflows whose predictions are tracked (bounded by ``MAX_WORKFLOWS``)."""
        return len(self._workflows)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        del state["wall_clock"]  # a clock need not pickle; the restoring service sets its own
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.wall_clock = time.time
        # a checkpoint from before the budget existed
        self.__dict__.setdefault("max_forecasts_per_s", MAX_FORECASTS_PER_S)
        self.__dict__.setdefault("_tokens", self.max_forecasts_per_s)
        self.__dict__.setdefault("_tokens_s", None)
        self.__dict__.setdefault("forecasts_skipped", 0)

    def wants_forecast(self, workflow_id: str, now_s: float) -> bool:
        """Whether to log a forecast after this call: always, unless the workflow's calls come
        faster than ``MIN_FORECAST_INTERVAL_S`` (a replay flood; agent steps take seconds) or
        all workflows' together faster than ``max_forecasts_per_s`` - each logged forecast
        costs a K-step roll-out of the predictor. Both samples are by time, not by outcome, so
        the logged accuracy stays an unbiased estimate."""
        wf = self._workflows.get(workflow_id)
        if wf is not None and now_s - wf.logged_s < MIN_FORECAST_INTERVAL_S:
            return False
        if not self._take_token(now_s):
            self.forecasts_skipped += 1
            return False
        if wf is not None:
            wf.logged_s = now_s
        else:
            self._first_logged[workflow_id] = now_s
        return True

    def _take_token(self, now_s: float) -> bool:
        rate, last = self.max_forecasts_per_s, self._tokens_s
        self._tokens_s = now_s
        if last is not None:
            self._tokens = min(rate, self._tokens + max(0.0, now_s - last) * rate)
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def on_call(
        self,
        workflow_id: str,
        workflow_type: str,
        agent: str,
        forecast: Forecast | None,
    ) -> None:
        """A call of ``agent`` arrived: resolve what it answers, then log the new forecast."""
        wf = self._workflows.get(workflow_id)
        if wf is None:
            logged = self._first_logged.pop(workflow_id, -1e18)
            wf = self._workflows[workflow_id] = _Workflow(workflow_type, logged_s=logged)
            if len(self._workflows) > MAX_WORKFLOWS:
                self._workflows.popitem(last=False)
        else:
            self._workflows.move_to_end(workflow_id)
        wf.calls += 1
        wf.last_agent = agent
        self._resolve(workflow_id, wf, wf.calls, agent)
        if forecast is not None:
            now = self.wall_clock()
            for step in range(1, forecast.k + 1):
                top = forecast.top(step)
                wf.pending.append(
                    _Pending(now, wf.calls, step, top, forecast.prob(top, step),
                             forecast.alive[step - 1])
                )  # fmt: skip

    def on_finished(self, workflow_id: str) -> None:
        wf = self._workflows.pop(workflow_id, None)
        if wf is not None:
            self._resolve(workflow_id, wf, wf.calls + 1, END)
            wf.pending.clear()  # steps past the end are not scored

    def _resolve(self, workflow_id: str, wf: _Workflow, position: int, actual: str) -> None:
        keep: list[_Pending] = []
        now = self.wall_clock()
        for p in wf.pending:
            if p.made_at + p.step == position:
                correct = p.predicted == actual
                row = self._row(
                    workflow_id, wf=wf, p=p, actual=actual, correct=correct, resolved_ts=now
                )
                self._rows.append(row)
                self.recent.append(row)
                self.resolved += 1
                self.correct += correct
            elif p.made_at + p.step > position:
                keep.append(p)
        wf.pending = keep

    @staticmethod
    def _row(
        workflow_id: str,
        *,
        wf: _Workflow,
        p: _Pending,
        actual: str | None,
        correct: bool | None,
        resolved_ts: float | None,
    ) -> dict[str, object]:
        return {
            "ts": p.ts,
            "workflow_id": workflow_id,
            "workflow_type": wf.workflow_type,
            "step": p.step,
            "predicted_agent": p.predicted,
            "probability": _finite(p.probability),
            "p_alive": _finite(p.p_alive),
            "actual_agent": actual,
            "correct": correct,
            "resolved_ts": resolved_ts,
        }

    def describe(self, workflow_id: str) -> tuple[str, str | None] | None:
        """(workflow type, last agent) of a workflow seen calling, else None."""
        wf = self._workflows.get(workflow_id)
        return (wf.workflow_type, wf.last_agent) if wf is not None else None

    def take_rows(self, include_pending: bool = False) -> list[dict[str, object]]:
        """Resolved rows since the last call (and, at shutdown, the unresolved ones)."""
        rows, self._rows = self._rows, []
        if include_pending:
            for wid, wf in self._workflows.items():
                rows.extend(
                    self._row(wid, wf=wf, p=p, actual=None, correct=None, resolved_ts=None)
                    for p in wf.pending
                )
                wf.pending.clear()
        return rows


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def forecast_view(forecast: Forecast) -> list[dict[str, Any]]:
    """A forecast as the API shows it: per step the top agents and P(still running)."""
    steps = []
    for i, dist in enumerate(forecast.agents):
        top = sorted(dist.items(), key=lambda kv: -kv[1])[:TOP_AGENTS]
        steps.append(
            {
                "step": i + 1,
                "agents": {a: round(p, 4) for a, p in top},
                "p_alive": round(forecast.alive[i], 4),
            }
        )
    return steps


def resize_predictor(predictor: Predictor, k: int) -> Predictor:
    """Change a live predictor's lookahead K in place, keeping everything it has learnt.

    Only the roll-out depth and the per-step accuracy tracking depend on K: steps 1..min(K)
    keep their counters, new steps start empty; forecasts already served for the old K are
    dropped (they cannot be scored against the new steps)."""
    if k == predictor.k:
        return predictor
    tracker = predictor.tracker
    fresh = type(tracker)(k, window=tracker.window, drift_delta=tracker.drift_delta)
    n = min(k, tracker.k)
    fresh.rolling[:n] = tracker.rolling[:n]
    fresh.hits[:n] = tracker.hits[:n]
    fresh.checked[:n] = tracker.checked[:n]
    fresh.cross_entropy = tracker.cross_entropy
    fresh.detectors = tracker.detectors
    fresh.drifts = tracker.drifts
    predictor.tracker = fresh
    predictor.k = k
    for workflow in getattr(predictor, "_workflows", {}).values():
        workflow.forecast = None
        workflow.pending.clear()
    return predictor
