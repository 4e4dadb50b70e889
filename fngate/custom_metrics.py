"""Custom metrics of Triton Python models (`pb_utils.MetricFamily`): what a model's process reports
after each batch, how a runner adds it to Redis, and how a gateway's metrics port reads it back as
Prometheus families beside Triton's nv_* series.

Every step bounds what a model can make, since its code is the caller's: names and labels as
Prometheus takes them, at most MAX_FAMILIES families and MAX_SERIES series a function version, label
values and help texts cut to a length. The model's process refuses past the caps with a
TritonModelException that says so; the runner checks again (the process is not trusted) and drops
what is over, logged once.

In Redis, one hash a function version (keys.custom_metrics): `m|<family>` -> the family's kind, help
and buckets (JSON); `v|<family>|<labels JSON>` -> a counter's or gauge's value; a histogram's series
as `...|b<index>` (its buckets' counts, not cumulative), `...|sum` and `...|count`. Counters and
histograms are added to by every runner (HINCRBYFLOAT); a gauge is the last value set."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

from fngate.nv_metrics import Family

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
KINDS = (COUNTER, GAUGE, HISTOGRAM)
MAX_FAMILIES = 64
MAX_SERIES = 1024
"""Series (one label set of one family) a function version may have, over its families."""
MAX_BUCKETS = 32
MAX_LABELS = 16
MAX_HELP_CHARS = 1024
MAX_LABEL_VALUE_CHARS = 256
NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]{0,199}$")
LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]{0,99}$")
RESERVED = ("nv_", "fngate_")
"""Prefixes of the families fngate exports itself: a model's family may not take them."""


class MetricError(ValueError):
    """A family or series a model may not make (a bad name, a cap passed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Declared:
    """A family as a model declared it."""

    name: str
    kind: str
    help: str
    buckets: tuple[float, ...] = ()


def check_family(name: Any, kind: Any, text: Any, buckets: Any = ()) -> Declared:
    """The family, or MetricError naming what is wrong with it."""
    if not isinstance(name, str) or not NAME.match(name):
        raise MetricError(f"metric family name {str(name)[:100]!r} is not a Prometheus metric name")
    if name.startswith(RESERVED):
        raise MetricError(f"metric family name {name!r}: the prefixes {', '.join(RESERVED)} are fngate's own")
    if kind not in KINDS:
        raise MetricError(f"metric family {name!r}: kind {str(kind)[:40]!r} is none of {', '.join(KINDS)}")
    bounds = tuple(float(bound) for bound in buckets or ())
    if kind == HISTOGRAM:
        if not bounds or len(bounds) > MAX_BUCKETS:
            raise MetricError(f"metric family {name!r}: a histogram takes 1 to {MAX_BUCKETS} buckets")
        if any(not math.isfinite(bound) for bound in bounds) or list(bounds) != sorted(set(bounds)):
            raise MetricError(f"metric family {name!r}: buckets must be finite and increasing")
    return Declared(name, kind, str(text)[:MAX_HELP_CHARS], bounds if kind == HISTOGRAM else ())


def check_labels(family: str, labels: Any) -> dict[str, str]:
    """The labels of one series as strings, or MetricError."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping) or len(labels) > MAX_LABELS:
        raise MetricError(f"metric family {family!r}: labels must be a dict of at most {MAX_LABELS}")
    checked = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not LABEL.match(key) or key == "le":
            raise MetricError(f"metric family {family!r}: {str(key)[:100]!r} is not a label name it may use")
        checked[key] = str(value)[:MAX_LABEL_VALUE_CHARS]
    return checked


def series_key(labels: Mapping[str, str]) -> str:
    return orjson.dumps(dict(sorted(labels.items()))).decode()


