"""The benchmark's plot, throughput.png: fngate's own scenarios against concurrency, or, for a run
of the Triton scenarios alone, each server at its better delay and their ratio (the pairing is
bench/report.py's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import Row, at_better_delay, closed_pairs


def against_triton_series(rows: list[Row]) -> dict[str, list[tuple[int, float, float]]]:
    """What a run beside Triton plots: for each protocol and model, (clients, fngate req/s, Triton
    req/s) with each server at its better delay."""
    series: dict[str, list[tuple[int, float, float]]] = {}
    for (protocol, model, concurrency), (ours, theirs) in at_better_delay(closed_pairs(rows)).items():
        series.setdefault(f"{model}, {protocol}", []).append(
            (int(concurrency), float(ours["req_per_s"]), float(theirs["req_per_s"]))
        )
    return {label: sorted(points) for label, points in series.items()}


def draw(path: Path, rows: list[Row]) -> None:
    """fngate's own scenarios against concurrency; a run of the Triton scenarios alone, each
    server at its better delay and their ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "tiny (fngate, binary)": [r for r in rows if r.get("scenario") == "S1" and r.get("body") == "binary"],
        "wide, batching (fngate)": [
            r
            for r in rows
            if r.get("scenario") == "S2" and r.get("function") == "wide" and r.get("body") == "binary"
        ],
        "wide, no batching (fngate)": [r for r in rows if r.get("function") == "wide-nobatch"],
    }
    in_process = [r for r in rows if r.get("scenario") == "in-process"]
    beside = against_triton_series(rows)
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if beside and not in_process and not any(series.values()):
        _draw_against_triton(axes, beside)
    else:
        _draw_own(axes, series, in_process)
    for axis in axes:
        axis.grid(True, which="both", alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _draw_own(axes: Any, series: dict[str, list[Row]], in_process: list[Row]) -> None:
    for label, unsorted in series.items():
        points = sorted(unsorted, key=lambda r: r["concurrency"])
        if not points:
            continue
        x = [p["concurrency"] for p in points]
        axes[0].plot(x, [p["req_per_s"] for p in points], marker="o", label=label)
        axes[1].plot(x, [p["p50_ms"] for p in points], marker="o", label=f"{label} p50")
        axes[1].plot(x, [p["p99_ms"] for p in points], marker="x", linestyle="--", label=f"{label} p99")
    for name in ("tiny", "wide"):
        limits = sorted((r for r in in_process if r.get("function") == name), key=lambda r: r["batch"])
        if limits:
            axes[0].plot(
                [r["batch"] for r in limits],
                [r["req_per_s"] for r in limits],
                linestyle=":",
                marker="s",
                label=f"{name}: onnxruntime in-process (batch = c)",
            )
    axes[0].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="requests/s", title="throughput")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="latency")


def _draw_against_triton(axes: Any, beside: dict[str, list[tuple[int, float, float]]]) -> None:
    for label, points in beside.items():
        clients = [point[0] for point in points]
        line = axes[0].plot(clients, [point[1] for point in points], marker="o", label=f"fngate: {label}")
        color = line[0].get_color()
        axes[0].plot(clients, [point[2] for point in points], marker="x", linestyle="--", color=color)
        axes[1].plot(clients, [point[1] / point[2] for point in points], marker="o", color=color, label=label)
    axes[1].axhline(1.0, color="black", linewidth=0.8)
    title = "throughput at each server's better delay (dashed: Triton)"
    axes[0].set(xscale="log", yscale="log", xlabel="clients", ylabel="requests/s", title=title)
    axes[1].set(xscale="log", xlabel="clients", ylabel="fngate / Triton", title="ratio, like for like")
