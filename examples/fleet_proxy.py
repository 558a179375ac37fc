"""A minimal OpenAI-compatible proxy that routes each call by AgentKV's route service.

    python examples/fleet_proxy.py --route http://127.0.0.1:8480 \\
        --replica r1=http://10.0.0.1:8000 --replica r2=http://10.0.0.2:8000 --listen 0.0.0.0:8000

``POST /v1/completions`` and ``POST /v1/chat/completions``: the proxy reads the call's workflow
and agent the way the connector does (docs/CONNECTOR.md): the body's ``kv_transfer_params``
(``workflow_id``, ``agent``), then an ``X-Workflow-Id`` / ``X-Agent`` header, then the body's
``metadata`` or ``extra_body`` keys of the same names, then the session id (body ``session_id``
or ``X-Session-ID``) as the workflow. Tags found outside ``kv_transfer_params`` are copied into
it, so the replica's connector sees the same workflow. It asks the route service
(``GET /route``), forwards the body unchanged otherwise to the chosen replica's endpoint (the
one its full state announced, else ``--replica``'s URL of that name) and returns or streams the
answer, with ``X-AgentKV-Replica`` and ``X-AgentKV-Route`` headers saying where and why.

Routing never fails a request: with the route service down, slow (``--route-timeout``), or
naming a replica it cannot reach, the call goes round-robin over the ``--replica`` list (and,
when a routed replica refuses the connection, once more to the next one). A call without any
workflow tag is routed round-robin too. ``GET /healthz`` answers the proxy's own health.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from policyd.fleet.router_service import AsyncRouteClient, RouteUnavailableError, parse_listen

log = logging.getLogger("fleet_proxy")

HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


def _text(value: object) -> str | None:
    if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
        return str(value)[:256]
    return None


def call_tags(body: Mapping[str, Any], headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The call's (workflow_id, agent), from the first place that names each."""
    params = body.get("kv_transfer_params")
    places: list[Mapping[str, Any]] = [params if isinstance(params, Mapping) else {}]
    places.append({"workflow_id": headers.get("x-workflow-id"), "agent": headers.get("x-agent")})
    for key in ("metadata", "extra_body"):
        extra = body.get(key)
        if isinstance(extra, Mapping):
            places.append(extra)
            inner = extra.get("kv_transfer_params")
            if isinstance(inner, Mapping):
                places.append(inner)
    workflow = next((w for p in places if (w := _text(p.get("workflow_id")))), None)
    agent = next((a for p in places if (a := _text(p.get("agent")))), None)
    if workflow is None:
        workflow = _text(body.get("session_id")) or _text(headers.get("x-session-id"))
    return workflow, agent


def tagged(body: dict[str, Any], workflow_id: str | None, agent: str | None) -> dict[str, Any]:
    """``body`` with the workflow and agent in ``kv_transfer_params`` (where the connector
    reads them), adding only what is missing there."""
    params = body.get("kv_transfer_params")
    params = dict(params) if isinstance(params, Mapping) else {}
    changed = False
    for key, value in (("workflow_id", workflow_id), ("agent", agent)):
        if value is not None and not _text(params.get(key)):
            params[key] = value
            changed = True
    return {**body, "kv_transfer_params": params} if changed else body


class Upstreams:
    """The replicas' endpoints: the static ``--replica`` list (the round-robin fallback) and
    those the route service announced. Used on one event loop."""

    def __init__(self, replicas: Mapping[str, str]) -> None:
        self.static = {name: url.rstrip("/") for name, url in replicas.items()}
        self._turn = itertools.count()

    def endpoint(self, replica: str, announced: str) -> str | None:
        return announced.rstrip("/") or self.static.get(replica)

    def next(self, avoid: str | None = None) -> tuple[str, str]:
        """The next (name, endpoint) in turn, avoiding ``avoid`` when there is another."""
        names = sorted(self.static)
        if not names:
            raise LookupError("no --replica to fall back on")
        for _ in range(len(names)):
            name = names[next(self._turn) % len(names)]
            if name != avoid or len(names) == 1:
                return name, self.static[name]
        return names[0], self.static[names[0]]


