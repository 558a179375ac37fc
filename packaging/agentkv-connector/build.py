"""Build the ``agentkv-connector`` wheel: stage the connector's modules and the vocabulary they
import beside ``pyproject.toml``, then ``pip wheel`` it (no network: the running interpreter's
setuptools builds it).

    python packaging/agentkv-connector/build.py --out dist/

The module lists below are the distribution's contents; ``tests/vllm/test_plugin.py`` imports
every one of them from the installed wheel alone, so a new import outside them fails there.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# what vLLM's scheduler and workers load (the replay and benchmark tools need the simulator)
CONNECTOR_MODULES: Final = (
    "__init__", "copy_plan", "deferred", "events", "params", "plugin", "runtime", "trace_file",
    "vllm_adapter",
)  # fmt: skip
PACKAGE: Final = ("__init__",)
VOCABULARY: Final = ("__init__", "types", "wire", "client")  # policyd/core
TIERS: Final = ("__init__", "budget", "gpu", "host_order", "view")


def stage(into: Path) -> None:
    shutil.copyfile(HERE / "pyproject.toml", into / "pyproject.toml")
    for package, names in (
        ("connector", CONNECTOR_MODULES),
        ("policyd", PACKAGE),
        ("policyd/core", VOCABULARY),
        ("policyd/tiers", TIERS),
    ):
        (into / package).mkdir(parents=True)
        for name in names:
            shutil.copyfile(ROOT / package / f"{name}.py", into / package / f"{name}.py")


def build(out: Path) -> Path:
    """The wheel's path, under ``out`` (a wheel of the same name there is replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="agentkv-connector-") as tmp:
        staged, wheels = Path(tmp) / "src", Path(tmp) / "wheels"
        staged.mkdir()
        stage(staged)
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "--quiet", "--wheel-dir", str(wheels), str(staged)],
            check=True,
        )  # fmt: skip
        (wheel,) = wheels.glob("*.whl")
        return Path(shutil.move(wheel, out / wheel.name))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "dist", help="folder for the wheel")
    args = ap.parse_args(argv)
    print(build(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
