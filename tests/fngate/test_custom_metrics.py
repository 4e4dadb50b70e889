"""What a model's process may report as custom metrics, what a runner keeps of it, and what a scrape
makes of the hashes: hostile reports refused whole, caps held, families merged as Triton's are."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fngate import custom_metrics, nv_metrics
from fngate.custom_metrics import Bounded, MetricError, decode_updates


def update(**fields: Any) -> dict[str, Any]:
    return {"f": "rows_total", "k": "counter", "h": "Rows", "b": [], "l": {"model": "m"}, "a": 1.0} | fields


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"f": "nv_inference_count"}, "fngate's own"),
        ({"f": "rows total"}, "not a Prometheus metric name"),
        ({"k": "summary"}, "is none of"),
        ({"l": {"le": "1"}}, "not a label name"),
        ({"l": {f"l{index}": "x" for index in range(17)}}, "at most 16"),
        ({"a": -1.0}, "not negative"),
        ({"a": float("nan")}, "not negative"),
        ({"k": "histogram", "b": [2.0, 1.0], "c": [0, 0, 1], "n": 1}, "increasing"),
        ({"k": "histogram", "b": [1.0], "c": [0, 0, 1], "n": 1}, "do not match"),
        ({"k": "histogram", "b": [1.0], "c": [0, 1], "n": 5}, "do not match"),
    ],
)
def test_a_report_that_is_not_one_is_refused_whole(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(MetricError, match=message):
        decode_updates([update(), update(**fields)])


def test_a_report_of_too_many_updates_is_refused() -> None:
    with pytest.raises(MetricError, match="at most 1024"):
        decode_updates([update()] * (custom_metrics.MAX_SERIES + 1))


def test_the_caps_on_families_and_series_hold_and_a_family_keeps_its_first_kind() -> None:
    bounds = Bounded()
    families = decode_updates(
        [update(f=f"family_{index}") for index in range(custom_metrics.MAX_FAMILIES + 1)]
    )
    refused = [bounds.admit(item) for item in families]
    assert refused[:-1] == [None] * custom_metrics.MAX_FAMILIES and "over 64" in str(refused[-1])
    (gauge,) = decode_updates([update(f="family_0", k="gauge", v=1.0)])
    assert "declared a counter" in str(bounds.admit(gauge))
    series = decode_updates(
        [update(f="family_0", l={"n": str(index)}) for index in range(custom_metrics.MAX_SERIES)]
    )
    admitted = [item for item in series if bounds.admit(item) is None]
    assert len(bounds.series) == custom_metrics.MAX_SERIES and len(admitted) == custom_metrics.MAX_SERIES - 64


def stored(updates: list[dict[str, Any]]) -> dict[bytes, bytes]:
    """A version's hash after the runner's commands (HSET, HINCRBYFLOAT) for these updates."""
    held: dict[bytes, bytes] = {}
    for command, _key, field, value in custom_metrics.commands("key", decode_updates(updates)):
        name = field.encode()
        if command == "HSET":
            held[name] = value if isinstance(value, bytes) else str(value).encode()
        else:
            held[name] = repr(float(held.get(name, b"0")) + float(value)).encode()
    return held


def test_a_scrape_merges_versions_by_family_as_triton_does() -> None:
    first = stored(
        [
            update(a=2.0),
            update(f="depth", k="gauge", h="Depth", v=7.0, a=0.0),
            update(f="took", k="histogram", h="Took", b=[1.0, 5.0], c=[1, 0, 2], n=3, a=21.5),
        ]
    )
    second = stored(
        [update(a=3.0), update(l={"model": "other"}, a=1.0), update(f="depth", k="counter", h="x")]
    )
    text = nv_metrics.render(custom_metrics.families([first, second])).decode()
    parsed = {family.name: family for family in text_string_to_metric_families(text)}
    assert parsed["rows"].type == "counter" and parsed["rows"].documentation == "Rows"
    assert {(sample.labels["model"], sample.value) for sample in parsed["rows"].samples} == {
        ("m", 5.0),
        ("other", 1.0),
    }
    assert [sample.value for sample in parsed["depth"].samples] == [
        7.0
    ]  # the counter of that name is left out
    took = {(sample.name, sample.labels.get("le")): sample.value for sample in parsed["took"].samples}
    assert took[("took_bucket", "1.0")] == 1 and took[("took_bucket", "5.0")] == 1
    assert (
        took[("took_bucket", "+Inf")] == 3
        and took[("took_sum", None)] == 21.5
        and took[("took_count", None)] == 3
    )


def test_a_scrape_holds_at_most_its_series() -> None:
    hashes = [stored([update(l={"n": str(index)}) for index in range(50)])]
    (family,) = custom_metrics.families(hashes, max_series=10)
    assert len(family.samples) == 10
