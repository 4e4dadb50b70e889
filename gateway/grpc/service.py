"""The GRPCInferenceService's handlers: each RPC translated to the gateway's core, with the same
keys (the `authorization` metadata, as tritonclient sends headers), scopes, limits, deadlines (the
RPC's own) and traces (a `traceparent` in the metadata) as over HTTP. System shared memory is
gateway.shared_memory's (CUDA shared memory is refused at registration); trace and log settings
RPCs answer UNIMPLEMENTED. gateway.grpc.transport serves them."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from tritonclient.grpc import service_pb2

from fngate import telemetry
from fngate.errors import (
    ErrorCode,
    FunctionError,
    Internal,
    InvalidArgument,
    Overloaded,
    PayloadTooLarge,
    PermissionDenied,
    RateLimited,
)
from fngate.manifest import FunctionManifest
from fngate.repository import FunctionVersion
from fngate.sequences import step_of
from fngate.tensors import Tensors
from fngate.wire import Reply
from gateway import control, metadata, metrics
from gateway.auth import ADMIN, ANY, BROWSE, INVOKE, INVOKER, READ, Principal, UnknownKey
from gateway.call import Call
from gateway.grpc import codec
from gateway.grpc.messages import nested_fields
from gateway.grpc.rpc import Method, Rpc, RpcError
from gateway.grpc.status import CODES, Status
from gateway.shared_memory import NOTHING_PLACED, SharedMemory
from gateway.state import Services
from gateway.validation import OFF_LOOP_BYTES, parse, parse_now, shown

log = logging.getLogger(__name__)
tracer = trace.get_tracer("fngate.gateway")
STREAM_IN_FLIGHT = 256
STREAM_BACKLOG = 1024
"""Responses of a stream waiting for its client to read them: a decoupled model's past it are
dropped, and its request ends with an error (a slow reader holds bounded memory)."""
"""Requests of one ModelStreamInfer stream answered at once; the stream is read no further meanwhile."""
SERVICE = "inference.GRPCInferenceService"
_END = object()


class GrpcInference:
    def __init__(self, services: Services) -> None:
        self.services = services
        self._tracing = telemetry.tracing_active()

    def methods(self) -> dict[bytes, Method]:
        """Every RPC of the service by its name on the wire, with its request message's parser and
        the map of its nested messages (walked before a large message is built)."""
        table = {}
        for method in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
            parse = getattr(service_pb2, method.input_type.name).FromString
            handler = getattr(self, method.name)
            table[method.name.encode()] = Method(
                parse,
                unary=None if method.client_streaming else handler,
                streaming=handler if method.client_streaming else None,
                open=method.name in HEALTH,
                nested=nested_fields(method.input_type),
            )
        return table

    def authenticate(self, header: str | None) -> asyncio.Future[Any] | None:
        """The key check the transport makes on an RPC's headers, before it reads a byte of its
        messages: any valid key passes (each handler then checks its scope). None for a key the
        table holds; a look-up in Redis for one it does not hold yet; raises for no key or a wrong
        one."""
        keys = self.services.keys
        try:
            keys.authorize(header, ANY, None)
        except UnknownKey:
            return asyncio.ensure_future(keys.authorize_async(header, ANY, None))
        return None

    def failure(self, exc: BaseException, rpc: Rpc) -> RpcError:
        """The status an RPC ends with for its handler's exception (a bug: INTERNAL, logged)."""
        if isinstance(exc, RpcError):
            return exc
        if isinstance(exc, FunctionError):
            # Over a size limit is RESOURCE_EXHAUSTED in gRPC, as a message over its maximum is.
            status = Status.RESOURCE_EXHAUSTED if isinstance(exc, PayloadTooLarge) else CODES[exc.code]
            return RpcError(status, exc.message, _trailers(exc, self.services.settings.retry_after_s))
        return RpcError(Status.INTERNAL, _internal(rpc.name, exc).message)

    # Health: open to every caller, as over HTTP (HEALTH).

    async def ServerLive(self, request: Any, rpc: Rpc) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, rpc: Rpc) -> Any:
        return service_pb2.ServerReadyResponse(ready=self.services.catalog.health.available)

    # Metadata: the `read` scope, or `invoke` of the function asked about.

    async def ServerMetadata(self, request: Any, rpc: Rpc) -> Any:
        await self._authorize(rpc, ANY, None)  # as GET /v2: any valid key
        return service_pb2.ServerMetadataResponse(**metadata.server(self.services.settings.server_name))

    async def ModelMetadata(self, request: Any, rpc: Rpc) -> Any:
        await self._authorize(rpc, READ, request.name)
        return codec.metadata(metadata.model(self.services.catalog, request.name, request.version or None))

    async def ModelReady(self, request: Any, rpc: Rpc) -> Any:
        await self._authorize(rpc, READ, request.name)
        _, ready = metadata.ready(self.services.catalog, request.name, request.version or None)
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ModelConfig(self, request: Any, rpc: Rpc) -> Any:
        await self._authorize(rpc, READ, request.name)
        document = metadata.configuration(self.services.catalog, request.name, request.version or None)
        return service_pb2.ModelConfigResponse(config=codec.model_config(document))

    async def ModelStatistics(self, request: Any, rpc: Rpc) -> Any:
        """Of one function, or of every function the key may read."""
        found = self.services
        principal = await self._authorize(rpc, READ if request.name else BROWSE, request.name or None)
        document = await metadata.statistics(
            found.catalog,
            found.redis,
            request.name or None,
            request.version or None,
            lambda name: principal.allows(READ, name),
        )
        return codec.statistics(document)

    async def RepositoryIndex(self, request: Any, rpc: Rpc) -> Any:
        await self._authorize(rpc, READ, None)
        entries = await control.repository_index(self.services.catalog, request.ready)
        response = service_pb2.RepositoryIndexResponse()
        for entry in entries:
            response.models.add(**entry)
        return response

    async def RepositoryModelLoad(self, request: Any, rpc: Rpc) -> Any:
        found = self.services
        await self._authorize(rpc, ADMIN, None)
        parameters = codec.parameters(request.parameters)
        await control.load_request(
            found.catalog, request.model_name, parameters, found.settings.load_timeout_s
        )
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, rpc: Rpc) -> Any:
        found = self.services
        await self._authorize(rpc, ADMIN, None)
        await control.unload(found.catalog, request.model_name, found.settings.load_timeout_s)
        return service_pb2.RepositoryModelUnloadResponse()

    # Shared memory: the caller's key's regions (gateway.shared_memory), for any key that may invoke.

    async def SystemSharedMemoryStatus(self, request: Any, rpc: Rpc) -> Any:
        key_id, regions = await self._regions(rpc)
        response = service_pb2.SystemSharedMemoryStatusResponse()
        for found in await regions.status(key_id, request.name or None):
            response.regions[found["name"]].CopyFrom(
                service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(**found)
            )
        return response

    async def SystemSharedMemoryRegister(self, request: Any, rpc: Rpc) -> Any:
        key_id, regions = await self._regions(rpc)
        await regions.register(key_id, request.name, request.key, request.offset, request.byte_size)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, rpc: Rpc) -> Any:
        key_id, regions = await self._regions(rpc)
        await regions.unregister(key_id, request.name or None)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any, rpc: Rpc) -> Any:
        await self._regions(rpc)
        SharedMemory.cuda_status(request.name or None)  # none
        return service_pb2.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(self, request: Any, rpc: Rpc) -> Any:
        await self._regions(rpc)
        SharedMemory.cuda_register()
        return service_pb2.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request: Any, rpc: Rpc) -> Any:
        await self._regions(rpc)
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    async def _regions(self, rpc: Rpc) -> tuple[str, SharedMemory]:
        principal = await self._authorize(rpc, INVOKER, None)
        assert self.services.shared_memory is not None
        return principal.key_id, self.services.shared_memory

    # Inference: the `invoke` scope of the function.

    def ModelInfer(self, request: Any, rpc: Rpc) -> Awaitable[Any]:
        """A small request from a key the table holds is answered from the reply's future, with no
        task; a traced one, a large one (parsed in a thread) or a new key's runs as a task."""
        started = time.perf_counter()
        if self._tracing or request.ByteSize() >= OFF_LOOP_BYTES:
            return self._infer_slowly(request, rpc, started)
        try:
            principal = self.services.keys.authorize(
                rpc.metadata.get("authorization"), INVOKE, request.model_name
            )
        except UnknownKey:
            return self._infer_slowly(request, rpc, started)
        try:
            function = self._function(request)
            manifest = function.manifest
            inputs, shared = parse_now(codec.inputs_of, request, manifest)
        except FunctionError as exc:
            self._refused(request, exc)
            raise
        if shared or (request.outputs and any(item.parameters for item in request.outputs)):  # shared memory
            return self._infer_slowly(request, rpc, started)
        # Without tracing here, the caller's trace context still travels on to the runner.
        traceparent = rpc.metadata.get("traceparent")
        call = self._call(request, function, rpc, principal, traceparent, started, inputs)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        reply = self.services.dispatcher.invoke(call)
        reply.add_done_callback(functools.partial(_answer, answer, manifest, request.id, rpc))
        answer.add_done_callback(functools.partial(_cancelled, reply))
        return answer

    async def _infer_slowly(self, request: Any, rpc: Rpc, started: float) -> Any:
        principal = await self.services.keys.authorize_async(
            rpc.metadata.get("authorization"), INVOKE, request.model_name
        )
        with self._span("ModelInfer", rpc.metadata.get("traceparent")) as traceparent:
            return await self._infer(request, rpc, principal, traceparent, started)

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], rpc: Rpc) -> AsyncIterator[Any]:
        """Each request answered with its id as soon as it is done (not in order), errors included,
        as Triton's decoupled stream does; at most STREAM_IN_FLIGHT at once. The key is checked
        once the first request is in: a refusal sent sooner races the client's first write, which
        grpc's clients then report as an INTERNAL error instead of the refusal."""
        incoming = aiter(requests)
        first = await anext(incoming, None)
        principal = await self._authorize(rpc, ANY, None)
        if first is None:
            return
        answers: asyncio.Queue[Any] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
        traceparent = rpc.metadata.get("traceparent")

        async def answer(request: Any) -> None:
            try:
                if not principal.allows(INVOKE, request.model_name):
                    raise PermissionDenied(
                        f"the API key {principal.key_id} lacks the scope {INVOKE}:{shown(request.model_name)}"
                    )
                if self._decoupled(request):
                    await self._stream(request, principal, traceparent, answers)
                else:
                    response = await self._infer(request, None, principal, traceparent, time.perf_counter())
                    answers.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))
            except FunctionError as exc:
                answers.put_nowait(_stream_error(request, exc.message))
            except Exception as exc:
                answers.put_nowait(_stream_error(request, _internal(request.model_name, exc).message))
            finally:
                slots.release()

        async def read() -> None:
            async with asyncio.TaskGroup() as answering:
                await slots.acquire()
                answering.create_task(answer(first))
                async for request in incoming:
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
        self, request: Any, rpc: Rpc | None, principal: Principal, traceparent: str | None, started: float
    ) -> Any:
        placed = NOTHING_PLACED
        try:
            function = self._function(request)
            manifest = function.manifest
            inputs, shared = await parse(codec.inputs_of, request, request.ByteSize(), manifest)
            outputs = codec.shared_outputs(request, manifest)
            if shared or outputs:
                regions = self.services.shared_memory
                assert regions is not None
                inputs, placed = await regions.place(principal.key_id, manifest, inputs, shared, outputs)
        except FunctionError as exc:
            self._refused(request, exc)
            raise
        call = self._call(request, function, rpc, principal, traceparent, started, inputs)
        reply = await self.services.dispatcher.invoke(call)
        _timed(rpc, manifest, reply)
        return codec.response_of(reply, manifest, request.id, placed)

    def _decoupled(self, request: Any) -> bool:
        try:
            spec = self._function(request).manifest.model_spec
        except FunctionError:
            return False  # _infer answers it
        return spec is not None and spec.decoupled

    async def _stream(
        self, request: Any, principal: Principal, traceparent: str | None, answers: asyncio.Queue[Any]
    ) -> None:
        """A decoupled model's request: each of its responses on the stream as it comes (with the
        request's id), its errors as the stream's error messages; with the request parameter
        `triton_enable_empty_final_response`, each response says `triton_final_response` false and
        an empty one says true at the end, as Triton does."""
        function = self._function(request)
        manifest = function.manifest
        try:
            inputs, shared = await parse(codec.inputs_of, request, request.ByteSize(), manifest)
            if shared or codec.shared_outputs(request, manifest):
                raise InvalidArgument(
                    f"model '{manifest.name}' is decoupled: its tensors do not travel in shared memory"
                )
        except FunctionError as exc:
            self._refused(request, exc)
            raise
        call = self._call(request, function, None, principal, traceparent, time.perf_counter(), inputs)
        empty_final = bool(codec.parameters(request.parameters).get("triton_enable_empty_final_response"))
        dropped = 0

        def on_part(reply: Reply) -> None:
            nonlocal dropped
            if answers.qsize() >= STREAM_BACKLOG:
                dropped += 1
            elif reply.error is not None:
                answers.put_nowait(_stream_error(request, reply.error.message))
            else:
                response = codec.response_of(reply, manifest, request.id)
                if empty_final:
                    response.parameters["triton_final_response"].bool_param = False
                answers.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))

        call.on_part = on_part
        reply = await self.services.dispatcher.invoke(call)
        if dropped:
            raise Overloaded(
                f"{dropped} responses of model '{manifest.name}' were dropped: the client read its "
                f"stream too slowly ({STREAM_BACKLOG} responses waited to be read)"
            )
        if empty_final:
            final = service_pb2.ModelInferResponse(
                model_name=manifest.name, model_version=reply.version, id=request.id
            )
            final.parameters["triton_final_response"].bool_param = True
            answers.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=final))

    def _function(self, request: Any) -> FunctionVersion:
        return self.services.catalog.get(request.model_name, request.model_version or None)

    def _refused(self, request: Any, exc: FunctionError) -> None:
        """A failure before the core had the call (the core counts the rest)."""
        name = request.model_name
        metrics.failed(name if name in self.services.catalog.functions else "", exc.code.value)

    def _call(
        self,
        request: Any,
        function: FunctionVersion,
        rpc: Rpc | None,
        principal: Principal,
        traceparent: str | None,
        started: float,
        inputs: Tensors,
    ) -> Call:
        try:
            params = codec.parameters(request.parameters)
            return Call(
                function,
                inputs,
                codec.outputs_of(request, function.manifest),
                principal,
                codec.timeout_ms(params, rpc.time_remaining() if rpc is not None else None),
                codec.use_cache(params),
                request.id or None,
                traceparent,
                None,
                started,
                priority=codec.natural_parameter(params, "priority") or 0,
                queue_timeout_us=codec.natural_parameter(params, "timeout"),
                sequence=step_of(params),
            )
        except FunctionError as exc:
            self._refused(request, exc)
            raise

    async def _authorize(self, rpc: Rpc, scope: str, function: str | None) -> Principal:
        return await self.services.keys.authorize_async(rpc.metadata.get("authorization"), scope, function)

    def _span(self, method: str, traceparent: str | None) -> _ServerSpan:
        return _ServerSpan(self._tracing, method, traceparent)


