"""gRPC ``inference.GRPCInferenceService`` (Triton's own protos from tritonclient) over the engine.

Implements ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata, ModelConfig, ModelInfer (one response
with the whole text) and ModelStreamInfer (decoupled streaming: one response per text delta, then a final
response carrying the ``triton_final_response`` parameter; an empty one when the request enabled
``triton_enable_empty_final_response``, as tritonclient's ``enable_empty_final_response=True`` does).
With ``return_log_probs`` every text response and the final one also carry ``cum_log_probs`` [1, 1] and
``output_log_probs`` [1, 1, n] (FP32 raw contents) for all tokens so far (:mod:`llmc.serve.ensemble_logprobs`).
Errors: INVALID_ARGUMENT (bad request), UNAVAILABLE (queue full / draining, with a retry hint),
DEADLINE_EXCEEDED (request timeout), NOT_FOUND (unknown model), UNAUTHENTICATED (API key).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from llmc import __version__
from llmc.errors import LlmcError, QueueFullError, RequestError, ServeError
from llmc.serve.engine_client import PreparedPrompt, RequestTimeoutError, ServerDrainingError
from llmc.serve.ensemble_logprobs import EnsembleLogprobs
from llmc.serve.protocol import (ENSEMBLE_NAMES, EXTENSIONS, GenerateRequest, client_names, model_config_dict,
                                 model_metadata_dict, parse_generate_fields)
from llmc.serve.state import ServerState
from llmc.serve.tensors import decode_raw, serialize_bytes, tensors_to_fields

log = logging.getLogger(__name__)
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents", "BYTES": "bytes_contents"}


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message for an error raised while serving a request."""
    if isinstance(exc, RequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (QueueFullError, ServerDrainingError)):
        return grpc.StatusCode.UNAVAILABLE, f"{exc} (retry after {getattr(exc, 'retry_after_s', 1.0):g} s)"
    if isinstance(exc, RequestTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    return grpc.StatusCode.INTERNAL, str(exc)


def request_fields(request: pb.ModelInferRequest) -> dict[str, Any]:
    """Ensemble fields from a ModelInferRequest's tensors (raw_input_contents or typed contents)."""
    tensors: dict[str, list[Any]] = {}
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise RequestError("raw_input_contents", f"has {len(raw)} buffers for {len(request.inputs)} inputs")
    for i, tensor in enumerate(request.inputs):
        if raw:
            tensors[tensor.name] = decode_raw(tensor.name, tensor.datatype, raw[i])
        else:
            decode_raw(tensor.name, tensor.datatype, b"")  # checks the name and datatype
            if tensor.datatype not in _CONTENTS:  # FP16 / BF16 have no typed contents field in the proto
                raise RequestError(tensor.name, f"a {tensor.datatype} input must be sent in raw_input_contents")
            tensors[tensor.name] = list(getattr(tensor.contents, _CONTENTS[tensor.datatype]))
    return tensors_to_fields(tensors)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The servicer; unimplemented RPCs answer UNIMPLEMENTED (the generated base class does that)."""

    def __init__(self, state: ServerState):
        self.state = state

    async def _auth(self, context: grpc.aio.ServicerContext) -> None:
        if self.state.api_key is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        if not self.state.key_matches(metadata.get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key; send the metadata "
                                                                   "'authorization: Bearer <key>'")

    async def _model(self, name: str, context: grpc.aio.ServicerContext) -> None:
        await self._auth(context)
        if not self.state.knows(name):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {name!r}; this server serves "
                                                           f"{self.state.model_name!r}")

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=not self.state.client.draining)

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        await self._auth(context)
        return pb.ServerMetadataResponse(name="llmc", version=__version__, extensions=list(EXTENSIONS))

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        await self._model(request.name, context)
        return pb.ModelReadyResponse(ready=not self.state.client.draining)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        await self._model(request.name, context)
        meta = model_metadata_dict(request.name)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["inputs"]],
            outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["outputs"]])

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: Any) -> pb.ModelConfigResponse:
        await self._model(request.name, context)
        return pb.ModelConfigResponse(config=json_format.ParseDict(model_config_dict(request.name),
                                                                   model_config_pb2.ModelConfig()))

    def _parse(self, request: pb.ModelInferRequest) -> GenerateRequest:
        return parse_generate_fields(request_fields(request), self.state.defaults, self.state.vocab_size,
                                     allow_extras=False)

    async def _prepare(self, request: pb.ModelInferRequest, req: GenerateRequest) -> PreparedPrompt:
        """Tokenize and check max_tokens (the request parameter ``strict_max_tokens`` turns a cap into an error)."""
        strict = request.parameters["strict_max_tokens"].bool_param \
            if "strict_max_tokens" in request.parameters else False
        with client_names(ENSEMBLE_NAMES):
            return await self.state.client.prepare(req.prompt, req.params, strict)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        await self._model(request.model_name, context)
        try:
            req = self._parse(request)
            prepared = await self._prepare(request, req)
            parts = [] if req.exclude_input_in_output else [req.prompt]
            logprobs = EnsembleLogprobs(req.return_log_probs)
            async with aclosing(self.state.client.stream(prepared, req.params)) as events:
                with client_names(ENSEMBLE_NAMES):
                    event = await anext(events)
                parts.append(event.text)
                logprobs.add(event)
                while not event.finished:
                    event = await anext(events)
                    parts.append(event.text)
                    logprobs.add(event)
        except LlmcError as exc:
            await context.abort(*status_of(exc))
        return _response(request, "".join(parts), final=True, finish_reason=event.finish_reason,
                         warnings=prepared.warnings(), logprobs=logprobs)

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> Any:
        """Bidirectional stream: every incoming request runs concurrently; responses interleave."""
        await self._auth(context)
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def read_requests() -> None:
            async for request in request_iterator:
                task = asyncio.ensure_future(self._serve_stream_request(request, out))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
            await out.put(None)

        reader = asyncio.ensure_future(read_requests())
        try:
            while (item := await out.get()) is not None:
                yield item
        finally:  # the client went away: abort every request of this stream (their blocks are freed)
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _serve_stream_request(self, request: pb.ModelInferRequest, out: asyncio.Queue) -> None:
        empty_final = request.parameters["triton_enable_empty_final_response"].bool_param \
            if "triton_enable_empty_final_response" in request.parameters else False
        try:
            if not self.state.knows(request.model_name):
                raise RequestError("model_name", f"unknown model {request.model_name!r}; this server serves "
                                                 f"{self.state.model_name!r}")
            req = self._parse(request)
            prepared = await self._prepare(request, req)
            prefix = "" if req.exclude_input_in_output else req.prompt
            logprobs = EnsembleLogprobs(req.return_log_probs)
            async with aclosing(self.state.client.stream(prepared, req.params)) as events:
                with client_names(ENSEMBLE_NAMES):
                    event = await anext(events)
                while True:
                    text, prefix = prefix + event.text, ""
                    logprobs.add(event)
                    if not req.stream and not event.finished:
                        prefix = text
                    else:
                        for response in _stream_responses(request, text, event, empty_final, prepared.warnings(),
                                                          logprobs):
                            await out.put(pb.ModelStreamInferResponse(infer_response=response))
                    if event.finished:
                        break
                    event = await anext(events)
        except Exception as exc:  # noqa: BLE001 - every request of the stream gets its final response
            if not isinstance(exc, LlmcError):
                log.exception("unhandled error in ModelStreamInfer")
            code, message = status_of(exc)
            await out.put(pb.ModelStreamInferResponse(error_message=f"{code.name}: {message}",
                                                      infer_response=_response(request, None, final=True)))


def _stream_responses(request: pb.ModelInferRequest, text: str, event: Any, empty_final: bool,
                      warnings: list[str], logprobs: EnsembleLogprobs) -> list[Any]:
    """The responses for one event: text (not final) then an empty final one, or text marked final. The "empty"
    final one carries the log-probabilities (and nothing else) when the request asked for them."""
    if not event.finished:
        return [_response(request, text, final=False, logprobs=logprobs)] if text else []
    if empty_final:
        head = [_response(request, text, final=False, logprobs=logprobs)] if text else []
        return head + [_response(request, None, final=True, finish_reason=event.finish_reason, warnings=warnings,
                                 logprobs=logprobs)]
    return [_response(request, text, final=True, finish_reason=event.finish_reason, warnings=warnings,
                      logprobs=logprobs)]


def _response(request: pb.ModelInferRequest, text: str | None, final: bool, finish_reason: str | None = None,
              warnings: list[str] | None = None, logprobs: EnsembleLogprobs | None = None) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version or "1",
                                     id=request.id)
    if text is not None:
        response.outputs.add(name="text_output", datatype="BYTES", shape=[1, 1])
        response.raw_output_contents.append(serialize_bytes([text.encode("utf-8")]))
    for name, array in logprobs.tensors() if logprobs is not None else ():
        response.outputs.add(name=name, datatype="FP32", shape=list(array.shape))
        response.raw_output_contents.append(array.astype("<f4").tobytes())
    response.parameters["triton_final_response"].bool_param = final
    if finish_reason is not None:
        response.parameters["finish_reason"].string_param = finish_reason
    if warnings:
        response.parameters["warnings"].string_param = "; ".join(warnings)
    return response


async def start_grpc_server(state: ServerState, host: str, port: int,
                            idle_timeout_s: float | None = None) -> grpc.aio.Server:
    """Create, bind and start the gRPC server (grpc.aio on the current event loop); returns it.

    ``idle_timeout_s``: connections without an open call for that long are closed. ServeError when the
    port cannot be bound (in use, or no permission)."""
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    if idle_timeout_s is not None:
        options.append(("grpc.max_connection_idle_ms", int(idle_timeout_s * 1000)))
    server = grpc.aio.server(options=options)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(state), server)
    try:  # grpcio returns 0 on some versions and raises RuntimeError("Failed to bind ...") on others
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ServeError(f"cannot bind the gRPC port {host}:{port} (in use, or not allowed); pass a free "
                         f"--grpc-port, or --grpc-port 0 to serve HTTP only")
    await server.start()
    return server
