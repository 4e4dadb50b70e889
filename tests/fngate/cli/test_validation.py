"""`fngate validate` finds what deploy would refuse and what only the first invocation would show."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import yaml

from fngate.cli.validation import validate_files

ROOT = Path(__file__).resolve().parents[3]


def classifier(tmp_path: Path, **changes: object) -> Path:
    folder = tmp_path / "classifier"
    shutil.copytree(ROOT / "functions" / "classifier", folder)
    doc = yaml.safe_load((folder / "function.yaml").read_text())
    doc.update(changes)
    (folder / "function.yaml").write_text(yaml.safe_dump(doc))
    return folder / "function.yaml"


def validate(*paths: Path) -> tuple[int, list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    code = validate_files(list(paths), out, err)
    return code, err.getvalue().splitlines(), out.getvalue()


def test_the_examples_are_valid() -> None:
    examples = sorted((ROOT / "functions").glob("*/function.yaml"))
    code, problems, out = validate(*examples)
    assert (code, problems) == (0, [])
    assert out.count(": ok (") == len(examples) >= 3


def test_every_problem_at_once(tmp_path: Path) -> None:
    path = classifier(
        tmp_path,
        inputs=[{"name": "features", "datatype": "FP64", "shape": [-1, 8]}],
        outputs=[{"name": "probabilities", "datatype": "FP32", "shape": [-1, -1]}],
        versions={"policy": "all", "traffic": {1: 60, 2: 30}},
    )
    code, problems, _ = validate(path)
    assert code == 2
    assert problems == [
        f"{path}: versions.traffic: weights add up to 90, not 100",
        f"{path}: inputs[0].name: the model has no input 'features' (its inputs: input)",
        f"{path}: inputs: the model also takes input, which the manifest does not name",
        f"{path}: outputs[0].shape: [-1, -1], but the model's 'probabilities' is [-1, 4]",
    ]


def test_datatype_and_shape_against_the_model(tmp_path: Path) -> None:
    path = classifier(tmp_path, inputs=[{"name": "input", "datatype": "FP16", "shape": [-1, 8]}])
    code, problems, _ = validate(path)
    assert code == 2
    assert problems == [
        f"{path}: inputs[0].datatype: FP16, but the model's 'input' is FP32",
        f"{path}: inputs[0].shape: [-1, 8], but the model's 'input' is [-1, 16]",
    ]


def test_a_missing_model_file(tmp_path: Path) -> None:
    path = classifier(tmp_path, model={"backend": "onnxruntime", "path": "missing.onnx"})
    code, problems, _ = validate(path)
    assert code == 2
    assert problems == [f"{path}: model.path: {path.parent / 'missing.onnx'} does not exist"]
