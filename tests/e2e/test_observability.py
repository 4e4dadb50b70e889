"""One trace from HTTP through the queue into the batch, and Prometheus counts that add up."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_http

ROW = [0.25] * 16


class Receiver:
    """An OTLP/HTTP trace receiver: decodes each export and keeps its spans."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    for resource_spans in request.resource_spans:
                        service = next(
                            a.value.string_value
                            for a in resource_spans.resource.attributes
                            if a.key == "service.name"
                        )
                        for scope in resource_spans.scope_spans:
                            for span in scope.spans:
                                receiver.spans.append(
                                    {
                                        "service": service,
                                        "name": span.name,
                                        "trace": span.trace_id.hex(),
                                        "id": span.span_id.hex(),
                                        "parent": span.parent_span_id.hex(),
                                        "links": [
                                            (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                                        ],
                                        "attributes": {a.key: a.value for a in span.attributes},
                                        "events": {
                                            event.name: {a.key: a.value for a in event.attributes}
                                            for event in span.events
                                        },
                                    }
                                )
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def named(self, prefix: str) -> list[dict[str, Any]]:
        with self.lock:
            return [span for span in self.spans if span["name"].startswith(prefix)]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    found = Receiver()
    server = ThreadingHTTPServer(("127.0.0.1", 0), found.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield found, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


async def test_one_trace_from_http_into_the_batch(
    gateway_process: Callable[..., str],
    runner_process: Callable[..., Any],
    receiver: tuple[Receiver, str],
    tmp_path: Path,
) -> None:
    spans, endpoint = receiver
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    base = gateway_process(**otel)
    await wait_http(base)
    status_port = free_port()
    sent_rows = 0
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        # Queued before any runner exists: the first batch holds several and pays the cold start.
        calls = [
            asyncio.create_task(
                client.post(
                    "/v2/models/classifier/infer",
                    json={
                        "inputs": [
                            {"name": "input", "datatype": "FP32", "shape": [rows, 16], "data": ROW * rows}
                        ]
                    },
                )
            )
            for rows in (1, 2, 3, 1)
        ]
        sent_rows = 7
        await asyncio.sleep(0.3)
        runner_process(FNGATE_FUNCTIONS='["classifier"]', FNGATE_STATUS_PORT=str(status_port), **otel)
        responses = await asyncio.gather(*calls)
        assert [response.status_code for response in responses] == [200] * 4
        gateway_metrics = (await client.get("/metrics")).text
        runner_metrics = (await client.get(f"http://127.0.0.1:{status_port}/metrics")).text
        ready = await client.get(f"http://127.0.0.1:{status_port}/healthz/ready")

    for _ in range(100):
        if len(spans.named("execute classifier")) >= 4 and len(spans.named("POST")) >= 4:
            break
        await asyncio.sleep(0.1)
    servers = [
        span for span in spans.named("POST /v2/models/{name}/infer") if span["service"] == "fngate-gateway"
    ]
    executes = spans.named("execute classifier")
    assert len(servers) == 4 and len(executes) == 4
    for server in servers:
        mine = [span for span in executes if span["trace"] == server["trace"]]
        assert len(mine) == 1, "each request's runner span is in the request's own trace"
        assert mine[0]["parent"] == server["id"]
        assert mine[0]["service"] == "fngate-runner"
        assert [span for span in spans.named("queue classifier") if span["trace"] == server["trace"]]
        assert [span for span in spans.named("enqueue classifier") if span["trace"] == server["trace"]]
    batches = spans.named("batch classifier")
    linked = {span_id for batch in batches for _trace, span_id in batch["links"]}
    assert {server["id"] for server in servers} <= linked, (
        "every request is linked from the batch that ran it"
    )
    first = next(batch for batch in batches if len(batch["links"]) > 1)
    assert first["attributes"]["fngate.batch_size"].int_value > 1
    loads = spans.named("load classifier")
    assert len(loads) == 1 and loads[0]["attributes"]["fngate.cold_start"].bool_value
    # Each request waited for the runner to start: its span says what it waited for, as its answer's
    # Server-Timing does.
    for server in servers:
        phases = server["events"]["cold start"]
        assert phases["fngate.cold_start.start_ms"].double_value > 0, phases
        assert set(phases) == {
            f"fngate.cold_start.{phase}_ms" for phase in ("start", "queue", "fetch", "load", "exec")
        }
    assert all("server-timing" in response.headers for response in responses)

    assert scrape(gateway_metrics, "fngate_request_success_total", function="classifier") == 4
    assert scrape(gateway_metrics, "fngate_request_duration_seconds_count", function="classifier") == 4
    assert scrape(runner_metrics, "fngate_inference_count_total", function="classifier") == sent_rows
    assert scrape(runner_metrics, "fngate_execution_count_total", function="classifier") == len(batches)
    assert scrape(runner_metrics, "fngate_cold_starts_total", function="classifier") == 1
    assert (
        scrape(runner_metrics, "fngate_runner_invocations_total", function="classifier", outcome="success")
        == 4
    )
    assert ready.status_code == 200


async def test_failures_are_counted_by_code(serve_gateway: Callable[..., Any]) -> None:
    base = await serve_gateway()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        await client.post("/v1/functions/classifier", json={"inputs": {"input": [[1.0]]}})
        await client.post("/v1/functions/nope", json={"inputs": {"input": [[1.0]]}})
        text = (await client.get("/metrics")).text
    assert scrape(text, "fngate_request_failure_total", function="classifier", code="invalid_argument") >= 1
    assert scrape(text, "fngate_request_failure_total", function="", code="not_found") >= 1


async def test_names_that_are_no_function_make_no_series(serve_gateway: Callable[..., Any]) -> None:
    """A client cannot grow the gateway's metrics (and its memory) by inventing function names."""
    base = await serve_gateway()
    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        for index in range(20):
            answer = await client.post(f"/v1/functions/made-up-{index}", json={"inputs": {"input": [[1.0]]}})
            assert answer.status_code == 404
        text = (await client.get("/metrics")).text
    assert "made-up-" not in text
    assert scrape(text, "fngate_request_duration_seconds_count", function="") >= 20