def _cancelled(reply: asyncio.Future[Reply], answer: asyncio.Future[Any]) -> None:
    """A cancelled RPC (the client's RST_STREAM, its connection lost) lets go of its invocation."""
    if answer.cancelled():
        reply.cancel()


def _answer(
    answer: asyncio.Future[Any],
    manifest: FunctionManifest,
    request_id: str,
    rpc: Rpc,
    reply: asyncio.Future[Reply],
) -> None:
    if answer.done():
        return
    if reply.cancelled():
        answer.cancel()
    elif (error := reply.exception()) is not None:
        answer.set_exception(error)
    else:
        try:
            _timed(rpc, manifest, reply.result())
            answer.set_result(codec.response_of(reply.result(), manifest, request_id))
        except Exception as exc:  # a bug: the transport logs it and answers INTERNAL
            answer.set_exception(exc)


def _timed(rpc: Rpc | None, manifest: FunctionManifest, reply: Reply) -> None:
    """A cold start's phases in the RPC's trailing metadata (server-timing, as over HTTP); a
    stream's answers have no trailers of their own."""
    if reply.timing and rpc is not None:
        rpc.timing = metrics.server_timing(manifest.name, reply.timing)


HEALTH = ("ServerLive", "ServerReady")
"""Served to every caller, without a key."""
UNIMPLEMENTED = (
    "TraceSetting",
    "LogSettings",
)
"""RPCs fngate does not serve: UNIMPLEMENTED, to a caller with a valid key (as every RPC but health)."""


