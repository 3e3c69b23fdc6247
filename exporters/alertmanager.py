"""Violations as Alertmanager alerts (``POST /api/v2/alerts``).

An alert is identified by its labels: ``alertname="DurableCheckViolation"``, ``rule``,
``rule_name``, ``severity``, ``service``, ``session`` and ``violation_id`` (a session id
is fine as an alert label: alerts are not time series), and ``waived="true"`` for a finding
the operator's waivers accept (route it to no receiver to keep it from paging). Annotations describe it:
``summary``, ``description`` (the violation's message), ``trace_id``, ``action_id`` and,
when ``trace_url_template`` is set, ``trace_url`` (also sent as ``generatorURL``).

Alertmanager forgets an alert at its ``endsAt``, so active alerts are re-sent every
``resend_interval`` with ``startsAt`` fixed and ``endsAt`` = now + 3 × resend_interval
(two lost re-sends in a row do not end an alert). An alert is resolved, by sending
``endsAt`` = the time it was resolved, when the pipeline calls ``resolve()`` or when
it has not been exported again for ``resolve_after``.

The exporter remembers at most ``max_active`` alerts; when full, the oldest is
forgotten (counted as dropped): Alertmanager then ends it by itself at its ``endsAt``.
A send is retried with capped backoff up to ``max_attempts``; an active alert whose
send failed that many times is tried again at its next re-send, a resolution whose
send failed is given up (Alertmanager ends the alert at its ``endsAt`` anyway).

Delivery listeners are told the violation ids of every chunk Alertmanager accepted;
serve's outbox counts a violation delivered to Alertmanager only then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from exporters.base import FailureLog, SendResult, describe_error, http_result, init_exporter_metrics, tell_listeners
from exporters.config import AlertmanagerConfig
from processor._version import __version__
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import WAIVED, Violation

log = logging.getLogger("durable_check.exporters")

ALERT_NAME = "DurableCheckViolation"
_CHUNK = 500


def format_time(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def trace_url(template: str, violation: Violation) -> str:
    """Fill ``{trace_id}`` and friends by plain replacement (no format-string evaluation)."""
    if not template or not violation.trace_id:
        return ""
    out = template
    for field_name in ("trace_id", "span_id", "session_id", "violation_id"):
        out = out.replace("{" + field_name + "}", str(getattr(violation, field_name)))
    return out


def alert_labels(violation: Violation) -> dict[str, str]:
    labels = {
        "alertname": ALERT_NAME,
        "rule": violation.rule,
        "rule_name": violation.name,
        "severity": violation.severity,
        "session": violation.session_id,
        "violation_id": violation.violation_id,
    }
    if violation.service:
        labels["service"] = violation.service
    if WAIVED in violation.details:
        # Accepted by the operator's waiver file: routed or silenced on this label, never lost.
        labels["waived"] = "true"
    return labels


def alert_annotations(violation: Violation, template: str) -> dict[str, str]:
    where = f" in {violation.service}" if violation.service else ""
    annotations = {
        "summary": f"{violation.rule} {violation.name}{where} (session {violation.session_id})",
        "description": violation.message,
        "action_id": violation.action_id,
    }
    if violation.trace_id:
        annotations["trace_id"] = violation.trace_id
    link = trace_url(template, violation)
    if link:
        annotations["trace_url"] = link
    mark = violation.details.get(WAIVED)
    if isinstance(mark, dict):
        annotations["waived"] = f"{mark.get('reason', '')} ({mark.get('by', '')})"
    return annotations


@dataclass(slots=True)
class _Alert:
    labels: dict[str, str]
    annotations: dict[str, str]
    generator_url: str
    starts_at: float
    # Monotonic clock: when it was last exported by the pipeline, last delivered.
    last_seen: float
    last_sent: float | None = None
    # Wall clock: when it was resolved (its endsAt), None while active.
    resolved_at: float | None = None
    # Alertmanager accepted it at least once (last_sent is also set after giving up, to pace retries).
    delivered: bool = False

    def payload(self, now: float, ends_in: float) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "labels": self.labels,
            "annotations": self.annotations,
            "startsAt": format_time(self.starts_at),
            "endsAt": format_time(self.resolved_at if self.resolved_at is not None else now + ends_in),
        }
        if self.generator_url:
            doc["generatorURL"] = self.generator_url
        return doc


class AlertmanagerExporter:
    name = "alertmanager"
    wants_actions = False

    def __init__(self, cfg: AlertmanagerConfig, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        self._resend_s = float(cfg.resend_interval)
        self._resolve_after_s = float(cfg.resolve_after)
        self._template = cfg.trace_url_template
        self._max_active = cfg.max_active
        self._policy = cfg.retry_policy()
        base = cfg.url.rstrip("/")
        self._url = base if base.endswith("/api/v2/alerts") else base + "/api/v2/alerts"
        self._http = httpx.Client(timeout=float(cfg.timeout), headers={
            "User-Agent": f"durable-check/{__version__}", **cfg.headers,
        })
        self._alerts: OrderedDict[str, _Alert] = OrderedDict()
        self._cond = threading.Condition()
        self._stopping = False
        self._abandoned = threading.Event()
        self._failures = FailureLog(self.name)
        self._listeners: list[Callable[[Sequence[str]], None]] = []
        init_exporter_metrics(telemetry, self.name)
        self._thread = threading.Thread(target=self._run, name="exporter-alertmanager", daemon=True)
        self._update_depth()
        self._thread.start()

    # -- called by the pipeline --------------------------------------------------------

    def export(self, violations: Sequence[Violation]) -> None:
        try:
            self._add(violations)
        except Exception:
            self._telemetry.exporter_failures.labels(self.name).inc()
            log.exception("exporter alertmanager: unexpected error; %d violations not alerted", len(violations))

    def _add(self, violations: Sequence[Violation]) -> None:
        now_wall, now = time.time(), time.monotonic()
        evicted = 0
        known: list[str] = []
        with self._cond:
            if self._stopping:
                return
            for v in violations:
                alert = self._alerts.get(v.violation_id)
                if alert is not None:
                    # Seen again: still happening, so it stays (or becomes again) active.
                    alert.last_seen = now
                    if alert.resolved_at is not None:
                        alert.resolved_at = None
                        alert.last_sent = None
                    elif alert.delivered:
                        known.append(v.violation_id)
                    continue
                if len(self._alerts) >= self._max_active:
                    self._alerts.popitem(last=False)
                    evicted += 1
                started = v.time_ns / 1e9 if v.time_ns is not None else now_wall
                link = trace_url(self._template, v)
                self._alerts[v.violation_id] = _Alert(
                    labels=alert_labels(v),
                    annotations=alert_annotations(v, self._template),
                    generator_url=link,
                    starts_at=min(started, now_wall),
                    last_seen=now,
                )
            self._update_depth()
            self._cond.notify()
        if known:
            # Handed over again (by serve's outbox) but already active in Alertmanager: confirm at once.
            self._tell_delivered(known)
        if evicted:
            self._telemetry.exporter_dropped.labels(self.name).inc(evicted)
            log.warning("exporter alertmanager: %d active alerts at the bound, forgot the %d oldest",
                        self._max_active, evicted)

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """End these alerts now; ids never alerted (or forgotten) are ignored."""
        now_wall = time.time()
        with self._cond:
            for vid in violation_ids:
                alert = self._alerts.get(vid)
                if alert is not None and alert.resolved_at is None:
                    alert.resolved_at = now_wall
            self._update_depth()
            self._cond.notify()

    def export_actions(self, actions: Sequence[Action]) -> None:
        """Actions do not alert."""

    def add_delivery_listener(self, listener: Callable[[Sequence[str]], None]) -> None:
        """``listener(violation_ids)``, from the worker thread, after Alertmanager accepted a POST holding
        their alerts (serve's outbox waits for it)."""
        self._listeners.append(listener)

    def _tell_delivered(self, violation_ids: list[str]) -> None:
        tell_listeners(self._listeners, violation_ids, self.name)

    def active_ids(self) -> list[str]:
        with self._cond:
            return [vid for vid, a in self._alerts.items() if a.resolved_at is None]

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Deliver new alerts and resolutions still pending; active alerts are *not*
        resolved (the violations still stand) and end at their ``endsAt``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout_s))
        self._abandoned.set()
        with self._cond:
            pending = sum(1 for a in self._alerts.values() if a.last_sent is None or a.resolved_at is not None)
        if pending and self._thread.is_alive():
            self._telemetry.exporter_dropped.labels(self.name).inc(pending)
            log.warning("exporter alertmanager: shut down with %d alert updates undelivered", pending)
        self._http.close()

    # -- the worker --------------------------------------------------------------------

    def _update_depth(self) -> None:
        # Waiting for delivery: new alerts and resolutions (active, delivered alerts only
        # wait for their next re-send, which is not a backlog).
        pending = sum(1 for a in self._alerts.values() if a.last_sent is None or a.resolved_at is not None)
        self._telemetry.exporter_queue_depth.labels(self.name).set(pending)

    def _due(self, now: float, now_wall: float) -> tuple[list[tuple[str, _Alert]], float]:
        """Alerts to send now, and seconds until the next one falls due."""
        due: list[tuple[str, _Alert]] = []
        wait = self._resend_s
        for vid, alert in self._alerts.items():
            if (alert.resolved_at is None and self._resolve_after_s > 0
                    and now - alert.last_seen >= self._resolve_after_s):
                alert.resolved_at = now_wall
            if alert.resolved_at is not None or alert.last_sent is None:
                due.append((vid, alert))
                continue
            if self._stopping:
                continue
            next_send = alert.last_sent + self._resend_s - now
            if next_send <= 0:
                due.append((vid, alert))
                continue
            wait = min(wait, next_send)
            if self._resolve_after_s > 0:
                wait = min(wait, alert.last_seen + self._resolve_after_s - now)
        return due, max(0.01, wait)

    def _run(self) -> None:
        while not self._abandoned.is_set():
            with self._cond:
                due, wait = self._due(time.monotonic(), time.time())
                if not due:
                    if self._stopping:
                        return
                    self._cond.wait(wait)
                    continue
            for start in range(0, len(due), _CHUNK):
                if not self._deliver(due[start:start + _CHUNK]):
                    return

    def _post(self, payload: list[dict[str, Any]]) -> SendResult:
        try:
            response = self._http.post(self._url, json=payload)
        except httpx.HTTPError as exc:
            return SendResult.retry(describe_error(exc))
        return http_result(response)

    def _deliver(self, chunk: list[tuple[str, _Alert]]) -> bool:
        """Send one chunk with retries; False when shutdown gave up on the worker."""
        attempt = 0
        while True:
            attempt += 1
            now, now_wall = time.monotonic(), time.time()
            with self._cond:
                # Snapshot under the lock: export()/resolve() may change an alert meanwhile.
                payload = [alert.payload(now_wall, 3 * self._resend_s) for _, alert in chunk]
                sent_states = [alert.resolved_at for _, alert in chunk]
            try:
                result = self._post(payload)
            except Exception as exc:  # a broken endpoint must not kill the worker
                result = SendResult.retry(describe_error(exc))
            if self._abandoned.is_set():
                return False
            if result.ok:
                self._failures.succeeded()
                self._telemetry.exporter_sent.labels(self.name).inc(len(chunk))
                self._telemetry.exporter_last_success.labels(self.name).set_to_current_time()
                self._settle(chunk, sent_states, now, delivered=True)
                self._tell_delivered([vid for vid, _ in chunk])
                return True
            self._telemetry.exporter_failures.labels(self.name).inc()
            self._failures.failed(result.reason, attempt)
            if not result.retryable or attempt >= self._policy.max_attempts:
                log.error("exporter alertmanager: %d alert updates not delivered after %d attempts (%s)",
                          len(chunk), attempt, result.reason)
                self._settle(chunk, sent_states, now, delivered=False, permanent=not result.retryable)
                return True
            if self._abandoned.wait(self._policy.delay(attempt, result.retry_after)):
                return False

    def _settle(
        self, chunk: list[tuple[str, _Alert]], sent_states: list[float | None], now: float,
        *, delivered: bool, permanent: bool = False,
    ) -> None:
        dropped = 0
        with self._cond:
            for (vid, alert), resolved_at in zip(chunk, sent_states, strict=True):
                if self._alerts.get(vid) is not alert:
                    continue  # forgotten meanwhile (bound reached)
                if alert.resolved_at != resolved_at:
                    continue  # re-activated or resolved meanwhile: the next round sends the news
                if resolved_at is not None:
                    # Delivered resolution, or one given up on: Alertmanager ends it at endsAt.
                    del self._alerts[vid]
                    dropped += 0 if delivered else 1
                elif delivered:
                    alert.last_sent = now
                    alert.delivered = True
                elif permanent:
                    del self._alerts[vid]
                    dropped += 1
                else:
                    # Try again at the next re-send rather than hammering a dead endpoint.
                    alert.last_sent = now
            self._update_depth()
        if dropped:
            self._telemetry.exporter_dropped.labels(self.name).inc(dropped)
