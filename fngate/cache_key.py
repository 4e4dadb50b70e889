"""The response cache's key: what gateways look answers up by, and what a runner that queues a
pipeline's next step looks it up by too."""

from __future__ import annotations

import hashlib

import numpy as np

from fngate.tensors import Tensors, datatype_of, to_bytes


def cache_key(
    function: str, version: str, digest: str, inputs: Tensors, outputs: tuple[str, ...] | None
) -> str:
    """BLAKE2b-256 over everything that decides the answer: function, version, the version's
    artifact digest, each input (sorted by name) with its datatype, shape and bytes, and the
    requested outputs. Fields are length-prefixed, so no two different requests share a preimage."""
    digest_of = hashlib.blake2b(digest_size=32, person=b"fngate-cache-v1")

    def part(data: bytes) -> None:
        digest_of.update(len(data).to_bytes(8, "little"))
        digest_of.update(data)

    for text in (function, version, digest):
        part(text.encode())
    for name in sorted(inputs):
        array = inputs[name]
        part(name.encode())
        part(datatype_of(array).encode())
        part(np.asarray(array.shape, dtype="<i8").tobytes())
        part(to_bytes(array))
    part(b"\x00".join(name.encode() for name in sorted(outputs)) if outputs is not None else b"\xff*")
    return digest_of.hexdigest()
