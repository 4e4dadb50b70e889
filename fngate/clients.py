"""Redis clients by URL. `redis://`, `rediss://` and `unix://` name one Redis; `redis+cluster://`
and `rediss+cluster://` a Redis Cluster, by one or more of its nodes (`redis+cluster://h1:7000,
h2:7001`; the others are learnt from them). redis-py's clients for the slow paths, and the hot
path's pipelined client (fngate.fastredis; routed by slot on a cluster, fngate.fastredis_cluster).

A cluster's redis-py client is a RedisCluster: the same commands as a Redis, typed as one here, so
that callers stay as they are; the few that differ (transactions, pub/sub) ask `is_cluster_client`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, ClusterPubSub, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster

from fngate.fastredis import FastRedis
from fngate.fastredis_cluster import ClusterFastRedis

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""A cluster URL's scheme -> the scheme of each of its nodes."""


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterURL:
    """What a cluster URL says: how to reach each node, and the nodes to start from."""

    scheme: str
    """'redis' or 'rediss' (TLS)."""
    username: str
    password: str
    seeds: tuple[tuple[str, int], ...]

    def node_url(self, host: str, port: int) -> str:
        """One node's URL, for a client of that node alone."""
        credentials = ""
        if self.password:
            credentials = f"{quote(self.username, safe='')}:{quote(self.password, safe='')}@"
        return f"{self.scheme}://{credentials}{host}:{port}/0"


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def parse_cluster(url: str) -> ClusterURL:
    """A `redis+cluster://[user:password@]host:port[,host:port...][/0]` URL. Raises ValueError."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"not a Redis Cluster URL: {parts.scheme}://")
    if parts.path not in ("", "/", "/0"):
        raise ValueError("a Redis Cluster has database 0 only")
    credentials, _, hosts = parts.netloc.rpartition("@")
    username, _, password = credentials.partition(":")
    seeds = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"a Redis Cluster URL names its nodes as host:port, not {item!r}")
        seeds.append((host.strip("[]"), int(port)))
    return ClusterURL(scheme, unquote(username), unquote(password), tuple(seeds))


class _WritesLost(AbstractConnection):
    """A connection whose write on a transport the event loop has closed fails as a lost
    connection does (redis-py's ConnectionError, the connection dropped), not with uvloop's
    RuntimeError ("unable to perform operation on <TCPTransport closed=True ...>; the handler is
    closed"). A Redis that dies while a client connects to it (a killed node, a failover) resets
    the connection between its accept and the client's first command: redis-py (8.1) then writes
    on the closed transport, and every loop that waits out a Redis outage would take the
    RuntimeError for a bug and die of it."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except RuntimeError as exc:
            if "closed" not in str(exc):
                raise
            await self.disconnect(nowait=True)
            raise redis.exceptions.ConnectionError(f"connection lost while writing ({exc})") from exc


class _TCPConnection(_WritesLost, Connection):
    pass


class _TLSConnection(_WritesLost, SSLConnection):
    pass


class _UnixConnection(_WritesLost, UnixDomainSocketConnection):
    pass


_LOST_AWARE: dict[type[AbstractConnection], type[AbstractConnection]] = {
    Connection: _TCPConnection,
    SSLConnection: _TLSConnection,
    UnixDomainSocketConnection: _UnixConnection,
}


def _lost_aware(kind: type[AbstractConnection]) -> type[AbstractConnection]:
    return _LOST_AWARE.get(kind, kind)


class _StaysClosed(aioredis.ConnectionPool):
    """A pool that, once its client is closed (_Redis.aclose), stays closed: a command asks it for
    a connection in vain (redis-py's ConnectionError, which every caller takes as Redis being
    away), and a connection handed back is disconnected. redis-py's (8.1) opens a new connection
    for a command sent after its client's `aclose()`, and keeps a connected one where the command
    was connecting while the client closed: a connection nothing closes, left to the garbage
    collector after its event loop is gone. Whatever outlives a process's shutdown by a moment (a
    background publish, a state report after a load) would leave one."""

    closed = False

    async def get_connection(self, *args: Any, **kwargs: Any) -> AbstractConnection:
        if self.closed:
            raise redis.exceptions.ConnectionError("the Redis client is closed")
        return cast(AbstractConnection, await super().get_connection(*args, **kwargs))  # type: ignore[no-untyped-call]

    async def release(self, connection: AbstractConnection) -> None:
        await super().release(connection)
        if self.closed:
            await connection.disconnect()


class _BlockingStaysClosed(_StaysClosed, aioredis.BlockingConnectionPool):
    pass


class _Redis(aioredis.Redis):
    """redis-py's client, whose `aclose()` closes its pool for good (_StaysClosed)."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        if close_connection_pool or (close_connection_pool is None and self.auto_close_connection_pool):
            cast(_StaysClosed, self.connection_pool).closed = True
        await super().aclose(close_connection_pool)


def _client(pool: _StaysClosed) -> aioredis.Redis:
    pool.connection_class = _lost_aware(pool.connection_class)
    return _Redis.from_pool(pool)  # closing the client closes the pool


def connect(url: str, **options: Any) -> aioredis.Redis:
    """redis-py's asyncio client of `url` (a RedisCluster for a cluster URL). `options`: redis-py's
    connection options (socket_timeout, socket_connect_timeout, max_connections...)."""
    if not is_cluster(url):
        return _client(_StaysClosed.from_url(url, **options))
    cluster = parse_cluster(url)
    client = _RedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in cluster.seeds],
        username=cluster.username or None,
        password=cluster.password or None,
        ssl=cluster.scheme == "rediss",
        **options,
    )
    return cast(aioredis.Redis, client)


class _RedisCluster(RedisCluster):
    """redis-py's asyncio cluster client, whose commands fail as a lost connection does when its
    connection is closed under them: in a failover redis-py (8.1) can close a node's connection
    while a command is connecting on it, and the command then fails with an AttributeError
    (`'NoneType' object has no attribute 'writelines'`), which every loop that waits out a Redis
    outage would take for a bug and die of. Its nodes' connections are _WritesLost ones."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The nodes learnt later are made with these arguments; the seeds were made already.
        self.connection_kwargs["connection_class"] = _lost_aware(self.connection_kwargs["connection_class"])
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = cast(type[Connection], _lost_aware(node.connection_class))

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except AttributeError as exc:
            raise redis.exceptions.ConnectionError(f"connection closed while in use ({exc})") from exc


def connect_pool(url: str, max_connections: int, timeout_s: float, **options: Any) -> aioredis.Redis:
    """A client of at most `max_connections` connections, on which a command waits up to
    `timeout_s` for a free one rather than fail (one Redis; a cluster's client holds
    `max_connections` per node)."""
    if is_cluster(url):
        return connect(url, max_connections=max_connections, **options)
    pool = _BlockingStaysClosed.from_url(url, max_connections=max_connections, timeout=timeout_s, **options)
    return _client(pool)


def connect_sync(url: str, **options: Any) -> redis.Redis:
    """redis-py's blocking client of `url` (a RedisCluster for a cluster URL), for the CLI."""
    if not is_cluster(url):
        return redis.Redis.from_url(url, **options)
    cluster = parse_cluster(url)
    seeds = [SyncClusterNode(host, port) for host, port in cluster.seeds]  # type: ignore[no-untyped-call]
    client = SyncRedisCluster(
        startup_nodes=seeds,
        username=cluster.username or None,
        password=cluster.password or None,
        ssl=cluster.scheme == "rediss",
        **options,
    )
    return cast(redis.Redis, client)


def fastredis(url: str, timeout_s: float = 2.0) -> FastRedis:
    """The hot path's client of `url`: one pipelined connection, or one per primary of a cluster."""
    if is_cluster(url):
        cluster = parse_cluster(url)
        return ClusterFastRedis(cluster.seeds, cluster.node_url, timeout_s)
    return FastRedis(url, timeout_s)


def is_cluster_client(client: Any) -> bool:
    """A redis-py client of a Redis Cluster (connect's, connect_sync's)."""
    return isinstance(client, RedisCluster | SyncRedisCluster)


async def publish(client: aioredis.Redis, channel: str, message: str) -> int:
    """PUBLISH, or on a cluster SPUBLISH: a shard channel lives on the primary of its slot, and the
    answer (how many subscribers heard it) counts them all, which a cluster's PUBLISH does not (it
    counts those of the node it reached)."""
    if is_cluster_client(client):
        return int(await client.spublish(channel, message))
    return int(await client.publish(channel, message))


async def subscribe(pubsub: Any, channel: str) -> None:
    """SUBSCRIBE, or SSUBSCRIBE on a cluster's pub/sub (see publish)."""
    if isinstance(pubsub, ClusterPubSub):
        await pubsub.cluster.initialize()  # the slot map, which a first command would have fetched
        await pubsub.ssubscribe(channel)
    else:
        await pubsub.subscribe(channel)


async def next_message(pubsub: Any, timeout_s: float) -> dict[str, Any] | None:
    """The next message `subscribe` asked for, waiting up to `timeout_s`; None if none came."""
    if isinstance(pubsub, ClusterPubSub):
        found: dict[str, Any] | None = await pubsub.get_sharded_message(True, timeout_s)
    else:
        found = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
    return found
