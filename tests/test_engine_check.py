"""``policyd engine-check`` on records written here: the engine's side of each request is the
simulator's own (its hits and both tiers after each allocation), so the replay must agree with
it exactly, and a change made to one request's record must be reported at that request."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from policyd.cli import main as cli_main
from policyd.core.engine import Engine
from policyd.core.types import EventBatch, PolicySnapshot, WorkflowFinished
from policyd.policies import make_policy
from policyd.sim.engine_check import Capacities, check_run, rounds_workload, workflows_workload
from policyd.sim.replay import Simulator

CAPS = Capacities(
    block_tokens=16, gpu_blocks=12, host_blocks=8, concurrency=2,
    max_pinned_blocks=0, max_ranked_blocks=12, step_ops=12,
)  # fmt: skip


def requests() -> list[dict[str, Any]]:
    """Two workflows, two at a time, over four rounds: each call re-sends its workflow's
    transcript (a shared system prompt, then its own blocks) and adds two blocks."""
    out = []
    for rnd in range(4):
        for w in range(2):
            blocks = [1, 2] + [100 * (w + 1) + k for k in range(2 * rnd + 2)]
            out.append({
                "round": rnd, "workflow_id": f"w{w}", "agent": "a", "workflow_type": "t",
                "prompt": [0] * (16 * len(blocks) + 3), "generated": [0] * 4,
                "block_hashes": blocks, "full_block_hashes": blocks,
            })  # fmt: skip
    return out


@pytest.fixture
def run() -> dict[str, Any]:
    """A record whose engine side is the simulator's own replay of it."""
    reqs = requests()
    tiers: list[dict[str, list[int]]] = []
    sim = Simulator(
        rounds_workload(reqs, CAPS.block_tokens), make_policy("lru"), CAPS.config(1), script={}
    )
    sim.tier_log = tiers
    report = sim.run()
    for req, rec, seen in zip(reqs, report.records, tiers, strict=True):
        req["gpu_tokens"] = rec.gpu_hit_blocks * CAPS.block_tokens
        req["host_tokens"] = rec.host_hit_blocks * CAPS.block_tokens
        req.update(seen)
    assert report.host_hit_blocks > 0 and report.gpu_hit_blocks > 0  # both tiers matter here
    return {"name": "vllm-default", "policy": None, "requests": reqs, "script": {}}


def test_a_record_of_the_simulators_own_replay_agrees_request_by_request(
    run: dict[str, Any],
) -> None:
    check = check_run(run, CAPS)
    assert check.mismatches == 0 and check.first_mismatch == ""
    assert check.first_divergence == "" and check.total_gap() == 0.0


def test_tiers_that_differ_are_reported_at_the_first_request_where_they_do(
    run: dict[str, Any],
) -> None:
    changed = copy.deepcopy(run)
    at = next(i for i, r in enumerate(changed["requests"]) if r["host"])
    dropped = changed["requests"][at]["host"].pop()
    check = check_run(changed, CAPS)
    assert check.mismatches == 0  # every hit still agrees
    assert check.first_divergence_at == at
    assert f"request {at} (round" in check.first_divergence
    assert any(f"only in the simulator [{dropped}]" in line for line in check.divergence_details)


def test_a_hit_that_differs_is_reported_at_its_request(run: dict[str, Any]) -> None:
    changed = copy.deepcopy(run)
    last = len(changed["requests"]) - 1
    changed["requests"][last]["gpu_tokens"] += CAPS.block_tokens
    check = check_run(changed, CAPS)
    assert check.mismatches == 1 and check.first_mismatch_at == last
    assert check.first_divergence == ""  # the tiers themselves agree


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "No such file"),
        ("not json", "not JSON"),
        ("{}", "no list of runs"),
        ('{"runs": []}', "missing block_tokens"),
        (
            json.dumps(
                {
                    "runs": [{"name": "x", "requests": [{"round": 0}], "script": {}}],
                    **dataclasses.asdict(CAPS),
                }
            ),
            "run 0, request 0 lacks one of",
        ),
    ],
)
def test_a_file_that_is_not_a_record_gets_one_line_of_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, said: str
) -> None:
    path = tmp_path / "record.json"
    if content is not None:
        path.write_text(content)
    assert cli_main(["engine-check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("policyd engine-check: error: ") and said in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_other_policies_decide_on_the_records_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], run: dict[str, Any]
) -> None:
    """``--policies`` prints each policy's (or variant's) own decisions on the record's
    requests: the hits of the same replay run directly; an unknown policy, parameter or an
    oracle is refused in one line before any replay."""
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"runs": [run], **dataclasses.asdict(CAPS)}))
    labels = ["lru", "agentkv[guard=false]"]
    assert cli_main(["engine-check", str(path), "--policies", ",".join(labels)]) == 0
    out = capsys.readouterr().out
    workload = workflows_workload(run["requests"], CAPS.block_tokens)
    policies = (make_policy("lru"), make_policy("agentkv", guard=False))
    for label, policy in zip(labels, policies, strict=True):
        report = Simulator(workload, policy, CAPS.config(CAPS.concurrency)).run()
        gpu = report.gpu_hit_blocks * CAPS.block_tokens
        host = report.host_hit_blocks * CAPS.block_tokens
        assert f"| {label} | {gpu + host} ({gpu} + {host}) |" in out
    for bad, said in (
        ("lru,nope", "unknown policy 'nope'"),
        ("agentkv[nope=1]", "is not param=value"),
        ("belady", "offline oracle"),
    ):
        assert cli_main(["engine-check", str(path), "--policies", bad]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1


class RecordingEngine:
    """The in-process engine, keeping the workflows the simulator reported finished, in order."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.inner = Engine(make_policy("lru"), clock=clock)
        self.finished: list[str] = []

    @property
    def state(self) -> Any:
        return self.inner.state

    def apply(self, batch: EventBatch) -> object:
        self.finished += [e.workflow_id for e in batch.events if isinstance(e, WorkflowFinished)]
        return self.inner.apply(batch)

    def snapshot(self) -> PolicySnapshot:
        return self.inner.snapshot()

    def prefetch(self, budget_blocks: int) -> list[int]:
        return self.inner.prefetch(budget_blocks)


@pytest.mark.parametrize("at_last_call", [False, True])
def test_on_an_engines_rounds_a_workflow_ends_with_its_call_sent_workflow_done(
    at_last_call: bool,
) -> None:
    """One stream holds both workflows' calls (the rounds): by default a workflow ends with the
    stream; with ``workflow_ends_at_last_call`` each ends when its call marked ``last`` does."""
    reqs = requests()
    for req in reqs:  # each workflow's call in the last round is its last
        req["workflow_done"] = req["round"] == 3
    engines: list[RecordingEngine] = []

    def make(clock: Callable[[], float]) -> RecordingEngine:
        engines.append(RecordingEngine(clock))
        return engines[-1]

    sim = Simulator(
        rounds_workload(reqs, CAPS.block_tokens), make_policy("lru"), CAPS.config(1), engine=make
    )
    sim.workflow_ends_at_last_call = at_last_call
    sim.run()
    assert engines[0].finished == (["w0", "w1"] if at_last_call else ["w1"])
