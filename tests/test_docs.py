"""The docs site (mkdocs.yml, docs/) and the README: the site builds with every internal link and
anchor resolved, and the reference pages name what the code has (every command and flag, manifest
key, route, RPC, setting and metric family), so that neither can drift from the other."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
MKDOCS = ROOT / ".venv" / "docs" / "bin" / "mkdocs"
BUILD_TIMEOUT_S = 120


def read(relative: str) -> str:
    return (ROOT / relative).read_text(encoding="utf-8")


def build(config_dir: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the site whose mkdocs.yml is in `config_dir` (the folder it runs
    in: CONTRIBUTING.md is included from there)."""
    if not MKDOCS.exists():
        pytest.skip("MkDocs is not installed in .venv/docs: run scripts/bootstrap")
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env["NO_MKDOCS_2_WARNING"] = "1"  # Material's notice of its successor, on every build
    return subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(site)],
        cwd=config_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )


def test_the_site_builds_with_every_link_and_anchor_resolved(tmp_path: Path) -> None:
    done = build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").exists()
    # CONTRIBUTING.md is the site's Contributing page, included whole.
    assert "House rules" in (tmp_path / "site" / "contributing" / "index.html").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "broken",
    ["[a](first-calls.md#no-such-heading)", "[a](#no-such-heading)", "[a](no-such-page.md)"],
)
def test_a_broken_link_or_anchor_fails_the_build(tmp_path: Path, broken: str) -> None:
    """The check above is only as good as mkdocs.yml's validation settings: keep them failing."""
    copy = tmp_path / "copy"
    shutil.copytree(DOCS, copy / "docs")
    for name in ("mkdocs.yml", "CONTRIBUTING.md"):
        shutil.copy(ROOT / name, copy / name)
    page = copy / "docs" / "start" / "install.md"
    page.write_text(page.read_text(encoding="utf-8") + f"\n{broken}\n", encoding="utf-8")
    done = build(copy, tmp_path / "site")
    assert done.returncode != 0
    assert "start/install.md" in done.stdout + done.stderr


def cli_reference() -> ModuleType:
    path = ROOT / "scripts" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("cli_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_line_reference_is_the_parsers() -> None:
    """Committed rather than made at build time: the docs' environment has none of fngate's
    packages, and the page reads the same on GitHub as on the site."""
    assert read("docs/reference/cli.md") == cli_reference().render(), (
        "run: .venv/bin/python scripts/cli_reference.py"
    )


def manifest_keys(schema: dict[str, Any], node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    if "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    for option in node.get("anyOf", []):
        yield from manifest_keys(schema, option, prefix)
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        yield from manifest_keys(schema, node["items"], f"{prefix}[]")
    for key, child in node.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        nested = list(manifest_keys(schema, child, path))
        yield from nested or [path]


def test_every_manifest_key_is_in_the_reference() -> None:
    from fngate.manifest import schema_json

    schema = json.loads(schema_json())
    page = read("docs/reference/manifest.md")
    assert [key for key in manifest_keys(schema, schema) if f"`{key}`" not in page] == []


def test_every_route_is_in_the_http_reference() -> None:
    from gateway.http import app, invoke

    page = read("docs/reference/http.md")
    routes = {("POST", route.path) for route in invoke.ROUTES}
    for route in app.ROUTES:
        routes |= {(method, route.path) for method in route.methods or () if method != "HEAD"}
    missing = sorted(
        f"{method} {path}" for method, path in routes if f"`{method} {path.rstrip('/')}`" not in page
    )
    assert missing == []


def test_every_rpc_is_in_the_grpc_reference() -> None:
    from tritonclient.grpc import service_pb2

    from gateway.grpc.service import UNIMPLEMENTED

    page = read("docs/reference/grpc.md")
    service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    served = [method.name for method in service.methods if method.name not in UNIMPLEMENTED]
    assert [name for name in served if not re.search(rf"\b{name}\b", page)] == []


def test_every_setting_is_in_the_settings_reference() -> None:
    from fngate.config import ENV_PREFIX, GatewaySettings, RunnerSettings

    page = read("docs/reference/settings.md")
    variables = {
        ENV_PREFIX + name.upper() for cls in (GatewaySettings, RunnerSettings) for name in cls.model_fields
    }
    assert sorted(name for name in variables if f"`{name}`" not in page) == []


METRIC = re.compile(r"\b(?:Counter|Gauge|Histogram|Summary)\(\s*\"(fngate_\w+)\"")


def test_every_metric_family_is_in_the_metrics_reference() -> None:
    defined = {
        name
        for package in ("fngate", "gateway", "runner")
        for path in (ROOT / package).rglob("*.py")
        for name in METRIC.findall(path.read_text(encoding="utf-8"))
    }
    assert len(defined) > 20  # the pattern still finds how families are declared
    page = read("docs/reference/metrics.md")
    assert sorted(name for name in defined if f"`{name}`" not in page) == []


PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
TOP = ("fngate", "gateway", "runner", "bench", "tests", "scripts", "deploy", "terraform", "functions", "docs")
REPOSITORY_PATH = re.compile(rf"^(?:{'|'.join(TOP)}|requirements)/[\w./-]*(?:::\w+)?$")
MODULE = re.compile(r"^(?:python -m )?((?:fngate|gateway|runner|bench|tests)(?:\.(?!py\b)\w+)+)")


def code_spans(text: str) -> Iterator[str]:
    """The inline code of a page, fenced blocks left out (they hold commands and output)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    yield from re.findall(r"`([^`\n]+)`", prose)


def named_things(text: str) -> Iterator[str]:
    for raw in code_spans(text):
        span = raw.strip()
        if REPOSITORY_PATH.match(span) and not any(mark in span for mark in "*{<["):
            yield span
        elif match := MODULE.match(span):
            yield match.group(1)


def exists(name: str) -> bool:
    """A repository path (with a test's `::name`), or a dotted module with an attribute after it."""
    if "/" in name:
        path, _, test = name.partition("::")
        target = ROOT / path.rstrip("/")
        if not target.exists():
            return False
        return (
            not test
            or re.search(rf"\b(?:def|class) {test}\b", target.read_text(encoding="utf-8")) is not None
        )
    parts = name.split(".")
    for length in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:length])
        module = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if module.exists():
            rest = parts[length:]
            return not rest or re.search(rf"\b{rest[0]}\b", module.read_text(encoding="utf-8")) is not None
    return False


def test_every_file_and_module_the_docs_name_exists() -> None:
    """A page that names `fngate/queue.py` after it became a package, or a module by its old name,
    fails here rather than misleading a reader."""
    missing = sorted(
        f"{page.relative_to(ROOT)}: {name}"
        for page in PAGES
        for name in set(named_things(page.read_text(encoding="utf-8")))
        if not exists(name)
    )
    assert missing == []


def test_the_readme_is_a_short_front_door() -> None:
    readme = read("README.md")
    assert len(readme.encode()) < 8 * 1024
    # The two set-up commands, as CI and the product run them.
    assert "scripts/bootstrap --run && .venv/bin/fngate up" in readme
    assert "\nscripts/test " in readme
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme + read("CONTRIBUTING.md"))
    assert [link for link in links if not (ROOT / link).exists()] == []
