"""The one Kubernetes API call fngate makes from inside a cluster: a gateway waking a runner pool at
zero (its Deployment's scale subresource from 0 to 1 replica) the moment work arrives for it, rather
than at KEDA's next poll. KEDA keeps owning the count from there (1..N..0).

The call is a JSON patch whose first operation tests that the count is 0: it never lowers a pool
that KEDA has scaled up, and every gateway replica may send it (one of them sets 1, the others find
the test failed). It runs with the pod's service-account token, which the rendered Role lets patch
the scale of the runner Deployments of its namespace and nothing else (fngate/k8s.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path

ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where a pod's service-account token, the cluster's CA and the pod's namespace are mounted."""
TIMEOUT_S = 5.0
# A Scale at 0 replicas has an empty spec (`replicas` is omitted when 0): test that, then add 1.
WAKE = json.dumps(
    [{"op": "test", "path": "/spec", "value": {}}, {"op": "add", "path": "/spec/replicas", "value": 1}]
).encode()


def runner_deployment(pool: str) -> str:
    """The Deployment of a runner pool, as fngate k8s render names it."""
    return f"fngate-runner-{pool}"


class KubeError(Exception):
    """The API could not be reached, or refused the call (the message says which and why)."""


@dataclasses.dataclass(frozen=True)
class InCluster:
    """The API server as the pod's service account reaches it."""

    base: str
    namespace: str
    account: Path = ACCOUNT

    @classmethod
    def from_pod(cls, account: Path = ACCOUNT) -> InCluster:
        """Raises KubeError outside a pod, or in one without its service-account token."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise KubeError("not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST)")
        if not (account / "token").is_file():
            raise KubeError(
                f"no service-account token at {account} (the pod needs automountServiceAccountToken)"
            )
        namespace = (account / "namespace").read_text(encoding="utf-8").strip()
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", namespace, account)

    def wake(self, pool: str) -> bool:
        """Sets the pool's Deployment from 0 to 1 replica: True when this call did, False when it was
        not at 0 (already up, or another gateway woke it). Raises KubeError when it could not ask.
        Blocking (run it in a thread): the token is read at each call, since the kubelet rotates it."""
        name = runner_deployment(pool)
        url = f"{self.base}/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}/scale"
        token = (self.account / "token").read_text(encoding="utf-8").strip()
        request = urllib.request.Request(url, data=WAKE, method="PATCH")
        request.add_header("Content-Type", "application/json-patch+json")
        request.add_header("Authorization", f"Bearer {token}")
        try:
            context = ssl.create_default_context(cafile=str(self.account / "ca.crt"))
            with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as answer:
                answer.read()
            return True
        except urllib.error.HTTPError as exc:
            reason = _reason(exc)
            exc.close()
            if exc.code == 422:  # the patch is fixed and valid: only its test can fail (not at 0)
                return False
            what = f"{exc.code} from the Kubernetes API patching deployments/{name}/scale"
            raise KubeError(f"{what}: {reason}") from None
        except OSError as exc:  # ssl.SSLError and urllib's URLError are OSErrors
            raise KubeError(f"the Kubernetes API at {self.base} could not be reached: {exc}") from None


def _reason(exc: urllib.error.HTTPError) -> str:
    """The Status object's message, bounded (never the request, whose header holds the token)."""
    try:
        status = json.loads(exc.read(16384))
        return str(status.get("message", ""))[:300]
    except (OSError, ValueError, AttributeError):
        return exc.reason if isinstance(exc.reason, str) else ""
