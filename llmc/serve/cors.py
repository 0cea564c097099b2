"""Cross-origin requests (CORS) for ``llmc serve --allowed-origins``: browser apps on other origins may call the HTTP
routes.

Off by default, as browsers then keep every page on another origin from reading llmc's answers. With origins
allowed (``http://localhost:3000``, or ``*`` for any):

- a preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin gets 204 with the methods,
  the headers it asked for and ``Access-Control-Max-Age``; it needs no API key (browsers send none with it). A
  preflight from any other origin, or to a server with none allowed, gets a 403 that names the flag;
- every response to an allowed origin, streams and errors included (so a page can read a 401's or 400's
  message), carries ``Access-Control-Allow-Origin`` (the origin itself) and ``Vary: Origin``, and exposes
  ``Retry-After``.

The API key still guards every route: CORS only lets a browser read what the server answers.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

METHODS = "GET, POST, DELETE, OPTIONS"
MAX_AGE_S = 600
_ORIGIN = re.compile(r"^https?://[^/?#\s]+$")


def parse_origins(text: str | None) -> tuple[str, ...]:
    """``--allowed-origins`` (comma-separated) -> the origins; ValueError naming an entry that is not an origin."""
    if not text:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not _ORIGIN.match(origin):
            raise ValueError(f"{origin!r} is not an origin; write scheme://host[:port], e.g. http://localhost:3000, "
                             f"or * for any origin")
    return origins


def _allowed(request: web.Request, origins: tuple[str, ...]) -> str | None:
    """The request's ``Origin`` when it may read answers, else None."""
    origin = request.headers.get("Origin")
    return origin if origin is not None and ("*" in origins or origin in origins) else None


def cors_middleware(origins: tuple[str, ...]) -> Any:
    """The middleware that answers preflights (before the API-key check: a preflight carries no key)."""

    @web.middleware
    async def cors(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        origin = _allowed(request, origins)
        if origin is None:
            fix = (f"add it to llmc serve --allowed-origins (now: {', '.join(origins)})" if origins else
                   f"start llmc serve with --allowed-origins {request.headers.get('Origin') or 'ORIGIN'}")
            return web.json_response({"error": f"cross-origin requests from {request.headers.get('Origin')!r} are "
                                               f"not allowed; {fix}"}, status=403)
        asked = request.headers.get("Access-Control-Request-Headers", "Authorization, Content-Type")
        return web.Response(status=204, headers={
            "Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Allow-Methods": METHODS,
            "Access-Control-Allow-Headers": asked, "Access-Control-Max-Age": str(MAX_AGE_S)})

    return cors


def response_marker(origins: tuple[str, ...]) -> Any:
    """The ``on_response_prepare`` callback that marks a response to an allowed origin readable (streams too,
    whose headers go out before their handler returns)."""

    async def mark(request: web.Request, response: web.StreamResponse) -> None:
        origin = _allowed(request, origins)
        if origin is not None and "Access-Control-Allow-Origin" not in response.headers:  # preflights have it
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Retry-After"
            response.headers.add("Vary", "Origin")

    return mark
