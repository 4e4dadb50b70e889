"""The deploy API: PUT, GET and DELETE /v1/functions/{name}, and PUT /v1/functions/{name}/traffic,
so that deployers need an API key with the `deploy` scope and neither S3 nor Redis credentials. The
body of a PUT is a gzipped tar of the function's folder, `function.yaml` at its root; it is streamed
to disk, bounded by max_deploy_bytes, and unpacked into a scratch folder (removed whatever happens)
bounded by max_unpacked_bytes and max_unpack_ratio times its size; what the repository keeps is
bounded by max_versions and max_repository_bytes (fngate/retention.py). A traffic PUT is
`{"traffic": {"3": 90, "4": 10}}`."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tarfile
import tempfile
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fngate import deployment
from fngate.config import GatewaySettings, RepositoryLimits
from fngate.errors import FunctionNotFound, InvalidArgument, PayloadTooLarge
from fngate.manifest import MANIFEST_FILE
from fngate.repository import Repository, check_name
from gateway.auth import DEPLOY
from gateway.http.bodies import control_json
from gateway.http.guard import Guarded, principal_of
from gateway.http.rendering import json_response
from gateway.state import services

log = logging.getLogger(__name__)

ARCHIVE_TYPES = ("application/gzip", "application/x-gzip", "application/x-tar", "application/octet-stream")
MAX_MEMBERS = 10_000
REMOVE_GRACE_S = 1.0


class Deployer:
    """The repository the gateway serves from, opened on first use (an S3 one creates a client)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.url = settings.repo
        self.max_bytes = settings.max_deploy_bytes
        self.max_unpacked_bytes = settings.max_unpacked_bytes
        self.max_unpack_ratio = settings.max_unpack_ratio
        self.limits: RepositoryLimits = settings
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
    it, plus the new version's number and the old versions removed to make room (201)."""
    try:
        name = check_name(request.path_params["name"])
    except FunctionNotFound as exc:  # a name nothing can be stored under: the request is wrong
        raise InvalidArgument(exc.message) from None
    owner = deployer(request)
    kind = request.headers.get("content-type", "application/gzip").split(";")[0].strip()
    if kind not in ARCHIVE_TYPES:
        raise InvalidArgument(f"the body must be a tar.gz of the function's folder, not {kind}")
    with tempfile.TemporaryDirectory(prefix="fngate-deploy-") as scratch:
        archive = Path(scratch) / "upload.tar.gz"
        size = await _receive(request, archive, owner.max_bytes)
        folder = Path(scratch) / "function"
        limit = unpacked_limit(owner.max_unpacked_bytes, owner.max_unpack_ratio, size)
        await asyncio.to_thread(_unpack, archive, folder, limit)
        manifest = folder / MANIFEST_FILE
        if not manifest.is_file():
            raise InvalidArgument(f"the archive has no {MANIFEST_FILE} at its root")
        version, record, removed = await deployment.publish(
            manifest, owner.repository(), services(request).redis, owner.limits, name
        )
    log.info("deployed %s version %s (key %s)", name, version.version, _key_id(request))
    if removed:
        log.info("removed %s versions %s past what it keeps", name, ", ".join(removed))
    answer = {**deployment.describe(record), "deployed": version.version, "pruned": list(removed)}
    return json_response(answer, 201)


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
    body = await control_json(request, services(request).settings.body_timeout_s)
    traffic = body.get("traffic") if isinstance(body, dict) else None
    if not isinstance(traffic, dict) or not all(isinstance(weight, int) for weight in traffic.values()):
        raise InvalidArgument('the body must be {"traffic": {"<version>": <weight>, ...}}')
    weights = {str(version): weight for version, weight in traffic.items()}
    record, note = await deployment.route(
        deployer(request).repository(), services(request).redis, name, weights
    )
    log.info("routed %s: %s (key %s)", name, record.traffic, _key_id(request))
    return json_response({**deployment.describe(record), "note": note})


async def _receive(request: Request, target: Path, limit: int) -> int:
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
    return size


def _unpack(archive: Path, folder: Path, limit_bytes: int) -> None:
    """Regular files and folders only, each inside `folder`, at most MAX_MEMBERS of them and
    `limit_bytes` in all: each member's size is in its header, checked before its bytes are read, so
    that a small archive of zeros is refused at once. Each is written here (mode 644 or 755, owned
    by the gateway), not by tarfile's extract: its `filter` argument is missing from the Python
    3.11.2 of Debian 12, the images' Python."""
    total = 0
    try:
        with tarfile.open(archive, "r:*") as tar:
            for count, member in enumerate(tar, start=1):
                if not (member.isfile() or member.isdir()):
                    raise InvalidArgument(
                        f"the archive holds {member.name[:128]!r}, which is not a file or folder"
                    )
                total += member.size
                if total > limit_bytes:
                    raise PayloadTooLarge(f"the archive unpacks to more than {limit_bytes} bytes")
                if count > MAX_MEMBERS:
                    raise InvalidArgument(f"the archive holds more than {MAX_MEMBERS} files and folders")
                _write(tar, member, folder)
    except (tarfile.TarError, OSError) as exc:
        raise InvalidArgument(f"the body is not a readable tar.gz: {exc}") from None


def _write(tar: tarfile.TarFile, member: tarfile.TarInfo, folder: Path) -> None:
    parts = Path(member.name).parts
    if not parts and member.isdir():  # the folder itself ('.')
        return
    target = folder.joinpath(*parts)
    if not parts or Path(member.name).is_absolute() or ".." in parts:
        raise InvalidArgument(f"the archive holds {member.name[:128]!r}, which is outside its folder")
    if member.isdir():
        target.mkdir(mode=0o755, parents=True, exist_ok=True)
        return
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    source = tar.extractfile(member)
    assert source is not None  # a regular file's
    with source, target.open("wb") as sink:
        shutil.copyfileobj(source, sink)
    target.chmod(0o755 if member.mode & 0o100 else 0o644)


def unpacked_limit(settings_max: int, ratio: float, archive_bytes: int) -> int:
    """The most an archive of `archive_bytes` may unpack to: `ratio` times its size, and never more
    than `settings_max`."""
    return min(settings_max, int(ratio * archive_bytes))


def _key_id(request: Request) -> str:
    return principal_of(request.scope).key_id or "-"


ROUTES: list[Route] = [
    Guarded("/v1/functions/{name}", put_function, DEPLOY, methods=["PUT"]),
    Guarded("/v1/functions/{name}", get_function, DEPLOY, methods=["GET"]),  # HEAD too
    Guarded("/v1/functions/{name}", delete_function, DEPLOY, methods=["DELETE"]),
    Guarded("/v1/functions/{name}/traffic", put_traffic, DEPLOY, methods=["PUT"]),
]
