"""``policyd trace get``: a source archive served over real HTTP on loopback (the machine has no
route to GitHub), built from the excerpts in tests/data; pinned checksums, atomic publishing."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from policyd.cli import main as policyd
from policyd.traces.fetch import SOURCES, TraceFetchError, TraceSource, get, verify
from policyd.traces.location import TRACES_ENV
from policyd.traces.swe import read_swe

DATA = Path(__file__).parent / "data"
MOONCAKE_LIKE = TraceSource(
    name="mooncake",
    what="t",
    repository="o/r",
    commit="abc",
    prefix="FAST25-release/traces",
    published="mooncake/synthetic_trace.jsonl",
    licence="t",
)
SWE_LIKE = TraceSource(
    name="swebench",
    what="t",
    repository="o/r",
    commit="abc",
    prefix="runs/trajs",
    published="swe.tar.gz",
    licence="t",
    archive_folder="swe",
)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def repo_archive(path: Path, files: dict[str, bytes]) -> None:
    """A GitHub-style archive: every file under one top folder."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"r-abc/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def swe_excerpts() -> dict[str, bytes]:
    out = {}
    with tarfile.open(DATA / "swebench_excerpt.tar.gz") as tar:
        for member in tar.getmembers():
            if member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                out[Path(member.name).name] = f.read()
    return out


class Served:
    def __init__(self, root: Path) -> None:
        self.requests = 0
        served = self

        class Handler(SimpleHTTPRequestHandler):
            def do_GET(self) -> None:
                served.requests += 1
                super().do_GET()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    root = tmp_path / "www"
    root.mkdir()
    s = Served(root)
    yield s
    s.server.shutdown()


def test_a_single_file_trace_is_fetched_checked_and_not_fetched_twice(
    tmp_path: Path, served: Served
) -> None:
    data = (DATA / "mooncake_excerpt.jsonl").read_bytes()
    repo_archive(
        tmp_path / "www" / "m.tar.gz",
        {"FAST25-release/traces/synthetic_trace.jsonl": data, "README.md": b"other"},
    )
    pinned = {"synthetic_trace.jsonl": sha(data)}
    out = tmp_path / "traces"
    path = get(MOONCAKE_LIKE, out, served.url("m.tar.gz"), pinned, progress=None)
    assert path == out / "mooncake" / "synthetic_trace.jsonl"
    assert path.read_bytes() == data
    assert sorted(p.name for p in out.rglob("*")) == ["mooncake", "synthetic_trace.jsonl"]
    get(MOONCAKE_LIKE, out, served.url("m.tar.gz"), pinned, progress=None)
    assert served.requests == 1  # an intact copy is kept


def test_an_archive_trace_is_written_under_its_published_name_and_reads(
    tmp_path: Path, served: Served
) -> None:
    trajs = swe_excerpts()
    files = {f"runs/trajs/{n}": d for n, d in trajs.items()}
    files["runs/other/x.traj.json"] = b"{}"  # same suffix, another folder: not taken
    repo_archive(tmp_path / "www" / "s.tar.gz", files)
    pinned = {n: sha(d) for n, d in trajs.items()}
    path = get(SWE_LIKE, tmp_path, served.url("s.tar.gz"), pinned, progress=None)
    assert path == tmp_path / "swe.tar.gz"
    verify(path, pinned)
    assert len(list(read_swe(path))) == 3


def test_a_file_that_differs_from_its_pin_is_an_error_and_nothing_is_written(
    tmp_path: Path, served: Served
) -> None:
    trajs = swe_excerpts()
    pinned = {n: sha(d) for n, d in trajs.items()}
    name = sorted(trajs)[1]
    trajs[name] = trajs[name].replace(b"sympy", b"sYmpy", 1)
    repo_archive(tmp_path / "www" / "s.tar.gz", {f"runs/trajs/{n}": d for n, d in trajs.items()})
    with pytest.raises(TraceFetchError, match=name):
        get(SWE_LIKE, tmp_path / "out", served.url("s.tar.gz"), pinned, progress=None)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_missing_file_and_an_unreachable_source_are_clear_errors(
    tmp_path: Path, served: Served
) -> None:
    trajs = swe_excerpts()
    pinned = {n: sha(d) for n, d in trajs.items()}
    first = sorted(trajs)[0]
    repo_archive(tmp_path / "www" / "s.tar.gz", {f"runs/trajs/{first}": trajs[first]})
    with pytest.raises(TraceFetchError, match="2 pinned file"):
        get(SWE_LIKE, tmp_path / "out", served.url("s.tar.gz"), pinned, progress=None)
    with pytest.raises(TraceFetchError, match="cannot download"):
        get(SWE_LIKE, tmp_path / "out", served.url("nothing.tar.gz"), pinned, progress=None)
    (tmp_path / "www" / "junk.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(TraceFetchError, match=r"not a readable tar\.gz"):
        get(SWE_LIKE, tmp_path / "out", served.url("junk.tar.gz"), pinned, progress=None)


def test_the_cli_names_unknown_traces_and_checks_local_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert policyd(["trace", "get", "nope"]) == 1
    assert "unknown trace 'nope'" in capsys.readouterr().err
    # an excerpt is not the pinned trace: verify says how it differs
    assert policyd(["trace", "verify", "swebench", "--path", str(DATA / "swebench_excerpt.tar.gz")])
    assert "197 pinned file(s) missing" in capsys.readouterr().err
    assert policyd(["trace", "list", "--dest", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SOURCES) and "not fetched" in listed


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_pinned_trace_matches_a_local_copy_when_one_is_given(name: str) -> None:
    src = SOURCES[name]
    pinned = src.manifest()
    assert pinned and all(len(h) == 64 for h in pinned.values())
    root = os.environ.get(TRACES_ENV)
    if not root or not (Path(root) / src.published).exists():
        pytest.skip(f"{TRACES_ENV} does not hold {src.published}")
    verify(Path(root) / src.published, pinned)
