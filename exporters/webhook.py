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
from collections.abc import Sequence

import httpx
import orjson

from exporters.base import (
    QueuedViolationExporter,
    SendResult,
    describe_error,
    http_result,
    json_default,
    violation_document,
)
from exporters.config import WebhookConfig
from processor._version import __version__
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import Violation


def idempotency_key(violations: Sequence[Violation]) -> str:
    if len(violations) == 1:
        return violations[0].violation_id
    digest = hashlib.sha256("\x1f".join(v.violation_id for v in violations).encode("utf-8"))
    return digest.hexdigest()[:32]


class WebhookExporter(QueuedViolationExporter):
    name = "webhook"

    def __init__(self, cfg: WebhookConfig, telemetry: Telemetry) -> None:
        self._url = cfg.url
        self._http = httpx.Client(timeout=float(cfg.timeout), headers={
            "Content-Type": "application/json",
            "User-Agent": f"durable-check/{__version__}",
            **cfg.headers,
        })
        self._start_queue(telemetry, max_queue=cfg.max_queue, batch_size=cfg.batch_size, policy=cfg.retry_policy())

    def _send(self, violations: list[Violation]) -> SendResult:
        body = orjson.dumps({"violations": [violation_document(v) for v in violations]}, default=json_default)
        try:
            response = self._http.post(self._url, content=body,
                                       headers={"Idempotency-Key": idempotency_key(violations)})
        except httpx.HTTPError as exc:
            return SendResult.retry(describe_error(exc))
        return http_result(response)

    def _close(self) -> None:
        self._http.close()

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """A webhook reports what was found; a cleared condition sends nothing."""

    def export_actions(self, actions: Sequence[Action]) -> None:
        """Only violations go to the webhook."""
