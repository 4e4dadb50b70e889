"""The lock (requirements/, made by scripts/lock): made from pyproject.toml as it is now, every set
pinned with hashes, one version of each package across the sets, and the one source of what
scripts/bootstrap and the Dockerfile install."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import tomllib
from types import ModuleType

import pytest
from deploy_files import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = ROOT / "requirements"
PIN = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)(?: ; [^\\\n]+)? \\$"
    r"((?:\n    --hash=sha256:[0-9a-f]{64}(?: \\)?)+)",
    re.MULTILINE,
)
"""An entry: `name==version [; marker] \\` and one or more hash lines."""


def lock_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("lock", str(ROOT / "scripts" / "lock"))
    spec = importlib.util.spec_from_loader("lock", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def pins(name: str) -> dict[str, str]:
    text = (LOCK / f"{name}.txt").read_text(encoding="utf-8")
    found = {canonicalize_name(match.group(1)): match.group(2) for match in PIN.finditer(text)}
    entries = [line for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    assert len(found) == len(entries), f"{name}.txt: an entry without a pin or a hash"
    return found


def test_every_set_was_made_from_pyproject_as_it_is() -> None:
    lock = lock_script()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    digest = lock.dependency_digest(pyproject)
    for name in [*lock.TARGETS, "build", *lock.TOOLS]:
        header = (LOCK / f"{name}.txt").read_text(encoding="utf-8").split("\n", 3)[:3]
        assert f"pyproject.toml sha256: {digest}" in header[2], (
            f"requirements/{name}.txt is older than pyproject.toml's dependencies: run scripts/lock"
        )


@pytest.mark.parametrize("target", ["gateway", "runner", "gpu", "dev"])
def test_each_set_pins_what_pyproject_asks_for(target: str) -> None:
    lock = lock_script()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    locked = pins(target)
    requirements = [*project["dependencies"]]
    pending = list(lock.TARGETS[target])
    while pending:
        for item in project["optional-dependencies"][pending.pop()]:
            requirement = Requirement(item)
            if canonicalize_name(requirement.name) == "fngate":
                pending += sorted(requirement.extras)
            else:
                requirements.append(item)
    for item in requirements:
        requirement = Requirement(item)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        version = locked.get(canonicalize_name(requirement.name))
        assert version is not None, f"{target}: {requirement.name} is not locked"
        assert requirement.specifier.contains(version, prereleases=True), (target, item, version)


def test_one_version_of_each_package_across_the_sets() -> None:
    versions: dict[str, set[str]] = {}
    for name in ("gateway", "runner", "gpu", "dev", "build"):
        for package, version in pins(name).items():
            versions.setdefault(package, set()).add(version)
    assert {package: found for package, found in versions.items() if len(found) > 1} == {}
    # The gateway's set is the base of the runners': what it holds, they hold.
    assert pins("gateway").items() <= pins("runner").items()
    assert pins("gateway").items() <= pins("gpu").items()
    assert "onnxruntime" not in pins("gateway")  # the gateway never imports it
    for tool, pin in lock_script().TOOLS.items():
        assert pins(tool)[tool] == pin.split("==")[1]


def test_bootstrap_and_the_dockerfile_install_from_the_lock() -> None:
    bootstrap = (ROOT / "scripts" / "bootstrap").read_text(encoding="utf-8")
    assert "--require-hashes --no-deps" in bootstrap
    for name in ("dev", "runner", "build", "checkov", "kserve"):
        assert f"requirements/{name}.txt" in bootstrap, name
    assert "pip install -q -e" not in bootstrap and "--upgrade pip" not in bootstrap
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    for name in ("gateway", "runner", "gpu", "build"):
        assert f"COPY requirements/{name}.txt " in dockerfile, name
    assert "optional-dependencies" not in dockerfile  # nothing read from pyproject.toml unpinned


def test_the_lock_names_no_local_path() -> None:
    # No path of the machine that made it (an editable or local requirement).
    for path in LOCK.glob("*.txt"):
        text = path.read_text(encoding="utf-8")
        assert "file://" not in text and " @ " not in text, path.name
