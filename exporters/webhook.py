"""Violations as JSON POSTs: ``{"violations": [...]}``.

Each element is ``Violation.to_json()`` plus ``time``, the same object as a JSONL line.
With ``batch_size: 1`` (the default) a request carries one violation and its
``Idempotency-Key`` header is the violation id, so a receiver can drop a repeat
(delivery is at least once: a request whose answer was lost is sent again). With a
larger batch the key is a digest of the batch's violation ids; a failed batch is
retried as is, so its key is stable across retries.

Retried (capped backoff, ``max_attempts``): connection errors, timeouts, 5xx, 408 and
429; ``Retry-After`` is honoured up to ``max_backoff``. Any other 4xx is a refusal:
the batch is dropped and counted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import httpx
import orjson

from exporters.base import (
    RetryQueue,
    SendResult,
    describe_error,
    json_default,
    parse_retry_after,
    violation_document,
)
from exporters.config import WebhookConfig
from processor._version import __version__
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import Violation

_RETRYABLE_4XX = frozenset({408, 429})


def idempotency_key(violations: Sequence[Violation]) -> str:
    if len(violations) == 1:
        return violations[0].violation_id
    digest = hashlib.sha256("\x1f".join(v.violation_id for v in violations).encode("utf-8"))
    return digest.hexdigest()[:32]


class WebhookExporter:
    name = "webhook"
    wants_actions = False

    def __init__(self, cfg: WebhookConfig, telemetry: Telemetry) -> None:
        self._url = cfg.url
        self._http = httpx.Client(timeout=float(cfg.timeout), headers={
            "Content-Type": "application/json",
            "User-Agent": f"durable-check/{__version__}",
            **cfg.headers,
        })
        self._queue: RetryQueue[Violation] = RetryQueue(
            self.name, telemetry, self._send, lambda v: v.violation_id,
            max_queue=cfg.max_queue, batch_size=cfg.batch_size, policy=cfg.retry_policy(),
            remember_sent=cfg.max_queue * 4,
        )

    @property
    def queue(self) -> RetryQueue[Violation]:
        return self._queue

    def _send(self, violations: list[Violation]) -> SendResult:
        body = orjson.dumps({"violations": [violation_document(v) for v in violations]}, default=json_default)
        try:
            response = self._http.post(self._url, content=body,
                                       headers={"Idempotency-Key": idempotency_key(violations)})
        except httpx.HTTPError as exc:
            return SendResult.retry(describe_error(exc))
        status = response.status_code
        if 200 <= status < 300:
            return SendResult.success()
        reason = f"HTTP {status}"
        if status >= 500 or status in _RETRYABLE_4XX:
            return SendResult.retry(reason, parse_retry_after(response.headers.get("Retry-After")))
        return SendResult.permanent(reason)

    def export(self, violations: Sequence[Violation]) -> None:
        self._queue.put(violations)

    def add_delivery_listener(self, listener: Callable[[Sequence[str]], None]) -> None:
        """``listener(violation_ids)`` once the endpoint accepted them (serve's outbox waits for it)."""
        self._queue.add_delivery_listener(listener)

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """A webhook reports what was found; a cleared condition sends nothing."""

    def export_actions(self, actions: Sequence[Action]) -> None:
        """Only violations go to the webhook."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._queue.shutdown(timeout_s)
        self._http.close()
