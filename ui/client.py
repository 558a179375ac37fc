"""The dashboard's client for the daemon's HTTP API (docs/API.md): the only way the UI sees data.

Every call has a short timeout, and every failure becomes one of a few typed errors
(``DaemonUnreachableError``, ``DaemonTimeoutError``, ``DaemonRejectedError``,
``DaemonFailedError``, all ``ApiError``) whose message a page shows as a banner: the dashboard
never shows a traceback because the daemon is down, slow or refuses a request. The DuckDB history
belongs to the daemon, so there is no database access here, only HTTP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import httpx

DEFAULT_API_URL: Final = "http://127.0.0.1:8470"
CONNECT_TIMEOUT_S: Final = 2.0
READ_TIMEOUT_S: Final = 5.0
SQL_READ_TIMEOUT_S: Final = 15.0  # the daemon's own SQL limit is a few seconds; leave it room

Json = dict[str, Any]


class ApiError(Exception):
    """A call to the daemon failed; ``str(err)`` is a message fit for a banner."""

    title = "Daemon error"

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class DaemonUnreachableError(ApiError):
    """Nothing answers at the configured address (refused, unknown host, reset)."""

    title = "Daemon unreachable"


class DaemonTimeoutError(ApiError):
    """The daemon accepted the connection but did not answer within the timeout."""

    title = "Daemon too slow"


class DaemonRejectedError(ApiError):
    """The daemon answered 4xx: the request is wrong (bad value, refused SQL, missing token)."""

    title = "Rejected by the daemon"

    def __init__(
        self, message: str, *, url: str, status: int, errors: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message, url=url)
        self.status = status
        self.errors = dict(errors or {})  # per-key messages (PUT /api/settings)


class DaemonFailedError(ApiError):
    """The daemon answered 5xx, or with something that is not the JSON it documents."""

    title = "Daemon failed"

    def __init__(self, message: str, *, url: str, status: int | None = None) -> None:
        super().__init__(message, url=url)
        self.status = status


def _error_message(response: httpx.Response) -> str:
    """The daemon's ``{"error": ...}`` text (or FastAPI's ``detail``), else the raw body."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        for key in ("error", "detail"):
            if key in body:
                value = body[key]
                return value if isinstance(value, str) else _flatten_detail(value)
    return str(body)[:500]


def _per_key_errors(response: httpx.Response) -> dict[str, str]:
    """The ``errors: {key: message}`` map a settings refusal carries, if any."""
    try:
        body = response.json()
    except ValueError:
        return {}
    errors = body.get("errors") if isinstance(body, dict) else None
    return {str(k): str(v) for k, v in errors.items()} if isinstance(errors, dict) else {}


def _flatten_detail(detail: object) -> str:
    """FastAPI's validation ``detail`` list as one line per problem."""
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, dict):
                loc = ".".join(str(x) for x in item.get("loc", ()))
                parts.append(f"{loc}: {item.get('msg', item)}")
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return str(detail)


@dataclass(frozen=True)
class LiveSettings:
    """The daemon's tunables: ``values`` by key, and the JSON Schema that declares each one
    (``properties``: type, bounds, ``enum``, ``description``)."""

    values: dict[str, object]
    schema: Json


