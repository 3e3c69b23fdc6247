"""The Pipeline page's numbers, read from this process's own metrics (processor.telemetry)."""

from __future__ import annotations

from typing import Any

from processor.telemetry import Telemetry


def _samples(telemetry: Telemetry) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in telemetry.registry.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(value for _, value in samples.get(name, ()))


def _by(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in samples.get(name, ()):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def pipeline_status(telemetry: Telemetry) -> dict[str, Any]:
    """Receivers, queue, state store and exporters, as this process counts them since it started."""
    s = _samples(telemetry)
    exporters: dict[str, dict[str, float | None]] = {}
    for key, metric in (("sent", "durable_check_exporter_sent_total"),
                        ("failures", "durable_check_exporter_failures_total"),
                        ("dropped", "durable_check_exporter_dropped_total"),
                        ("queue_depth", "durable_check_exporter_queue_depth"),
                        ("outbox_pending", "durable_check_outbox_pending"),
                        ("last_success", "durable_check_exporter_last_success_timestamp_seconds")):
        for name, value in _by(s, metric, "exporter").items():
            exporters.setdefault(name, {"sent": 0, "failures": 0, "dropped": 0, "queue_depth": 0,
                                        "outbox_pending": 0, "last_success": None})[key] = value
    evaluated = s.get("durable_check_evaluation_seconds_count", [])
    seconds = s.get("durable_check_evaluation_seconds_sum", [])
    batches = sum(v for _, v in evaluated)
    return {
        "receivers": {
            "received": _by(s, "durable_check_spans_received_total", "protocol"),
            "rejected": _by(s, "durable_check_spans_rejected_total", "reason"),
            "duplicate": _total(s, "durable_check_spans_duplicate_total"),
            "late": _total(s, "durable_check_spans_late_total"),
        },
        "queue": {"depth": _total(s, "durable_check_queue_depth")},
        "evaluation": {
            "batches": batches,
            "mean_seconds": (sum(v for _, v in seconds) / batches) if batches else None,
            "open_sessions": _total(s, "durable_check_open_sessions"),
            "open_waits": _by(s, "durable_check_open_waits", "state"),
            "expired_waits": _by(s, "durable_check_expired_waits", "state"),
            "oldest_open_wait_age_seconds": _total(s, "durable_check_oldest_open_wait_age_seconds"),
        },
        "state": {
            "journal_depth": _total(s, "durable_check_journal_depth"),
            "journal_bytes": _total(s, "durable_check_journal_bytes"),
            "failures": _by(s, "durable_check_state_failures_total", "kind"),
            "sessions_not_restored": _total(s, "durable_check_sessions_not_restored_total"),
        },
        "exporters": [{"name": name, **values} for name, values in sorted(exporters.items())],
    }
