"""Fixtures of the end-to-end tests beyond the shared ones: a real S3 API (moto's server), and
what Python functions printed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.e2e.function_output import FunctionOutput
from tests.s3 import moto_server, s3

__all__ = ["function_output", "moto_server", "s3"]


@pytest.fixture
def function_output(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> FunctionOutput:
    """What the Python functions of this test's runners printed (in-process runners, and runner
    processes of runner_process)."""
    caplog.set_level(logging.INFO, logger="runner.function")
    return FunctionOutput(caplog, tmp_path)
