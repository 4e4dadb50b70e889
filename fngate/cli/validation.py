"""`fngate validate`: every check deploy makes on a manifest, plus its tensors against the ONNX
graph it names (onnx is a dev extra, imported lazily). Every problem is reported at once; in a
repository folder, each function's or Triton model's folder is read on its own, as `fngate up`
reads it, so that one that cannot be read is named and the others are still checked."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from fngate.manifest import MANIFEST_FILE, FunctionManifest, ManifestError, TensorSpec, load_manifest
from fngate.pipeline import Problem, edge_problems
from fngate.repository import FolderRepository, FunctionRecord, is_triton_model, problem_of
from fngate.tensors import ONNX_DATATYPES


def validate_files(files: Sequence[Path], out: TextIO, err: TextIO) -> int:
    """Print `file: where: problem` lines for every file; exit code 2 when any has a problem."""
    failed = 0
    notes: set[str] = set()
    for path in files:
        if path.is_dir():  # a repository folder, or one function's or model's folder
            failed += validate_folder(path, out, err, notes)
            continue
        try:
            failed += validate_manifest(path, out, err, notes)
        except Exception as exc:  # a fault of fngate's reading: still named, with its file
            failed += 1
            print(problem_of(path, exc), file=err)
    for note in sorted(notes):
        print(f"fngate validate: note: {note}", file=err)
    return 2 if failed else 0


def validate_manifest(path: Path, out: TextIO, err: TextIO, notes: set[str]) -> int:
    """One manifest's problems, or its ok line; 1 when it has a problem."""
    problems, note = check(path)
    if note:
        notes.add(note)
    for line in problems:
        print(line, file=err)
    if problems:
        return 1
    manifest = load_manifest(path)
    kind = (
        manifest.model.backend
        if manifest.pipeline is None
        else f"pipeline of {len(manifest.pipeline.steps)} steps"
    )
    print(f"{path}: ok ({manifest.name}, {kind})", file=out)
    return 0


def validate_folder(path: Path, out: TextIO, err: TextIO, notes: set[str]) -> int:
    """A repository folder, or one function's or Triton model's folder: each function's folder read
    as `fngate up` reads it (fngate.repository), then checked as deploy checks it. Returns how
    many could not be read or have a problem."""
    single = (path / MANIFEST_FILE).is_file() or is_triton_model(path)
    folders = [path] if single else sorted(item for item in path.iterdir() if item.is_dir())
    repository = FolderRepository(path.parent if single else path)
    from fngate.cli.triton import auto_completed

    completed = {folder.name: auto_completed(folder) for folder in folders}
    repository.completed = {name: record for name, record in completed.items() if record is not None}
    failed = 0
    for folder in folders:
        try:
            record, _ = repository.read_folder(folder)
            if record is not None:
                failed += _check_folder(folder, record, out, err, notes, repository.completed)
        except Exception as exc:  # whatever it is, this folder's alone
            failed += 1
            print(problem_of(folder, exc), file=err)
    return failed


def _check_folder(
    folder: Path,
    record: FunctionRecord,
    out: TextIO,
    err: TextIO,
    notes: set[str],
    completed: Mapping[str, str],
) -> int:
    if (folder / MANIFEST_FILE).is_file():
        return validate_manifest(folder / MANIFEST_FILE, out, err, notes)
    if not is_triton_model(folder):  # deployed versions: read as their index documents say
        print(f"{folder}: ok ({record.name}, versions {', '.join(record.versions)})", file=out)
        return 0
    from fngate.cli.triton import validate_repository

    try:
        import onnx  # noqa: F401 (only whether it is installed)

        compare: Any = onnx_problems
    except ImportError:
        compare = None
        notes.add("onnx is not installed (pip install onnx), so tensors were not compared with the models")
    return int(bool(validate_repository(folder, out, err, compare, completed)))


def check(path: Path) -> tuple[list[str], str]:
    """Every problem of one manifest as printable lines, and a note on what was not checked."""
    try:
        manifest = load_manifest(path)
    except ManifestError as exc:
        return list(exc.lines()), ""
    problems = [f"{path}: {problem}" for problem in policy_problems(manifest)]
    if manifest.pipeline is not None:
        graph, note = pipeline_problems(path, manifest)
        return problems + [f"{path}: {where}: {problem}" for where, problem in graph], note
    model = path.parent / manifest.model.path
    if not model.is_file():
        problems.append(f"{path}: model.path: {model} does not exist")
        return problems, ""
    note = ""
    if manifest.model.backend == "onnxruntime":
        try:
            found = onnx_problems(manifest, model)
        except ImportError:
            note = "onnx is not installed (pip install onnx), so tensors were not compared with the models"
            found = []
        problems += [f"{path}: {problem}" for problem in found]
    return problems, note


