"""Fixtures of the deployment checks: the Terraform modules, parsed once, one checkov run per
session (it takes seconds, and every checkov test reads the same report), and a real S3 API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from deploy_files import ROOT, TERRAFORM, CheckovReport, Module, find_tool, load_module

from tests.s3 import moto_server, s3

__all__ = ["checkov_report", "modules", "moto_server", "s3"]

CHECKOV_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def modules() -> dict[str, Module]:
    """The root module as "root" and each of terraform/modules/* by folder name."""
    found = {"root": load_module(TERRAFORM)}
    for folder in sorted((TERRAFORM / "modules").iterdir()):
        if folder.is_dir():
            found[folder.name] = load_module(folder)
    return found


@pytest.fixture(scope="session")
def checkov_report() -> Iterator[CheckovReport]:
    """checkov on terraform/ and the Dockerfile, once. checkov lives in its own environment
    (.venv/checkov, or CHECKOV=path): it pins boto3 and packaging, which fngate's environment must not."""
    checkov = os.environ.get("CHECKOV") or find_tool(
        "checkov", ROOT / ".venv" / "checkov" / "bin" / "checkov"
    )
    if checkov is None:
        pytest.skip(
            "checkov is not installed; install it beside fngate's environment: "
            "python3 -m venv .venv/checkov && .venv/checkov/bin/pip install checkov"
        )
    # --skip-download: no network; severities and guidelines come from the vendor's service.
    common = ["--skip-download", "--compact", "--output", "json"]
    targets = {"terraform": ["-d", "terraform"], "dockerfile": ["-f", "Dockerfile"]}
    by_framework: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    for framework, target in targets.items():
        command = [checkov, *target, "--framework", framework, *common]
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=CHECKOV_TIMEOUT_S, check=False
        )
        if done.returncode not in (0, 1):  # 1: a check failed, which the tests report one by one
            pytest.fail(f"checkov exited with {done.returncode}:\n{done.stderr[-3000:]}")
        by_framework[framework] = json.loads(done.stdout)
    duration_s = time.monotonic() - started
    print(f"checkov: {duration_s:.1f} s", file=sys.stderr)
    yield CheckovReport(by_framework, duration_s)
