"""Text from a function that generates it (manifest `text_generation`): the prompt (and the sampling
parameters) as its inputs, and its answer as text in pieces, each response of the model a token,
cut at a token limit or a stop sequence. What the OpenAI-compatible routes serve
(gateway.http.openai)."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Mapping
from typing import Any

import numpy as np
import orjson

from fngate.manifest import FunctionManifest
from fngate.tensors import Tensors
from fngate.wire import Reply
from gateway.http.streaming import Responses


def inputs_of(manifest: FunctionManifest, prompt: str, sampling: Mapping[str, Any]) -> Tensors:
    """The prompt in the prompt input, and the sampling parameters as one JSON object in the
    parameters input where the function has one (each of one element, in the input's rank)."""
    generation = manifest.text_generation
    assert generation is not None, f"function '{manifest.name}' does not generate text"
    texts = {generation.input: prompt.encode()}
    if generation.parameters is not None:
        texts[generation.parameters] = orjson.dumps(dict(sampling))
    inputs: Tensors = {}
    for name, text in texts.items():
        spec = manifest.input(name)
        assert spec is not None  # the manifest checked its text_generation
        element = np.empty(1, dtype=np.object_)
        element[0] = text
        inputs[name] = element.reshape([1] * len(spec.shape))
    return inputs


class Stops:
    """A text that comes in pieces, cut before the first of its stop sequences: `feed` answers what
    may go out now, holding back an end that may be the start of one (`held`)."""

    def __init__(self, sequences: tuple[str, ...]) -> None:
        self.sequences = sequences
        self.held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """What may go out of the held text and `piece`, and whether a stop sequence was met (then
        the text ends before it, and nothing more goes out)."""
        text = self.held + piece
        found = [at for sequence in self.sequences if (at := text.find(sequence)) >= 0]
        if found:
            self.held = ""
            return text[: min(found)], True
        keep = max(
            (
                size
                for sequence in self.sequences
                for size in range(1, len(sequence))
                if text.endswith(sequence[:size])
            ),
            default=0,
        )
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep], False


class Generation:
    """The text of one call, read with `async for` in pieces as it comes: each response of the model
    a token (its text output's elements, decoded as UTF-8 across responses), cut after `max_tokens`
    tokens (`finish_reason` "length") or before the first stop sequence ("stop", as when the model
    ends). The call is cancelled at the cut. A model's error response ends the text with its error.

    Usage is counted as the gateway can without a tokenizer: `tokens`, the responses read;
    `prompt_tokens`, the prompt's words (separated by white space)."""

    def __init__(
        self,
        responses: Responses,
        output: str,
        prompt: str,
        max_tokens: int | None = None,
        stops: tuple[str, ...] = (),
    ) -> None:
        self._responses = responses
        self._output = output
        self._max_tokens = max_tokens
        self._stops = stops
        self.prompt_tokens = len(prompt.split())
        self.tokens = 0
        self.finish_reason = "stop"

    async def __aiter__(self) -> AsyncIterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        stops = Stops(self._stops)
        try:
            async for reply in self._responses:
                if reply.error is not None:
                    raise reply.error
                self.tokens += 1
                piece, stopped = stops.feed(decoder.decode(_data(reply, self._output)))
                if piece:
                    yield piece
                if stopped:
                    return
                if self._max_tokens is not None and self.tokens >= self._max_tokens:
                    self.finish_reason = "length"
                    break
            piece, stopped = stops.feed(decoder.decode(b"", final=True))
            rest = piece if stopped else piece + stops.held
            if rest:
                yield rest
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the call if it is still on its way (its reader went away)."""
        self._responses.close()


def _data(reply: Reply, output: str) -> bytes:
    array = reply.outputs.get(output)
    if array is None:
        return b""
    items = np.asarray(array).ravel()
    return b"".join(item if isinstance(item, bytes) else str(item).encode() for item in items)
