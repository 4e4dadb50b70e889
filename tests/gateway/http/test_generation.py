"""Text generation's pure parts: a streamed text cut at its stop sequences, the prompt and the
sampling parameters as a function's inputs."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from fngate.manifest import parse_manifest
from gateway.http.generation import Stops, inputs_of


@pytest.mark.parametrize(
    ("stops", "pieces", "out", "stopped"),
    [
        ((), ["a", "b"], ["a", "b"], False),
        (("x",), ["ab", "cd"], ["ab", "cd"], False),
        (("x",), ["abxcd"], ["ab"], True),
        (("xy",), ["abx", "ycd"], ["ab", ""], True),  # across pieces: the x is held until the y
        (("xy",), ["abx", "z"], ["ab", "xz"], False),  # an x that starts none is let out
        (("xyz",), ["x", "y", "z"], ["", "", ""], True),
        (("bc", "ab"), ["abc"], [""], True),  # the earliest in the text wins
        (("yz", "xyq"), ["axy"], ["a"], False),  # held: the longest end that may start one
    ],
)
def test_a_text_is_cut_before_its_first_stop_sequence(
    stops: tuple[str, ...], pieces: list[str], out: list[str], stopped: bool
) -> None:
    cut = Stops(stops)
    found = []
    met = False
    for piece in pieces:
        text, met = cut.feed(piece)
        found.append(text)
        if met:
            break
    assert (found, met) == (out, stopped)


def test_held_text_is_what_an_unfinished_stop_sequence_held_back() -> None:
    cut = Stops(("xyz",))
    assert cut.feed("abxy") == ("ab", False)
    assert cut.held == "xy"  # the text ended here: it goes out as it is


def generator(shape: list[int], parameters: bool) -> Any:
    inputs = [{"name": "prompt", "datatype": "BYTES", "shape": shape}]
    inputs += [{"name": "sampling", "datatype": "BYTES", "shape": shape}] if parameters else []
    return parse_manifest(
        {
            "name": "gen",
            "model": {"backend": "python", "path": "model.py"},
            "inputs": inputs,
            "outputs": [{"name": "text", "datatype": "BYTES", "shape": shape}],
            "batching": {"max_batch_size": 4 if shape[0] == -1 else 0},
            "text_generation": {"input": "prompt", "output": "text"}
            | ({"parameters": "sampling"} if parameters else {}),
        },
        "f.yaml",
    )


@pytest.mark.parametrize("shape", [[-1, 1], [-1], [1], [1, 1]])
def test_the_prompt_and_parameters_are_one_element_in_their_inputs_rank(shape: list[int]) -> None:
    inputs = inputs_of(generator(shape, True), "héllo", {"max_tokens": 3})
    assert inputs["prompt"].shape == (1,) * len(shape) and inputs["prompt"].dtype == np.object_
    assert inputs["prompt"].ravel()[0] == "héllo".encode()
    assert orjson.loads(inputs["sampling"].ravel()[0]) == {"max_tokens": 3}
    assert set(inputs_of(generator(shape, False), "x", {"max_tokens": 3})) == {"prompt"}
