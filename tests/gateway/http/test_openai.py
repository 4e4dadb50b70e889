"""OpenAI's request bodies as the gateway reads them: a chat as a prompt, the stop sequences, and
what is refused, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.http.openai import BadField, chat_prompt, stops_of


def test_a_chat_is_a_prompt_of_role_lines_that_the_assistant_completes() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None},
    ]
    assert chat_prompt(messages) == "system: be brief\nuser: hi there\nassistant:\nassistant:"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "hi"}], "messages[0]"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
    ],
)
def test_a_chat_that_is_not_text_is_refused_naming_the_field(messages: Any, param: str) -> None:
    with pytest.raises(BadField) as refused:
        chat_prompt(messages)
    assert refused.value.param == param


@pytest.mark.parametrize(
    ("stop", "stops"),
    [(None, ()), ("x", ("x",)), (["a", "b"], ("a", "b")), ([], ())],
)
def test_stop_is_a_string_or_a_few(stop: Any, stops: tuple[str, ...]) -> None:
    assert stops_of(stop) == stops


@pytest.mark.parametrize("stop", [3, [""], ["a"] * 5, ["x" * 257], [1]])
def test_a_stop_out_of_bounds_is_refused(stop: Any) -> None:
    with pytest.raises(BadField, match="'stop' must be"):
        stops_of(stop)
