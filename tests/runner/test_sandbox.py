"""The frames between a runner and a function's process, over a real pipe; and the environment."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest

from runner import sandbox

TENSORS: list[np.ndarray[Any, Any]] = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2],  # not contiguous
    np.arange(6, dtype=">i4").reshape(2, 3),  # big-endian
    np.array([True, False]),
    np.arange(4, dtype=np.float16),
    np.zeros((0, 4), dtype=np.float32),
    np.array([[b"a", b""], [b"\x00\xff", "e\u0301".encode()]], dtype=object),
]


def test_tensors_round_trip_through_a_pipe() -> None:
    tensors = {f"t{index}": array for index, array in enumerate(TENSORS)}
    big = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)  # 2 MiB > a pipe
    tensors["big"] = big
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    specs, buffers = sandbox.pack_tensors(tensors)
    writer = threading.Thread(target=sandbox.send, args=(write_end, {"tensors": specs}, buffers, None))
    writer.start()
    try:
        header, body = sandbox.receive(read_end)
    finally:
        writer.join(10)
        os.close(read_end)
        os.close(write_end)
    decoded = sandbox.unpack_tensors(header["tensors"], body)
    assert decoded.keys() == tensors.keys()
    for name, array in tensors.items():
        assert decoded[name].shape == array.shape, name
        np.testing.assert_array_equal(decoded[name], array)


def test_a_closed_pipe_is_reported() -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)
    with pytest.raises(sandbox.ChannelClosed):
        sandbox.receive(read_end)
    os.close(read_end)


def test_a_silent_pipe_times_out() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    with pytest.raises(TimeoutError):
        sandbox.receive(read_end, time.monotonic() + 0.05)
    os.close(read_end)
    os.close(write_end)


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("FNGATE_REDIS_URL", False),
        ("fngate_repo", False),
        ("AWS_SECRET_ACCESS_KEY", False),
        ("AWS_REGION", False),
        ("DB_PASSWORD", False),
        ("GITHUB_TOKEN", False),
        ("STRIPE_API_KEY", False),
        ("GOOGLE_APPLICATION_CREDENTIALS", False),
        ("PATH", True),
        ("HOME", True),
        ("LANG", True),
        ("OMP_NUM_THREADS", True),
        ("MODEL_SETTING", True),
    ],
)
def test_clean_environment(name: str, kept: bool) -> None:
    assert (name in sandbox.clean_environment({name: "value"})) is kept
