"""fngate.kube outside a cluster: what a gateway with FNGATE_KUBERNETES_WAKE says when it cannot wake
pools (tests/deploy/test_kubernetes.py wakes them on a real cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fngate.kube import InCluster, KubeError


def test_outside_a_pod_or_without_a_token_it_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeError, match="not in a Kubernetes pod"):
        InCluster.from_pod(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(KubeError, match="automountServiceAccountToken"):
        InCluster.from_pod(tmp_path)
    (tmp_path / "token").write_text("t")
    (tmp_path / "namespace").write_text("ml\n")
    found = InCluster.from_pod(tmp_path)
    assert (found.base, found.namespace) == ("https://[fd00::1]:443", "ml")


def test_an_api_that_cannot_be_reached_is_a_clear_error_without_the_token(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("secret-token-value")
    (tmp_path / "ca.crt").write_text("")
    # A closed loopback port: nothing answers.
    with pytest.raises(KubeError, match="could not be reached") as raised:
        InCluster("https://127.0.0.1:9", "ml", tmp_path).wake("default")
    assert "secret-token-value" not in str(raised.value)
