"""OTLP/HTTP receiver: ``POST /v1/traces`` (protobuf or JSON, gzip or zstd), ``/healthz``, ``/readyz``.

Answers follow the OTLP specification: 200 with an ``ExportTraceServiceResponse``
(partial success when spans could not be converted), 400 for a body that does not
decode, 401 for a missing or wrong bearer token, 405 for another method, 413 for a
body over ``max_request_body_size`` (before or after decompression), 415 for another
content type or encoding, 503 with ``Retry-After`` when the queue is full or the
server is shutting down. Error bodies are a ``google.rpc.Status`` in the request's
encoding (JSON when the content type itself was refused).

503 rather than 429: the server is overloaded as a whole, not rate-limiting one
client, and both make the official exporters retry.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, Final

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response
from google.rpc import code_pb2, status_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from processor.config import HttpReceiverConfig
from processor.convert.otlp_json import OtlpJsonError, decode_traces
from processor.receive._streams import StreamEnded, TooLong, decompress_whole
from processor.receive.budget import BudgetSpent, ByteBudget, Claim
from processor.receive.otlp_common import (
    RefusalLog,
    RequestDecodeError,
    bearer_token_ok,
    count_spans,
    parse_protobuf,
    plain_status,
    retry_status,
    status_json,
    too_many_spans,
)
from processor.receive.queue import Batch, IngestQueue, ProcessingFailed, QueueClosed, QueueFull
from processor.telemetry import Telemetry

logger = logging.getLogger(__name__)

PROTOBUF: Final = "application/x-protobuf"
JSON: Final = "application/json"
ORIGIN: Final = "otlp-http"
_JSON_DECODE_FACTOR: Final = 16
_HTTP_TO_RPC: Final = {
    400: code_pb2.INVALID_ARGUMENT,
    401: code_pb2.UNAUTHENTICATED,
    404: code_pb2.NOT_FOUND,
    405: code_pb2.UNIMPLEMENTED,
    413: code_pb2.RESOURCE_EXHAUSTED,
    415: code_pb2.INVALID_ARGUMENT,
    503: code_pb2.UNAVAILABLE,
}


class _Disconnected(Exception):
    """The client closed the connection before its body ended: nobody is left to answer."""


class _Refused(Exception):
    def __init__(self, http_status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.http_status = http_status
        self.headers = headers or {}


def _status_response(
    http_status: int, status: status_pb2.Status, media: str, headers: dict[str, str] | None = None
) -> Response:
    if media == PROTOBUF:
        return Response(status.SerializeToString(), http_status, headers=headers, media_type=PROTOBUF)
    return Response(orjson.dumps(status_json(status)), http_status, headers=headers, media_type=JSON)


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The decoded body, every gzip member or zstd frame; never more than ``limit`` bytes are inflated."""
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "zstd"):
        raise _Refused(415, f"unsupported Content-Encoding {encoding[:40]!r}; use gzip, zstd or none")
    try:
        out = decompress_whole(body, encoding, limit)
    except StreamEnded as exc:
        raise _Refused(400, f"{encoding} body does not decompress: {exc.reason}") from None
    if isinstance(out, TooLong):
        raise _Refused(413, f"decompressed body is larger than the limit of {limit} bytes")
    return out


