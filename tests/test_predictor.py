"""The online next-agent predictor: what it learns, how fast, what it answers, what it costs.

Streams are built here from small rules (a cycle, a hint that picks the branch, a regime change),
so each expectation follows from the rule, not from a recorded output of the predictor.
"""

from __future__ import annotations

import doctest
import math
import pickle
import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from river import checks, metrics, utils

from experiments import predictor_eval
from experiments.predictor_eval import MarkovBaseline, evaluate, interleave
from policyd.core.types import HintValue
from policyd.models.predictor import (
    END,
    START,
    Forecast,
    Predictor,
    backoff,
    context,
    fusion,
    kinds,
    learning,
    mixture,
    nodes,
    onestep,
    parts,
    position,
    restore,
    rollout,
    scoring,
    serving,
    tracking,
    workflows,
)
from policyd.models.predictor import forecast as forecast_module
from policyd.models.predictor.backoff import BackoffClassifier
from policyd.traces.location import WHO_AND_WHEN, local_trace
from policyd.traces.whowhen import whowhen_workload
from policyd.workloads.calls import Call, Workload
from policyd.workloads.pbkv import code_writing, fact_checking, financial

WHOWHEN = local_trace(WHO_AND_WHEN)  # the public chats, when $AGENTKV_TRACES holds them

Step = tuple[str, dict[str, HintValue]]


def run(predictor: Predictor, workflows: Iterable[Sequence[Step]], kind: str = "t") -> None:
    """Feed whole workflows one after another (predict before each call, as a policy would)."""
    for n, steps in enumerate(workflows):
        wid = f"{kind}-{n}-{id(steps)}"
        for i, (agent, hints) in enumerate(steps):
            if i:
                predictor.predict(wid)
            predictor.observe_call(wid, kind, agent, hints, float(i))
        predictor.predict(wid)
        predictor.observe_finished(wid)


def plain(agents: str) -> list[Step]:
    return [(a, {}) for a in agents]


def check_forecast(forecast: Forecast, k: int, aliased: bool = False) -> None:
    """The invariants every forecast keeps (an aliased workflow's leaves out the agents it has
    not called: its distributions sum to at most 1)."""
    assert len(forecast.agents) == len(forecast.alive) == k
    previous = 1.0
    for dist, alive in zip(forecast.agents, forecast.alive, strict=True):
        assert -1e-12 <= alive <= previous + 1e-12
        previous = alive
        assert END not in dist and START not in dist
        assert all(p >= 0.0 for p in dist.values())
        if aliased:
            assert sum(dist.values()) <= 1.0 + 1e-9
        elif alive > 1e-9:
            assert math.isclose(sum(dist.values()), 1.0, rel_tol=1e-9)


# ---- doctests and River's estimator contract ---------------------------------------------------


@pytest.mark.parametrize(
    "module",
    [
        forecast_module,
        backoff,
        context,
        mixture,
        position,
        nodes,
        kinds,
        workflows,
        onestep,
        learning,
        rollout,
        tracking,
        scoring,
        serving,
        parts,
        restore,
        fusion,
        predictor_eval,
    ],
)
def test_doctests(module: object) -> None:
    assert doctest.testmod(module).failed == 0  # type: ignore[arg-type]


def test_backoff_classifier_passes_rivers_generic_checks() -> None:
    # the dataset-driven checks need scikit-learn; these are the ones on the estimator itself
    model = BackoffClassifier(order=2)
    for check in (
        checks.common.check_repr,
        checks.common.check_str,
        checks.common.check_tags,
        checks.common.check_clone_same_class,
        checks.common.check_clone_is_idempotent,
        checks.common.check_init_has_default_params_for_tests,
        checks.common.check_init_default_params_are_not_mutable,
        checks.common.check_doc,
        checks.common.check_clone_changes_memory_addresses,
        checks.common.check_pickling_supports_roundtrip,
        checks.common.check_get_params_matches_signature,
    ):
        check(model)  # type: ignore[no-untyped-call]


# ---- learning ----------------------------------------------------------------------------------


def test_learns_a_deterministic_cycle_within_a_few_workflows() -> None:
    predictor = Predictor(k=3)
    run(predictor, [plain("ABCD")] * 5)
    hits, checked = list(predictor.tracker.hits), list(predictor.tracker.checked)
    run(predictor, [plain("ABCD")] * 10)
    for step in range(3):
        late = predictor.tracker.hits[step] - hits[step]
        late_checked = predictor.tracker.checked[step] - checked[step]
        assert late_checked >= 10
        assert late == late_checked, f"step {step + 1}: {late}/{late_checked} right"
    predictor.observe_call("x", "t", "A", {}, 0.0)
    forecast = predictor.predict("x")
    assert [forecast.top(s) for s in (1, 2, 3)] == ["B", "C", "D"]
    assert forecast.agents[0]["B"] > 0.9
    predictor.observe_call("x", "t", "B", {}, 1.0)
    predictor.observe_call("x", "t", "C", {}, 2.0)
    assert [predictor.predict("x").top(s) for s in (1, 2, 3)] == ["D", END, END]
    assert predictor.predict_next_for_new("t").top(1) == "A"


