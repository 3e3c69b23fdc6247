"""Processor mode: every received span goes on downstream, as it arrived.

The spans are already serialized OTLP, so they travel as protobuf messages over the
official gRPC stub or an HTTP POST, not through the SDK's exporter (which would need
SDK span objects). The only change is an attribute ``durable.violation.rules`` (the
ids of the rules a span's records tripped) on spans whose violations were known when
the request was evaluated.

Forwarding never holds up checking: the evaluator hands spans over with
:meth:`Forwarder.offer`, which never blocks; a bounded buffer (``max_buffer_spans``)
absorbs a slow or absent downstream, and what does not fit is dropped, counted in
``forward_dropped`` and logged (counts only, never payloads). A sender thread batches
(``max_batch_spans``) and retries with capped exponential backoff and jitter, at most
``max_attempts`` times per batch.
"""

from __future__ import annotations

import collections
import logging
import random
import ssl
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, cast

import grpc
import httpx
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from exporters.otlp_transport import RETRYABLE_GRPC_CODES, RETRYABLE_HTTP_STATUSES, grpc_target, http_url
from processor.config import ForwardConfig
from processor.telemetry import Telemetry
from processor.violations import Violation

logger = logging.getLogger(__name__)

VIOLATION_RULES_ATTRIBUTE: Final = "durable.violation.rules"

# Drop warnings are summarised at most this often, so an outage does not flood the log.
_DROP_LOG_INTERVAL_S: Final = 10.0


SpanKey = tuple[str, str]


def rules_by_span(violations: Iterable[Violation]) -> dict[SpanKey, set[str]]:
    """Rule ids per (trace id, span id), both in hex as violations carry them."""
    by_span: dict[SpanKey, set[str]] = collections.defaultdict(set)
    for violation in violations:
        if violation.trace_id and violation.span_id:
            by_span[(violation.trace_id, violation.span_id)].add(violation.rule)
    return by_span


def annotate(request: Any, rules: Mapping[SpanKey, set[str]]) -> int:
    """Set ``durable.violation.rules`` on the spans of ``request`` named in ``rules``; returns spans annotated."""
    if not rules:
        return 0
    annotated = 0
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found = rules.get((bytes(span.trace_id).hex(), bytes(span.span_id).hex()))
                if not found:
                    continue
                # Replace, not append: a span forwarded twice (redelivery) keeps one attribute.
                for index in range(len(span.attributes) - 1, -1, -1):
                    if span.attributes[index].key == VIOLATION_RULES_ATTRIBUTE:
                        del span.attributes[index]
                values = [common_pb2.AnyValue(string_value=rule) for rule in sorted(found)]
                span.attributes.append(
                    common_pb2.KeyValue(
                        key=VIOLATION_RULES_ATTRIBUTE,
                        value=common_pb2.AnyValue(array_value=common_pb2.ArrayValue(values=values)),
                    )
                )
                annotated += 1
    return annotated


@dataclass(slots=True)
class _Held:
    request: Any
    release_at: float
    keys: list[SpanKey]


