"""A real S3 API for the tests: moto's server on 127.0.0.1 (port 0) in a thread, behind a WSGI layer
that records every request and can answer object reads with an error (S3 down, access denied).
boto3 reaches it through its endpoint URL, in this process and in runner processes alike."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import boto3
import pytest
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

FAULTS = {
    403: b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>",
    503: b"<Error><Code>ServiceUnavailable</Code><Message>Please reduce your request rate.</Message></Error>",
}


class QuietHandler(MotoRequestHandler):  # type: ignore[misc]
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


class MotoServer:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.fault: int | None = None
        """Answer GET and HEAD of objects with this status (403 or 503) while set."""
        self._app = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, self._wsgi, threaded=True, request_handler=QuietHandler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _wsgi(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method, path = environ["REQUEST_METHOD"], environ["PATH_INFO"]
        self.requests.append((method, path))
        if self.fault is not None and method in ("GET", "HEAD") and path.count("/") > 1:
            start_response(f"{self.fault} Fault", [("Content-Type", "application/xml")])
            return [FAULTS[self.fault]] if method == "GET" else []
        result: Iterable[bytes] = self._app(environ, start_response)
        return result

    def count(self, method: str, suffix: str) -> int:
        return sum(1 for seen, path in self.requests if seen == method and path.endswith(suffix))

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)


@dataclasses.dataclass
class Bucket:
    """One test's bucket on the shared server, and how to reach it."""

    server: MotoServer
    name: str
    env: dict[str, str]

    @property
    def repo(self) -> str:
        return f"s3://{self.name}/prod"

    def client(self) -> Any:
        return boto3.client("s3", endpoint_url=self.server.url, region_name="us-east-1")

    def key(self, *parts: str) -> str:
        return "/".join(["prod", *parts])


def aws_env(url: str) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL_S3": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": "/dev/null",
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    }


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def s3(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    """A fresh bucket; this process's boto3 (and child processes given `env`) reach it."""
    env = aws_env(moto_server.url)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    moto_server.requests.clear()
    moto_server.fault = None
    bucket = Bucket(moto_server, f"models-{uuid.uuid4().hex[:8]}", env)
    bucket.client().create_bucket(Bucket=bucket.name)
    return bucket
