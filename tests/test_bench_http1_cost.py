"""`python -m bench.http1_cost` measures what it says: both engines answer every request of a
keep-alive connection, the uvicorn one through the gateway's own protocol and link (a uvicorn
release that changes them breaks this, not the figure silently)."""

from __future__ import annotations

import uvloop

from bench import http1_cost


def test_both_engines_answer_every_request_on_one_connection() -> None:
    requests = http1_cost.requests(300)
    loop = uvloop.new_event_loop()
    try:
        feed, transport = http1_cost.uvicorn_engine(loop)
        http1_cost.measure(feed, requests, loop)
        uvicorn_written = transport.written
        assert not transport.closed
    finally:
        loop.close()
    feed, transport = http1_cost.httptools_engine()
    http1_cost.measure(feed, requests, None)
    answer = len(http1_cost.ANSWER)
    # Each answer is the body and a head of some 110 bytes (status, date, type, length): 300
    # answers, none lost or doubled, and the same bytes from both.
    assert 300 * (answer + 90) < uvicorn_written < 300 * (answer + 130)
    assert transport.written == uvicorn_written
