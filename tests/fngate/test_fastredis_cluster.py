"""ClusterFastRedis and the per-slot steps against a real Redis Cluster on loopback (3 primaries,
3 replicas): routing by slot, redirections while a slot moves, scripts loaded on every primary, a
batch's FINISH across slots (replies first, waiters that join meanwhile answered too), results
charged once to a key's quota in another slot, and an asynchronous pipeline's cancellation across
slots finished or undone after one stopped midway."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis.asyncio as aioredis

from fngate import clients, delivery, keys, queue
from fngate.fastredis import FastRedis, Script
from fngate.fastredis_cluster import ClusterFastRedis
from fngate.queue import slots
from fngate.up.redis_cluster import LocalCluster
from gateway.slots import SlotSteps
from tests.fngate.test_fastredis import scripts_in_order

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
    client = clients.fastredis(redis_url)
    assert isinstance(client, ClusterFastRedis) and client.cluster
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


async def test_scripts_a_primary_does_not_know_run_in_the_order_sent(
    redis_url: str, redis_cluster: LocalCluster
) -> None:
    client = clients.fastredis(redis_url)
    for port in redis_cluster.primaries():
        redis_cluster.node(port).script_flush()
    for name in tags_on_every_primary(redis_cluster).values():
        await scripts_in_order(client, "{" + name + "}:in-order")
    await client.aclose()


async def test_a_script_with_absent_keys_stays_in_its_slot(redis_url: str, redis: aioredis.Redis) -> None:
    client = clients.fastredis(redis_url)
    call = queue.enqueue_call(keys.invocations("tiny"), REPLY, queue.Waiter("r", "i", 9), 500, 100)
    assert "" in call.keys  # no cache, no coalescing, no limits
    outcome = queue.parse_enqueue(await Script(client, queue.ENQUEUE)(call.keys, call.args))
    assert outcome == queue.Queued()
    assert await client.execute("XLEN", keys.invocations("tiny")) == 1
    await client.aclose()


async def test_commands_follow_a_slot_that_moves(
    redis_url: str, redis_cluster: LocalCluster, redis: aioredis.Redis
) -> None:
    client = clients.fastredis(redis_url)
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
    client = clients.fastredis(redis_url)
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


async def pipeline_on_two_slots(client: FastRedis, cluster: LocalCluster) -> tuple[str, str, slots.FirstStep]:
    """An asynchronous pipeline submitted as the gateway submits it on a cluster: its first step
    with its result (SUBMIT_ASYNC), its other on another primary (FORWARD), recorded on the
    result's slot. Its id, its first step's stream, and its other step."""
    first, second = list(tags_on_every_primary(cluster).values())[:2]
    head, other = keys.invocations(first, keys.ASYNC), keys.invocations(second, keys.ASYNC)
    for stream in (head, other):
        await client.execute("XGROUP", "CREATE", stream, keys.RUNNER_GROUP, "0", "MKSTREAM")
    invocation_id = keys.result_id(head)
    result = keys.result(invocation_id)
    call = queue.submit_async_call(
        head, REPLY, result, b"{}", 60_000, invocation_id, 10, step=b"one", others=1
    )
    submitted = await Script(client, queue.SUBMIT_ASYNC)(call.keys, list(call.args))
    assert isinstance(queue.parse_submit_async(submitted), queue.Queued)
    queued: list[tuple[int, bytes]] = []
    forwarded = queue.Forward(other, REPLY, b"two", 10, 0)
    assert await delivery.forward(delivery.scripts(client), [forwarded], queued) is None
    [(index, entry)] = queued
    step = slots.FirstStep(index, other, entry.decode())
    await client.execute("XADD", result, "NOMKSTREAM", "*", "f", slots.record([step]))
    return invocation_id, head, step


async def set_aside(client: FastRedis, step: slots.FirstStep) -> None:
    """What a cancellation that stopped midway did: the other step set aside, CANCEL not run."""
    call = slots.aside_call([step], keys.RUNNER_GROUP, True, 60_000)
    assert await Script(client, slots.ASIDE)(call.keys, list(call.args)) == b"untaken"


async def test_a_cancellation_stopped_midway_is_finished_by_a_repeat(
    redis_url: str, redis_cluster: LocalCluster, redis: aioredis.Redis
) -> None:
    client = clients.fastredis(redis_url)
    invocation_id, head, step = await pipeline_on_two_slots(client, redis_cluster)
    await set_aside(client, step)
    assert await client.execute("XLEN", step.stream) == 0  # no runner can take it meanwhile
    assert await SlotSteps(client).cancel(invocation_id) == "cancelled"
    assert [await client.execute("XLEN", stream) for stream in (head, step.stream)] == [0, 0]
    assert await client.execute("EXISTS", f"{step.stream}:aside:{step.entry}") == 0
    assert await SlotSteps(client).cancel(invocation_id) == "cancelled"  # again: the same
    await client.aclose()


async def test_a_cancellation_too_late_puts_back_what_one_stopped_midway_set_aside(
    redis_url: str, redis_cluster: LocalCluster, redis: aioredis.Redis
) -> None:
    """The first step taken by a runner after the other was set aside: the next cancellation
    answers 'running' and queues the other again, as it was (its step context, its bytes), where
    a cancellation after that finds it."""
    client = clients.fastredis(redis_url)
    invocation_id, head, step = await pipeline_on_two_slots(client, redis_cluster)
    [(_, before)] = await client.execute("XRANGE", step.stream, "-", "+")
    size = await client.execute("GET", queue.queue_bytes(step.stream))
    await set_aside(client, step)
    await client.execute("XREADGROUP", "GROUP", keys.RUNNER_GROUP, "runner", "STREAMS", head, ">")
    assert await SlotSteps(client).cancel(invocation_id) == "running"
    [(_, after)] = await client.execute("XRANGE", step.stream, "-", "+")
    assert after == before
    assert await client.execute("GET", queue.queue_bytes(step.stream)) == size
    assert await client.execute("EXISTS", f"{step.stream}:aside:{step.entry}") == 0
    assert await SlotSteps(client).cancel(invocation_id) == "running"
    assert await client.execute("XLEN", step.stream) == 1  # queued once
    await client.aclose()


async def test_results_are_charged_once_to_a_quota_in_another_slot(
    redis_url: str, redis_cluster: LocalCluster, redis: aioredis.Redis
) -> None:
    """Two asynchronous results answered by one batch: one in its stream's slot (stored by FINISH),
    one in another function's (a pipeline's last step: stored by DELIVER). Each is charged to the
    key's quota once stored; the batch finished again (a runner that died before its FINISH was
    acknowledged, its entries run again) charges nothing more."""
    client = clients.fastredis(redis_url)
    first, second = list(tags_on_every_primary(redis_cluster).values())[:2]
    stream, elsewhere = keys.invocations(first, keys.ASYNC), keys.invocations(second, keys.ASYNC)
    quota = keys.result_quota("k1")
    outgoing: list[queue.Outgoing] = []
    entries: list[queue.SubmitOutcome] = []
    for target in (stream, elsewhere):
        invocation_id = keys.result_id(target)
        result = keys.result(invocation_id)
        call = queue.submit_async_call(
            target, REPLY, result, b"{}", 60_000, invocation_id, 10, quota_elsewhere=quota
        )
        submitted = await Script(client, queue.SUBMIT_ASYNC)(call.keys, list(call.args))
        entries.append(queue.parse_submit_async(submitted))
        outgoing.append(queue.Outgoing(REPLY, result, reply_ttl_ms=60_000))
    assert all(isinstance(outcome, queue.Queued) for outcome in entries)
    ids = [entry for entry, _ in await client.execute("XRANGE", stream, "-", "+")]
    run = delivery.scripts(client)
    await delivery.finish(run, stream, keys.RUNNER_GROUP, outgoing, ids, 2, 1000)
    each = len(b"{}") + len(REPLY[queue.HEADER]) + len(REPLY[queue.BODY])
    assert await client.execute("HGET", quota, "total") == str(2 * each).encode()
    await delivery.finish(run, stream, keys.RUNNER_GROUP, outgoing, ids, 2, 1000)
    assert await client.execute("HGET", quota, "total") == str(2 * each).encode()
    for item in outgoing:
        assert await client.execute("EXISTS", queue.stored_result(item.reply_to)) == 1
    held = await Script(client, slots.QUOTA)(*_quota(quota, 2 * each))
    assert held >= 1000  # the key holds its quota: refused until some expires
    assert await Script(client, slots.QUOTA)(*_quota(quota, 2 * each + 1)) == 0
    await client.aclose()


def _quota(quota: str, max_bytes: int) -> tuple[list[str], list[object]]:
    call = slots.quota_call(queue.ResultQuota(quota, max_bytes))
    return call.keys, list(call.args)
