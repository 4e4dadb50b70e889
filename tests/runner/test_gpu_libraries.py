"""The libraries a GPU provider links, found where NVIDIA's wheels put them (CUDA 13's nvidia/cu13/lib
among them) and loaded in order before onnxruntime loads the provider: on a fake wheel layout, and
on small shared libraries built here when a C compiler is at hand."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.backends.libraries import (
    cuda_runtime_libraries,
    load_order,
    needed_libraries,
    preload,
    wheel_libraries,
)


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_libraries_are_found_where_cuda_12_and_13_wheels_put_them(tmp_path: Path) -> None:
    venv, system = tmp_path / "venv-site", tmp_path / "system-site"
    cudart = touch(venv / "nvidia" / "cu13" / "lib" / "libcudart.so.13")
    cublas = touch(venv / "nvidia" / "cu13" / "lib" / "libcublas.so.13")
    cudnn = touch(venv / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9")
    nvinfer = touch(venv / "tensorrt_libs" / "libnvinfer.so.10")
    old = touch(venv / "nvidia" / "cublas" / "lib" / "libcublas.so.12")
    capi = touch(tmp_path / "capi" / "libonnxruntime_providers_shared.so")
    touch(system / "nvidia" / "cu13" / "lib" / "libcudart.so.13")  # shadowed by the first root
    touch(venv / "numpy" / "libnothing.so.1")  # not a wheel folder of NVIDIA's
    found = wheel_libraries([capi.parent, venv, system, tmp_path / "absent"])
    assert found == {
        "libcudart.so.13": cudart,
        "libcublas.so.13": cublas,
        "libcublas.so.12": old,
        "libcudnn.so.9": cudnn,
        "libnvinfer.so.10": nvinfer,
        "libonnxruntime_providers_shared.so": capi,
    }


def test_each_library_loads_after_those_it_links() -> None:
    found = {
        name: Path(f"/site/{name}") for name in ("libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13")
    }
    links = {
        "libcublas.so.13": ["libcublasLt.so.13", "libc.so.6"],
        "libcublasLt.so.13": ["libcudart.so.13"],
        "libcudart.so.13": [],
    }
    order = load_order(
        ["libcublas.so.13", "libcudart.so.13", "libcuda.so.1"], found, lambda path: links[path.name]
    )
    assert [path.name for path in order] == ["libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13"]


@pytest.mark.parametrize(
    ("cuda_version", "expected"),
    [
        # As onnxruntime-gpu 1.31's preload_dlls names them for Linux (cuFFT is 12 with CUDA 13).
        ("13.0", ("libcufft.so.12", "libnvrtc.so.13", "libcudnn.so.9")),
        ("12.8", ("libcufft.so.11", "libnvrtc.so.12", "libcudnn.so.9")),
        ("", ()),  # a CPU build
    ],
)
def test_the_cuda_providers_run_time_libraries_are_onnxruntimes(
    cuda_version: str, expected: tuple[str, ...]
) -> None:
    assert cuda_runtime_libraries(cuda_version) == expected


def test_a_file_that_is_not_a_shared_library_links_nothing(tmp_path: Path) -> None:
    assert needed_libraries(touch(tmp_path / "libempty.so.1")) == ()
    (tmp_path / "text.so").write_text("not an ELF file at all, just text that is long enough " * 4)
    assert needed_libraries(tmp_path / "text.so") == ()
    assert needed_libraries(tmp_path / "absent.so") == ()


compiler = pytest.mark.skipif(
    not (shutil.which("cc") and sys.platform == "linux"), reason="needs a C compiler on Linux"
)


def build(source: str, target: Path, *links: str, folder: Path | None = None) -> Path:
    """A shared library with this C source, linking `links` (found in `folder`), soname its name."""
    code = target.with_suffix(".c")
    code.write_text(source)
    command = ["cc", "-shared", "-fPIC", "-o", str(target), str(code), f"-Wl,-soname,{target.name}"]
    if folder is not None:
        command += [f"-L{folder}", *(f"-l:{name}" for name in links)]
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    return target


@compiler
def test_a_provider_loads_once_its_wheel_libraries_are_preloaded(tmp_path: Path) -> None:
    """As onnxruntime's CUDA provider links libcublas.so.13 from nvidia/cu13/lib, which no search
    path names: the provider loads only after `preload`, and `readelf -d` agrees on what it links."""
    lib = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    base = build("int fngate_base(void) { return 41; }\n", lib / "libfngatetestbase.so.13")
    build(
        "int fngate_base(void);\nint fngate_top(void) { return fngate_base() + 1; }\n",
        lib / "libfngatetesttop.so.13",
        base.name,
        folder=lib,
    )
    capi = tmp_path / "capi"
    capi.mkdir()
    provider = build(
        "int fngate_top(void);\nint fngate_provider(void) { return fngate_top(); }\n",
        capi / "libfngatetest_providers_cuda.so",
        "libfngatetesttop.so.13",
        folder=lib,
    )
    optional = build("int fngate_fft(void) { return 7; }\n", lib / "libfngatetestfft.so.12")
    assert needed_libraries(provider)[0] == "libfngatetesttop.so.13"
    if shutil.which("readelf"):
        shown = subprocess.run(
            ["readelf", "-d", str(provider)], capture_output=True, text=True, timeout=30, check=False
        )
        said = [line.split("[", 1)[1].rstrip("]") for line in shown.stdout.splitlines() if "(NEEDED)" in line]
        assert list(needed_libraries(provider)) == said

    import ctypes

    with pytest.raises(OSError, match=r"libfngatetesttop\.so\.13"):
        ctypes.CDLL(str(provider))
    # What the provider opens only at run time (cuDNN, cuFFT) is loaded too, and may be missing.
    loaded = preload(provider, [capi, tmp_path / "site"], [optional.name, "libfngatetestdnn.so.9"])
    assert loaded.failed == ()
    assert [path.name for path in loaded.loaded] == [
        "libfngatetestbase.so.13",
        "libfngatetesttop.so.13",
        optional.name,
    ]
    assert len(loaded.absent) == 1 and loaded.absent[0].startswith("libfngatetestdnn.so.9: ")
    assert ctypes.CDLL(str(provider)).fngate_provider() == 42
    assert ctypes.CDLL(optional.name).fngate_fft() == 7  # found by its name, as onnxruntime opens it


@compiler
def test_a_library_that_is_nowhere_is_the_reason(tmp_path: Path) -> None:
    folder = tmp_path / "build"
    folder.mkdir()
    missing = build("int fngate_gone(void) { return 1; }\n", folder / "libfngatetestgone.so.13")
    provider = build(
        "int fngate_gone(void);\nint fngate_p(void) { return fngate_gone(); }\n",
        tmp_path / "libfngatetest_providers_tensorrt.so",
        missing.name,
        folder=folder,
    )
    missing.unlink()
    loaded = preload(provider, [tmp_path / "site"])
    assert loaded.loaded == ()
    assert len(loaded.failed) == 1 and loaded.failed[0].startswith("libfngatetestgone.so.13: ")
