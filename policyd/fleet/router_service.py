"""``policyd route``: the fleet's routing service, over NATS and HTTP.

It subscribes to every replica's residency (core NATS subject ``agentkv.residency.>``,
published by each daemon's fleet link from its ``ResidencyFeed``), keeps the ``PrefixIndex``
and answers routers over HTTP:

* ``GET /route?workflow_id=W[&agent=A][&next_agent=B]`` -> ``{"replica", "endpoint",
  "prefix_blocks", "reason", "stage", "router"}``: where the workflow's next call goes and where
  to stage the predicted next agent (``next_agent``, else ``agent``); ``POST /route`` takes the
  same as JSON plus ``block_hashes`` (the call's own, for ``--router prefix``); 503 when no
  replica is live;
* ``GET /replicas``: each replica's endpoint, resident blocks per tier, load, last update
  number, gaps, whether it is stale (a gap not yet healed by a full state) and age;
* ``GET /healthz``: whether NATS is connected and how many replicas are live.

A replica is live while its last message is younger than ``replica_ttl_s`` (full states come
every few seconds); one silent for ``forget_after_s`` is dropped with its workflows. A
replica's load is its ``running`` requests as last reported plus the calls routed to it since
that report (what its report cannot count yet).

Everything (NATS callbacks, HTTP handlers) runs on one asyncio loop, so the index and the
router are touched by one thread only. ``RouteClient`` is the routers' HTTP client.

Run: ``python -m policyd.fleet.router_service --fleet nats://127.0.0.1:4222 --listen
127.0.0.1:8480 --router workflow``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import httpx
import nats
import uvicorn
from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from policyd.core.http_errors import invalid_request
from policyd.fleet.residency import SUBJECT_PREFIX, ResidencyError, decode
from policyd.fleet.routing import (
    ROUTERS,
    Decision,
    NoReplicaError,
    PrefixIndex,
    RouteQuery,
    Router,
    SessionSticky,
    WorkflowAware,
    make_router,
)

log = logging.getLogger(__name__)

SUBSCRIPTION: Final = f"{SUBJECT_PREFIX}.>"
REPLICA_TTL_S: Final = 10.0
FORGET_AFTER_S: Final = 300.0
MAX_ID_CHARS: Final = 256
U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]


def parse_servers(url: str) -> list[str]:
    """``nats://a:4222,nats://b:4222`` (or ``a:4222,b:4222``) -> the server URLs."""
    servers = [s.strip() for s in url.split(",") if s.strip()]
    if not servers:
        raise ValueError("no NATS server given")
    return [s if "://" in s else f"nats://{s}" for s in servers]


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:port`` for IPv6) -> (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--listen wants host:port, not {listen!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass
class Counters:
    messages: int = 0
    invalid: int = 0
    ignored: int = 0
    routed: int = 0


@dataclass
class RouteState:
    """The index, the router and the replicas' loads; one owner (the service's loop)."""

    router_name: str = "workflow"
    replica_ttl_s: float = REPLICA_TTL_S
    forget_after_s: float = FORGET_AFTER_S
    clock: Callable[[], float] = time.monotonic
    index: PrefixIndex = field(init=False)
    router: Router = field(init=False)
    counters: Counters = field(default_factory=Counters)
    _routed_since: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = PrefixIndex(clock=self.clock)
        self.router = make_router(self.router_name, self.index)

    def on_message(self, subject: str, data: bytes) -> None:
        """One NATS message on ``agentkv.residency.<replica>``; bad ones are counted."""
        self.counters.messages += 1
        replica = subject[len(SUBJECT_PREFIX) + 1 :]
        try:
            message = decode(data)
        except ResidencyError as exc:
            self.counters.invalid += 1
            log.debug("invalid residency message on %s: %s", subject, exc)
            return
        if self.index.apply(replica, message):
            self._routed_since.pop(replica, None)
        else:
            self.counters.ignored += 1

    def live(self) -> list[str]:
        """The replicas heard from within ``replica_ttl_s``; forgets long-silent ones."""
        now = self.clock()
        alive = []
        for name, view in list(self.index.replicas.items()):
            age = now - view.seen_s
            if age > self.forget_after_s:
                self.index.drop_replica(name)
                self._routed_since.pop(name, None)
            elif age <= self.replica_ttl_s:
                alive.append(name)
        return alive

    def loads(self) -> dict[str, float]:
        """Each live replica's outstanding work (reported running + routed since)."""
        replicas = self.index.replicas
        return {
            name: float(replicas[name].running + self._routed_since.get(name, 0))
            for name in self.live()
        }

    def route(
        self,
        workflow_id: str,
        agent: str | None = None,
        next_agent: str | None = None,
        block_hashes: Sequence[int] = (),
        prompt_tokens: int = 0,
    ) -> Decision:
        """Route one call; ``NoReplicaError`` when no replica is live."""
        loads = self.loads()
        query = RouteQuery(workflow_id, agent, tuple(block_hashes), prompt_tokens)
        decision = self.router.choose(query, loads)
        self._routed_since[decision.replica] = self._routed_since.get(decision.replica, 0) + 1
        self.counters.routed += 1
        loads[decision.replica] = loads.get(decision.replica, 0.0) + 1.0
        stage: str | None = None
        if isinstance(self.router, WorkflowAware):
            stage = self.router.stage_for(workflow_id, next_agent or agent, loads)
        elif isinstance(self.router, SessionSticky):
            stage = decision.replica
        view = self.index.replicas.get(decision.replica)
        return Decision(
            decision.replica,
            decision.prefix_blocks,
            decision.reason,
            endpoint=view.endpoint if view is not None else "",
            stage=stage,
        )

    def replicas_report(self) -> list[dict[str, Any]]:
        now = self.clock()
        live = set(self.live())
        return [
            {
                "replica": name,
                "endpoint": view.endpoint,
                "live": name in live,
                "gpu_blocks": len(view.gpu),
                "host_blocks": len(view.host),
                "running": view.running,
                "load": view.running + self._routed_since.get(name, 0),
                "seq": view.seq,
                "epoch": view.epoch,
                "stale": view.stale,
                "full_seen": view.full_seen,
                "gaps": view.gaps,
                "age_s": round(now - view.seen_s, 3),
            }
            for name, view in sorted(self.index.replicas.items())
        ]


class ResidencySubscriber:
    """One NATS connection subscribed to ``agentkv.residency.>``, delivering each message to
    ``on_message(subject, data)`` on the loop that ``start`` ran on. It retries the first
    connection until it succeeds and reconnects forever after; never raises to its caller."""

    def __init__(
        self,
        servers: list[str],
        on_message: Callable[[str, bytes], None],
        *,
        retry_s: float = 0.5,
    ) -> None:
        self.servers = servers
        self.on_message = on_message
        self.retry_s = retry_s
        self._nc: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        return self._nc is not None and bool(self._nc.is_connected)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._connect(), name="residency-subscriber")

    async def _connect(self) -> None:
        async def deliver(msg: Any) -> None:
            self.on_message(msg.subject, msg.data)

        async def on_error(exc: Exception) -> None:
            log.debug("NATS: %s", exc)

        while True:
            try:
                nc = await nats.connect(
                    servers=self.servers,
                    name="agentkv-route",
                    connect_timeout=2,
                    reconnect_time_wait=self.retry_s,
                    max_reconnect_attempts=-1,
                    error_cb=on_error,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("NATS %s not reachable (%s); retrying", ",".join(self.servers), exc)
                await asyncio.sleep(self.retry_s)
                continue
            self._nc = nc
            await nc.subscribe(SUBSCRIPTION, cb=deliver)
            return

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.close(), timeout=2.0)
            self._nc = None


class RouteBody(BaseModel):
    workflow_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    agent: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    next_agent: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    block_hashes: list[U64] = Field(default_factory=list, max_length=1_000_000)
    prompt_tokens: int = Field(default=0, ge=0)


def _answer(state: RouteState, body: RouteBody) -> JSONResponse:
    try:
        d = state.route(
            body.workflow_id, body.agent, body.next_agent, body.block_hashes, body.prompt_tokens
        )
    except NoReplicaError as exc:
        return JSONResponse({"error": str(exc)}, status_code=503)
    return JSONResponse(
        {
            "replica": d.replica,
            "endpoint": d.endpoint,
            "prefix_blocks": d.prefix_blocks,
            "reason": d.reason,
            "stage": d.stage,
            "router": state.router.name,
        }
    )


def create_app(state: RouteState, subscriber: ResidencySubscriber | None = None) -> FastAPI:
    """The HTTP API over ``state``; ``subscriber`` (if any) runs for the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if subscriber is not None:
            await subscriber.start()
        try:
            yield
        finally:
            if subscriber is not None:
                await subscriber.stop()

    app = FastAPI(title="AgentKV fleet router", version="1", lifespan=lifespan)

    app.exception_handler(RequestValidationError)(invalid_request)

    @app.get("/route")
    async def route_get(
        workflow_id: Annotated[str, Query(min_length=1, max_length=MAX_ID_CHARS)],
        agent: Annotated[str | None, Query(max_length=MAX_ID_CHARS)] = None,
        next_agent: Annotated[str | None, Query(max_length=MAX_ID_CHARS)] = None,
        prompt_tokens: Annotated[int, Query(ge=0)] = 0,
    ) -> JSONResponse:
        body = RouteBody(
            workflow_id=workflow_id,
            agent=agent,
            next_agent=next_agent,
            prompt_tokens=prompt_tokens,
        )
        return _answer(state, body)

    @app.post("/route")
    async def route_post(body: RouteBody) -> JSONResponse:
        return _answer(state, body)

    @app.get("/replicas")
    async def replicas() -> dict[str, Any]:
        return {"replicas": state.replicas_report()}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        c = state.counters
        return {
            "ok": True,
            "nats": subscriber.connected if subscriber is not None else None,
            "router": state.router.name,
            "replicas": len(state.live()),
            "messages": c.messages,
            "invalid": c.invalid,
            "ignored": c.ignored,
            "routed": c.routed,
        }

    return app


@dataclass
class RunningRouteService:
    """A route service serving on a background thread; ``stop()`` shuts it down."""

    state: RouteState
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10.0)

    def __enter__(self) -> RunningRouteService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def start_route_service(
    servers: list[str] | None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    router: str = "workflow",
    replica_ttl_s: float = REPLICA_TTL_S,
) -> RunningRouteService:
    """Serve on a background thread (``servers`` None: no NATS, the state fed by hand);
    returns once it listens."""
    state = RouteState(router, replica_ttl_s=replica_ttl_s)
    subscriber = ResidencySubscriber(servers, state.on_message) if servers else None
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    config = uvicorn.Config(
        create_app(state, subscriber), log_level="warning", access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="policyd-route", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 15.0
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    if not server.started:
        server.should_exit = True
        raise RuntimeError("the route service did not start")
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return RunningRouteService(state, f"http://{shown}:{bound_port}", server, thread)


class RouteUnavailableError(RuntimeError):
    """The route service did not answer (down, slow, no live replica, bad answer)."""


def _params(workflow_id: str, agent: str | None, next_agent: str | None) -> dict[str, str]:
    params = {"workflow_id": workflow_id}
    if agent:
        params["agent"] = agent
    if next_agent:
        params["next_agent"] = next_agent
    return params


def _decision(response: httpx.Response) -> Decision:
    response.raise_for_status()
    body = response.json()
    stage = body.get("stage")
    return Decision(
        str(body["replica"]),
        int(body.get("prefix_blocks", 0)),
        str(body.get("reason", "")),
        endpoint=str(body.get("endpoint") or ""),
        stage=str(stage) if stage is not None else None,
    )


_FAILURES: Final = (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError)


class RouteClient:
    """A router's client of the route service: ``route(workflow_id, agent)`` -> ``Decision``
    (with the replica's ``endpoint`` and the ``stage`` replica filled).

    Thread-safe (one ``httpx.Client``, which is); every failure is ``RouteUnavailableError``,
    so a caller falls back with one ``except``. ``timeout_s`` bounds each call."""

    def __init__(self, base_url: str, *, timeout_s: float = 0.5) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s)

    def route(
        self, workflow_id: str, agent: str | None = None, next_agent: str | None = None
    ) -> Decision:
        try:
            response = self._client.get("/route", params=_params(workflow_id, agent, next_agent))
            return _decision(response)
        except _FAILURES as exc:
            raise RouteUnavailableError(f"route service {self.base_url}: {exc}") from exc

    def close(self) -> None:
        self._client.close()


class AsyncRouteClient:
    """``RouteClient`` for asyncio callers (a proxy's handlers); use it on one event loop."""

    def __init__(self, base_url: str, *, timeout_s: float = 0.5) -> None:
        self.base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def route(
        self, workflow_id: str, agent: str | None = None, next_agent: str | None = None
    ) -> Decision:
        try:
            params = _params(workflow_id, agent, next_agent)
            return _decision(await self._client.get("/route", params=params))
        except _FAILURES as exc:
            raise RouteUnavailableError(f"route service {self.base_url}: {exc}") from exc

    async def aclose(self) -> None:
        await self._client.aclose()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="policyd route", description="The fleet's workflow-aware routing service."
    )
    parser.add_argument(
        "--fleet",
        default="nats://127.0.0.1:4222",
        help="NATS servers, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--listen", default="127.0.0.1:8480", help="HTTP host:port (default %(default)s)"
    )
    parser.add_argument("--router", choices=ROUTERS, default="workflow")
    parser.add_argument(
        "--replica-ttl",
        type=float,
        default=REPLICA_TTL_S,
        help="seconds of silence after which a replica takes no calls (default %(default)s)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``policyd route``: serve until interrupted."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        servers = parse_servers(args.fleet)
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        print(f"policyd route: {exc}")
        return 2
    state = RouteState(args.router, replica_ttl_s=args.replica_ttl)
    app = create_app(state, ResidencySubscriber(servers, state.on_message))
    log.info("routing (%s) on http://%s:%d, fleet %s", args.router, host, port, args.fleet)
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
