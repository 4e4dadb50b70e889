"""The gRPC front end's server: grpcio's asyncio server on the gateway's own event loop, serving
GRPCInferenceService on `grpc_port` for as long as the gateway's lifespan lasts."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from tritonclient.grpc import service_pb2_grpc

from fngate.errors import Unavailable
from gateway.grpc.service import GrpcInference
from gateway.state import Services

log = logging.getLogger(__name__)
MAX_CONCURRENT_RPCS = 4096
"""RPCs one gateway process serves at once; past it grpc answers RESOURCE_EXHAUSTED."""
STOP_GRACE_S = 5.0


@contextlib.asynccontextmanager
async def serving(services: Services) -> AsyncIterator[int]:
    """Serve until the block ends, then let RPCs in flight finish for a moment; yields the port
    (useful when `grpc_port` asked for any free one)."""
    settings = services.settings
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 1 if settings.grpc_reuse_port else 0),
        ],
        maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(GrpcInference(services), server)
    address = f"{settings.host}:{settings.grpc_port}"
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # the port is taken, or the address is not this host's
        raise Unavailable(f"cannot serve gRPC on {address}: {exc}") from exc
    await server.start()
    log.info("gRPC (GRPCInferenceService) on %s:%d", settings.host, port)
    try:
        yield port
    finally:
        await server.stop(STOP_GRACE_S)
