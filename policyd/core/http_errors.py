"""How the HTTP services (the daemon's API, ``policyd route``) answer a request that does not
validate: ``422 {"error": "<where>: <what>; ..."}``, one part per error, the body's fields named
without the ``body`` prefix."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


async def invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's exception handler for ``RequestValidationError``."""
    assert isinstance(exc, RequestValidationError)
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where or 'body'}: {err.get('msg')}")
    return JSONResponse({"error": "; ".join(parts)}, status_code=422)
