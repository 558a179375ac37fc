"""The command line starts light: building its parsers (``policyd --help``) and running
``policyd sql`` import neither the policies (River, the predictor), the daemon, the history
writer's Arrow schema, nor the benchmarks and evaluations (``experiments``); the names its
parsers list equal the registries' (no timing here: ``policyd bench-cli`` measures the start)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from experiments.startup_bench import render
from policyd.cli import OWN_PARSERS
from policyd.core.names import ONLINE_POLICY_NAMES, ORACLE_POLICY_NAMES, POLICY_NAMES, TRACE_FORMATS
from policyd.daemon.settings import online_policies
from policyd.policies import POLICIES
from policyd.traces import READERS

HEAVY = ("river", "pyarrow", "fastapi", "uvicorn", "sqlalchemy", "alembic", "numpy", "scipy")
HEAVY_POLICYD = (
    "policyd.policies",
    "policyd.models.predictor",
    "policyd.daemon",
    "policyd.sim.replay",
    "experiments",
)


def _imported_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout
    return set(out.split())


def _heavy(modules: set[str]) -> list[str]:
    return sorted(
        m
        for m in modules
        if m.split(".")[0] in HEAVY or any(m == h or m.startswith(h + ".") for h in HEAVY_POLICYD)
    )


def test_building_every_parser_imports_nothing_heavy() -> None:
    modules = _imported_after("import policyd.cli as cli\ncli.build_parser()")
    assert _heavy(modules) == []
    assert "duckdb" not in modules and "rich" not in modules


def test_policyd_sql_imports_duckdb_but_not_the_writer_nor_the_policies(tmp_path: Path) -> None:
    db = tmp_path / "h.duckdb"
    subprocess.run(
        [sys.executable, "-m", "policyd.cli", "migrate", "--db", str(db)],
        check=True,
        capture_output=True,
    )
    code = (
        "import contextlib, io\nfrom policyd.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['sql', 'SELECT 41 + 1', '--db', {str(db)!r}, '--format', 'csv']) == 0"
    )
    modules = _imported_after(code)
    assert "duckdb" in modules
    assert _heavy(modules) == []


def test_the_parsers_names_equal_the_registries() -> None:
    assert sorted(POLICY_NAMES) == sorted(POLICIES)
    assert sorted(ORACLE_POLICY_NAMES) == sorted(
        n for n, cls in POLICIES.items() if cls.ordering == "oracle"
    )
    assert list(ONLINE_POLICY_NAMES) == online_policies()
    assert sorted(TRACE_FORMATS) == sorted(READERS)


def test_every_subcommand_with_its_own_parser_answers_as_policyd() -> None:
    for name in OWN_PARSERS:
        out = subprocess.run(
            [sys.executable, "-m", "policyd.cli", name, "--help"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert out.startswith(f"usage: policyd {name}")


def test_bench_cli_table_judges_the_median_against_the_target() -> None:
    table = render(
        {
            "python -c pass": [0.05, 0.04, 0.06],
            "policyd --help": [0.2, 0.3, 0.1],
            "policyd sql": [0.6, 0.7, 0.4],
        }
    )
    assert "| policyd --help | 0.200 | 4.0x | <= 0.5 s: met |" in table
    assert "| policyd sql | 0.600 | 12.0x | <= 0.5 s: NOT met |" in table
    assert "| python -c pass | 0.050 | 1.0x | - |" in table
