"""The predictor's fast paths compute what their straightforward versions compute, bit for bit.

Each kernel that was rewritten for speed (the roll-out inlined into the predictor, the hint
splitter with its cached names, the three-expert mixture step, the tracker's inlined top-1) is
checked here against the plain computation it replaces, on replays and on generated inputs.
"""

from __future__ import annotations

import math
import pickle
import random
from collections.abc import Mapping
from typing import TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st
from river import preprocessing

from experiments.predictor_eval import interleave
from policyd.core.types import HintValue
from policyd.models.predictor import END, Forecast, Predictor, context, mixture, rollout, tracking
from policyd.workloads.calls import Call
from policyd.workloads.pbkv import code_writing, fact_checking
from tests.test_predictor import _replay_side_by_side

T = TypeVar("T")


def test_inlined_rollout_forecasts_as_the_reference_rollout() -> None:
    """Scenario: a replay of two workloads; before every forecast the predictor's inlined
    roll-out and ``rollout.rollout`` (the reference, with the predictor's one-step evaluation
    as its step) are run from the same node: the forecasts are equal, float for float."""
    predictor = Predictor(k=3)
    events = list(interleave(fact_checking(seed=3, workflows=40), 8))
    events += list(interleave(code_writing(seed=3, workflows=40), 8))
    compared = 0
    for call, pos, ended in events:
        wid = call.workflow_id
        if pos:
            position = predictor._workflows[wid].position
            hints, node = predictor._one_step.at(position)
            reference = rollout.rollout(
                position,
                node,
                lambda child, hints=hints: predictor._one_step.evaluate(child, hints),  # type: ignore[misc]
                k=predictor.k,
                beam=predictor.beam,
                min_branch=predictor.min_branch,
                order=predictor.order,
            )
            assert predictor._rollout.forecast(position, node, hints) == reference
            compared += 1
            predictor.predict(wid)
        if ended:
            predictor.observe_finished(wid)
        else:
            predictor.observe_call(wid, call.workflow_type, call.agent, call.hints, float(pos))
    assert compared > 500


def _split_hints_reference(hints: Mapping[str, HintValue]) -> tuple[dict[str, float], ...]:
    """``split_hints`` written plainly: names formatted every time, pairs from a sorted copy."""
    numeric: dict[str, float] = {}
    onehot: dict[str, float] = {}
    integers: list[tuple[str, int]] = []
    for key, value in hints.items():
        if value is None:
            continue
        if isinstance(value, bool):
            numeric[key] = float(value)
        elif isinstance(value, int):
            numeric[key] = float(value)
            integers.append((key, value))
        elif isinstance(value, float):
            if math.isfinite(value):
                numeric[key] = value
        elif isinstance(value, str):
            onehot[f"{key}={value}"] = 1.0
    integers = sorted(integers)[: context.MAX_INT_HINTS]
    for i, (a, x) in enumerate(integers):
        for b, y in integers[i + 1 :]:
            numeric[f"{a}-{b}"] = float(x - y)
    return numeric, onehot


hint_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(hints=st.dictionaries(st.sampled_from("abcdefg"), hint_values, max_size=7))
def test_split_hints_with_cached_names_equals_the_plain_computation(
    hints: dict[str, HintValue],
) -> None:
    numeric, onehot = context.split_hints(hints)
    expected_numeric, expected_onehot = _split_hints_reference(hints)
    assert list(numeric.items()) == list(expected_numeric.items())  # values and order
    assert list(onehot.items()) == list(expected_onehot.items())
    # a second time, from the caches
    assert context.split_hints(hints) == (numeric, onehot)


def test_three_expert_mixture_step_equals_the_general_step() -> None:
    rng = random.Random(5)
    mix = mixture.Mixture(3)
    compared = 0
    for _ in range(20_000):
        weights = [rng.random() for _ in range(3)]
        said = [rng.choice((0.0, 1.0, rng.random(), rng.random() * 1e-3)) for _ in range(3)]
        try:
            general = mix._step(weights, said)
        except OverflowError:  # (both overflow alike; nothing to compare)
            continue
        assert mix._step3(weights, said) == general
        compared += 1
    assert compared > 19_000
    # learn uses it, and ends where the general step ends
    plain, unrolled = mixture.Mixture(3), mixture.Mixture(3)
    plain._step3 = plain._step  # type: ignore[method-assign]
    for _ in range(200):
        said = [rng.random() for _ in range(3)]
        last = rng.choice("abc")
        plain.learn(last, said)
        unrolled.learn(last, said)
        assert plain.weights(last) == unrolled.weights(last)
    assert plain.typewide == unrolled.typewide