def test_backoff_answers_unseen_contexts_from_shorter_ones() -> None:
    model = BackoffClassifier(order=3)
    for _ in range(10):
        model.learn_one({"type": "t", "h1": "B", "h2": "A", "h3": START}, "C")
    # a longer context never seen: the (t, B) level answers
    assert model.predict_one({"type": "t", "h1": "B", "h2": "Z", "h3": "Y"}) == "C"
    # a type never seen: what all types share after B
    assert model.predict_one({"type": "other", "h1": "B"}) == "C"
    # an agent never seen as context: the type's unigram
    assert model.predict_one({"type": "t", "h1": "nobody"}) == "C"
    assert model.predict_proba_one({}) == {"C": 1.0}
    assert BackoffClassifier().predict_proba_one({"type": "t", "h1": "A"}) == {}


def test_backoff_memory_is_bounded_when_every_workflow_names_new_agents() -> None:
    model = BackoffClassifier(order=2, max_contexts=500)
    for n in range(2000):  # group-chat style: agents named per task
        model.learn({"type": "chat", "h1": f"expert{n}", "h2": START}, "Verifier")
        model.learn({"type": "chat", "h1": "Verifier", "h2": f"expert{n}"}, END)
    assert model.n_contexts <= 500
    # what recurs survives the pruning
    assert model.distribution({"type": "chat", "h1": "expert-new"})["Verifier"] > 0.4


def per_task(n: int) -> list[Step]:
    """A group chat whose experts are named per task: the task's expert, its verifier, the
    expert again, then the verifier twice."""
    expert, verifier = f"Expert{n}", f"Verifier{n % 3}"
    return plain_names([expert, verifier, expert, verifier, verifier])


def plain_names(agents: Sequence[str]) -> list[Step]:
    return [(a, {}) for a in agents]


def test_a_type_that_names_its_agents_per_workflow_is_modelled_over_aliases() -> None:
    aliased, by_name = Predictor(k=3), Predictor(k=3, alias_share=None)
    for predictor in (aliased, by_name):
        run(predictor, [per_task(n) for n in range(40)], kind="chat")
        run(predictor, [plain("ABCD")] * 40, kind="fixed")  # names that recur: not aliased
    assert aliased.stats()["aliased_types"] == ["chat"]
    assert by_name.stats()["aliased_types"] == []
    # the chat's shape is learnt: after expert, verifier the expert comes back, then the
    # verifier twice - named by the names this chat gave them
    aliased.observe_call("new", "chat", "Expert99", {}, 0.0)
    aliased.observe_call("new", "chat", "Verifier7", {}, 1.0)
    forecast = aliased.predict("new")
    check_forecast(forecast, 3, aliased=True)
    assert [forecast.top(s) for s in (1, 2, 3)] == ["Expert99", "Verifier7", "Verifier7"]
    # before the verifier has spoken, its name is unknown: its mass is left out
    aliased.observe_call("newer", "chat", "Expert100", {}, 0.0)
    first = aliased.predict("newer")
    check_forecast(first, 3, aliased=True)
    assert set(first.agents[0]) <= {"Expert100"} and first.agents[0].get("Expert100", 0) < 0.5
    check_forecast(aliased.predict_next_for_new("chat"), 3, aliased=True)
    assert aliased.predict_next_for_new("chat").agents[0] == {}
    # the recurring type stays by name (what all types share differs a little: not the tops)
    for predictor in (aliased, by_name):
        predictor.observe_call("f", "fixed", "A", {}, 0.0)
    tops = [[p.predict("f").top(s) for s in (1, 2, 3)] for p in (aliased, by_name)]
    assert tops == [["B", "C", "D"]] * 2
    # and by name the chat is not learnt: the verifier's name was never seen before
    by_name.observe_call("new", "chat", "Expert99", {}, 0.0)
    by_name.observe_call("new", "chat", "Verifier7", {}, 1.0)
    assert by_name.predict("new").top(2) != "Verifier7"


@settings(max_examples=20, deadline=None)
@given(
    chats=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=20, max_size=30)
)
def test_an_aliased_forecast_names_only_agents_its_workflow_called(
    chats: list[list[int]],
) -> None:
    predictor = Predictor(k=3, alias_after=4, alias_window=8)
    for n, speakers in enumerate(chats):
        wid, called = f"c{n}", set()
        for i, speaker in enumerate(speakers):
            agent = f"expert{n}-{speaker}"  # every chat names its own experts
            predictor.observe_call(wid, "chat", agent, {}, float(i))
            called.add(agent)
            forecast = predictor.predict(wid)
            check_forecast(forecast, 3, aliased=True)
            if predictor._workflows[wid].named is not None:  # (started once aliased)
                assert all(set(step) <= called for step in forecast.agents)
        predictor.observe_finished(wid)
    assert predictor.stats()["aliased_types"] == ["chat"]


