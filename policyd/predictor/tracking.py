"""How good the predictor is, measured online, and when the world changed.

Every forecast is checked when its truth arrives: the forecast made at a workflow's position
``p`` for step ``k`` against the label of position ``p + k`` (an agent, or ``END`` when the
workflow finished there; steps past the end are not scored). Per step: top-1 accuracy over the
last ``window`` checks (``utils.Rolling(metrics.Accuracy)``) and since the start (counts); for
step 1 also the cross-entropy of the whole distribution (``metrics.CrossEntropy``, calibration).

Drift: one ``drift.ADWIN`` per workflow type watches the 0/1 stream of step-1 top-1 errors.
ADWIN also fires when the error *falls* (the model got better); ``Tracker.check`` reports a
drift only when the error rose, which is when the predictor must forget.
"""

from __future__ import annotations

from typing import Any

from river import drift, metrics, utils

from policyd.predictor.forecast import END, Forecast


class Tracker:
    """Online accuracy per step, calibration of step 1, and an error-drift detector per type.

    >>> tracker = Tracker(k=2, window=10)
    >>> f = Forecast(agents=[{"a": 1.0}, {"b": 1.0}], alive=[1.0, 0.5])
    >>> tracker.check("w", f, 1, "a")
    False
    >>> tracker.check("w", f, 2, "c")
    False
    >>> tracker.accuracy(1), tracker.accuracy(2)
    (1.0, 0.0)
    """

    def __init__(self, k: int, window: int = 500, drift_delta: float = 0.05) -> None:
        self.k = k
        self.window = window
        self.drift_delta = drift_delta
        self.rolling = [utils.Rolling(metrics.Accuracy, window_size=window) for _ in range(k)]
        self.hits = [0] * k
        self.checked = [0] * k
        self.cross_entropy = metrics.CrossEntropy()  # type: ignore[no-untyped-call]
        self.detectors: dict[str, drift.ADWIN] = {}
        self.drifts: dict[str, int] = {}

    def check(self, kind: str, forecast: Forecast, step: int, label: str) -> bool:
        """Score ``forecast``'s step ``step`` against ``label``; True when this reveals a drift
        towards more errors in workflow type ``kind``."""
        guess = forecast.top(step)
        self.rolling[step - 1].update(label, guess)
        self.checked[step - 1] += 1
        self.hits[step - 1] += guess == label
        if step != 1:
            return False
        alive = forecast.alive[0]
        joint = {agent: alive * p for agent, p in forecast.agents[0].items()}
        joint[END] = 1.0 - alive
        self.cross_entropy.update(label, joint)
        detector = self.detectors.get(kind)
        if detector is None:
            detector = self.detectors[kind] = drift.ADWIN(delta=self.drift_delta)  # type: ignore[no-untyped-call]
        before = detector.estimation
        detector.update(float(guess != label))  # type: ignore[no-untyped-call]
        if detector.drift_detected and detector.estimation > before:
            self.drifts[kind] = self.drifts.get(kind, 0) + 1
            return True
        return False

    def accuracy(self, step: int, rolling: bool = False) -> float:
        """Top-1 accuracy of step ``step`` (1-based), over the window or since the start."""
        if rolling:
            return float(self.rolling[step - 1].obj.get())  # type: ignore[no-untyped-call]
        checked = self.checked[step - 1]
        return self.hits[step - 1] / checked if checked else 0.0

    def stats(self) -> dict[str, Any]:
        return {
            "accuracy": [self.accuracy(s) for s in range(1, self.k + 1)],
            "rolling_accuracy": [self.accuracy(s, rolling=True) for s in range(1, self.k + 1)],
            "checked": list(self.checked),
            "cross_entropy": float(self.cross_entropy.get()),  # type: ignore[no-untyped-call]
            "drifts": dict(self.drifts),
        }
