"""Self-telemetry, declared in one place.

Every metric Durable Check exposes is listed in ``METRICS``; ``Telemetry`` builds them
in a registry of its own (one per running pipeline, so tests can run several), and
``docs/telemetry.md`` is generated from the same list (``python -m processor.telemetry``).

No session, action or trace id is ever a label: those are unbounded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MetricType = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    attr: str
    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...] = ()


METRICS: tuple[MetricSpec, ...] = (
    # What the checked agents do.
    MetricSpec("violations", "durable_check_violations", "counter",
               "Violations found, by rule, severity and service.", ("rule", "severity", "service")),
    MetricSpec("actions", "durable_check_actions", "counter",
               "Action records evaluated, by kind, status and service.", ("kind", "status", "service")),
    MetricSpec("open_sessions", "durable_check_open_sessions", "gauge",
               "Sessions with state held in memory or in the store."),
    MetricSpec("sessions_packed", "durable_check_sessions_packed", "gauge",
               "Idle open sessions (a minute without a record) whose rule groups are held packed and compressed, "
               "as the last packing pass found them; such a session is unpacked when a record of it arrives."),
    MetricSpec("packed_bytes", "durable_check_packed_bytes", "gauge",
               "Compressed bytes the packed sessions' groups take, as the last packing pass found them."),
    MetricSpec("open_waits", "durable_check_open_waits", "gauge",
               "Sessions waiting (for an approval, an external event, a scheduled retry) with nothing resolving "
               "it yet, by workflow state: what the view's Waiting now lists, those past their deadline included.",
               ("state",)),
    MetricSpec("expired_waits", "durable_check_expired_waits", "gauge",
               "Open waits past their deadline (also in durable_check_open_waits), by workflow state.", ("state",)),
    MetricSpec("oldest_open_wait_age", "durable_check_oldest_open_wait_age_seconds", "gauge",
               "Age of the oldest open wait, expired ones included: stuck work made visible."),
    MetricSpec("sessions_evicted", "durable_check_sessions_evicted", "counter",
               "Sessions dropped because the open-session bound was reached."),
    MetricSpec("sessions_handed_over", "durable_check_sessions_handed_over", "counter",
               "Sessions this replica handed, with their state, to the replica that asked for them (shared "
               "PostgreSQL state: the Collector now routes them there)."),
    MetricSpec("state_entries", "durable_check_state_entries", "gauge",
               "Rule groups and delivery keys remembered across all sessions (bounded by "
               "evaluate.max_remembered_entries)."),
    MetricSpec("state_entries_dropped", "durable_check_state_entries_dropped", "counter",
               "Remembered entries the least recently active sessions forgot to stay within "
               "evaluate.max_remembered_entries, by what (group, delivery_key).", ("what",)),
    MetricSpec("rule_errors", "durable_check_rule_errors", "counter",
               "Records on which a rule's expression failed or overran its evaluation budget "
               "(the rule did not fire on them), by rule.", ("rule",)),
    MetricSpec("violations_capped", "durable_check_violations_capped", "counter",
               "Violations not reported one by one past a cap, by scope (session, request); "
               "each cap raises one DS113 summary instead.", ("scope",)),
    MetricSpec("violations_waived", "durable_check_violations_waived", "counter",
               "Violations an operator's waiver or baseline accepts (reported as waived, not as errors), "
               "by rule.", ("rule",)),
    # The processor's own health.
    MetricSpec("spans_received", "durable_check_spans_received", "counter",
               "Spans received, by protocol (grpc, http, file).", ("protocol",)),
    MetricSpec("spans_rejected", "durable_check_spans_rejected", "counter",
               "Spans refused or not convertible, by protocol and reason.", ("protocol", "reason")),
    MetricSpec("spans_duplicate", "durable_check_spans_duplicate", "counter",
               "Spans delivered again (same trace and span id) and counted once."),
    MetricSpec("spans_late", "durable_check_spans_late", "counter",
               "Spans that arrived behind the watermark (later than the allowed lateness)."),
    MetricSpec("queue_depth", "durable_check_queue_depth", "gauge",
               "Requests waiting between the receivers and the evaluator."),
    MetricSpec("open_files_limit", "durable_check_open_files_limit", "gauge",
               "The process's open-file limit after serve raised it to the hard limit at start; each listener "
               "keeps at most its share of it in connections."),
    MetricSpec("evaluation_seconds", "durable_check_evaluation_seconds", "histogram",
               "Time to evaluate one batch of records."),
    MetricSpec("exporter_sent", "durable_check_exporter_sent", "counter",
               "Items delivered by an exporter.", ("exporter",)),
    MetricSpec("exporter_failures", "durable_check_exporter_failures", "counter",
               "Failed export attempts (each retry counts).", ("exporter",)),
    MetricSpec("exporter_dropped", "durable_check_exporter_dropped", "counter",
               "Items an exporter gave up on (retry queue full or retries exhausted).", ("exporter",)),
    MetricSpec("jsonl_lines_rotated_away", "durable_check_jsonl_lines_rotated_away", "counter",
               "Lines JSONL rotation removed with the oldest copy, by output (violations, actions).", ("output",)),
    MetricSpec("exporter_queue_depth", "durable_check_exporter_queue_depth", "gauge",
               "Items waiting in an exporter's retry queue.", ("exporter",)),
    MetricSpec("exporter_last_success", "durable_check_exporter_last_success_timestamp_seconds", "gauge",
               "When an exporter last delivered (Unix seconds); absent until its first delivery.", ("exporter",)),
    MetricSpec("forward_dropped", "durable_check_forward_dropped", "counter",
               "Spans processor mode could not forward downstream (buffer overflow or retries exhausted)."),
    # The durable state (state.backend sqlite or postgres).
    MetricSpec("journal_depth", "durable_check_journal_depth", "gauge",
               "Requests journaled (acknowledged) and not yet evaluated."),
    MetricSpec("journal_bytes", "durable_check_journal_bytes", "gauge",
               "Bytes of the requests in the journal; past state.journal_max_size new requests are refused."),
    MetricSpec("outbox_pending", "durable_check_outbox_pending", "gauge",
               "Violations recorded in the outbox whose delivery an exporter has not yet confirmed.",
               ("exporter",)),
    MetricSpec("sessions_not_restored", "durable_check_sessions_not_restored", "counter",
               "Sessions the state store held that could not be read back when the evaluator started or "
               "rebuilt its engine: their rule state is lost, so later violations in them may be missed. "
               "Logged as a count, without ids."),
    MetricSpec("state_failures", "durable_check_state_failures", "counter",
               "Failed state store operations, by kind (locked, full, corrupt, read_only, connection, other).",
               ("kind",)),
    # The first tier (route.endpoint): spans regrouped by session and sent on.
    MetricSpec("route_sent", "durable_check_route_sent_spans", "counter",
               "Spans the first tier sent on with their session on the resource (a span re-sent after a "
               "restart counts again)."),
    MetricSpec("route_held", "durable_check_route_held_spans", "gauge",
               "Spans the first tier holds until their trace names their session (at most allowed_lateness)."),
    MetricSpec("route_send_failures", "durable_check_route_send_failures", "counter",
               "Attempts to send spans on that failed and are retried (the downstream unavailable or busy)."),
    MetricSpec("route_refused", "durable_check_route_refused_spans", "counter",
               "Spans the downstream refused for good (not retryable, e.g. a malformed request): logged as a "
               "count, dropped."),
    MetricSpec("requests_set_aside", "durable_check_requests_set_aside", "counter",
               "Accepted requests set aside so that the evaluator goes on: evaluation_failed (an error evaluating "
               "it), commit_failed (its state cannot be stored), crashed_evaluating (the process stopped or was "
               "restarted while evaluating it, on every try). Logged without their content.", ("reason",)),
)

# The values of ``requests_set_aside``' label (processor.worker).
SET_ASIDE_REASONS: tuple[str, ...] = ("evaluation_failed", "commit_failed", "crashed_evaluating")

# The values of ``state_failures``' label (processor.state.faults.failure_kind).
STATE_FAILURE_KINDS: tuple[str, ...] = ("locked", "full", "corrupt", "read_only", "connection", "other")


class Telemetry:
    """The metrics of one pipeline, as attributes named by ``MetricSpec.attr``."""

    violations: Counter
    actions: Counter
    open_sessions: Gauge
    sessions_packed: Gauge
    packed_bytes: Gauge
    open_waits: Gauge
    expired_waits: Gauge
    oldest_open_wait_age: Gauge
    sessions_evicted: Counter
    sessions_handed_over: Counter
    state_entries: Gauge
    state_entries_dropped: Counter
    rule_errors: Counter
    violations_capped: Counter
    violations_waived: Counter
    spans_received: Counter
    spans_rejected: Counter
    spans_duplicate: Counter
    spans_late: Counter
    queue_depth: Gauge
    open_files_limit: Gauge
    evaluation_seconds: Histogram
    exporter_sent: Counter
    exporter_failures: Counter
    exporter_dropped: Counter
    jsonl_lines_rotated_away: Counter
    exporter_queue_depth: Gauge
    exporter_last_success: Gauge
    forward_dropped: Counter
    journal_depth: Gauge
    route_sent: Counter
    route_held: Gauge
    route_send_failures: Counter
    route_refused: Counter
    journal_bytes: Gauge
    outbox_pending: Gauge
    sessions_not_restored: Counter
    state_failures: Counter
    requests_set_aside: Counter

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        for spec in METRICS:
            metric: Counter | Gauge | Histogram
            if spec.type == "counter":
                metric = Counter(spec.name, spec.help, spec.labels, registry=self.registry)
            elif spec.type == "gauge":
                metric = Gauge(spec.name, spec.help, spec.labels, registry=self.registry)
            else:
                metric = Histogram(
                    spec.name,
                    spec.help,
                    spec.labels,
                    registry=self.registry,
                    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
                )
            setattr(self, spec.attr, metric)


def render_markdown() -> str:
    """docs/telemetry.md, generated from ``METRICS``."""
    out = [
        "# Self-telemetry",
        "",
        "Generated from `processor/telemetry.py` by `python -m processor.telemetry`; do not edit by hand.",
        "Counters are exposed with the `_total` suffix. No label ever holds a session, action or trace id.",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for spec in METRICS:
        name = spec.name + ("_total" if spec.type == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "none"
        out.append(f"| `{name}` | {spec.type} | {labels} | {spec.help} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
