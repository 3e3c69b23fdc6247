"""The exporter interface and the bounded retry queue every network exporter uses.

An exporter must never slow down or break the pipeline: ``export()`` hands items to a
bounded queue and returns at once; a worker thread of the exporter's own delivers them
with capped exponential backoff and jitter. When the queue is full the *oldest* queued
item is dropped (the newest violations are the most actionable, and the oldest have
already waited longest on a failing endpoint); every drop is counted in
``exporter_dropped{exporter}`` and logged without payload.

An item is identified by a key (the violation id): an item whose key is already queued,
in flight, or was delivered recently is not queued again, so a violation exported twice
(or again after an outage) is delivered once.

Delivery listeners (``add_delivery_listener``) are told the keys of every delivered
batch: serve's transactional outbox counts a violation delivered to an exporter only
then, so a violation still waiting in this queue when the process dies is handed over
again after the restart.
"""

from __future__ import annotations

import email.utils
import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import httpx

from exporters._recent import RecentIds
from processor.convert.timefmt import format_rfc3339
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import Violation

log = logging.getLogger("durable_check.exporters")

T = TypeVar("T")

_OVERFLOW_LOG_INTERVAL_S = 10.0

# ``undelivered(violation_ids)``: those of the ids another exporter has not delivered yet,
# or None while that cannot be told yet (serve's outbox before it handed its rows over again).
Undelivered = Callable[[Collection[str]], set[str] | None]


@runtime_checkable
class Exporter(Protocol):
    """Where violations go. No method raises into the pipeline or blocks it."""

    name: str
    # True when export_actions() does something (JSONL with ``actions: true``): the
    # pipeline then hands it every batch of actions, and skips the others.
    wants_actions: bool

    def export(self, violations: Sequence[Violation]) -> None:
        """Queue violations for delivery and return at once."""

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """A condition cleared: alerting exporters send its end; others ignore it."""

    def export_actions(self, actions: Sequence[Action]) -> None:
        """Action records; only the JSONL exporter with ``actions: true`` writes them."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Deliver what can be delivered within ``timeout_s``, then stop."""


@dataclass(frozen=True, slots=True)
class SendResult:
    """What one delivery attempt came to.

    ``reason`` goes into logs: a status code or an error class, never a payload.
    ``retry_after`` is the server's own request (HTTP Retry-After), in seconds.
    """

    ok: bool
    retryable: bool = False
    retry_after: float | None = None
    reason: str = ""

    @staticmethod
    def success() -> SendResult:
        return SendResult(ok=True)

    @staticmethod
    def retry(reason: str, retry_after: float | None = None) -> SendResult:
        return SendResult(ok=False, retryable=True, retry_after=retry_after, reason=reason)

    @staticmethod
    def permanent(reason: str) -> SendResult:
        return SendResult(ok=False, retryable=False, reason=reason)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Capped exponential backoff with jitter; ``max_attempts`` counts the first try."""

    max_attempts: int = 10
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay(self, failures: int, retry_after: float | None = None) -> float:
        """Seconds to wait after the ``failures``-th failure in a row (1-based)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * (2.0 ** max(0, failures - 1)))
        # "Equal jitter": at least half the step, so retries of many exporters spread out
        # without ever collapsing to an immediate retry.
        delay = base / 2.0 + random.uniform(0.0, base / 2.0)  # noqa: S311 - jitter, not security
        if retry_after is not None:
            # The server asked for a pause: honour it, but never beyond our own cap.
            delay = max(delay, min(retry_after, self.max_backoff_s))
        return delay


