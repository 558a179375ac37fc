"""The daemon's bookkeeping after each event the Engine applied: the cache counters, the models
the policy does not feed itself (predictor, SHARDS estimator), the prediction log and its rows
for the history, drift alarms, and the decision a finished workflow makes (its blocks retire)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from policyd.core.engine import Engine
from policyd.core.types import (
    BlocksLoaded,
    BlocksRemoved,
    BlocksStored,
    Event,
    PrefixHit,
    RequestStarted,
    WorkflowFinished,
)
from policyd.daemon.decisions import DecisionLog
from policyd.daemon.policy_holder import PolicyHolder
from policyd.daemon.predictions import PredictionLog
from policyd.daemon.sizing import learn_prompt
from policyd.history import History
from policyd.history.process import HistoryProcess


class EventBookkeeping:
    """The Engine's hook (``observe``): called with each event after the state and the policy
    saw it, on the thread applying events (the engine worker, or housekeeping's ``tick``),
    always under the service's lock.

    Adds to ``counts`` (the service's counters: ``requests``, ``prompt_blocks``,
    ``gpu_hit_blocks``, ``host_hit_blocks``, ``recomputed_blocks``, ``host_written_bytes``,
    ``host_evicted_blocks``, ``host_loaded_bytes``), teaches ``holder.shards`` the prompts,
    feeds ``holder.predictor`` when the policy does not, keeps ``predictions`` (the prediction
    log), counts drift alarms (``drift_alarms``, ``drift_last_ts``: wall-clock time of the
    last new one) and logs a ``retire`` decision per finished workflow.
    ``record_prediction_rows`` moves the log's finished rows to the history (takes the lock
    to take them, records them after releasing it)."""

    def __init__(
        self,
        *,
        lock: AbstractContextManager[Any],
        engine: Engine,
        holder: PolicyHolder,
        predictions: PredictionLog,
        counts: Counter[str],
        decisions: DecisionLog,
        history: History | HistoryProcess,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
    ) -> None:
        self.lock = lock
        self.engine = engine
        self.holder = holder
        self.predictions = predictions
        self.counts = counts
        self.decisions = decisions
        self.history = history
        self.clock = clock
        self.wall_clock = wall_clock
        self.kv_bytes_per_block = holder.kv_bytes_per_block
        self.drift_alarms = 0
        self.drift_last_ts: float | None = None
        self._handlers: dict[type, Callable[[Event], None]] = {
            RequestStarted: self._on_request_started,
            PrefixHit: self._on_prefix_hit,
            BlocksStored: self._on_blocks_stored,
            BlocksRemoved: self._on_blocks_removed,
            BlocksLoaded: self._on_blocks_loaded,
            WorkflowFinished: self._on_workflow_finished,
        }

    def observe(self, event: Event) -> None:
        """Bookkeeping after the Engine and the policy saw ``event`` (under the lock)."""
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def record_prediction_rows(self, final: bool = False) -> None:
        """The prediction log's resolved rows to the history (``final``: the pending ones too)."""
        with self.lock:
            rows = self.predictions.take_rows(include_pending=final)
        if rows:
            self.history.record("predictions", rows)

    def _feeds_predictor(self) -> bool:
        return not self.holder.owns_predictor(self.engine.policy)

    def _on_request_started(self, event: Event) -> None:
        assert isinstance(event, RequestStarted)
        self.counts["requests"] += 1
        learn_prompt(self.holder.shards, event.block_hashes, event.prompt_tokens)
        predictor = self.holder.predictor
        if self._feeds_predictor():
            predictor.observe_call(
                event.workflow_id, event.workflow_type, event.agent, event.hints, event.ts
            )
        log_forecast = self.predictions.wants_forecast(event.workflow_id, self.clock())
        forecast = None
        if log_forecast:
            try:
                forecast = predictor.predict(event.workflow_id)
            except KeyError:
                forecast = None
        wf = self.engine.state.workflows.get(event.workflow_id)
        wtype = wf.workflow_type if wf is not None else event.workflow_type
        self.predictions.on_call(event.workflow_id, wtype, event.agent, forecast)
        alarms = sum(predictor.tracker.drifts.values())
        if alarms > self.drift_alarms:
            self.drift_alarms, self.drift_last_ts = alarms, self.wall_clock()

    def _on_prefix_hit(self, event: Event) -> None:
        assert isinstance(event, PrefixHit)
        c = self.counts
        c["prompt_blocks"] += event.gpu_blocks + event.host_blocks + event.recomputed_blocks
        c["gpu_hit_blocks"] += event.gpu_blocks
        c["host_hit_blocks"] += event.host_blocks
        c["recomputed_blocks"] += event.recomputed_blocks

    def _on_blocks_stored(self, event: Event) -> None:
        assert isinstance(event, BlocksStored)
        if event.tier == "host":
            self.counts["host_written_bytes"] += len(event.block_hashes) * self.kv_bytes_per_block

    def _on_blocks_removed(self, event: Event) -> None:
        assert isinstance(event, BlocksRemoved)
        if event.tier == "host":
            self.counts["host_evicted_blocks"] += len(event.block_hashes)

    def _on_blocks_loaded(self, event: Event) -> None:
        assert isinstance(event, BlocksLoaded)
        self.counts["host_loaded_bytes"] += len(event.block_hashes) * self.kv_bytes_per_block

    def _on_workflow_finished(self, event: Event) -> None:
        assert isinstance(event, WorkflowFinished)
        if self._feeds_predictor():
            self.holder.predictor.observe_finished(event.workflow_id)
        self.predictions.on_finished(event.workflow_id)
        wf = self.engine.state.workflows.get(event.workflow_id)
        resident = self.engine.state.resident
        n = 0
        if wf is not None:
            n = len(wf.blocks) - len(wf.blocks.difference(resident["gpu"], resident["host"]))
        self.decisions.record(
            "retire",
            tier=None,
            workflow_id=event.workflow_id,
            n_blocks=n,
            reason=f"workflow finished ({event.reason}): its {n} cached blocks are retired",
        )
