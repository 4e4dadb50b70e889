"""FastRedis: one Redis connection on an asyncio protocol with hiredis's reply parser, for the
hot path's few commands (EVALSHA, XREADGROUP). Every command issued in one event-loop turn goes
out in one write, and replies are matched to callers in order: auto-pipelining for free.

Measured with `python -m bench.redis_clients`, a client CPU cost per call about a sixth of
redis-py's (which the rest of fngate keeps using: pub/sub, scans, admin work). Errors are
redis-py's exceptions, so callers handle one vocabulary: a reply error is a ResponseError (or
NoScriptError), a lost or refused connection a ConnectionError, a command not answered in
`timeout_s` a TimeoutError (and the connection is dropped, since later replies would be out of
step). A call after a failure connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
from collections import deque
from typing import Any

import hiredis
from hiredis import pack_command
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)


def encode(args: tuple[Any, ...]) -> bytes:
    """One command in RESP (what every client writes; hiredis parses what comes back). hiredis packs
    str, bytes, int and float in C; a command with other buffers is packed here."""
    try:
        packed: bytes = pack_command(args)
    except TypeError:
        return _encode(args)
    return packed


def _encode(args: tuple[Any, ...]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes | bytearray | memoryview):
            data = bytes(arg)
        elif isinstance(arg, str):
            data = arg.encode()
        else:
            data = str(arg).encode()
        out += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(out)


def _error(reply: hiredis.ReplyError) -> ResponseError:
    message = str(reply)
    return NoScriptError(message) if message.startswith("NOSCRIPT") else ResponseError(message)


SCRIPTS: dict[str, str] = {}
"""Every Script's source by its SHA1: loaded on a connection before its first EVALSHA there."""


