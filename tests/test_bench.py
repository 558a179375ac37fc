"""policyd bench: one run measures every policy beside the oracle; bad input is a clear error."""

from __future__ import annotations

import json

import pytest

from policyd.bench import BenchSpec, run_bench
from policyd.cli import main
from policyd.workloads import make_workload


def small(name: str):
    return make_workload("code-writing", seed=2, workflows=12)


def spec(**overrides) -> BenchSpec:
    fields = dict(
        workloads=["code-writing"],
        policies=["lru", "pbkv"],
        concurrency=[4],
        gpu_blocks=[3000],
        host_blocks=[0],
        profile="h200-llama3.1-8b",
    )
    fields.update(overrides)
    return BenchSpec(**fields)  # type: ignore[arg-type]


def test_every_policy_and_noise_level_is_reported_beside_belady():
    reports = run_bench(spec(noise=[0.0, 1.0]), load=small, show_progress=False)
    labels = [r.policy for r in reports]
    assert labels == ["lru", "pbkv", "pbkv noise=0", "pbkv noise=1", "belady"]
    assert all(r.belady_fraction is not None for r in reports)
    belady = reports[-1]
    assert belady.belady_fraction == 1.0
    assert all(r.requests == belady.requests for r in reports)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"policies": ["lru", "nope"]}, "unknown policy 'nope'"),
        ({"noise": [1.5]}, "noise levels must be in [0, 1]"),
        ({"policies": ["lru"], "noise": [0.5]}, "add pbkv"),
    ],
)
def test_bad_specs_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spec(**overrides)


def test_cli_rejects_unknown_names_and_bad_fractions(capsys):
    for argv in (
        ["bench", "--policies", "lru,nope"],
        ["bench", "--workload", "no-such-workload-or-path"],
        ["bench", "--noise", "0,2"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    assert "valid" in capsys.readouterr().err


def test_cli_json_names_the_command_that_reproduces_it(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--workload", "synthetic", "--concurrency", "2", "--gpu-blocks", "2000"]
    argv += ["--host-blocks", "0", "--policies", "lru", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"] == "policyd " + " ".join(argv)
    assert {r["policy"] for r in payload["results"]} == {"lru", "belady"}
    assert "reproduce: policyd bench" in capsys.readouterr().out