@settings(max_examples=200, deadline=None)
@given(
    dist=st.dictionaries(st.sampled_from("abcd"), st.floats(0.0, 1.0), max_size=4),
    alive=st.floats(0.0, 1.0),
    label=st.sampled_from(["a", "b", "c", "d", END]),
)
def test_the_tracker_scores_the_forecasts_top_label(
    dist: dict[str, float], alive: float, label: str
) -> None:
    forecast = Forecast(agents=[dist, dist], alive=[alive, alive])
    tracker = tracking.Tracker(k=2, window=10)
    for step in (1, 2):
        tracker.check("t", forecast, step, label)
        assert tracker.hits[step - 1] == int(forecast.top(step) == label)
        assert tracker._window[step - 1][-1] == (label, forecast.top(step))


def _without(obj: T, *names: str) -> T:
    """A copy of slotted ``obj`` with attributes ``names`` never set (as unpickled from a
    version that did not have them)."""
    copy = type(obj).__new__(type(obj))
    for slot in type(obj).__slots__:  # type: ignore[attr-defined]
        if slot not in names:
            setattr(copy, slot, getattr(obj, slot))
    return copy


def test_a_checkpoint_from_before_the_cached_agents_and_margins_still_forecasts() -> None:
    """A predictor pickled before count-model views named their agents and kept their back-off
    Counts, and before hints kept their margins: those caches are dropped on restore and
    rebuilt from the learnt state (the forecasts are those of that state, caches emptied)."""
    events = list(interleave(code_writing(seed=8, workflows=30), 8))
    original = Predictor(k=3)
    for call, pos, ended in events[:150]:
        if pos:
            original.predict(call.workflow_id)
        if ended:
            original.observe_finished(call.workflow_id)
        else:
            args = (call.workflow_type, call.agent, call.hints, float(pos))
            original.observe_call(call.workflow_id, *args)
    legacy = pickle.loads(pickle.dumps(original))
    for classifier in (legacy.markov, legacy.copy):
        del classifier.generation
    for model in legacy._types.values():  # views as an older version pickled them
        for key, structure in list(model.structures.items()):
            model.structures[key] = _without(structure, "agents", "resolved")
    for workflow in legacy._workflows.values():
        if workflow.hints is not None:
            workflow.hints = _without(workflow.hints, "margins")
    restored = pickle.loads(pickle.dumps(legacy))
    assert all(not m.structures for m in restored._types.values())
    assert restored.markov.generation == restored.copy.generation == 0
    # the same learnt state with those caches emptied by hand forecasts alike
    reference = pickle.loads(pickle.dumps(original))
    for model in reference._types.values():
        model.structures.clear()
    for workflow in reference._workflows.values():
        workflow.node = workflow.hints = None
    for wid in original.active():
        for predictor in (restored, reference):
            predictor._workflows[wid].forecast = None  # forecast afresh from that state
        assert restored.predict(wid) == reference.predict(wid)
    assert original.active()


def test_learning_from_kept_counts_equals_looking_them_up() -> None:
    """Scenario: back-off tables small enough to be pruned every few dozen calls (contexts
    dropped, ``generation`` bumped). A predictor that learns through the Counts its views kept
    forecasts, and ends with the same tables, as one whose kept Counts are forgotten before
    every call (so it looks every level up, creating what is missing)."""
    kept, looked_up = Predictor(k=3), Predictor(k=3)
    for predictor in (kept, looked_up):
        predictor.markov.max_contexts, predictor.copy.max_contexts = 20, 10
    events = list(interleave(code_writing(seed=9, workflows=60), 8))

    def forget() -> None:
        for model in looked_up._types.values():
            for structure in model.structures.values():
                structure.resolved = None

    _replay_side_by_side(kept, looked_up, events, lambda _: forget())
    assert kept.markov.generation > 3  # pruned along the way
    for a, b in ((kept.markov, looked_up.markov), (kept.copy, looked_up.copy)):
        assert a.generation == b.generation
        assert {k: (c.counts, c.total, c.order) for k, c in a._tables.items()} == {
            k: (c.counts, c.total, c.order) for k, c in b._tables.items()
        }
    assert any(s.resolved is not None for m in kept._types.values() for s in m.structures.values())