def describe_error(exc: BaseException) -> str:
    """An exception as a short log reason: its class and message, cut to a bounded length."""
    text = str(exc)
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class FailureLog:
    """Logs the first failure of a streak as a warning and the recovery, not every retry."""

    def __init__(self, exporter: str) -> None:
        self._exporter = exporter
        self._streak = 0

    def failed(self, reason: str, attempt: int) -> None:
        self._streak += 1
        if self._streak == 1:
            log.warning("exporter %s: delivery failed (%s); retrying with backoff", self._exporter, reason)
        else:
            log.debug("exporter %s: attempt %d failed (%s)", self._exporter, attempt, reason)

    def succeeded(self) -> None:
        if self._streak:
            log.info("exporter %s: delivering again after %d failed attempts", self._exporter, self._streak)
        self._streak = 0


def init_exporter_metrics(telemetry: Telemetry, exporter: str) -> None:
    """Create the exporter's series at zero, so the first failure or drop is an increase
    that ``increase()``/``rate()`` can see (a series born at 1 shows no increase)."""
    telemetry.exporter_sent.labels(exporter)
    telemetry.exporter_failures.labels(exporter)
    telemetry.exporter_dropped.labels(exporter)
    telemetry.exporter_queue_depth.labels(exporter).set(0)


def tell_listeners(listeners: Iterable[Callable[[list[str]], None]], keys: list[str], exporter: str) -> None:
    """Tell every delivery listener ``keys``; one that fails is logged and the rest are still told."""
    for listener in listeners:
        try:
            listener(keys)
        except Exception:  # a listener's failure must not stop the exporter
            log.exception("exporter %s: a delivery listener failed", exporter)