def pipeline_problems(path: Path, manifest: FunctionManifest) -> tuple[list[Problem], str]:
    """The pipeline's graph, and each step against the function it calls when that function's
    manifest is in a folder beside the pipeline's (as in functions/); a note names those not found."""
    if manifest.pipeline is None:  # (its graph was checked when it was read)
        return [], ""
    beside: dict[str, FunctionManifest] = {}
    for candidate in sorted(path.resolve().parent.parent.glob(f"*/{MANIFEST_FILE}")):
        try:
            found = load_manifest(candidate)
        except ManifestError:
            continue
        beside.setdefault(found.name, found)
    functions = {step.name: beside.get(step.function_name) for step in manifest.pipeline.steps}
    missing = sorted({step.function_name for step in manifest.pipeline.steps if functions[step.name] is None})
    checked = {name: function for name, function in functions.items() if function is not None}
    edges = [item for item in edge_problems(manifest, checked) if not item[1].endswith("is not deployed")]
    note = ""
    if missing:
        note = (
            f"{path}: functions {', '.join(missing)} are not in folders beside it, so their steps were "
            "not checked (deploy checks them against the repository)"
        )
    return edges, note


def policy_problems(manifest: FunctionManifest) -> list[str]:
    """The version policy checks that need no repository (deploy adds those against stored versions)."""
    versions = manifest.versions
    problems = []
    if versions.policy == "specific" and not versions.specific:
        problems.append("versions.specific: name at least one version for policy 'specific'")
    if versions.traffic and sum(versions.traffic.values()) != 100:
        problems.append(f"versions.traffic: weights add up to {sum(versions.traffic.values())}, not 100")
    return problems


def onnx_problems(manifest: FunctionManifest, model: Path) -> list[str]:
    """Names, datatypes and shapes of the manifest's inputs and outputs against the ONNX graph."""
    import onnx

    try:
        graph = onnx.load(str(model), load_external_data=False).graph
    except Exception as exc:
        return [f"model.path: {model} is not an ONNX model ({type(exc).__name__}: {exc})"]
    initializers = {item.name for item in graph.initializer}
    problems: list[str] = []
    for kind, specs, values in (
        ("inputs", manifest.inputs, [item for item in graph.input if item.name not in initializers]),
        ("outputs", manifest.outputs, list(graph.output)),
    ):
        declared = {item.name: item for item in values}
        for index, spec in enumerate(specs):
            value = declared.get(spec.name)
            if value is None:
                problems.append(
                    f"{kind}[{index}].name: the model has no {kind[:-1]} '{spec.name}' "
                    f"(its {kind}: {', '.join(sorted(declared)) or 'none'})"
                )
                continue
            problems += [f"{kind}[{index}].{problem}" for problem in _tensor_problems(spec, value)]
        named = {spec.name for spec in specs}
        missing = [name for name in declared if name not in named]
        if kind == "inputs" and missing:
            problems.append(
                f"inputs: the model also takes {', '.join(missing)}, which the manifest does not name"
            )
    return problems


def _tensor_problems(spec: TensorSpec, value: Any) -> list[str]:
    tensor_type = value.type.tensor_type
    problems = []
    datatype = ONNX_DATATYPES.get(tensor_type.elem_type, f"ONNX type {tensor_type.elem_type}")
    if datatype != spec.datatype:
        problems.append(f"datatype: {spec.datatype}, but the model's '{spec.name}' is {datatype}")
    if tensor_type.HasField("shape"):
        dims = [dim.dim_value if dim.HasField("dim_value") else -1 for dim in tensor_type.shape.dim]
        if len(dims) != len(spec.shape):
            problems.append(
                f"shape: {list(spec.shape)} has rank {len(spec.shape)}, the model's {dims} rank {len(dims)}"
            )
        else:
            clashes = [
                axis
                for axis, (mine, theirs) in enumerate(zip(spec.shape, dims, strict=True))
                if theirs not in (-1, mine)  # a -1 where the model is fixed fails other sizes
            ]
            if clashes:
                problems.append(f"shape: {list(spec.shape)}, but the model's '{spec.name}' is {dims}")
    return problems
