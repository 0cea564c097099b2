"""What every front end of ``llmc serve`` shares: the server state, the error mapping, and the HTTP plumbing
(JSON bodies, the API-key check, server-sent events) that the KServe v2 and OpenAI routes both use.

The route modules (:mod:`llmc.serve.kserve_http`, :mod:`llmc.serve.openai_api`) and the gRPC servicer
(:mod:`llmc.serve.grpc_server`) import this module and never each other. Every HTTP error is JSON with a 4xx/5xx
status: ``{"error": "..."}`` (KServe and Triton's shape), and on the OpenAI routes (``/v1/...``) OpenAI's own,
``{"error": {"message", "type", "param", "code"}}``, whose ``message`` OpenAI's client libraries show. The server
keeps serving after any bad request.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from llmc.errors import EngineError, LlmcError, QueueFullError, RequestError, UnknownModelError
from llmc.request.params import SamplingParams
from llmc.serve.anthropic_protocol import ANTHROPIC_PATHS, anthropic_error
from llmc.serve.engine_client import EngineClient, PreparedPrompt, RequestTimeoutError, ServerDrainingError, before
from llmc.serve.protocol import client_names, loads_json_object
from llmc.serve.reasoning import ReasoningSyntax
from llmc.serve.tgi_protocol import TGI_PATHS, tgi_error
from llmc.serve.tool_syntax import ToolSyntax

log = logging.getLogger(__name__)

# Names that reach the served model: llmc's own name plus Triton's, so unchanged Triton clients work.
TRITON_ALIASES = ("ensemble", "tensorrt_llm_bls")
# TGI ignores a request's model, and its clients send placeholders: "tgi" (TGI's docs, LiteLLM's huggingface
# provider), "dummy" (huggingface_hub's InferenceClient given a URL). Requests accept them for the served model.
TGI_PLACEHOLDERS = ("tgi", "dummy")
PUBLIC_PATHS = ("/v2/health/live", "/v2/health/ready", "/health")
# vLLM's utility routes (:mod:`llmc.serve.vllm_api`): OpenAI's error shape, and no request counted in the metrics
UTILITY_PATHS = ("/health", "/version", "/tokenize", "/detokenize")
UNCOUNTED_PATHS = (*UTILITY_PATHS, "/info", "/v1/messages/count_tokens")  # no request of theirs counts in the metrics


@dataclass(frozen=True)
class ServerState:
    """What every handler needs: the engine bridge, the served name, request defaults and the API key."""

    client: EngineClient
    model_name: str
    defaults: SamplingParams
    vocab_size: int
    api_key: str | None = None
    body_timeout_s: float = 60.0  # a request body must arrive within this many seconds of its headers
    max_body_bytes: int = 16 * 1024 * 1024
    tool_syntax: ToolSyntax | None = None  # the model's tool-call syntax (None: tool_choice "auto" is refused)
    reasoning: ReasoningSyntax | None = None  # chat answers' thinking goes out as reasoning_content
    max_model_len: int | None = None  # prompt + answer tokens a request may hold (the recipe's max_seq_len)
    allowed_origins: tuple[str, ...] = ()  # browser origins that may read answers (CORS; "*": any)
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' "created": when serving began

    def knows(self, model: str) -> bool:
        """True for the served model's name and the Triton aliases."""
        return model == self.model_name or model in TRITON_ALIASES

    def request_names(self) -> tuple[str, ...]:
        """The names a request's ``model`` may give: the served model's first (the default), the Triton aliases and
        TGI's placeholders."""
        return (self.model_name, *TRITON_ALIASES, *TGI_PLACEHOLDERS)

    def key_matches(self, presented: str | None, x_api_key: str | None = None) -> bool:
        """Constant-time check of an ``Authorization`` value against ``Bearer <api_key>``, or of an ``X-Api-Key``
        value (Anthropic's clients send the key so) against the key (True without a key)."""
        if self.api_key is None:
            return True
        if presented is None and x_api_key is not None:
            presented = f"Bearer {x_api_key}"
        expected = f"Bearer {self.api_key}".encode()
        return hmac.compare_digest((presented or "").encode("utf-8", "surrogateescape"), expected)


STATE_KEY = web.AppKey("llmc_state", ServerState)
# True once the current request's handler has handed it to the EngineClient, which counts its outcome from
# then on (set per request by the middleware; a keep-alive connection's requests share one task).
_SUBMITTED: ContextVar[bool] = ContextVar("llmc_submitted", default=False)


