"""One Triton model folder ({model}/config.pbtxt and numbered version folders) as the versions of a
function, and the ONNX auto-complete of a model that has no configuration."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fngate.manifest import MANIFEST_FILE, FunctionManifest, ManifestError
from fngate.tensors import ONNX_DATATYPES
from fngate.triton.config import (
    CONFIG_FILE,
    MODEL_FILES,
    ModelSignature,
    TensorConfig,
    complete,
    map_config,
    parse_config,
    parse_config_json,
)

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2 as pb

VERSION = re.compile(r"^[1-9][0-9]{0,8}$")
ORT_TYPES = {
    "float": "FP32",
    "double": "FP64",
    "float16": "FP16",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "uint8": "UINT8",
    "uint16": "UINT16",
    "uint32": "UINT32",
    "uint64": "UINT64",
    "bool": "BOOL",
    "string": "BYTES",
}
"""onnxruntime's `tensor(<type>)` names."""


@dataclasses.dataclass(frozen=True, slots=True)
class TritonVersion:
    manifest: FunctionManifest
    version: str


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFolder:
    name: str
    """The model's name in Triton (its folder's)."""
    versions: tuple[TritonVersion, ...]
    """Oldest first: every numbered folder that holds the model file (an ensemble's, every one)."""
    warnings: tuple[str, ...]
    """What fngate does not honour of its configuration, and versions it skipped."""


PYTHON_AUTO_COMPLETE = (
    "a Python model (model.py) with no config.pbtxt, whose auto_complete_config has not run: fngate "
    "runs it in a confined process of its own, never where the repository is read (`fngate up` does, "
    "for a folder repository, and `fngate validate`), or write the configuration it would complete: a "
    'config.pbtxt with backend: "python", its input, output and max_batch_size'
)


def is_model_folder(folder: Path) -> bool:
    """A Triton model: a config.pbtxt, or (auto-complete) a numbered folder holding a model.onnx, or
    a model.py (which read_model refuses, with why)."""
    if (folder / CONFIG_FILE).is_file():
        return True
    return any(
        VERSION.match(item.name)
        and ((item / MODEL_FILES["onnxruntime"]).is_file() or (item / MODEL_FILES["python"]).is_file())
        for item in _numbered(folder)
    )


def version_folders(folder: Path) -> list[str]:
    """The numbered folders of a model, oldest first."""
    return sorted((item.name for item in _numbered(folder)), key=int)


def read_model(folder: Path, override: str | None = None, completed: str | None = None) -> ModelFolder:
    """Read and map a model folder (with `override`, a load request's configuration as JSON, in
    place of its config.pbtxt, completed as Triton completes it; for a Python model with no
    config.pbtxt, `completed` is what its auto_complete_config answered, as runner.triton.complete
    records it); raises ManifestError when it cannot be served at all."""
    source = str(folder / CONFIG_FILE)
    config_path = folder / CONFIG_FILE
    if override is not None:
        source = f"{folder}: the configuration of the load request"
        config = parse_config_json(override, source)
        if not config.backend and not config.platform:  # as Triton, from the model file there
            config.backend = _backend_of_files(folder)
    elif config_path.is_file():
        try:
            text = config_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ManifestError(source, [("", f"cannot read: {exc}")]) from exc
        config = parse_config(text, source)
    elif _backend_of_files(folder) == "python":
        config = _completed(folder, completed)
        source = f"{folder}: the configuration its auto_complete_config completed"
    else:
        from tritonclient.grpc import model_config_pb2 as pb

        if not any((item / MODEL_FILES["onnxruntime"]).is_file() for item in _numbered(folder)):
            raise ManifestError(source, [("", PYTHON_AUTO_COMPLETE)])
        config = pb.ModelConfig(backend="onnxruntime")
    if config.name and config.name != folder.name:
        raise ManifestError(source, [("name", f"{config.name!r} is not its folder's name {folder.name!r}")])
    versions = version_folders(folder)
    if not versions:
        raise ManifestError(source, [("", "no numbered version folder")])
    newest = folder / versions[-1]
    filename = config.default_model_filename or MODEL_FILES["onnxruntime"]
    try:
        notes = complete(config, folder.name, lambda: onnx_signature(newest / filename))
    except ValueError as exc:
        raise ManifestError(source, [("input", f"auto-complete from {newest / filename}: {exc}")]) from exc
    mapped = map_config(config, source)
    warnings = list(mapped.warnings)
    found = []
    for version in versions:
        if mapped.model_file and not (folder / version / mapped.model_file).is_file():
            warnings.append(f"{folder / version}: no {mapped.model_file}; version {version} is skipped")
            continue
        found.append(TritonVersion(mapped.manifest(version, source), version))
    if not found:
        raise ManifestError(source, [("", f"no version folder holds {mapped.model_file}")])
    warnings += [f"{source}: {note}" for note in notes]
    return ModelFolder(folder.name, tuple(found), tuple(warnings))


