"""The predictor's compiled build (setup.py, AGENTKV_COMPILE=1): the same forecasts as the
source, never run stale, and checkpoints that move between the builds."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import pytest

from experiments import predictor_builds
from policyd.models.predictor import SOURCES, compiled_modules
from policyd.traces.location import WHO_AND_WHEN, local_trace

REPO = Path(__file__).resolve().parents[1]
WHOWHEN = local_trace(WHO_AND_WHEN)  # the public chats, when $AGENTKV_TRACES holds them


def _python(code: str, *, path: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter that imports policyd from ``path``."""
    environment = {**os.environ, "PYTHONPATH": str(path), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )


def _record(directory: Path, **digests: str) -> None:
    (directory / SOURCES).write_text(json.dumps(digests))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_compiled_module_is_stale_once_its_source_differs_from_the_recorded_one(
    tmp_path: Path,
) -> None:
    suffix = EXTENSION_SUFFIXES[0]
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / f"a{suffix}").write_bytes(b"")
    (tmp_path / "b.py").write_text("y = 1\n")  # no extension: not compiled, never stale
    assert compiled_modules(tmp_path) == (["a"], ["a"])  # nothing recorded: stale
    _record(tmp_path, a=_sha(tmp_path / "a.py"))
    assert compiled_modules(tmp_path) == (["a"], [])
    (tmp_path / "a.py").write_text("x = 2\n")
    assert compiled_modules(tmp_path) == (["a"], ["a"])
    (tmp_path / SOURCES).write_text("{not json")
    assert compiled_modules(tmp_path) == (["a"], ["a"])


@pytest.fixture
def copied(tmp_path: Path) -> Path:
    """The policyd package's source, copied to a directory of its own (without any build)."""
    shutil.copytree(
        REPO / "policyd",
        tmp_path / "policyd",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", SOURCES),
    )
    return tmp_path


REPORT = """
    import warnings
    warnings.simplefilter("error", RuntimeWarning)
    try:
        import policyd.models.predictor
    except RuntimeWarning as warning:
        print("warned:", warning)
        warnings.simplefilter("ignore", RuntimeWarning)
        import policyd.models.predictor
    from policyd.models.predictor import fusion
    print(policyd.models.predictor.BUILD, fusion.__file__)
"""


def test_an_edited_compiled_module_is_never_run_the_source_is_with_a_warning(
    copied: Path,
) -> None:
    # an "extension" that would not even load: the import must not try it
    package = copied / "policyd" / "models" / "predictor"
    (package / f"fusion{EXTENSION_SUFFIXES[0]}").write_bytes(b"not a shared object")
    _record(package, fusion="0" * 64)  # compiled from another source than this one
    done = _python(REPORT, path=copied, cwd=copied)
    assert done.returncode == 0, done.stderr
    assert "warned: policyd.models.predictor: fusion changed since compiled" in done.stdout
    assert f"interpreted {package / 'fusion.py'}" in done.stdout


def test_agentkv_interpreted_runs_the_source_of_an_up_to_date_build(copied: Path) -> None:
    package = copied / "policyd" / "models" / "predictor"
    (package / f"fusion{EXTENSION_SUFFIXES[0]}").write_bytes(b"not a shared object")
    _record(package, fusion=_sha(package / "fusion.py"))
    done = _python(REPORT, path=copied, cwd=copied, AGENTKV_INTERPRETED="1")
    assert done.returncode == 0, done.stderr
    assert "warned" not in done.stdout
    assert f"interpreted {package / 'fusion.py'}" in done.stdout


def test_the_side_by_side_bench_refuses_an_install_that_is_not_compiled(
    copied: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        predictor_builds.main([str(copied)])
    assert exit_.value.code == 2
    assert "is not compiled (no extension modules" in capsys.readouterr().err
    package = copied / "policyd" / "models" / "predictor"
    (package / f"fusion{EXTENSION_SUFFIXES[0]}").write_bytes(b"not a shared object")
    with pytest.raises(SystemExit) as exit_:
        predictor_builds.main([str(copied)])
    assert exit_.value.code == 2
    assert "fusion changed since compiled: build it again" in capsys.readouterr().err


CHECKPOINT = """
    import hashlib, pickle
    from pathlib import Path
    import policyd.models.predictor
    from policyd.models.predictor import Predictor
    from policyd.workloads.pbkv import financial
    calls = [c for s in financial(seed=3, workflows=40).streams for c in s]
    half = len(calls) // 2
    def run(predictor, calls):
        digest = hashlib.sha256()
        for n, call in enumerate(calls):
            predictor.observe_call(call.workflow_id, call.workflow_type, call.agent, call.hints, n)
            forecast = predictor.predict(call.workflow_id)
            digest.update(repr((forecast.agents, forecast.alive)).encode())
        return digest.hexdigest()
    checkpoint = Path("ckpt")
    if not checkpoint.exists():
        predictor = Predictor()
        run(predictor, calls[:half])
        checkpoint.write_bytes(pickle.dumps(predictor))
    print(policyd.models.predictor.BUILD, run(pickle.loads(checkpoint.read_bytes()), calls[half:]))
"""


@pytest.mark.slow
def test_the_compiled_predictor_serves_the_same_forecasts(tmp_path: Path) -> None:
    # the project as it installs, compiled into a target directory
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in ("policyd", "experiments", "connector", "ui"):
        shutil.copytree(
            REPO / package,
            source / package,
            ignore=shutil.ignore_patterns("__pycache__", "*.so", SOURCES),
        )
    install = tmp_path / "install"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", install, source],
        env={**os.environ, "AGENTKV_COMPILE": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    compiled, stale = compiled_modules(install / "policyd" / "models" / "predictor")
    assert "fusion" in compiled and not stale

    # both builds side by side: the same forecasts (SHA-256; it exits 1 where they differ)
    bench = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.predictor_builds",
            str(install),
            "--workloads",
            "who-and-when,code-writing" if WHOWHEN is not None else "fact-checking,code-writing",
            "--workflows",
            "150",
            "--rounds",
            "1",
            *(["--whowhen", str(WHOWHEN)] if WHOWHEN is not None else []),
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert bench.returncode == 0, bench.stdout + bench.stderr
    rows = [line for line in bench.stdout.splitlines() if line.startswith("│")]
    compiled_rows = [row for row in rows if " compiled " in row]
    assert len(rows) == 4 and len(compiled_rows) == 2, bench.stdout
    assert all(" yes " in row for row in compiled_rows), bench.stdout

    # a checkpoint (pickle) taken by one build continues identically in the other
    saved = _python(CHECKPOINT, path=install, cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    loaded = _python(CHECKPOINT, path=install, cwd=tmp_path, AGENTKV_INTERPRETED="1")
    assert loaded.returncode == 0, loaded.stderr
    build_saved, forecasts_saved = saved.stdout.split()
    build_loaded, forecasts_loaded = loaded.stdout.split()
    assert (build_saved, build_loaded) == ("compiled", "interpreted")
    assert forecasts_saved == forecasts_loaded
