"""The public traces, fetched from their sources and checked against pinned checksums.

The repository ships no real trace, only small excerpts in ``tests/data``. ``policyd trace get
NAME`` downloads a trace's source repository at a pinned commit (GitHub's archive of it), takes
out the trace's files, checks each against the SHA-256 pinned in ``manifests/NAME.json`` and
writes the trace under its published name (``location.py``) into a folder: ``--dest``, else
``$AGENTKV_TRACES``, else ``~/.cache/agentkv/traces``. Nothing is written unless every pinned
file arrived intact. ``policyd trace verify NAME`` checks a local copy the same way.

Contract: a manifest maps each file's base name to its SHA-256; a trace is intact when its files
are exactly the manifest's (a folder, or a tar archive of one), whatever the container.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import IO, Final

from policyd.traces.location import MOONCAKE, SWE_TRAJECTORIES, WHO_AND_WHEN

CHUNK_BYTES: Final = 1 << 20
LICENCE_FILE: Final = "LICENSE"  # kept beside a trace's files when the source has one there


class TraceFetchError(RuntimeError):
    """A trace could not be fetched or is not the pinned one (the message says which file)."""


@dataclass(frozen=True)
class TraceSource:
    """Where one trace comes from and how it is laid out locally.

    ``archive_url``: a tar.gz of the source repository at the pinned commit. ``prefix``: the
    folder inside it (below the archive's top folder) that holds the trace's files.
    ``published``: the trace's path under the traces folder (``location.py``'s names); a name
    ending in ``.tar.gz`` is written as a tar archive of the files under ``archive_folder``.
    """

    name: str
    what: str
    repository: str
    commit: str
    prefix: str
    published: str
    licence: str
    archive_folder: str = ""

    @property
    def archive_url(self) -> str:
        return f"https://github.com/{self.repository}/archive/{self.commit}.tar.gz"

    def manifest(self) -> dict[str, str]:
        text = resources.files("policyd.traces").joinpath(f"manifests/{self.name}.json")
        pinned: dict[str, str] = json.loads(text.read_text())
        return pinned


SOURCES: Final = {
    s.name: s
    for s in (
        TraceSource(
            name="swebench",
            what="200 SWE-bench Verified trajectories of mini-swe-agent (Gemini 3 Pro)",
            repository="gruckion/mini-swe-agent",
            commit="d12a71af",
            prefix="swebench_results/20251118_gemini-3-pro-74pct/trajs",
            published=SWE_TRAJECTORIES,
            licence="MIT (repository); trajectories from the SWE-bench experiments bucket",
            archive_folder="swebench_minisweagent",
        ),
        TraceSource(
            name="whowhen",
            what="126 Who&When multi-agent group chats (AG2 CaptainAgent)",
            repository="ag2ai/Agents_Failure_Attribution",
            commit="f4d2b6da",
            prefix="Who&When/Algorithm-Generated",
            published=WHO_AND_WHEN,
            licence="MIT",
        ),
        TraceSource(
            name="mooncake",
            what="Mooncake's FAST '25 synthetic trace: 3,993 requests with prefix block hashes",
            repository="kvcache-ai/Mooncake",
            commit="3b5a5941",
            prefix="FAST25-release/traces",
            published=MOONCAKE,
            licence="Apache-2.0",
        ),
    )
}


def source(name: str) -> TraceSource:
    try:
        return SOURCES[name]
    except KeyError:
        known = ", ".join(sorted(SOURCES))
        raise TraceFetchError(f"unknown trace {name!r}; known: {known}") from None


# -- checking ------------------------------------------------------------------------------------


def sha256_of(stream: IO[bytes]) -> str:
    digest = hashlib.sha256()
    while chunk := stream.read(CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


def file_hashes(path: Path) -> Iterator[tuple[str, str]]:
    """(base name, SHA-256) of every file of a local copy: a folder (recursively), a tar
    archive, or one file."""
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            with file.open("rb") as stream:
                yield file.name, sha256_of(stream)
    elif tarfile.is_tarfile(path):
        with tarfile.open(path, "r:*") as archive:
            for member in archive:
                opened = archive.extractfile(member) if member.isfile() else None
                if opened is not None:
                    yield PurePosixPath(member.name).name, sha256_of(opened)
    else:
        with path.open("rb") as stream:
            yield path.name, sha256_of(stream)


def manifest_of(path: Path) -> dict[str, str]:
    """The manifest a local copy would have (to pin a new source)."""
    return dict(sorted(file_hashes(path)))


def verify(
    path: Path, pinned: dict[str, str], extra_ok: frozenset[str] = frozenset({LICENCE_FILE})
) -> None:
    """Raise ``TraceFetchError`` naming the first difference unless ``path`` holds exactly
    the pinned files (``extra_ok``: base names allowed beside them: the source's licence)."""
    if not path.exists():
        raise TraceFetchError(f"{path}: not found")
    seen = manifest_of(path)
    wrong = [n for n in pinned if n in seen and seen[n] != pinned[n]]
    missing = [n for n in pinned if n not in seen]
    extra = [n for n in seen if n not in pinned and n not in extra_ok]
    problems = []
    if wrong:
        problems.append(f"{len(wrong)} file(s) differ from the pinned checksum (first: {wrong[0]})")
    if missing:
        problems.append(f"{len(missing)} pinned file(s) missing (first: {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} file(s) not in the manifest (first: {extra[0]})")
    if problems:
        raise TraceFetchError(f"{path}: " + "; ".join(problems))


# -- fetching ------------------------------------------------------------------------------------


def download(url: str, into: Path, progress: IO[str] | None = sys.stderr) -> None:
    """``url`` to the file ``into``, printing the bytes received as it goes."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response, into.open("wb") as out:
            total = int(response.headers.get("Content-Length") or 0)
            got = 0
            while chunk := response.read(CHUNK_BYTES):
                out.write(chunk)
                got += len(chunk)
                if progress is not None:
                    of = f" of {total / 1e6:.1f}" if total else ""
                    print(f"\r  {got / 1e6:.1f}{of} MB", end="", file=progress, flush=True)
    except OSError as exc:  # URLError, HTTPError, timeouts, a full disk
        raise TraceFetchError(f"cannot download {url}: {exc}") from exc
    if progress is not None:
        print(file=progress)


def extract(archive: Path, src: TraceSource, pinned: dict[str, str], into: Path) -> int:
    """The pinned files under ``src.prefix`` in the repository archive, written flat into the
    folder ``into``; returns how many. Members are matched by base name; nothing else leaves
    the archive (no path from it is ever used to write)."""
    found = 0
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                parts = PurePosixPath(member.name).parts
                inside = PurePosixPath(*parts[1:]) if len(parts) > 1 else PurePosixPath()
                if not member.isfile() or inside.parent != PurePosixPath(src.prefix):
                    continue
                name = inside.name
                if name not in pinned and name != LICENCE_FILE:
                    continue
                stream = tar.extractfile(member)
                assert stream is not None
                data = stream.read()
                if name in pinned:
                    if hashlib.sha256(data).hexdigest() != pinned[name]:
                        raise TraceFetchError(f"{name}: not the pinned file (checksum differs)")
                    found += 1
                (into / name).write_bytes(data)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise TraceFetchError(f"{src.archive_url}: not a readable tar.gz ({exc})") from exc
    missing = sorted(set(pinned) - {p.name for p in into.iterdir()})
    if missing:
        raise TraceFetchError(
            f"{src.archive_url}: {len(missing)} pinned file(s) not under {src.prefix} "
            f"(first: {missing[0]})"
        )
    return found


def publish(files: Path, src: TraceSource, target: Path) -> None:
    """Move the checked files to ``target`` (a folder, or a tar.gz under ``archive_folder``),
    replacing nothing half-written: the result is built beside ``target`` and renamed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + ".partial")
    _remove(staging)
    if src.published.endswith(".tar.gz"):
        with tarfile.open(staging, "w:gz") as tar:
            for file in sorted(files.iterdir()):
                tar.add(file, arcname=f"{src.archive_folder}/{file.name}")
    elif PurePosixPath(src.published).suffix:  # one file, published as that file
        (only,) = (f for f in files.iterdir() if f.name != LICENCE_FILE)
        shutil.copyfile(only, staging)
    else:
        shutil.copytree(files, staging)
    _remove(target)
    staging.rename(target)


