"""OTLP delivery of a ready-made request over gRPC or HTTP/protobuf.

One attempt per call; retrying is the caller's (the retry queue's). Which failures are
worth a retry follows the OTLP specification: gRPC UNAVAILABLE, DEADLINE_EXCEEDED,
RESOURCE_EXHAUSTED, ABORTED, CANCELLED, OUT_OF_RANGE, DATA_LOSS; HTTP 429, 502, 503,
504 (with Retry-After honoured) and connection errors or timeouts. Anything else
(a 400, INVALID_ARGUMENT) would fail again the same way.
"""

from __future__ import annotations

import logging
from typing import Any, Final, Literal, Protocol
from urllib.parse import urlsplit

import grpc
import httpx
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from exporters.base import SendResult, describe_error, parse_retry_after
from processor._version import __version__
from processor.telemetry import Telemetry

log = logging.getLogger("durable_check.exporters")

Signal = Literal["traces", "metrics"]

# What the OTLP specification says a sender retries; anything else is refused for good.
RETRYABLE_GRPC_CODES: Final = frozenset({
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DATA_LOSS,
})
RETRYABLE_HTTP_STATUSES: Final = frozenset({429, 502, 503, 504})


class _Message(Protocol):
    def SerializeToString(self) -> bytes: ...


def grpc_target(endpoint: str, insecure: bool) -> tuple[str, bool]:
    """``host:port`` and whether to use plaintext: an http:// or https:// prefix decides, else ``insecure``."""
    if endpoint.startswith("http://"):
        return endpoint[len("http://"):].rstrip("/"), True
    if endpoint.startswith("https://"):
        return endpoint[len("https://"):].rstrip("/"), False
    return endpoint, insecure


def http_url(endpoint: str, signal: Signal) -> str:
    """The collector's base URL gets the signal's path; a URL with a path is used as is."""
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + f"/v1/{signal}"
    return endpoint


class OtlpTransport:
    def __init__(
        self,
        exporter: str,
        telemetry: Telemetry,
        *,
        endpoint: str,
        protocol: Literal["grpc", "http"],
        insecure: bool,
        headers: dict[str, str],
        timeout_s: float,
        signal: Signal,
    ) -> None:
        self._exporter = exporter
        self._telemetry = telemetry
        self._protocol = protocol
        self._signal = signal
        self._timeout_s = timeout_s
        self._channel: grpc.Channel | None = None
        self._http: httpx.Client | None = None
        self._grpc_call: Any = None
        if protocol == "grpc":
            target, plaintext = grpc_target(endpoint, insecure)
            self._channel = (
                grpc.insecure_channel(target) if plaintext
                else grpc.secure_channel(target, grpc.ssl_channel_credentials())
            )
            self._metadata = tuple((k.lower(), v) for k, v in headers.items())
            if signal == "traces":
                self._grpc_call = trace_service_pb2_grpc.TraceServiceStub(  # type: ignore[no-untyped-call]
                    self._channel).Export
            else:
                self._grpc_call = metrics_service_pb2_grpc.MetricsServiceStub(  # type: ignore[no-untyped-call]
                    self._channel).Export
        else:
            self._url = http_url(endpoint, signal)
            self._http = httpx.Client(
                timeout=timeout_s,
                headers={
                    "Content-Type": "application/x-protobuf",
                    "User-Agent": f"durable-check/{__version__}",
                    **headers,
                },
            )

    def send(self, request: _Message, timeout_s: float | None = None) -> SendResult:
        """One attempt; ``timeout_s`` shortens the configured timeout (a flush at shutdown)."""
        timeout = self._timeout_s if timeout_s is None else max(0.001, min(timeout_s, self._timeout_s))
        if self._protocol == "grpc":
            return self._send_grpc(request, timeout)
        return self._send_http(request, timeout)

    def _send_grpc(self, request: _Message, timeout: float) -> SendResult:
        try:
            response = self._grpc_call(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            # The raised error is also a grpc.Call; the stubs do not say so.
            code_of = getattr(exc, "code", None)
            code: grpc.StatusCode = code_of() if callable(code_of) else grpc.StatusCode.UNKNOWN
            reason = f"gRPC {code.name}"
            if code in RETRYABLE_GRPC_CODES:
                return SendResult.retry(reason)
            return SendResult.permanent(reason)
        self._check_partial_success(response)
        return SendResult.success()

    def _send_http(self, request: _Message, timeout: float) -> SendResult:
        assert self._http is not None
        try:
            response = self._http.post(self._url, content=request.SerializeToString(), timeout=timeout)
        except httpx.HTTPError as exc:
            return SendResult.retry(describe_error(exc))
        status = response.status_code
        if 200 <= status < 300:
            if response.content:
                parsed: Any = (
                    trace_service_pb2.ExportTraceServiceResponse() if self._signal == "traces"
                    else metrics_service_pb2.ExportMetricsServiceResponse()
                )
                try:
                    parsed.ParseFromString(response.content)
                except Exception:  # a success with an unreadable body is still a success
                    return SendResult.success()
                self._check_partial_success(parsed)
            return SendResult.success()
        reason = f"HTTP {status}"
        if status in RETRYABLE_HTTP_STATUSES:
            return SendResult.retry(reason, parse_retry_after(response.headers.get("Retry-After")))
        return SendResult.permanent(reason)

    def _check_partial_success(self, response: Any) -> None:
        partial = response.partial_success
        rejected = int(partial.rejected_spans if self._signal == "traces" else partial.rejected_data_points)
        if rejected:
            self._telemetry.exporter_dropped.labels(self._exporter).inc(rejected)
            # The receiver's message describes its reason, not our payload.
            log.warning("exporter %s: receiver rejected %d items (%s)", self._exporter, rejected,
                        partial.error_message[:200])

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._http is not None:
            self._http.close()
