"""OTLP/gRPC receiver: ``opentelemetry.proto.collector.trace.v1.TraceService/Export`` on grpc.aio.

The handler stays light: check the token, parse, count, queue. Conversion and
evaluation happen in the evaluator worker. The method is registered with a raw-bytes
deserializer so that a body which does not parse is answered INVALID_ARGUMENT with
what failed (grpc's own deserializer would answer INTERNAL). A message over
``max_recv_msg_size`` never reaches the handler: grpc answers RESOURCE_EXHAUSTED.

Bytes are counted before gRPC buffers them. A unary handler would only run once
gRPC holds the whole message, so ``Export`` is served as a stream of one message
(the same bytes on the wire): the handler first takes ``max_recv_msg_size`` from the
byte budget, and only then asks for the message; past the budget the call is
refused UNAVAILABLE with a RetryInfo and its message is never read. Once read, the
reservation shrinks to the message's size. What gRPC holds for a stream nobody reads
is bounded by its flow-control window, kept at its initial size (BDP probing off),
and by the streams one connection may open (``grpc.max_concurrent_streams``).

Status codes (OTLP specification): INVALID_ARGUMENT for undecodable data,
UNAUTHENTICATED for a missing or wrong bearer token, UNAVAILABLE with a
``google.rpc.RetryInfo`` when the queue is full or the server is shutting down.
The standard health service reports SERVING once started and NOT_SERVING while
draining; it needs no token, so orchestrators can probe it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, NoReturn

import grpc
from google.rpc import code_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from processor.config import GrpcReceiverConfig
from processor.embedded_http import bind_listener
from processor.open_files import listener_share
from processor.receive.budget import BudgetSpent, ByteBudget, Claim
from processor.receive.otlp_common import (
    RefusalLog,
    RequestDecodeError,
    bearer_token_ok,
    count_spans,
    parse_protobuf,
    retry_status,
    too_many_spans,
)
from processor.receive.queue import Batch, IngestQueue, ProcessingFailed, QueueClosed, QueueFull
from processor.telemetry import Telemetry

logger = logging.getLogger(__name__)

TRACE_SERVICE: Final = trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name
# The standard key, and the one the OpenTelemetry Python exporter reads RetryInfo from.
_STATUS_DETAILS_KEY: Final = "grpc-status-details-bin"
_RETRY_INFO_KEY: Final = "google.rpc.retryinfo-bin"
# Where spans came from, as violations name it.
ORIGIN: Final = "otlp-grpc"
# Streams one connection may have open at once; more wait in the client (HTTP/2 SETTINGS).
MAX_STREAMS_PER_CONNECTION: Final = 32


def _ms(seconds: float) -> int:
    return max(1, round(float(seconds) * 1000))


def _server_credentials(cfg: GrpcReceiverConfig) -> grpc.ServerCredentials:
    with open(cfg.tls.key_file, "rb") as handle:
        key = handle.read()
    with open(cfg.tls.cert_file, "rb") as handle:
        cert = handle.read()
    client_ca = None
    if cfg.tls.client_ca_file:
        with open(cfg.tls.client_ca_file, "rb") as handle:
            client_ca = handle.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


class OTLPGrpcReceiver:
    def __init__(
        self,
        cfg: GrpcReceiverConfig,
        queue: IngestQueue,
        telemetry: Telemetry,
        accepting: Callable[[], bool],
        *,
        max_spans_per_request: int | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self._cfg = cfg
        self._span_limit = max_spans_per_request
        # Shared with the HTTP receiver in serve; alone, the receiver gets its own.
        self._budget = budget if budget is not None else ByteBudget(4 * int(cfg.max_recv_msg_size))
        self._queue = queue
        self._telemetry = telemetry
        self._accepting = accepting
        self._server: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._refusals = RefusalLog(logger)
        self.port = 0

    async def start(self) -> int:
        """Bind and start serving; returns the bound port (useful with ``:0``)."""
        connections = self._cfg.connections
        server = grpc.aio.server(
            options=[
                # The connection limits every listener has (processor.listener_config.ConnectionLimits).
                ("grpc.max_allowed_incoming_connections", listener_share(connections.max_open)),
                ("grpc.server_handshake_timeout_ms", _ms(connections.header_timeout)),
                ("grpc.max_connection_idle_ms", _ms(connections.idle_timeout)),
                ("grpc.max_receive_message_length", int(self._cfg.max_recv_msg_size)),
                ("grpc.max_send_message_length", 4 * 1024 * 1024),
                # A second serve on the same port must fail, not share the port unnoticed.
                ("grpc.so_reuseport", 0),
                # Bytes of a message nobody has asked for yet stay within the initial window.
                ("grpc.http2.bdp_probe", 0),
                ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
            ]
        )
        # A stream of one message: the handler runs before the message is read (see the module's doc).
        handler = grpc.stream_unary_rpc_method_handler(
            self._export,
            request_deserializer=None,  # raw bytes: we parse, so bad input gets INVALID_ARGUMENT
            response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(TRACE_SERVICE, {"Export": handler}),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if not self._cfg.endpoint.endswith(":0"):
            # A port in use is said in our words before gRPC's C core logs its own raw line about it.
            bind_listener(self._cfg.endpoint, "receivers.otlp.grpc.endpoint", 1).close()
        try:
            if self._cfg.tls.enabled:
                port = server.add_secure_port(self._cfg.endpoint, _server_credentials(self._cfg))
            else:
                port = server.add_insecure_port(self._cfg.endpoint)
        except RuntimeError:
            # grpc says only "Failed to bind"; the usual cause is another process on the port.
            raise OSError(
                f"receivers.otlp.grpc.endpoint: cannot listen on {self._cfg.endpoint} (in use or not available)"
            ) from None
        await server.start()
        self._server = server
        self.port = port
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(TRACE_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        return port

    async def set_draining(self) -> None:
        await self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._health.set(TRACE_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls; calls in flight get ``grace_s`` to finish (they wait for their acknowledgement)."""
        if self._server is not None:
            await self._server.stop(grace_s)

    async def _export(self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        claim = self._budget.claim()
        try:
            return await self._export_claimed(messages, context, claim)
        finally:
            claim.release()

    async def _export_claimed(
        self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any], claim: Claim
    ) -> Any:
        token = self._cfg.auth.bearer_token
        if token:
            metadata = context.invocation_metadata() or ()
            authorization = next((str(v) for k, v in metadata if k == "authorization"), None)
            if not bearer_token_ok(token, authorization):
                self._refusals.refused("OTLP/gRPC export (UNAUTHENTICATED)", "missing or wrong bearer token")
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        # The largest message gRPC would accept, taken before it is read; what it does not use is given back.
        reserved = int(self._cfg.max_recv_msg_size)
        try:
            claim.take(reserved)
        except BudgetSpent as exc:
            await self._refuse(context, 0, exc, self._queue.retry_after_s)
        try:
            body = await asyncio.wait_for(self._one_message(messages, context),
                                          float(self._cfg.connections.body_timeout))
        except TimeoutError:
            self._refusals.refused("OTLP/gRPC export (DEADLINE_EXCEEDED)", "the request message did not arrive "
                                   "within receivers.otlp.grpc.connections.body_timeout")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the request message did not arrive within the server's body_timeout")
        claim.give_back(max(0, reserved - len(body)))
        try:
            request = parse_protobuf(body)
        except RequestDecodeError as exc:
            self._refusals.refused("OTLP/gRPC export (INVALID_ARGUMENT)", str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        spans = count_spans(request)
        self._telemetry.spans_received.labels("grpc").inc(spans)
        if spans == 0:
            return trace_service_pb2.ExportTraceServiceResponse()
        if self._span_limit is not None and spans > self._span_limit:
            self._telemetry.spans_rejected.labels("grpc", "too_many_spans").inc(spans)
            message = too_many_spans(spans, self._span_limit)
            self._refusals.refused("OTLP/gRPC export (INVALID_ARGUMENT)", message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        if not self._accepting():
            await self._refuse(context, spans, QueueClosed(), self._queue.retry_after_s)
        batch = Batch(request=request, span_count=spans, protocol="grpc", origin=ORIGIN, body=body)
        try:
            ack = await self._queue.put_and_wait_durable(batch)
        except QueueFull as exc:
            await self._refuse(context, spans, exc, exc.retry_after_s)
        except (QueueClosed, ProcessingFailed) as exc:
            await self._refuse(context, spans, exc, self._queue.retry_after_s)
        response = trace_service_pb2.ExportTraceServiceResponse()
        if ack.rejected_spans:
            response.partial_success.rejected_spans = ack.rejected_spans
            response.partial_success.error_message = ack.message
        return response

    async def _one_message(
        self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """The call's one request message; a client that streams none or several is refused."""
        async for body in messages:
            async for _ in messages:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Export takes one request message")
            return body
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request message")

    async def _refuse(
        self, context: grpc.aio.ServicerContext[Any, Any], spans: int, exc: Exception, retry_after_s: float
    ) -> NoReturn:
        reason = "queue_full" if isinstance(exc, QueueFull) else "unavailable"
        if spans:
            self._telemetry.spans_rejected.labels("grpc", reason).inc(spans)
        status = retry_status(code_pb2.UNAVAILABLE, str(exc), retry_after_s)
        info = status.details[0].value
        await context.abort(
            grpc.StatusCode.UNAVAILABLE,
            str(exc),
            trailing_metadata=((_STATUS_DETAILS_KEY, status.SerializeToString()), (_RETRY_INFO_KEY, info)),
        )

