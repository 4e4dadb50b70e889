"""An S3 repository: the layout of fngate/repository.py under s3://bucket/prefix/, and the one place
where boto3's exceptions become fngate's. boto3 is imported when an S3 repository is opened, so
gateways, the CLI and runners of folder repositories never pay for it."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import itertools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

from fngate.errors import FunctionNotFound, Unavailable
from fngate.manifest import MANIFEST_FILE, FunctionManifest, ManifestError
from fngate.repository import (
    CHUNK,
    ROUTING_FILE,
    VERSION,
    ArtifactFile,
    FunctionRecord,
    FunctionVersion,
    Progress,
    Routing,
    check_name,
    decode_version,
    digest_of,
    encode_version,
    make_record,
    next_version,
    now_iso,
)

log = logging.getLogger(__name__)

MISSING = {"NoSuchKey", "404", "NotFound"}
CLAIM_ATTEMPTS = 20
PART_BYTES = 8 * 1024 * 1024
"""Up to this size a file is read with one GET; a larger one in ranged GETs of this size when it
goes to disk (memory stays bounded), of a READ_THREADS-th of the file when it is read into memory."""
MAX_PART_BYTES = 64 * 1024 * 1024
READ_THREADS = 8
"""Ranged GETs in flight for one file (botocore's connection pool holds 10)."""


@contextlib.contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """boto3's exceptions become Unavailable (FunctionNotFound for a missing object), once, here."""
    from botocore.exceptions import BotoCoreError, ClientError  # type: ignore[import-untyped]

    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        if code in MISSING:
            raise FunctionNotFound(f"{what} is missing from the repository") from exc
        if code in {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"}:
            raise Unavailable(f"{what}: access denied by S3 ({code})") from exc
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
            raise Unavailable(f"{what}: S3 is unavailable ({code})") from exc
        raise Unavailable(f"{what}: S3 answered {code}: {error.get('Message', exc)}") from exc
    except BotoCoreError as exc:
        raise Unavailable(f"{what}: the repository is unreachable: {exc}") from exc


class S3Repository:
    """The repository layout of fngate/repository.py under s3://bucket/prefix/. Endpoint, region and
    credentials come from the standard AWS settings (AWS_ENDPOINT_URL_S3 included)."""

    _warm: Any = None

    @staticmethod
    def warm_up() -> None:
        """Import boto3 and load its S3 service model into boto3's default session (about half a
        second): a runner started ahead of need does it while it waits, so that opening the
        repository for its pool then costs a client, not the imports. The client made for it is
        kept: botocore caches the S3 endpoint rules only as long as a client uses them, and
        building them again took 0.1 to 0.15 s of a standby runner's cold start."""
        import boto3  # type: ignore[import-untyped]

        S3Repository._warm = boto3.client("s3")

    def __init__(self, url: str, part_bytes: int = PART_BYTES) -> None:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not url.startswith("s3://") or not bucket:
            raise ValueError(f"{url!r} is not an S3 URL (s3://bucket/prefix)")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.part_bytes = part_bytes
        # Imported here: a runner of a folder repository does not pay for boto3 at its cold start.
        import boto3
        from botocore.config import Config  # type: ignore[import-untyped]

        config = Config(retries={"mode": "standard", "max_attempts": 3}, connect_timeout=5, read_timeout=60)
        self.client: Any = boto3.client("s3", config=config)
        self.unreadable: dict[str, str] = {}
        """As of the last scan: by function, why one of its versions' indexes could not be read."""

    def scan(self) -> dict[str, FunctionRecord]:
        records = {}
        self.unreadable = {}
        for name in self._children(self._key("")):
            if VERSION.match(name) is None:
                with contextlib.suppress(FunctionNotFound):
                    record = self._read(check_name(name))
                    if record is not None:
                        records[name] = record
        return records

    def get(self, name: str) -> FunctionRecord:
        record = self._read(check_name(name))
        if record is None:
            raise FunctionNotFound(f"function {name!r} is not in {self.url}")
        return record

    def next_version(self, name: str) -> str:
        taken = self._children(self._key(check_name(name), ""))
        return str(next_version(item.removesuffix(".json") for item in taken))

    def add_version(
        self, manifest: FunctionManifest, files: Sequence[tuple[ArtifactFile, Path]], progress: Progress
    ) -> FunctionVersion:
        name = check_name(manifest.name)
        claim = next(((item, path) for item, path in files if item.path == MANIFEST_FILE), None)
        if claim is None:
            raise ValueError(f"a version's files must include its {MANIFEST_FILE}")
        number = self._claim(name, claim[1].read_bytes())
        progress(claim[0].size)
        for item, source in files:
            if item is not claim[0]:
                self._upload(source, self._key(name, str(number), item.path), item, progress)
        entries = tuple(item for item, _ in files)
        version = FunctionVersion(manifest, str(number), Path(), digest_of(entries), entries)
        index = orjson.dumps({**encode_version(version), "at": now_iso()})
        with s3_errors(self._url(name, f"{number}.json")):
            self.client.put_object(Bucket=self.bucket, Key=self._key(name, f"{number}.json"), Body=index)
        self.set_routing(name, None)  # the new version's policy rules
        return version

    def set_routing(self, name: str, routing: Routing | None) -> None:
        key = self._key(check_name(name), ROUTING_FILE)
        with s3_errors(self._url(name, ROUTING_FILE)):
            if routing is None:
                self.client.delete_object(Bucket=self.bucket, Key=key)
            else:
                body = orjson.dumps({**routing.encode(), "at": now_iso()})
                self.client.put_object(Bucket=self.bucket, Key=key, Body=body)

    def remove(self, name: str) -> None:
        home = self._key(check_name(name), "")
        with s3_errors(self._url(name)):
            keys = [item["Key"] for page in self._pages(home, None) for item in page.get("Contents", ())]
            if not keys:
                raise FunctionNotFound(f"function {name!r} is not in {self.url}")
            # Indexes first: a scan in between sees fewer versions, never a version without files.
            keys.sort(key=lambda key: not key.endswith(".json"))
            for start in range(0, len(keys), 1000):
                batch = [{"Key": key} for key in keys[start : start + 1000]]
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def remove_versions(self, name: str, versions: Sequence[str]) -> None:
        for number in versions:
            if VERSION.match(number) is None:
                continue
            folder = self._key(check_name(name), number, "")
            with s3_errors(self._url(name, number)):
                keys = [
                    item["Key"] for page in self._pages(folder, None) for item in page.get("Contents", ())
                ]
                self.client.delete_object(Bucket=self.bucket, Key=self._key(name, f"{number}.json"))
                for start in range(0, len(keys), 1000):
                    batch = [{"Key": key} for key in keys[start : start + 1000]]
                    self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def stored_bytes(self) -> int:
        with s3_errors(self._url()):
            return sum(
                item["Size"] for page in self._pages(self._key(""), None) for item in page.get("Contents", ())
            )

    def fetch(self, function: FunctionVersion, item: ArtifactFile, target: Path) -> str:
        """Write the file to `target`; returns the sha256 of what was written, computed as the bytes
        arrive (one pass: nothing reads the file again to check it)."""
        digest = hashlib.sha256()
        with target.open("wb") as sink:
            for part in self._parts(function, item, self.part_bytes):
                digest.update(part)
                sink.write(part)
        return digest.hexdigest()

    def read(self, function: FunctionVersion, item: ArtifactFile) -> tuple[bytes, str]:
        """The file's bytes, in memory, and their sha256 computed as they arrive. The whole file is
        held anyway, so it comes in READ_THREADS ranged GETs, all in flight at once (up to
        MAX_PART_BYTES each): as many connections as parts of PART_BYTES would use, a fraction of
        the requests (each costs S3 a first-byte latency and a request charge)."""
        digest = hashlib.sha256()
        parts = []
        part_bytes = max(self.part_bytes, min(-(-item.size // READ_THREADS), MAX_PART_BYTES))
        for part in self._parts(function, item, part_bytes):
            digest.update(part)  # hashlib releases the GIL: the GETs go on meanwhile
            parts.append(part)
        return b"".join(parts), digest.hexdigest()

    def _parts(self, function: FunctionVersion, item: ArtifactFile, part_bytes: int) -> Iterator[bytes]:
        """The file's bytes in order: one GET for a file of up to `part_bytes`, ranged GETs of
        `part_bytes` in parallel (a window of 2 * READ_THREADS parts ahead of the reader, so memory
        stays bounded) for a larger one."""
        key = self._key(function.name, function.version, item.path)
        with s3_errors(self._url(function.name, function.version, item.path)):
            if item.size <= part_bytes:
                yield from self.client.get_object(Bucket=self.bucket, Key=key)["Body"].iter_chunks(CHUNK)
                return

            def get(start: int) -> bytes:
                last = min(start + part_bytes, item.size) - 1
                response = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{last}")
                data: bytes = response["Body"].read()
                return data

            starts = iter(range(0, item.size, part_bytes))
            pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS, thread_name_prefix="s3-read")
            try:
                ahead = itertools.islice(starts, 2 * READ_THREADS)
                window = collections.deque(pool.submit(get, start) for start in ahead)
                while window:
                    part = window.popleft().result()
                    following = next(starts, None)
                    if following is not None:
                        window.append(pool.submit(get, following))
                    yield part
            finally:
                pool.shutdown(wait=False, cancel_futures=True)

    def _read(self, name: str) -> FunctionRecord | None:
        versions = []
        home = self._key(name, "")
        with s3_errors(self._url(name)):
            indexes = [item["Key"] for page in self._pages(home, "/") for item in page.get("Contents", ())]
        routing = None
        for key in indexes:
            stem = key.removeprefix(home).removesuffix(".json")
            if key == home + ROUTING_FILE:
                routing = self._routing(key)
                continue
            if not key.endswith(".json") or VERSION.match(stem) is None:
                continue
            with s3_errors(f"s3://{self.bucket}/{key}"):
                body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
            try:
                version = decode_version(orjson.loads(body), Path(), f"s3://{self.bucket}/{key}")
            except Exception as exc:  # any error: this version's alone, whatever it is
                problem = (
                    str(exc)
                    if isinstance(exc, ManifestError | ValueError)
                    else f"{type(exc).__name__}: {exc}"
                )
                log.warning("skipping %s: %s", key, problem)
                self.unreadable[name] = problem
                continue
            if version.name == name and version.version == stem:
                versions.append(version)
        return make_record(versions, routing) if versions else None

    def _routing(self, key: str) -> Routing | None:
        with s3_errors(f"s3://{self.bucket}/{key}"):
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        try:
            return Routing.decode(orjson.loads(body), f"s3://{self.bucket}/{key}")
        except ValueError as exc:
            log.warning("ignoring %s: %s", key, exc)
            return None

    def _claim(self, name: str, manifest: bytes) -> int:
        """The next version number, claimed by writing its manifest only if it does not exist yet."""
        number = int(self.next_version(name))
        for _ in range(CLAIM_ATTEMPTS):
            key = self._key(name, str(number), MANIFEST_FILE)
            try:
                with s3_errors(self._url(name, str(number))):
                    self.client.put_object(Bucket=self.bucket, Key=key, Body=manifest, IfNoneMatch="*")
                return number
            except Unavailable as exc:
                cause: Any = exc.__cause__
                code = getattr(cause, "response", {}).get("Error", {}).get("Code")
                if code not in {"PreconditionFailed", "412"}:  # not someone else's claim of it
                    raise
            number += 1
        raise Unavailable(f"{self._url(name)}: could not claim a version number; retry")

    def _upload(self, source: Path, key: str, item: ArtifactFile, progress: Progress) -> None:
        extra = {"Metadata": {"sha256": item.sha256}, "ChecksumAlgorithm": "SHA256"}
        with s3_errors(f"s3://{self.bucket}/{key}"):
            self.client.upload_file(str(source), self.bucket, key, ExtraArgs=extra, Callback=progress)

    def _children(self, prefix: str) -> list[str]:
        """Names one level below `prefix`: folders without their '/', objects as they are."""
        names = []
        with s3_errors(self._url()):
            for page in self._pages(prefix, "/"):
                names += [
                    item["Prefix"][len(prefix) :].rstrip("/") for item in page.get("CommonPrefixes", ())
                ]
                names += [item["Key"][len(prefix) :] for item in page.get("Contents", ())]
        return names

    def _pages(self, prefix: str, delimiter: str | None) -> Iterator[dict[str, Any]]:
        arguments = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            arguments["Delimiter"] = delimiter
        yield from self.client.get_paginator("list_objects_v2").paginate(**arguments)

    def _key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts] if self.prefix else parts)

    def _url(self, *parts: str) -> str:
        return "/".join([self.url, *parts])
