"""policyd bench: one run measures every policy beside the oracle; bad input is a clear error."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from policyd.bench import BenchSpec, across_seeds, run_bench
from policyd.bench import main as bench_main
from policyd.cli import main
from policyd.sim.report import Report
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


def _report(seed_hits: dict[str, float], workload: str = "code-writing") -> list[Report]:
    return [
        Report(
            policy,
            workload,
            "h200-llama3.1-8b",
            24,
            8192,
            0,
            prompt_blocks=1000,
            gpu_hit_blocks=round(hit * 1000),
        )
        for policy, hit in seed_hits.items()
    ]


def test_across_seeds_compares_mean_hit_rates_and_counts_the_seeds_won():
    by_seed = {
        0: _report({"lru": 0.30, "pbkv": 0.40, "agentkv": 0.38, "belady": 0.5}),
        1: _report({"lru": 0.50, "pbkv": 0.30, "agentkv": 0.45, "belady": 0.6}),
        2: _report({"lru": 0.40, "pbkv": 0.35, "agentkv": 0.42, "belady": 0.6}),
    }
    console = Console(width=200, record=True)
    console.print(across_seeds(by_seed))
    row = next(line for line in console.export_text().splitlines() if "code-writing" in line)
    # means: lru 0.400, pbkv 0.350, agentkv 0.4167; per seed 0.95x, 0.90x, 1.05x
    cells = [cell.strip() for cell in row.split("│") if cell.strip()]
    assert cells[3:] == ["0.4167", "0.4000 (lru)", "1.0417x", "1 of 3", "0.9000x"]


def test_python_m_bench_runs_every_seed_and_tags_the_json_rows(tmp_path, capsys):
    out = tmp_path / "seeds.json"
    argv = ["--workload", "code-writing", "--policies", "lru,agentkv", "--concurrency", "4"]
    argv += ["--streams", "6", "--gpu-blocks", "3000", "--host-blocks", "0", "--seed", "0,1"]
    png = tmp_path / "seeds.png"
    assert bench_main([*argv, "--no-progress", "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    payload = json.loads(out.read_text())
    assert payload["spec"]["seed"] == [0, 1]
    rows = [(r["seed"], r["policy"]) for r in payload["results"]]
    assert rows == [(s, p) for s in (0, 1) for p in ("lru", "agentkv", "belady")]
    # the seeds are different workloads, not one run repeated
    assert len({r["prompt_blocks"] for r in payload["results"]}) == 2
    text = capsys.readouterr().out
    assert "agentkv vs the best baseline over 2 seeds (0, 1)" in text
    assert "seed 1" in text


def test_python_m_bench_refuses_bad_seeds(capsys):
    for seed in ("-1", "zero", ""):
        with pytest.raises(SystemExit) as exc:
            bench_main(["--workload", "code-writing", "--concurrency", "4", "--seed", seed])
        assert exc.value.code == 2
    assert "expected" in capsys.readouterr().err
    for option, value in (("--concurrency", "0"), ("--gpu-blocks", "x"), ("--host-blocks", "-1")):
        argv = ["--workload", "code-writing", "--concurrency", "4", option, value]
        with pytest.raises(SystemExit) as exc:
            bench_main(argv)
        assert exc.value.code == 2
    assert "expected" in capsys.readouterr().err
