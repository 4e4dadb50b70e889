"""checkov on the Terraform and the Dockerfile: no failed check, and every skip says why, inline."""

from __future__ import annotations

import pytest
from deploy_files import CheckovReport

# A justification is a sentence, not a token: `#checkov:skip=CKV_X:<why>`.
MIN_JUSTIFICATION_CHARS = 30


@pytest.mark.parametrize("framework", ["terraform", "dockerfile"])
def test_checkov_finds_no_failed_check(checkov_report: CheckovReport, framework: str) -> None:
    report = checkov_report.by_framework[framework]
    failed = [
        f"{check['check_id']} {check['check_name']}: {check['resource']} ({check['file_path']})"
        for check in report["results"]["failed_checks"]
    ]
    assert not failed, "\n".join(failed)
    assert report["summary"]["passed"] > 0, "checkov ran no check: did it find the files?"


@pytest.mark.parametrize("framework", ["terraform", "dockerfile"])
def test_every_checkov_skip_is_justified(checkov_report: CheckovReport, framework: str) -> None:
    for check in checkov_report.by_framework[framework]["results"]["skipped_checks"]:
        reason = check["check_result"].get("suppress_comment", "")
        assert len(reason) >= MIN_JUSTIFICATION_CHARS, (
            f"{check['check_id']} on {check['resource']}: {reason!r}"
        )
