"""The gRPC front end's server: gateway.grpc.transport's connections on the gateway's own event
loop, serving GRPCInferenceService on `grpc_port` (or the listening socket `grpc_bind` names) for as
long as the gateway's lifespan lasts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

from fngate.errors import Unavailable
from gateway.grpc.rpc import Open, RpcLimits
from gateway.grpc.service import GrpcInference
from gateway.grpc.transport import GrpcConnection
from gateway.state import Services

log = logging.getLogger(__name__)
STOP_GRACE_S = 5.0
"""How long RPCs in flight at shutdown have to finish."""
BACKLOG = 2048


@contextlib.asynccontextmanager
async def serving(services: Services) -> AsyncIterator[int]:
    """Serve until the block ends, then take no new RPC and let those in flight finish for a
    moment; yields the port (useful when `grpc_port` asked for any free one)."""
    settings = services.settings
    service = GrpcInference(services)
    methods = service.methods()
    limits = RpcLimits(
        max_message_bytes=settings.max_body_bytes,
        max_headers=settings.max_headers,
        max_header_bytes=settings.max_header_bytes,
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        max_connections=settings.max_connections,
        budget=services.budget,
        failure=service.failure,
        authenticate=service.authenticate if services.keys.enabled else None,
        idle_timeout_s=settings.grpc_idle_timeout_s,
        drain_timeout_s=settings.grpc_drain_timeout_s,
        max_parked_bytes=settings.grpc_max_parked_bytes,
    )
    open_ = Open()
    loop = asyncio.get_running_loop()
    address = settings.grpc_bind or f"{settings.host}:{settings.grpc_port}"
    try:
        if settings.grpc_bind.startswith("fd://"):  # a supervisor's socket, which outlives this process
            sock = socket.socket(fileno=int(settings.grpc_bind.removeprefix("fd://")))
            server = await loop.create_server(
                lambda: GrpcConnection(methods, limits, open_), sock=sock, backlog=BACKLOG
            )
        else:
            server = await loop.create_server(
                lambda: GrpcConnection(methods, limits, open_),
                settings.host,
                settings.grpc_port,
                reuse_port=settings.grpc_reuse_port or None,
                backlog=BACKLOG,
            )
    except (OSError, ValueError) as exc:  # the port is taken, the address not this host's, no such fd
        raise Unavailable(f"cannot serve gRPC on {address}: {exc}") from exc
    host, port = server.sockets[0].getsockname()[:2]
    log.info("gRPC (GRPCInferenceService) on %s:%d", host, port)
    try:
        yield port
    finally:
        server.close()
        for connection in list(open_.connections):
            connection.go_away()
        waiting = [asyncio.ensure_future(connection.idle.wait()) for connection in open_.connections]
        if waiting:
            await asyncio.wait(waiting, timeout=STOP_GRACE_S)
            for pending in waiting:
                pending.cancel()
        for connection in list(open_.connections):
            if connection.transport is not None:
                connection.transport.close()
        await server.wait_closed()
