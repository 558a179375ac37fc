"""policyd bench: one run measures every policy beside the oracle; bad input is a clear error."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from experiments.bench import (
    BenchSpec,
    _run_in_processes,
    across_seeds,
    replays,
    run_bench,
    seed_summaries,
)
from experiments.bench import main as python_m_bench
from policyd.cli import build_parser, main
from policyd.sim.report import Report
from policyd.workloads import make_workload


def bench_main(argv: list[str]) -> int:
    """``policyd bench ARGV``; a refusal's exit status whether argparse or the command refuses."""
    try:
        return main(["bench", *argv])
    except SystemExit as exc:
        return int(exc.code or 0)


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


def test_a_variant_runs_beside_the_default_under_its_own_label(capsys):
    # each plan applied whole (no step budget), so that every score reaches the host order
    variants = spec(policies=["pbkv", "pbkv[noise=1.0]"], host_blocks=[1000], step_ops=None)
    reports = run_bench(variants, load=small, show_progress=False)
    by_label = {r.policy: r for r in reports}
    assert list(by_label) == ["pbkv", "pbkv[noise=1.0]", "belady"]
    # the same workload, other decisions: a predictor replaced by noise orders the host tier
    # otherwise (the host order applies every score; docs/RESULTS.md, *One decision path*)
    assert by_label["pbkv"].requests == by_label["pbkv[noise=1.0]"].requests
    assert by_label["pbkv"].host_hit_blocks != by_label["pbkv[noise=1.0]"].host_hit_blocks


def test_bench_compares_each_agentkv_variant_with_the_baselines(capsys):
    argv = ["--workload", "code-writing", "--streams", "8", "--concurrency", "4"]
    argv += ["--gpu-blocks", "3000", "--host-blocks", "0", "--no-progress"]
    argv += ["--policies", "lru,agentkv,agentkv[guard=false,discount=0.5]"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "agentkv vs the best baseline per point" in out
    assert "agentkv[guard=false,discount=0.5] vs the best baseline" in out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"policies": ["lru", "nope"]}, "unknown policy 'nope'"),
        ({"noise": [1.5]}, "noise levels must be in [0, 1]"),
        ({"policies": ["lru"], "noise": [0.5]}, "add pbkv"),
        ({"policies": ["agentkv[nope=1]"]}, "'nope=1' is not param=value with a parameter"),
        ({"policies": ["agentkv[referee]"]}, "'referee' is not param=value"),
        ({"policies": ["agentkv[referee=virtual"]}, "expected name[param=value,...]"),
        ({"policies": ["nope[referee=virtual]"]}, "unknown policy 'nope'"),
    ],
)
def test_bad_specs_are_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        spec(**overrides)


def test_a_host_tier_given_as_a_multiple_of_the_gpu_tier_is_sized_at_each_point():
    sizes = spec(gpu_blocks=[3000, 6000], host_blocks=[0, "1x", "0.5x", 1000])
    points = [(gpu, host) for _, _, gpu, host in sizes.points()]
    assert points == [
        (3000, 0), (3000, 3000), (3000, 1500), (3000, 1000),
        (6000, 0), (6000, 6000), (6000, 3000), (6000, 1000),
    ]  # fmt: skip
    reports = run_bench(
        spec(policies=["lru"], gpu_blocks=[3000], host_blocks=["1x"]), load=small,
        show_progress=False,
    )  # fmt: skip
    assert [(r.gpu_blocks, r.host_blocks) for r in reports] == [(3000, 3000)] * 2  # and belady


def test_a_multiple_of_the_gpu_tier_needs_gpu_sizes_and_a_number():
    with pytest.raises(ValueError, match="needs GPU tier sizes"):
        spec(gpu_blocks=[None], host_blocks=["1x"])
    with pytest.raises(ValueError, match="not a multiple of the GPU tier"):
        spec(host_blocks=["ax"])


