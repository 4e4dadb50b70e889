"""A Triton Python model through fngate's adapter: one request per invocation of a batch, error
responses failing their own invocation, and business logic scripting refused with a clear error."""

from __future__ import annotations

import time
import types
from pathlib import Path

import numpy as np
import pytest

from runner.triton import python_backend as pb_utils
from runner.triton.model import TritonModel, instance_args

SOURCE = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0, 0] < 0:
                error = pb_utils.TritonError("negative", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
            elif x[0, 0] == 0:
                call = pb_utils.InferenceRequest(model_name="other", requested_output_names=["Y"], inputs=[])
                responses.append(call.exec())
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * len(requests))]))
        return responses
"""


def load(tmp_path: Path) -> TritonModel:
    from runner.triton.model import provide_utils

    provide_utils()
    module = types.ModuleType("model")
    exec(compile(SOURCE, "model.py", "exec"), module.__dict__)
    config = {"name": "doubler", "max_batch_size": 4, "output": [{"name": "Y"}]}
    return TritonModel(module, tmp_path / "doubler" / "2" / "model.py", tmp_path / "doubler", config)


def test_each_request_is_answered_on_its_own(tmp_path: Path) -> None:
    model = load(tmp_path)
    args = model.args  # what initialize was given
    assert (args["model_name"], args["model_version"], args["model_repository"]) == (
        "doubler",
        "2",
        str(tmp_path / "doubler"),
    )
    x = np.array([[1.0], [2.0], [-1.0], [3.0]], dtype=np.float32)
    outputs = model.infer({"X": x}, [2, 1, 1])  # three invocations: 2 rows, 1 and 1
    assert model.member_errors == {"1": ["invalid_argument", "negative"]}
    np.testing.assert_array_equal(outputs["Y"], [[3.0], [6.0], [9.0]])  # the others' rows, in order


def test_a_call_outside_a_model_process_is_refused_clearly(tmp_path: Path) -> None:
    """A model's calls (BLS) go up its process's pipe to its runner: loaded anywhere else, a call
    says so, a decoupled one too (tests/e2e/test_triton_python.py and test_triton_decoupled.py make
    real ones)."""
    model = load(tmp_path)
    with pytest.raises(pb_utils.TritonModelException, match="runs in a runner's model process only"):
        model.infer({"X": np.zeros((1, 1), dtype=np.float32)}, [1])
    with pytest.raises(pb_utils.TritonModelException, match="runs in a runner's model process only"):
        pb_utils.InferenceRequest("other", ["Y"], []).exec(decoupled=True)


@pytest.mark.parametrize(
    ("elements", "wire"),
    [
        ([[b"ab", b""], [b"\xff\x00", b"c"]], b"\2\0\0\0ab\0\0\0\0\2\0\0\0\xff\0\1\0\0\0c"),  # C order
        ([b""], b"\0\0\0\0"),
        ([b"", b""], b"\0\0\0\0\0\0\0\0"),
        (["é", "日本"], b"\2\0\0\0\xc3\xa9\6\0\0\0\xe6\x97\xa5\xe6\x9c\xac"),  # str as UTF-8
        ([b"\x00\x01\x02\x80\xfe"], b"\5\0\0\0\x00\x01\x02\x80\xfe"),
    ],
)
def test_bytes_tensors_round_trip_in_tritons_wire_layout(elements: list[object], wire: bytes) -> None:
    array = np.array(elements, dtype=np.object_)
    serialized = pb_utils.serialize_byte_tensor(array)
    assert serialized.shape == () and serialized.item() == wire
    expected = [item.encode() if isinstance(item, str) else item for item in array.ravel()]
    for encoded in (wire, serialized, np.frombuffer(wire, dtype=np.uint8), memoryview(wire)):
        decoded = pb_utils.deserialize_bytes_tensor(encoded)
        assert decoded.dtype == np.object_ and decoded.tolist() == expected


def test_bytes_tensors_of_no_elements_and_bad_data() -> None:
    assert pb_utils.serialize_byte_tensor(np.empty((0, 3), dtype=np.object_)).size == 0
    assert pb_utils.deserialize_bytes_tensor(b"").tolist() == []
    nothing = pb_utils.serialize_byte_tensor(np.empty(0, np.object_))
    assert pb_utils.deserialize_bytes_tensor(nothing).size == 0
    fixed = pb_utils.serialize_byte_tensor(np.array([b"ab", b"c"], dtype=np.bytes_))
    assert pb_utils.deserialize_bytes_tensor(fixed).tolist() == [b"ab", b"c"]
    with pytest.raises(pb_utils.TritonModelException, match="float32"):
        pb_utils.serialize_byte_tensor(np.zeros(2, dtype=np.float32))
    with pytest.raises(pb_utils.TritonModelException, match="inside the length of element 1"):
        pb_utils.deserialize_bytes_tensor(b"\1\0\0\0a\1\0")
    with pytest.raises(pb_utils.TritonModelException, match="element 0 runs past the end"):
        pb_utils.deserialize_bytes_tensor(b"\5\0\0\0abc")


def test_a_reschedule_is_refused_and_release_all_accepted() -> None:
    request = pb_utils.InferenceRequest("m", ["Y"], [])
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL)
    assert pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE == 2
    with pytest.raises(pb_utils.TritonModelException, match="fngate does not reschedule"):
        request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)


ASYNC_SOURCE = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def initialize(self, args):
        self.loop = asyncio.get_running_loop()
        self.ticks = 0
        self.ticker = asyncio.create_task(self.tick())  # kept across calls, as an async client would be

    async def tick(self):
        while True:
            self.ticks += 1
            await asyncio.sleep(0.001)

    async def execute(self, requests):
        await asyncio.sleep(0.01)
        same = asyncio.get_running_loop() is self.loop and not self.ticker.done()
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            state = np.array([[self.ticks, same]] * len(x), dtype=np.int64)
            outputs = [pb_utils.Tensor("Y", x), pb_utils.Tensor("T", state)]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses

    async def finalize(self):
        self.ticker.cancel()
        pb_utils.Logger.log_info(f"finalized after {self.ticks} ticks")
"""