class AnnotatingHold:
    """Holds evaluated requests until their own violations are known, then forwards them annotated.

    The engine orders spans: its session rules see a span once it has waited
    ``allowed_lateness`` (and the next tick has run), so those violations come out of a
    later batch or tick; only condition rules report from the request's own batch (add
    the request before noting them). Holding each request for that long before
    forwarding lets its spans carry them all. Used by the evaluator thread only.
    Bounded: beyond ``max_spans`` held, the oldest request goes on early, without what
    is not yet known.
    """

    def __init__(self, forwarder: Forwarder, hold_s: float, max_spans: int) -> None:
        self._forwarder = forwarder
        self._hold_s = hold_s
        self._max_spans = max_spans
        self._held: collections.deque[_Held] = collections.deque()
        self._spans = 0
        self._rules: dict[SpanKey, set[str]] = {}

    def add(self, request: Any, now: float) -> None:
        keys = [
            (bytes(span.trace_id).hex(), bytes(span.span_id).hex())
            for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans
        ]
        for key in keys:
            self._rules.setdefault(key, set())
        self._held.append(_Held(request, now + self._hold_s, keys))
        self._spans += len(keys)
        while self._spans > self._max_spans and len(self._held) > 1:
            self._release(self._held.popleft())

    def note(self, violations: Iterable[Violation]) -> None:
        """Violations just found: remember the rules of spans still held."""
        for violation in violations:
            found = self._rules.get((violation.trace_id, violation.span_id))
            if found is not None:
                found.add(violation.rule)

    def release_due(self, now: float) -> None:
        while self._held and self._held[0].release_at <= now:
            self._release(self._held.popleft())

    def release_all(self) -> None:
        while self._held:
            self._release(self._held.popleft())

    def _release(self, held: _Held) -> None:
        rules = {key: self._rules.pop(key) for key in held.keys if key in self._rules}
        self._spans -= len(held.keys)
        annotate(held.request, rules)
        self._forwarder.offer(held.request.resource_spans)


def split_resource_spans(resource_spans: trace_pb2.ResourceSpans, max_spans: int) -> list[tuple[Any, int]]:
    """``resource_spans`` as pieces of at most ``max_spans`` spans each (resource and scope kept on each)."""
    total = sum(len(ss.spans) for ss in resource_spans.scope_spans)
    if total <= max_spans:
        return [(resource_spans, total)]
    pieces: list[tuple[Any, int]] = []
    def fresh() -> Any:
        return trace_pb2.ResourceSpans(resource=resource_spans.resource, schema_url=resource_spans.schema_url)

    current = fresh()
    count = 0
    for scope_spans in resource_spans.scope_spans:
        target = None
        for span in scope_spans.spans:
            if count == max_spans:
                pieces.append((current, count))
                current = fresh()
                count = 0
                target = None
            if target is None:
                target = current.scope_spans.add(scope=scope_spans.scope, schema_url=scope_spans.schema_url)
            target.spans.append(span)
            count += 1
    if count:
        pieces.append((current, count))
    return pieces


@dataclass(slots=True)
class Outcome:
    ok: bool
    retryable: bool
    # The downstream's own suggestion (RetryInfo, Retry-After), if it gave one.
    retry_after_s: float | None
    reason: str
    rejected_spans: int = 0


