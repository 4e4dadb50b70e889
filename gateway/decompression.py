"""Compressed request data (a body's Content-Encoding, a gRPC message's grpc-encoding) undone a
bounded step at a time, for both front ends: never more than a limit once decompressed, a step of
at most INFLATE_STEP_BYTES handed on at a time, and truncated data refused."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from fngate.errors import InvalidArgument, PayloadTooLarge

INFLATE_STEP_BYTES = 256 * 1024
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class Inflater:
    """An encoding undone a step at a time: each `feed` hands `sink` the decompressed bytes in
    pieces of at most INFLATE_STEP_BYTES, and refuses (PayloadTooLarge) once they pass
    `limit_bytes` in all. `what` names the data in its errors ('body', 'message')."""

    def __init__(
        self, encoding: str, limit_bytes: int, sink: Callable[[bytes], None], what: str = "body"
    ) -> None:
        self.name = encoding.strip().lower()
        self.what = what
        wbits = _WBITS.get(self.name)
        if wbits is None:
            raise InvalidArgument(
                f"Content-Encoding {encoding!r} is not supported: use gzip, deflate or none"
            )
        self._wbits = wbits
        self._limit = limit_bytes
        self._sink = sink
        self._head = b""
        self._decoder: zlib._Decompress | None = None
        self.size = 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._decoder is None:
            if self._head or len(data) < 2:  # the two bytes that tell deflate's kind, when split
                self._head += data
                if len(self._head) < 2:
                    return
                data, self._head = self._head, b""
            if self.name == "deflate" and not _zlib_header(data):
                self._wbits = -zlib.MAX_WBITS  # raw deflate, without the zlib header that RFC 9110 asks for
            self._decoder = zlib.decompressobj(self._wbits)
        pending = data
        while True:
            decoder = self._decoder
            if decoder.eof:
                if not pending or self._wbits <= zlib.MAX_WBITS:
                    return  # what follows a deflate stream is ignored, as before
                decoder = self._decoder = zlib.decompressobj(self._wbits)  # gzip: the next member
            try:
                chunk = decoder.decompress(pending, INFLATE_STEP_BYTES)
            except zlib.error as exc:
                raise InvalidArgument(f"the {self.name} {self.what} does not decompress: {exc}") from None
            self.size += len(chunk)
            if self.size > self._limit:
                raise PayloadTooLarge(
                    f"the decompressed {self.what} is over the limit of {self._limit} bytes"
                )
            if chunk:
                self._sink(chunk)
            pending = decoder.unused_data if decoder.eof else decoder.unconsumed_tail
            if not decoder.eof and not pending and len(chunk) < INFLATE_STEP_BYTES:
                return  # it needs more input

    def close(self) -> None:
        if self._decoder is None and not self._head:
            return  # an empty body
        if self._decoder is None or not self._decoder.eof:
            raise InvalidArgument(f"the {self.name} {self.what} is truncated")


def _zlib_header(body: bytes | bytearray | memoryview) -> bool:
    """RFC 1950: method 8 (deflate) in the low bits of the first byte, both bytes a multiple of 31."""
    return len(body) >= 2 and body[0] & 0x0F == 8 and ((body[0] << 8) | body[1]) % 31 == 0


def decode_body(body: bytes, encoding: str | None, limit_bytes: int) -> bytes:
    """The body as sent before its Content-Encoding (gzip or deflate; identity as is), never more
    than `limit_bytes` once decompressed."""
    if (encoding or "identity").strip().lower() == "identity":
        return body
    parts: list[bytes] = []
    inflater = Inflater(encoding or "", limit_bytes, parts.append)
    inflater.feed(body)
    inflater.close()
    return b"".join(parts)
