"""The bounded queue between the receivers and the evaluator: backpressure instead of loss.

Receivers run in the asyncio loop; the single evaluator worker runs in its own thread
(the engine is not thread-safe, and evaluation must not stall the loop that answers
clients). The queue is bounded twice, by requests and by spans: a request that does
not fit is refused at once with a retryable error (gRPC UNAVAILABLE with RetryInfo,
HTTP 503 with Retry-After), and the sender's exporter retries it later. Nothing is
dropped silently.

A request is acknowledged in one place, :meth:`IngestQueue.put_and_wait_durable`:
it returns once the worker resolves the request's future. With the in-memory state
that is after conversion and evaluation (when the number of rejected spans for the
partial-success answer is known). With a durable store it is after conversion and
the inbox journal's commit (processor.worker): the request is on disk, and is
evaluated from the journal, after a crash too.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from processor.telemetry import Telemetry

Protocol = Literal["grpc", "http"]


@dataclass(frozen=True, slots=True)
class Ack:
    """What the receiver answers once a request is processed: OTLP partial success."""

    rejected_spans: int = 0
    # Names spans by position and what was wrong with their shape; never attribute values.
    message: str = ""


class QueueFull(Exception):
    """The queue has no room for the request; the sender should retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("the checker is busy: too many requests waiting to be evaluated")
        self.retry_after_s = retry_after_s


class QueueClosed(Exception):
    """The server is shutting down and accepts no more requests."""

    def __init__(self) -> None:
        super().__init__("the checker is shutting down and accepts no more data")


class ProcessingFailed(Exception):
    """The worker could not take the request through (a store failure); the sender should retry."""


@dataclass(slots=True)
class Batch:
    """One received request on its way to the worker."""

    # An ExportTraceServiceRequest or TracesData (both hold resource_spans).
    request: Any
    span_count: int
    protocol: Protocol
    origin: str
    # Spans the receiver already left out (OTLP/JSON spans that did not decode), with why.
    decode_problems: list[str] = field(default_factory=list)
    # The request's protobuf bytes as received (None for OTLP/JSON): a durable store journals them
    # as they are instead of serializing ``request`` again.
    body: bytes | None = None
    received_ns: int = field(default_factory=time.time_ns)
    # Resolved by the worker; the receiver answers the client from it.
    ack: concurrent.futures.Future[Ack] = field(default_factory=concurrent.futures.Future)


class IngestQueue:
    """Bounded by ``max_requests`` and ``max_spans``; one producer side (the loop), one consumer (the worker)."""

    def __init__(self, max_requests: int, max_spans: int, retry_after_s: float, telemetry: Telemetry) -> None:
        self.max_requests = max_requests
        self.max_spans = max_spans
        self.retry_after_s = retry_after_s
        self._telemetry = telemetry
        self._items: collections.deque[Batch] = collections.deque()
        self._spans = 0
        self._closed = False
        self._cond = threading.Condition()

    # -- receiver side ------------------------------------------------------------------

    async def put_and_wait_durable(self, batch: Batch) -> Ack:
        """The acknowledgement point: returns once the request is safely through; raises if refused.

        Raises QueueFull or QueueClosed when the request is not taken (answer retryable),
        ProcessingFailed when the worker could not process it (answer retryable).
        """
        self.try_put(batch)
        # Taken is taken: a client that gives up waiting does not take the request back out.
        return await asyncio.shield(asyncio.wrap_future(batch.ack))

    def try_put(self, batch: Batch) -> None:
        """Enqueue without waiting; QueueFull or QueueClosed when it is not taken."""
        with self._cond:
            if self._closed:
                raise QueueClosed()
            # An empty queue takes any request, so one larger than max_spans still gets through.
            if self._items and (
                len(self._items) >= self.max_requests or self._spans + batch.span_count > self.max_spans
            ):
                # Jittered, so refused senders do not all come back at the same moment.
                raise QueueFull(self.retry_after_s * random.uniform(1.0, 1.5))  # noqa: S311 - jitter
            self._items.append(batch)
            self._spans += batch.span_count
            self._telemetry.queue_depth.set(len(self._items))
            self._cond.notify()

    def is_full(self) -> bool:
        with self._cond:
            return len(self._items) >= self.max_requests or self._spans >= self.max_spans

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Refuse new requests; the worker still drains what is queued."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- worker side --------------------------------------------------------------------

    def get(self, timeout_s: float) -> Batch | None:
        """The next request, or None after ``timeout_s`` (or at once when closed and empty)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._items:
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    return None
                self._cond.wait(remaining)
            batch = self._items.popleft()
            self._spans -= batch.span_count
            self._telemetry.queue_depth.set(len(self._items))
            return batch

    def drained(self) -> bool:
        """Closed and nothing left: the worker may stop."""
        with self._cond:
            return self._closed and not self._items

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
