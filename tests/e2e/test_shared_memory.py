"""Triton's system shared memory extension, as the quickstart's shm clients use it
(simple_{http,grpc}_shm_client, simple_{http,grpc}_shm_string_client): regions registered by the
caller, tensors read from them and outputs written into them, over HTTP and gRPC, with tritonclient's
own shared memory module; then what is refused, per key, and off by default."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from gateway.shared_memory import DISABLED
from tests.conftest import free_port, start_redis
from tests.e2e.test_auth import create_key
from tests.triton_repository import (
    IDENTITY,
    SIMPLE,
    SIMPLE_STRING,
    identity_onnx,
    model,
    simple_onnx,
    simple_string_onnx,
)

VECTOR_BYTES = 16 * 4


def repository(root: Path) -> Path:
    simple_onnx(model(root, "simple", SIMPLE, {"1": {}}) / "1" / "model.onnx")
    identity_onnx(model(root, "identity", IDENTITY, {"1": {}}) / "1" / "model.onnx")
    simple_string_onnx(model(root, "simple_string", SIMPLE_STRING, {"1": {}}) / "1" / "model.onnx")
    return root


class Regions:
    """Shared memory objects made as the example clients make them, destroyed at the end."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.tag = uuid.uuid4().hex[:12]

    def make(self, name: str, size: int) -> tuple[Any, str]:
        key = f"/fngate-test-{self.tag}-{name}"
        handle = shm.create_shared_memory_region(f"{self.tag}-{name}", key, size)
        self.handles.append(handle)
        return handle, key

    def close(self) -> None:
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.close()


