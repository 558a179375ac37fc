"""``policyd throughput`` runs end to end on a small generated trace, beside both peers."""

from __future__ import annotations

import json

from experiments import throughput


def test_throughput_measures_every_row_and_our_two_models_agree(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTKV_TRACES", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no trace in the default cache folder either
    out = tmp_path / "rows.json"
    argv = ["--requests", "120", "--gpu-blocks", "1000", "--host-blocks", "2000"]
    argv += ["--oracle-workloads", "group-chat"]
    assert throughput.main([*argv, "--python-requests", "12", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["trace"].startswith("synthetic")
    rows = {(r["simulator"], r["what"]): r for r in result["rows"]}
    assert len(rows) == 8
    assert all(r["refs"] == result["refs"] > 0 for r in result["rows"][:5])
    assert all(r["cpu_s"] > 0 for r in result["rows"])
    # the trace at concurrency 1 and 16, then the chats at 16 and two GPU tiers
    assert [o["concurrency"] for o in result["oracle"]] == [1, 16, 16, 16]
    assert all(o["lru_s"] > 0 and o["belady_s"] > 0 for o in result["oracle"])
    # the same calls under LRU: the compiled and the Python model hit the same blocks
    head = "lru, GPU, first 12 calls"
    assert rows[("ours, compiled", head)]["hit_rate"] == rows[("ours, Python", head)]["hit_rate"]
