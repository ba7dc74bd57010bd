"""OpenTelemetry traces of the gateway: one trace per request, a span per attempt.

    POST /v1/chat/completions            (the request: tenant, model, token counts, outcome)
      admission                          (tokenize, context check, quota)
      queue                              (waiting for a replica's engine to grant KV)
      kv_handoff                         (decode-pool placements: prefill replica, bytes, seconds, GB/s, outcome)
      attempt                            (replica, attempt number, lease blocks, cached tokens expected)
        prefill                          (sent -> first token from the replica)
        decode                           (first token -> last token)
      stream                             (first byte to the client -> [DONE])

The attempt's context travels to the replica in `traceparent`, so a replica that traces joins the
same trace; an incoming `traceparent` makes the gateway's span its child. Spans go to a JSON-lines
file (`--trace-file`) or an OTLP/HTTP endpoint (`--otlp-endpoint`, needs the
opentelemetry-exporter-otlp-proto-http package). Attributes carry counts and ids, never prompt text.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

TRACER_NAME = "meshserve.gateway"


class JSONLinesSpanExporter(SpanExporter):
    """One span per line: names, ids, parent, times (ns), attributes, events, status."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(s), separators=(",", ":")) for s in spans]
        with self._lock:
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def span_record(span: ReadableSpan) -> dict[str, object]:
    ctx = span.get_span_context()  # None only for a ReadableSpan built by hand, never one the SDK ended
    start, end = span.start_time, span.end_time
    return {"name": span.name, "trace_id": f"{ctx.trace_id:032x}" if ctx is not None else None,
            "span_id": f"{ctx.span_id:016x}" if ctx is not None else None,
            "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
            "start_ns": start, "end_ns": end,
            "duration_ms": round((end - start) / 1e6, 3) if end and start is not None else None,
            "attributes": dict(span.attributes or {}),
            "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
            "status": span.status.status_code.name}


def setup_tracing(trace_file: str | None, otlp_endpoint: str | None) -> TracerProvider | None:
    """A provider exporting where asked (None: spans are not recorded, traceparent still passes)."""
    if trace_file is None and otlp_endpoint is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "meshserve-gateway"}))
    if trace_file is not None:
        provider.add_span_processor(BatchSpanProcessor(JSONLinesSpanExporter(trace_file), schedule_delay_millis=500))
    if otlp_endpoint is not None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )
        except ImportError:
            raise ValueError("--otlp-endpoint needs the OTLP exporter: pip install 'meshserve[otlp]' "
                             "(opentelemetry-exporter-otlp-proto-http)") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider


class Tracing:
    def __init__(self, provider: TracerProvider | None) -> None:
        self.provider = provider
        self.tracer = (provider or trace.NoOpTracerProvider()).get_tracer(TRACER_NAME)

    @staticmethod
    def incoming(headers: Mapping[str, str]) -> Context:
        """The caller's trace context (from traceparent), if it sent one."""
        return propagate.extract({k.lower(): v for k, v in headers.items()})

    @staticmethod
    def outgoing(span: trace.Span) -> dict[str, str]:
        """Headers that make the replica's work part of `span`'s trace."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
