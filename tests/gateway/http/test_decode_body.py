"""Compressed request bodies: gzip and deflate decoded, the size limit applied after decompression,
and decompressed a bounded step at a time, so that a decoder that refuses the start stops it."""

from __future__ import annotations

import gzip
import zlib

import pytest

from fngate.errors import InvalidArgument, PayloadTooLarge
from gateway.decompression import INFLATE_STEP_BYTES, Inflater, decode_body

BODY = b'{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}]}' * 20


def raw_deflate(data: bytes) -> bytes:
    encoder = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return encoder.compress(data) + encoder.flush()


@pytest.mark.parametrize(
    ("encoding", "sent"),
    [
        (None, BODY),
        ("identity", BODY),
        ("gzip", gzip.compress(BODY, mtime=0)),
        ("GZip", gzip.compress(BODY, mtime=0)),
        ("x-gzip", gzip.compress(BODY, mtime=0)),
        ("deflate", zlib.compress(BODY)),
        ("deflate", raw_deflate(BODY)),
        ("gzip", gzip.compress(BODY[:100], mtime=0) + gzip.compress(BODY[100:], mtime=0)),
    ],
)
def test_decodes(encoding: str | None, sent: bytes) -> None:
    assert decode_body(sent, encoding, len(BODY)) == BODY


def test_the_limit_applies_to_the_decompressed_size() -> None:
    with pytest.raises(PayloadTooLarge, match="decompressed body is over the limit of 100 bytes"):
        decode_body(gzip.compress(BODY, mtime=0), "gzip", 100)


def test_a_bomb_stops_at_the_limit() -> None:
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < 100_000
    with pytest.raises(PayloadTooLarge):
        decode_body(bomb, "gzip", 1024 * 1024)


@pytest.mark.parametrize(
    ("encoding", "sent", "message"),
    [
        ("br", BODY, "'br' is not supported"),
        ("gzip", BODY, "does not decompress"),
        ("gzip", gzip.compress(BODY, mtime=0)[:-12], "truncated"),
        ("deflate", zlib.compress(BODY)[:20], "truncated"),
    ],
)
def test_bad_bodies_are_400(encoding: str, sent: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        decode_body(sent, encoding, 1 << 20)


def test_a_body_refused_early_is_not_decompressed_further() -> None:
    bomb = gzip.compress(b"1," * (32 * 1024 * 1024), compresslevel=9)
    steps: list[int] = []

    def refuse(chunk: bytes) -> None:
        steps.append(len(chunk))
        raise InvalidArgument("more than 16 elements of data")

    with pytest.raises(InvalidArgument):
        Inflater("gzip", 64 * 1024 * 1024, refuse).feed(bomb)
    assert steps == [INFLATE_STEP_BYTES]  # one step of 64 MiB, then nothing


@pytest.mark.parametrize("sent", [zlib.compress(BODY), raw_deflate(BODY), gzip.compress(BODY, mtime=0)])
def test_a_body_fed_a_byte_at_a_time_decodes(sent: bytes) -> None:
    """The first two bytes (which tell zlib's deflate from raw deflate) may come apart."""
    parts: list[bytes] = []
    inflater = Inflater("gzip" if sent[:2] == b"\x1f\x8b" else "deflate", len(BODY), parts.append)
    for index in range(len(sent)):
        inflater.feed(memoryview(sent)[index : index + 1])
    inflater.close()
    assert b"".join(parts) == BODY