def test_a_type_whose_names_start_to_recur_goes_back_to_names() -> None:
    predictor = Predictor(k=2, alias_window=32, alias_after=16)
    run(predictor, [per_task(n) for n in range(20)], kind="chat")
    assert predictor.stats()["aliased_types"] == ["chat"]
    # the same four experts from now on: after the window has seen few new names, by name
    run(predictor, [plain("ABCB")] * 40, kind="chat")
    assert predictor.stats()["aliased_types"] == []
    predictor.observe_call("again", "chat", "A", {}, 0.0)
    assert [predictor.predict("again").top(s) for s in (1, 2)] == ["B", "C"]


def test_aliasing_is_scored_on_names_and_survives_a_checkpoint() -> None:
    predictor = Predictor(k=2)
    run(predictor, [per_task(n) for n in range(30)], kind="chat")
    stats = predictor.stats()
    assert stats["aliased_types"] == ["chat"] and stats["agents"] < 10  # aliases, not names
    predictor.observe_call("open", "chat", "ExpertX", {}, 0.0)
    predictor.observe_call("open", "chat", "Verifier1", {}, 1.0)
    restored = pickle.loads(pickle.dumps(predictor))
    assert restored.predict("open") == predictor.predict("open")
    # a checkpoint from before aliasing existed: restored by name, switching later as it learns
    legacy = pickle.loads(pickle.dumps(predictor))
    for model in legacy._types.values():
        for slot in ("aliased", "names", "novel"):
            delattr(model, slot)
    for workflow in legacy._workflows.values():
        for slot in ("aliases", "named", "novel"):
            delattr(workflow, slot)
    legacy = pickle.loads(pickle.dumps(legacy))
    check_forecast(legacy.predict("open"), 2)
    run(legacy, [per_task(n) for n in range(100, 130)], kind="chat")
    assert legacy.stats()["aliased_types"] == ["chat"]
    # scoring is on names: a chat whose verifier is new is a miss at step 1, not an alias hit
    before = predictor.tracker.checked[0], predictor.tracker.hits[0]
    predictor.observe_call("miss", "chat", "ExpertY", {}, 0.0)
    predictor.predict("miss")
    predictor.observe_call("miss", "chat", "VerifierNew", {}, 1.0)
    assert predictor.tracker.checked[0] == before[0] + 1
    assert predictor.tracker.hits[0] == before[1]


def test_new_agents_and_workflow_types_mid_stream() -> None:
    predictor = Predictor(k=2)
    run(predictor, [plain("ABC")] * 30)
    # a new agent D appears between A and B and stays
    run(predictor, [plain("ADBC")] * 40)
    predictor.observe_call("x", "t", "A", {}, 0.0)
    assert predictor.predict("x").top(1) == "D"
    assert predictor.predict("x").top(2) == "B"
    # a new type, never seen: predicted from what all types share, then learnt on its own
    unseen = predictor.predict_next_for_new("fresh")
    check_forecast(unseen, 2)
    run(predictor, [plain("XYZ")] * 10, kind="fresh")
    assert predictor.predict_next_for_new("fresh").top(1) == "X"
    predictor.observe_call("y", "fresh", "X", {}, 0.0)
    assert [predictor.predict("y").top(s) for s in (1, 2)] == ["Y", "Z"]
    assert predictor.stats()["types"] == 2


def test_a_hint_that_decides_the_branch_is_learnt() -> None:
    rng = random.Random(7)
    workflows: list[list[Step]] = []
    for _ in range(150):
        x = rng.randint(0, 1)
        branch = "B" if x else "C"
        workflows.append([("A", {"x": x, "size": rng.random()}), (branch, {}), ("D", {})])
    predictor = Predictor(k=2)
    run(predictor, workflows)
    for x, branch, other in ((1, "B", "C"), (0, "C", "B")):
        predictor.observe_call(f"probe{x}", "t", "A", {"x": x, "size": 0.5}, 0.0)
        forecast = predictor.predict(f"probe{x}")
        assert forecast.top(1) == branch
        assert forecast.agents[0][branch] > 0.8
        assert forecast.agents[0].get(other, 0.0) < 0.2
        assert forecast.top(2) == "D"
    # the count model alone cannot tell: after A it has seen B and C about as often
    markov = predictor.markov.predict_proba_one({"type": "t", "h1": "A", "h2": START})
    assert abs(markov["B"] - markov["C"]) < 0.3
    assert predictor.stats()["expert_weights"]["t"]["context"] > 0.5


