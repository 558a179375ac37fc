"""``connector.bench_step`` on vLLM's real ``BlockPool``, small: it runs the connector's own
calls, and the deadline it applies is the connector's (it cuts steps; without it none is)."""

from __future__ import annotations

import pytest

from connector import bench_step

pytestmark = pytest.mark.vllm

SMALL = ["--blocks", "2000", "--steps", "300", "--named", "500", "--host-blocks", "4000"]
SMALL += ["--max-prompt-blocks", "100", "--workflows", "8", "--snapshot-every", "20"]


def _work(out: str) -> dict[str, int]:
    line = next(x for x in out.splitlines() if x.startswith("budget: "))
    pairs = (item.rsplit(" ", 1) for item in line.split("over the run: ")[1].split(", "))
    return {name: int(count) for name, count in pairs}


def test_the_deadline_cuts_steps_and_leaves_plan_work_for_later(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_step.main([*SMALL, "--step-deadline-us", "0"]) == 0
    free = _work(capsys.readouterr().out)
    assert free["steps the deadline cut"] == 0
    assert free["GPU plan operations"] > 0
    # a deadline no step can meet: every step is cut, yet the starvation rule keeps the plan
    # moving (one batch after every few starved steps)
    assert bench_step.main([*SMALL, "--step-deadline-us", "0.001"]) == 0
    out = capsys.readouterr().out
    cut = _work(out)
    assert cut["steps the deadline cut"] > 0
    assert 0 < cut["GPU plan operations"] < free["GPU plan operations"]
    assert "| CPU: every step | 300 |" in out
