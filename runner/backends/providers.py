"""onnxruntime execution providers: which a manifest asks for (TensorRT, CUDA, CPU, in that order),
which this process can give (probed once), the reason for each one skipped, and the options of
each: fp16, engine and timing caches, and optimisation profiles from the manifest's batch range."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib.metadata
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from fngate.config import RunnerSettings
from fngate.errors import Unavailable
from fngate.manifest import FunctionManifest
from runner import gpu
from runner.backends.engine_cache import EngineStore
from runner.backends.libraries import cuda_runtime_libraries, preload, wheel_roots

log = logging.getLogger(__name__)

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
CHAIN = {"tensorrt": (TENSORRT, CUDA, CPU), "cuda": (CUDA, CPU), "cpu": (CPU,)}
SHORT = {TENSORRT: "TensorRT", CUDA: "CUDA", CPU: "CPU"}
TENSORRT_LIBRARIES = ("libnvinfer.so.10", "libnvonnxparser.so.10")
"""What onnxruntime-gpu's TensorRT provider links (its `readelf -d` NEEDED entries)."""
PROVIDER_LIBRARIES = {
    CUDA: "libonnxruntime_providers_cuda.so",
    TENSORRT: "libonnxruntime_providers_tensorrt.so",
}
"""In onnxruntime/capi/: onnxruntime loads one when a session asks for its provider."""
NOT_SHAPING = ("device_id", "trt_engine_cache_path", "trt_timing_cache_path")
"""Options that do not change the engine TensorRT builds, so stay out of the cache key."""


@dataclasses.dataclass(frozen=True, slots=True)
class Acceleration:
    """How a runner uses its GPU, from RunnerSettings: built once, passed to each load."""

    engine_dir: Path = dataclasses.field(default_factory=lambda: Path("~/.cache/fngate/engines").expanduser())
    store: EngineStore | None = None
    """Where built engine caches persist between pods (the repository); None keeps them local."""
    require: bool = False
    """Refuse (unavailable) rather than run on a lesser provider than the manifest asks for."""
    device_index: int = 0

    @classmethod
    def from_settings(cls, settings: RunnerSettings, store: EngineStore | None = None) -> Acceleration:
        return cls(
            Path(settings.engine_cache_dir).expanduser(),
            store,
            settings.require_accelerator,
            settings.gpu_device,
        )