def test_retries_so_far_move_the_forecast() -> None:
    """Scenario: a tester sends work back to the coder until the second attempt, always; the
    hints carry nothing, so only the per-agent call counts tell the attempts apart."""
    predictor = Predictor(k=3)
    run(predictor, [plain("PCTCTCTR")] * 60)
    predictor.observe_call("x", "t", "P", {}, 0.0)
    expected = [*"CTCTCTR", END]
    for i, agent in enumerate("CTCTCTR"):
        predictor.observe_call("x", "t", agent, {}, float(i + 1))
        forecast = predictor.predict("x")
        assert [forecast.top(s) for s in (1, 2, 3)] == (expected[i + 1 :] + [END] * 3)[:3]


# ---- what a forecast is ------------------------------------------------------------------------


def test_forecasts_are_distributions_and_alive_never_increases() -> None:
    predictor = Predictor(k=4)
    workload = fact_checking(seed=1, workflows=40)
    for call, pos, ended in interleave(workload, 8):
        if ended:
            check_forecast(predictor.predict(call.workflow_id), 4)
            predictor.observe_finished(call.workflow_id)
            continue
        if pos:
            check_forecast(predictor.predict(call.workflow_id), 4)
        predictor.observe_call(call.workflow_id, call.workflow_type, call.agent, call.hints, 0.0)
    # late in the stream, after a summarizer the workflow ends, and stays ended
    predictor.observe_call("x", "fact-checking", "planner", {"hops": 2}, 0.0)
    predictor.observe_call("x", "fact-checking", "summarizer", {"hops": 2}, 1.0)
    forecast = predictor.predict("x")
    assert forecast.alive[0] < 0.2
    assert forecast.alive == sorted(forecast.alive, reverse=True)


@settings(max_examples=40, deadline=None)
@given(
    streams=st.lists(
        st.lists(st.sampled_from("ABCDE"), min_size=1, max_size=8), min_size=1, max_size=12
    ),
    hint=st.one_of(st.none(), st.integers(-5, 5), st.floats(allow_nan=False), st.text(max_size=3)),
    k=st.integers(1, 4),
)
def test_forecast_invariants_on_any_stream(
    streams: list[list[str]], hint: HintValue, k: int
) -> None:
    predictor = Predictor(k=k, seed=3)
    for n, agents in enumerate(streams):
        wid = f"w{n}"
        check_forecast(predictor.predict_next_for_new("t", {"h": hint}), k)
        for i, agent in enumerate(agents):
            predictor.observe_call(wid, "t", agent, {"h": hint, "i": i}, float(i))
            check_forecast(predictor.predict(wid), k)
        predictor.observe_finished(wid)
    assert predictor.stats()["active"] == 0


def test_forecast_accessors() -> None:
    f = Forecast(agents=[{"a": 0.6, "b": 0.4}, {}], alive=[0.5, 0.0])
    assert f.prob("a", 1) == pytest.approx(0.3)
    assert f.prob(END, 1) == pytest.approx(0.5)
    assert f.top(1) == END  # P(end) = 0.5 beats P(a) = 0.3
    assert f.top(2) == END


# ---- noise, drift, cost ------------------------------------------------------------------------


def test_full_noise_gives_chance_accuracy() -> None:
    agents = "ABCDEFG"  # 7 agents and END: chance is 1/8
    clean, noisy = Predictor(k=2, noise=0.0), Predictor(k=2, noise=1.0, seed=5)
    for predictor in (clean, noisy):
        run(predictor, [plain(agents)] * 60)
    assert clean.stats()["accuracy"][0] > 0.95
    assert 0.07 < noisy.stats()["accuracy"][0] < 0.2
    # the models behind the noise learnt all the same
    assert noisy.markov.predict_one({"type": "t", "h1": "C", "h2": "B"}) == "D"
    # seeded: the same noise twice
    again = Predictor(k=2, noise=1.0, seed=5)
    run(again, [plain(agents)] * 60)
    assert again.stats()["accuracy"] == noisy.stats()["accuracy"]


def test_drift_is_detected_and_accuracy_recovers() -> None:
    """Scenario: 200 workflows P->A->B->C, then the order of A and B flips for good."""
    before, after = plain("PABC"), plain("PBAC")
    predictor = Predictor(k=1, window=100)
    run(predictor, [before] * 200)
    assert predictor.stats()["drifts"] == {}
    run(predictor, [after] * 60)
    assert predictor.stats()["drifts"].get("t", 0) >= 1
    assert predictor.stats()["rolling_accuracy"][0] > 0.95
    # the reaction: the type's counts were decayed, so the count model itself follows the new
    # order; without forgetting, 200 old workflows still outvote 60 new ones there
    after_p: dict[Hashable, Any] = {"type": "t", "h1": "P", "h2": START}
    assert predictor.markov.predict_one(after_p) == "B"
    stubborn = Predictor(k=1, window=100, drift_decay=1.0, max_count=1e9)
    run(stubborn, [before] * 200)
    run(stubborn, [after] * 60)
    assert stubborn.markov.predict_one(after_p) == "A"


