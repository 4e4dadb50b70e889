"""What a new user reads and runs first: the README's commands and the package's metadata."""

from __future__ import annotations

import re
import tomllib

from tests.conftest import ROOT


def test_the_readme_holds_no_placeholder_and_no_install_that_fails() -> None:
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"\[[^\]]*to be stated", readme)
    # fngate is not on PyPI: installs go from this folder. perf-analyzer's wheel needs glibc 2.38.
    assert not re.search(r"pip install '?fngate\[", readme)
    for line in readme.splitlines():
        if "pip install perf-analyzer" in line:
            assert "2.38" in line or "Debian 13" in line, line


def test_the_license_is_an_spdx_expression() -> None:
    """A license table makes setuptools warn on every install (three times in scripts/bootstrap)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read the string
