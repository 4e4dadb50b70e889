"""The HTTP front end: the only part of the gateway that knows ASGI, Starlette, routes, headers,
bodies and statuses."""