def refuse_fallback(manifest: FunctionManifest, accel: Acceleration, reason: str | None) -> None:
    """Unavailable when the model cannot run where its manifest asks (`reason`) and this runner
    requires the accelerator (FNGATE_REQUIRE_ACCELERATOR)."""
    if reason is not None and accel.require:
        raise Unavailable(
            f"{manifest.name} asks for accelerator {manifest.model.accelerator} and this runner "
            f"requires it (FNGATE_REQUIRE_ACCELERATOR), but {reason}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Environment:
    """What this process can offer, as plain data so that the choice is a pure function of it."""

    available: tuple[str, ...]
    """onnxruntime.get_available_providers(): the providers compiled into the installed package."""
    device: gpu.Device | gpu.NoDevice
    tensorrt_version: str = ""
    """TensorRT's library version; empty when its libraries cannot be loaded (see tensorrt_problem)."""
    tensorrt_problem: str = ""
    package_problem: str = ""
    """Set when onnxruntime's packages are wrong: none, or the CPU and GPU ones both (one import name)."""
    cuda_problem: str = ""
    """Which libraries the CUDA provider links could not be loaded, and why; empty when all could."""


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    providers: tuple[str, ...]
    """In order; the first is the provider the model is expected to run on."""
    skipped: tuple[tuple[str, str], ...] = ()
    """(provider, why) for each provider of the manifest's chain that this process cannot give."""

    @property
    def reason(self) -> str | None:
        if not self.skipped:
            return None
        return "; ".join(f"{SHORT[name]} provider unavailable: {why}" for name, why in self.skipped)


def choose(accelerator: str, environment: Environment) -> Choice:
    providers = []
    skipped = []
    for provider in CHAIN[accelerator]:
        problem = unavailable(provider, environment)
        if problem is None:
            providers.append(provider)
        else:
            skipped.append((provider, problem))
    return Choice(tuple(providers), tuple(skipped))


def unavailable(provider: str, environment: Environment) -> str | None:
    """Why `provider` cannot run here, or None."""
    if provider == CPU:
        return None
    if provider not in environment.available:
        hint = environment.package_problem or (
            "the installed onnxruntime is the CPU package; install fngate[gpu] (onnxruntime-gpu)"
        )
        return f"onnxruntime has no {provider} ({hint})"
    if isinstance(environment.device, gpu.NoDevice):
        return f"no NVIDIA GPU is visible ({environment.device.reason})"
    if environment.cuda_problem:
        return f"the CUDA libraries onnxruntime links cannot be loaded ({environment.cuda_problem})"
    if provider == TENSORRT and (environment.tensorrt_problem or not environment.tensorrt_version):
        return f"TensorRT's libraries cannot be loaded ({environment.tensorrt_problem})"
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Profile:
    """TensorRT optimisation profile in the provider's syntax: `name:1x256,other:1x3x224x224`."""

    min: str
    opt: str
    max: str


def profile(manifest: FunctionManifest) -> tuple[Profile | None, str]:
    """The profile that covers every batch the manifest allows (1 to max_batch_size rows, tuned
    for the largest preferred size), so that no batch triggers a rebuild; or None and why not
    (none is needed when every shape is fixed)."""
    if not manifest.batched:
        variable = [spec.name for spec in manifest.inputs if -1 in spec.shape]
        if not variable:
            return None, ""
        return None, f"inputs {variable} have variable dimensions and batching is off"
    ranges = []
    for spec in manifest.inputs:
        if -1 in spec.shape[1:]:
            return None, f"input '{spec.name}' has a variable dimension besides the batch dimension"
        if ":" in spec.name or "," in spec.name:
            return None, f"input '{spec.name}' has a name the provider's profile syntax cannot carry"
        ranges.append((spec.name, spec.shape[1:]))

    def shapes(rows: int) -> str:
        return ",".join(f"{name}:{'x'.join(str(d) for d in (rows, *dims))}" for name, dims in ranges)

    low, opt, high = batch_range(manifest)
    return Profile(shapes(low), shapes(opt), shapes(high)), ""


def batch_range(manifest: FunctionManifest) -> tuple[int, int, int]:
    """(min, opt, max) rows of a batch: 1, the largest preferred size, max_batch_size."""
    batching = manifest.batching
    return 1, max(batching.preferred_batch_sizes, default=batching.max_batch_size), batching.max_batch_size


def options(
    provider: str, manifest: FunctionManifest, engine_folder: Path, device_index: int
) -> dict[str, str]:
    """The provider options onnxruntime is given (strings, as its Python API expects)."""
    if provider == CUDA:
        return {"device_id": str(device_index)}
    if provider != TENSORRT:
        return {}
    chosen = {
        "device_id": str(device_index),
        "trt_fp16_enable": str(manifest.model.precision == "fp16"),
        "trt_engine_cache_enable": "True",
        "trt_engine_cache_path": str(engine_folder),
        "trt_timing_cache_enable": "True",
        "trt_timing_cache_path": str(engine_folder),
    }
    found, _why = profile(manifest)
    if found is not None:
        chosen |= {
            "trt_profile_min_shapes": found.min,
            "trt_profile_opt_shapes": found.opt,
            "trt_profile_max_shapes": found.max,
        }
    return chosen


@functools.cache
def probe(device_index: int) -> Environment:
    """Look once per process: onnxruntime's providers, the GPU (NVML), the libraries each GPU
    provider links (loaded here from the CUDA and TensorRT wheels), TensorRT's version."""
    device = gpu.find_device(device_index)
    try:
        import onnxruntime as ort
    except ImportError:
        return Environment((), device, package_problem="onnxruntime is not installed; install fngate[gpu]")
    available = tuple(ort.get_available_providers())
    problems: dict[str, str] = {}
    if isinstance(device, gpu.Device):
        capi = Path(ort.__file__).parent / "capi"
        roots = [capi, *wheel_roots()]
        runtime = cuda_runtime_libraries(getattr(ort, "cuda_version", "") or "")
        for provider in (CUDA, TENSORRT):
            library = capi / PROVIDER_LIBRARIES[provider]
            if provider in available and library.is_file():
                loaded = preload(library, roots, runtime if provider == CUDA else ())
                problems[provider] = "; ".join(loaded.failed)
                for absent in loaded.absent:
                    log.warning("the CUDA provider's models that need %s fail: it cannot be loaded", absent)
    version, problem = ("", "") if TENSORRT not in available else tensorrt_library()
    return Environment(
        available,
        device,
        version,
        problems.get(TENSORRT) or problem,
        _package_conflict(),
        problems.get(CUDA, ""),
    )


def tensorrt_library() -> tuple[str, str]:
    """(TensorRT's version, "") once its libraries are loaded, else ("", why not). The tensorrt
    wheel loads them from its own folder on import; a system install is found by the loader."""
    with contextlib.suppress(ImportError):
        import tensorrt  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    loaded = None
    for name in TENSORRT_LIBRARIES:
        try:
            library = ctypes.CDLL(name)
        except OSError as exc:
            return "", f"{name}: {exc}; install fngate[gpu,tensorrt] (tensorrt-cu13 10.x)"
        loaded = loaded or library
    assert loaded is not None
    return library_version(int(loaded.getInferLibVersion())), ""


def library_version(number: int) -> str:
    """NV_TENSORRT_VERSION: major * 10000 + minor * 100 + patch since TensorRT 10."""
    if number >= 10000:
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number // 100 % 10}.{number % 100}"


def _package_conflict() -> str:
    installed = set()
    for name in ("onnxruntime", "onnxruntime-gpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(name)
            installed.add(name)
    if len(installed) < 2:
        return ""
    return (
        "onnxruntime and onnxruntime-gpu are both installed and share the import name 'onnxruntime'; "
        "uninstall both, then install fngate[gpu] alone"
    )


def session_problem(
    asked: Sequence[tuple[str, Mapping[str, str]]],
    providers: Sequence[str],
    provider_options: Mapping[str, Mapping[str, str]],
) -> str | None:
    """How a session differs from the one asked for (providers in order, and the options given to
    each), or None. onnxruntime's Python layer retries a session that fails to create with its
    own fallback providers and none of the options (device_id included), and a provider it cannot
    load is left out with a warning: the session, not the request, says what runs. Of the options
    only device_id is compared: the others are echoed in onnxruntime's own spelling, and a session
    that lost them in a fallback has lost the TensorRT provider too."""
    names = [name for name, _options in asked]
    if list(providers) != names:
        lost = [SHORT.get(name, name) for name in names if name not in providers]
        said = f"the session has {list(providers)}, not {names}"
        return f"onnxruntime did not create the {', '.join(lost)} provider ({said})" if lost else said
    for name, options in asked:
        wanted, given = options.get("device_id"), provider_options.get(name, {}).get("device_id")
        if wanted is not None and given is not None and given != wanted:
            return (
                f"onnxruntime created the {SHORT.get(name, name)} provider on GPU {given}, not {wanted}: "
                "it dropped the options asked for"
            )
    return None
