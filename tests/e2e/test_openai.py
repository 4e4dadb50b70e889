"""OpenAI's API through real processes (gateway, runner, the model's confined process), called with
OpenAI's own client as its users call it: a decoupled Triton Python model that sends the words of
its prompt back one response each (a token each), declared a text generator in its config.pbtxt,
and a Python function that answers its whole text at once, declared one in its function.yaml. The
tokens come in order from the first call on, when the runner's connections are still opening (on
one Redis and on a cluster)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis
import yaml

from tests.conftest import on_cluster_too
from tests.e2e.test_auth import create_key
from tests.e2e.test_triton_decoupled import DOUBLE, DOUBLE_CONFIG
from tests.triton_repository import model

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: True }
input [
  { name: "PROMPT" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "SAMPLING" data_type: TYPE_STRING dims: [ 1 ] }
]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters { key: "text_generation_input" value: { string_value: "PROMPT" } }
parameters { key: "text_generation_output" value: { string_value: "TEXT" } }
parameters { key: "text_generation_parameters" value: { string_value: "SAMPLING" } }
"""

# The prompt's words, one response each (the first bare, the others after a space); the prompt
# "parameters?" answers the sampling parameters it was given, as one response; "fail?" one word,
# then an error response.
ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()[0].decode()
            sampling = pb_utils.get_input_tensor_by_name(request, "SAMPLING").as_numpy()[0].decode()
            words = prompt.split()
            tokens = [sampling] if prompt == "parameters?" else [words[0], *(" " + w for w in words[1:])]
            sender = request.get_response_sender()
            for token in tokens:
                text = pb_utils.Tensor("TEXT", np.array([token.encode()], dtype=object))
                sender.send(pb_utils.InferenceResponse([text]))
            if prompt == "fail?":
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("the model gave up")))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

SHOUT = """
import numpy as np


class Model:
    def __init__(self, directory):
        pass

    def infer(self, inputs):
        texts = [item.decode().upper().encode() for item in inputs["prompt"].ravel()]
        return {"text": np.array(texts, dtype=object).reshape(-1, 1)}
"""


def shout(root: Path) -> None:
    """A Python function (function.yaml) that answers its prompt in capitals, all at once."""
    folder = root / "shout"
    folder.mkdir(parents=True)
    manifest = {
        "name": "shout",
        "model": {"backend": "python", "path": "model.py"},
        "inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [-1, 1]}],
        "outputs": [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}],
        "batching": {"max_batch_size": 4, "timeout_ms": 30000},
        "text_generation": {"input": "prompt", "output": "text"},
    }
    (folder / "function.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    (folder / "model.py").write_text(SHOUT)


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello big world"}]
WORDS = ["system:", " be", " brief", " user:", " hello", " big", " world", " assistant:"]


async def chunks_of(stream: Any) -> list[Any]:
    return [chunk async for chunk in stream]


def repository(root: Path) -> Path:
    """The text generators echo (Triton, decoupled) and shout (function.yaml), and double, which
    generates no text."""
    model(root, "echo", ECHO_CONFIG, {"1": {"model.py": ECHO}})
    model(root, "double", DOUBLE_CONFIG, {"1": {"model.py": DOUBLE}})
    shout(root)
    return root


@on_cluster_too
async def test_openai_s_client_chats_and_completes_streamed_and_whole(
    serve_gateway: Callable[..., Any], inprocess_runner: Callable[..., Any], tmp_path: Path
) -> None:
    root = repository(tmp_path / "models")
    base = await serve_gateway(repo=str(root))
    await inprocess_runner(repo=str(root), artifact_dir=str(tmp_path / "artifacts"))
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60) as client:
        # Whole: the text and what it counts (a token a response; the prompt's words).
        whole = await client.chat.completions.create(model="echo", messages=CHAT)
        assert (whole.object, whole.model, whole.id[:9]) == ("chat.completion", "echo", "chatcmpl-")
        assert whole.choices[0].message.role == "assistant"
        assert whole.choices[0].message.content == "".join(WORDS)
        assert whole.choices[0].finish_reason == "stop"
        assert whole.usage is not None
        usage = (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
        assert usage == (8, 8, 16)

        # Streamed: each token its own chunk, in order, then the finish, the usage, and [DONE].
        stream = await client.chat.completions.create(
            model="echo", messages=CHAT, stream=True, stream_options={"include_usage": True}
        )
        chunks = await chunks_of(stream)
        contents = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices]
        assert contents == ["", *WORDS, None]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
        assert {chunk.id for chunk in chunks} == {chunks[0].id}
        assert "".join(content or "" for content in contents) == whole.choices[0].message.content

        # Completions, whole and streamed alike; max_tokens and stop are cut at the gateway.
        done = await client.completions.create(model="echo", prompt="one two three four")
        assert (done.object, done.choices[0].text) == ("text_completion", "one two three four")
        streamed = await client.completions.create(model="echo", prompt="one two three four", stream=True)
        assert [chunk.choices[0].text for chunk in await chunks_of(streamed)] == [
            "one",
            " two",
            " three",
            " four",
            "",
        ]
        cut = await client.completions.create(model="echo", prompt="one two three four", max_tokens=2)
        assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("one two", "length")
        stopped = await chunks_of(
            await client.completions.create(
                model="echo", prompt="one two three four", stop=["o th"], stream=True
            )
        )
        assert "".join(chunk.choices[0].text for chunk in stopped) == "one tw"  # across two tokens
        assert stopped[-1].choices[0].finish_reason == "stop"

        # The sampling parameters reach the model's parameters input as one JSON object.
        asked = await client.completions.create(
            model="echo", prompt="parameters?", temperature=0.5, seed=7, max_tokens=9
        )
        assert json.loads(asked.choices[0].text) == {"max_tokens": 9, "temperature": 0.5, "seed": 7}

        # An error response of the model: the stream's last event, raised by the client.
        failing = await client.completions.create(model="echo", prompt="fail?", stream=True)
        with pytest.raises(openai.APIError, match="the model gave up"):
            async for chunk in failing:
                assert chunk.choices[0].text == "fail?"
        with pytest.raises(openai.InternalServerError, match="the model gave up"):
            await client.completions.create(model="echo", prompt="fail?")

        # A function.yaml text generator that answers at once: one chunk.
        loud = await client.completions.create(model="shout", prompt="quiet please", stream=True)
        assert [chunk.choices[0].text for chunk in await chunks_of(loud)] == ["QUIET PLEASE", ""]


