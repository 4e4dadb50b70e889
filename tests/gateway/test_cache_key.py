from __future__ import annotations

import numpy as np
import pytest

from gateway.cache import cache_key

X = np.arange(8, dtype=np.float32).reshape(2, 4)
BASE = ("fn", "1", "digest", {"x": X}, None)


def key(*changes: object) -> str:
    args = list(BASE)
    for index, value in changes:  # type: ignore[misc]
        args[index] = value
    return cache_key(*args)  # type: ignore[arg-type]


def test_same_request_same_key() -> None:
    assert key() == key((3, {"x": X.copy()}))
    assert len(key()) == 64


def test_input_order_does_not_matter() -> None:
    a, b = np.ones((1, 2), np.int32), np.zeros((1, 3), np.int32)
    assert cache_key("f", "1", "d", {"a": a, "b": b}, None) == cache_key(
        "f", "1", "d", {"b": b, "a": a}, None
    )


@pytest.mark.parametrize(
    "change",
    [
        (0, "other-fn"),
        (1, "2"),
        (2, "another-digest"),
        (3, {"x": X + 1}),
        (3, {"x": X.reshape(4, 2)}),  # same bytes, other shape
        (3, {"x": X.view(np.int32)}),  # same bytes, other datatype
        (3, {"y": X}),  # other name
        (4, ("y",)),  # only some outputs
    ],
)
def test_everything_that_changes_the_answer_changes_the_key(change: tuple[int, object]) -> None:
    assert key(change) != key()


def test_boundaries_between_fields_are_unambiguous() -> None:
    assert cache_key("ab", "c", "d", {"x": X}, None) != cache_key("a", "bc", "d", {"x": X}, None)
