"""What `fngate deploy` prints: the example request body, and the progress of a large upload."""

from __future__ import annotations

import io
from pathlib import Path

import orjson

from fngate.manifest import FunctionManifest, load_manifest
from fngate.tools.deploy import LARGE_BYTES, ProgressBar, example_body

ROOT = Path(__file__).resolve().parent.parent.parent


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_example_body_is_one_row_of_zeros() -> None:
    body = example_body(load_manifest(ROOT / "functions" / "classifier" / "function.yaml"))
    assert body is not None
    assert orjson.loads(body) == {"inputs": {"input": [[0.0] * 16]}}


def test_no_example_body_for_large_inputs() -> None:
    manifest = FunctionManifest.model_validate(
        {
            "name": "vision",
            "model": {"backend": "onnxruntime", "path": "model.onnx"},
            "inputs": [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}],
        }
    )
    assert example_body(manifest) is None


def test_a_large_upload_shows_its_progress_on_a_terminal() -> None:
    terminal = Terminal()
    bar = ProgressBar(LARGE_BYTES * 2, terminal, "big: uploading")
    bar(LARGE_BYTES)
    bar(LARGE_BYTES)
    bar.close()
    assert terminal.getvalue().endswith("\rbig: uploading [" + "#" * 30 + "] 100% 16.0 MiB of 16.0 MiB\n")
    assert "50%" in terminal.getvalue()


def test_small_uploads_and_logs_get_no_progress_bar() -> None:
    small, log = Terminal(), io.StringIO()
    for stream, total in ((small, LARGE_BYTES - 1), (log, LARGE_BYTES * 2)):
        bar = ProgressBar(total, stream, "x")
        bar(total)
        bar.close()
        assert stream.getvalue() == ""
