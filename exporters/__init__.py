"""Where violations go: JSON lines, OTLP spans, Prometheus metrics (scrape and OTLP push),
Alertmanager alerts and webhooks. See docs/exporters.md."""

from __future__ import annotations

import logging

from exporters.alertmanager import AlertmanagerExporter
from exporters.base import Exporter, RetryPolicy, RetryQueue, SendResult, undelivered_in_queues, violation_document
from exporters.config import (
    AlertmanagerConfig,
    ExportersConfig,
    JsonlConfig,
    OtlpConfig,
    OtlpMetricsConfig,
    PrometheusConfig,
    WebhookConfig,
)
from exporters.jsonl import JsonlExporter
from exporters.otlp_metrics import OtlpMetricsExporter
from exporters.otlp_spans import OtlpSpanExporter
from exporters.prometheus import PrometheusExporter
from exporters.webhook import WebhookExporter
from processor.telemetry import Telemetry

__all__ = [
    "AlertmanagerConfig",
    "AlertmanagerExporter",
    "Exporter",
    "ExportersConfig",
    "JsonlConfig",
    "JsonlExporter",
    "OtlpConfig",
    "OtlpMetricsConfig",
    "OtlpMetricsExporter",
    "OtlpSpanExporter",
    "PrometheusConfig",
    "PrometheusExporter",
    "RetryPolicy",
    "RetryQueue",
    "SendResult",
    "WebhookConfig",
    "WebhookExporter",
    "build_exporters",
    "violation_document",
]

log = logging.getLogger("durable_check.exporters")


def build_exporters(cfg: ExportersConfig, telemetry: Telemetry) -> list[Exporter]:
    """The exporters whose destination is configured, started.

    Raises ``ConfigError`` (naming the config path) when one cannot start, e.g. the
    metrics port is taken or the JSONL file cannot be read; those already started are
    shut down first.
    """
    exporters: list[Exporter] = []
    try:
        if cfg.jsonl.path:
            exporters.append(JsonlExporter(cfg.jsonl, telemetry))
        if cfg.otlp.endpoint:
            exporters.append(OtlpSpanExporter(cfg.otlp, telemetry))
        if cfg.prometheus.endpoint:
            exporters.append(PrometheusExporter(cfg.prometheus, telemetry))
        if cfg.otlp_metrics.endpoint:
            exporters.append(OtlpMetricsExporter(cfg.otlp_metrics, telemetry))
        if cfg.alertmanager.url:
            exporters.append(AlertmanagerExporter(cfg.alertmanager, telemetry))
        if cfg.webhook.url:
            exporters.append(WebhookExporter(cfg.webhook, telemetry))
    except Exception:
        for exporter in exporters:
            exporter.shutdown(1.0)
        raise
    log.info("exporters: %s", ", ".join(e.name for e in exporters) or "none")
    _hold_rotated_copies(exporters, cfg.jsonl)
    return exporters


def _hold_rotated_copies(exporters: list[Exporter], cfg: JsonlConfig) -> None:
    """JSONL rotation keeps the copies holding what the other exporters' queues still owe (serve's
    outbox, when state is durable, takes this over with what it has pending)."""
    for jsonl in exporters:
        if not isinstance(jsonl, JsonlExporter):
            continue
        others = [e for e in exporters if e is not jsonl and callable(getattr(e, "add_delivery_listener", None))]
        queues = [q for e in others if isinstance(q := getattr(e, "queue", None), RetryQueue)]
        if queues:
            jsonl.hold_for(undelivered_in_queues(queues))
        elif not others:
            log.info("exporter jsonl: the only exporter that delivers violations; its file and %d rotated "
                     "copies (%s bytes each) are the only copy, and rotation removes the oldest",
                     cfg.rotate_keep, cfg.rotate_max_size)