@dataclasses.dataclass(slots=True)
class Update:
    """What one series changed by since the last report: a counter's increase, a gauge's value, a
    histogram's new observations by bucket (the last: above every bound), their sum and count."""

    family: Declared
    labels: dict[str, str]
    add: float = 0.0
    value: float | None = None
    counts: list[int] = dataclasses.field(default_factory=list)
    observed: int = 0

    def encode(self) -> dict[str, Any]:
        family = self.family
        return {
            "f": family.name,
            "k": family.kind,
            "h": family.help,
            "b": list(family.buckets),
            "l": self.labels,
            "a": self.add,
            "v": self.value,
            "c": self.counts,
            "n": self.observed,
        }


def decode_updates(raw: Any) -> list[Update]:
    """A process's report, checked as if the process had sent anything at all: what is malformed
    raises MetricError."""
    if not isinstance(raw, list) or len(raw) > MAX_SERIES:
        raise MetricError(f"a metrics report must be a list of at most {MAX_SERIES} updates")
    updates = []
    for item in raw:
        if not isinstance(item, dict):
            raise MetricError("a metrics update must be an object")
        family = check_family(item.get("f"), item.get("k"), item.get("h", ""), item.get("b") or ())
        labels = check_labels(family.name, item.get("l"))
        add, value, observed = item.get("a", 0.0), item.get("v"), item.get("n", 0)
        counts = item.get("c") or []
        if not isinstance(add, int | float) or not math.isfinite(add) or add < 0:
            raise MetricError(f"metric family {family.name!r}: an increase must be finite and not negative")
        if value is not None and (not isinstance(value, int | float) or not math.isfinite(value)):
            raise MetricError(f"metric family {family.name!r}: a value must be a finite number")
        if family.kind == HISTOGRAM and (
            not isinstance(counts, list)
            or len(counts) != len(family.buckets) + 1
            or not all(isinstance(count, int) and count >= 0 for count in counts)
            or not isinstance(observed, int)
            or observed != sum(counts)
        ):
            raise MetricError(f"metric family {family.name!r}: histogram counts do not match its buckets")
        updates.append(
            Update(family, labels, float(add), None if value is None else float(value), counts, int(observed))
        )
    return updates


class Bounded:
    """What one function version's reports may add: families and series past the caps are dropped
    (and said once by the caller); a family re-declared with another kind keeps its first."""

    def __init__(self) -> None:
        self.families: dict[str, Declared] = {}
        self.series: set[tuple[str, str]] = set()
        self.said: set[str] = set()
        """The refusals logged already (each once)."""

    def admit(self, update: Update) -> str | None:
        """None when the update may be added; else why not."""
        name = update.family.name
        known = self.families.get(name)
        if known is None:
            if len(self.families) >= MAX_FAMILIES:
                return f"over {MAX_FAMILIES} metric families"
            self.families[name] = known = update.family
        if known.kind != update.family.kind or known.buckets != update.family.buckets:
            return f"metric family {name!r} was declared a {known.kind} with other buckets or kind first"
        key = (name, series_key(update.labels))
        if key not in self.series:
            if len(self.series) >= MAX_SERIES:
                return f"over {MAX_SERIES} metric series"
            self.series.add(key)
        return None


def commands(key: str, updates: Iterable[Update]) -> list[tuple[Any, ...]]:
    """The Redis commands that add a report to the version's hash."""
    sent: list[tuple[Any, ...]] = []
    declared: dict[str, Declared] = {}
    for update in updates:
        family = update.family
        if family.name not in declared:
            declared[family.name] = family
            meta = orjson.dumps({"kind": family.kind, "help": family.help, "buckets": list(family.buckets)})
            sent.append(("HSET", key, f"m|{family.name}", meta))
        series = f"v|{family.name}|{series_key(update.labels)}"
        if family.kind == GAUGE:
            if update.value is not None:
                sent.append(("HSET", key, series, repr(update.value)))
            else:
                sent.append(("HINCRBYFLOAT", key, series, repr(update.add)))
        elif family.kind == COUNTER:
            sent.append(("HINCRBYFLOAT", key, series, repr(update.add)))
        else:
            for index, count in enumerate(update.counts):
                sent.append(("HINCRBYFLOAT", key, f"{series}|b{index}", count))
            sent.append(("HINCRBYFLOAT", key, f"{series}|sum", repr(update.add)))
            sent.append(("HINCRBYFLOAT", key, f"{series}|count", update.observed))
    return sent


