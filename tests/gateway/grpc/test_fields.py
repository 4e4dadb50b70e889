"""gateway.grpc.fields: which request header lists and trailers RFC 9113 section 8 makes
malformed, and the content-length a request declares, as a table."""

from __future__ import annotations

import pytest

from bench.h2_cost import REQUEST_HEADERS
from gateway.grpc.fields import judge_request, judge_trailers

REQUEST = list(REQUEST_HEADERS)


def replaced(name: bytes, value: bytes | None) -> list[tuple[bytes, bytes]]:
    if value is None:
        return [field for field in REQUEST if field[0] != name]
    return [(field, value if field == name else old) for field, old in REQUEST]


WELL_FORMED = {
    "gRPC's request": (REQUEST, None),
    "without :authority": (replaced(b":authority", None), None),
    "a content-length": ([*REQUEST, (b"content-length", b"17")], 17),
    "the same content-length twice": ([*REQUEST, (b"content-length", b"0"), (b"content-length", b"0")], 0),
    "CONNECT": ([(b":method", b"CONNECT"), (b":authority", b"example:443")], None),
    "an empty value": ([*REQUEST, (b"x-empty", b"")], None),
    "inner whitespace and octets past ASCII in a value": ([*REQUEST, (b"x-v", b"a b\t\xe9")], None),
    # Left out on purpose (gateway/grpc/fields.py): perf_analyzer's -H "authorization: Bearer KEY".
    "a value that starts with a space": ([*REQUEST, (b"authorization", b" Bearer KEY")], None),
    "a value that ends with a tab": ([*REQUEST, (b"x-v", b"a\t")], None),
    "every octet a name may hold": (
        [*REQUEST, (bytes(range(0x21, 0x3A)) + bytes(range(0x3B, 0x41)), b"1")],
        None,
    ),
    "the rest of them": ([*REQUEST, (bytes(range(0x5B, 0x7F)), b"1")], None),
}

MALFORMED = {
    "an uppercase name": [*REQUEST, (b"X-Upper", b"1")],
    "a space in a name": [*REQUEST, (b"x y", b"1")],
    "a control octet in a name": [*REQUEST, (b"x\x01", b"1")],
    "DEL in a name": [*REQUEST, (b"x\x7f", b"1")],
    "an octet past ASCII in a name": [*REQUEST, (b"x\xe9", b"1")],
    "a colon inside a name": [*REQUEST, (b"x:y", b"1")],
    "an empty name": [*REQUEST, (b"", b"1")],
    "a bare colon": [(b":", b"1"), *REQUEST],
    "NUL in a value": [*REQUEST, (b"x-v", b"a\x00")],
    "CR in a value": [*REQUEST, (b"x-v", b"a\rb")],
    "LF in a value": [*REQUEST, (b"x-v", b"\n")],
    "connection": [*REQUEST, (b"connection", b"close")],
    "keep-alive": [*REQUEST, (b"keep-alive", b"5")],
    "proxy-connection": [*REQUEST, (b"proxy-connection", b"x")],
    "transfer-encoding": [*REQUEST, (b"transfer-encoding", b"chunked")],
    "upgrade": [*REQUEST, (b"upgrade", b"h2c")],
    "TE other than trailers": replaced(b"te", b"gzip"),
    "an unknown pseudo-header": [(b":protocol", b"websocket"), *REQUEST],
    "a response's pseudo-header": [(b":status", b"200"), *REQUEST],
    "a pseudo-header after a regular field": [*REQUEST, (b":authority", b"x")],
    "a repeated :path": [(b":path", b"/"), *REQUEST],
    "no :method": replaced(b":method", None),
    "no :scheme": replaced(b":scheme", None),
    "no :path": replaced(b":path", None),
    "an empty :path": replaced(b":path", b""),
    "CONNECT with :path": [(b":method", b"CONNECT"), (b":authority", b"a:1"), (b":path", b"/")],
    "CONNECT without :authority": [(b":method", b"CONNECT")],
    "a content-length not a number": [*REQUEST, (b"content-length", b"1e3")],
    "a negative content-length": [*REQUEST, (b"content-length", b"-1")],
    "two content-lengths that differ": [*REQUEST, (b"content-length", b"1"), (b"content-length", b"2")],
}


@pytest.mark.parametrize("case", list(WELL_FORMED))
def test_a_well_formed_request_is_taken_with_its_content_length(case: str) -> None:
    fields, length = WELL_FORMED[case]
    assert judge_request(fields) == (None, length)


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_request_is_named_so(case: str) -> None:
    problem, length = judge_request(MALFORMED[case])
    assert problem is not None and length is None


@pytest.mark.parametrize(
    ("fields", "malformed"),
    [
        ([(b"x-checksum", b"abc")], False),
        ([], False),
        ([(b":path", b"/")], True),
        ([(b"X-Upper", b"1")], True),
        ([(b"x-v", b"a\n")], True),
        ([(b"transfer-encoding", b"chunked")], True),
    ],
)
def test_trailers_hold_no_pseudo_header_and_fields_a_request_may_hold(
    fields: list[tuple[bytes, bytes]], malformed: bool
) -> None:
    problem, length = judge_trailers(fields)
    assert (problem is not None) is malformed and length is None
