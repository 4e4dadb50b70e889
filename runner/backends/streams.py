"""A decoupled Triton Python model's process, read by a thread of its own (runner.backends.python).

Triton hands a decoupled model its next batch once `execute` returns, while threads the model left
running still answer the last one. So does this: the batch's thread sends the batch down the
process's pipe and waits for its reply (the model's `execute` returned), which names the requests
that stream on; the reader thread reads everything the process sends, whenever it sends it: each
response goes to its batch's Streaming (and on to its caller), each final flag ends its request, and
a batch whose requests have all ended is done (`Streaming.continuing`). The reader also carries the
model's calls (BLS) and their answers, and tells the process of the callers that leave.

A batch, its streaming included, is bounded by the function's execution timeout: one that passes
it stops the process (as a late batch always did), and every batch still open there fails.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from fngate.errors import FunctionError, ModelFailed, ModelTimeout
from runner import bls, sandbox
from runner.backends import Mailbox, Streaming

log = logging.getLogger(__name__)

Frame = tuple[dict[str, Any], Any]


@dataclasses.dataclass(eq=False)
class _Batch:
    streamed: Streaming | None
    deadline: float
    reply: concurrent.futures.Future[Frame] = dataclasses.field(default_factory=concurrent.futures.Future)
    finals: set[int] = dataclasses.field(default_factory=set)
    """Its requests whose final flag came."""
    open: set[int] | None = None
    """Once its reply came: its requests that stream on."""


class ModelStreams:
    def __init__(
        self,
        name: str,
        requests: int,
        replies: int,
        max_frame_bytes: int,
        timeout_s: float,
        overdue: Callable[[], object],
    ) -> None:
        """`overdue`: stops the process (a batch passed its deadline); `timeout_s`: the function's
        execution timeout, named in the errors."""
        self._name = name
        self._requests, self._replies = requests, replies
        self._max_frame_bytes = max_frame_bytes
        self._timeout_s = timeout_s
        self._overdue = overdue
        self._lock = threading.Lock()
        self._writing = threading.Lock()
        self._batches: dict[int, _Batch] = {}
        self._next = 0
        self._calls = bls.Calls(name)
        self._added = Mailbox()
        """A batch was added: its cancels are to be watched."""
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name=f"streams-{name}", daemon=True)
        self._thread.start()

    def exchange(
        self, request: dict[str, Any], buffers: Any, deadline: float, streamed: Streaming | None
    ) -> Frame:
        """The batch down the pipe, and its reply once `execute` returned. Raises what reading
        the process raised (sandbox.ChannelClosed, FrameTooLarge, ...), TimeoutError past
        `deadline`. The requests that stream on end through `streamed.continuing`."""
        batch = _Batch(streamed, deadline)
        with self._lock:
            if self._failed is not None:
                raise self._failed
            self._next += 1
            number = self._next
            self._batches[number] = batch
        self._added.post(number)
        with self._writing:
            sandbox.send(self._requests, {**request, "batch": number}, buffers, deadline)
        try:
            header, body = batch.reply.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise TimeoutError from None
        with self._lock:
            still = set(header.get("open") or ()) - batch.finals
            if still and streamed is not None and "error" not in header:
                batch.open = still
                streamed.continuing = concurrent.futures.Future()
            else:
                self._batches.pop(number, None)
        return header, body

    def _read(self) -> None:
        waits = select.poll()
        for fd in (self._replies, self._added.fileno()):
            waits.register(fd, select.POLLIN)
        watched: set[int] = set()
        stopping = False
        try:
            while True:
                self._added.take()
                with self._lock:
                    batches = list(self._batches.items())
                if self._calls.fileno() >= 0 and self._calls.fileno() not in watched:
                    waits.register(self._calls.fileno(), select.POLLIN)
                    watched.add(self._calls.fileno())
                for _number, batch in batches:
                    if batch.streamed is not None and batch.streamed.cancels.fileno() not in watched:
                        fd = batch.streamed.cancels.fileno()
                        if fd >= 0:
                            waits.register(fd, select.POLLIN)
                            watched.add(fd)
                self._send_down(batches)
                now = time.monotonic()
                if not stopping and any(batch.deadline <= now and batch.open for _, batch in batches):
                    stopping = True  # a stream past its deadline (a batch still waited on times out in run)
                    self._overdue()  # the process is stopped: the next read fails them all
                deadlines = [batch.deadline for _, batch in batches if not stopping]
                wait_ms = max(1.0, (min(deadlines) - now) * 1000) if deadlines else None
                ready = waits.poll(wait_ms)
                for fd, events in ready:
                    if fd in watched and events & (select.POLLNVAL | select.POLLHUP):
                        waits.unregister(fd)  # its batch ended and its pipe was closed
                        watched.discard(fd)
                if not any(fd == self._replies for fd, _events in ready):
                    continue
                header, body = sandbox.receive(self._replies, time.monotonic() + 30, self._max_frame_bytes)
                self._take(header, body)
        except BaseException as exc:  # the process is gone (or wrote what is not a frame)
            self._fail_all(exc)
        finally:
            self._calls.close()
            self._added.close()

    def _send_down(self, batches: list[tuple[int, _Batch]]) -> None:
        """The calls' answers and responses, and the callers that left, down the pipe."""
        frames = self._calls.frames()
        for number, batch in batches:
            for index in batch.streamed.cancels.take() if batch.streamed is not None else ():
                frames.append(({"op": "cancel", "batch": number, "index": index}, []))
        if frames:
            with self._writing:
                for frame, buffers in frames:
                    sandbox.send(self._requests, frame, buffers, time.monotonic() + 30)

    def _take(self, header: dict[str, Any], body: Any) -> None:
        op = header.get("op")
        if op == "sent":
            self._sent(header, body)
        elif op == "call":
            with self._lock:
                deadline = max((batch.deadline for batch in self._batches.values()), default=time.monotonic())
            self._calls.start(header, body, deadline)
        else:
            with self._lock:
                number = int(header.get("batch", 0))
                batch = self._batches.get(number)
            if batch is not None and not batch.reply.done():
                batch.reply.set_result((header, body))

    def _sent(self, header: dict[str, Any], body: Any) -> None:
        """A response of a request of a batch, or its final flag."""
        number, index = int(header.get("batch", 0)), int(header.get("index", 0))
        with self._lock:
            batch = self._batches.get(number)
        if batch is None:
            return  # its batch failed, or ended
        if not header.get("empty") and batch.streamed is not None:
            error = header.get("error")
            failure = FunctionError.from_code(str(error[0]), str(error[1])) if error else None
            outputs = {} if failure is not None else sandbox.unpack_tensors(header.get("tensors") or [], body)
            batch.streamed.send(index, outputs, failure)
        if not header.get("final"):
            return
        with self._lock:
            batch.finals.add(index)
            if batch.open is None:
                return  # its reply is still to come
            batch.open.discard(index)
            if batch.open:
                return
            self._batches.pop(number, None)
        if batch.streamed is not None and batch.streamed.continuing is not None:
            batch.streamed.continuing.set_result({})

    def _fail_all(self, exc: BaseException) -> None:
        overdue = any(batch.deadline <= time.monotonic() for batch in self._batches.values())
        if overdue:
            error: FunctionError = ModelTimeout(
                f"function '{self._name}': a stream ran past its execution timeout of "
                f"{self._timeout_s * 1000:.0f} ms; its process was stopped and starts again"
            )
        else:
            error = ModelFailed(f"function '{self._name}': its process ended while it streamed")
        with self._lock:
            self._failed = exc if isinstance(exc, Exception) else sandbox.ChannelClosed()
            batches, self._batches = list(self._batches.values()), {}
        for batch in batches:
            if not batch.reply.done():
                batch.reply.set_exception(self._failed)
            continuing = batch.streamed.continuing if batch.streamed is not None else None
            if batch.open and continuing is not None and not continuing.done():
                continuing.set_result({index: error for index in batch.open})
