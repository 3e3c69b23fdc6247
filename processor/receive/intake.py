"""Both OTLP receivers of one process in front of its queue: started, drained and stopped together.

``serve`` (the evaluator) and its first-tier mode (``route.endpoint``, processor.route)
receive the same way: gRPC and HTTP share one byte budget and one bounded queue, and
whoever consumes the queue decides when a request is acknowledged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from processor.config import OTLPReceiverConfig
from processor.embedded_http import EmbeddedHttpServer
from processor.listener_config import AuthConfig, TLSConfig
from processor.receive.budget import ByteBudget
from processor.receive.otlp_grpc import OTLPGrpcReceiver
from processor.receive.otlp_http import build_app
from processor.receive.queue import IngestQueue
from processor.telemetry import Telemetry

# serve's start-up lines come under one name, whichever part prints them.
logger = logging.getLogger("processor.serve")

# How long receivers wait for calls still open once the queue is drained (those are only being refused).
RECEIVER_GRACE_S: Final = 3.0

Check = Callable[[], tuple[bool, str]]


def describe_protection(tls: TLSConfig, auth: AuthConfig) -> str:
    """What guards a listener, for the start-up log: an operator sees at once that auth is off."""
    if not tls.enabled:
        transport = "TLS off"
    elif tls.client_ca_file:
        transport = "TLS on, client certificates required"
    else:
        transport = "TLS on"
    return f"{transport}, bearer-token auth {'on' if auth.bearer_token else 'off'}"


def with_port(endpoint: str, port: int) -> str:
    return f"{endpoint.rpartition(':')[0]}:{port}"


class OtlpIntake:
    """The gRPC and HTTP receivers configured in ``cfg``, feeding ``queue``."""

    def __init__(
        self, cfg: OTLPReceiverConfig, queue: IngestQueue, telemetry: Telemetry,
        *, alive: Check, healthy: Callable[[], bool], failing: str,
    ) -> None:
        """``alive``: the consumer of the queue comes round (liveness); ``healthy``: its store takes
        writes, else readiness says ``failing``."""
        self._cfg = cfg
        self._queue = queue
        self._telemetry = telemetry
        self._alive = alive
        self._healthy = healthy
        self._failing = failing
        # Set by the owner once everything behind the receivers runs too; set by drain().
        self.started = False
        self.draining = False
        # Request bytes both receivers hold at once (processor.receive.budget).
        self.budget = ByteBudget(int(cfg.max_bytes_in_flight))
        self._grpc: OTLPGrpcReceiver | None = None
        self._http: EmbeddedHttpServer | None = None
        self.grpc_port = 0
        self.http_port = 0

    def accepting(self) -> bool:
        return self.started and not self.draining

    def ready(self) -> tuple[bool, str]:
        """(ready, why not): what /readyz and the gRPC health answer say."""
        if not self.started:
            return False, "starting"
        if self.draining:
            return False, "shutting down"
        if self._queue.is_full():
            return False, "queue full"
        if not self._healthy():
            return False, self._failing
        return True, ""

    async def start(self) -> None:
        """Bind and start both receivers; OSError if an endpoint cannot be bound."""
        cfg = self._cfg
        if cfg.grpc.endpoint:
            self._grpc = OTLPGrpcReceiver(cfg.grpc, self._queue, self._telemetry, self.accepting,
                                          max_spans_per_request=cfg.max_spans_per_request, budget=self.budget)
            self.grpc_port = await self._grpc.start()
            logger.info("OTLP/gRPC receiver listening on %s", with_port(cfg.grpc.endpoint, self.grpc_port))
            logger.info("OTLP/gRPC receiver: %s", describe_protection(cfg.grpc.tls, cfg.grpc.auth))
        if cfg.http.endpoint:
            app = build_app(cfg.http, self._queue, self._telemetry, self.accepting, self.ready,
                            max_spans_per_request=cfg.max_spans_per_request, budget=self.budget, alive=self._alive)
            self._http = EmbeddedHttpServer(app, cfg.http.endpoint, cfg.http.tls, what="the HTTP receiver",
                                            where="receivers.otlp.http.endpoint", backlog=1024,
                                            graceful_s=RECEIVER_GRACE_S, connections=cfg.http.connections)
            self.http_port = self._http.port
            await self._http.start()
            logger.info("OTLP/HTTP receiver listening on %s", with_port(cfg.http.endpoint, self.http_port))
            logger.info("OTLP/HTTP receiver: %s", describe_protection(cfg.http.tls, cfg.http.auth))

    async def drain(self) -> bool:
        """Stop accepting: readiness and gRPC health turn NOT_SERVING, new requests are told to retry, the
        queue closes (its consumer finishes what it holds). False when already draining."""
        if self.draining:
            return False
        self.draining = True
        if self._grpc is not None:
            await self._grpc.set_draining()
        self._queue.close()
        return True

    async def stop(self, deadline: float) -> None:
        """Stop both receivers by ``deadline`` (monotonic); call once every accepted request has its answer."""
        if self._grpc is not None:
            await self._grpc.stop(max(0.5, min(RECEIVER_GRACE_S, deadline - time.monotonic())))
        if self._http is not None:
            # Every accepted request has its answer by now; a connection still open is idle or
            # being refused, and must not hold the exit for uvicorn's default 30 s.
            grace = max(1.0, min(RECEIVER_GRACE_S, deadline - time.monotonic()))
            await self._http.stop(deadline - time.monotonic(), graceful_s=grace)
