"""How good the predictor is, measured online, and when the world changed.

Every forecast is checked when its truth arrives: the forecast made at a workflow's position
``p`` for step ``k`` against the label of position ``p + k`` (an agent, or ``END`` when the
workflow finished there; steps past the end are not scored). Per step: top-1 accuracy over the
last ``window`` checks (``utils.Rolling(metrics.Accuracy)``) and since the start (counts); for
step 1 also the cross-entropy of the whole distribution (``metrics.CrossEntropy``, calibration).

The rolling accuracy is read rarely (stats, the API) and checked ~3 times per call, so the
checks are kept in a window of (label, guess) pairs and fed to the River metric when it is read:
only the last ``window`` of them, since the older ones would have left its window anyway. It
reads the same as a metric updated at every check.

Drift: one ``drift.ADWIN`` per workflow type watches step 1's *surprise*: the top-1 error less
the error the forecast itself expected (1 - the probability it gave its guess), mapped to
[0, 1]. A workflow whose next agent is a coin flip (a fan-out's calls start in the order their
tool calls finish) errs half the time and says so: no surprise, so no drift, however that
share of such positions shifts. A structure that changed makes a confident forecast wrong:
surprise, then drift. (Watching the plain 0/1 error, ADWIN read the financial crew's
fan-outs as 49 drifts in 1,000 stationary workflows, each one forgetting what the predictor
had learnt; docs/RESULTS.md, *Fan-outs in arrival order*.) ADWIN also fires when the surprise
*falls* (the model got better); ``Tracker.check`` reports a drift only when it rose, which is
when the predictor must forget.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from river import drift, metrics, utils

from policyd.models.predictor.forecast import END, Forecast


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
        self._rolling = [self._new_rolling() for _ in range(k)]
        self._window: list[deque[tuple[str, str]]] = [deque(maxlen=window) for _ in range(k)]
        self._unread = [0] * k  # checks per step not yet fed to the rolling metric
        self.hits = [0] * k
        self.checked = [0] * k
        self.cross_entropy = metrics.CrossEntropy()  # type: ignore[no-untyped-call]
        self.detectors: dict[str, drift.ADWIN] = {}
        self.drifts: dict[str, int] = {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickle, one whose rolling metrics were updated at every check included."""
        if "rolling" in state:
            state["_rolling"] = state.pop("rolling")
            state["_window"] = [deque(maxlen=state["window"]) for _ in range(state["k"])]
            state["_unread"] = [0] * state["k"]
        self.__dict__.update(state)

    def _new_rolling(self) -> utils.Rolling[metrics.Accuracy]:
        return utils.Rolling(metrics.Accuracy, window_size=self.window)

    @property
    def rolling(self) -> list[utils.Rolling[metrics.Accuracy]]:
        """The rolling accuracy per step (River metrics), up to date with every check."""
        rolling, windows, unread = self._rolling, self._window, self._unread
        for i, fresh in enumerate(unread):
            if not fresh:
                continue
            window = windows[i]
            if fresh >= self.window:  # the whole window is new: a fresh metric reads the same
                rolling[i] = self._new_rolling()
            for label, guess in list(window)[max(0, len(window) - fresh) :]:
                rolling[i].update(label, guess)
            unread[i] = 0
        return rolling

    def check(self, kind: str, forecast: Forecast, step: int, label: str) -> bool:
        """Score ``forecast``'s step ``step`` against ``label``; True when this reveals a drift
        towards more errors in workflow type ``kind``."""
        i = step - 1
        dist = forecast.agents[i]  # forecast.top(step), inlined: it runs ~K times per call
        if dist:
            alive = forecast.alive[i]
            agent = max(dist, key=dist.__getitem__)
            sure = alive * dist[agent]  # the probability the forecast gives its guess
            guess, sure = (agent, sure) if sure >= 1.0 - alive else (END, 1.0 - alive)
        else:
            guess, sure = END, 1.0
        self._window[i].append((label, guess))
        self._unread[i] += 1
        self.checked[i] += 1
        if guess == label:
            self.hits[i] += 1
        if step != 1:
            return False
        # the cross-entropy reads the true label's probability only: the joint distribution
        # (alive x agents, END) is not built, just that entry
        alive = forecast.alive[0]
        if label == END:
            joint = {END: 1.0 - alive}
        else:
            p = forecast.agents[0].get(label)
            joint = {} if p is None else {label: alive * p}
        self.cross_entropy.update(label, joint)
        detector = self.detectors.get(kind)
        if detector is None:
            detector = self.detectors[kind] = drift.ADWIN(delta=self.drift_delta)  # type: ignore[no-untyped-call]
        before = detector.estimation
        surprise = float(guess != label) - (1.0 - sure)  # in [-1, 1]; ~0 while calibrated
        detector.update((1.0 + surprise) / 2.0)  # type: ignore[no-untyped-call]
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