def test_an_async_execute_is_awaited_on_one_loop_that_outlives_each_batch(tmp_path: Path) -> None:
    from runner.triton.model import provide_utils

    provide_utils()  # the model imports triton_python_backend_utils, whichever test ran before
    module = types.ModuleType("model")
    exec(compile(ASYNC_SOURCE, "model.py", "exec"), module.__dict__)
    config = {"name": "waiter", "max_batch_size": 4, "output": [{"name": "Y"}, {"name": "T"}]}
    model = TritonModel(module, tmp_path / "waiter" / "1" / "model.py", tmp_path / "waiter", config)
    x = np.array([[1.0], [2.0]], dtype=np.float32)
    first = model.infer({"X": x}, [1, 1])
    np.testing.assert_array_equal(first["Y"], x)
    time.sleep(0.05)  # the model's task runs on between batches
    second = model.infer({"X": x}, [2])
    np.testing.assert_array_equal(second["Y"], x)
    assert first["T"][:, 1].all() and second["T"][:, 1].all()  # the loop of initialize, its task alive
    assert second["T"][0, 0] > first["T"][0, 0]
    model.close()


@pytest.mark.parametrize(
    ("groups", "index", "expected"),
    [
        ([{"name": "doubler", "kind": "KIND_CPU", "count": 2}], 0, ("doubler_0", "CPU")),
        ([{"name": "doubler", "kind": "KIND_CPU", "count": 2}], 1, ("doubler_1", "CPU")),
        (
            [{"name": "a", "kind": "KIND_GPU", "count": 1}, {"name": "b", "kind": "KIND_CPU", "count": 2}],
            2,
            ("b_1", "CPU"),
        ),
        (
            [{"name": "a", "kind": "KIND_GPU", "count": 1}, {"name": "b", "kind": "KIND_CPU", "count": 2}],
            0,
            ("a_0", "GPU"),
        ),
        (
            [{"name": "", "kind": "KIND_MODEL", "count": 1}, {"name": "", "count": 1}],
            1,
            ("doubler_1_0", "CPU"),
        ),
        ([{"name": "", "kind": "KIND_MODEL", "count": 1}], 0, ("doubler_0_0", "MODEL")),
        ([], 0, ("doubler_0_0", "CPU")),
    ],
)
def test_each_instance_has_tritons_name_and_kind(
    groups: list[dict[str, object]], index: int, expected: tuple[str, str]
) -> None:
    args = instance_args({"name": "doubler", "instance_group": groups}, "doubler", index)
    assert (args["model_instance_name"], args["model_instance_kind"]) == expected
    assert args["model_instance_device_id"] == "0"
