"""What a runner adds to the statistics hash after a batch, and how the gateway renders it."""

from __future__ import annotations

from fngate.statistics import BatchOutcome, increments, model_stats

MS = 1_000_000


def test_a_batch_of_two_adds_each_invocations_queue_time_and_the_batchs_compute_time() -> None:
    outcome = BatchOutcome(
        enqueued_ms=[1000, 1002], rows=[3, 1], failed=[False, False], started_ns=1005 * MS, ended_ns=1009 * MS
    )
    assert increments(outcome) == {
        "success_count": 2,
        "success_ns": 9 * MS + 7 * MS,
        "queue_count": 2,
        "queue_ns": 5 * MS + 3 * MS,
        "compute_input_count": 2,
        "compute_infer_count": 2,
        "compute_infer_ns": 2 * 4 * MS,
        "compute_output_count": 2,
        "inference_count": 4,
        "execution_count": 1,
        "batch_4_count": 1,
        "batch_4_ns": 4 * MS,
    }


def test_a_failed_invocation_counts_only_as_a_failure() -> None:
    outcome = BatchOutcome(
        enqueued_ms=[1000, 1000], rows=[1, 1], failed=[True, False], started_ns=1001 * MS, ended_ns=1002 * MS
    )
    added = increments(outcome)
    assert added["fail_count"] == 1
    assert added["fail_ns"] == 2 * MS
    assert added["success_count"] == 1
    assert added["inference_count"] == 1


def test_a_batch_that_failed_whole_is_no_execution() -> None:
    outcome = BatchOutcome(
        enqueued_ms=[1000], rows=[2], failed=[True], started_ns=1001 * MS, ended_ns=1003 * MS
    )
    assert increments(outcome) == {"fail_count": 1, "fail_ns": 3 * MS}


def test_model_stats_renders_tritons_format_with_every_field() -> None:
    raw = {
        b"success_count": b"2",
        b"success_ns": b"900",
        b"queue_count": b"2",
        b"queue_ns": b"100",
        b"inference_count": b"4",
        b"execution_count": b"1",
        b"last_inference": b"1700000000000",
        b"batch_4_count": b"1",
        b"batch_4_ns": b"400",
    }
    stats = model_stats("classifier", "1", raw)
    assert stats["name"] == "classifier"
    assert stats["version"] == "1"
    assert stats["inference_count"] == 4
    assert stats["execution_count"] == 1
    assert stats["last_inference"] == 1700000000000
    assert stats["inference_stats"]["success"] == {"count": 2, "ns": 900}
    assert stats["inference_stats"]["fail"] == {"count": 0, "ns": 0}
    assert set(stats["inference_stats"]) == {
        "success",
        "fail",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
        "cache_hit",
        "cache_miss",
    }
    assert stats["batch_stats"] == [
        {
            "batch_size": 4,
            "compute_input": {"count": 1, "ns": 0},
            "compute_infer": {"count": 1, "ns": 400},
            "compute_output": {"count": 1, "ns": 0},
        }
    ]


def test_a_version_never_run_has_zero_counts() -> None:
    stats = model_stats("classifier", "2", {})
    assert stats["inference_count"] == 0
    assert stats["inference_stats"]["success"] == {"count": 0, "ns": 0}
    assert stats["batch_stats"] == []