def create_app(
    route_url: str | None,
    replicas: Mapping[str, str],
    *,
    route_timeout_s: float = 0.3,
    upstream_timeout_s: float = 600.0,
) -> FastAPI:
    """The proxy: ``route_url`` None routes round-robin only."""
    upstreams = Upstreams(replicas)
    router = AsyncRouteClient(route_url, timeout_s=route_timeout_s) if route_url else None
    client = httpx.AsyncClient(timeout=httpx.Timeout(upstream_timeout_s, connect=2.0))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.aclose()
            if router is not None:
                await router.aclose()

    app = FastAPI(title="AgentKV fleet proxy", lifespan=lifespan)

    async def choose(workflow_id: str | None, agent: str | None) -> tuple[str, str, str]:
        """(replica, endpoint, reason) for one call; never raises but LookupError when
        neither the route service nor ``--replica`` names any replica."""
        if router is not None and workflow_id is not None:
            try:
                decision = await router.route(workflow_id, agent)
            except RouteUnavailableError as exc:
                log.warning("routing round-robin: %s", exc)
            else:
                endpoint = upstreams.endpoint(decision.replica, decision.endpoint)
                if endpoint:
                    return decision.replica, endpoint, decision.reason or "routed"
                log.warning("no endpoint for replica %s: round-robin", decision.replica)
        name, endpoint = upstreams.next()
        return name, endpoint, "fallback"

    async def forward(path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "the body is not a JSON object"}, status_code=400)
        workflow_id, agent = call_tags(body, request.headers)
        body = tagged(body, workflow_id, agent)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            replica, endpoint, reason = await choose(workflow_id, agent)
        except LookupError as exc:
            return JSONResponse({"error": str(exc)}, status_code=503)
        for attempt in range(2):
            upstream = client.build_request("POST", f"{endpoint}{path}", json=body, headers=headers)
            try:
                response = await client.send(upstream, stream=True)
            except httpx.ConnectError as exc:
                if attempt == 1 or not upstreams.static:
                    return JSONResponse(
                        {"error": f"replica {replica} unreachable: {exc}"}, status_code=502
                    )
                log.warning("replica %s unreachable (%s): round-robin", replica, exc)
                replica, endpoint = upstreams.next(avoid=replica)
                reason = "fallback"
                continue
            except httpx.HTTPError as exc:
                return JSONResponse({"error": f"replica {replica}: {exc}"}, status_code=502)
            break
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
        out_headers["x-agentkv-replica"] = replica
        out_headers["x-agentkv-route"] = reason

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(
            relay(),
            status_code=response.status_code,
            headers=out_headers,
            media_type=response.headers.get("content-type"),
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("/v1/chat/completions", request)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "route": route_url, "replicas": sorted(upstreams.static)}

    return app


def parse_replicas(values: Sequence[str]) -> dict[str, str]:
    """``name=url`` pairs -> {name: url}."""
    replicas: dict[str, str] = {}
    for value in values:
        name, sep, url = value.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--replica wants name=url, not {value!r}")
        replicas[name] = url
    return replicas


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--route", default="http://127.0.0.1:8480", help="the route service")
    parser.add_argument(
        "--replica", action="append", default=[], help="name=url of a replica (repeat)"
    )
    parser.add_argument("--listen", default="127.0.0.1:8000")
    parser.add_argument("--route-timeout", type=float, default=0.3)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        replicas = parse_replicas(args.replica)
        host, port = parse_listen(args.listen)
    except ValueError as exc:
        print(f"fleet_proxy: {exc}", file=sys.stderr)
        return 2
    app = create_app(args.route or None, replicas, route_timeout_s=args.route_timeout)
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