async def test_openai_s_client_is_refused_as_it_expects(
    redis: aioredis.Redis, redis_url: str, serve_gateway: Callable[..., Any], tmp_path: Path
) -> None:
    """No runner: every refusal is the gateway's, before anything is queued."""
    root = repository(tmp_path / "models")
    invoker, _ = create_key(redis_url, "invoke")
    narrow, _ = create_key(redis_url, "invoke:echo")
    reader, _ = create_key(redis_url, "read")
    base = await serve_gateway(repo=str(root), auth=True)
    wrong = "fng_0123456789ab_" + "x" * 43
    async with (
        openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=invoker, max_retries=0) as client,
        openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=narrow, max_retries=0) as echo_only,
        openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=reader, max_retries=0) as read_only,
        openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=wrong, max_retries=0) as nobody,
    ):
        # The models a key may see: the text generators it may invoke, or read.
        assert [item.id async for item in client.models.list()] == ["echo", "shout"]
        assert (await client.models.retrieve("echo")).id == "echo"
        assert [item.id async for item in read_only.models.list()] == ["echo", "shout"]
        assert [item.id async for item in echo_only.models.list()] == ["echo"]
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("double")

        with pytest.raises(openai.NotFoundError) as unknown:
            await client.chat.completions.create(model="nope", messages=CHAT)
        assert unknown.value.response.json()["error"]["param"] == "model"
        with pytest.raises(openai.BadRequestError, match="does not generate text"):
            await client.chat.completions.create(model="double", messages=CHAT)
        with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
            await client.completions.create(model="echo", prompt="x", n=2)
        with pytest.raises(openai.PermissionDeniedError, match="lacks the scope invoke:echo"):
            await read_only.chat.completions.create(model="echo", messages=CHAT)
        with pytest.raises(openai.PermissionDeniedError, match="lacks the scope invoke:shout"):
            await echo_only.completions.create(model="shout", prompt="x")
        with pytest.raises(openai.AuthenticationError) as refused:
            await nobody.completions.create(model="echo", prompt="x", stream=True)
        assert refused.value.response.json()["error"]["code"] == "unauthenticated"