def exercise(client: Any, protocol: Any, regions: Regions, headers: dict[str, str] | None = None) -> None:
    """What the quickstart's shm clients do, with `client` (tritonclient.http or .grpc)."""
    client.unregister_system_shared_memory(headers=headers)
    client.unregister_cuda_shared_memory(headers=headers)
    left = np.arange(16, dtype=np.int32)
    right = np.full(16, 3, dtype=np.int32)
    out_handle, out_key = regions.make("out", VECTOR_BYTES * 2)
    in_handle, in_key = regions.make("in", VECTOR_BYTES * 2)
    shm.set_shared_memory_region(in_handle, [left])
    shm.set_shared_memory_region(in_handle, [right], offset=VECTOR_BYTES)
    client.register_system_shared_memory("output_data", out_key, VECTOR_BYTES * 2, headers=headers)
    client.register_system_shared_memory("input_data", in_key, VECTOR_BYTES * 2, headers=headers)

    inputs = [protocol.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    inputs[0].set_shared_memory("input_data", VECTOR_BYTES)
    inputs[1].set_shared_memory("input_data", VECTOR_BYTES, offset=VECTOR_BYTES)
    outputs = [protocol.InferRequestedOutput(name) for name in ("OUTPUT0", "OUTPUT1")]
    outputs[0].set_shared_memory("output_data", VECTOR_BYTES)
    outputs[1].set_shared_memory("output_data", VECTOR_BYTES, offset=VECTOR_BYTES)
    result = client.infer("simple", inputs, outputs=outputs, headers=headers)
    assert result.get_output("OUTPUT0") is not None and result.get_output("OUTPUT1") is not None
    total = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    difference = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=VECTOR_BYTES)
    assert total.tolist() == [(left + right).tolist()]
    assert difference.tolist() == [(left - right).tolist()]

    # One input in a region and one in the request, one output in a region and one in the answer
    # (over gRPC, raw_input_contents then holds the one input not in shared memory).
    shm.set_shared_memory_region(out_handle, [np.zeros(32, dtype=np.int32)])
    mixed = [protocol.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    mixed[0].set_data_from_numpy(np.full((1, 16), 100, dtype=np.int32))
    mixed[1].set_shared_memory("input_data", VECTOR_BYTES, offset=VECTOR_BYTES)
    wanted = [protocol.InferRequestedOutput("OUTPUT0"), protocol.InferRequestedOutput("OUTPUT1")]
    wanted[1].set_shared_memory("output_data", VECTOR_BYTES, offset=VECTOR_BYTES)
    result = client.infer("simple", mixed, outputs=wanted, headers=headers)
    assert result.as_numpy("OUTPUT0").tolist() == [[103] * 16]
    assert shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=VECTOR_BYTES).tolist() == [
        [97] * 16
    ]
    assert shm.get_contents_as_numpy(out_handle, np.int32, [1, 16]).tolist() == [[0] * 16]  # not written

    # Strings (simple_*_shm_string_client): serialized as the binary extension lays them out.
    numbers = np.array([[str(n).encode() for n in range(16)]], dtype=np.object_)
    ones = np.full((1, 16), b"1", dtype=np.object_)
    left_raw, right_raw = serialize_byte_tensor(numbers), serialize_byte_tensor(ones)
    sizes = (serialized_byte_size(left_raw), serialized_byte_size(right_raw))
    text_in, text_in_key = regions.make("text-in", sum(sizes))
    text_out, text_out_key = regions.make("text-out", 1024)
    shm.set_shared_memory_region(text_in, [left_raw])
    shm.set_shared_memory_region(text_in, [right_raw], offset=sizes[0])
    client.register_system_shared_memory("text_in", text_in_key, sum(sizes), headers=headers)
    client.register_system_shared_memory("text_out", text_out_key, 1024, headers=headers)
    texts = [protocol.InferInput(name, [1, 16], "BYTES") for name in ("INPUT0", "INPUT1")]
    texts[0].set_shared_memory("text_in", sizes[0])
    texts[1].set_shared_memory("text_in", sizes[1], offset=sizes[0])
    text_outputs = [protocol.InferRequestedOutput("OUTPUT0")]
    text_outputs[0].set_shared_memory("text_out", 1024)
    result = client.infer("simple_string", texts, outputs=text_outputs, headers=headers)
    written = result.get_output("OUTPUT0")
    assert written is not None
    sums = shm.get_contents_as_numpy(text_out, np.object_, [1, 16])
    assert [item.decode() if isinstance(item, bytes) else item for item in sums[0]] == [
        str(n + 1) for n in range(16)
    ]

    # An input of 256 KiB or more (read from its region off the gateway's event loop), its output
    # written into the same region after it.
    vector = np.arange(70_000, dtype=np.float32)
    big, big_key = regions.make("big", vector.nbytes * 2)
    shm.set_shared_memory_region(big, [vector])
    client.register_system_shared_memory("big", big_key, vector.nbytes * 2, headers=headers)
    large = protocol.InferInput("INPUT0", [vector.size], "FP32")
    large.set_shared_memory("big", vector.nbytes)
    echoed = protocol.InferRequestedOutput("OUTPUT0")
    echoed.set_shared_memory("big", vector.nbytes, offset=vector.nbytes)
    client.infer("identity", [large], outputs=[echoed], headers=headers)
    back = shm.get_contents_as_numpy(big, np.float32, [vector.size], offset=vector.nbytes)
    assert np.array_equal(back, vector)
    client.unregister_system_shared_memory("big", headers=headers)

    listed = client.get_system_shared_memory_status(headers=headers)
    if protocol is triton_grpc:
        found = {
            name: (status.key, status.offset, status.byte_size) for name, status in listed.regions.items()
        }
    else:
        found = {status["name"]: (status["key"], status["offset"], status["byte_size"]) for status in listed}
    assert found == {
        "input_data": (in_key, 0, VECTOR_BYTES * 2),
        "output_data": (out_key, 0, VECTOR_BYTES * 2),
        "text_in": (text_in_key, 0, sum(sizes)),
        "text_out": (text_out_key, 0, 1024),
    }
    client.unregister_system_shared_memory("text_in", headers=headers)
    listed = client.get_system_shared_memory_status(headers=headers)
    names = set(listed.regions) if protocol is triton_grpc else {status["name"] for status in listed}
    assert names == {"input_data", "output_data", "text_out"}
    client.unregister_system_shared_memory(headers=headers)
    listed = client.get_system_shared_memory_status(headers=headers)
    assert not (listed.regions if protocol is triton_grpc else listed)


async def test_tensors_travel_in_shared_memory_as_the_quickstart_clients_send_them(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path, regions: Regions
) -> None:
    root = repository(tmp_path / "models")
    grpc_port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=grpc_port, allow_client_shm=True)
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))

    def both() -> None:
        http = triton_http.InferenceServerClient(base.removeprefix("http://"))
        rpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            exercise(http, triton_http, regions)
            regions.close()
            regions.handles.clear()
            exercise(rpc, triton_grpc, regions)
        finally:
            http.close()
            rpc.close()

    await asyncio.to_thread(both)


