"""The connector's own distribution: the wheel ``packaging/agentkv-connector/build.py`` makes,
installed alone beside vLLM (no editable project, no ``.pth`` files), registers the connector
through vLLM's plugin entry point and imports nothing it does not carry."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
PACKAGING = ROOT / "packaging" / "agentkv-connector"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, str(PACKAGING / "build.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    wheel = Path(built.stdout.strip().splitlines()[-1])
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert "connector/vllm_adapter.py" in names and "policyd/tiers/gpu.py" in names
    assert not any(n.startswith(("policyd/sim", "policyd/daemon", "ui/")) for n in names)
    return target


def run_isolated(target: Path, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` with the wheel's folder and vLLM's site-packages only: ``-S`` skips the
    ``.pth`` files that make this checkout importable in the vLLM venv."""
    site = sysconfig.get_paths()["purelib"]
    prelude = f"import sys; sys.path[:0] = [{str(target)!r}, {site!r}]\n"
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", prelude + code],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def test_the_plugin_entry_point_registers_the_connector_from_the_wheel(installed: Path) -> None:
    result = run_isolated(
        installed,
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "config = KVTransferConfig(kv_connector='AgentKVConnector', kv_role='kv_both')\n"
        "cls = KVConnectorFactory.get_connector_class(config)\n"
        "import connector.plugin\n"
        "connector.plugin.register()  # a second time: nothing happens\n"
        "print(cls.__name__, sys.modules[cls.__module__].__file__)\n",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    name, path = result.stdout.split()[-2:]
    assert name == "AgentKVConnector"
    assert Path(path).is_relative_to(installed)  # the wheel's, not this checkout's


def test_every_module_of_the_wheel_imports_from_the_wheel_alone(installed: Path) -> None:
    modules = sorted(
        ".".join(p.relative_to(installed).with_suffix("").parts).removesuffix(".__init__")
        for p in installed.rglob("*.py")
    )
    result = run_isolated(
        installed,
        f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
        "import importlib.util\nprint(importlib.util.find_spec('policyd.sim'))\n",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "None"  # nothing of the daemon or the simulator


def test_the_distribution_has_the_projects_version() -> None:
    ours = tomllib.loads((PACKAGING / "pyproject.toml").read_text())["project"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert ours["version"] == project["version"]
    assert ours["entry-points"]["vllm.general_plugins"]["agentkv"] == "connector.plugin:register"
