"""The GRPCInferenceService servicer: each RPC translated to the gateway's core, with the same keys
(the `authorization` metadata, as tritonclient sends headers), scopes, limits, deadlines (the RPC's
own) and traces (a `traceparent` in the metadata) as over HTTP. Shared-memory, trace and log
settings RPCs answer UNIMPLEMENTED."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, NoReturn

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from tritonclient.grpc import service_pb2, service_pb2_grpc

from fngate import telemetry
from fngate.errors import ErrorCode, FunctionError, Internal, PermissionDenied, RateLimited
from gateway import control, metadata, metrics
from gateway.auth import ADMIN, ANY, BROWSE, INVOKE, OPEN, READ, Principal
from gateway.call import Call
from gateway.grpc import protocol
from gateway.grpc.status import CODES
from gateway.state import Services
from gateway.validation import parse, shown

log = logging.getLogger(__name__)
tracer = trace.get_tracer("fngate.gateway")
STREAM_IN_FLIGHT = 256
"""Requests of one ModelStreamInfer stream answered at once; the stream is read no further meanwhile."""
SERVICE = "inference.GRPCInferenceService"
_END = object()


class GrpcInference(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(self, services: Services) -> None:
        self.services = services
        self._tracing = telemetry.tracing_active()

    # Health: open to every caller, as over HTTP.

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.services.catalog.health.available)

    # Metadata: the `read` scope, or `invoke` of the function asked about.

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        async with self._answering(context, ANY, None):  # as GET /v2: any valid key
            document = metadata.server()
        return service_pb2.ServerMetadataResponse(**document)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        async with self._answering(context, READ, request.name):
            document = metadata.model(self.services.catalog, request.name, request.version or None)
        return protocol.metadata(document)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        async with self._answering(context, READ, request.name):
            _, ready = metadata.ready(self.services.catalog, request.name, request.version or None)
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        async with self._answering(context, READ, request.name):
            document = metadata.configuration(self.services.catalog, request.name, request.version or None)
        return service_pb2.ModelConfigResponse(config=protocol.model_config(document))

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        """Of one function, or of every function the key may read."""
        found = self.services
        answering = self._answering(context, READ if request.name else BROWSE, request.name or None)
        async with answering:
            principal = answering.principal
            document = await metadata.statistics(
                found.catalog,
                found.redis,
                request.name or None,
                request.version or None,
                lambda name: principal.allows(READ, name),
            )
        return protocol.statistics(document)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        async with self._answering(context, READ, None):
            entries = await control.repository_index(self.services.catalog, request.ready)
        response = service_pb2.RepositoryIndexResponse()
        for entry in entries:
            response.models.add(**entry)
        return response

    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        found = self.services
        async with self._answering(context, ADMIN, None):
            await control.load(found.catalog, request.model_name, found.settings.load_timeout_s)
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        found = self.services
        async with self._answering(context, ADMIN, None):
            await control.unload(found.catalog, request.model_name, found.settings.load_timeout_s)
        return service_pb2.RepositoryModelUnloadResponse()

    # Inference: the `invoke` scope of the function.

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        started = time.perf_counter()
        headers = _metadata(context)
        retry_after_s = self.services.settings.retry_after_s
        try:
            principal = await self.services.keys.authorize_async(
                headers.get("authorization"), INVOKE, request.model_name
            )
        except FunctionError as exc:
            await _abort(context, exc, retry_after_s)
        with self._span("ModelInfer", headers) as traceparent:
            try:
                return await self._infer(request, principal, context.time_remaining(), traceparent, started)
            except FunctionError as exc:
                await _abort(context, exc, retry_after_s)
            except Exception:
                await _abort(context, _internal(request.model_name), retry_after_s)

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """Each request answered with its id as soon as it is done (not in order), errors included,
        as Triton's decoupled stream does; at most STREAM_IN_FLIGHT at once."""
        headers = _metadata(context)
        try:
            principal = await self.services.keys.authorize_async(headers.get("authorization"), ANY)
        except FunctionError as exc:
            await _abort(context, exc, self.services.settings.retry_after_s)
        answers: asyncio.Queue[Any] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
        tracer_context = headers.get("traceparent")

        async def answer(request: Any) -> None:
            try:
                if not principal.allows(INVOKE, request.model_name):
                    raise PermissionDenied(
                        f"the API key {principal.key_id} lacks the scope {INVOKE}:{shown(request.model_name)}"
                    )
                response = await self._infer(request, principal, None, tracer_context, time.perf_counter())
                answers.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))
            except FunctionError as exc:
                answers.put_nowait(_stream_error(request, exc.message))
            except Exception:
                answers.put_nowait(_stream_error(request, _internal(request.model_name).message))
            finally:
                slots.release()

        async def read() -> None:
            async with asyncio.TaskGroup() as answering:
                async for request in requests:
                    await slots.acquire()
                    answering.create_task(answer(request))
            answers.put_nowait(_END)

        reading = asyncio.create_task(read())
        try:
            while (item := await answers.get()) is not _END:
                yield item
        finally:
            reading.cancel()

    async def _infer(
        self,
        request: Any,
        principal: Principal,
        remaining_s: float | None,
        traceparent: str | None,
        started: float,
    ) -> Any:
        services = self.services
        name = request.model_name
        try:
            function = services.catalog.get(name, request.model_version or None)
            manifest = function.manifest
            params = protocol.parameters(request.parameters)
            size = protocol.held_bytes(request)
            hold = services.budget.hold()
            try:
                hold.add(size)
                inputs = await parse(protocol.inputs_of, request, size, manifest)
            finally:
                hold.release()
            call = Call(
                function,
                inputs,
                protocol.outputs_of(request, manifest),
                principal,
                protocol.timeout_ms(params, remaining_s),
                protocol.use_cache(params),
                request.id or None,
                traceparent,
                None,
                started,
                priority=protocol.natural(params, "priority") or 0,
                queue_timeout_us=protocol.natural(params, "timeout"),
            )
        except FunctionError as exc:
            metrics.failed(name if name in services.catalog.functions else "", exc.code.value)
            raise
        reply = await services.dispatcher.invoke(call)
        return protocol.response_of(reply, manifest, request.id)

    def _answering(self, context: Any, scope: str, function: str | None) -> _Answering:
        return _Answering(self.services, context, scope, function)

    def _span(self, method: str, headers: dict[str, str]) -> _ServerSpan:
        return _ServerSpan(self._tracing, method, headers.get("traceparent"))


