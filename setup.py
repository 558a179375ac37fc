"""The optional compiled build of the predictor (everything else is in pyproject.toml).

``AGENTKV_COMPILE=1 pip install .`` (or ``-e .``) compiles the predictor's modules
(``policyd/models/predictor/*.py`` but its ``__init__``) with Cython, unchanged: the same source and
the same arithmetic, about a quarter less CPU per call (``make bench-predictor`` measures both
builds side by side). Without it, or where a module has changed since it was compiled (an
editable checkout), the interpreted source runs (``policyd.models.predictor.BUILD`` says which).
The Docker image is built compiled; ``make setup`` is not, so that edits need no rebuild.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from setuptools import Extension, setup

PACKAGE = Path("policyd") / "models" / "predictor"
SOURCES = (
    "compiled-sources.json"  # as policyd.models.predictor.SOURCES reads it (module -> SHA-256)
)


def compiled() -> list[Extension]:
    if os.environ.get("AGENTKV_COMPILE", "0") in ("", "0"):
        return []
    from Cython.Build import cythonize  # noqa: PLC0415  (a build requirement, needed here only)

    modules = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    digests = {p.stem: hashlib.sha256(p.read_bytes()).hexdigest() for p in modules}
    (PACKAGE / SOURCES).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    # annotation_typing off: annotations stay hints, as in CPython (no C-typed arguments that
    # would refuse what the interpreter accepts); the speed is the interpreter's dispatch gone
    extensions: list[Extension] = cythonize(
        [Extension(f"policyd.models.predictor.{p.stem}", [str(p)]) for p in modules],
        build_dir="build/cython",  # (the generated C, out of the package)
        compiler_directives={"language_level": 3, "annotation_typing": False},
        quiet=True,
    )
    return extensions


setup(
    ext_modules=compiled(),
    # (the only package-data declaration: one in pyproject.toml would replace this one)
    package_data={"policyd.models.predictor": [SOURCES], "policyd.traces": ["manifests/*.json"]},
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
