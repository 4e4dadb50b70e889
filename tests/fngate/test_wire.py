from __future__ import annotations

import numpy as np
import pytest

from fngate.errors import DeadlineExceeded, InvalidArgument
from fngate.wire import Invocation, Reply


def test_invocation_round_trip() -> None:
    inputs = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.array([[b"x"], [b"yz"]], dtype=object),
        "c": np.array([[True], [False]]),
    }
    invocation = Invocation("id1", "fn", "3", "fngate:r:g", 123, inputs, ("out",), "00-abc-def-01")
    back = Invocation.decode(invocation.encode())
    assert (back.id, back.function, back.version, back.reply_to) == ("id1", "fn", "3", "fngate:r:g")
    assert (back.deadline_ms, back.outputs, back.traceparent, back.rows) == (
        123,
        ("out",),
        "00-abc-def-01",
        2,
    )
    for name, array in inputs.items():
        assert back.inputs[name].tolist() == array.tolist()
        assert back.inputs[name].dtype == array.dtype


def test_reply_round_trip_with_and_without_error() -> None:
    ok = Reply("i", "1", {"y": np.ones((2, 2), dtype=np.int64)}, None, "batch", 7)
    back = Reply.decode(ok.encode())
    assert back.error is None
    assert back.outputs["y"].tolist() == [[1, 1], [1, 1]]
    assert (back.batch_id, back.batch_size) == ("batch", 7)
    failed = Reply.decode(Reply("i", "1", {}, DeadlineExceeded("late")).encode())
    assert isinstance(failed.error, DeadlineExceeded)
    assert failed.error.message == "late"


def test_other_wire_versions_are_refused() -> None:
    fields = Reply("i", "1").encode()
    fields[b"h"] = fields[b"h"].replace(b'"v":1', b'"v":99')
    with pytest.raises(InvalidArgument, match="wire version 99"):
        Reply.decode(fields)
