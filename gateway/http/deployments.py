"""The deploy API: PUT, GET and DELETE /v1/functions/{name}, and PUT /v1/functions/{name}/traffic,
so that deployers need an API key with the `deploy` scope and neither S3 nor Redis credentials. The
body of a PUT is a gzipped tar of the function's folder, `function.yaml` at its root; it is streamed
to disk, bounded by max_deploy_bytes. A traffic PUT is `{"traffic": {"3": 90, "4": 10}}`."""

from __future__ import annotations

import asyncio
import logging
import tarfile
import tempfile
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fngate import deployment
from fngate.config import GatewaySettings
from fngate.errors import InvalidArgument
from fngate.repository import MANIFEST_FILE, Repository, check_name
from gateway.http.errors import PayloadTooLarge
from gateway.http.guard import PRINCIPAL
from gateway.http.protocol import load_json
from gateway.http.rendering import json_response
from gateway.state import services

log = logging.getLogger(__name__)

ARCHIVE_TYPES = ("application/gzip", "application/x-gzip", "application/x-tar", "application/octet-stream")
REMOVE_GRACE_S = 1.0


class Deployer:
    """The repository the gateway serves from, opened on first use (an S3 one creates a client)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.url = settings.repo
        self.max_bytes = settings.max_deploy_bytes
        self._repository: Repository | None = None

    def repository(self) -> Repository:
        if self._repository is None:
            self._repository = deployment.open_any(self.url)
        return self._repository


def deployer(request: Request) -> Deployer:
    found: Deployer = services(request).deployer
    return found


async def put_function(request: Request) -> Response:
    """Store the archive's folder as the function's next version; answer what `GET` answers for
    it, plus the new version's number (201)."""
    name = check_name(request.path_params["name"])
    owner = deployer(request)
    kind = request.headers.get("content-type", "application/gzip").split(";")[0].strip()
    if kind not in ARCHIVE_TYPES:
        raise InvalidArgument(f"the body must be a tar.gz of the function's folder, not {kind}")
    with tempfile.TemporaryDirectory(prefix="fngate-deploy-") as scratch:
        archive = Path(scratch) / "upload.tar.gz"
        await _receive(request, archive, owner.max_bytes)
        folder = Path(scratch) / "function"
        await asyncio.to_thread(_unpack, archive, folder)
        manifest = folder / MANIFEST_FILE
        if not manifest.is_file():
            raise InvalidArgument(f"the archive has no {MANIFEST_FILE} at its root")
        version, record = await deployment.publish(
            manifest, owner.repository(), services(request).redis, name
        )
    log.info("deployed %s version %s (key %s)", name, version.version, _key_id(request))
    return json_response({**deployment.describe(record), "deployed": version.version}, 201)


async def get_function(request: Request) -> Response:
    name = check_name(request.path_params["name"])
    record = await asyncio.to_thread(deployer(request).repository().get, name)
    return json_response(deployment.describe(record))


async def delete_function(request: Request) -> Response:
    """Remove every version; invocations still queued are answered not_found."""
    name = check_name(request.path_params["name"])
    repository = deployer(request).repository()
    record = await asyncio.to_thread(repository.get, name)
    answered = await deployment.withdraw(repository, record, services(request).redis, REMOVE_GRACE_S)
    log.info("removed %s (key %s)", name, _key_id(request))
    return json_response({"removed": name, "versions": list(record.versions), "answered": answered})


async def put_traffic(request: Request) -> Response:
    """Route unpinned invocations to stored versions by weight, make before break (as `fngate
    traffic` does directly); answers what GET answers, and how the loads went."""
    name = check_name(request.path_params["name"])
    body = load_json(await request.body(), empty={})
    traffic = body.get("traffic") if isinstance(body, dict) else None
    if not isinstance(traffic, dict) or not all(isinstance(weight, int) for weight in traffic.values()):
        raise InvalidArgument('the body must be {"traffic": {"<version>": <weight>, ...}}')
    weights = {str(version): weight for version, weight in traffic.items()}
    record, note = await deployment.route(
        deployer(request).repository(), services(request).redis, name, weights
    )
    log.info("routed %s: %s (key %s)", name, record.traffic, _key_id(request))
    return json_response({**deployment.describe(record), "note": note})


async def _receive(request: Request, target: Path, limit: int) -> None:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the archive of {declared} bytes is over the limit of {limit} bytes")
    size = 0
    with target.open("wb") as sink:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"the archive is over the limit of {limit} bytes")
            sink.write(chunk)
    if size == 0:
        raise InvalidArgument("the body is empty: send a tar.gz of the function's folder")


def _unpack(archive: Path, folder: Path) -> None:
    """Regular files and folders only, inside `folder` (tarfile's data filter refuses the rest)."""
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar.getmembers():
                if not (member.isfile() or member.isdir()):
                    raise InvalidArgument(f"the archive holds {member.name!r}, which is not a file or folder")
            tar.extractall(folder, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise InvalidArgument(f"the body is not a readable tar.gz: {exc}") from None


def _key_id(request: Request) -> str:
    principal = request.scope.get(PRINCIPAL)
    return getattr(principal, "key_id", "") or "-"


ROUTES: list[Route] = [
    Route("/v1/functions/{name}", put_function, methods=["PUT"]),
    Route("/v1/functions/{name}", get_function, methods=["GET"]),
    Route("/v1/functions/{name}", delete_function, methods=["DELETE"]),
    Route("/v1/functions/{name}/traffic", put_traffic, methods=["PUT"]),
]