def openai_error(message: str, status: int, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``type`` is ``invalid_request_error`` for a 4xx (the client's request), else
    ``server_error``; ``param`` the request's field at fault; ``code`` a machine-readable reason or None."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_error(path: str, status: int, message: str, headers: Mapping[str, str] | None = None,
               param: str | None = None, code: str | None = None) -> web.Response:
    """An error response in the shape of the route's API: OpenAI's under ``/v1/`` and on vLLM's utility routes,
    TGI's (``{"error", "error_type"}``, TGI's statuses) on its routes, Anthropic's (``{"type": "error", "error":
    {"type", "message"}}``) on the Messages API's, ``{"error": message}`` else."""
    if path in ANTHROPIC_PATHS:
        return web.json_response(anthropic_error(status, message), status=status, headers=headers)
    if path in TGI_PATHS:
        status, tgi_body = tgi_error(status, message, code)
        return web.json_response(tgi_body, status=status, headers=headers)
    openai = path.startswith("/v1/") or path in UTILITY_PATHS
    body = openai_error(message, status, param, code) if openai else {"error": message}
    return web.json_response(body, status=status, headers=headers)


def error_status(exc: LlmcError) -> tuple[int, str | None]:
    """The HTTP status of an llmc error raised while handling a request, and OpenAI's ``code`` for it."""
    if isinstance(exc, UnknownModelError):
        return 404, "model_not_found"
    if isinstance(exc, RequestError):
        return 400, None
    if isinstance(exc, QueueFullError):
        return 503, "queue_full"
    if isinstance(exc, ServerDrainingError):
        return 503, "server_shutting_down"
    if isinstance(exc, RequestTimeoutError):
        return 504, "timeout"
    assert isinstance(exc, (EngineError, LlmcError))
    return 500, None


def error_response(exc: LlmcError, path: str) -> web.Response:
    """The HTTP response for an llmc error raised while handling a request to ``path``."""
    status, code = error_status(exc)
    headers = {}
    if status == 503:
        headers["Retry-After"] = str(max(1, round(getattr(exc, "retry_after_s", 1.0))))
    param = exc.field if isinstance(exc, RequestError) else None
    return json_error(path, status, str(exc), headers, param, code)


@web.middleware
async def auth_and_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Bearer-token check (all paths except health) and LlmcError -> JSON error response."""
    state = request.app[STATE_KEY]
    key, x_api_key = request.headers.get("Authorization"), request.headers.get("X-Api-Key")
    if request.path not in PUBLIC_PATHS and not state.key_matches(key, x_api_key):
        return json_error(request.path, 401, "missing or wrong API key; send 'Authorization: Bearer <key>' (or "
                                             "'X-Api-Key: <key>')",
                          {"WWW-Authenticate": "Bearer"}, code="invalid_api_key")
    submitted = _SUBMITTED.set(False)
    try:
        return await handler(request)
    except (asyncio.CancelledError, ConnectionResetError):  # the client left before its request was submitted
        if not _SUBMITTED.get() and request.path not in UNCOUNTED_PATHS:
            state.client.metrics.requests.labels("abort").inc()
        raise
    except LlmcError as exc:
        if isinstance(exc, RequestError) and request.path not in UNCOUNTED_PATHS:
            state.client.metrics.rejected.labels("invalid").inc()
        return error_response(exc, request.path)
    except web.HTTPException as exc:  # aiohttp's own 404 / 405 / 413 ... answer JSON too
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Connection", "Retry-After")}
        return json_error(request.path, exc.status, exc.text or exc.reason, headers)
    except Exception as exc:  # a bug: logged with its traceback; the client still gets JSON, the server goes on
        log.exception("unhandled error in %s %s", request.method, request.path)
        return json_error(request.path, 500, f"internal server error ({type(exc).__name__}); see the server log")
    finally:
        _SUBMITTED.reset(submitted)


async def prepare(request: web.Request, prompt: Any, params: SamplingParams, strict: bool,
                  names: Mapping[str, str]) -> PreparedPrompt:
    """Hand the request to the EngineClient (tokenize, check max_tokens); errors use the client's ``names``."""
    _SUBMITTED.set(True)
    with client_names(names):
        return await request.app[STATE_KEY].client.prepare(prompt, params, strict)


async def read_body(request: web.Request) -> bytes:
    """The whole request body, within ``max_body_bytes`` (413) and ``body_timeout_s`` (408, connection closed).

    A Content-Length over the limit is refused before any byte is read, so ``Content-Length: 10**12`` with
    no body gets an immediate answer instead of an open socket."""
    state = request.app[STATE_KEY]
    if request.content_length is not None and request.content_length > state.max_body_bytes:
        raise web.HTTPRequestEntityTooLarge(state.max_body_bytes, request.content_length,
                                            headers={"Connection": "close"})
    try:
        return await before(request.read(), asyncio.get_running_loop().time() + state.body_timeout_s)
    except asyncio.TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {state.body_timeout_s:g} s",
                                     headers={"Connection": "close"}) from None


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object, or RequestError (400) naming what is wrong."""
    return loads_json_object(await read_body(request))


def served_model(request: web.Request) -> str:
    """The ``{model}`` of the URL; 404 (JSON) unless this server serves it."""
    state = request.app[STATE_KEY]
    name = request.match_info["model"]
    if not state.knows(name):
        raise web.HTTPNotFound(text=json.dumps({"error": f"unknown model {name!r}; this server serves "
                                                         f"{state.model_name!r}"}),
                               content_type="application/json")
    return name


async def start_sse(request: web.Request) -> web.StreamResponse:
    """Send the headers of a server-sent-events response."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def send_sse(response: web.StreamResponse, payload: dict[str, Any] | str, event: str | None = None) -> None:
    """One ``data: ...`` event (a dict is sent as JSON, a string as is, e.g. ``[DONE]``), after an ``event:``
    line when ``event`` names its type (the Responses API's events)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    head = "" if event is None else f"event: {event}\n"
    await response.write(f"{head}data: {data}\n\n".encode())
