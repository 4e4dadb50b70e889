"""ClusterPipelinedRedis and the per-slot steps against a real Redis Cluster on loopback (3 primaries,
3 replicas): routing by slot, redirections while a slot moves, scripts loaded on every primary, and
a batch's FINISH across slots (replies first, waiters that join meanwhile answered too)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis.asyncio as aioredis

from fngate import clients, delivery, keys, queue
from fngate.cluster import ClusterPipelinedRedis
from fngate.pipelined import Script
from fngate.tools.local_cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.parametrize("redis_url", ["cluster"], indirect=True)]
REPLY = {queue.HEADER: b"h", queue.BODY: b"b"}


def tags_on_every_primary(cluster: LocalCluster) -> dict[int, str]:
    """A function name whose slot each primary serves: primary port -> name."""
    found: dict[int, str] = {}
    for index in range(1000):
        name = f"fn{index}"
        found.setdefault(cluster.primary_of(keys.invocations(name)), name)
        if len(found) == len(cluster.primaries()):
            return found
    raise AssertionError("no names for every primary")


async def test_commands_go_to_the_primary_of_their_slot(redis_url: str, redis_cluster: LocalCluster) -> None:
    client = clients.pipelined(redis_url)
    assert isinstance(client, ClusterPipelinedRedis) and client.cluster
    names = tags_on_every_primary(redis_cluster)
    await asyncio.gather(
        *(client.execute("SET", keys.invocations(name) + ":x", port) for port, name in names.items())
    )
    for port, name in names.items():  # each stored where the cluster says its slot lives
        assert redis_cluster.node(port).get(keys.invocations(name) + ":x") == str(port).encode()
        slot = redis_cluster.node(port).execute_command("CLUSTER KEYSLOT", keys.invocations(name))
        assert slot == keys.slot(keys.invocations(name))
    script = Script(client, "return redis.call('GET', KEYS[1])")  # unknown to every primary
    answers = await asyncio.gather(*(script([keys.invocations(name) + ":x"], []) for name in names.values()))
    assert sorted(answers) == sorted(str(port).encode() for port in names)
    await client.aclose()


async def test_a_script_with_absent_keys_stays_in_its_slot(redis_url: str, redis: aioredis.Redis) -> None:
    client = clients.pipelined(redis_url)
    call = queue.enqueue_call(keys.invocations("tiny"), REPLY, queue.Waiter("r", "i", 9), 500, 100)
    assert "" in call.keys  # no cache, no coalescing, no limits
    outcome = queue.parse_enqueue(await Script(client, queue.ENQUEUE)(call.keys, call.args))
    assert outcome == queue.Queued()
    assert await client.execute("XLEN", keys.invocations("tiny")) == 1
    await client.aclose()


async def test_commands_follow_a_slot_that_moves(
    redis_url: str, redis_cluster: LocalCluster, redis: aioredis.Redis
) -> None:
    client = clients.pipelined(redis_url)
    stream = keys.invocations("moving")
    await client.execute("XADD", stream, "*", "h", "1")
    slot, source = keys.slot(stream), redis_cluster.primary_of(stream)
    target = next(port for port in redis_cluster.primaries() if port != source)
    source_id = redis_cluster.node(source).execute_command("CLUSTER MYID").decode()
    target_id = redis_cluster.node(target).execute_command("CLUSTER MYID").decode()
    fresh = keys.cache_entry("moving", "new")  # a key of the slot that exists nowhere yet

    # Migrating: the source still has the stream; a key it lacks is asked of the target (ASK),
    # and a script whose keys are split between the two is retried (TRYAGAIN) until it settles.
    redis_cluster.node(target).execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
    redis_cluster.node(source).execute_command("CLUSTER SETSLOT", slot, "MIGRATING", target_id)
    assert await client.execute("HSET", fresh, "h", "x") == 1  # ASK: written on the target
    assert redis_cluster.node(target).execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 1
    assert redis_cluster.node(source).execute_command("CLUSTER COUNTKEYSINSLOT", slot) == 1  # the stream
    both = Script(client, "return {redis.call('XLEN', KEYS[1]), redis.call('HGET', KEYS[2], 'h')}")

    def finish_moving() -> None:
        node = redis_cluster.node(source)
        node.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *node.keys("*{moving}*"))
        for port in redis_cluster.primaries():
            redis_cluster.node(port).execute_command("CLUSTER SETSLOT", slot, "NODE", target_id)

    timer = threading.Timer(0.3, finish_moving)
    timer.start()
    try:
        assert await both([stream, fresh], []) == [1, b"x"]  # TRYAGAIN until the move ended
    finally:
        timer.join()
    # Moved: the old owner answers MOVED, and the map follows.
    assert await client.execute("XLEN", stream) == 1
    assert redis_cluster.primary_of(stream) == target
    await client.aclose()


async def test_finish_across_slots_answers_waiters_that_join_meanwhile(
    redis_url: str, redis: aioredis.Redis
) -> None:
    client = clients.pipelined(redis_url)
    stream = keys.invocations("tiny")
    gateways = [keys.replies("gw-a"), keys.replies("gw-b")]
    for reply_stream in gateways:
        await client.execute("XGROUP", "CREATE", reply_stream, "alive", "$", "MKSTREAM")
    await client.execute("XGROUP", "CREATE", stream, keys.RUNNER_GROUP, "0", "MKSTREAM")
    entry = await client.execute("XADD", stream, "*", "h", "x", "b", "y")
    await client.execute("XREADGROUP", "GROUP", keys.RUNNER_GROUP, "c", "STREAMS", stream, ">")
    marker = keys.in_flight("tiny", "k")
    await client.execute("SET", marker, "1")
    await client.execute("RPUSH", queue.waiters(marker), queue.Waiter(gateways[1], "w1", 9).encode())
    run = delivery.scripts(client)
    finishes = 0

    async def run_and_join(source: str, script_keys: list[str], args: list[object]) -> object:
        nonlocal finishes
        if source == queue.FINISH:
            finishes += 1
            if finishes == 2:  # another identical invocation came while the first waiter was answered
                waiter = queue.Waiter(gateways[0], "w2", 9).encode()
                await client.execute("RPUSH", queue.waiters(marker), waiter)
        return await run(source, script_keys, args)

    outgoing = [queue.Outgoing(REPLY, gateways[0], keys.cache_entry("tiny", "k"), 60, marker)]
    await delivery.finish(run_and_join, stream, keys.RUNNER_GROUP, outgoing, [entry], 2, 1000)
    assert finishes == 3  # w1 found, w2 found, done
    own = await client.execute("XRANGE", gateways[0], "-", "+")
    waited = await client.execute("XRANGE", gateways[1], "-", "+")
    answer = [b"h", b"h", b"b", b"b"]
    assert [fields for _, fields in own] == [answer, [*answer, b"for", b"w2"]]
    assert [fields for _, fields in waited] == [[*answer, b"for", b"w1"]]
    assert await client.execute("EXISTS", marker, queue.waiters(marker)) == 0
    assert await client.execute("XLEN", stream) == 0  # acknowledged and deleted once all were answered
    assert await client.execute("HGET", keys.cache_entry("tiny", "k"), "h") == b"h"
    await client.aclose()
