"""A bounded repository, in a folder and in S3 (moto's server): a deploy removes the oldest
versions past max_versions, through the CLI and through the deploy API, while the kept ones answer
and a removed one is as unknown as one never deployed; a deploy past max_repository_bytes is refused
and uploads nothing."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.deployments import ROW, cli, invoke, runner_env, scale_function
from tests.s3 import Bucket


@dataclasses.dataclass
class Target:
    """A repository of either kind, and what is stored in it."""

    repo: str
    bucket: Bucket | None

    def listing(self) -> dict[str, int]:
        """Every file or object by its path in the repository, with its size."""
        if self.bucket is None:
            root = Path(self.repo)
            return {
                str(path.relative_to(root)): path.stat().st_size for path in root.rglob("*") if path.is_file()
            }
        pages = self.bucket.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket.name)
        return {
            item["Key"].removeprefix("prod/"): item["Size"]
            for page in pages
            for item in page.get("Contents", ())
        }

    def versions(self, name: str) -> set[str]:
        """The version folders (and indexes) of a function: '1' for 1/..., '1.json' for its index."""
        return {path.split("/")[1] for path in self.listing() if path.startswith(f"{name}/")}


@pytest.fixture(params=["folder", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "s3":
        bucket: Bucket = request.getfixturevalue("s3")
        return Target(bucket.repo, bucket)
    (tmp_path / "repo").mkdir()
    return Target(str(tmp_path / "repo"), None)


async def test_a_deploy_prunes_the_oldest_versions_past_max_versions(
    target: Target,
    redis_url: str,
    serve_gateway: Callable[..., Any],
    runner_process: Callable[..., Any],
    tmp_path: Path,
) -> None:
    base = await serve_gateway(repo=target.repo, catalog_refresh_s=0.2, max_versions=3)
    runner_process(
        **runner_env(target.repo, tmp_path / "artifacts", target.bucket.env if target.bucket else None)
    )
    flags = ("--repo", target.repo, "--redis", redis_url)
    factors = {str(number): float(number + 1) for number in range(1, 6)}
    for number in range(1, 5):  # versions 1 to 4 with the CLI, to the repository itself
        manifest = scale_function(tmp_path / f"v{number}", "scale", factors[str(number)])
        deployed = await cli("deploy", str(manifest), *flags, env={"FNGATE_MAX_VERSIONS": "3"})
        assert deployed.returncode == 0, deployed.stderr
        assert ("pruned scale" in deployed.stdout) is (number == 4), deployed.stdout
    assert "pruned scale version 1 from the repository (a function keeps 3 versions" in deployed.stdout
    # Version 5 through the deploy API, whose gateway keeps 3 versions too.
    manifest = scale_function(tmp_path / "v5", "scale", factors["5"])
    deployed = await cli("deploy", str(manifest), "--gateway", base, env={"FNGATE_API_KEY": "-"})
    assert deployed.returncode == 0, deployed.stderr
    assert "deployed scale version 5 through" in deployed.stdout
    assert "pruned scale version 2 from the repository" in deployed.stdout

    assert target.versions("scale") == {"3", "3.json", "4", "4.json", "5", "5.json"}
    listed = await cli("ls", *flags)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split()[:3] for line in listed.stdout.split("\n\n")[0].splitlines()[1:]]
    assert rows == [["scale", "3", "no"], ["scale", "4", "no"], ["scale", "5", "yes"]]

    async with httpx.AsyncClient(base_url=base, timeout=30) as client:
        described = (await client.get("/v1/functions/scale")).json()
        assert [item["version"] for item in described["versions"]] == ["3", "4", "5"]
        # The kept versions are whole: served again, each answers with its own files.
        split = await client.put("/v1/functions/scale/traffic", json={"traffic": {"3": 34, "4": 33, "5": 33}})
        assert split.status_code == 200, split.text
        for version in ("3", "4", "5"):
            pinned = await invoke(client, f"/v2/models/scale/versions/{version}/infer")
            assert pinned.status_code == 200, pinned.text
            assert pinned.json()["outputs"][0]["data"] == [value * factors[version] for value in ROW]
        # A removed version is as unknown as one never deployed.
        removed = await invoke(client, "/v2/models/scale/versions/1/infer", wait_s=0)
        unknown = await invoke(client, "/v2/models/scale/versions/9/infer", wait_s=0)
        assert removed.status_code == unknown.status_code == 404
        assert removed.json()["error"] == unknown.json()["error"].replace("'9'", "'1'")
        routed = await client.put("/v1/functions/scale/traffic", json={"traffic": {"1": 100}})
        assert routed.status_code == 400 and "no stored versions ['1']" in routed.text


async def test_a_deploy_past_max_repository_bytes_is_refused_and_uploads_nothing(
    target: Target, redis_url: str, serve_gateway: Callable[..., Any], tmp_path: Path
) -> None:
    flags = ("--repo", target.repo, "--redis", redis_url)
    first = await cli("deploy", str(scale_function(tmp_path / "v1", "scale", 2.0)), *flags)
    assert first.returncode == 0, first.stderr
    before = target.listing()
    limit = sum(before.values()) + 100  # room for a little, not for a second version's files
    if target.bucket is not None:
        target.bucket.server.requests.clear()
    manifest = scale_function(tmp_path / "v2", "scale", 3.0)

    refused = await cli("deploy", str(manifest), *flags, env={"FNGATE_MAX_REPOSITORY_BYTES": str(limit)})
    assert refused.returncode == 2, refused.stderr  # the caller's to settle
    assert f"over its limit of {limit} bytes (max_repository_bytes;" in refused.stderr
    assert "free space with `fngate rm`" in refused.stderr and "nothing was uploaded" in refused.stderr
    assert "uploading" not in refused.stdout

    base = await serve_gateway(repo=target.repo, max_repository_bytes=limit)
    through = await cli("deploy", str(manifest), "--gateway", base, env={"FNGATE_API_KEY": "-"})
    assert through.returncode == 1, through.stderr
    assert "the gateway answered 413: the repository would hold" in through.stderr
    assert "max_repository_bytes" in through.stderr and "nothing was uploaded" in through.stderr

    assert target.listing() == before
    if target.bucket is not None:
        writes = [(method, path) for method, path in target.bucket.server.requests if method != "GET"]
        assert writes == []
    # The space freed as the message says, the deploy fits.
    removed = await cli("rm", "scale", *flags, "--grace-s", "0", "--yes")
    assert removed.returncode == 0, removed.stderr
    again = await cli("deploy", str(manifest), *flags, env={"FNGATE_MAX_REPOSITORY_BYTES": str(limit)})
    assert again.returncode == 0, again.stderr
