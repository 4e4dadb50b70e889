"""The shared libraries a GPU provider of onnxruntime links, and those its CUDA provider opens only
at run time (onnxruntime's own preload_dlls loads them too), found where NVIDIA's wheels put them
(no search path names those folders) and loaded, each after those it links, before onnxruntime
loads the provider; and why one cannot be. Reads ELF headers itself: no tool is needed."""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

WHEEL_FOLDERS = ("nvidia", "tensorrt_libs")
"""Where NVIDIA's wheels put their libraries under site-packages: nvidia/<name>/lib for CUDA 12,
nvidia/cu13/lib for CUDA 13, nvidia/cudnn/lib, tensorrt_libs/ (tensorrt-cu13-libs)."""


def wheel_roots() -> list[Path]:
    """The folders Python imports packages from (site-packages, the virtual environment's first)."""
    return [Path(entry) for entry in sys.path if entry and Path(entry).is_dir()]


def needed_libraries(path: Path) -> tuple[str, ...]:
    """The libraries an ELF file links (its DT_NEEDED entries, what `readelf -d` lists as NEEDED),
    in order; () for a file that is not a 64-bit little-endian ELF with a dynamic section."""
    try:
        with path.open("rb") as elf:
            header = elf.read(64)
            if len(header) < 64 or header[:4] != b"\x7fELF" or header[4:6] != b"\x02\x01":
                return ()
            phoff, phentsize, phnum = (
                struct.unpack_from("<Q", header, 32)[0],
                *struct.unpack_from("<HH", header, 54),
            )
            elf.seek(phoff)
            segments = [struct.unpack_from("<IIQQQQ", elf.read(phentsize)) for _ in range(phnum)]
            loads = [(vaddr, offset, filesz) for kind, _f, offset, vaddr, _p, filesz in segments if kind == 1]
            dynamic = next(
                ((offset, filesz) for kind, _f, offset, _v, _p, filesz in segments if kind == 2), None
            )
            if dynamic is None:
                return ()
            elf.seek(dynamic[0])
            table = elf.read(dynamic[1])
            entries = [struct.unpack_from("<qQ", table, at) for at in range(0, len(table) - 15, 16)]
            strtab = next((value for tag, value in entries if tag == 5), None)  # DT_STRTAB
            start = next(
                (
                    offset + strtab - vaddr
                    for vaddr, offset, size in loads
                    if vaddr <= (strtab or -1) < vaddr + size
                ),
                None,
            )
            if start is None:
                return ()
            names = []
            for tag, value in entries:
                if tag == 0:  # DT_NULL ends the table
                    break
                if tag == 1:  # DT_NEEDED: an offset into the string table
                    elf.seek(start + value)
                    names.append(elf.read(256).split(b"\0", 1)[0].decode(errors="replace"))
            return tuple(names)
    except (OSError, struct.error):
        return ()


def wheel_libraries(roots: Sequence[Path]) -> dict[str, Path]:
    """Shared libraries by file name in NVIDIA's wheel folders under `roots` (and in a root itself:
    onnxruntime's capi folder), the first root's first."""
    found: dict[str, Path] = {}
    for root in roots:
        folders = [root / name for name in WHEEL_FOLDERS if (root / name).is_dir()]
        candidates = [path for path in root.glob("lib*.so*")]
        for folder in folders:
            candidates += sorted(folder.rglob("lib*.so*"))
        for path in candidates:
            if path.is_file():
                found.setdefault(path.name, path)
    return found


def load_order(
    wanted: Sequence[str], found: Mapping[str, Path], needs: Callable[[Path], Sequence[str]]
) -> list[Path]:
    """The files of `found` that `wanted` needs, directly or through one another, each after the
    ones it links; names not in `found` are left to the system's loader."""
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name not in found:
            return
        seen.add(name)
        for dependency in needs(found[name]):
            visit(dependency)
        order.append(found[name])

    for name in wanted:
        visit(name)
    return order


def cuda_runtime_libraries(cuda_version: str) -> tuple[str, ...]:
    """What onnxruntime's CUDA provider opens only when a model needs it, so that its NEEDED
    entries do not name them, for a build of this CUDA version ("13.0"): cuFFT (FFT operators),
    nvrtc (kernels compiled at run time) and cuDNN (convolutions). onnxruntime's own preload_dlls
    loads these beside what the provider links, and lets each be missing; so does `preload`."""
    major = cuda_version.split(".", 1)[0]
    if not major.isdigit():
        return ()
    cufft = "12" if int(major) >= 13 else "11"
    return (f"libcufft.so.{cufft}", f"libnvrtc.so.{major}", "libcudnn.so.9")


@dataclasses.dataclass(frozen=True, slots=True)
class Preloaded:
    loaded: tuple[Path, ...]
    failed: tuple[str, ...] = ()
    """"name: why" for each library the provider links that cannot be loaded."""
    absent: tuple[str, ...] = ()
    """"name: why" for each optional library that cannot be loaded: the provider loads, and only
    the models that need it fail (a convolution without cuDNN)."""


def preload(provider_library: Path, roots: Sequence[Path], optional: Sequence[str] = ()) -> Preloaded:
    """Load what `provider_library` links, and the `optional` libraries it opens at run time, before
    onnxruntime does: from the wheels where they are (by path, so that nvidia/cu13/lib needs no
    LD_LIBRARY_PATH), else by name as the system's loader finds it. A library loaded once is found
    by its name afterwards, so onnxruntime's own dlopen of the provider then succeeds; one it links
    that fails here is the reason the provider would."""
    wanted = needed_libraries(provider_library)
    extra = [name for name in optional if name not in wanted]
    found = wheel_libraries(roots)
    loaded: list[Path] = []
    problems: dict[str, str] = {}
    for path in load_order([*wanted, *extra], found, needed_libraries):
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            loaded.append(path)
        except OSError as exc:
            problems[path.name] = f"{path.name}: {exc}"
    for name in [*wanted, *extra]:
        if name not in found:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                problems[name] = f"{name}: {exc}"
    failed = tuple(problem for name, problem in problems.items() if name not in extra)
    absent = tuple(problems[name] for name in extra if name in problems)
    return Preloaded(tuple(loaded), failed, absent)