@dataclasses.dataclass(slots=True)
class _Merged:
    kind: str
    help: str
    buckets: tuple[float, ...]
    samples: list[tuple[str, tuple[tuple[str, str], ...], float]]
    """(the sample name's suffix: '' or _bucket, _sum, _count; labels; value)"""


def families(hashes: Sequence[Mapping[bytes, bytes]], max_series: int = 10 * MAX_SERIES) -> list[Family]:
    """The families of every version's hash, merged by name (as Triton's are: one name, one family
    for the whole server); a family declared again with another kind is left out of the later
    hashes. At most `max_series` series in all."""
    found: dict[str, _Merged] = {}
    plain: dict[tuple[str, str], float] = {}
    """A counter's or gauge's series by (family, labels): a counter's summed over the hashes, a
    gauge's as the last hash holds it."""
    histograms: dict[tuple[str, str], dict[str, float]] = {}
    for raw in hashes:
        fields = {key.decode(errors="replace"): value for key, value in raw.items()}
        own = _declare(fields, found)
        for field, value in fields.items():
            name, _, rest = field.removeprefix("v|").partition("|")
            if not field.startswith("v|") or name not in own:
                continue
            try:
                number = float(value)
            except ValueError:
                continue
            if found[name].kind == HISTOGRAM:
                key, _, part = rest.rpartition("|")
                parts = histograms.setdefault((name, key), {})
                parts[part] = parts.get(part, 0.0) + number
                continue
            summed = found[name].kind == COUNTER
            plain[(name, rest)] = plain.get((name, rest), 0.0) * summed + number
    series = 0
    for (name, key), number in sorted(plain.items()):
        labels = _labels(key)
        if labels is not None and series < max_series:
            series += 1
            found[name].samples.append(("", labels, number))
    for (name, key), parts in sorted(histograms.items()):
        labels = _labels(key)
        if labels is not None and series < max_series:
            series += 1
            _histogram(found[name], labels, parts)
    return [
        Family(
            name,
            merged.help,
            merged.kind,
            tuple((labels, value) for _, labels, value in merged.samples),
            tuple(suffix for suffix, _, _ in merged.samples),
        )
        for name, merged in sorted(found.items())
        if merged.samples
    ]


def _declare(fields: Mapping[str, bytes], found: dict[str, _Merged]) -> set[str]:
    """The families one hash declares that are merged: new ones, and those of the same kind."""
    own = set()
    for field, value in fields.items():
        if not field.startswith("m|"):
            continue
        name = field[2:]
        try:
            meta = orjson.loads(value)
            declared = check_family(name, meta.get("kind"), meta.get("help", ""), meta.get("buckets") or ())
        except (orjson.JSONDecodeError, MetricError, AttributeError, TypeError, ValueError):
            continue
        known = found.setdefault(name, _Merged(declared.kind, declared.help, declared.buckets, []))
        if (known.kind, known.buckets) == (declared.kind, declared.buckets):
            own.add(name)
    return own


def _histogram(family: _Merged, labels: tuple[tuple[str, str], ...], parts: Mapping[str, float]) -> None:
    """A histogram series' samples: cumulative buckets (the last +Inf), its sum and count."""
    total = 0.0
    for index, bound in enumerate((*family.buckets, math.inf)):
        total += parts.get(f"b{index}", 0.0)
        le = "+Inf" if bound == math.inf else repr(bound)
        family.samples.append(("_bucket", (*labels, ("le", le)), total))
    family.samples.append(("_sum", labels, parts.get("sum", 0.0)))
    family.samples.append(("_count", labels, parts.get("count", 0.0)))


def _labels(text: str) -> tuple[tuple[str, str], ...] | None:
    try:
        labels = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(labels, dict):
        return None
    return tuple(sorted((str(key), str(value)) for key, value in labels.items()))
