"""A Redis Cluster on loopback, for the tests and the benchmark: `redis-server --cluster-enabled yes`
processes (3 primaries with a replica each, by default) joined by `redis-cli --cluster create`.
Nothing persists. Each node's port is chosen free together with its cluster bus port (+10000)."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from fngate import keys

BUS_OFFSET = 10000
"""A node's cluster bus listens on its port plus this."""


LOG = "redis.log"
PORTS_FROM = 12000
EPHEMERAL_DEFAULT = (32768, 60999)
"""Linux's default ip_local_port_range."""


class ClusterError(Exception):
    pass


@dataclasses.dataclass
class LocalCluster:
    folder: Path
    ports: list[int]
    processes: dict[int, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)
    commands: dict[int, list[str]] = dataclasses.field(default_factory=dict)

    @property
    def url(self) -> str:
        """Every node, so that a client starts from any that is up."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def command(self, port: int, *args: Any) -> Any:
        """One command to one node (CLUSTER ..., MIGRATE)."""
        return self.node(port).execute_command(*args)  # type: ignore[no-untyped-call]

    def primaries(self) -> dict[int, list[tuple[int, int]]]:
        """Each primary's port -> its slot ranges, as a node that is up sees them."""
        for port in self.ports:
            if self.processes[port].poll() is not None:
                continue
            with contextlib.suppress(redis.RedisError, OSError):
                found: dict[int, list[tuple[int, int]]] = {}
                for start, end, primary, *_ in self.command(port, "CLUSTER SLOTS"):
                    found.setdefault(int(primary[1]), []).append((int(start), int(end)))
                return found
        raise ClusterError("no node of the cluster answers")

    def primary_of(self, key: str) -> int:
        """The port of the primary that serves `key`'s slot."""
        slot = keys.slot(key)
        for port, ranges in self.primaries().items():
            if any(start <= slot <= end for start, end in ranges):
                return port
        raise ClusterError(f"slot {slot} has no primary")

    def kill(self, port: int) -> None:
        """SIGKILL one node: it answers nothing from now on, and writes nothing more."""
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait(timeout=10)

    def start(self, port: int) -> None:
        """Start a node (again: a primary that was killed rejoins as a replica of its successor)."""
        self.processes[port] = subprocess.Popen(
            self.commands[port], stdout=subprocess.DEVNULL, start_new_session=True
        )

    def restart(self, port: int, timeout_s: float = 10) -> None:
        """Start a node that was killed and wait until it answers; a clear error if it exits (its
        port taken meanwhile) instead of a cluster that waits on it."""
        self.start(port)
        _wait_answering(self, timeout_s, [port])

    def wait_until_healthy(self, timeout_s: float = 30) -> None:
        """Until every node that runs sees every slot served (cluster_state:ok)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for port in self.ports:
                if self.processes[port].poll() is not None:
                    continue
                try:
                    info = self.command(port, "CLUSTER INFO")  # parsed by redis-py into a dict
                except (redis.RedisError, OSError):
                    states.append(False)
                    continue
                slots_ok = int(info.get("cluster_slots_ok", 0))
                states.append(info.get("cluster_state") == "ok" and slots_ok == keys.SLOTS)
            if states and all(states):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"the cluster did not become healthy within {timeout_s:.0f} s")
            time.sleep(0.1)

    def wait_for_failover(self, port: int, timeout_s: float = 30) -> None:
        """After `port` was killed: until a replica serves every slot it served and the cluster is
        healthy. Healthy alone is not enough: the nodes report every slot served until they mark the
        dead one failed (cluster-node-timeout), so right after a kill the cluster still looks whole."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(ClusterError):  # no node answers for a moment
                if port not in self.primaries():
                    break
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"no replica took over from {port} within {timeout_s:.0f} s; "
                    f"the nodes' logs (under {self.folder}) end:\n{self.log_tails()}"
                )
            time.sleep(0.1)
        self.wait_until_healthy(max(1.0, deadline - time.monotonic()))

    def log_tails(self, lines: int = 8) -> str:
        """The last lines of each node's log, for a failure's message."""
        tails = []
        for port in self.ports:
            log = self.folder / str(port) / LOG
            with contextlib.suppress(OSError):
                tails.append(f"{port}:\n" + "\n".join(log.read_text().splitlines()[-lines:]))
        return "\n".join(tails)

    def wait_for_replicas(self, timeout_s: float = 30) -> None:
        """Until each replica that runs is in step with its primary (master_link_status:up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            lagging = []
            for port in self.ports:
                if self.processes[port].poll() is not None:
                    continue
                try:
                    info = self.node(port).info("replication")
                except (redis.RedisError, OSError):  # still loading what it synced
                    lagging.append(port)
                    continue
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    lagging.append(port)
            if not lagging:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"replicas {lagging} did not catch up within {timeout_s:.0f} s")
            time.sleep(0.1)

    def move_slot(self, slot: int, to_port: int, keys_per_step: int = 10, pause_s: float = 0.0) -> None:
        """Move one slot to the primary at `to_port` as a resharding does: IMPORTING there,
        MIGRATING at its owner, its keys moved a few at a time (`pause_s` between steps), then
        every node told its new owner."""
        source = next(
            port for port, ranges in self.primaries().items() if any(a <= slot <= b for a, b in ranges)
        )
        if source == to_port:
            raise ClusterError(f"slot {slot} is at {to_port} already")
        target_id = self.command(to_port, "CLUSTER MYID").decode()
        source_id = self.command(source, "CLUSTER MYID").decode()
        self.command(to_port, "CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        self.command(source, "CLUSTER SETSLOT", slot, "MIGRATING", target_id)
        while True:
            batch = self.command(source, "CLUSTER GETKEYSINSLOT", slot, keys_per_step)
            if not batch:
                break
            self.command(source, "MIGRATE", "127.0.0.1", to_port, "", 0, 5000, "REPLACE", "KEYS", *batch)
            time.sleep(pause_s)
        for port in self.ports:
            if self.processes[port].poll() is None:
                with contextlib.suppress(redis.ResponseError):  # a replica refuses SETSLOT: it follows
                    self.command(port, "CLUSTER SETSLOT", slot, "NODE", target_id)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            if process.poll() is None:
                process.kill()
                process.wait()


def free_ports(count: int) -> list[int]:
    """`count` loopback ports that are free, each with its bus port free too, both below the
    kernel's ephemeral range: a node restarted after a kill must find its ports again, and one in
    that range may meanwhile be taken by any process's outgoing connection."""
    found: list[int] = []
    candidates = random.sample(range(PORTS_FROM, ephemeral_ports()[0] - BUS_OFFSET), 200)
    for port in candidates:
        if all(_is_free(candidate) for candidate in (port, port + BUS_OFFSET)):
            found.append(port)
            if len(found) == count:
                return found
    raise ClusterError("no free ports on loopback for a cluster")


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The range the kernel draws ports from for connections and binds to port 0."""
    try:
        low, high = (int(field) for field in Path(path).read_text().split())
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    if low - BUS_OFFSET - PORTS_FROM < 1000:  # too few below it: the range's own low end is risked
        return EPHEMERAL_DEFAULT
    return low, high


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_cluster(
    folder: Path, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
) -> LocalCluster:
    """A running, healthy cluster in `folder`. `node_timeout_ms`: how long a primary may be silent
    before its replica takes over (cluster-node-timeout)."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if server is None or cli is None:
        raise ClusterError("redis-server and redis-cli are needed: run scripts/bootstrap")
    cluster = LocalCluster(folder, free_ports(primaries * (1 + replicas)))
    try:
        for port in cluster.ports:
            home = folder / str(port)
            home.mkdir(parents=True, exist_ok=True)
            options = [
                *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(home)),
                *("--cluster-enabled", "yes", "--cluster-config-file", str(home / "nodes.conf")),
                *("--cluster-node-timeout", str(node_timeout_ms)),
                # Slots that lose their primary stop alone: the others serve on meanwhile.
                *("--cluster-require-full-coverage", "no"),
                *("--save", "", "--appendonly", "no"),
                # Failovers are logged at notice: what went wrong in one is told by these logs.
                *("--loglevel", "notice", "--logfile", str(home / LOG)),
            ]
            cluster.commands[port] = [server, *options]
            cluster.start(port)
        _wait_answering(cluster)
        addresses = [f"127.0.0.1:{port}" for port in cluster.ports]
        created = subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", str(replicas), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if created.returncode != 0:
            raise ClusterError(f"redis-cli --cluster create failed: {created.stdout[-2000:]}{created.stderr}")
        cluster.wait_until_healthy()
        cluster.wait_for_replicas()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_answering(cluster: LocalCluster, timeout_s: float = 10, ports: list[int] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    for port in ports or cluster.ports:
        while True:
            if cluster.processes[port].poll() is not None:
                raise ClusterError(f"redis-server on port {port} exited")
            with contextlib.suppress(redis.RedisError, OSError):
                if cluster.node(port).ping():
                    break
            if time.monotonic() > deadline:
                raise ClusterError(f"redis-server on port {port} did not answer")
            time.sleep(0.05)


@contextlib.contextmanager
def running(folder: Path, primaries: int = 3, replicas: int = 1) -> Iterator[LocalCluster]:
    cluster = start_cluster(folder, primaries, replicas)
    try:
        yield cluster
    finally:
        cluster.stop()