def test_a_fan_outs_arrival_order_is_no_drift() -> None:
    """The financial crew's three analysts start in the order their filing lookups finish: at
    those positions the next agent is a coin flip, the same in every workflow. The forecast
    says it is unsure there, so the drift detector, which watches the error beyond what the
    forecast expected, sees no change (watching the plain error it fired 4 times in these 100
    stationary workflows, each time forgetting what was learnt)."""
    predictor = Predictor()
    for call, pos, ended in interleave(financial(seed=3, workflows=100), 16):
        if ended:
            predictor.observe_finished(call.workflow_id)
            continue
        if pos:
            predictor.predict(call.workflow_id)
        predictor.observe_call(call.workflow_id, call.workflow_type, call.agent, call.hints, 0.0)
    stats = predictor.stats()
    assert stats["drifts"] == {}
    assert stats["accuracy"][0] > 0.74  # (0.719 while it forgot)


def test_the_branching_floor_drops_unlikely_continuations_from_later_steps() -> None:
    """``min_branch``: a step-1 branch less likely than the floor is not rolled out, so what
    only it leads to is missing from step 2; above the floor it is there, with its mass. (Step
    1 differs in the last digits only: the roll-outs refresh cached count views at other
    times.)"""

    def trained(min_branch: float) -> Predictor:
        predictor = Predictor(k=2, min_branch=min_branch)
        for w in range(200):  # start -> a, then b 85% / c 15%; b -> x, c -> y
            rare = w % 20 < 3
            for ts, agent in enumerate(["a", "c" if rare else "b", "y" if rare else "x"]):
                predictor.observe_call(f"w{w}", "t", agent, {}, float(ts))
            predictor.observe_finished(f"w{w}")
        predictor.observe_call("new", "t", "a", {}, 0.0)
        return predictor

    low, high = trained(0.05).predict("new"), trained(0.2).predict("new")
    assert 0.05 < low.agents[0]["c"] < 0.2
    assert high.agents[0] == pytest.approx(low.agents[0], abs=1e-3)
    assert low.agents[1].get("y", 0.0) > 0.05
    assert high.agents[1].get("y", 0.0) < 0.01 and high.agents[1]["x"] > 0.95


def test_work_per_forecast_is_bounded_by_the_beam() -> None:
    """Count-based cost: every forecast evaluates the one-step model at most 1 + beam * (k - 1)
    times, however long the stream; the per-type cache and the active set stay bounded."""
    predictor = Predictor(k=3, beam=2, max_cache=50, max_workflows=20)
    bound = 1 + 2 * (3 - 1)
    most = 0
    for call, pos, ended in interleave(code_writing(seed=2, workflows=120), 16):
        if ended:
            predictor.observe_finished(call.workflow_id)
            continue
        if pos:
            before = predictor.stats()["evaluations"]
            predictor.predict(call.workflow_id)
            most = max(most, predictor.stats()["evaluations"] - before)
            # a second ask is answered from the cache
            evaluations = predictor.stats()["evaluations"]
            predictor.predict(call.workflow_id)
            assert predictor.stats()["evaluations"] == evaluations
        predictor.observe_call(call.workflow_id, call.workflow_type, call.agent, call.hints, 0.0)
    assert 1 < most <= bound
    assert len(predictor._types.model("code-writing").structures) <= 50
    for i in range(30):  # more active workflows than remembered: the oldest are forgotten
        predictor.observe_call(f"extra{i}", "code-writing", "planner", {}, 0.0)
    assert predictor.stats()["active"] <= 20


def test_views_count_the_count_model_views_computed() -> None:
    """``views`` counts the evaluations that computed the count experts' view anew (what a
    call's cost grows with): never more than the evaluations, fewer where views are reused
    longer (a larger ``refresh``), none for a forecast already served."""
    events = list(interleave(code_writing(seed=3, workflows=80), 16))
    counted = {}
    for refresh in (16, 64):
        predictor = Predictor(k=3, refresh=refresh)
        for call, pos, ended in events:
            if pos:
                predictor.predict(call.workflow_id)
                views = predictor.stats()["views"]
                predictor.predict(call.workflow_id)  # answered from the cache
                assert predictor.stats()["views"] == views
            if ended:
                predictor.observe_finished(call.workflow_id)
            else:
                args = (call.workflow_type, call.agent, call.hints, float(pos))
                predictor.observe_call(call.workflow_id, *args)
        stats = predictor.stats()
        assert 0 < stats["views"] < stats["evaluations"]
        assert stats["views_per_evaluation"] == stats["views"] / stats["evaluations"]
        counted[refresh] = stats["views"]
    assert counted[64] < counted[16]


