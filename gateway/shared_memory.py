"""Triton's system shared memory extension: a client on the gateway's host registers a POSIX shared
memory object (`/dev/shm/<key>`) as a named region, then names regions in an inference request
instead of sending tensor bytes: the gateway reads each input from its region, and writes each
output asked for into its region instead of the response.

Off unless the gateway is started with `allow_client_shm` (`--allow-client-shm`), as Triton's
`--allow-client-shm`: the gateway reads and writes those objects with its own user's rights, so only
clients trusted that far belong on its host. The regions are kept in Redis, per API key (one key's
names never meet another's), so that every gateway process of a port (`workers`) knows them; the
bytes still travel to the runner in the invocation, as any tensor's do (docs/triton/shared-memory.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import stat
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fngate import keys
from fngate.errors import FunctionNotFound, InvalidArgument, PayloadTooLarge, Unavailable
from fngate.manifest import FunctionManifest
from fngate.tensors import Tensors, from_bytes, to_bytes
from gateway.validation import OFF_LOOP_BYTES, check_complete, natural, shown

ROOT = "/dev/shm"
"""Where shm_open's objects live on Linux."""
MAX_REGIONS = 128
"""Regions one API key may hold registered at once."""
REGION_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
SHM_KEY = re.compile(r"^/[A-Za-z0-9_.-]{1,255}$")
DISABLED = (
    "Client shared memory is disabled. Start the gateway with '--allow-client-shm' "
    "(FNGATE_ALLOW_CLIENT_SHM=true) to enable."
)
CUDA_REFUSED = (
    "CUDA shared memory is not served by fngate: its gateways hold no GPU, and a runner's GPU is on "
    "another process (or machine); register system shared memory instead"
)
_SHRANK = "shared memory region '{}' is smaller than when it was registered"
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"


@dataclasses.dataclass(frozen=True, slots=True)
class Region:
    """A registered region: `byte_size` bytes from `offset` of the object `key`."""

    name: str
    key: str
    offset: int
    byte_size: int

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclasses.dataclass(frozen=True, slots=True)
class SharedTensor:
    """A tensor of a request that lives in a region: `byte_size` bytes from `offset` in it; an
    input's datatype and shape as the request declared them."""

    name: str
    region: str
    offset: int
    byte_size: int
    datatype: str = ""
    shape: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """The outputs of a request that go to shared memory, with their regions found."""

    outputs: Mapping[str, tuple[Region, SharedTensor]] = dataclasses.field(default_factory=dict)

    def write(self, outputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, int]:
        """Each output placed in shared memory written there (the bytes written, by name); an output
        larger than its place is refused, as Triton refuses it."""
        written: dict[str, int] = {}
        with _Objects(os.O_RDWR) as objects:
            for name, (region, tensor) in self.outputs.items():
                array = outputs.get(name)
                if array is None:
                    continue
                raw = to_bytes(array)
                if len(raw) > tensor.byte_size:
                    raise InvalidArgument(
                        f"shared memory size specified with the request for output '{name}' "
                        f"({tensor.byte_size} bytes) should be at least {len(raw)} bytes to hold the results"
                    )
                _write(objects.fd(region), region, tensor.offset, raw)
                written[name] = len(raw)
        return written


NOTHING_PLACED = Placed()


def shared_of(params: Mapping[str, Any], name: str, where: str) -> SharedTensor | None:
    """The region a tensor's parameters name (None: none), checked."""
    region = params.get(REGION)
    if region is None:
        return None
    if not isinstance(region, str) or not REGION_NAME.match(region):
        raise InvalidArgument(f"{where}: '{REGION}' must be a region's name")
    if params.get("binary_data"):  # a requested output's: it goes to one place
        raise InvalidArgument("Output can't set both 'shared_memory_region' and 'binary_data'")
    offset = natural(params.get(OFFSET, 0), f"{where}: '{OFFSET}'")
    size = params.get(BYTE_SIZE)
    if size is None:
        raise InvalidArgument(f"{where}: '{REGION}' needs '{BYTE_SIZE}'")
    return SharedTensor(name, region, offset, natural(size, f"{where}: '{BYTE_SIZE}'"))


