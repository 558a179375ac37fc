"""The daemon's HTTP API (docs/API.md): FastAPI, async handlers, Engine work in the threadpool.

``create_app(service)`` builds the app; ``policyd serve`` runs it with uvicorn, tests run it in a
thread. Errors are ``{"error": "..."}`` with a 4xx status; admin routes need
``Authorization: Bearer <token>`` when the service was given a token. ``GET /api/settings``
carries the tunables' JSON Schema (``policyd.daemon.settings.Tunables``); ``PUT`` documents its
body as ``TunablesChange``.

Fleet history: when the service has a ``fleet_history`` attribute (the segment source string,
``nats://host:port/bucket`` or a directory, that ``policyd.history.segments.SegmentExporter``
exports every replica's history into; None or absent: no fleet) ``POST /api/sql`` with
``"fleet": true`` runs the statement over every replica's segments
(``policyd.history.fleet_sql.query_fleet``: the same lockdown and limits, a ``replica`` column),
and ``GET /api/fleet`` says whether it can. ``fleet_cache_dir`` (optional, a path) is where
the segments are cached and the fleet's DuckDB file is built.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from policyd.core.http_errors import invalid_request
from policyd.daemon import views
from policyd.daemon.service import Service
from policyd.daemon.settings import TunablesChange, tunables_schema
from policyd.history import HistoryError, SqlRefused

T = TypeVar("T")
log = logging.getLogger(__name__)
U64 = Annotated[int, Field(ge=0, le=2**64 - 1)]
MAX_SQL_ROWS = 10_000
MAX_SETTINGS_BODY_BYTES = 64 * 1024  # a settings change is a few keys
MAX_ERRORS_SHOWN = 20
DECISION_KINDS = ("evict", "admit", "decline", "prefetch", "pin", "retire")
SETTINGS_SCHEMA = tunables_schema()  # GET /api/settings: what the dashboard's form is built from
SETTINGS_CHANGE_DOC = {  # PUT /api/settings's body in the OpenAPI document
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": TunablesChange.model_json_schema()}},
    }
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


class EvictBody(BaseModel):
    tier: Literal["gpu", "host"]
    candidates: list[U64]
    n_blocks: int = Field(ge=0)


class AdmitBody(BaseModel):
    request_id: str
    block_hashes: list[U64]


class PrefetchBody(BaseModel):
    budget_blocks: int = Field(ge=0, le=1_000_000)


class SqlBody(BaseModel):
    sql: str = Field(min_length=1, max_length=100_000)
    max_rows: int = Field(default=1000, ge=0, le=MAX_SQL_ROWS)
    format: Literal["json"] = "json"
    fleet: bool = False


def fleet_source(service: Service) -> str | None:
    """The service's fleet history source (``service.fleet_history``), None when it has none."""
    source = getattr(service, "fleet_history", None)
    return str(source) if source else None


def fleet_sql(service: Service, sql: str, max_rows: int) -> dict[str, Any]:
    """``POST /api/sql`` with ``fleet``: the statement over every replica's segments."""
    from policyd.history.fleet_sql import query_fleet  # noqa: PLC0415 - only when asked

    source = fleet_source(service)
    if source is None:
        raise ApiError(409, "this daemon was started without a fleet history source")
    cache_dir = getattr(service, "fleet_cache_dir", None)
    result, info = query_fleet(sql, source, cache_dir=cache_dir, max_rows=max_rows)
    return {
        "columns": result.columns,
        "rows": [list(r) for r in result.rows],
        "truncated": result.truncated,
        "elapsed_ms": result.elapsed_ms,
        "snapshot_ts": None,
        "fleet": {
            "replicas": info.replicas,
            "segments": info.segments,
            "prepare_ms": info.prepare_ms,
        },
    }


def _cut(message: str, limit: int = 400) -> str:
    """An error message cut to ``limit`` characters (it may quote a long bad value)."""
    return message if len(message) <= limit else f"{message[:limit]}... ({len(message)} chars)"


