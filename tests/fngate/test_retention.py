"""What a repository keeps: which versions a deploy removes, a policy that serves more than is kept,
pipelines' pins, and the storage limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fngate.manifest import FunctionManifest, parse_manifest
from fngate.repository import ArtifactFile, FunctionVersion, make_record
from fngate.retention import count_problems, kept, pinned, prunable, size_of, storage_problem

FILE = ArtifactFile("model.py", "0" * 64, 100)


def manifest(name: str = "scale", **versions: Any) -> FunctionManifest:
    return parse_manifest(
        {
            "name": name,
            "model": {"backend": "python", "path": "model.py"},
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
            "versions": versions,
        },
        name,
    )


def stored(count: int, **versions: Any) -> list[FunctionVersion]:
    """Versions 1..count of function scale, the newest with this version policy."""
    return [
        FunctionVersion(manifest(**(versions if number == count else {})), str(number), Path(), files=(FILE,))
        for number in range(1, count + 1)
    ]


@pytest.mark.parametrize(
    ("count", "policy", "keep", "held", "removed"),
    [
        (3, {}, 3, set(), ()),
        (5, {}, 3, set(), ("1", "2")),
        (5, {}, 3, {"1"}, ("2", "3")),  # a held version stays; the next oldest goes in its place
        (5, {}, 3, {"4"}, ("1", "2")),
        (5, {}, 1, {"1", "2", "3", "4"}, ()),  # everything named: nothing goes
        (5, {"policy": "latest", "latest": 3}, 3, set(), ("1", "2")),
        (5, {"policy": "specific", "specific": ["1", "5"]}, 2, set(), ("2", "3", "4")),
        (5, {"policy": "all"}, 3, set(), ()),  # served (deploy refuses such a policy past `keep`)
        (12, {}, 10, set(), ("1", "2")),
    ],
)
def test_a_deploy_removes_the_oldest_versions_nothing_serves_or_names(
    count: int, policy: dict[str, Any], keep: int, held: set[str], removed: tuple[str, ...]
) -> None:
    assert prunable(make_record(stored(count, **policy)), keep, held) == removed


def test_versions_that_fngate_did_not_deploy_are_never_removed() -> None:
    unversioned = [FunctionVersion(manifest(), str(number), Path()) for number in (1, 2, 3)]
    assert prunable(make_record(unversioned), 1, set()) == ()


@pytest.mark.parametrize(("max_stored", "max_versions", "keep"), [(None, 10, 10), (3, 10, 3), (30, 10, 10)])
def test_a_manifest_keeps_fewer_versions_never_more(
    max_stored: int | None, max_versions: int, keep: int
) -> None:
    versions = {"max_stored": max_stored} if max_stored is not None else {}
    assert kept(manifest(**versions), max_versions) == keep


def test_a_policy_that_serves_more_versions_than_are_kept_is_a_problem() -> None:
    assert count_problems(make_record(stored(4, policy="latest", latest=3)), 3) == []
    assert count_problems(make_record(stored(4, policy="all")), 3) == [
        "versions: the policy serves 4 versions, and a function keeps 3 (versions.max_stored, at most "
        "the deployment's max_versions): serve fewer"
    ]


def test_versions_pinned_by_served_pipeline_steps() -> None:
    def pipeline(number: str, *functions: str) -> FunctionVersion:
        steps = [  # a chain: each step takes the one before
            {
                "name": f"s{index}",
                "function": function,
                "inputs": {"x": f"s{index - 1}.y" if index else "request.x"},
            }
            for index, function in enumerate(functions)
        ]
        doc = {
            "name": "flow",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
            "pipeline": {"steps": steps, "outputs": {"y": f"s{len(steps) - 1}.y"}},
        }
        return FunctionVersion(parse_manifest(doc, "flow"), number, Path())

    records = {
        "scale": make_record(stored(3)),
        "flow": make_record([pipeline("1", "scale@1"), pipeline("2", "scale@2", "scale", "other@3")]),
    }
    assert pinned(records, "scale") == {"2"}  # flow version 1 is no longer served
    assert pinned(records, "other") == {"3"}
    assert pinned(records, "flow") == frozenset()


@pytest.mark.parametrize(
    ("stored_bytes", "adding", "freeing", "limit", "refused"),
    [
        (900, 100, 0, 1000, False),
        (901, 100, 0, 1000, True),
        (901, 100, 1, 1000, False),  # what the deploy removes makes room
        (10**12, 10**9, 0, 0, False),  # 0: no limit
    ],
)
def test_the_storage_limit(stored_bytes: int, adding: int, freeing: int, limit: int, refused: bool) -> None:
    problem = storage_problem(stored_bytes, adding, freeing, limit)
    assert bool(problem) is refused
    if refused:
        assert "max_repository_bytes" in problem and "fngate rm" in problem
        assert problem.endswith("nothing was uploaded")


def test_a_version_counts_its_files() -> None:
    assert size_of(stored(3)) == 300
