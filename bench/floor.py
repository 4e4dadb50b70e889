"""The HTTP floor: the cheapest Starlette-on-Hypercorn endpoint (read the body, answer a fixed JSON),
served exactly as the gateway is. What fngate's gateway costs above this is fngate's own overhead."""

from __future__ import annotations

import asyncio
import sys

import uvloop
from hypercorn.asyncio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fngate.config import GatewaySettings
from gateway.__main__ import hypercorn_config


async def echo(request: Request) -> Response:
    await request.body()
    return Response(b'{"outputs": []}', media_type="application/json")


def main() -> None:
    settings = GatewaySettings(bind=sys.argv[1])
    app = Starlette(routes=[Route("/v2/models/{name}/infer", echo, methods=["POST"])])
    uvloop.run(serve(app, hypercorn_config(settings), shutdown_trigger=asyncio.Event().wait))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
