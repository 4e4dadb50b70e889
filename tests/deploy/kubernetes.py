"""A real one-node Kubernetes with KEDA for tests/deploy/test_kubernetes.py: ../shared/k8s's `fgk8s`,
which runs it all inside a network namespace of its own. Every address of the cluster (node, pods,
Services) exists only in that namespace: the test reaches them with `fgk8s kubectl` and with
tests/deploy/k8s_client.py run by `fgk8s ns`, never from the machine's own namespace."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("FNGATE_K8S_DIR", ROOT.parent / "shared" / "k8s"))
IMAGES = ROOT / "build" / "images.tar"
NODE = "10.250.0.1"
"""The node's address, inside the cluster's namespace only: Redis and the S3 stand-in listen there."""
NETNS = "/run/netns/fgk8s"
TOOLS = ("containerd", "runc", "iptables", "ipset", "conntrack", "zstd", "redis-server")


def unavailable() -> str:
    """Why the cluster cannot run here ('' when it can)."""
    if not (SHARED / "fgk8s").exists():
        return f"no {SHARED.name} cluster bundle beside the checkout (../shared/k8s)"
    if os.geteuid() != 0:
        return "the cluster needs root (containerd and the kubelet)"
    missing = [tool for tool in TOOLS if not shutil.which(tool)]
    if missing or not Path("/usr/lib/cni/bridge").exists():
        return f"missing {', '.join(missing) or 'CNI plugins'}: scripts/bootstrap installs them as root"
    if not IMAGES.exists():
        return "no build/images.tar: `scripts/images --save build/images.tar` builds it (scripts/test does)"
    return ""


class Cluster:
    """`fgk8s up` in a scratch folder; `close` stops all it started."""

    def __init__(self) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="fngate-k8s-"))
        self.env = {**os.environ, "K8S": str(self.state)}
        self.background: list[subprocess.Popen[bytes]] = []
        self.figures: dict[str, Any] = {}

    def up(self, images: Path | None = None) -> None:
        """The cluster started; with `images` (a `docker save` tar), those imported into its
        containerd as soon as containerd answers, while the rest of the cluster starts."""
        started = time.monotonic()
        (self.state / "bin").mkdir()
        unpack = f"zstd -dc {SHARED / 'bundle.tar.zst'} | tar -x -C {self.state / 'bin'}"
        subprocess.run(["bash", "-c", unpack], check=True, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(1) as starting:
            booting = starting.submit(self.fgk8s, "up", timeout=240)
            imported = images is None or self._import(images, booting)
            booting.result()  # fgk8s up's failure, if it failed
        assert imported, "containerd did not answer while fgk8s up ran: no images imported"
        self.figures["cluster_up_s"] = round(time.monotonic() - started, 1)

    def _import(self, images: Path, booting: concurrent.futures.Future[str]) -> bool:
        """`images` into containerd's k8s.io namespace once containerd answers (False if fgk8s up
        ended first, or it never did)."""
        socket = str(self.state / "run" / "containerd.sock")
        deadline = time.monotonic() + 120
        while not self.succeeds("ctr", "-a", socket, "version", timeout=10):
            if booting.done() or time.monotonic() > deadline:
                return False
            time.sleep(0.25)
        started = time.monotonic()
        self.ns("ctr", "-a", socket, "-n", "k8s.io", "images", "import", str(images), timeout=300)
        self.figures["images_import_s"] = round(time.monotonic() - started, 1)
        return True

    def close(self) -> None:
        for process in self.background:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self.fgk8s("down", timeout=180, check=False)
        shutil.rmtree(self.state, ignore_errors=True)

    def fgk8s(self, *args: str, timeout: float = 120, check: bool = True, stdin: str | None = None) -> str:
        done = subprocess.run(
            [str(SHARED / "fgk8s"), *args],
            env=self.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and done.returncode != 0:
            output = done.stdout[-2000:] + done.stderr[-3000:]
            raise AssertionError(f"fgk8s {' '.join(args[:6])} exited {done.returncode}:\n{output}")
        return done.stdout

    def kubectl(self, *args: str, timeout: float = 120, check: bool = True, stdin: str | None = None) -> str:
        return self.fgk8s("kubectl", *args, timeout=timeout, check=check, stdin=stdin)

    def succeeds(self, *args: str, timeout: float = 30, env: dict[str, str] | None = None) -> bool:
        """Whether a command inside the cluster's namespace exits 0 within `timeout` (`ns`): for
        polls, which ask again."""
        try:
            self.ns(*args, timeout=timeout, env=env)
        except (AssertionError, subprocess.TimeoutExpired):
            return False
        return True

    def ns(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
        """A command inside the cluster's namespace; its output (it must exit 0)."""
        done = subprocess.run(
            ["nsenter", f"--net={NETNS}", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=ROOT,
        )
        assert done.returncode == 0, (
            f"{' '.join(args[:4])} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
        return done.stdout

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A process of the test's inside the namespace, ended by `close`; its output in the state folder."""
        with (self.state / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(
                ["nsenter", f"--net={NETNS}", *args],
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=ROOT,
            )
        self.background.append(process)
        return process

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args))

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return list(self.get("pods", "-n", namespace, "-l", selector)["items"])

    def log(self, name: str) -> str:
        path = self.state / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class Watch:
    """`kubectl get -w` of one kind, each line it prints kept with the moment it came (epoch s), so
    that a figure has the resolution of the watch, not of the API's one-second timestamps."""

    def __init__(self, cluster: Cluster, *args: str) -> None:
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(
            [str(SHARED / "fgk8s"), "kubectl", "get", "-w", *args],
            env=cluster.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.time(), line.strip()))

    def first(self, predicate: Callable[[str], bool], after: float = 0.0) -> float | None:
        return next((at for at, line in list(self.lines) if at >= after and predicate(line)), None)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(timeout=10)
        self.reader.join(timeout=10)
        assert self.process.stdout is not None
        self.process.stdout.close()

    def deletions(self) -> dict[str, float]:
        """Of a `--output-watch-events` watch printing `TYPE NAME DELETION-TIMESTAMP`: the seconds
        from each pod's deletion (its SIGTERM) to its end."""
        deleting: dict[str, float] = {}
        took: dict[str, float] = {}
        for at, line in list(self.lines):
            if not line:
                continue
            kind, name, *deleted = line.split()
            if deleted and name not in deleting:
                deleting[name] = at
            if kind == "DELETED" and name in deleting:
                took[name] = round(at - deleting[name], 2)
        return took


@contextlib.contextmanager
def watching(cluster: Cluster, *args: str) -> Iterator[Watch]:
    watch = Watch(cluster, *args)
    try:
        time.sleep(0.5)  # the watch lists what exists before the change to time
        yield watch
    finally:
        watch.close()


def wait_until(what: str, predicate: Callable[[], object], timeout_s: float, every_s: float = 0.5) -> float:
    """Seconds until `predicate()` held; fails the test with `what` after timeout_s."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)
    return round(time.monotonic() - started, 2)
