"""Scoring forecasts as their truth arrives, per workflow.

When a workflow's next call (or its end) is observed, every forecast still pending for it is
scored: the one made at position ``p`` on its step ``pos - p + 1`` (``Tracker.check``: top-1
accuracy per step, step 1's calibration, drift). A forecast leaves the queue once its last step
has been scored, or when the workflow ended (steps past the end are not scored). A position
where no forecast was served can still be scored on step 1, from its one-step prediction
(``unserved``): what a predictor that does not roll out every position (the daemon's) does.
"""

from __future__ import annotations

from policyd.models.predictor.forecast import END, Forecast
from policyd.models.predictor.nodes import Node, step_one
from policyd.models.predictor.tracking import Tracker
from policyd.models.predictor.workflows import Workflow


class Scorer:
    """Scores a workflow's forecasts with ``tracker`` (which may be replaced by one of
    another K between calls: the daemon's resize, which also empties the queues)."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def score(self, workflow: Workflow, node: Node, name: str, *, unserved: bool) -> bool:
        """Score what was forecast for ``workflow`` against ``name`` (an agent, or ``END``),
        the label of its position's next call; with ``unserved``, also step 1 of the one-step
        prediction ``node`` made there. True when this reveals a drift of its type towards
        more errors."""
        tracker = self.tracker
        kind, pos = workflow.position.kind, workflow.position.pos
        drifted = False
        pending = workflow.pending
        if pending:
            check = tracker.check
            for made, forecast in pending:
                if check(kind, forecast, pos - made + 1, name):
                    drifted = True
            while pending and (name == END or pos - pending[0][0] + 2 > tracker.k):
                pending.popleft()
        if unserved:  # (the newest forecast: after the older ones, as it would be in pending)
            first, ended = step_one(node.labels, node.probs)
            step = workflow.in_names(Forecast([first], [1.0 - ended]))
            if tracker.check(kind, step, 1, name):
                drifted = True
        return drifted
