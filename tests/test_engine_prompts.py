"""``policyd engine-prompts`` with a generated workload: every call becomes token ids, and two
calls share a prefix of tokens exactly as long as the prefix of blocks they share."""

from __future__ import annotations

import json
from itertools import takewhile
from pathlib import Path

import pytest

from policyd.traces.engine_prompts import main
from policyd.workloads import make_workload


def _shared(a: list[int], b: list[int]) -> int:
    """The length of the prefix ``a`` and ``b`` share."""
    return sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1], zip(a, b, strict=False)))


def test_a_generated_workload_becomes_prompts_that_share_what_its_blocks_share(
    tmp_path: Path,
) -> None:
    out = tmp_path / "prompts.json"
    argv = ["--workload", "financial", "--param", "workflows=3", "--seed", "1",
            "--tokens-per-block", "1", "--max-tokens", "100000", "--requests", "1000",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    flows = json.loads(out.read_text())["workflows"]
    work = make_workload("financial", seed=1, workflows=3)
    streams = list(work)
    assert [len(f["calls"]) for f in flows] == [len(s) for s in streams]
    calls = [c for s in streams for c in s]
    prompts = [c["prompt"] for f in flows for c in f["calls"]]
    assert [len(p) for p in prompts] == [len(c.block_hashes) for c in calls]
    for i in range(1, len(calls)):  # each call against the one before (often another agent's)
        blocks = _shared(list(calls[i - 1].block_hashes), list(calls[i].block_hashes))
        assert _shared(prompts[i - 1], prompts[i]) >= blocks
    assert all(f["workflow_type"] for f in flows)


def test_a_parameter_the_generator_does_not_take_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--workload", "financial", "--param", "flows=3", "--out", str(tmp_path / "p")])
    assert stop.value.code == 2
    assert "--param" in capsys.readouterr().err
