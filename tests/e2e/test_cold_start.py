"""The loading rule (docs/cold-start.md): invocations that arrive while their model loads wait for
the load, up to the model's load_timeout_s, before their own deadline starts; so the first
invocation of a function whose load outlasts its timeout_ms is answered under default settings."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from tests.e2e.test_scale_to_zero import scaler

__all__ = ["scaler"]

ROW = [1.0, 2.0, 3.0, 4.0]


async def test_invocations_that_arrive_while_the_model_loads_are_answered(
    serve_gateway: Callable[..., Any], scaler: Callable[..., Any]
) -> None:
    base = await serve_gateway()
    await scaler()
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        # No runner yet: the pool wakes, the runner starts and the model loads for 3 s, three
        # times the function's timeout_ms; every invocation queued meanwhile is answered.
        first = await asyncio.gather(
            *(client.post("/v1/functions/slowload", json={"inputs": {"x": [ROW]}}) for _ in range(3))
        )
        for response in first:
            assert response.status_code == 200, response.text
            assert response.json()["outputs"]["y"] == [[2.0, 4.0, 6.0, 8.0]]

        # The wait is bounded: with load_timeout_s (0.5 s) shorter than the load, the deadline
        # starts at the bound and passes before the model is ready.
        late = await client.post("/v1/functions/impatient", json={"inputs": {"x": [ROW]}})
        assert late.status_code == 504, late.text
        assert late.json()["code"] == "deadline_exceeded"
        assert "load_timeout_s" in late.json()["error"]
