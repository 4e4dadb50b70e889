"""The deployment files as the tests read them: where they are, Terraform modules parsed with
python-hcl2, and where the command-line tools are. Imported by name (`deploy_files`), since
`conftest` is ambiguous once several test folders have one."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TERRAFORM = ROOT / "terraform"


def find_tool(name: str, *candidates: Path) -> str | None:
    """The first of candidates that exists, else `name` on PATH, else None."""
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(name)


def load_hcl(path: Path) -> dict[str, Any]:
    """One .tf or .tfvars file as python-hcl2 reads it, strings without their quotes."""
    import hcl2

    options = hcl2.SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    with path.open(encoding="utf-8") as file:
        return hcl2.load(file, serialization_options=options)  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Module:
    """The top-level blocks of one Terraform module (every .tf file of a folder)."""

    path: Path
    blocks: dict[str, list[Any]]

    def resource(self, kind: str, name: str, section: str = "resource") -> dict[str, Any]:
        for entry in self.blocks.get(section, []):
            if kind in entry and name in entry[kind]:
                return entry[kind][name]  # type: ignore[no-any-return]
        raise KeyError(f"{section} {kind}.{name} not in {self.path.relative_to(ROOT)}")

    def named(self, section: str) -> dict[str, Any]:
        """variable, output or module blocks by name."""
        return {name: body for entry in self.blocks.get(section, []) for name, body in entry.items()}

    @property
    def locals(self) -> dict[str, Any]:
        return {key: value for entry in self.blocks.get("locals", []) for key, value in entry.items()}

    def resolve(self, value: Any) -> Any:
        """`${local.a.b}` (or `${(local.a.b)}`) to the literal it names in this module; anything
        else unchanged."""
        match = re.fullmatch(r"\$\{\(?local\.([\w.]+)\)?\}", value) if isinstance(value, str) else None
        if match is None:
            return value
        found: Any = self.locals
        for part in match.group(1).split("."):
            found = found[part]
        return found


def load_module(path: Path) -> Module:
    blocks: dict[str, list[Any]] = {}
    for file in sorted(path.glob("*.tf")):
        for section, entries in load_hcl(file).items():
            blocks.setdefault(section, []).extend(entries)
    return Module(path, blocks)


@dataclass(frozen=True)
class CheckovReport:
    by_framework: dict[str, dict[str, Any]]
    duration_s: float
