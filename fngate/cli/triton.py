"""`fngate import-triton REPO OUT`, and `fngate validate` and `fngate deploy` of a Triton model
repository: each model folder read as the gateway and runners read it (fngate.triton), every
field fngate does not honour named in a warning."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

import yaml

from fngate.manifest import MANIFEST_FILE, FunctionManifest, ManifestError
from fngate.process import module_command
from fngate.repository import FunctionVersion as Version
from fngate.repository import is_triton_model, make_record, problem_of

ModelCheck = Callable[[FunctionManifest, Path], list[str]]


def model_folders(path: Path) -> list[Path]:
    """The Triton model folders of a repository folder, or the folder itself when it is one."""
    if is_triton_model(path):
        return [path]
    if not path.is_dir():
        return []
    return [folder for folder in sorted(path.iterdir()) if folder.is_dir() and is_triton_model(folder)]


def is_triton_repository(path: Path) -> bool:
    return path.is_dir() and bool(model_folders(path))


def served(folder: Path, completed: str | None = None) -> tuple[FunctionManifest, str, list[str]]:
    """A model folder's newest served version: its manifest, its number, and the warnings (a Python
    model with no config.pbtxt as its auto_complete_config completes it, or as `completed` records
    it already). Raises ManifestError."""
    from fngate.triton.models import read_model

    model = read_model(folder, completed=completed if completed is not None else auto_completed(folder))
    record = make_record([Version(item.manifest, item.version, folder) for item in model.versions])
    chosen = record.default or record.newest()
    return chosen.manifest, chosen.version, list(model.warnings)


AUTO_COMPLETE_TIMEOUT_S = 180


def auto_completed(folder: Path) -> str | None:
    """For a Python model's folder with no config.pbtxt, what its auto_complete_config answers, run
    by `python -m runner.triton.complete --print` (a confined process of its own, as on `fngate up`)
    as fngate.triton.models.read_model takes it; None for any other folder."""
    from fngate.triton.models import needs_completion

    if needs_completion(folder) is None:
        return None
    command = module_command("runner.triton.complete", "--print", str(folder))
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=AUTO_COMPLETE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return json.dumps({"error": f"it did not answer within {AUTO_COMPLETE_TIMEOUT_S} s"})
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {done.returncode}"
        return json.dumps({"error": reason.removeprefix(f"{folder}: auto_complete_config failed: ")})
    return json.dumps({"config": json.loads(done.stdout)})


def import_repository(repo: Path, out: Path, err: TextIO) -> list[Path]:
    """Write OUT/{function}/function.yaml for each model of `repo`, with the files of its newest
    served version under OUT/{function}/{version}/ (where Triton had them, so that a model.py finds
    its files where it looked before). Returns the manifests written; raises ManifestError for
    the first model that cannot be served."""
    written = []
    for folder in model_folders(repo):
        manifest, version, warnings = served(folder)
        for warning in warnings:
            print(f"fngate import-triton: warning: {warning}", file=err)
        target = out / manifest.name
        if target.exists():
            raise ManifestError(str(target), [("", "exists already; import into an empty folder")])
        target.mkdir(parents=True)
        if manifest.pipeline is None:
            shutil.copytree(folder / version, target / version, ignore=shutil.ignore_patterns("__pycache__"))
        document = manifest.model_dump(mode="json", exclude_defaults=True)
        (target / MANIFEST_FILE).write_text(
            f"# Imported from the Triton model {folder} (version {version}).\n"
            + yaml.safe_dump(document, sort_keys=False)
        )
        written.append(target / MANIFEST_FILE)
    return written


def validate_repository(
    path: Path,
    out: TextIO,
    err: TextIO,
    check: ModelCheck | None = None,
    completed: Mapping[str, str] | None = None,
) -> int:
    """`fngate validate` of a Triton model repository (or one model folder): every problem and
    every warning; 2 when a model cannot be served. `check`: what else to find wrong with an ONNX
    model's manifest against its file (fngate validate's onnx_problems); `completed`: the Python
    models' completed configurations already made, by folder name."""
    failed = 0
    for folder in model_folders(path):
        try:
            manifest, version, warnings = served(folder, (completed or {}).get(folder.name))
        except Exception as exc:  # whatever it is, this model's alone
            failed += 1
            print(problem_of(folder, exc), file=err)
            continue
        for warning in warnings:
            print(f"{warning} (warning)", file=err)
        problems = []
        if check is not None and manifest.pipeline is None and manifest.model.backend == "onnxruntime":
            problems = check(manifest, folder / manifest.model.path)
        for problem in problems:
            print(f"{folder}: {problem}", file=err)
        failed += bool(problems)
        kind = (
            manifest.model.backend
            if manifest.pipeline is None
            else f"ensemble of {len(manifest.pipeline.steps)} steps"
        )
        if not problems:
            print(
                f"{folder}: ok ({manifest.model_name} as {manifest.name} version {version}, {kind})", file=out
            )
    return 2 if failed else 0


def deploy_paths(
    paths: Sequence[Path], err: TextIO
) -> tuple[list[Path], tempfile.TemporaryDirectory[str] | None]:
    """`fngate deploy` of Triton repositories: each imported into a temporary folder first (kept
    until the returned directory is cleaned up); manifests pass through as they are."""
    if not any(is_triton_repository(path) for path in paths):
        return list(paths), None
    staging = tempfile.TemporaryDirectory(prefix="fngate-import-")
    manifests: list[Path] = []
    for index, path in enumerate(paths):
        if is_triton_repository(path):
            manifests += import_repository(path, Path(staging.name) / str(index), err)
        else:
            manifests.append(path)
    return manifests, staging