def _replay_side_by_side(
    a: Predictor,
    b: Predictor,
    events: Sequence[tuple[Any, int, bool]],
    before_each: Callable[[Predictor], None] = lambda _: None,
) -> None:
    """Feed ``events`` to both predictors (``before_each`` runs on ``b`` before every event);
    every forecast and the accuracy must be the same."""
    for call, pos, ended in events:
        before_each(b)
        for predictor in (a, b):
            if pos:
                predictor.predict(call.workflow_id)
            if ended:
                predictor.observe_finished(call.workflow_id)
            else:
                args = (call.workflow_type, call.agent, call.hints, float(pos))
                predictor.observe_call(call.workflow_id, *args)
        if pos and not ended:
            assert a.predict(call.workflow_id) == b.predict(call.workflow_id)
    assert a.stats()["accuracy"] == b.stats()["accuracy"]


def test_the_path_cache_changes_no_forecast() -> None:
    """Caching the context model's relative features and dot products per path (recomputed
    when its weights change) is an optimisation only: every forecast and the learnt state are
    those of a predictor that caches nothing."""
    cached, uncached = Predictor(k=3), Predictor(k=3, max_paths=0)
    events = list(interleave(fact_checking(seed=4, workflows=60), 8))
    _replay_side_by_side(cached, uncached, events)
    assert cached._types.model("fact-checking").context.version > 100  # the weights did change


def test_the_name_and_feature_caches_change_no_forecast() -> None:
    """The crossed hint names (per candidate and set of hint names) and the path features (per
    candidate, calls and run) are built once and reused: a predictor whose caches are emptied
    before every call forecasts and learns exactly as one that keeps them."""
    kept, emptied = Predictor(k=3), Predictor(k=3)
    events = list(interleave(code_writing(seed=6, workflows=50), 8))
    events += list(interleave(fact_checking(seed=6, workflows=50), 8))

    def empty_caches(predictor: Predictor) -> None:
        predictor._one_step.path._parts.clear()
        for model in predictor._types.values():
            model.context._crossed.clear()

    _replay_side_by_side(kept, emptied, events, before_each=empty_caches)
    assert kept._one_step.path._parts and all(m.context._crossed for m in kept._types.values())
    # a refreshed position reuses its context keys: they are the ones its contexts give
    for model in kept._types.values():
        for structure in model.structures.values():
            assert kept.markov.context_keys(structure.markov_x) == structure.markov_keys
            assert kept.copy.context_keys(structure.copy_x) == structure.copy_keys


def test_crossed_features_name_every_hint_with_a_value() -> None:
    model = context.ContextModel()
    hints = model.hint_features({"a": 2.0, "b": 0.0}, {"repo=x": 1.0})
    model.learn_hints({"a": 1.0, "b": 0.0})
    model.learn_hints({"a": 3.0, "b": 0.0})
    hints = model.hint_features({"a": 3.0, "b": 0.0}, {"repo=x": 1.0})
    expected = {"C|bias": 1.0, **{f"C|{f}": v for f, v in hints.items() if v}}
    assert model.crossed("C", hints) == expected
    assert "C|b" not in expected and "C|repo=x" in expected  # zeros add nothing
    assert model.crossed("C", hints) == expected  # the second time from the names cache
    assert model.crossed_names("D", ("a",)) == ("D|bias", "D|a")
    legacy = pickle.loads(pickle.dumps(model))
    del legacy._crossed  # a model pickled before the cache existed
    restored = pickle.loads(pickle.dumps(legacy))
    assert restored.crossed("C", hints) == expected


