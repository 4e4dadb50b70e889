"""gateway.grpc.hpack_memo: what the remembering HPACK encoder and decoder answer is what hpack's
own answer, over a connection whose dynamic table fills, evicts and changes size, and what they
remember stays bounded."""

from __future__ import annotations

import random

import hpack

from bench.h2_cost import REQUEST_HEADERS
from gateway.grpc import hpack_memo


def header_lists(seed: int, count: int) -> list[list[tuple[bytes, bytes]]]:
    """Mostly the one repeated request, some with headers of their own (new table entries that
    evict others from a small table), some with a value never indexed."""
    rng = random.Random(seed)
    lists = []
    for _ in range(count):
        headers = list(REQUEST_HEADERS)
        draw = rng.random()
        if draw < 0.2:
            headers.append((b"x-request-id", str(rng.randrange(10**6)).encode()))
        elif draw < 0.3:
            headers.append((b"grpc-timeout", f"{rng.randrange(1, 999)}m".encode()))
        elif draw < 0.35:
            headers.append((b"x-large", b"v" * rng.randrange(200, 900)))
        lists.append(headers)
    return lists


def test_the_decoder_answers_what_hpack_answers_as_the_table_changes() -> None:
    client = hpack.Encoder()
    plain = hpack.Decoder()
    remembering = hpack_memo.Decoder(plain.max_header_list_size)
    for index, headers in enumerate(header_lists(1, 3000)):
        if index in (700, 1900):  # the client shrinks, then grows, its table: a size update in the block
            size = 256 if index == 700 else 4096
            client.header_table_size = size
        block = client.encode(headers)
        assert remembering.decode(block, raw=True) == plain.decode(block, raw=True) == headers
        assert len(remembering._memory) <= hpack_memo.MAX_REMEMBERED


def test_the_encoder_writes_what_hpack_writes_as_the_table_changes() -> None:
    encoder = hpack_memo.Encoder()
    plain = hpack.Encoder()
    client = hpack.Decoder()
    rng = random.Random(2)
    answers = [
        [(b":status", b"200"), (b"content-type", b"application/grpc")],
        [(b"grpc-status", b"0")],
    ]
    for index in range(3000):
        draw = rng.random()
        if draw < 0.1:  # an error's trailers: a message of its own, a new table entry
            headers = [(b"grpc-status", b"5"), (b"grpc-message", f"no function {index}".encode())]
        elif draw < 0.15:  # a field never to be indexed equals the plain pair, and is written apart
            headers = [(b"grpc-status", b"13"), hpack.NeverIndexedHeaderTuple(b"grpc-message", b"not kept")]
        elif draw < 0.2:
            headers = [(b"grpc-status", b"13"), (b"grpc-message", b"not kept")]
        else:
            headers = answers[index % 2]
        if index in (500, 1500):  # the client's SETTINGS_HEADER_TABLE_SIZE
            encoder.header_table_size = plain.header_table_size = 200 if index == 500 else 4096
        block = encoder.encode(headers)
        assert block == plain.encode(headers)
        assert client.decode(block, raw=True) == headers
        assert len(encoder._memory) <= hpack_memo.MAX_REMEMBERED


def test_a_judgement_is_remembered_with_its_block() -> None:
    """decode_judged judges a block's list once for as long as the table stays as it was, and
    again once a block changed the table."""
    client = hpack.Encoder()
    decoder = hpack_memo.Decoder(16_384)
    judged: list[tuple[tuple[bytes, bytes], ...]] = []

    def judge(fields: hpack_memo.Fields) -> int:
        judged.append(tuple(fields))
        return len(fields)

    first = client.encode(REQUEST_HEADERS)  # fills the table
    repeated = client.encode(REQUEST_HEADERS)  # every field by index
    for block in (first, repeated, repeated, repeated):
        headers, verdict = decoder.decode_judged(block, judge)
        assert headers == REQUEST_HEADERS and verdict == len(REQUEST_HEADERS)
    assert len(judged) == 2  # the first block, and the repeated one once
    changed = client.encode([*REQUEST_HEADERS, (b"x-new", b"1")])
    decoder.decode_judged(changed, judge)
    decoder.decode_judged(repeated, judge)
    assert len(judged) == 4
