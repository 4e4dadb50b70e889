"""`python -m bench.cpu_split --profile DIR`: the gateway the bench starts runs under cProfile, writes
its profile as it exits, and the shares printed from it name the gateway's own functions."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bench.cpu_split import profile_shares
from bench.deployment import deployment


def test_a_profiled_gateway_writes_its_profile_and_its_shares_name_its_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    profiles = tmp_path / "profiles"
    with deployment(repo, tmp_path / "logs", profiles) as deployed:
        url = deployed.start_gateway(workers=1)
        for _ in range(20):
            assert httpx.get(f"{url}/v2/health/ready").status_code == 200
    written = profiles / "gateway-0.prof"
    assert written.stat().st_size > 0  # written at its exit, when the deployment stopped it
    profile_shares(written, top=40)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gateway-0.prof: ")
    shares = lines[2:]
    assert len(shares) == 40
    assert any(" gateway/" in line for line in shares), shares
    for line in shares:
        under, own = (float(part.rstrip("%")) for part in line.split()[:2])
        assert 0 <= own <= under < 90  # nothing with (nearly) all the time under it is listed
