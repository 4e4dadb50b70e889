"""What `fngate deploy` prints: the example request body, the progress of a large upload, and a
warning when a model is large enough for its load to outlast its limits."""

from __future__ import annotations

import io
from pathlib import Path

import orjson

from fngate.cli.deploy import LARGE_BYTES, ProgressBar, example_body, load_warning
from fngate.manifest import FunctionManifest, load_manifest

ROOT = Path(__file__).resolve().parents[3]


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


def test_a_model_whose_load_may_outlast_load_timeout_s_is_warned_about() -> None:
    manifest = load_manifest(ROOT / "functions" / "classifier" / "function.yaml")
    assert load_warning(manifest, 3000) == ""  # a few KB
    assert load_warning(manifest, 268_000_000) == ""  # the model: seconds, under 120 s
    warning = load_warning(manifest, 20_000_000_000)
    assert "model.load_timeout_s of 120 s" in warning and "18.6 GiB" in warning
    patient = manifest.model_copy(
        update={"model_spec": manifest.model.model_copy(update={"load_timeout_s": 3600})}
    )
    assert load_warning(patient, 20_000_000_000) == ""