def _json_safe(value: object) -> object:
    """Values JSON can carry: non-finite floats become null, unknown types their str()."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return str(value)


def create_app(service: Service, *, token: str | None = None) -> FastAPI:
    """The API over ``service``; ``token`` defaults to the service's configured token."""
    token = token if token is not None else service.settings.token
    app = FastAPI(title="AgentKV policy daemon", version="1")
    latency = service.metrics.decision_latency

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": exc.message, **exc.extra}, status_code=exc.status)

    app.exception_handler(RequestValidationError)(invalid_request)

    @app.exception_handler(HistoryError)
    async def _history(request: Request, exc: HistoryError) -> JSONResponse:
        # the history process is down or its link is: say so at once (never hang)
        return JSONResponse(
            {"error": _cut(f"the history is not available: {exc}")}, status_code=503
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    token_bytes = (token or "").encode("utf-8")

    def admin(request: Request) -> None:
        if not token:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        # header values arrive decoded as latin-1: compare bytes (a str with non-ASCII
        # characters is a TypeError in compare_digest, which was a 500)
        given_bytes = given.strip().encode("latin-1", errors="replace")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given_bytes, token_bytes):
            raise ApiError(401, "this route needs 'Authorization: Bearer <token>'")

    async def call(fn: Callable[..., T], *args: Any) -> T:
        return await run_in_threadpool(fn, *args)

    async def timed(route: str, work: Awaitable[T]) -> T:
        started = time.perf_counter()
        try:
            return await work
        finally:
            latency.labels(route).observe(time.perf_counter() - started)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        body = await call(service.ready)
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/api/stats")
    async def stats() -> Any:
        return _json_safe(await call(views.stats, service))

    @app.get("/api/predictions")
    async def predictions(limit: int = Query(50, ge=0, le=500)) -> Any:
        return _json_safe(await call(views.predictions_view, service, limit))

    @app.get("/api/sizing")
    async def sizing() -> Any:
        return _json_safe(service.sizing_view)

    @app.get("/api/timeseries")
    async def timeseries(minutes: float = Query(60.0, gt=0, le=60 * 24 * 365)) -> Any:
        return _json_safe({"rows": await call(views.timeseries, service, minutes)})

    @app.get("/api/decisions")
    async def decisions(
        limit: int = Query(100, ge=1, le=1000),
        kind: str | None = None,
        q: str | None = Query(None, max_length=200),
    ) -> Any:
        if kind and kind not in DECISION_KINDS:
            raise ApiError(422, f"kind must be one of {', '.join(DECISION_KINDS)} (or empty)")
        kind, q = kind or None, q or None
        return _json_safe({"decisions": await call(views.decisions_view, service, limit, kind, q)})

    @app.post("/api/decide/evict")
    async def decide_evict(body: EvictBody) -> Any:
        return await timed(
            "evict", call(service.decide_evict, body.tier, body.candidates, body.n_blocks)
        )

    @app.post("/api/decide/admit")
    async def decide_admit(body: AdmitBody) -> Any:
        return await timed("admit", call(service.decide_admit, body.request_id, body.block_hashes))

    @app.post("/api/decide/prefetch")
    async def decide_prefetch(body: PrefetchBody) -> Any:
        return await timed("prefetch", call(service.decide_prefetch, body.budget_blocks))

    @app.get("/api/snapshot")
    async def snapshot() -> Any:
        return _json_safe(await call(views.snapshot_view, service))

    @app.post("/api/snapshot/publish", dependencies=[Depends(admin)])
    async def publish_snapshot() -> Any:
        try:
            return await call(service.publish_snapshot_now)
        except TimeoutError as exc:
            raise ApiError(503, str(exc)) from None

    def settings_body() -> dict[str, Any]:
        return {**views.settings_view(service), "schema": SETTINGS_SCHEMA}

    @app.get("/api/settings")
    async def get_settings() -> Any:
        return settings_body()

    # The body is read here, not by FastAPI: over 64 KiB it is a 413 before it is parsed, and a
    # refusal is a 400 with a message per key (the service validates with TunablesChange)
    @app.put("/api/settings", dependencies=[Depends(admin)], openapi_extra=SETTINGS_CHANGE_DOC)
    async def put_settings(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > MAX_SETTINGS_BODY_BYTES:
            raise ApiError(413, f"the body is over {MAX_SETTINGS_BODY_BYTES} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
            raise ApiError(400, 'the body must be a JSON object {"key": value, ...}') from None
        if not isinstance(body, dict) or not body:
            raise ApiError(400, 'the body must be a non-empty JSON object {"key": value, ...}')
        errors = await call(service.update_settings, body, "api")
        if errors:
            shown = list(errors.items())[:MAX_ERRORS_SHOWN]
            summary = "; ".join(f"{k}: {v}" for k, v in shown)
            if len(errors) > len(shown):
                summary += f"; and {len(errors) - len(shown)} more"
            raise ApiError(400, f"nothing applied: {summary}", errors=dict(shown))
        return settings_body()

    @app.get("/api/settings/history")
    async def settings_history(limit: int = Query(100, ge=1, le=1000)) -> Any:
        return _json_safe({"changes": await call(views.settings_history, service, limit)})

    sql_guard = [] if service.settings.sql_without_token else [Depends(admin)]

    @app.get("/api/fleet")
    async def fleet() -> Any:
        return {"enabled": fleet_source(service) is not None}

    @app.post("/api/sql", dependencies=sql_guard)
    async def sql(body: SqlBody) -> Any:
        run = fleet_sql if body.fleet else views.sql
        try:
            result = await call(run, service, body.sql, body.max_rows)
        except (SqlRefused, ValueError) as exc:  # (DuckDB's message may quote the query)
            raise ApiError(400, _cut(str(exc))) from None
        except HistoryError:  # its message names the file or the source: not for the API
            what = "the fleet's history segments are" if body.fleet else "the history snapshot is"
            log.warning("POST /api/sql: %s not readable", what, exc_info=True)
            raise ApiError(503, f"{what} not readable now; retry") from None
        return _json_safe(result)

    @app.post("/api/checkpoint", dependencies=[Depends(admin)])
    async def checkpoint_now() -> Any:
        return await call(service.save_checkpoint)

    @app.post("/api/history/publish", dependencies=[Depends(admin)])
    async def publish() -> Any:
        return await call(service.publish_history)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await call(service.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
