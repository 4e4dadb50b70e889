"""Execution slots (runner.rate_limiter): a holder waits until what it needs is free and every earlier
waiter is served; a resource the runner does not name has as much as the largest need."""

from __future__ import annotations

import asyncio

from runner.rate_limiter import RateLimiter


async def test_waiters_are_served_in_order_when_what_they_need_is_free() -> None:
    slots = RateLimiter({"GPU_EXEC_SLOTS": 8})
    order: list[str] = []
    release = {name: asyncio.Event() for name in ("heavy-1", "heavy-2", "heavy-3", "light")}

    async def run(name: str, need: int) -> None:
        async with slots.hold({"GPU_EXEC_SLOTS": need}):
            order.append(name)
            await release[name].wait()

    tasks = [asyncio.create_task(run("heavy-1", 4)), asyncio.create_task(run("heavy-2", 4))]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(run("heavy-3", 4)), asyncio.create_task(run("light", 1))]
    await asyncio.sleep(0.01)
    assert order == ["heavy-1", "heavy-2"]  # the light one waits behind the heavy one before it
    assert slots.free("GPU_EXEC_SLOTS") == 0
    release["heavy-1"].set()
    await asyncio.sleep(0.01)
    assert order == ["heavy-1", "heavy-2", "heavy-3"]
    release["heavy-2"].set()
    await asyncio.sleep(0.01)
    assert order[-1] == "light"
    for event in release.values():
        event.set()
    await asyncio.gather(*tasks)
    assert slots.free("GPU_EXEC_SLOTS") == 8


async def test_an_unnamed_resource_has_the_largest_need_and_a_cancelled_waiter_leaves_its_place() -> None:
    slots = RateLimiter()
    async with slots.hold({"MEMORY_BW": 2}):
        waiter = asyncio.create_task(slots.hold({"MEMORY_BW": 1}).__aenter__())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        waiter.cancel()
    async with slots.hold({"MEMORY_BW": 2}):
        assert slots.free("MEMORY_BW") == 0
    assert slots.free("MEMORY_BW") == 2