def _unimplemented(name: str) -> Any:
    async def refuse(self: GrpcInference, request: Any, rpc: Rpc) -> Any:
        await self._authorize(rpc, ANY, None)
        raise RpcError(Status.UNIMPLEMENTED, f"{name} is not served by fngate")

    refuse.__name__ = name
    return refuse


for _name in UNIMPLEMENTED:
    setattr(GrpcInference, _name, _unimplemented(_name))


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
                self._span.set_attribute("rpc.grpc.status_code", _code_of(exc))
            self._span.end()


def _code_of(exc: BaseException) -> int:
    if isinstance(exc, RpcError):
        return int(exc.status)
    if isinstance(exc, FunctionError):
        return int(CODES[exc.code])
    return int(Status.UNKNOWN)


def _trailers(exc: FunctionError, retry_after_s: int) -> Iterator[tuple[str, str]]:
    if isinstance(exc, RateLimited):
        yield "retry-after", str(exc.retry_after_s)
    elif exc.code in (ErrorCode.OVERLOADED, ErrorCode.UNAVAILABLE):
        yield "retry-after", str(retry_after_s)


def _stream_error(request: Any, message: str) -> Any:
    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    return service_pb2.ModelStreamInferResponse(error_message=message, infer_response=response)


def _internal(name: str, exc: BaseException) -> Internal:
    """A bug's error for the caller, with a request id; logged once with its traceback."""
    request_id = uuid.uuid4().hex
    log.error("%s over gRPC failed unexpectedly (request %s)", name[:160], request_id, exc_info=exc)
    metrics.failed("", ErrorCode.INTERNAL.value)
    return Internal(f"internal error (request id {request_id})")