def onnx_signature(path: Path) -> ModelSignature:
    """The inputs and outputs of an ONNX model, with onnx when it is installed, else onnxruntime
    (the runner's); raises ValueError when neither can read it. Blocking."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    try:
        import onnx
    except ImportError:
        return _ort_signature(path)
    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # onnx raises DecodeError and others for a file that is not a model
        raise ValueError(f"onnx cannot read it: {exc}") from exc
    initializers = {item.name for item in graph.initializer}
    inputs = tuple(_onnx_tensor(item) for item in graph.input if item.name not in initializers)
    return ModelSignature(inputs, tuple(_onnx_tensor(item) for item in graph.output))


def _onnx_tensor(value: object) -> TensorConfig:
    tensor_type = value.type.tensor_type  # type: ignore[attr-defined]
    datatype = ONNX_DATATYPES.get(tensor_type.elem_type)
    if datatype is None:
        raise ValueError(f"'{value.name}': ONNX type {tensor_type.elem_type} has no datatype")  # type: ignore[attr-defined]
    dims = tuple(dim.dim_value if dim.HasField("dim_value") else -1 for dim in tensor_type.shape.dim)
    return TensorConfig(value.name, datatype, dims)  # type: ignore[attr-defined]


def _ort_signature(path: Path) -> ModelSignature:
    try:
        import onnxruntime as ort
    except ImportError:
        raise ValueError("neither onnx nor onnxruntime is installed to read it") from None
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own exception types are not importable by name
        raise ValueError(f"onnxruntime cannot read it: {exc}") from exc

    def tensor(item: object) -> TensorConfig:
        kind = str(item.type).removeprefix("tensor(").removesuffix(")")  # type: ignore[attr-defined]
        if kind not in ORT_TYPES:
            raise ValueError(f"'{item.name}': {item.type} has no datatype")  # type: ignore[attr-defined]
        dims = tuple(dim if isinstance(dim, int) else -1 for dim in item.shape)  # type: ignore[attr-defined]
        return TensorConfig(item.name, ORT_TYPES[kind], dims)  # type: ignore[attr-defined]

    return ModelSignature(
        tuple(tensor(item) for item in session.get_inputs()),
        tuple(tensor(item) for item in session.get_outputs()),
    )


def needs_completion(folder: Path) -> Path | None:
    """The model.py (of the newest version) of a Python model's folder with no config.pbtxt, which
    its auto_complete_config completes (runner.triton.complete); None for any other folder."""
    if not folder.is_dir() or (folder / CONFIG_FILE).exists() or (folder / MANIFEST_FILE).exists():
        return None
    versions = sorted(
        (item for item in _numbered(folder) if (item / MODEL_FILES["python"]).is_file()),
        key=lambda item: int(item.name),
    )
    return versions[-1] / MODEL_FILES["python"] if versions else None


def _completed(folder: Path, completed: str | None) -> pb.ModelConfig:
    """A Python model's configuration as its auto_complete_config completed it (a record
    {"config": ...} or {"error": ...} of runner.triton.complete)."""
    source = f"{folder}: the configuration its auto_complete_config completed"
    if completed is None:
        raise ManifestError(str(folder / CONFIG_FILE), [("", PYTHON_AUTO_COMPLETE)])
    record = json.loads(completed)
    if "error" in record:
        raise ManifestError(source, [("", f"auto_complete_config failed: {record['error']}")])
    return parse_config_json(json.dumps(record["config"]), source)


def _backend_of_files(folder: Path) -> str:
    """The backend whose default model file a version folder holds ('' for none)."""
    for backend, filename in MODEL_FILES.items():
        if any((item / filename).is_file() for item in _numbered(folder)):
            return backend
    return ""


def _numbered(folder: Path) -> list[Path]:
    try:
        return [item for item in folder.iterdir() if item.is_dir() and VERSION.match(item.name)]
    except OSError:
        return []
