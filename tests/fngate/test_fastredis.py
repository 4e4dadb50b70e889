"""FastRedis against a real redis-server: order, errors, scripts, and a server that goes away."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Callable

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fngate import clients
from fngate.fastredis import FastRedis, Script, stream_entries
from fngate.up.supervisor import start_redis

Start = Callable[..., tuple[subprocess.Popen[bytes], str]]


async def test_concurrent_commands_get_their_own_replies(redis_url: str) -> None:
    client = FastRedis(redis_url)
    await client.execute("DEL", "n")
    replies = await asyncio.gather(*(client.execute("INCR", "n") for _ in range(200)))
    assert replies == list(range(1, 201))  # one write per event-loop turn, replies in order
    await client.aclose()


async def test_commands_sent_while_the_connection_opens_are_written_in_order(redis_url: str) -> None:
    """A decoupled model's responses are sent as they come, the first ones before the runner's
    connection is open: none may overtake another."""
    client = FastRedis(redis_url)
    await client.execute("DEL", "order")
    await client.aclose()  # not connected any more
    sent = []
    for index in range(100):  # one a loop turn, across the opening of the connection
        sent.append(client.send("RPUSH", "order", index))
        await asyncio.sleep(0)
    await asyncio.gather(*sent)
    assert await client.execute("LRANGE", "order", 0, -1) == [str(index).encode() for index in range(100)]
    await client.aclose()


async def test_reply_errors_are_redis_py_errors(redis_url: str) -> None:
    client = FastRedis(redis_url)
    await client.execute("SET", "text", "x")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await client.execute("LPUSH", "text", "y")
    assert await client.execute("GET", "text") == b"x"  # the connection goes on after an error
    await client.aclose()


async def test_a_script_is_loaded_when_redis_does_not_know_it(redis_url: str) -> None:
    client = FastRedis(redis_url)
    await client.execute("SCRIPT", "FLUSH")
    script = Script(client, "return {KEYS[1], ARGV[1]}")
    assert await script(["k"], ["v"]) == [b"k", b"v"]
    await client.aclose()


async def scripts_in_order(client: FastRedis, key: str) -> None:
    """A script Redis does not know, sent without waiting and followed at once by another command
    (and by another first call of a script, on the next loop turn): each runs, and in the order
    sent (a sequence's start and its next step; a call retried after NOSCRIPT would come last)."""
    await client.execute("DEL", key)
    push = f"return redis.call('RPUSH', KEYS[1], ARGV[1]) -- {key}"
    sent = [Script(client, push).send([key], ["first"]), client.send("RPUSH", key, "second")]
    await asyncio.sleep(0)
    sent.append(Script(client, push + " again").send([key], ["third"]))
    assert await asyncio.gather(*sent) == [1, 2, 3]
    assert await client.execute("LRANGE", key, 0, -1) == [b"first", b"second", b"third"]


async def test_scripts_redis_does_not_know_run_in_the_order_sent(redis_url: str) -> None:
    client = FastRedis(redis_url)
    await client.execute("SCRIPT", "FLUSH")
    await scripts_in_order(client, "in-order")
    await client.aclose()
    await client.execute("SCRIPT", "FLUSH")  # a new connection loads its scripts again
    await client.aclose()
    await scripts_in_order(client, "in-order")  # sent while it connects: loaded on that connection
    await client.aclose()


async def test_every_kind_of_argument_reaches_redis_as_written(redis_url: str) -> None:
    client = FastRedis(redis_url)
    values = [b"\x00raw\r\n", "text \u00e9", 42, -7, 2.5, memoryview(b"view"), bytearray(b"array")]
    keys = [f"arg:{index}" for index in range(len(values))]
    for key, value in zip(keys, values, strict=True):
        await client.execute("SET", key, value)
    expected = [b"\x00raw\r\n", "text \u00e9".encode(), b"42", b"-7", b"2.5", b"view", b"array"]
    assert await client.execute("MGET", *keys) == expected
    await client.aclose()


async def test_stream_entries(redis_url: str) -> None:
    client = FastRedis(redis_url)
    await client.execute("DEL", "s")
    entry_id = await client.execute("XADD", "s", "*", "h", "1", "b", "2")
    reply = await client.execute("XREAD", "COUNT", 10, "STREAMS", "s", "0-0")
    assert stream_entries(reply) == [(entry_id, {b"h": b"1", b"b": b"2"})]
    assert stream_entries(None) == []
    await client.aclose()


async def test_a_restarted_redis_is_reconnected(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = tmp_path_factory.mktemp("restarted")
    process, url = start_redis(folder)
    client = FastRedis(url, timeout_s=1)
    try:
        assert await client.execute("PING") == b"PONG"
        process.kill()
        process.wait()
        with pytest.raises(RedisConnectionError):
            await client.execute("PING")
        process, url = start_redis(folder)
        assert await client.execute("PING") == b"PONG"
    finally:
        process.kill()
        process.wait()
        await client.aclose()


async def test_a_paused_redis_times_out_and_recovers(extra_redis: Start) -> None:
    process, url = extra_redis()
    client = FastRedis(url, timeout_s=0.5)
    assert await client.execute("SET", "k", "1")
    process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(RedisTimeoutError):
            await client.execute("GET", "k")
    finally:
        process.send_signal(signal.SIGCONT)
    assert await client.execute("GET", "k") == b"1"  # a new connection: no reply out of step
    await client.aclose()


async def test_a_cancelled_caller_is_cancelled_and_later_replies_stay_in_step(redis_url: str) -> None:
    client = FastRedis(redis_url, timeout_s=5)
    waiting = asyncio.create_task(client.execute("BLPOP", "nothing-here", 0.3, timeout_s=5))
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):  # not a timeout: the caller was cancelled
        await waiting
    assert await client.execute("PING") == b"PONG"  # the BLPOP's late reply goes to nobody
    await client.aclose()


async def test_queue_bytes_bound_and_release(redis_url: str) -> None:
    """fngate.queue's scripts on a real Redis: max_queue_bytes refuses past the limit, FINISH gives
    the bytes back, and a reply to a gateway whose stream is gone is dropped, not kept."""
    from fngate import queue

    client = FastRedis(redis_url)
    await client.execute("FLUSHALL")
    enqueue, finish = Script(client, queue.ENQUEUE), Script(client, queue.FINISH)
    fields = {queue.HEADER: b"h" * 40, queue.BODY: b"b" * 40}
    waiter = queue.Waiter("fngate:r:gone", "i", 1)

    async def submit() -> queue.EnqueueOutcome:
        call = queue.enqueue_call("q", fields, waiter, 1000, max_queue_size=10, max_queue_bytes=100)
        return queue.parse_enqueue(await enqueue(call.keys, call.args))

    assert await submit() == queue.Queued()
    assert await submit() == queue.Queued()  # 80 bytes queued: under the limit when it came
    assert await submit() == queue.Full("bytes")
    await client.execute("XGROUP", "CREATE", "q", "runners", "0")
    read = await client.execute("XREADGROUP", "GROUP", "runners", "r1", "COUNT", 1, "STREAMS", "q", ">")
    ((entry_id, entry),) = stream_entries(read)
    assert entry is not None
    reply = {queue.HEADER: b"{}", queue.BODY: b""}
    call = queue.finish_call(
        "q", "runners", [queue.Outgoing(reply, "fngate:r:gone")], [entry_id], queue.entry_bytes(entry), 1000
    )
    await finish(call.keys, call.args)
    assert int(await client.execute("GET", queue.queue_bytes("q"))) == 80
    assert await client.execute("EXISTS", "fngate:r:gone") == 0  # NOMKSTREAM: no stream conjured up
    assert await submit() == queue.Queued()
    await client.aclose()


async def test_a_lone_redis_client_is_not_a_cluster_one(single_redis_url: str) -> None:
    client = clients.fastredis(single_redis_url)
    assert type(client) is FastRedis and not client.cluster
    with pytest.raises(ValueError, match="database 0 only"):
        clients.parse_cluster("redis+cluster://127.0.0.1:7000/2")
    parsed = clients.parse_cluster("rediss+cluster://user:p%40ss@h1:7000,h2:7001")
    assert (parsed.scheme, parsed.username, parsed.password, parsed.seeds) == (
        "rediss", "user", "p@ss", (("h1", 7000), ("h2", 7001))
    )  # fmt: skip
    assert parsed.node_url("h2", 7001) == "rediss://user:p%40ss@h2:7001/0"
    with pytest.raises(ResponseError):
        await client.execute("CLUSTER", "SLOTS")  # cluster support is disabled on a lone Redis
    await client.aclose()