UNIMPLEMENTED = (
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
    "TraceSetting",
    "LogSettings",
)
"""RPCs fngate does not serve: UNIMPLEMENTED, to a caller with a valid key (as every RPC but health)."""


def _unimplemented(name: str) -> Any:
    async def refuse(self: GrpcInference, request: Any, context: Any) -> Any:
        async with self._answering(context, ANY, None):
            pass
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not served by fngate")

    refuse.__name__ = name
    return refuse


for _name in UNIMPLEMENTED:
    setattr(GrpcInference, _name, _unimplemented(_name))


class _Answering:
    """A metadata RPC's key check, then its body: a FunctionError raised in it ends the RPC with
    its status."""

    def __init__(self, services: Services, context: Any, scope: str, function: str | None) -> None:
        self._services, self._context, self._need = services, context, (scope, function)
        self.principal = OPEN

    async def __aenter__(self) -> None:
        header = _metadata(self._context).get("authorization")
        try:
            self.principal = await self._services.keys.authorize_async(header, *self._need)
        except FunctionError as exc:
            await _abort(self._context, exc, self._services.settings.retry_after_s)

    async def __aexit__(self, kind: Any, exc: BaseException | None, _tb: Any) -> bool:
        if isinstance(exc, FunctionError):
            await _abort(self._context, exc, self._services.settings.retry_after_s)
        return False


class _ServerSpan:
    """The RPC's server span, continuing the caller's trace; yields the traceparent that the
    invocation carries on (None without tracing)."""

    def __init__(self, active: bool, method: str, traceparent: str | None) -> None:
        self._active, self._method, self._traceparent = active, method, traceparent
        self._span: Any = None

    def __enter__(self) -> str | None:
        if not self._active:
            return self._traceparent
        self._span = tracer.start_span(
            f"{SERVICE}/{self._method}",
            context=telemetry.extract(self._traceparent),
            kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": self._method},
        )
        return telemetry.inject(trace.set_span_in_context(self._span))

    def __exit__(self, kind: Any, exc: BaseException | None, _tb: Any) -> None:
        if self._span is not None:
            if exc is not None:
                self._span.set_attribute("rpc.grpc.status_code", _code_of(exc).value[0])
            self._span.end()


def _metadata(context: Any) -> dict[str, str]:
    found: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            found[key] = value
    return found


def _code_of(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, FunctionError):
        return CODES[exc.code]
    return grpc.StatusCode.UNKNOWN


def _trailers(exc: FunctionError, retry_after_s: int) -> Iterator[tuple[str, str]]:
    if isinstance(exc, RateLimited):
        yield "retry-after", str(exc.retry_after_s)
    elif exc.code in (ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE):
        yield "retry-after", str(retry_after_s)


async def _abort(context: Any, exc: FunctionError, retry_after_s: int) -> NoReturn:
    context.set_trailing_metadata(tuple(_trailers(exc, retry_after_s)))
    await context.abort(CODES[exc.code], exc.message)
    raise AssertionError("unreachable: abort raises")


def _stream_error(request: Any, message: str) -> Any:
    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=response)


def _internal(name: str) -> Internal:
    request_id = uuid.uuid4().hex
    log.exception("invocation of %s over gRPC failed unexpectedly (request %s)", name[:128], request_id)
    metrics.failed("", ErrorCode.INTERNAL.value)
    return Internal(f"internal error (request id {request_id})")