def _remove(path: Path) -> None:
    """``path`` gone, whether a folder, a file or nothing."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def get(
    src: TraceSource,
    folder: Path,
    url: str | None = None,
    pinned: dict[str, str] | None = None,
    progress: IO[str] | None = sys.stderr,
) -> Path:
    """Fetch ``src`` into ``folder`` (under its published name) unless an intact copy is
    there already; the trace's path. ``url`` / ``pinned``: another archive and manifest (a
    mirror; tests)."""
    pinned = src.manifest() if pinned is None else pinned
    target = folder / src.published
    if target.exists():
        try:
            verify(target, pinned)
            return target
        except TraceFetchError:
            pass  # fetch it again
    with tempfile.TemporaryDirectory(prefix="agentkv-trace-") as tmp:
        archive, files = Path(tmp) / "source.tar.gz", Path(tmp) / "files"
        files.mkdir()
        if progress is not None:
            print(f"{src.name}: downloading {url or src.archive_url}", file=progress)
        download(url or src.archive_url, archive, progress)
        found = extract(archive, src, pinned, files)
        publish(files, src, target)
    if progress is not None:
        print(f"{src.name}: {found} files checked against their pinned SHA-256", file=progress)
    return target


def listing(folder: Path) -> str:
    """Each known trace: what it is, its source and licence, and whether ``folder`` has it."""
    lines = []
    for src in SOURCES.values():
        path = folder / src.published
        state = "present" if path.exists() else "not fetched"
        lines.append(
            f"{src.name:<9} {src.what}\n"
            f"{'':<9} {src.repository} @ {src.commit}, {src.prefix}/ ({src.licence})\n"
            f"{'':<9} {path}: {state}"
        )
    return "\n".join(lines)