def test_cli_rejects_unknown_names_and_bad_fractions(capsys):
    for argv in (
        ["bench", "--policies", "lru,nope"],
        ["bench", "--workload", "no-such-workload-or-path"],
        ["bench", "--noise", "0,2"],
        ["bench", "--host-blocks", "0,x2"],
        ["bench", "--host-blocks", "-1"],
        ["bench", "--host-blocks", "-1x"],
        ["bench", "--host-blocks", ","],
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
    # means: lru 0.400, pbkv 0.350, agentkv 0.4167; per seed 0.95x, 0.90x, 1.05x against that
    # seed's best; against lru on every seed 1.2667x, 0.9x, 1.05x: mean 1.0722, sd 0.1844,
    # t(0.975, 2 df) = 4.3027, half-width 4.3027 x 0.1844 / sqrt(3) = 0.4580
    cells = [cell.strip() for cell in row.split("│") if cell.strip()]
    assert cells[3:] == [
        "0.4167",
        "0.4000 (lru)",
        "1.0417x",
        "1.0722x (0.614-1.530)",
        "1 of 3",
        "0.9000x",
    ]


def test_the_paired_interval_tells_a_consistent_shortfall_from_the_seed_spread():
    # agentkv 2% behind pbkv on every seed, while the seeds' hit rates differ by up to 2x
    scales = (1.0, 1.5, 2.0, 1.2)
    steady = {
        seed: _report({"lru": 0.1 * scale, "pbkv": 0.2 * scale, "agentkv": 0.196 * scale})
        for seed, scale in enumerate(scales)
    }
    # the same shortfall on average, but won or lost by 6-8% from seed to seed
    swinging = {
        seed: _report({"lru": 0.1 * scale, "pbkv": 0.2 * scale, "agentkv": factor * scale})
        for seed, (scale, factor) in enumerate(
            zip(scales, (0.212, 0.18, 0.214, 0.178), strict=True)
        )
    }
    point = ("code-writing", 24, 8192, 0)
    steady_summary = seed_summaries(steady)[point]
    assert steady_summary.best_policy == "pbkv"
    interval = steady_summary.interval()
    assert interval is not None
    assert interval[0] == pytest.approx(0.98, abs=2e-3)  # (hit counts are whole blocks)
    assert interval[2] < 1.0  # behind beyond the spread between seeds
    interval = seed_summaries(swinging)[point].interval()
    assert interval is not None
    assert interval[0] == pytest.approx(0.98, abs=2e-3)
    assert interval[1] < 1.0 < interval[2]  # cannot tell
    assert seed_summaries({0: steady[0]})[point].interval() is None  # one seed: no interval


def test_bench_runs_every_seed_and_tags_the_json_rows(tmp_path, capsys):
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


def test_bench_reprints_a_stored_run_from_its_json(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["--workload", "code-writing", "--policies", "lru,agentkv", "--concurrency", "4"]
    argv += ["--streams", "6", "--gpu-blocks", "3000", "--host-blocks", "0", "--seed", "0,1"]
    assert bench_main([*argv, "--no-progress", "--json", str(out)]) == 0
    ran = capsys.readouterr().out
    png = tmp_path / "again.png"
    assert bench_main(["--from-json", str(out), "--plot", str(png)]) == 0
    again = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the same tables (every row of every table) and the same reproducing command, read back
    # instead of run again
    def rows(text: str) -> list[str]:
        return [line for line in text.splitlines() if "│" in line or line.startswith("reproduce")]

    assert rows(again) == rows(ran)
    # per seed three policies and agentkv vs the best; the table over the seeds; the command
    assert sum("code-writ" in line for line in rows(ran)) == 2 * (3 + 1) + 1 + 1
    assert "over 2 seeds (0, 1)" in again


def test_bench_reads_runs_of_other_seeds_as_one_and_refuses_unlike_runs(tmp_path, capsys):
    argv = ["--workload", "code-writing", "--policies", "lru,agentkv", "--concurrency", "4"]
    argv += ["--streams", "6", "--gpu-blocks", "3000", "--host-blocks", "0", "--no-progress"]
    both, first, second = (tmp_path / f"{name}.json" for name in ("both", "first", "second"))
    assert bench_main([*argv, "--seed", "0,1", "--json", str(both)]) == 0
    assert bench_main([*argv, "--seed", "0", "--json", str(first)]) == 0
    assert bench_main([*argv, "--seed", "1", "--json", str(second)]) == 0
    capsys.readouterr()

    def over_seeds(text: str) -> list[str]:  # the table over the seeds: title and rows
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if "over 2 seeds" in line)
        return [lines[start], *(line for line in lines[start:] if "│ code-writ" in line)]

    assert bench_main(["--from-json", str(both)]) == 0
    one_run = capsys.readouterr().out
    assert bench_main(["--from-json", f"{first},{second}"]) == 0
    two_runs = capsys.readouterr().out
    assert over_seeds(two_runs) == over_seeds(one_run)
    assert "over 2 seeds (0, 1)" in two_runs
    words = " ".join(two_runs.split())  # (a long command wraps)
    assert f"--seed 0 --json {first} && " in words  # both commands reproduce it
    assert f"--seed 1 --json {second}" in words

    # a seed read twice, or a run of other settings, would mix what is not one run
    for paths, message in (
        (f"{first},{both}", "seed 0 is in"),
        (f"{second},{first},{second}", "seed 1 is in"),
    ):
        assert bench_main(["--from-json", paths]) == 2
        assert message in capsys.readouterr().err
    other = tmp_path / "other.json"
    argv[argv.index("3000")] = "2000"
    assert bench_main([*argv, "--seed", "1", "--json", str(other)]) == 0
    capsys.readouterr()
    assert bench_main(["--from-json", f"{first},{other}"]) == 2
    err = capsys.readouterr().err
    assert "not runs of the same points" in err and "gpu_blocks" in err
    assert bench_main(["--from-json", ","]) == 2
    assert "takes a path" in capsys.readouterr().err


def test_bench_from_json_refuses_what_is_not_a_stored_run(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    for content in ("{not json", '{"results": [{"policy": "lru"}]}', '{"results": []}', "[]"):
        bad.write_text(content)
        assert bench_main(["--from-json", str(bad)]) == 2
        assert str(bad) in capsys.readouterr().err
    assert bench_main(["--from-json", str(tmp_path / "missing.json")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    # a stored run is re-read, not run again: what would specify a run is refused beside it
    for extra in (
        ["--workload", "code-writing"],
        ["--concurrency", "4"],
        ["--sweep", "concurrency"],
    ):
        assert bench_main(["--from-json", str(bad), *extra]) == 2
        assert f"it takes no {extra[0]}" in capsys.readouterr().err


def test_bench_refuses_bad_seeds(capsys):
    for seed in ("-1", "zero", ""):
        assert bench_main(["--workload", "code-writing", "--concurrency", "4", "--seed", seed]) == 2
    assert "expected" in capsys.readouterr().err
    for option, value in (
        ("--concurrency", "0"),
        ("--gpu-blocks", "x"),
        ("--host-blocks", "-1"),
        ("--streams", "0"),
        ("--step-ops", "x"),
    ):
        argv = ["--workload", "code-writing", "--concurrency", "4", option, value]
        assert bench_main(argv) == 2
    assert "expected" in capsys.readouterr().err


def test_the_one_parser_takes_the_flags_python_m_bench_alone_had():
    """``python -m experiments.bench``'s own flags (--streams, seeds as a list, policy variants,
    --plot without --sweep, --from-json) are ``policyd bench``'s, beside its old ones."""
    argv = ["bench", "--workload", "code-writing,financial", "--concurrency", "24"]
    argv += ["--streams", "32", "--gpu-blocks", "8192", "--host-blocks", "0,4096"]
    argv += ["--seed", "0,1,2", "--policies", "lru,pbkv,agentkv[guard=false,discount=0.5]"]
    argv += ["--plot", "seeds.png", "--json", "seeds.json", "--no-progress"]
    argv += ["--noise", "0,1", "--step-ops", "all", "--max-ranked-blocks", "512"]
    argv += ["--max-pinned-blocks", "8", "--profile", "h200-llama3.1-8b"]
    args = build_parser().parse_args(argv)
    assert args.streams == 32
    assert args.seed == [0, 1, 2]
    assert args.policies == ["lru", "pbkv", "agentkv[guard=false,discount=0.5]"]
    assert args.plot == "seeds.png" and args.sweep is None
    assert args.step_ops is None and args.noise == [0.0, 1.0]
    assert build_parser().parse_args(["bench", "--from-json", "a.json,b.json"]).from_json == (
        "a.json,b.json"
    )
    # policyd bench's defaults, whichever command the flags came from
    defaults = build_parser().parse_args(["bench"])
    assert defaults.policies == ["lru", "belady"]
    assert defaults.gpu_blocks == [4096] and defaults.host_blocks == [0, 16384]
    assert defaults.seed == [0] and defaults.streams is None
    assert defaults.profile == "h200-llama3.1-8b"


def test_python_m_bench_is_an_alias_of_policyd_bench(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        python_m_bench(["--help"])
    assert exc.value.code == 0
    alias_help = capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == alias_help  # one declaration of the flags
    assert alias_help.startswith("usage: policyd bench")
    argv = ["--workload", "code-writing", "--streams", "6", "--concurrency", "4"]
    argv += ["--gpu-blocks", "3000", "--host-blocks", "0", "--policies", "lru,agentkv"]
    alias, merged = tmp_path / "alias.json", tmp_path / "merged.json"
    assert python_m_bench([*argv, "--no-progress", "--json", str(alias)]) == 0
    assert main(["bench", *argv, "--no-progress", "--json", str(merged)]) == 0
    capsys.readouterr()
    rows = [json.loads(path.read_text()) for path in (alias, merged)]
    # both reproduce as policyd bench
    assert rows[0]["command"].replace(str(alias), str(merged)) == rows[1]["command"]
    assert rows[0]["command"].startswith("policyd bench --workload code-writing")
    timing = {"wall_s", "refs_per_s"}
    figures = [
        [{k: v for k, v in r.items() if k not in timing} for r in run["results"]] for run in rows
    ]
    assert figures[0] == figures[1]  # (the replay's own speed aside)
    # the command's refusals are the alias's, as argparse errors
    with pytest.raises(SystemExit) as exc:
        python_m_bench(["--from-json", ","])
    assert exc.value.code == 2
    assert "takes a path" in capsys.readouterr().err


def test_bench_without_agentkv_prints_no_comparison_table(capsys):
    argv = ["bench", "--workload", "code-writing", "--streams", "6", "--concurrency", "4"]
    argv += ["--gpu-blocks", "3000", "--host-blocks", "0", "--no-progress"]
    assert main(argv) == 0  # the default policies, lru and belady
    out = capsys.readouterr().out
    assert "policyd bench - profile h200-llama3.1-8b" in out
    assert "vs the best baseline" not in out


def _measured(report: Report) -> dict[str, object]:
    """A report's figures but its timings."""
    return {k: v for k, v in report.to_json().items() if k not in ("wall_s", "refs_per_s")}


def test_replays_in_worker_processes_report_what_one_process_reports():
    """``--jobs``: the same reports in the same order, belady's oracle from its point's lru."""
    several = spec(
        streams=8,
        policies=["lru", "pbkv", "agentkv"],
        concurrency=[4, 8],
        gpu_blocks=[1500],
        host_blocks=[0, 1500],
        noise=[1.0],
    )
    alone = run_bench(several, show_progress=False)
    spread = run_bench(several, show_progress=False, jobs=2)
    assert [r.policy for r in spread] == [r.policy for r in alone]
    assert [_measured(r) for r in spread] == [_measured(r) for r in alone]
    assert len(alone) == 4 * 5 and all(r.belady_fraction is not None for r in spread)
    assert not any(r.records for r in [*alone, *spread])  # (lru's dropped once belady ran)


def test_jobs_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="at least 1"):
        run_bench(spec(), show_progress=False, jobs=0)
    with pytest.raises(ValueError, match="custom load"):
        run_bench(spec(), load=small, show_progress=False, jobs=2)
    # a replay that fails in a worker fails the bench with its own error
    with pytest.raises(ValueError, match="raise the GPU capacity"):
        run_bench(spec(streams=8, gpu_blocks=[10]), show_progress=False, jobs=2)


def test_workers_report_every_call_they_replay():
    """The progress of ``--jobs``: each worker puts the calls it replays on a queue, as the
    replay reports them (every 256 calls on the Python model, at the end on the compiled one)."""
    several = spec(streams=8, policies=["lru", "pbkv"], host_blocks=[0, 1500])
    done: dict[tuple[int, str], Report] = {}
    counted: list[int] = []
    _run_in_processes(
        several,
        replays(several),
        2,
        lambda run, report: done.__setitem__((run.point, run.label), report),
        counted.append,
    )
    assert len(done) == 2 * 3
    assert sum(counted) == sum(report.requests for report in done.values())