def test_the_rolling_accuracy_reads_as_one_updated_at_every_check() -> None:
    """The tracker feeds its River rolling metrics when they are read; read at any point, they
    give what metrics updated at every check give, window overflows included."""

    def value(metric: utils.Rolling[metrics.Accuracy]) -> float:
        return float(metric.obj.get())  # type: ignore[no-untyped-call]

    rng = random.Random(11)
    window = 20
    tracker = tracking.Tracker(k=2, window=window)
    eager = [utils.Rolling(metrics.Accuracy, window_size=window) for _ in range(2)]
    reads = 0
    for n in range(400):
        step = rng.choice((1, 2))
        guess = rng.choice("ab")
        forecast = Forecast(agents=[{guess: 1.0}, {guess: 1.0}], alive=[1.0, 1.0])
        label = rng.choice("abc")
        tracker.check("t", forecast, step, label)
        eager[step - 1].update(label, guess)
        if rng.random() < 0.1 or n in (5, 399):  # reads now and then: short and long gaps
            reads += 1
            for s in (1, 2):
                assert tracker.accuracy(s, rolling=True) == value(eager[s - 1])
    assert reads > 10
    # the daemon's resize copies the metrics over: the copy goes on from them
    fresh = tracking.Tracker(k=2, window=window)
    fresh.rolling[:1] = tracker.rolling[:1]
    forecast = Forecast(agents=[{"a": 1.0}, {"a": 1.0}], alive=[1.0, 1.0])
    fresh.check("t", forecast, 1, "a")
    eager[0].update("a", "a")
    assert fresh.accuracy(1, rolling=True) == value(eager[0])
    # a tracker pickled when its metrics were updated at every check
    state = dict(tracker.__dict__)
    state["rolling"] = state.pop("_rolling")
    for name in ("_window", "_unread"):
        del state[name]
    legacy = tracking.Tracker.__new__(tracking.Tracker)
    legacy.__setstate__(state)
    assert legacy.accuracy(2, rolling=True) == tracker.accuracy(2, rolling=True)
    legacy.check("t", forecast, 2, "b")
    eager[1].update("b", "a")
    assert legacy.accuracy(2, rolling=True) == value(eager[1])


def test_a_restored_checkpoint_forecasts_as_the_original() -> None:
    """A pickled predictor (the daemon's checkpoint) goes on forecasting and learning exactly as
    the one that kept running; one pickled before the weight versions existed drops its caches
    and still forecasts."""
    events = list(interleave(code_writing(seed=5, workflows=80), 8))
    original = Predictor(k=3)

    def feed(predictor: Predictor, part: list[tuple[Call, int, bool]]) -> list[Forecast]:
        out = []
        for call, pos, ended in part:
            if pos:
                out.append(predictor.predict(call.workflow_id))
            if ended:
                predictor.observe_finished(call.workflow_id)
            else:
                args = (call.workflow_type, call.agent, call.hints, float(pos))
                predictor.observe_call(call.workflow_id, *args)
        return out

    feed(original, events[:300])
    checkpoint = pickle.dumps(original)
    restored = pickle.loads(checkpoint)
    assert restored.active() == original.active()
    assert feed(restored, events[300:]) == feed(original, events[300:])
    assert restored.stats()["accuracy"] == original.stats()["accuracy"]

    legacy = pickle.loads(checkpoint)
    for model in legacy._types.values():
        del model.context.version
    legacy = pickle.loads(pickle.dumps(legacy))
    for forecast in feed(legacy, events[300:400]):
        check_forecast(forecast, 3)


def test_invalid_use_is_refused() -> None:
    predictor = Predictor()
    with pytest.raises(KeyError, match="not active"):
        predictor.predict("nobody")
    with pytest.raises(ValueError, match="reserved"):
        predictor.observe_call("w", "t", END, {}, 0.0)
    with pytest.raises(ValueError, match="noise"):
        Predictor(noise=1.5)
    with pytest.raises(ValueError, match="min_branch"):
        Predictor(min_branch=-0.1)
    with pytest.raises(ValueError, match="alias_share"):
        Predictor(alias_share=0.0)
    with pytest.raises(ValueError, match="alias_after"):
        Predictor(alias_after=100, alias_window=64)
    predictor.observe_finished("never started")  # ignored
    predictor.forget("never started")
    assert predictor.stats()["finished"] == 0


# ---- the evaluation ------------------------------------------------------------------------------


def test_markov_baseline_rolls_forward() -> None:
    baseline = MarkovBaseline(k=3)
    for agents in ("ABC", "ABC", "ABD"):
        last = START
        for agent in [*agents, END]:
            baseline.learn("t", last, agent)
            last = agent
    assert baseline.predict("t", "A") == ["B", "C", END]
    assert baseline.predict("t", "unknown") == ["A", "B", "C"]  # the type's most frequent


def test_interleave_round_robins_and_ends_each_stream_once() -> None:
    def call(w: str, a: str) -> Call:
        return Call(workflow_id=w, agent=a, block_hashes=(), prompt_tokens=0)

    streams = [[call("w1", "a"), call("w1", "b")], [call("w2", "c")], [call("w3", "d")]]
    events = [
        (c.workflow_id, pos, ended) for c, pos, ended in interleave(Workload("x", streams), 2)
    ]
    assert events == [
        ("w1", 0, False),
        ("w2", 0, False),
        ("w2", 1, True),
        ("w1", 1, False),
        ("w1", 2, True),
        ("w3", 0, False),
        ("w3", 1, True),
    ]


