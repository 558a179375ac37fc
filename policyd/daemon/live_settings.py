"""Changing the daemon's tunables while it runs (``PUT /api/settings``, the demo)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from policyd.core.engine import Engine
from policyd.daemon.policy_holder import POLICY_PARAMS, PolicyHolder
from policyd.daemon.settings import validate_tunables
from policyd.history import History
from policyd.history.process import HistoryProcess


class SettingsUpdater:
    """Validates a change set whole (``settings.validate_tunables``), then applies it to
    ``holder.tunables`` under the service's lock: a change to the policy or to a setting a
    policy takes rebuilds the policy (one that refuses its parameters rolls everything back
    and answers errors per key), a new ``block_sample_rate`` goes to the history. After the
    lock is released each change becomes a ``settings_changes`` row, and a change to the policy
    or to ``snapshot_interval_s`` wakes the publisher (``wake_publisher``). Called from HTTP
    threads and the demo's thread."""

    def __init__(
        self,
        lock: AbstractContextManager[Any],
        holder: PolicyHolder,
        engine: Engine,
        history: History | HistoryProcess,
        counts: Counter[str],
        *,
        wall_clock: Callable[[], float],
        wake_publisher: Callable[[], None],
    ) -> None:
        self.lock = lock
        self.holder = holder
        self.engine = engine
        self.history = history
        self.counts = counts
        self.wall_clock = wall_clock
        self.wake_publisher = wake_publisher

    def update(self, changes: Mapping[str, object], actor: str = "api") -> dict[str, str]:
        """Validate everything, then apply live; returns errors per key (nothing applied if any)."""
        good, errors = validate_tunables(changes)
        if errors:
            return errors
        holder = self.holder
        rows = []
        with self.lock:
            old = dict(holder.tunables)
            changed = {k: v for k, v in good.items() if old[k] != v}
            holder.tunables.update(changed)
            if changed.keys() & {"policy", "recency_guard", *POLICY_PARAMS}:
                try:
                    holder.rebuild(self.engine, self.counts["requests"])
                except Exception as exc:  # a policy that refuses its params: roll back
                    holder.tunables = old
                    holder.rebuild(self.engine, self.counts["requests"])
                    return {
                        k: f"rejected by policy {good.get('policy', old['policy'])}: {exc}"
                        for k in changed
                    }
            if "block_sample_rate" in changed:
                self.history.set_block_sample_rate(holder.float_setting("block_sample_rate"))
            for k, v in changed.items():
                rows.append(
                    {
                        "ts": self.wall_clock(),
                        "key": k,
                        "old_value": json.dumps(old[k]),
                        "new_value": json.dumps(v),
                        "actor": actor,
                    }
                )
        if rows:
            self.history.record("settings_changes", rows)
        if "snapshot_interval_s" in changed or "policy" in changed:
            self.wake_publisher()
        return {}