def build_app(
    cfg: HttpReceiverConfig,
    queue: IngestQueue,
    telemetry: Telemetry,
    accepting: Callable[[], bool],
    ready: Callable[[], tuple[bool, str]],
    *,
    max_spans_per_request: int | None = None,
    budget: ByteBudget | None = None,
    alive: Callable[[], tuple[bool, str]] | None = None,
) -> FastAPI:
    """The receiver's ASGI app. ``accepting``: new data may come in; ``ready``: (ready, why not);
    ``alive``: (alive, why not), false when the process must be restarted (a stuck evaluator).

    ``budget`` is shared with the gRPC receiver in serve; alone, the app gets its own.
    """
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    limit = int(cfg.max_request_body_size)
    span_limit = max_spans_per_request
    in_flight = budget if budget is not None else ByteBudget(4 * limit)
    token = cfg.auth.bearer_token
    refusals = RefusalLog(logger)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # 404 and 405 come from routing; they answer with a Status like every other error.
        code = _HTTP_TO_RPC.get(exc.status_code, code_pb2.UNKNOWN)
        return _status_response(exc.status_code, plain_status(code, str(exc.detail)), JSON, dict(exc.headers or {}))

    @app.get("/healthz")
    async def healthz() -> Response:
        is_alive, why = alive() if alive is not None else (True, "")
        if not is_alive:
            return Response(orjson.dumps({"status": "stuck", "reason": why}), 503, media_type=JSON)
        return Response(orjson.dumps({"status": "alive"}), 200, media_type=JSON)

    @app.get("/readyz")
    async def readyz() -> Response:
        is_ready, why = ready()
        body = {"status": "ready"} if is_ready else {"status": "not ready", "reason": why}
        return Response(orjson.dumps(body), 200 if is_ready else 503, media_type=JSON)

    @app.post("/v1/traces")
    async def traces(request: Request) -> Response:
        claim = in_flight.claim()
        try:
            return await _traces(request, claim)
        finally:
            claim.release()

    async def _traces(request: Request, claim: Claim) -> Response:
        media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        answer_media = media if media in (PROTOBUF, JSON) else JSON
        try:
            if token and not bearer_token_ok(token, request.headers.get("authorization")):
                raise _Refused(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
            if media not in (PROTOBUF, JSON):
                shown = media[:60] or "none"
                raise _Refused(415, f"unsupported Content-Type {shown!r}; use {PROTOBUF} or {JSON}")
            encoding = request.headers.get("content-encoding", "").strip().lower()
            if encoding not in ("", "identity", "gzip", "zstd"):
                raise _Refused(415, f"unsupported Content-Encoding {encoding[:40]!r}; use gzip, zstd or none")
            try:
                body = await _read_body(request, limit, claim, queue.retry_after_s)
            except _Disconnected:
                # A client that goes away mid-body is common (restarts, timeouts): one
                # rate-limited line, not a traceback per connection.
                refusals.refused("OTLP/HTTP export (client disconnected)", "the body ended early")
                return Response(status_code=400)
            if encoding not in ("", "identity"):
                body = _decompress(body, encoding, limit)
                _take(claim, len(body), queue.retry_after_s)
            decode_problems: list[str] = []
            message: Any
            # The protobuf bytes (decompressed) as they are, for the journal; JSON has none.
            protobuf_body: bytes | None = None
            if media == PROTOBUF:
                try:
                    message = parse_protobuf(body)
                except RequestDecodeError as exc:
                    raise _Refused(400, str(exc)) from None
                protobuf_body = body
            else:
                # Parsed JSON holds ~18x its size in Python objects while it is converted (measured
                # on OTLP/JSON spans): that transient cost is taken from the budget too.
                transient = _JSON_DECODE_FACTOR * len(body)
                _take(claim, transient, queue.retry_after_s)
                try:
                    message, decode_problems = _decode_json(body)
                finally:
                    claim.give_back(transient)
            spans = count_spans(message) + len(decode_problems)
            telemetry.spans_received.labels("http").inc(spans)
            if spans == 0:
                return _success(answer_media, 0, "")
            if span_limit is not None and spans > span_limit:
                telemetry.spans_rejected.labels("http", "too_many_spans").inc(spans)
                raise _Refused(400, too_many_spans(spans, span_limit))
            if not accepting():
                telemetry.spans_rejected.labels("http", "unavailable").inc(spans)
                raise _Refused(503, str(QueueClosed()), _retry_after(queue.retry_after_s))
            batch = Batch(
                request=message, span_count=spans, protocol="http", origin=ORIGIN, decode_problems=decode_problems,
                body=protobuf_body,
            )
            try:
                ack = await queue.put_and_wait_durable(batch)
            except QueueFull as exc:
                telemetry.spans_rejected.labels("http", "queue_full").inc(spans)
                raise _Refused(503, str(exc), _retry_after(exc.retry_after_s)) from None
            except (QueueClosed, ProcessingFailed) as exc:
                telemetry.spans_rejected.labels("http", "unavailable").inc(spans)
                raise _Refused(503, str(exc), _retry_after(queue.retry_after_s)) from None
            return _success(answer_media, ack.rejected_spans, ack.message)
        except _Refused as refused:
            if refused.http_status != 503:
                # Busy answers are counted in spans_rejected; these are a sender's mistakes.
                refusals.refused(f"OTLP/HTTP export ({refused.http_status})", str(refused))
            code = _HTTP_TO_RPC.get(refused.http_status, code_pb2.UNKNOWN)
            if refused.http_status == 503:
                status = retry_status(code, str(refused), float(refused.headers["Retry-After"]))
            else:
                status = plain_status(code, str(refused))
            return _status_response(refused.http_status, status, answer_media, refused.headers)

    return app


def _retry_after(seconds: float) -> dict[str, str]:
    # Retry-After takes whole seconds.
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def _take(claim: Claim, size: int, retry_after_s: float) -> None:
    try:
        claim.take(size)
    except BudgetSpent as exc:
        raise _Refused(503, str(exc), _retry_after(retry_after_s)) from None


async def _read_body(request: Request, limit: int, claim: Claim, retry_after_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _Refused(413, f"body of {declared} bytes is larger than the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _Refused(413, f"body is larger than the limit of {limit} bytes")
            _take(claim, len(chunk), retry_after_s)
            chunks.append(chunk)
    except ClientDisconnect:
        raise _Disconnected from None
    return b"".join(chunks)


def _decode_json(body: bytes) -> tuple[object, list[str]]:
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _Refused(400, f"body is not JSON: {exc}") from None
    try:
        return decode_traces(document)
    except OtlpJsonError as exc:
        raise _Refused(400, f"body is not an OTLP/JSON trace request: {exc}") from None


def _success(media: str, rejected: int, message: str) -> Response:
    if media == PROTOBUF:
        response = trace_service_pb2.ExportTraceServiceResponse()
        if rejected:
            response.partial_success.rejected_spans = rejected
            response.partial_success.error_message = message
        return Response(response.SerializeToString(), 200, media_type=PROTOBUF)
    body: dict[str, object] = {}
    if rejected:
        body["partialSuccess"] = {"rejectedSpans": str(rejected), "errorMessage": message}
    return Response(orjson.dumps(body), 200, media_type=JSON)