def test_interleave_gives_a_fan_outs_calls_in_the_order_they_start() -> None:
    """A step's calls start ``gap_s`` after it is issued (as the simulator issues them), so the
    predictor meets a fan-out in the order of the tool times, not the generator's."""

    def call(agent: str, gap_s: float, parallel: bool) -> Call:
        return Call("w", agent, (), 0, gap_s=gap_s, parallel=parallel)

    stream = [
        call("plan", 0.0, False),
        call("a", 0.7, False),
        call("b", 0.1, True),
        call("c", 0.4, True),
        call("end", 0.0, False),
    ]
    order = [(c.agent, pos) for c, pos, ended in interleave(Workload("x", [stream]), 1)]
    assert order == [("plan", 0), ("b", 1), ("c", 2), ("a", 3), ("end", 4), ("end", 5)]


def test_prequential_evaluation_beats_markov_on_fact_checking() -> None:
    result = evaluate(fact_checking(seed=0, workflows=150), Predictor(k=3), concurrency=16)
    assert result.ours.all.checked[0] == result.markov.all.checked[0] > 1000
    for step in (1, 2, 3):
        assert result.ours.all.accuracy(step) >= result.markov.all.accuracy(step) - 0.01
    assert result.ours.all.accuracy(1) > 0.85


@pytest.mark.skipif(
    WHOWHEN is None or not WHOWHEN.is_dir(), reason="Who&When traces not here ($AGENTKV_TRACES)"
)
def test_real_whowhen_chats() -> None:
    assert WHOWHEN is not None
    workload = whowhen_workload(WHOWHEN, limit=60)
    result = evaluate(workload, Predictor(k=3), concurrency=16)
    assert result.ours.all.checked[0] > 200
    # group chats name their experts per task: the copy expert is what beats first-order counts
    assert result.ours.all.accuracy(1) > result.markov.all.accuracy(1)
    # and aliases (the chat's first speaker, second, ...) learn the shape the names hide
    by_name = evaluate(workload, Predictor(k=3, alias_share=None), concurrency=16)
    for step in (1, 2, 3):
        assert result.ours.late.accuracy(step) > by_name.ours.late.accuracy(step)


def test_eval_command_prints_a_table_and_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workloads", "financial,fact-checking", "--workflows", "20", "--concurrency", "4"]
    assert predictor_eval.main(argv) == 0
    out = capsys.readouterr().out
    assert "financial" in out and "fact-checking" in out and "Markov @3" in out
    assert "policyd eval-predictor --workloads financial,fact-checking" in out


def test_eval_cost_table_reports_a_ratio_to_the_reference_loop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--workloads", "financial", "--workflows", "30", "--concurrency", "4", "--cost"]
    assert predictor_eval.main(argv) == 0
    out = capsys.readouterr().out
    assert "Predictor cost per call" in out and "x ref (IQR)" in out and "views anew" in out
    result = evaluate(code_writing(seed=1, workflows=40), Predictor(k=3), concurrency=8)
    assert len(result.cost_us) == result.calls + result.workflows
    assert len(result.ratios) == len(result.cost_us) // predictor_eval.COST_CHUNK
    assert result.ratio() > 0 and result.quiet_us() > 0
    assert result.predict_us > 0 and result.learn_us > 0
    assert 0 < result.views_per_evaluation < 1


def test_eval_runs_predictor_variants_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workloads", "financial", "--workflows", "20", "--concurrency", "4"]
    assert predictor_eval.main([*argv, "--refresh", "16,64", "--beam", "1"]) == 0
    out = capsys.readouterr().out
    assert "financial beam=1 refresh=16" in out and "financial beam=1 refresh=64" in out
    assert predictor_eval.main([*argv, "--alias-share", "0.5,0"]) == 0
    out = capsys.readouterr().out
    assert "financial alias_share=0.5" in out and "financial alias_share=never" in out
    assert predictor_eval.main([*argv, "--min-branch", "0.05,0.3"]) == 0
    out = capsys.readouterr().out
    assert "financial min_branch=0.05" in out and "financial min_branch=0.3" in out
    with pytest.raises(SystemExit):
        predictor_eval.main([*argv, "--min-branch", "1.5"])
    assert "fractions in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        predictor_eval.main([*argv, "--refresh", "sixteen"])
    assert "expected comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        predictor_eval.main([*argv, "--beam", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="fact-checking"):
        predictor_eval.load("nope", 1, 0, WHOWHEN)


def test_eval_runs_group_chats_of_several_agent_counts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workloads", "group-chat", "--agents", "3,8", "--workflows", "6", "--cost"]
    assert predictor_eval.main(argv) == 0
    out = capsys.readouterr().out
    assert "group-chat agents=3" in out and "group-chat agents=8" in out
    workload = predictor_eval.load("group-chat", 4, 0, None, agents=8)
    assert len({call.agent for stream in workload.streams for call in stream}) <= 8
    with pytest.raises(ValueError, match="at least 2 agents"):
        predictor_eval.load("group-chat", 4, 0, None, agents=1)