def test_the_scaler_in_plain_dicts_scales_as_rivers_own() -> None:
    """Scenario: hints whose names come and go (a feature first seen late, one seen in a
    transform before it is ever learnt). The context model's scaler, its moments kept in plain
    dicts, transforms and learns exactly as River's StandardScaler with its own containers."""
    model = context.ContextModel()
    river_own = preprocessing.StandardScaler()
    rng = random.Random(4)
    names = ["a", "b", "c", "d-e"]
    for n in range(2_000):
        present = [name for name in names[: 1 + n // 400] if rng.random() < 0.8]
        numeric = {name: rng.choice((0.0, 1.0, rng.gauss(3.0, 2.0))) for name in present}
        probe = {**numeric, "unseen": rng.random()} if n % 97 == 0 else numeric
        expected = river_own.transform_one(probe)  # type: ignore[no-untyped-call]
        assert model.hint_features(probe, {}) == expected
        model.learn_hints(numeric)
        river_own.learn_one(numeric)  # type: ignore[no-untyped-call]
    assert model.scaler.means == dict(river_own.means)
    assert model.scaler.vars == dict(river_own.vars)
    assert "unseen" in model.scaler.vars and "unseen" not in model.scaler.counts
    assert model.scaler.counts == dict(river_own.counts)
    assert type(model.scaler.means) is dict


def _replay(predictor: Predictor, events: list[tuple[Call, int, bool]], serve_every: int) -> int:
    """Replay ``events``, asking for a forecast after every ``serve_every``-th call (0: never);
    returns the forecasts asked for."""
    asked = 0
    for n, (call, pos, ended) in enumerate(events):
        wid = call.workflow_id
        if ended:
            predictor.observe_finished(wid)
            continue
        predictor.observe_call(wid, call.workflow_type, call.agent, call.hints, float(pos))
        if serve_every and n % serve_every == 0:
            predictor.predict(wid)
            asked += 1
    return asked


def test_without_unserved_roll_outs_served_forecasts_and_scores_are_the_same() -> None:
    """Scenario: the daemon's predictor (``roll_out_unserved=False``) and the replays' one see
    the same calls and are asked for a forecast after every call: every position is served, so
    forecasts, scores and drift are the same, float for float."""
    events = list(interleave(fact_checking(seed=5, workflows=60), 8))
    plain, daemon = Predictor(k=3), Predictor(k=3, roll_out_unserved=False)
    for predictor in (plain, daemon):
        _replay(predictor, events, 1)
    assert plain.tracker.stats() == daemon.tracker.stats()
    for wid in plain._workflows:
        assert plain.predict(wid) == daemon.predict(wid)


def test_without_unserved_roll_outs_step_one_still_scores_every_position() -> None:
    """Scenario: nobody asks for forecasts (or every 7th call). The daemon's predictor rolls
    out only what was asked for, yet scores step 1 at every position (what PBKV's fallback
    and the drift detector read) from the one-step distribution; steps 2..K are scored where
    a forecast was served. Step-1 accuracy stays that of the predictor that rolls out at every
    call (the caches it fills are refreshed at other times, so not bit for bit)."""
    events = list(interleave(code_writing(seed=5, workflows=80), 8))
    plain = Predictor(k=3)
    _replay(plain, events, 0)
    for serve_every in (0, 7):
        daemon = Predictor(k=3, roll_out_unserved=False)
        asked = _replay(daemon, events, serve_every)
        assert daemon.stats()["forecasts"] <= asked  # only what was asked for is rolled out
        assert daemon.tracker.checked[0] == plain.tracker.checked[0]
        if serve_every:
            assert 0 < daemon.tracker.checked[1] < plain.tracker.checked[1]
        else:
            assert daemon.tracker.checked[1] == 0
        assert abs(daemon.tracker.accuracy(1) - plain.tracker.accuracy(1)) < 0.02
    assert plain.stats()["forecasts"] > 0.9 * plain.tracker.checked[0]
