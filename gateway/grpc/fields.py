"""What RFC 9113 section 8 asks of the fields a client sends: judgements of a decoded header list,
a request's or its trailers', saying what makes the message malformed (a stream error of type
PROTOCOL_ERROR, 8.1.1) and the content-length it declares. Pure functions of the list:
gateway.grpc.http2 has its HPACK decoder remember their answers with the block's
(gateway.grpc.hpack_memo), so a header block that gRPC's clients repeat is judged once.

One requirement is left out on purpose: 8.2.1's "a field value MUST NOT start or end with SP or
HTAB". Triton's perf_analyzer sends `-H "authorization: Bearer KEY"` as the value " Bearer KEY",
and grpcio's server takes it; refusing it would refuse Triton's users their usual command. The
gateway forwards no field anywhere (what 8.2.1 guards against is smuggling through HTTP/1.1), and
reads the key with its whitespace trimmed."""

from __future__ import annotations

from collections.abc import Sequence

Fields = Sequence[tuple[bytes, bytes]]
Judgement = tuple[str | None, int | None]
"""(why the message is malformed, or None; the content-length it declares, or None)."""

CONNECTION_FIELDS = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)
"""Connection-specific fields, which make a message malformed (RFC 9113 8.2.2)."""
REQUEST_PSEUDO_HEADERS = frozenset({b":method", b":scheme", b":path", b":authority"})
_NAME_BYTES = bytes(c for c in range(0x21, 0x7F) if not 0x41 <= c <= 0x5A and c != 0x3A)
"""What a field name may hold (RFC 9113 8.2.1: no control, space, uppercase or non-ASCII octet, and
no colon but a pseudo-header's first)."""
_TE = (b"te", b"trailers")


def judge_request(fields: Fields) -> Judgement:
    """A request's header list (RFC 9113 8.2, 8.3, 8.5): fields a name and value may hold,
    pseudo-headers known, once each and first, :method, :scheme and a non-empty :path (a CONNECT's
    :authority alone), no connection-specific field, TE only "trailers", a content-length of
    digits."""
    pseudo: dict[bytes, bytes] = {}
    names: list[bytes] = []
    for name, value in fields:
        if name[:1] != b":":
            names.append(name)
        elif names:
            return "a pseudo-header after a regular field", None
        elif name in pseudo or name not in REQUEST_PSEUDO_HEADERS:
            return "a pseudo-header repeated, or one requests do not have", None
        else:
            pseudo[name] = value
    problem = _fields_problem(names, fields)
    if problem is not None:
        return problem, None
    if pseudo.get(b":method") == b"CONNECT":
        if b":scheme" in pseudo or b":path" in pseudo or b":authority" not in pseudo:
            return "a CONNECT request with :scheme or :path, or without :authority", None
    elif len(pseudo) - (b":authority" in pseudo) != 3:
        return "a request without :method, :scheme or :path", None
    elif not pseudo[b":path"]:
        return "an empty :path", None
    length = None
    if b"content-length" in names:
        lengths = {value for name, value in fields if name == b"content-length"}
        if len(lengths) > 1 or not all(value.isdigit() for value in lengths):
            return "a content-length that is not one number", None
        length = int(lengths.pop())
    return None, length


def judge_trailers(fields: Fields) -> Judgement:
    """A request's trailers (RFC 9113 8.1, 8.2, 8.3): fields a name and value may hold, no
    pseudo-header, no connection-specific field."""
    names = [name for name, _ in fields]
    if any(name[:1] == b":" for name in names):
        return "a pseudo-header in trailers", None
    return _fields_problem(names, fields), None


def _fields_problem(names: list[bytes], fields: Fields) -> str | None:
    """RFC 9113 8.2's checks of a field section whose pseudo-headers are known good (`names`: the
    rest's names), each over all the fields at once (a join, a translate, counts): cheaper in
    Python than each check on each field."""
    if not fields:
        return None
    if b"" in names or b"-".join(names).translate(None, _NAME_BYTES):
        return "a field name with an octet it may not hold (RFC 9113 8.2, 8.2.1)"
    values = b"\n".join([value for _, value in fields])
    if values.translate(None, b"\0\r") != values or values.count(b"\n") != len(fields) - 1:
        return "a field value with NUL, CR or LF (RFC 9113 8.2.1)"
    if not CONNECTION_FIELDS.isdisjoint(names):
        return "a connection-specific field (RFC 9113 8.2.2)"
    if b"te" in names and list(fields).count(_TE) != names.count(b"te"):
        return "TE other than trailers (RFC 9113 8.2.2)"
    return None