class GrpcSender:
    """Sends ExportTraceServiceRequests over the OTLP gRPC stub."""

    def __init__(self, cfg: ForwardConfig) -> None:
        options = [("grpc.max_send_message_length", -1)]
        target, insecure = grpc_target(cfg.endpoint, cfg.insecure)
        if insecure:
            self._channel = grpc.insecure_channel(target, options=options)
        else:
            roots = None
            if cfg.ca_file:
                with open(cfg.ca_file, "rb") as handle:
                    roots = handle.read()
            self._channel = grpc.secure_channel(
                target, grpc.ssl_channel_credentials(root_certificates=roots), options=options
            )
        self._stub = trace_service_pb2_grpc.TraceServiceStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = tuple((name.lower(), value) for name, value in cfg.headers.items())
        self._timeout = cfg.timeout

    def send(self, request: trace_service_pb2.ExportTraceServiceRequest) -> Outcome:
        try:
            response = self._stub.Export(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            # What a stub raises is also the call: it carries the code and trailing metadata.
            call = cast(grpc.Call, error)
            code = call.code()
            retry_after = _grpc_retry_delay(call.trailing_metadata() or ())
            return Outcome(False, code in RETRYABLE_GRPC_CODES, retry_after, f"gRPC {code.name}")
        return Outcome(True, False, None, "", response.partial_success.rejected_spans)

    def close(self) -> None:
        self._channel.close()


def _grpc_retry_delay(trailing: Iterable[tuple[str, str | bytes]]) -> float | None:
    for key, value in trailing:
        if key != "grpc-status-details-bin" or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except DecodeError:  # a malformed detail from downstream only loses the hint
            return None
        for detail in status.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return float(info.retry_delay.seconds + info.retry_delay.nanos / 1e9)
    return None


class HttpSender:
    """Sends ExportTraceServiceRequests as OTLP/HTTP protobuf POSTs."""

    def __init__(self, cfg: ForwardConfig) -> None:
        self._url = http_url(cfg.endpoint, "traces")
        verify: bool | ssl.SSLContext = ssl.create_default_context(cafile=cfg.ca_file) if cfg.ca_file else True
        self._client = httpx.Client(timeout=cfg.timeout, verify=verify)
        self._headers = {**cfg.headers, "Content-Type": "application/x-protobuf"}

    def send(self, request: trace_service_pb2.ExportTraceServiceRequest) -> Outcome:
        try:
            response = self._client.post(self._url, content=request.SerializeToString(), headers=self._headers)
        except httpx.HTTPError as error:
            return Outcome(False, True, None, f"HTTP {type(error).__name__}")
        if 200 <= response.status_code < 300:
            rejected = 0
            if response.content and response.headers.get("content-type", "").startswith("application/x-protobuf"):
                answer = trace_service_pb2.ExportTraceServiceResponse()
                try:
                    answer.ParseFromString(response.content)
                    rejected = answer.partial_success.rejected_spans
                except DecodeError:  # an unreadable success body is still a success
                    rejected = 0
            return Outcome(True, False, None, "", rejected)
        retry_after = None
        header = response.headers.get("retry-after")
        if header is not None:
            try:
                retry_after = max(0.0, float(header))
            except ValueError:
                retry_after = None
        status = response.status_code
        return Outcome(False, status in RETRYABLE_HTTP_STATUSES, retry_after, f"HTTP {status}")

    def close(self) -> None:
        self._client.close()


def open_sender(cfg: ForwardConfig) -> GrpcSender | HttpSender:
    """A sender to ``cfg.endpoint`` over ``cfg.protocol``; ``send`` answers, ``close`` lets go of the connection."""
    return GrpcSender(cfg) if cfg.protocol == "grpc" else HttpSender(cfg)


class Forwarder:
    """Buffers spans and sends them downstream from a thread of its own."""

    def __init__(self, cfg: ForwardConfig, telemetry: Telemetry) -> None:
        self._cfg = cfg
        self._telemetry = telemetry
        self._sender = open_sender(cfg)
        self._buffer: collections.deque[tuple[Any, int]] = collections.deque()
        self._buffered_spans = 0
        self._oldest_at = 0.0
        self._cond = threading.Condition()
        self._stopping = False
        self._deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name="durable-check-forward", daemon=True)
        # Set by shutdown: cuts a retry's backoff short (the deadline then decides what is left).
        self._stop_event = threading.Event()
        self._dropped_since_log = 0
        self._last_drop_log = 0.0
        self._last_drop_reason = ""
        self.sent_spans = 0

    def start(self) -> None:
        self._thread.start()

    def offer(self, resource_spans: Iterable[Any]) -> None:
        """Buffer spans for sending; never blocks. What does not fit is dropped and counted."""
        pieces = [piece for unit in resource_spans for piece in split_resource_spans(unit, self._cfg.max_batch_spans)]
        dropped = 0
        with self._cond:
            stopped = self._stopping
            for piece, count in pieces:
                if count == 0:
                    continue
                if stopped or self._buffered_spans + count > self._cfg.max_buffer_spans:
                    dropped += count
                    continue
                if not self._buffer:
                    self._oldest_at = time.monotonic()
                self._buffer.append((piece, count))
                self._buffered_spans += count
            if self._buffered_spans >= self._cfg.max_batch_spans:
                self._cond.notify()
        if dropped:
            self._dropped(dropped, "forwarding has stopped" if stopped else "the forward buffer is full")

    def shutdown(self, timeout_s: float) -> None:
        """Send what is buffered within ``timeout_s``; what is left then is dropped and counted."""
        with self._cond:
            self._stopping = True
            self._deadline = time.monotonic() + timeout_s
            self._cond.notify_all()
        self._stop_event.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s + 1.0)
        with self._cond:
            left = self._buffered_spans
            self._buffer.clear()
            self._buffered_spans = 0
        if left:
            self._dropped(left, "shutdown timeout reached")
        self._sender.close()
        if self._dropped_since_log:
            self._log_drops(force=True)

    # -- sender thread ------------------------------------------------------------------

    def _next_batch(self) -> list[tuple[Any, int]] | None:
        with self._cond:
            while True:
                if self._buffer:
                    due = self._oldest_at + self._cfg.flush_interval
                    if self._stopping or self._buffered_spans >= self._cfg.max_batch_spans or time.monotonic() >= due:
                        break
                    self._cond.wait(max(0.0, due - time.monotonic()))
                    continue
                if self._stopping:
                    return None
                self._cond.wait(1.0)
            batch: list[tuple[Any, int]] = []
            spans = 0
            while self._buffer and spans + self._buffer[0][1] <= self._cfg.max_batch_spans:
                piece, count = self._buffer.popleft()
                batch.append((piece, count))
                spans += count
            self._buffered_spans -= spans
            if self._buffer:
                self._oldest_at = time.monotonic()
            return batch

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._send_with_retries(batch)

    def _send_with_retries(self, batch: list[tuple[Any, int]]) -> None:
        spans = sum(count for _, count in batch)
        request = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[piece for piece, _ in batch])
        reason = ""
        for attempt in range(self._cfg.max_attempts):
            if time.monotonic() >= self._deadline:
                reason = "shutdown timeout reached"
                break
            outcome = self._sender.send(request)
            if outcome.ok:
                self.sent_spans += spans
                if outcome.rejected_spans:
                    logger.warning("downstream rejected %d of %d forwarded spans", outcome.rejected_spans, spans)
                return
            reason = outcome.reason
            if not outcome.retryable:
                break
            if attempt + 1 == self._cfg.max_attempts:
                reason = f"{reason} after {self._cfg.max_attempts} attempts"
                break
            backoff = min(self._cfg.max_backoff, self._cfg.initial_backoff * 2**attempt)
            # Full jitter on the upper half: senders that failed together do not come back together.
            delay = random.uniform(backoff / 2, backoff)  # noqa: S311 - jitter, not security
            if outcome.retry_after_s is not None:
                delay = min(self._cfg.max_backoff, max(delay, outcome.retry_after_s))
            if not self._stop_event.is_set():
                self._stop_event.wait(delay)
            else:
                time.sleep(min(delay, max(0.0, self._deadline - time.monotonic())))
        self._dropped(spans, f"sending failed ({reason})")

    def _dropped(self, count: int, why: str) -> None:
        self._telemetry.forward_dropped.inc(count)
        with self._cond:
            self._dropped_since_log += count
            self._last_drop_reason = why
        self._log_drops(force=False)

    def _log_drops(self, force: bool) -> None:
        now = time.monotonic()
        with self._cond:
            if not force and now - self._last_drop_log < _DROP_LOG_INTERVAL_S:
                return
            count, why = self._dropped_since_log, self._last_drop_reason
            self._dropped_since_log = 0
            self._last_drop_log = now
        if count:
            logger.warning("processor mode dropped %d spans not forwarded downstream: %s", count, why)


def forward_headers_for_log(headers: Mapping[str, str]) -> str:
    """Header names only: values (tokens) never reach a log."""
    return ", ".join(sorted(headers)) or "none"


def redact_endpoint(endpoint: str) -> str:
    """The endpoint without credentials written into a URL (``https://user:secret@host``)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return endpoint
    userinfo, at, host = rest.partition("@")
    return f"{scheme}://{host}" if at and "/" not in userinfo else endpoint
