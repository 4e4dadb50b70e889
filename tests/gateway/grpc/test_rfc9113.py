"""The gateway's HTTP/2 against RFC 9113: every requirement of sections 3.4 to 8 that a client can
test on a server, each a probe of raw frames in bench.rfc9113 named after its requirement (its
section in its docstring), run against a real gateway process on the uvicorn build and on the
Hypercorn build.

The gRPC port is the same on both builds: gateway.grpc.server serves it from the app's lifespan on
the process's own event loop (uvloop) with gateway.grpc.transport and gateway.grpc.http2, whichever
HTTP server runs the app. Both builds are run all the same, as the issue asks. Each build is one
gateway process for the whole module; every probe opens connections of its own."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.h2_peer import PREFACE, settings
from bench.rfc9113 import PROBES, Probe
from tests.conftest import free_socket
from tests.gateway.conftest import running_gateway
from tests.gateway.grpc.test_front_door import SERVERS

READY_TIMEOUT_S = 30.0


def answers_http2(port: int) -> bytes:
    """The first bytes the gRPC port answers a client preface with (its SETTINGS), waiting for a
    gateway that is still starting (its socket already listens: the connection waits in the
    backlog)."""
    with socket.create_connection(("127.0.0.1", port), timeout=READY_TIMEOUT_S) as sock:
        sock.sendall(PREFACE + settings())
        return sock.recv(9)


@pytest.fixture(scope="module", params=SERVERS)
def grpc_port(
    request: pytest.FixtureRequest,
    single_redis_url: str,
    repo: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[int]:
    """A gateway process of the build `request.param` names, serving gRPC on a socket bound here."""
    grpc_socket = free_socket()
    log_path = tmp_path_factory.mktemp("rfc9113") / "gateway.log"
    with (
        grpc_socket,
        running_gateway(single_redis_url, repo, log_path, grpc_socket, FNGATE_SERVER=request.param),
    ):
        port: int = grpc_socket.getsockname()[1]
        assert answers_http2(port)[3] == 4, "the gRPC port's first frame is not SETTINGS"
        yield port


LEFT_OUT = {
    "field_values_with_leading_or_trailing_whitespace_are_malformed": (
        "taken on purpose: Triton's perf_analyzer sends -H 'authorization: Bearer KEY' as ' Bearer KEY' "
        "(gateway/grpc/fields.py)"
    ),
}
"""Requirements the gateway leaves out on purpose, each with its reason: expected to fail, so that
the suite says so and notices if that changes."""


def probes() -> list[Any]:
    return [
        pytest.param(
            function,
            id=function.__name__,
            marks=[pytest.mark.xfail(strict=True, reason=LEFT_OUT[function.__name__])]
            if function.__name__ in LEFT_OUT
            else [],
        )
        for _, function in PROBES
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("probe", probes())
async def test_rfc9113(grpc_port: int, probe: Probe) -> None:
    await asyncio.wait_for(probe(grpc_port), timeout=20)
