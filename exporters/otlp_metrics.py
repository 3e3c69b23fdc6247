"""Push the self-metrics over OTLP on an interval.

The metrics live in one prometheus_client registry (``Telemetry``); rather than
declaring each of them a second time with the OpenTelemetry metrics SDK (two sources
of truth that could drift), every push collects the registry and converts its samples
into an ``ExportMetricsServiceRequest``: counters become cumulative monotonic sums
(start time from the counter's ``_created`` sample), gauges become gauges, histograms
become explicit-bucket histograms (Prometheus' cumulative ``le`` buckets turned into
per-bucket counts).

Values are cumulative, so a failed push is not retried: the next push carries
everything the failed one would have. Failures are counted in
``exporter_failures{exporter="otlp_metrics"}``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from prometheus_client import CollectorRegistry

from exporters.base import FailureLog, describe_error, init_exporter_metrics
from exporters.config import OtlpMetricsConfig
from exporters.otlp_transport import OtlpTransport
from exporters.resource import resource_attributes
from processor._version import __version__
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import Violation

log = logging.getLogger("durable_check.exporters")

_NS = 1_000_000_000


def _attributes(labels: dict[str, str]) -> list[KeyValue]:
    return [KeyValue(key=k, value=AnyValue(string_value=v)) for k, v in sorted(labels.items())]


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def _created_times(family: Any) -> dict[tuple[tuple[str, str], ...], int]:
    return {
        _key(s.labels): int(s.value * _NS)
        for s in family.samples if s.name == family.name + "_created"
    }


def _counter(family: Any, now_ns: int, default_start_ns: int) -> Metric:
    created = _created_times(family)
    points = [
        NumberDataPoint(
            attributes=_attributes(s.labels),
            start_time_unix_nano=created.get(_key(s.labels), default_start_ns),
            time_unix_nano=now_ns,
            as_double=float(s.value),
        )
        for s in family.samples if s.name == family.name + "_total"
    ]
    return Metric(
        name=family.name, description=family.documentation,
        sum=Sum(data_points=points, is_monotonic=True,
                aggregation_temporality=AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE),
    )


def _gauge(family: Any, now_ns: int) -> Metric:
    points = [
        NumberDataPoint(attributes=_attributes(s.labels), time_unix_nano=now_ns, as_double=float(s.value))
        for s in family.samples if s.name == family.name
    ]
    return Metric(name=family.name, description=family.documentation, gauge=Gauge(data_points=points))


def _histogram(family: Any, now_ns: int, default_start_ns: int) -> Metric:
    created = _created_times(family)
    buckets: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    sums: dict[tuple[tuple[str, str], ...], float] = {}
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    for s in family.samples:
        if s.name == family.name + "_bucket":
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            buckets.setdefault(_key(labels), []).append((float(s.labels["le"]), float(s.value)))
        elif s.name == family.name + "_sum":
            sums[_key(s.labels)] = float(s.value)
        elif s.name == family.name + "_count":
            counts[_key(s.labels)] = float(s.value)
    points = []
    for key, cumulative in buckets.items():
        cumulative.sort()
        bounds = [le for le, _ in cumulative if not math.isinf(le)]
        per_bucket = []
        previous = 0.0
        for _, total in cumulative:
            per_bucket.append(int(total - previous))
            previous = total
        points.append(HistogramDataPoint(
            attributes=_attributes(dict(key)),
            start_time_unix_nano=created.get(key, default_start_ns),
            time_unix_nano=now_ns,
            count=int(counts.get(key, previous)),
            sum=sums.get(key, 0.0),
            explicit_bounds=bounds,
            bucket_counts=per_bucket,
        ))
    return Metric(
        name=family.name, description=family.documentation,
        histogram=Histogram(data_points=points,
                            aggregation_temporality=AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE),
    )


def registry_to_request(
    registry: CollectorRegistry, *, now_ns: int | None = None, start_ns: int = 0,
    resource: Mapping[str, str] | None = None,
) -> ExportMetricsServiceRequest:
    """Every metric of the registry as one OTLP request (metrics without samples are left out).

    ``resource``: the resource attributes (``resource_attributes()`` unless given)."""
    now = now_ns if now_ns is not None else time.time_ns()
    metrics: list[Metric] = []
    for family in registry.collect():
        if family.type == "counter":
            metric = _counter(family, now, start_ns)
            if metric.sum.data_points:
                metrics.append(metric)
        elif family.type == "gauge":
            metric = _gauge(family, now)
            if metric.gauge.data_points:
                metrics.append(metric)
        elif family.type == "histogram":
            metric = _histogram(family, now, start_ns)
            if metric.histogram.data_points:
                metrics.append(metric)
    attributes = dict(resource) if resource is not None else resource_attributes()
    return ExportMetricsServiceRequest(resource_metrics=[ResourceMetrics(
        resource=Resource(attributes=_attributes(attributes)),
        scope_metrics=[ScopeMetrics(scope=InstrumentationScope(name="durable-check", version=__version__),
                                    metrics=metrics)],
    )])


def _data_point_count(request: ExportMetricsServiceRequest) -> int:
    total = 0
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                total += len(m.sum.data_points) + len(m.gauge.data_points) + len(m.histogram.data_points)
    return total


class OtlpMetricsExporter:
    name = "otlp_metrics"
    wants_actions = False

    def __init__(self, cfg: OtlpMetricsConfig, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._interval_s = float(cfg.interval)
        self._start_ns = time.time_ns()
        self._resource = resource_attributes()
        self._transport = OtlpTransport(
            self.name, telemetry,
            endpoint=cfg.endpoint, protocol=cfg.protocol, insecure=cfg.insecure,
            headers=cfg.headers, timeout_s=float(cfg.timeout), signal="metrics",
        )
        self._failures = FailureLog(self.name)
        init_exporter_metrics(telemetry, self.name)
        self._stop = threading.Event()
        self._push_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="exporter-otlp-metrics", daemon=True)
        self._thread.start()

    def push(self, timeout_s: float | None = None) -> bool:
        """Collect and send once; True when the receiver took it."""
        with self._push_lock:
            try:
                request = registry_to_request(self._telemetry.registry, start_ns=self._start_ns,
                                              resource=self._resource)
                result = self._transport.send(request, timeout_s)
            except Exception as exc:  # one failed push must not end the pushing
                self._telemetry.exporter_failures.labels(self.name).inc()
                self._failures.failed(describe_error(exc), 1)
                return False
            if result.ok:
                self._failures.succeeded()
                self._telemetry.exporter_sent.labels(self.name).inc(_data_point_count(request))
                self._telemetry.exporter_last_success.labels(self.name).set_to_current_time()
                return True
            self._telemetry.exporter_failures.labels(self.name).inc()
            self._failures.failed(result.reason, 1)
            return False

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.push()

    def export(self, violations: Sequence[Violation]) -> None:
        """Violations reach this exporter as counters in the registry."""

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """Metrics have no per-violation state to clear."""

    def export_actions(self, actions: Sequence[Action]) -> None:
        """Actions are counted by the pipeline."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """A last push, so the final counts reach the backend, then stop."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s)
        remaining = deadline - time.monotonic()
        if remaining > 0:
            self.push(remaining)
        self._transport.close()
