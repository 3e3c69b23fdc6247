"""What the gRPC and HTTP receivers share: decoding, status details, the token check, readiness."""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Final

from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from processor.records import Malformed

_BEARER: Final = "bearer "
# Partial-success messages list this many problems, then a count of the rest.
_MESSAGE_PROBLEMS: Final = 3


class RequestDecodeError(ValueError):
    """The body is not an OTLP trace request; the message says what failed, never what it held."""


def parse_protobuf(body: bytes) -> trace_service_pb2.ExportTraceServiceRequest:
    request = trace_service_pb2.ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        # upb names the failure ("Wire format was corrupt", "String field had bad UTF-8").
        detail = str(exc).rpartition(": ")[2] or "not protobuf"
        raise RequestDecodeError(f"cannot decode the body as an OTLP ExportTraceServiceRequest: {detail}") from None
    return request


def count_spans(request: Any) -> int:
    return sum(len(scope_spans.spans) for rs in request.resource_spans for scope_spans in rs.scope_spans)


def too_many_spans(spans: int, limit: int) -> str:
    """Why a request was refused whole: the sender must split it (a retry of the same request fails again)."""
    return (f"the request holds {spans} spans; at most {limit} are accepted per request "
            f"(receivers.otlp.max_spans_per_request): send smaller batches")


def bearer_token_ok(expected: str, authorization: str | None) -> bool:
    """``authorization`` is ``Bearer <expected>``; compared in constant time."""
    if authorization is None or authorization[: len(_BEARER)].lower() != _BEARER:
        return False
    presented = authorization[len(_BEARER):].strip()
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def retry_status(code: int, message: str, retry_after_s: float) -> status_pb2.Status:
    """A google.rpc.Status with a RetryInfo detail, as the OTLP specification asks for throttling."""
    seconds = math.floor(retry_after_s)
    info = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=seconds, nanos=int((retry_after_s - seconds) * 1e9))
    )
    status = status_pb2.Status(code=code, message=message)
    status.details.add().Pack(info)
    return status


def plain_status(code: int, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=code, message=message)


def status_json(status: status_pb2.Status) -> dict[str, Any]:
    """google.rpc.Status in JSON, as OTLP/HTTP answers a JSON request."""
    out: dict[str, Any] = {"code": status.code, "message": status.message}
    details = []
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            delay = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
            details.append({"@type": detail.type_url, "retryDelay": f"{delay:g}s"})
    if details:
        out["details"] = details
    return out


def rejected_span_count(rejected: list[Malformed], decode_problems: list[str]) -> int:
    """Spans (not records) that were refused: a span and its events count once."""
    spans = {(m.trace_id, m.span_id) for m in rejected if m.span_id}
    unnamed = sum(1 for m in rejected if not m.span_id)
    return len(spans) + unnamed + len(decode_problems)


def partial_success_message(rejected: list[Malformed], decode_problems: list[str]) -> str:
    problems = list(decode_problems) + [m.message for m in rejected]
    if not problems:
        return ""
    shown = "; ".join(problems[:_MESSAGE_PROBLEMS])
    more = len(problems) - _MESSAGE_PROBLEMS
    suffix = f" (and {more} more)" if more > 0 else ""
    return f"spans that could not be converted into action records: {shown}{suffix}"


class RefusalLog:
    """Logs refused requests without letting a broken client flood the log.

    The first refusal of each kind is logged with its reason; more of the same kind
    within ``interval_s`` are counted and summarised with the next one logged, with
    the span of time they were counted over (which may be far longer than the interval).
    """

    def __init__(
        self, logger: logging.Logger, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def refused(self, kind: str, reason: str) -> None:
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        more = self._suppressed.pop(kind, 0)
        suffix = ""
        if more and last is not None:
            suffix = f" ({more} more refused the same way since the one logged {_ago(now - last)} ago)"
        self._logger.warning("%s refused: %s%s", kind, reason, suffix)


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    return f"{seconds / 3600:.1f}h"
