"""The HTTP floor: the cheapest endpoint on the gateway's server (read the body, answer a fixed
JSON), served exactly as the gateway is. What fngate's gateway costs above this is its own overhead."""

from __future__ import annotations

import asyncio
import sys

from starlette.types import Receive, Scope, Send

from fngate.config import GatewaySettings
from fngate.process import run_forever
from gateway.http.server import SERVERS

BODY = b'{"outputs": []}'


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            reply = "lifespan.startup.complete" if message["type"] == "lifespan.startup" else None
            if reply is None:
                await send({"type": "lifespan.shutdown.complete"})
                return
            await send({"type": reply})
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


def main() -> None:
    settings = GatewaySettings(bind=sys.argv[1], server=sys.argv[2] if len(sys.argv) > 2 else "uvicorn")
    run_forever(SERVERS[settings.server](echo, settings, asyncio.Event()))


if __name__ == "__main__":
    main()
