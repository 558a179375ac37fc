"""Fleet learning on real parts: a 3-node NATS cluster with JetStream (stream replicas 3) on
loopback and three `policyd serve --fleet` processes. Each replica serves its own workflow
type; during the replay one NATS node and one daemon are killed (SIGKILL) and restarted. In
the end every replica forecasts every type's workflows from the others' learning, no delta was
lost or applied twice (the sequence accounting is printed), and decisions answered throughout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from policyd.core.client import DaemonClient
from policyd.core.types import (
    BlocksStored,
    Event,
    RequestFinished,
    RequestStarted,
    WorkflowFinished,
)
from policyd.core.wire import Endpoints
from policyd.daemon.server import READY_PREFIX
from policyd.fleet.deltas import FleetLearning
from policyd.fleet.link import FleetLink
from policyd.fleet.router_service import RunningRouteService, start_route_service
from policyd.models.predictor import Predictor
from policyd.models.shards import Shards
from tests.nats_servers import NatsCluster
from tests.test_daemon_process import wait_for
from tests.test_fleet_routing import ThreadServer, load_proxy, upstream

TYPES = {  # replica -> the workflow type it serves and that type's agents, in order
    "r0": ("alpha", ("a-plan", "a-code", "a-test")),
    "r1": ("beta", ("b-search", "b-read", "b-write")),
    "r2": ("gamma", ("g-ask", "g-check", "g-answer")),
}


def workflow(replica: str, n: int) -> list[Event]:
    kind, agents = TYPES[replica]
    wid = f"{replica}-w{n}"
    events: list[Event] = []
    for i, agent in enumerate(agents):
        rid = f"{wid}.{i}"
        base = 1_000_000 * (1 + list(TYPES).index(replica)) + 100 * n  # the transcript grows
        blocks = tuple(range(base, base + 4 + i))
        events.append(
            RequestStarted(
                ts=float(i), request_id=rid, workflow_id=wid, agent=agent,
                workflow_type=kind, block_hashes=blocks, prompt_tokens=16 * len(blocks),
            )
        )  # fmt: skip
        events.append(BlocksStored(ts=float(i), tier="gpu", block_hashes=blocks, request_id=rid))
        events.append(RequestFinished(ts=float(i), request_id=rid, output_tokens=4))
    events.append(WorkflowFinished(ts=9.0, workflow_id=wid))
    return events


class Daemon:
    """One `policyd serve --fleet` process, restartable on the same files."""

    def __init__(self, root: Path, replica: str, fleet: str, endpoint: str) -> None:
        self.replica, self.fleet, self.endpoint = replica, fleet, endpoint
        self.segments = root / "segments"
        self.dir = root / replica
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}
        self.client: DaemonClient | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        cmd = [sys.executable, "-m", "policyd.cli", "serve", "--db", str(self.dir / "h.duckdb"),
               "--events", "tcp://127.0.0.1:*", "--snapshots", "tcp://127.0.0.1:*",
               "--http-port", "0", "--log-level", "WARNING", "--history-writer", "thread",
               "--fleet", self.fleet, "--replica", self.replica,
               "--fleet-stream-replicas", "3", "--fleet-interval-s", "0.2",
               "--checkpoint-interval-s", "0.5",
               "--fleet-endpoint", self.endpoint,
               "--fleet-history", str(self.segments),
               "--fleet-history-interval-s", "0.5"]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(READY_PREFIX):
                self.ready = json.loads(line[len(READY_PREFIX) :])
                return
        raise AssertionError(f"{self.replica} did not start")

    def kill(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def send(self, events: list[Event]) -> None:
        """Send ``events`` as one source of the daemon (a source per start: its sequence
        numbers start again with the process)."""
        if self.client is None:
            endpoints = Endpoints(events=self.ready["events"], snapshots=self.ready["snapshots"])
            self.client = DaemonClient(f"replay-{self.replica}-{self.starts}", endpoints)
        self.client.send_many(events)
        self.client.flush()

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.ready["http_url"], timeout=10)

    def fleet_stats(self) -> dict[str, Any]:
        with self.http() as http:
            stats: dict[str, Any] = http.get("/api/stats").json()["fleet"]
            return stats

    def next_agent(self, workflow_id: str) -> str | None:
        with self.http() as http:
            for w in http.get("/api/predictions").json()["workflows"]:
                if w["workflow_id"] == workflow_id and w["steps"]:
                    agents: dict[str, float] = w["steps"][0]["agents"]
                    return max(agents, key=lambda a: agents[a]) if agents else None
        return None


@contextmanager
def fleet(root: Path, url: str, endpoints: dict[str, str]) -> Iterator[dict[str, Daemon]]:
    daemons = {r: Daemon(root, r, url, endpoints[r]) for r in TYPES}
    try:
        for d in daemons.values():
            d.start()
        yield daemons
    finally:
        for d in daemons.values():
            d.kill()


@contextmanager
def replicas_behind_a_proxy(route_url: str) -> Iterator[tuple[dict[str, str], str]]:
    """A stand-in OpenAI server per replica (the main test venv has no vLLM; it answers with
    its replica's name) and the example routing proxy in front of them, asking ``route_url``."""
    ups = {r: ThreadServer(upstream(r)) for r in TYPES}
    endpoints = {r: server.url for r, server in ups.items()}
    proxy = ThreadServer(load_proxy().create_app(route_url, endpoints, route_timeout_s=2.0))
    try:
        yield endpoints, proxy.url
    finally:
        proxy.stop()
        for server in ups.values():
            server.stop()


@contextmanager
def routing(servers: list[str]) -> Iterator[RunningRouteService]:
    route = start_route_service(servers)
    try:
        yield route
    finally:
        route.stop()


def by_workflow(routed: Callable[[str, str], httpx.Response], replica: str, agent: str) -> bool:
    """Whether the proxy routed the call by the workflow's cached prefix to ``replica``. Each
    poll is a routed call, which counts as load on its replica until that replica's next
    residency report, so the reason and the replica are read from one answer: a holder made
    overloaded by the polls themselves is skipped until its next report."""
    answer = routed(replica, agent)
    return (
        answer.status_code == 200
        and answer.headers["x-agentkv-route"] == "workflow-prefix"
        and answer.json()["replica"] == replica
    )


def forecasts(daemon: Daemon, workflow_id: str) -> bool:
    return daemon.next_agent(workflow_id) is not None


def decision_latency_s(daemon: Daemon) -> float:
    with daemon.http() as http:
        t0 = time.monotonic()
        reply = http.post("/api/decide/evict", json={"tier": "gpu", "candidates": [1, 2, 3],
                                                     "n_blocks": 1})  # fmt: skip
        assert reply.status_code == 200, reply.text
        return time.monotonic() - t0


def settled(daemons: dict[str, Daemon]) -> bool:
    """Every outbox empty, and every replica applied the same last delta of every other
    replica's incarnations (origins are ``replica/incarnation``)."""
    stats = {r: d.fleet_stats() for r, d in daemons.items()}
    if any(s["outbox"] or not s["connected"] for s in stats.values()):
        return False
    latest: dict[str, int] = {}
    for s in stats.values():
        for origin, number in s["origins"].items():
            latest[origin] = max(latest.get(origin, -1), number)
    return all(
        stats[r]["origins"].get(origin) == number
        for r in stats
        for origin, number in latest.items()
        if not origin.startswith(f"{r}/")
    )


def test_fleet_learning_survives_a_nats_node_and_a_daemon_killed(tmp_path: Path) -> None:
    with (
        NatsCluster(tmp_path / "nats", nodes=3) as cluster,
        routing(cluster.urls) as route,
        replicas_behind_a_proxy(route.url) as (endpoints, proxy_url),
        fleet(tmp_path, cluster.url, endpoints) as ds,
    ):
        for n in range(20):
            for r, d in ds.items():
                d.send(workflow(r, n))
        assert wait_for(lambda: all(d.fleet_stats()["applied"] >= 2 for d in ds.values()), 60)

        cluster.stop_node(0, kill=True)  # a NATS node dies; the stream keeps a quorum of 2
        latencies = []
        for n in range(20, 40):
            for r, d in ds.items():
                d.send(workflow(r, n))
            latencies.append(decision_latency_s(ds["r1"]))
        ds["r2"].kill()  # a daemon dies mid-replay (its last checkpoint is at most 0.5 s old)
        for n in range(40, 50):
            ds["r0"].send(workflow("r0", n))
            latencies.append(decision_latency_s(ds["r0"]))
        ds["r2"].start()
        cluster.restart_node(0)
        for n in range(50, 60):
            for r, d in ds.items():
                d.send(workflow(r, n))

        assert wait_for(lambda: settled(ds), 90), {r: d.fleet_stats() for r, d in ds.items()}
        stats = {r: d.fleet_stats() for r, d in ds.items()}
        print("\nsequence accounting per replica:")
        for r, s in stats.items():
            print(f"  {r}: published {s['published']} (JetStream duplicates "
                  f"{s['publish_duplicates']}), applied {s['applied']}, through stream seq "
                  f"{s['applied_through']}, duplicates skipped {s['duplicates']}, own skipped "
                  f"{s['own']}, gaps {s['gaps']}, origins {s['origins']}")  # fmt: skip
        print(f"  decision latency during the outages: max {max(latencies) * 1000:.0f} ms")
        for r, s in stats.items():
            assert s["gaps"] == 0, (r, s)  # no delta lost
            assert s["undecodable"] == 0
        for r in ("r0", "r1"):  # never restarted: each delta of every origin applied once
            s = stats[r]
            others = {o: n for o, n in s["origins"].items() if not o.startswith(f"{r}/")}
            assert s["applied"] == sum(n + 1 for n in others.values()), (r, s)
        assert stats["r2"]["incarnation"] != ""  # restarted: a new incarnation publishes

        # the router's index, from every replica's residency: the next call of a running
        # workflow, sent to the example proxy, reaches the replica holding its transcript
        for r, d in ds.items():
            d.send(workflow(r, 99)[:3])  # its first call, stored and finished; more to come

        def routed(r: str, agent: str) -> httpx.Response:
            return httpx.post(
                f"{proxy_url}/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "next"}]},
                headers={"X-Workflow-Id": f"{r}-w99", "X-Agent": agent},
                timeout=10,
            )

        for r, (_, agents) in TYPES.items():
            assert wait_for(partial(by_workflow, routed, r, agents[1]), 20), httpx.get(
                f"{route.url}/replicas"
            ).text[:2000]

        # the fleet's history in one statement, after the recovery: each replica's rows as
        # that replica's own SQL counts them
        own = {}
        for r, d in ds.items():
            with d.http() as http:
                assert http.post("/api/history/publish").status_code == 200
                own[r] = http.post("/api/sql", json={"sql": "SELECT count(*) FROM requests"}
                                   ).json()["rows"][0][0]  # fmt: skip
        sql = "SELECT replica, count(*) FROM requests GROUP BY 1 ORDER BY 1"

        def fleet_counts() -> dict[str, int]:
            result = subprocess.run(
                [sys.executable, "-m", "policyd.cli", "sql", "--fleet", str(ds["r0"].segments),
                 "--cache-dir", str(tmp_path / "sql-cache"), "--format", "json", sql],
                capture_output=True, text=True, check=False, timeout=60,
            )  # fmt: skip
            if result.returncode != 0:
                return {}
            return {
                row["replica"]: row["count_star()"] for row in json.loads(result.stdout)["rows"]
            }

        assert wait_for(lambda: fleet_counts() == own, 30), (fleet_counts(), own)
        print(f"  fleet SQL after recovery: requests per replica {own}")

        # every replica now forecasts the types it never served, from the fleet's counts
        for r, d in ds.items():
            probes = []
            for other, (kind, agents) in TYPES.items():
                wid = f"probe-{r}-{other}"
                d.send([RequestStarted(ts=0.0, request_id=f"{wid}.0", workflow_id=wid,
                                       agent=agents[0], workflow_type=kind)])  # fmt: skip
                probes.append((wid, agents[1]))
            for wid, expected in probes:
                assert wait_for(partial(forecasts, d, wid), 20), (r, wid)
                assert d.next_agent(wid) == expected, (r, wid)
        assert max(latencies) < 5.0  # never stalled on NATS (a liveness bound, not a speed)


def test_a_replica_cut_off_from_nats_keeps_learning_and_catches_up(tmp_path: Path) -> None:
    """All of NATS away: both links keep their daemons' models usable (merges and learning
    take the lock only briefly, never across the network); what one replica learnt meanwhile
    reaches the other once the server is back, through the durable consumer, once."""
    with NatsCluster(tmp_path / "nats", nodes=1) as cluster:
        predictors = {r: Predictor(roll_out_unserved=False) for r in ("a", "b")}
        shards = {r: Shards(rate=1.0) for r in ("a", "b")}
        locks = {r: threading.RLock() for r in ("a", "b")}
        links = {
            r: FleetLink(
                cluster.urls,
                r,
                FleetLearning(predictors[r], partial(shards.__getitem__, r)),
                locks[r],
                interval_s=0.1,
            )
            for r in ("a", "b")
        }
        for link in links.values():
            link.start()
        try:
            assert wait_for(lambda: all(link.connected for link in links.values()), 20)
            cluster.stop_node(0)
            assert wait_for(lambda: not links["a"].connected, 20)
            with locks["a"]:  # replica a serves a type b never saw, while NATS is away
                for w in range(20):
                    for ts, agent in enumerate(("x-plan", "x-act", "x-check")):
                        predictors["a"].observe_call(f"w{w}", "x", agent, {}, float(ts))
                    predictors["a"].observe_finished(f"w{w}")
            t0 = time.monotonic()
            with locks["b"]:  # b's lock is free: its daemon decides as usual
                assert time.monotonic() - t0 < 1.0
            cluster.restart_node(0)
            assert wait_for(lambda: links["b"].stats()["applied"] >= 1, 30), links["b"].stats()
            with locks["b"]:
                predictors["b"].observe_call("new", "x", "x-plan", {}, 0.0)
                assert predictors["b"].predict("new").top(1) == "x-act"
            assert links["b"].stats()["gaps"] == 0 and links["a"].stats()["outbox"] == 0
        finally:
            for link in links.values():
                link.stop()