def _ignored(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("SCRIPT LOAD failed: %s (its EVALSHA says so)", future.exception())


class _Protocol(asyncio.Protocol):
    def __init__(self, closed: asyncio.Future[None]) -> None:
        self.loop = asyncio.get_running_loop()  # made by a connection on this loop, used on it alone
        self._reader = hiredis.Reader()
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self._deadlines: deque[float] = deque()
        """loop.time() by which each waiting command must be answered."""
        self._watchdog: asyncio.TimerHandle | None = None
        self._timed_out = False
        self.transport: asyncio.Transport | None = None
        self.closed = closed
        self._outgoing: list[bytes] = []
        self.loaded: set[str] = set()
        """The scripts (SHA1) loaded on this connection (SCRIPT LOAD, sent before their first call)."""

    def load_before(self, args: tuple[Any, ...], timeout_s: float) -> None:
        """Before an EVALSHA of a Script not yet loaded on this connection: SCRIPT LOAD, in the
        same order on the same connection, so that the call never meets NOSCRIPT. A call retried
        after NOSCRIPT would run after commands sent behind it (a sequence's next step queued
        before its start); a new connection (a restarted Redis) loads again."""
        if not args or args[0] != "EVALSHA":
            return
        sha = args[1]
        if sha in self.loaded or sha not in SCRIPTS:
            return
        self.loaded.add(sha)
        future: asyncio.Future[Any] = self.loop.create_future()
        future.add_done_callback(_ignored)
        self.send(encode(("SCRIPT", "LOAD", SCRIPTS[sha])), future, timeout_s)

    def send(self, command: bytes, future: asyncio.Future[Any], timeout_s: float) -> None:
        """Queue a command; what is queued in one event-loop turn goes out in one write. Replies
        come in order, so one timer watches the oldest command: a connection whose oldest command
        is not answered in time is dropped, and every command on it fails."""
        deadline = self.loop.time() + timeout_s
        self.waiting.append(future)
        self._deadlines.append(deadline)
        if self._watchdog is None:
            self._watchdog = self.loop.call_at(deadline, self._watch)
        if not self._outgoing:
            self.loop.call_soon(self._flush)
        self._outgoing.append(command)

    def _watch(self) -> None:
        self._watchdog = None
        if not self._deadlines:
            return
        oldest = self._deadlines[0]
        if oldest <= self.loop.time():
            self._timed_out = True
            if self.transport is not None:
                self.transport.abort()  # connection_lost fails what waits
            return
        self._watchdog = self.loop.call_at(oldest, self._watch)

    def _flush(self) -> None:
        data, self._outgoing = b"".join(self._outgoing), []
        if self.transport is not None:
            self.transport.write(data)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            future = self.waiting.popleft()
            self._deadlines.popleft()
            if future.done():  # its caller gave up waiting
                continue
            if isinstance(reply, hiredis.ReplyError):
                future.set_exception(_error(reply))
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        error: Exception
        if self._timed_out:
            error = RedisTimeoutError("Redis did not answer in time")
        else:
            error = RedisConnectionError(f"connection to Redis lost: {exc or 'closed by the server'}")
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        self._deadlines.clear()
        if not self.closed.done():
            self.closed.set_result(None)


class FastRedis:
    cluster = False
    """A Redis Cluster's client (fngate.fastredis_cluster): callers split what would span slots."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self._options = parse_url(url)  # type: ignore[no-untyped-call]
        self._timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None
        self._backlog: list[tuple[tuple[Any, ...], asyncio.Future[Any], float]] = []
        """What `send` took while no connection was open, in order, for the first one that opens."""
        self._opening: asyncio.Task[None] | None = None

    async def execute(self, *args: Any, timeout_s: float | None = None) -> Any:
        """Send one command and return its reply. `timeout_s`: for blocking commands, longer than
        their BLOCK; the default otherwise."""
        protocol = await self._connected()
        future: asyncio.Future[Any] = protocol.loop.create_future()
        protocol.load_before(args, self._timeout_s)
        protocol.send(encode(args), future, timeout_s or self._timeout_s)
        return await future

    async def execute_after(self, first: tuple[Any, ...], *args: Any, timeout_s: float | None = None) -> Any:
        """`execute(*args)` right behind `first` on the same connection, in one write (ASKING before
        the command it lets through, on a Redis Cluster). Returns the command's reply."""
        protocol = await self._connected()
        before: asyncio.Future[Any] = protocol.loop.create_future()
        future: asyncio.Future[Any] = protocol.loop.create_future()
        protocol.load_before(args, self._timeout_s)
        protocol.send(encode(first), before, self._timeout_s)
        protocol.send(encode(args), future, timeout_s or self._timeout_s)
        await asyncio.wait((before, future))
        before.exception()  # the command's own answer says what went wrong
        return future.result()

    def send(self, *args: Any, timeout_s: float | None = None) -> asyncio.Future[Any]:
        """`execute` without a coroutine: the future of the reply. For callers that settle in a done
        callback rather than await. Commands are written in the order they are sent, also those
        sent while no connection is open (they wait, in order, for the one a task opens)."""
        protocol = self._protocol
        future: asyncio.Future[Any]
        if protocol is not None and protocol.transport is not None and not self._backlog:
            future = protocol.loop.create_future()
            protocol.load_before(args, self._timeout_s)
            protocol.send(encode(args), future, timeout_s or self._timeout_s)
            return future
        future = asyncio.get_running_loop().create_future()
        self._backlog.append((args, future, timeout_s or self._timeout_s))
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._send_backlog())
        return future

    async def _send_backlog(self) -> None:
        """Write what waited for a connection, in order, once one is open; fail it if none opens."""
        try:
            protocol = await self._connected()
        except Exception as exc:
            backlog, self._backlog = self._backlog, []
            for _, future, _ in backlog:
                if not future.done():
                    future.set_exception(exc)
            return
        except asyncio.CancelledError:
            backlog, self._backlog = self._backlog, []
            for _, future, _ in backlog:
                future.cancel()
            raise
        backlog, self._backlog = self._backlog, []
        for args, future, timeout_s in backlog:
            protocol.load_before(args, self._timeout_s)
            protocol.send(encode(args), future, timeout_s)

    def _drop(self, protocol: _Protocol) -> None:
        if protocol.transport is not None:
            protocol.transport.abort()
        if self._protocol is protocol:
            self._protocol = None

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.transport is not None:
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._protocol is None or self._protocol.transport is None:
                self._protocol = await self._connect()
            return self._protocol

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        options = self._options
        closed: asyncio.Future[None] = loop.create_future()
        try:
            async with asyncio.timeout(self._timeout_s):
                if "path" in options:
                    _, protocol = await loop.create_unix_connection(
                        lambda: _Protocol(closed), options["path"]
                    )
                else:
                    secure = (
                        ssl.create_default_context()
                        if "SSL" in str(options.get("connection_class"))
                        else None
                    )
                    _, protocol = await loop.create_connection(
                        lambda: _Protocol(closed),
                        options.get("host", "localhost"),
                        options.get("port", 6379),
                        ssl=secure,
                    )
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
        hello: list[tuple[Any, ...]] = []
        if options.get("password"):
            hello.append(
                ("AUTH", *([options["username"]] if options.get("username") else []), options["password"])
            )
        if options.get("db"):
            hello.append(("SELECT", options["db"]))
        for command in hello:
            future: asyncio.Future[Any] = loop.create_future()
            protocol.send(encode(command), future, self._timeout_s)
            await future
        return protocol

    async def aclose(self) -> None:
        """Close the connection and wait until it is closed (its socket released)."""
        protocol = self._protocol
        if protocol is not None:
            self._drop(protocol)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1):
                    await protocol.closed


class Script:
    """A Lua script called by EVALSHA; loaded on each connection before its first call there (and
    on a NOSCRIPT, should Redis's scripts be flushed under an open connection)."""

    def __init__(self, redis: FastRedis, source: str) -> None:
        self._redis = redis
        self._source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        SCRIPTS[self.sha] = source

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._redis.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await self._redis.execute("SCRIPT", "LOAD", self._source)
            return await self._redis.execute("EVALSHA", self.sha, len(keys), *keys, *args)

    def send(self, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        """The EVALSHA's reply as a future, for callers that settle in a done callback. A
        NoScriptError there means Redis has not loaded the script yet: calling the script (the
        coroutine) loads it."""
        return self._redis.send("EVALSHA", self.sha, len(keys), *keys, *args)


def stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes] | None]]:
    """XREAD/XREADGROUP's reply for one stream as (id, fields) pairs; fields None for an entry
    deleted after delivery."""
    if not reply:
        return []
    _stream, entries = reply[0]
    return [
        (entry_id, dict(zip(flat[::2], flat[1::2], strict=True)) if flat is not None else None)
        for entry_id, flat in entries
    ]
