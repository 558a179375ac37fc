"""Fleet learning without the network: what a replica learnt, as deltas, merged into another
replica's models (policyd.fleet.deltas) - counts that add, nothing echoed back, each delta
applied once - and the cold-replica evaluation command."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from experiments import fleet_learning
from policyd.fleet.deltas import (
    FleetLearning,
    FleetOutbox,
    FleetState,
    LearningDelta,
    OriginLedger,
    decode,
)
from policyd.models.predictor import Predictor
from policyd.models.shards import Shards
from policyd.workloads.pbkv import code_writing


def serve(predictor: Predictor, workflows: range, agents: tuple[str, ...]) -> None:
    for w in workflows:
        for ts, agent in enumerate(agents):
            predictor.observe_call(f"w{w}", "code", agent, {}, float(ts))
        predictor.observe_finished(f"w{w}")


def sealed(outbox: FleetOutbox, learning: FleetLearning) -> list[LearningDelta]:
    outbox.seal(learning)
    deltas = [decode(payload) for _, payload in outbox.sealed]
    outbox.sealed.clear()
    return deltas


def test_merged_counts_equal_learnt_counts() -> None:
    """A replica that merged another's deltas holds the same count-expert distributions as
    one that learnt the same transitions itself (the counts add; max_count not reached)."""
    agents = ("planner", "coder", "tester", "coder", "tester")
    source, twin, cold = Predictor(), Predictor(), Predictor()
    learning = FleetLearning(source, lambda: Shards(rate=1.0))
    serve(source, range(40), agents)
    serve(twin, range(40), agents)
    merger = FleetLearning(cold, lambda: Shards(rate=1.0))
    for delta in sealed(FleetOutbox("a", "i"), learning):
        merger.merge(delta)
    for history in ([], ["planner"], ["coder", "planner"], ["tester", "coder", "planner"]):
        x = {"type": "code", **{f"h{i + 1}": h for i, h in enumerate(history)}}
        assert cold.markov.distribution(x) == pytest.approx(twin.markov.distribution(x))
    cold.observe_call("new", "code", "planner", {}, 0.0)
    assert cold.predict("new").top(1) == "coder"
    assert cold.predict_next_for_new("code").top(1) == "planner"


def test_merged_learning_is_not_published_again() -> None:
    """What a replica merged never shows up in its own deltas (no echo through the fleet)."""
    a, b = Predictor(), Predictor()
    shards_a, shards_b = Shards(rate=1.0), Shards(rate=1.0)
    learn_a = FleetLearning(a, lambda: shards_a)
    learn_b = FleetLearning(b, lambda: shards_b)
    serve(a, range(10), ("planner", "coder"))
    shards_a.learn_prompt([1, 2, 3], 48)
    shards_a.learn_prompt([1, 2, 3, 4], 64)
    for delta in sealed(FleetOutbox("a", "i"), learn_a):
        learn_b.merge(delta)
    assert b.markov.n_contexts > 0 and shards_b.references == 7
    assert learn_b.take() == ([], None)
    shards_b.learn_prompt([9], 16)  # b's own learning only
    transitions, histogram = learn_b.take()
    assert transitions == [] and histogram is not None
    assert histogram.references == 1 and histogram.prompts == 1


def test_histogram_deltas_add_up() -> None:
    """The merged histogram is the sum of both replicas' histograms, counters included."""
    a, b = Shards(rate=1.0), Shards(rate=1.0)
    learn_a = FleetLearning(Predictor(), lambda: a)
    learn_b = FleetLearning(Predictor(), lambda: b)
    for i in range(30):
        a.learn_prompt([1, 2, 3, 100 + i], 64)
        b.learn_prompt([5, 6, 200 + i % 3], 48)
    expected = dict(b.histogram.weights)
    for index, weight in a.histogram.weights.items():
        expected[index] = expected.get(index, 0.0) + weight
    cold, refs = a.histogram.cold + b.histogram.cold, a.references + b.references
    for delta in sealed(FleetOutbox("a", "i"), learn_a):
        learn_b.merge(delta)
    assert b.histogram.weights == pytest.approx(expected)
    assert (b.histogram.cold, b.references, b.prompts) == (cold, refs, 60)
    assert b.curve(kv_bytes_per_block=1).references == refs


def test_ledger_applies_each_delta_once_and_counts_gaps() -> None:
    ledger = OriginLedger()

    def delta(replica: str, number: int, incarnation: str = "i1") -> LearningDelta:
        return LearningDelta(
            replica=replica, incarnation=incarnation, number=number, transitions=[]
        )

    assert ledger.admit(delta("a", 0), "me")
    assert not ledger.admit(delta("a", 0), "me")  # republished after a restart: skipped
    assert ledger.admit(delta("a", 2), "me")  # number 1 never came: a gap
    assert ledger.admit(delta("a", 0, "i2"), "me")  # a new incarnation counts from 0
    assert not ledger.admit(delta("me", 0), "me")  # its own, read back
    assert (ledger.applied, ledger.duplicates, ledger.gaps, ledger.own) == (3, 1, 1, 1)


def test_outbox_keeps_sealed_deltas_until_acknowledged_and_survives_a_checkpoint() -> None:
    predictor, shards = Predictor(), Shards(rate=1.0)
    learning = FleetLearning(predictor, lambda: shards)
    outbox = FleetOutbox("a", "i1")
    serve(predictor, range(3), ("planner", "coder"))
    assert outbox.seal(learning) == 1
    assert outbox.seal(learning) == 1  # nothing new: nothing sealed
    serve(predictor, range(3, 5), ("planner", "coder"))
    assert outbox.seal(learning) == 2
    first_id = outbox.sealed[0][0]
    outbox.acknowledged("a.i1.1")  # not the oldest: kept (published in order)
    assert len(outbox.sealed) == 2
    outbox.acknowledged(first_id)
    assert [decode(p).number for _, p in outbox.sealed] == [1]
    state = pickle.loads(pickle.dumps(FleetState(OriginLedger(), outbox, learning.baseline)))
    assert state.outbox.sealed == outbox.sealed  # republished with the same ids and bytes


def test_a_restored_predictor_journals_again() -> None:
    """A predictor pickled by an older daemon (no journal) restores and can start one."""
    predictor = Predictor()
    serve(predictor, range(3), ("planner", "coder"))
    restored = pickle.loads(pickle.dumps(predictor))
    assert restored.take_journal() == {}
    restored.start_journal()
    serve(restored, range(3, 4), ("planner", "coder"))
    assert sum(restored.take_journal().values()) == 3  # planner, coder, END


def test_eval_fleet_runs_and_the_fleet_helps_a_cold_replica(tmp_path: Path) -> None:
    """The command runs end to end; on a structured workload the merged counts lift the cold
    replica's first calls above a replica alone (seeded, so the figure is the same each run)."""
    out = tmp_path / "fleet.json"
    argv = ["--workloads", "code-writing", "--workflows", "200", "--seeds", "0",
            "--calls", "100", "--json", str(out)]  # fmt: skip
    assert fleet_learning.main(argv) == 0
    (point,) = json.loads(out.read_text())
    assert point["scored"] == 100 and point["deltas"] > 0
    assert point["accuracy"]["fleet"] > point["accuracy"]["alone"]


def test_split_gives_every_workflow_to_exactly_one_replica() -> None:
    workload = code_writing(seed=1, workflows=50)
    warm, cold = fleet_learning.split(workload, 0.6, 3)
    ids = [s[0].workflow_id for w in (*warm, cold) for s in w.streams]
    assert sorted(ids) == sorted(s[0].workflow_id for s in workload.streams)
    assert len(cold.streams) == 20
