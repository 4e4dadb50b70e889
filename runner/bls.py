"""Business logic scripting: a Triton Python model's `InferenceRequest(...).exec()` and
`async_exec()`, carried out by its runner. The model's process (confined, with no way to Redis)
sends each call on its pipe (runner.sandbox's frames); the thread that waits on its batch hands it
to the runner's event loop, where it is queued on the callee's stream as any invocation is (batched
with everyone else's, on whatever runner serves it) with the time left of the batch as its
deadline; its reply comes back on this runner's own reply stream, and goes back down the pipe. A
decoupled call (`exec(decoupled=True)`) gets each of the callee's responses down the pipe as it
comes, then the reply that ends them.

A model that calls itself is refused at once (it would wait for its own batch); a longer cycle
ends at the deadline."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from fngate import keys, queue
from fngate.errors import (
    DeadlineExceeded,
    FunctionError,
    FunctionNotFound,
    Internal,
    InvalidArgument,
    Overloaded,
    Unavailable,
)
from fngate.fastredis_cluster import placeheld
from fngate.repository import FunctionRecord, FunctionVersion
from fngate.wire import Invocation, Reply, replies_of
from runner import sandbox
from runner.backends import Mailbox

log = logging.getLogger(__name__)

RENEW_S = 5.0
LISTED_S = 60.0
"""How long the reply stream outlives this runner's last call (a gateway's sweep removes it)."""

_installed: tuple[Caller, asyncio.AbstractEventLoop] | None = None


def install(caller: Caller) -> None:
    """The runner's caller, which its models' processes call through (one runner a process; in
    tests, several runners in one process share the last one's)."""
    global _installed  # noqa: PLW0603 - one runner a process
    _installed = (caller, asyncio.get_running_loop())


def uninstall(caller: Caller) -> None:
    global _installed  # noqa: PLW0603 - one runner a process
    if _installed is not None and _installed[0] is caller:
        _installed = None


def start(
    function: str,
    header: Mapping[str, Any],
    body: np.ndarray[Any, Any],
    deadline: float,
    on_part: Callable[[Reply], None] | None = None,
) -> Any:
    """A call a model's process sent, under way on the runner's loop (from the batch's thread): a
    concurrent future of its Reply. `deadline`: time.monotonic() by which the batch must end.
    `on_part` (a decoupled call's): each of the callee's responses as it comes, on the loop."""
    installed = _installed
    if installed is None:
        failed: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        failed.set_exception(Unavailable("business logic scripting needs a runner's caller"))
        return failed
    caller, loop = installed
    return asyncio.run_coroutine_threadsafe(caller.call(function, header, body, deadline, on_part), loop)


def answer(call_id: Any, future: Any) -> tuple[dict[str, Any], list[Any]]:
    """The frame that answers a call in the model's process: the callee's outputs, or its error."""
    try:
        reply: Reply = future.result()
        error = reply.error
    except FunctionError as exc:
        error = exc
    except Exception as exc:
        log.exception("a model's call failed unexpectedly")
        error = Internal(f"the call failed unexpectedly: {type(exc).__name__}")
    if error is not None:
        return {"op": "called", "id": call_id, "error": error.message, "code": error.code.value}, []
    specs, buffers = sandbox.pack_tensors(reply.outputs)
    return {"op": "called", "id": call_id, "tensors": specs}, buffers


def part(call_id: Any, reply: Reply) -> tuple[dict[str, Any], list[Any]]:
    """The frame of one response of a decoupled call, before the call's answer ends it."""
    if reply.error is not None:
        return {"op": "called", "id": call_id, "part": True, "error": reply.error.message}, []
    specs, buffers = sandbox.pack_tensors(reply.outputs)
    return {"op": "called", "id": call_id, "part": True, "tensors": specs}, buffers


class Calls:
    """The calls a model's process made that are under way, for the thread that reads its pipe:
    `start` each as it comes, wait on `fileno()` (readable once one is answered, or a decoupled
    callee sent a response), then `frames()` down the pipe. `close()` cancels what is left."""

    def __init__(self, function: str) -> None:
        self._function = function
        self._under_way: dict[Any, Any] = {}
        """A call's concurrent future of its Reply -> the call's id in the process."""
        self._mailbox: Mailbox | None = None

    def start(self, header: Mapping[str, Any], body: np.ndarray[Any, Any], deadline: float) -> None:
        from runner.backends import Mailbox

        if self._mailbox is None:
            self._mailbox = Mailbox()
        call_id = header.get("id")
        mailbox = self._mailbox
        on_part = (lambda reply: mailbox.post(("part", call_id, reply))) if header.get("decoupled") else None
        future = start(self._function, header, body, deadline, on_part)
        self._under_way[future] = call_id
        future.add_done_callback(lambda done: mailbox.post(("done", done)))

    def fileno(self) -> int:
        """-1 before the first call."""
        return self._mailbox.fileno() if self._mailbox is not None else -1

    def frames(self) -> list[tuple[dict[str, Any], list[Any]]]:
        """The answers and responses that came since the last look, as frames for the process."""
        found = []
        for item in self._mailbox.take() if self._mailbox is not None else ():
            if item[0] == "part":
                found.append(part(item[1], item[2]))
            elif item[1] in self._under_way:
                found.append(answer(self._under_way.pop(item[1]), item[1]))
        return found

    def close(self) -> None:
        for future in list(self._under_way):
            future.cancel()
        if self._mailbox is not None:
            self._mailbox.close()


class Caller:
    """Queues the calls of this runner's models and waits for their replies on its own stream."""

    def __init__(
        self, redis: aioredis.Redis, runner: str, records: Callable[[], Mapping[str, FunctionRecord]]
    ) -> None:
        self._redis = redis
        self._name = f"runner-{runner}"
        self.stream = keys.replies(self._name)
        self._registered = float("-inf")
        self._records = records
        self._enqueue = redis.register_script(queue.ENQUEUE)
        self._waiting: dict[str, asyncio.Future[Reply]] = {}
        self._parts: dict[str, Callable[[Reply], None]] = {}
        """Decoupled calls' invocation id -> where each of the callee's responses goes."""
        self._reader: asyncio.Task[None] | None = None

    async def call(
        self,
        caller: str,
        header: Mapping[str, Any],
        body: np.ndarray[Any, Any],
        deadline: float,
        on_part: Callable[[Reply], None] | None = None,
    ) -> Reply:
        """The callee's answer; with `on_part` (exec(decoupled=True)), each of its responses goes
        there as it comes and the answer ends them."""
        function = self._callee(caller, header)
        spec = function.manifest.model_spec
        if on_part is None and spec is not None and spec.decoupled:
            raise InvalidArgument(
                f"'{function.manifest.model_name}' is a decoupled model, which answers with any number "
                "of responses: call it with exec(decoupled=True)"
            )
        inputs = sandbox.unpack_tensors(header.get("tensors") or [], body)
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise DeadlineExceeded(f"no time was left to call '{function.manifest.model_name}'")
        deadline_ms = int(time.time() * 1000 + left_s * 1000)
        outputs = header.get("outputs")
        invocation = Invocation(
            uuid.uuid4().hex,
            function.name,
            function.version,
            self.stream,
            deadline_ms,
            inputs,
            tuple(str(name) for name in outputs) if outputs else None,
            digest=function.digest,
        )
        batching = function.manifest.batching
        script = queue.enqueue_call(
            keys.invocations(function.name),
            invocation.encode(),
            queue.Waiter(self.stream, invocation.id, deadline_ms),
            int(left_s * 1000),
            batching.max_queue_size,
            batching.max_queue_bytes,
        )
        answer: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting[invocation.id] = answer
        if on_part is not None:
            self._parts[invocation.id] = on_part
        self._read_replies()
        try:
            try:
                await self._register()
                # Absent keys as the stream's hash tag: a Redis Cluster refuses a script whose
                # keys span slots ('' is slot 0); the scripts read both as absent.
                held = placeheld(("EVALSHA", "", len(script.keys), *script.keys))[3:]
                outcome = queue.parse_enqueue(await self._enqueue(keys=list(held), args=script.args))
            except (RedisError, OSError) as exc:
                raise Unavailable(f"the queue is unavailable: {exc}") from exc
            if isinstance(outcome, queue.Full):
                raise Overloaded(queue.full_message(f"function '{function.name}'", outcome.limit, False))
            try:
                return await asyncio.wait_for(answer, left_s)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"'{function.manifest.model_name}' did not answer within the {left_s * 1000:.0f} ms "
                    "the calling batch had left"
                ) from None
        finally:
            self._waiting.pop(invocation.id, None)
            self._parts.pop(invocation.id, None)

    def _callee(self, caller: str, header: Mapping[str, Any]) -> FunctionVersion:
        """The version a call names: by function or Triton model name, its version or the one served."""
        name = header.get("model")
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name or "")
        records = self._records()
        by_model = {(each.default or each.newest()).manifest.model_name: each for each in records.values()}
        record = records.get(name) or by_model.get(name)
        if record is None:
            raise FunctionNotFound(f"Request for unknown model: '{name[:200]}' is not found")
        if record.name == caller:
            raise InvalidArgument(
                f"'{name}' calls itself: a model's call waits for a batch of its own function, which "
                "its running batch holds"
            )
        version = str(header.get("version") or "")
        if version in ("", "-1"):
            if record.default is None:
                raise Unavailable(f"'{name}': its version policy serves no version")
            return record.default
        found = record.versions.get(version)
        if found is None:
            raise FunctionNotFound(f"Request for unknown model: '{name}' version {version[:20]} is not found")
        return found

    async def _register(self) -> None:
        """The reply stream made (runners reply only to streams that exist) and listed with the
        gateways' (keys.gateways), whose sweep removes it once this runner stops renewing it."""
        now = time.monotonic()
        if now - self._registered < RENEW_S:
            return
        try:
            await self._redis.xgroup_create(self.stream, "alive", "$", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        await self._redis.zadd(keys.gateways(), {self._name: time.time() + LISTED_S})
        self._registered = now

    def _read_replies(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="bls replies")

    async def _read(self) -> None:
        """Replies to this runner's calls, until none is awaited; each read is deleted."""
        last = "0-0"
        while self._waiting:
            try:
                found: Any = await self._redis.xread({self.stream: last}, count=100, block=1000)
            except (RedisError, OSError) as exc:
                log.warning("reading the replies to models' calls: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for _stream, entries in found or ():
                for entry_id, fields in entries:
                    last = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    for reply in replies_of(fields):
                        if reply.part:
                            on_part = self._parts.get(reply.id)
                            if on_part is not None:
                                on_part(reply)
                            continue
                        waiting = self._waiting.get(reply.id)
                        if waiting is not None and not waiting.done():
                            waiting.set_result(reply)
                with contextlib.suppress(RedisError, OSError):
                    await self._redis.xtrim(self.stream, minid=last, approximate=False)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        with contextlib.suppress(RedisError, OSError):
            await self._redis.delete(self.stream)
