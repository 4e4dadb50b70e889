"""Process-wide telemetry set-up: logs (human-readable lines on a terminal, JSON lines with trace
ids otherwise), OpenTelemetry traces over OTLP/HTTP when the standard OTEL_* variables ask for
them, and Prometheus metric names.

With no OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or
OTEL_TRACES_EXPORTER=otlp or console) set, no SDK is loaded: spans come from the API's no-op
tracer. OTEL_TRACES_EXPORTER=console writes each span to stderr as it ends: traces for a developer
with no collector.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
"""Histogram buckets (seconds) shared by gateway and runner latency metrics."""


EXPORTERS = ("otlp", "console")


def exporters(environ: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters the standard variables ask for, of EXPORTERS: OTEL_TRACES_EXPORTER's
    comma-separated list ("none": none), else OTLP where an OTLP endpoint is set."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return []
    named = [item.strip().lower() for item in env.get("OTEL_TRACES_EXPORTER", "").split(",") if item.strip()]
    if named:
        return [item for item in EXPORTERS if any(name.startswith(item) for name in named)]
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return ["otlp"] if endpoint else []


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    return bool(exporters(environ))


def interactive() -> bool:
    """stderr is a terminal: logs are for a person (and the gateway writes an access log)."""
    return sys.stderr.isatty()


ACCESS_LOG_FORMAT = '%(h)s "%(r)s" %(s)s %(b)s bytes %(D)s us'
"""Hypercorn's access log line (on a terminal): client, request line, status, size, duration."""


QUIET_LOGGERS = ("hpack", "h2")
"""HTTP/2's libraries log every header block they decode, values (API keys) included, at DEBUG:
never below INFO, whatever the level asked for."""


def configure(service: str, level: str) -> None:
    """Logging and, where asked for, tracing for one process; call once from __main__."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ConsoleFormatter(service) if interactive() else JsonFormatter(service))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.INFO, logging.getLogger().level))
    wanted = exporters()
    if not wanted or _has_sdk_provider():
        return
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    resource = Resource.create({"service.name": f"fngate-{service}", "service.namespace": "fngate"})
    resource = resource.merge(OTELResourceDetector().detect())  # OTEL_SERVICE_NAME and friends win
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    if "otlp" in wanted:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if "console" in wanted:  # each span as it ends, for a person watching
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    trace.set_tracer_provider(provider)


def tracing_active() -> bool:
    """An SDK tracer provider is installed (configure() found tracing requested)."""
    return _has_sdk_provider()


def _has_sdk_provider() -> bool:
    return hasattr(trace.get_tracer_provider(), "add_span_processor")


def shutdown() -> None:
    """Flush spans still buffered (at process exit)."""
    provider = trace.get_tracer_provider()
    stop = getattr(provider, "shutdown", None)
    if callable(stop):
        stop()


def inject(context: Context | None = None) -> str | None:
    """The W3C traceparent of the current span (or of `context`'s), for a message that crosses the
    queue."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier.get("traceparent")


def extract(traceparent: str | None) -> Context | None:
    """The remote parent a traceparent names (None when there is none)."""
    return propagate.extract({"traceparent": traceparent}) if traceparent else None


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the trace and span ids of the current span when there is one,
    and the record's own `fields` (logger.info(..., extra={"fields": {...}}))."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self._service,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):  # a record's own fields (extra={"fields": ...}); never over the above
            line.update({key: value for key, value in fields.items() if key not in line})
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            line["trace_id"] = f"{context.trace_id:032x}"
            line["span_id"] = f"{context.span_id:016x}"
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


class ConsoleFormatter(logging.Formatter):
    """`12:00:01.234 INFO  gateway  message`, with the traceback below when there is one."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        line = f"{stamp} {record.levelname:<7} {self._service:<8} {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line += "".join(f" {key}={value}" for key, value in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line