class SharedMemory:
    """The regions of every API key (in Redis), and the reads and writes of their bytes."""

    def __init__(self, redis: aioredis.Redis, allowed: bool, max_bytes: int) -> None:
        self._redis = redis
        self.allowed = allowed
        self._max_bytes = max_bytes

    @staticmethod
    async def _redis_call(command: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """A command on the regions' records; a Redis that does not answer is the caller's 503."""
        try:
            return await command(*args)
        except (RedisError, OSError) as exc:
            raise Unavailable(f"the shared memory regions are unavailable: {exc}") from exc

    def _check_allowed(self) -> None:
        if not self.allowed:
            raise InvalidArgument(DISABLED)

    async def register(self, key_id: str, name: str, key: Any, offset: Any, byte_size: Any) -> None:
        """Register `byte_size` bytes from `offset` of the object `key` as the region `name`."""
        self._check_allowed()
        if not REGION_NAME.match(name):
            raise InvalidArgument(
                f"'{shown(name)}' is not a region name (letters, digits, '_.:-', at most 128)"
            )
        if not isinstance(key, str) or not SHM_KEY.match(key) or key in ("/.", "/.."):
            raise InvalidArgument(
                "'key' must name a POSIX shared memory object: '/' then letters, digits and '_.-'"
            )
        where = f"region '{name}'"
        region = Region(
            name, key, natural(offset, f"{where}: 'offset'"), natural(byte_size, f"{where}: 'byte_size'")
        )
        with _opened(region.key, os.O_RDONLY) as fd:
            if region.offset + region.byte_size > os.fstat(fd).st_size:
                raise InvalidArgument(f"failed to register shared memory region '{name}': invalid args")
        held = keys.shared_memory(key_id)
        if await self._redis_call(self._redis.hlen, held) >= MAX_REGIONS:
            raise InvalidArgument(f"an API key holds at most {MAX_REGIONS} shared memory regions")
        if not await self._redis_call(self._redis.hsetnx, held, name, orjson.dumps(region.status())):
            raise InvalidArgument(f"shared memory region '{name}' already in manager")

    async def unregister(self, key_id: str, name: str | None) -> None:
        """One region (none registered by that name: nothing to do, as Triton), or every region of
        the key."""
        self._check_allowed()
        if name:
            await self._redis_call(self._redis.hdel, keys.shared_memory(key_id), name)
        else:
            await self._redis_call(self._redis.delete, keys.shared_memory(key_id))

    @staticmethod
    def cuda_status(name: str | None) -> list[dict[str, Any]]:
        """CUDA shared memory's regions: none (a gateway holds no GPU)."""
        if name:
            raise FunctionNotFound(f"Unable to find cuda shared memory region: '{shown(name)}'")
        return []

    @staticmethod
    def cuda_register() -> None:
        """Refused, saying why; unregistering any, or all, has nothing to do."""
        raise InvalidArgument(CUDA_REFUSED)

    async def status(self, key_id: str, name: str | None) -> list[dict[str, Any]]:
        if name:
            return [(await self._regions(key_id, [name]))[name].status()]
        held = await self._redis_call(self._redis.hgetall, keys.shared_memory(key_id))
        return [_region(raw).status() for _, raw in sorted(held.items())]

    async def _regions(self, key_id: str, names: Sequence[str]) -> dict[str, Region]:
        found = await self._redis_call(self._redis.hmget, keys.shared_memory(key_id), list(names))
        regions = {}
        for name, raw in zip(names, found, strict=True):
            if raw is None:
                raise FunctionNotFound(f"Unable to find system shared memory region: '{shown(name)}'")
            regions[name] = _region(raw)
        return regions

    async def place(
        self,
        key_id: str,
        manifest: FunctionManifest,
        given: Tensors,
        inputs: Sequence[SharedTensor],
        outputs: Mapping[str, SharedTensor],
    ) -> tuple[Tensors, Placed]:
        """A request's inputs, those `given` in it and those read from their regions (checked
        together), and the places of its outputs in shared memory."""
        self._check_allowed()
        names = sorted({tensor.region for tensor in inputs} | {tensor.region for tensor in outputs.values()})
        regions = await self._regions(key_id, names)
        for tensor in [*inputs, *outputs.values()]:
            _check_bounds(regions[tensor.region], tensor)
        total = sum(tensor.byte_size for tensor in inputs)
        if total > self._max_bytes:
            raise PayloadTooLarge(
                f"the inputs in shared memory are {total} bytes, over the gateway's limit of "
                f"{self._max_bytes}"
            )
        tensors: Tensors = dict(given)
        if total >= OFF_LOOP_BYTES:  # a large copy in a worker thread, off the event loop
            tensors.update(await asyncio.to_thread(_inputs, regions, inputs))
        else:
            tensors.update(_inputs(regions, inputs))
        check_complete(manifest, tensors)
        placed = {name: (regions[tensor.region], tensor) for name, tensor in outputs.items()}
        return tensors, Placed(placed) if placed else NOTHING_PLACED


def _inputs(regions: Mapping[str, Region], inputs: Sequence[SharedTensor]) -> Tensors:
    """Each input's bytes from its region (each region's object opened once)."""
    tensors: Tensors = {}
    with _Objects(os.O_RDONLY) as objects:
        for tensor in inputs:
            region = regions[tensor.region]
            raw = os.pread(objects.fd(region), tensor.byte_size, region.offset + tensor.offset)
            if len(raw) != tensor.byte_size:  # the object shrank since it was registered
                raise InvalidArgument(_SHRANK.format(region.name))
            tensors[tensor.name] = from_bytes(tensor.datatype, tensor.shape, raw, f"input '{tensor.name}'")
    return tensors


def _region(raw: bytes | str) -> Region:
    found = orjson.loads(raw)
    return Region(found["name"], found["key"], found["offset"], found["byte_size"])


def _check_bounds(region: Region, tensor: SharedTensor) -> None:
    if tensor.offset >= region.byte_size:
        raise InvalidArgument(f"Invalid offset for shared memory region: '{region.name}'")
    if tensor.offset + tensor.byte_size > region.byte_size:
        raise InvalidArgument(f"Invalid offset + byte size for shared memory region: '{region.name}'")


class _Objects(contextlib.ExitStack):
    """The objects of one request's regions, each opened once (with `mode`), closed together."""

    def __init__(self, mode: int) -> None:
        super().__init__()
        self._mode = mode
        self._fds: dict[str, int] = {}

    def fd(self, region: Region) -> int:
        if region.name not in self._fds:
            self._fds[region.name] = self.enter_context(_opened(region.key, self._mode))
        return self._fds[region.name]


@contextlib.contextmanager
def _opened(key: str, mode: int) -> Iterator[int]:
    """A shared memory object's descriptor: a regular file, never through a link (O_NOFOLLOW), and
    never a FIFO that would block the event loop (O_NONBLOCK, then the type checked)."""
    try:
        fd = os.open(
            os.path.join(ROOT, key.removeprefix("/")), mode | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        )
    except OSError as exc:
        raise InvalidArgument(f"Unable to open shared memory region: '{key}' ({exc.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidArgument(
                f"Unable to open shared memory region: '{key}' (not a shared memory object)"
            )
        yield fd
    finally:
        os.close(fd)


def _write(fd: int, region: Region, offset: int, raw: bytes) -> None:
    if region.offset + offset + len(raw) > os.fstat(fd).st_size:
        raise InvalidArgument(_SHRANK.format(region.name))
    os.pwrite(fd, raw, region.offset + offset)
