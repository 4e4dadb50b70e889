"""ClusterFastRedis: the hot path's client (fngate.fastredis) on a Redis Cluster. One pipelined
connection per primary; each command goes to the primary that serves its key's slot (keys.slot),
auto-pipelined with the others bound there.

A MOVED answer updates the slot's owner, sends the command there, and refreshes the whole map (a
failover, a slot moved); ASK sends it once, after ASKING, to the node importing the slot; TRYAGAIN
(keys of a script split between two nodes while their slot moves) retries until the command's
timeout. A lost connection fails the commands on it, which may have run: none is sent twice; the
map is refreshed, so that the next ones reach the replica that took over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fngate import keys
from fngate.fastredis import FastRedis

log = logging.getLogger(__name__)
Address = tuple[str, int]

REDIRECTS = 5
"""MOVED and ASK answers one command follows in a row; past them it is routed again a moment later
(the map read anew), until its deadline."""
TRY_AGAIN_S = 0.02
REFRESH_EVERY_S = 0.2
"""The slot map is asked for at most this often."""


def command_key(args: Sequence[Any]) -> Any:
    """The key that routes a command (all of a script's keys share its slot), or None."""
    name = _text(args[0]).upper()
    if name in ("EVALSHA", "EVAL"):
        return args[3] if int(args[2]) > 0 else None
    if name in ("XREAD", "XREADGROUP"):
        at = [_text(arg).upper() for arg in args].index("STREAMS")
        return args[at + 1]
    if name in ("XGROUP", "XINFO"):
        return args[2]
    if name in ("SCRIPT", "PING", "CLUSTER", "ASKING") or len(args) < 2:
        return None
    return args[1]


def placeheld(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A script call whose absent keys ('') are sent as the hash tag of its first key alone
    ('{tiny}'): a declared key of another slot (slot 0, for '') would refuse the call with
    CROSSSLOT. The scripts take both for absent (fngate.queue's `given`)."""
    count = int(args[2])
    declared = [_text(key) for key in args[3 : 3 + count]]
    if "" not in declared:
        return args
    first = next((key for key in declared if key), "")
    tag = "{" + keys.hash_tag(first) + "}"
    return (*args[:3], *(key or tag for key in declared), *args[3 + count :])


@dataclasses.dataclass(slots=True)
class _Routed:
    """One command on its way to the primary of its slot: what it needs when it is sent again
    (after MOVED, ASK or TRYAGAIN, or once the slot map is known)."""

    answer: asyncio.Future[Any]
    args: tuple[Any, ...]
    slot: int | None
    timeout_s: float | None
    deadline: float
    redirects: int = 0


class ClusterFastRedis(FastRedis):
    cluster = True

    def __init__(
        self, seeds: Sequence[Address], node_url: Callable[[str, int], str], timeout_s: float
    ) -> None:
        # No FastRedis.__init__: this client holds one of them per node instead of a connection.
        self._seeds = list(seeds)
        self._node_url = node_url
        self._timeout_s = timeout_s
        self._nodes: dict[Address, FastRedis] = {}
        self._slots: list[Address | None] = [None] * keys.SLOTS
        self._refreshing: asyncio.Task[None] | None = None
        self._last_refresh = float("-inf")

    async def execute(self, *args: Any, timeout_s: float | None = None) -> Any:
        return await self.send(*args, timeout_s=timeout_s)

    def send(self, *args: Any, timeout_s: float | None = None) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Any] = loop.create_future()
        name = _text(args[0]).upper()
        if name in ("EVALSHA", "EVAL"):
            args = placeheld(args)
        key = command_key(args)
        if key is None and name == "SCRIPT":
            self._background(self._everywhere(answer, args, timeout_s))
            return answer
        slot = keys.slot(key) if key is not None else None
        deadline = loop.time() + (timeout_s or self._timeout_s)
        self._route(_Routed(answer, args, slot, timeout_s, deadline))
        return answer

    def _route(self, command: _Routed, asking: Address | None = None) -> None:
        if command.answer.done():  # its caller stopped waiting
            return
        address = asking or self._owner(command.slot)
        if address is None:  # the map is not known yet (the first command) or has a hole
            self._background(self._route_when_known(command))
            return
        node = self._node(address)
        sent: asyncio.Future[Any]
        if asking is not None:
            execution = node.execute_after(("ASKING",), *command.args, timeout_s=command.timeout_s)
            sent = asyncio.ensure_future(execution)
        else:
            sent = node.send(*command.args, timeout_s=command.timeout_s)
        sent.add_done_callback(lambda future: self._answered(future, command))

    def _answered(self, sent: asyncio.Future[Any], command: _Routed) -> None:
        answer = command.answer
        if sent.cancelled():
            if not answer.done():
                answer.cancel()
            return
        error = sent.exception()  # retrieved even when nobody waits any more
        if answer.done():
            return
        if error is None:
            answer.set_result(sent.result())
            return
        if isinstance(error, ResponseError):
            kind, _, rest = str(error).partition(" ")
            if kind in ("MOVED", "ASK") and command.redirects >= REDIRECTS:
                # Redirected REDIRECTS times in a row (at a migration's end the slot's two nodes may
                # disagree on its owner for a moment): a redirection runs nothing, so it is asked
                # again, once the map is read anew, until the deadline.
                self._refresh_soon()
                if self._again_later(command):
                    return
            elif kind in ("MOVED", "ASK"):
                moved_slot, _, target = rest.partition(" ")
                address = _address(target)
                command.redirects += 1
                if kind == "MOVED":
                    self._slots[int(moved_slot)] = address
                    self._refresh_soon()
                    self._route(command)
                else:
                    self._route(command, asking=address)
                return
            # A slot that migrates answers ASK, then TRYAGAIN until a script's keys are on one node,
            # for as long as the migration lasts.
            if kind == "TRYAGAIN" and self._again_later(command):
                return
            if kind == "CLUSTERDOWN":
                self._refresh_soon()
        elif isinstance(error, RedisConnectionError | RedisTimeoutError | OSError):
            self._refresh_soon()
        answer.set_exception(error)

    def _again_later(self, command: _Routed) -> bool:
        """Route it again TRY_AGAIN_S from now, with REDIRECTS anew, unless that is past its
        deadline (the deadline bounds these rounds; REDIRECTS, the redirections between two)."""
        loop = asyncio.get_running_loop()
        if loop.time() + TRY_AGAIN_S >= command.deadline:
            return False
        command.redirects = 0
        loop.call_later(TRY_AGAIN_S, self._route, command)
        return True

    async def _route_when_known(self, command: _Routed) -> None:
        answer = command.answer
        try:
            async with asyncio.timeout_at(command.deadline):
                while self._owner(command.slot) is None:
                    await asyncio.shield(self._refresh_soon())
        except TimeoutError:
            if not answer.done():
                message = f"no node of the Redis Cluster serves slot {command.slot}"
                answer.set_exception(RedisConnectionError(message))
            return
        except RedisError as exc:
            if not answer.done():
                answer.set_exception(exc)
            return
        self._route(command)

    async def _everywhere(
        self, answer: asyncio.Future[Any], args: tuple[Any, ...], timeout_s: float | None
    ) -> None:
        """A keyless command that every primary needs (SCRIPT LOAD): its first answer, once all
        answered; it fails only where no primary took it."""
        try:
            if not any(self._slots):
                await asyncio.shield(self._refresh_soon())
            primaries = {address for address in self._slots if address is not None}
            results = await asyncio.gather(
                *(self._node(address).execute(*args, timeout_s=timeout_s) for address in primaries),
                return_exceptions=True,
            )
        except RedisError as exc:
            if not answer.done():
                answer.set_exception(exc)
            return
        if answer.done():
            return
        good = [result for result in results if not isinstance(result, BaseException)]
        if good:
            answer.set_result(good[0])
        else:
            answer.set_exception(results[0] if results else RedisConnectionError("no primary answered"))

    def _owner(self, slot: int | None) -> Address | None:
        if slot is None:
            return next((address for address in self._slots if address is not None), None)
        return self._slots[slot]

    def _node(self, address: Address) -> FastRedis:
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = FastRedis(self._node_url(*address), self._timeout_s)
        return node

    def _refresh_soon(self) -> asyncio.Task[None]:
        """The refresh under way, or a new one: one at a time, however many ask."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
            self._refreshing.add_done_callback(_logged)
        return self._refreshing

    async def _refresh(self) -> None:
        """Ask one node after another for the slot map (CLUSTER SLOTS), at most every
        REFRESH_EVERY_S; connections to nodes no longer primaries are closed. Raises
        RedisConnectionError when no node answers."""
        loop = asyncio.get_running_loop()
        wait_s = self._last_refresh + REFRESH_EVERY_S - loop.time()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self._last_refresh = loop.time()
        known = [address for address in dict.fromkeys(self._slots) if address is not None]
        failures = []
        for address in dict.fromkeys([*known, *self._nodes, *self._seeds]):
            try:
                reply = await self._node(address).execute("CLUSTER", "SLOTS")
            except (RedisError, OSError) as exc:
                failures.append(f"{address[0]}:{address[1]}: {exc}")
                continue
            self._apply(reply, address)
            return
        raise RedisConnectionError("no node of the Redis Cluster answered: " + "; ".join(failures))

    def _apply(self, reply: Any, asked: Address) -> None:
        slots: list[Address | None] = [None] * keys.SLOTS
        for start, end, primary, *_replicas in reply:
            host = _text(primary[0]) or asked[0]
            address = (host, int(primary[1]))
            for slot in range(int(start), int(end) + 1):
                slots[slot] = address
        if slots != self._slots:
            log.info("Redis Cluster slot map: %d primaries", len({a for a in slots if a is not None}))
        self._slots = slots
        primaries = set(slots)
        for address in [address for address in self._nodes if address not in primaries]:
            if address in self._seeds:
                continue  # kept to ask for the map
            self._background(self._nodes.pop(address).aclose())

    def _background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)

    async def aclose(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError):
                await self._refreshing
        nodes, self._nodes = list(self._nodes.values()), {}
        await asyncio.gather(*(node.aclose() for node in nodes))


_tasks: set[asyncio.Task[Any]] = set()
"""Background routing and refreshes: held until done (an unreferenced task may be collected)."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def _logged(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("Redis Cluster slot map not refreshed: %s", task.exception())


def _address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    return host, int(port)
