"""Administrative HTTP routes (the Open Inference Protocol model repository extension and the
deploy API), kept apart from the data plane so they can sit behind their own auth."""

from __future__ import annotations

from starlette.routing import Route

ROUTES: list[Route] = []
