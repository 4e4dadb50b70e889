"""Who may import whom: gateway and runner meet only in fngate (through Redis), and fngate imports
neither, except the CLI inside its subcommands."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_packages(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize(("package", "forbidden"), [("gateway", "runner"), ("runner", "gateway")])
def test_gateway_and_runner_never_import_each_other(package: str, forbidden: str) -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / package).rglob("*.py"))
        if forbidden in imported_packages(path, top_level_only=False)
    ]
    assert offenders == []


def test_fngate_imports_gateway_and_runner_only_inside_functions() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "fngate").rglob("*.py"))
        if imported_packages(path, top_level_only=True) & {"gateway", "runner"}
    ]
    assert offenders == []