class RetryQueue(Generic[T]):
    """A bounded, de-duplicating queue drained by one worker thread.

    ``send(batch)`` delivers up to ``batch_size`` items and returns a ``SendResult`` (an
    exception counts as a retryable failure). A failed batch is retried *as is* (same
    items, same order) until it is delivered, refused for good, or ``max_attempts`` is
    spent; items arriving meanwhile wait behind it. The bound ``max_queue`` covers
    queued plus in-flight items.
    """

    def __init__(
        self,
        exporter: str,
        telemetry: Telemetry,
        send: Callable[[list[T]], SendResult],
        key: Callable[[T], str],
        *,
        max_queue: int,
        batch_size: int,
        policy: RetryPolicy,
        remember_sent: int = 0,
    ) -> None:
        self.exporter = exporter
        self._telemetry = telemetry
        self._send = send
        self._key = key
        self._max_queue = max(1, max_queue)
        self._batch_size = max(1, batch_size)
        self._policy = policy
        # Told the keys of every delivered batch (serve's outbox deletes its pending rows then).
        self._delivery_listeners: list[Callable[[list[str]], None]] = []
        self._queued: OrderedDict[str, T] = OrderedDict()
        self._in_flight: dict[str, T] = {}
        # Keys delivered recently, fixed-size (exporters._recent): memory known at start, whatever the traffic.
        self._sent = RecentIds(remember_sent) if remember_sent > 0 else None
        self._cond = threading.Condition()
        self._stopping = False
        self._abandoned = False
        self._wake = threading.Event()
        self._failures = FailureLog(exporter)
        self.max_depth_seen = 0
        self._unlogged_drops = 0
        self._overflow_logged_at = -_OVERFLOW_LOG_INTERVAL_S
        init_exporter_metrics(telemetry, exporter)
        self._thread = threading.Thread(target=self._run, name=f"exporter-{exporter}", daemon=True)
        self._update_depth()
        self._thread.start()

    # -- called by the pipeline ------------------------------------------------------

    def put(self, items: Iterable[T]) -> None:
        """Queue items (never blocks, never raises); duplicates of known keys are skipped."""
        try:
            self._put(items)
        except Exception:
            self._telemetry.exporter_failures.labels(self.exporter).inc()
            log.exception("exporter %s: unexpected error while queueing", self.exporter)

    def _put(self, items: Iterable[T]) -> None:
        dropped = 0
        already_sent: list[str] = []
        with self._cond:
            if self._stopping:
                dropped = sum(1 for _ in items)
            else:
                for item in items:
                    k = self._key(item)
                    if self._sent is not None and k in self._sent:
                        # Delivered before: confirm it again (an outbox handing it over again waits for that).
                        already_sent.append(k)
                        continue
                    if k in self._queued or k in self._in_flight:
                        continue
                    if len(self._queued) + len(self._in_flight) >= self._max_queue:
                        if self._queued:
                            self._queued.popitem(last=False)
                        else:
                            # Everything is in flight (batch as large as the queue): the
                            # newcomer is the only thing that can go.
                            dropped += 1
                            continue
                        dropped += 1
                    self._queued[k] = item
                self._update_depth()
                self._cond.notify()
        if already_sent:
            self._tell_delivered(already_sent)
        if dropped:
            self._telemetry.exporter_dropped.labels(self.exporter).inc(dropped)
            self._log_overflow(dropped)

    def _log_overflow(self, dropped: int) -> None:
        # A dead endpoint under load overflows on every export: one line per interval.
        self._unlogged_drops += dropped
        now = time.monotonic()
        if now - self._overflow_logged_at >= _OVERFLOW_LOG_INTERVAL_S:
            log.warning("exporter %s: queue full (%d items), dropped %d of the oldest",
                        self.exporter, self._max_queue, self._unlogged_drops)
            self._unlogged_drops = 0
            self._overflow_logged_at = now

    @property
    def depth(self) -> int:
        with self._cond:
            return len(self._queued) + len(self._in_flight)

    def holding(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` queued or in flight: not delivered yet, nor given up on."""
        with self._cond:
            return {k for k in keys if k in self._queued or k in self._in_flight}

    def shutdown(self, timeout_s: float) -> None:
        """Stop taking items, deliver what fits in ``timeout_s``, count the rest as dropped."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout_s))
        with self._cond:
            self._abandoned = True
            left = len(self._queued) + len(self._in_flight)
            self._queued.clear()
            self._in_flight.clear()
            self._update_depth()
        self._wake.set()
        if left:
            self._telemetry.exporter_dropped.labels(self.exporter).inc(left)
            log.warning("exporter %s: shut down with %d items undelivered", self.exporter, left)

    # -- the worker ------------------------------------------------------------------

    def _update_depth(self) -> None:
        depth = len(self._queued) + len(self._in_flight)
        self.max_depth_seen = max(self.max_depth_seen, depth)
        self._telemetry.exporter_queue_depth.labels(self.exporter).set(depth)

    def _take_batch(self) -> list[tuple[str, T]] | None:
        with self._cond:
            while not self._queued and not self._stopping:
                self._cond.wait()
            if not self._queued or self._abandoned:
                return None
            batch: list[tuple[str, T]] = []
            while self._queued and len(batch) < self._batch_size:
                batch.append(self._queued.popitem(last=False))
            self._in_flight = dict(batch)
            return batch

    def _attempt(self, items: list[T]) -> SendResult:
        try:
            return self._send(items)
        except Exception as exc:  # a broken endpoint must not kill the worker
            return SendResult.retry(describe_error(exc))

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            items = [item for _, item in batch]
            attempt = 0
            while True:
                attempt += 1
                result = self._attempt(items)
                if self._abandoned:
                    return
                if result.ok:
                    self._failures.succeeded()
                    self._telemetry.exporter_sent.labels(self.exporter).inc(len(items))
                    self._telemetry.exporter_last_success.labels(self.exporter).set_to_current_time()
                    self._remember([k for k, _ in batch])
                    self._tell_delivered([k for k, _ in batch])
                    break
                self._telemetry.exporter_failures.labels(self.exporter).inc()
                self._failures.failed(result.reason, attempt)
                if not result.retryable or attempt >= self._policy.max_attempts:
                    self._telemetry.exporter_dropped.labels(self.exporter).inc(len(items))
                    log.error(
                        "exporter %s: dropped %d items after %d attempts (%s)",
                        self.exporter, len(items), attempt, result.reason,
                    )
                    break
                # Sleep, but wake early when shutdown gives up on us.
                if self._wake.wait(self._policy.delay(attempt, result.retry_after)) or self._abandoned:
                    return
            with self._cond:
                self._in_flight = {}
                self._update_depth()

    def add_delivery_listener(self, listener: Callable[[list[str]], None]) -> None:
        """``listener(keys)`` is called, from the worker thread, after each batch is delivered, and from
        ``put()``'s caller for keys put again that were delivered recently (``remember_sent``)."""
        self._delivery_listeners.append(listener)

    def _tell_delivered(self, keys: list[str]) -> None:
        tell_listeners(self._delivery_listeners, keys, self.exporter)

    def _remember(self, keys: list[str]) -> None:
        if self._sent is None:
            return
        with self._cond:
            for k in keys:
                self._sent.add(k)


class QueuedViolationExporter(ABC):
    """A network exporter whose violations go out through a RetryQueue, keyed by violation id.

    A subclass sets ``name``, sends a batch in ``_send`` and closes its connection in
    ``_close``. It calls ``_start_queue`` last in its ``__init__``: the queue's worker
    may call ``_send`` at once.
    """

    name: str
    wants_actions = False
    _queue: RetryQueue[Violation]

    def _start_queue(self, telemetry: Telemetry, *, max_queue: int, batch_size: int, policy: RetryPolicy) -> None:
        self._queue = RetryQueue(
            self.name, telemetry, self._send, lambda v: v.violation_id,
            max_queue=max_queue, batch_size=batch_size, policy=policy, remember_sent=max_queue * 4,
        )

    @abstractmethod
    def _send(self, violations: list[Violation]) -> SendResult:
        """Deliver one batch; the queue retries it as the result says."""

    @abstractmethod
    def _close(self) -> None:
        """Release the connection, once the queue has stopped."""

    @property
    def queue(self) -> RetryQueue[Violation]:
        return self._queue

    def export(self, violations: Sequence[Violation]) -> None:
        self._queue.put(violations)

    def add_delivery_listener(self, listener: Callable[[Sequence[str]], None]) -> None:
        """``listener(violation_ids)`` once the endpoint accepted them (serve's outbox waits for it)."""
        self._queue.add_delivery_listener(listener)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._queue.shutdown(timeout_s)
        self._close()


def undelivered_in_queues(queues: Sequence[RetryQueue[Any]]) -> Undelivered:
    """What these retry queues still hold (queued or in flight): with state in memory, that is
    all that is owed. What a queue gave up on is counted in its ``exporter_dropped``."""
    def undelivered(violation_ids: Collection[str]) -> set[str]:
        owed: set[str] = set()
        for queue in queues:
            owed |= queue.holding(violation_ids)
        return owed
    return undelivered


def json_default(value: Any) -> Any:
    """For orjson: rule details may carry tuples, sets or bytes; they become arrays or strings."""
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def violation_document(violation: Violation, now_ns: int | None = None) -> dict[str, Any]:
    """``Violation.to_json()`` plus ``time``, RFC 3339: the violation's event time, or
    (for a violation without one) the time it was exported."""
    doc = violation.to_json()
    when = violation.time_ns if violation.time_ns is not None else (now_ns if now_ns is not None else time.time_ns())
    doc["time"] = format_rfc3339(when)
    return doc


def parse_retry_after(value: str | None) -> float | None:
    """Seconds asked for by an HTTP Retry-After header (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# Client errors worth a retry: the request timed out, or the server asked us to slow down.
_RETRYABLE_4XX = frozenset({408, 429})


def http_result(response: httpx.Response) -> SendResult:
    """What an HTTP answer to a delivery means: 2xx delivered; 5xx, 408 and 429 retried
    (after the server's Retry-After, if it gave one); any other status refused for good."""
    status = response.status_code
    if 200 <= status < 300:
        return SendResult.success()
    reason = f"HTTP {status}"
    if status >= 500 or status in _RETRYABLE_4XX:
        return SendResult.retry(reason, parse_retry_after(response.headers.get("Retry-After")))
    return SendResult.permanent(reason)
