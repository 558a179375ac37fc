"""``connector.replay``'s summary of repeated runs (pure functions over run records)."""

from __future__ import annotations

import argparse

import pytest

from connector.replay import repeats_table, tunable


def _run(name: str, recomputed: int, p99: float | None) -> dict[str, object]:
    out: dict[str, object] = {"run": name, "recomputed_tokens": recomputed}
    if p99 is not None:
        out["connector_step_cpu_p99_us"] = p99
    return out


def test_repeats_table_takes_medians_and_judges_the_median_against_the_budget() -> None:
    records = [
        _run("vllm-default", 100, 120.0),
        _run("agentkv", 110, 150.0),
        _run("vllm-default", 90, 130.0),
        _run("agentkv", 99, 260.0),
        _run("vllm-default", 95, 110.0),
        _run("agentkv", 108, 190.0),
    ]
    lines = repeats_table(records, budget_us=200.0).splitlines()
    assert lines[0] == "over 3 runs of each, interleaved"
    default, agentkv = lines[1], lines[2]
    assert "median 95 (range 90-100)" in default
    assert "runs 120, 130, 110, median 120 (budget 200: within), worst 130" in default
    assert "x vLLM's default" not in default
    assert "median 108 (range 99-110); 1.137x vLLM's default's median" in agentkv
    # one run over the budget does not decide it; the median does, and the worst is shown
    assert "median 190 (budget 200: within), worst 260" in agentkv
    over = repeats_table(records, budget_us=180.0).splitlines()[2]
    assert "median 190 (budget 180: OVER)" in over


def test_repeats_table_without_step_times_or_a_default() -> None:
    line = repeats_table([_run("gpu-only", 50, None), _run("gpu-only", 70, None)]).splitlines()[1]
    assert line == "gpu-only: recomputed tokens median 60 (range 50-70)"


def test_a_tunable_is_key_equals_value_read_as_json_or_text() -> None:
    """``--tunable KEY=VALUE``: numbers and booleans as JSON reads them, anything else as
    text (the daemon validates it); a malformed one is refused by the parser."""
    assert tunable("recency_guard=off") == ("recency_guard", "off")
    assert tunable(" write_filter_theta =0.9") == ("write_filter_theta", 0.9)
    assert tunable("shards_rate=1") == ("shards_rate", 1)
    assert tunable("flag=true") == ("flag", True)
    for bad in ("recency_guard", "=off"):
        with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
            tunable(bad)