def refused(call: Callable[[], Any], status: str, text: str) -> None:
    with pytest.raises(InferenceServerException) as raised:
        call()
    assert text in raised.value.message(), raised.value.message()
    assert raised.value.status() == status, (raised.value.status(), raised.value.message())


async def test_regions_are_per_key_off_by_default_and_bounded(
    serve_gateway: Callable[..., Any],
    inprocess_runner: Callable[..., Any],
    redis_url: str,
    tmp_path: Path,
    regions: Regions,
) -> None:
    root = repository(tmp_path / "models")
    grpc_port = free_port()
    base = await serve_gateway(repo=str(root), grpc_port=grpc_port, allow_client_shm=True, auth=True)
    closed = await serve_gateway(repo=str(root))  # allow_client_shm left at its default
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    first, _ = create_key(redis_url, "invoke:simple")
    second, _ = create_key(redis_url, "invoke:simple")
    reader, _ = create_key(redis_url, "read")

    def check() -> None:
        http = triton_http.InferenceServerClient(base.removeprefix("http://"))
        rpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        off = triton_http.InferenceServerClient(closed.removeprefix("http://"))
        a, b = {"authorization": f"Bearer {first}"}, {"authorization": f"Bearer {second}"}
        try:
            handle, key = regions.make("data", VECTOR_BYTES * 2)
            shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32), np.ones(16, dtype=np.int32)])

            # Off unless the gateway allows it; listing and CUDA's unregister still answer.
            refused(lambda: off.register_system_shared_memory("data", key, VECTOR_BYTES), "400", DISABLED)
            assert off.get_system_shared_memory_status() == []
            off.unregister_cuda_shared_memory()

            # A key needs to be able to invoke something; without a key, nothing.
            refused(
                lambda: http.register_system_shared_memory(
                    "data", key, VECTOR_BYTES, headers={"authorization": f"Bearer {reader}"}
                ),
                "403",
                "lacks the scope invoke",
            )
            refused(http.get_system_shared_memory_status, "401", "")

            # Each key's names are its own.
            http.register_system_shared_memory("data", key, VECTOR_BYTES * 2, headers=a)
            refused(
                lambda: http.register_system_shared_memory("data", key, VECTOR_BYTES, headers=a),
                "400",
                "shared memory region 'data' already in manager",
            )
            assert http.get_system_shared_memory_status(headers=b) == []
            rpc.register_system_shared_memory("data", key, VECTOR_BYTES, offset=VECTOR_BYTES, headers=b)
            inputs = [triton_http.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_shared_memory("data", VECTOR_BYTES)
            answer = http.infer("simple", inputs, headers=a)  # a's region: 0..15 twice
            assert answer.as_numpy("OUTPUT0").tolist() == [[2 * n for n in range(16)]]
            answer = http.infer("simple", inputs, headers=b)  # b's region starts at the ones
            assert answer.as_numpy("OUTPUT0").tolist() == [[2] * 16]
            http.unregister_system_shared_memory(headers=b)
            assert [status["name"] for status in http.get_system_shared_memory_status(headers=a)] == ["data"]

            # What a registration may name: an object that exists, as a regular file, large enough.
            link = f"/dev/shm/fngate-test-{regions.tag}-link"
            os.symlink(f"/dev/shm/{key.removeprefix('/')}", link)
            try:
                refused(
                    lambda: http.register_system_shared_memory(
                        "linked", link.removeprefix("/dev/shm"), 8, headers=a
                    ),
                    "400",
                    "Unable to open shared memory region",
                )
            finally:
                os.unlink(link)
            for bad_key in ("/../etc/passwd", "etc", "/a/b"):
                refused(
                    lambda bad_key=bad_key: http.register_system_shared_memory("bad", bad_key, 8, headers=a),
                    "400",
                    "'key' must name a POSIX shared memory object",
                )
            refused(
                lambda: http.register_system_shared_memory(
                    "gone", f"/fngate-test-{regions.tag}-none", 8, headers=a
                ),
                "400",
                "Unable to open shared memory region",
            )
            refused(
                lambda: rpc.register_system_shared_memory("big", key, VECTOR_BYTES * 3, headers=a),
                "StatusCode.INVALID_ARGUMENT",
                "failed to register shared memory region 'big': invalid args",
            )

            # What a request may name: a region of its key, within it, of the size its shape needs,
            # and for an output, large enough for it.
            def infer(region: str, size: int, offset: int = 0, output: tuple[str, int] | None = None) -> None:
                tensors = [triton_http.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
                for tensor in tensors:
                    tensor.set_shared_memory(region, size, offset=offset)
                wanted = None
                if output is not None:
                    wanted = [triton_http.InferRequestedOutput("OUTPUT0")]
                    wanted[0].set_shared_memory(*output)
                http.infer("simple", tensors, outputs=wanted, headers=a)

            refused(
                lambda: infer("nowhere", VECTOR_BYTES), "404", "Unable to find system shared memory region"
            )
            refused(lambda: infer("data", VECTOR_BYTES, offset=VECTOR_BYTES * 2), "400", "Invalid offset")
            refused(
                lambda: infer("data", VECTOR_BYTES, offset=VECTOR_BYTES + 8),
                "400",
                "Invalid offset + byte size for shared memory region: 'data'",
            )
            refused(lambda: infer("data", VECTOR_BYTES - 4), "400", "input 'INPUT0'")
            refused(
                lambda: infer("data", VECTOR_BYTES, output=("data", 8)),
                "400",
                "should be at least 64 bytes to hold the results",
            )
            grpc_inputs = [triton_grpc.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
            grpc_inputs[0].set_shared_memory("data", VECTOR_BYTES)
            grpc_inputs[1].set_data_from_numpy(np.ones((1, 16), dtype=np.int32))
            assert rpc.infer("simple", grpc_inputs, headers=a).as_numpy("OUTPUT1").tolist() == [
                [n - 1 for n in range(16)]
            ]
            refused(
                lambda: rpc.register_cuda_shared_memory("gpu", b"", 0, 8, headers=a),
                "StatusCode.INVALID_ARGUMENT",
                "CUDA shared memory is not served by fngate",
            )
            http.unregister_system_shared_memory(headers=a)
        finally:
            http.close()
            rpc.close()
            off.close()

    await asyncio.to_thread(check)


async def test_a_redis_killed_and_back_answers_503_then_the_regions_again(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path, regions: Regions
) -> None:
    """The regions live in Redis: killed (SIGKILL), the routes that read them answer 503 with why;
    started again (its append-only file kept the regions), they answer as before, with no restart
    of the gateway."""
    folder = tmp_path / "redis"
    folder.mkdir()
    process, url = start_redis(folder, "--appendonly", "yes")
    root = repository(tmp_path / "models")
    base = await serve_gateway(repo=str(root), redis_url=url, allow_client_shm=True)
    await inprocess_runner(repo=str(root), redis_url=url, artifact_dir=str(tmp_path / "artifacts"))
    handle, key = regions.make("data", VECTOR_BYTES)
    shm.set_shared_memory_region(handle, [np.arange(16, dtype=np.int32)])
    held = [process]

    def kill_and_restart() -> None:
        http = triton_http.InferenceServerClient(base.removeprefix("http://"))

        def doubled() -> list[list[int]]:
            inputs = [triton_http.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_shared_memory("data", VECTOR_BYTES)
            return http.infer("simple", inputs).as_numpy("OUTPUT0").tolist()  # type: ignore[no-any-return]

        try:
            http.register_system_shared_memory("data", key, VECTOR_BYTES)
            assert doubled() == [[2 * n for n in range(16)]]
            held[0].kill()
            held[0].wait(timeout=10)
            refused(http.get_system_shared_memory_status, "503", "unavailable")
            held[0] = start_redis(folder, "--appendonly", "yes")[0]
            deadline = time.monotonic() + 20
            while True:  # the gateway and the runner reconnect by themselves
                try:
                    assert [status["name"] for status in http.get_system_shared_memory_status()] == ["data"]
                    assert doubled() == [[2 * n for n in range(16)]]
                    break
                except InferenceServerException:
                    assert time.monotonic() < deadline, "not served again once Redis was back"
                    time.sleep(0.1)
        finally:
            http.close()

    try:
        await asyncio.to_thread(kill_and_restart)
    finally:
        held[0].terminate()
        held[0].wait(timeout=10)
