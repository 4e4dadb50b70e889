"""The in-process limit: the same ONNX model called directly by onnxruntime, batch by batch."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort


def session(model: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])


def measure(model: Path, features: int, batch: int, threads: int, seconds: float) -> dict[str, float]:
    """Rows per second and p50/p99 latency of one `run` call at this batch size."""
    runner = session(model, threads)
    rng = np.random.default_rng(batch)
    inputs = [rng.standard_normal((batch, features), dtype=np.float32) for _ in range(16)]
    for x in inputs:
        runner.run(None, {"input": x})
    latencies: list[int] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        x = inputs[len(latencies) % len(inputs)]
        t0 = time.perf_counter_ns()
        runner.run(None, {"input": x})
        latencies.append(time.perf_counter_ns() - t0)
    elapsed = time.perf_counter() - started
    array = np.asarray(latencies) / 1e6
    return {
        "rows_per_s": len(latencies) * batch / elapsed,
        "p50_ms": float(np.percentile(array, 50)),
        "p99_ms": float(np.percentile(array, 99)),
    }