@dataclass(frozen=True)
class Client:
    """Typed calls to one daemon. ``transport`` is for tests that need a fault they cannot cause
    with a real socket; production uses httpx's default."""

    base_url: str = DEFAULT_API_URL
    token: str | None = None
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    read_timeout_s: float = READ_TIMEOUT_S
    transport: httpx.BaseTransport | None = None

    # -- the endpoints -------------------------------------------------------------------------

    def health(self) -> Json:
        return self._call("GET", "/healthz")

    def stats(self) -> Json:
        return self._call("GET", "/api/stats")

    def predictions(self, *, limit: int = 50) -> Json:
        return self._call("GET", "/api/predictions", params={"limit": limit})

    def sizing(self) -> Json:
        return self._call("GET", "/api/sizing")

    def timeseries(self, minutes: float) -> list[Json]:
        body = self._call("GET", "/api/timeseries", params={"minutes": minutes})
        return _rows(body, "rows", self._url("/api/timeseries"))

    def decisions(self, *, limit: int = 200, kind: str = "", q: str = "") -> list[Json]:
        params: dict[str, str | int] = {"limit": limit}
        if kind:
            params["kind"] = kind
        if q:
            params["q"] = q
        body = self._call("GET", "/api/decisions", params=params)
        return _rows(body, "decisions", self._url("/api/decisions"))

    def settings(self) -> list[Json]:
        return _rows(self._call("GET", "/api/settings"), "settings", self._url("/api/settings"))

    def live_settings(self) -> LiveSettings:
        """The tunables' current values and their JSON Schema (what the tuning form is built
        from), from one GET."""
        url = self._url("/api/settings")
        body = self._call("GET", "/api/settings")
        schema = body.get("schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
            raise DaemonFailedError(f"{url} answered without the settings' JSON Schema", url=url)
        values = {str(row.get("key")): row.get("value") for row in _rows(body, "settings", url)}
        return LiveSettings(values=values, schema=schema)

    def update_settings(self, changes: Mapping[str, object]) -> list[Json]:
        """PUT the changed knobs; the daemon validates all of them and applies all or none."""
        body = self._call("PUT", "/api/settings", json=dict(changes))
        return _rows(body, "settings", self._url("/api/settings"))

    def settings_history(self, *, limit: int = 200) -> list[Json]:
        body = self._call("GET", "/api/settings/history", params={"limit": limit})
        return _rows(body, "changes", self._url("/api/settings/history"))

    def publish_history(self) -> Json:
        """Ask the daemon to publish a fresh history snapshot for SQL (admin)."""
        return self._call("POST", "/api/history/publish", read_timeout_s=SQL_READ_TIMEOUT_S)

    def sql(self, sql: str, *, max_rows: int = 1000, fleet: bool = False) -> Json:
        """``{"columns", "rows", "truncated", "elapsed_ms", "snapshot_ts"}`` (and ``fleet``:
        ``{"replicas", "segments", ...}`` when ``fleet``: the statement ran over every
        replica's history, each table with a ``replica`` column); a refusal raises
        ``DaemonRejectedError``."""
        body: Json = {"sql": sql, "max_rows": max_rows}
        if fleet:
            body["fleet"] = True
        return self._call(
            "POST",
            "/api/sql",
            json=body,
            read_timeout_s=max(self.read_timeout_s, SQL_READ_TIMEOUT_S),
        )

    def fleet_enabled(self) -> bool:
        """Whether the daemon can run SQL over the whole fleet's history (``GET /api/fleet``);
        False from a daemon without that route."""
        try:
            body = self._call("GET", "/api/fleet")
        except DaemonRejectedError as err:
            if err.status == 404:
                return False
            raise
        return body.get("enabled") is True

    # -- the one place HTTP happens ------------------------------------------------------------

    def _url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int | float] | None = None,
        json: object = None,
        read_timeout_s: float | None = None,
    ) -> Json:
        url = self._url(path)
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        timeout = httpx.Timeout(
            read_timeout_s or self.read_timeout_s, connect=self.connect_timeout_s
        )
        try:
            with httpx.Client(timeout=timeout, transport=self.transport) as http:
                response = http.request(method, url, params=params, json=json, headers=headers)
        except httpx.TimeoutException as err:
            raise DaemonTimeoutError(
                f"no answer from {url} within {timeout.read or timeout.connect:g} s "
                f"({type(err).__name__})",
                url=url,
            ) from err
        except (httpx.TransportError, httpx.InvalidURL, httpx.UnsupportedProtocol) as err:
            raise DaemonUnreachableError(f"cannot reach {url}: {err}", url=url) from err
        if 400 <= response.status_code < 500:
            raise DaemonRejectedError(
                _error_message(response),
                url=url,
                status=response.status_code,
                errors=_per_key_errors(response),
            )
        if response.status_code >= 500 or response.status_code < 200:
            raise DaemonFailedError(
                f"HTTP {response.status_code} from {url}: {_error_message(response)}",
                url=url,
                status=response.status_code,
            )
        try:
            body = response.json()
        except ValueError as err:
            raise DaemonFailedError(f"{url} did not answer JSON", url=url) from err
        if isinstance(body, list):  # a bare list of rows: wrap it like the documented objects
            return {"rows": body}
        if not isinstance(body, dict):
            raise DaemonFailedError(f"{url} answered {type(body).__name__}, not an object", url=url)
        return body


def _rows(body: Json, key: str, url: str) -> list[Json]:
    """The list of row objects under ``key`` (or ``rows``) in a documented response."""
    rows = body.get(key, body.get("rows"))
    if not isinstance(rows, list):
        raise DaemonFailedError(f"{url} answered without a {key!r} list", url=url)
    return [row for row in rows if isinstance(row, dict)]
