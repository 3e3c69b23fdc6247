"""The scrape endpoint: ``GET /metrics`` on ``exporters.prometheus.endpoint``.

It serves the pipeline's own registry (``Telemetry.registry``); the pipeline updates
the metrics, this exporter only exposes them. ``/`` answers with a pointer to
``/metrics``; any other path is a 404, so a mistyped scrape path fails visibly.

It is served like serve's other listeners (:mod:`processor.embedded_http`): the same
TLS and bearer-token settings, the same connection cap and timeouts. It runs on its own
event loop in its own thread, so a scrape never waits for the receivers, nor they for it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Final

import orjson
from prometheus_client import make_asgi_app

from exporters.config import PrometheusConfig
from processor.errors import ConfigError, Problem
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import Violation

log = logging.getLogger("durable_check.exporters")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_START_TIMEOUT_S: Final = 30.0
_TEXT: Final = [(b"content-type", b"text/plain; charset=utf-8")]


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or _TEXT})
    await send({"type": "http.response.body", "body": body})


def scrape_app(telemetry: Telemetry, token: str | None) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``/metrics`` from the registry, behind the bearer token when one is set."""
    from processor.receive.otlp_common import bearer_token_ok

    metrics = make_asgi_app(telemetry.registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if token:
            authorization = next((value.decode("latin-1") for name, value in scope["headers"]
                                  if name == b"authorization"), None)
            if not bearer_token_ok(token, authorization):
                body = orjson.dumps({"error": "missing or wrong bearer token"})
                await _answer(send, 401, body, [(b"content-type", b"application/json"),
                                                (b"www-authenticate", b"Bearer")])
                return
        path = scope["path"]
        if path == "/metrics":
            await metrics(scope, receive, send)
        elif path == "/":
            await _answer(send, 200, b"durable-check: metrics at /metrics\n")
        else:
            await _answer(send, 404, b"not found; metrics are at /metrics\n")

    return app


class PrometheusExporter:
    """Serves the registry for scraping; violations reach it as counters, not here."""

    name = "prometheus"
    wants_actions = False

    def __init__(self, cfg: PrometheusConfig, telemetry: Telemetry) -> None:
        # Here, not at the top: every command imports the exporters' package, only serve serves.
        from processor.embedded_http import EmbeddedHttpServer, quiet_accept_errors

        try:
            self._server = EmbeddedHttpServer(
                scrape_app(telemetry, cfg.auth.bearer_token), cfg.endpoint, cfg.tls, what="the metrics endpoint",
                where="exporters.prometheus.endpoint", backlog=128, graceful_s=1, connections=cfg.connections,
            )
        except OSError as exc:
            raise ConfigError([Problem("exporters.prometheus.endpoint", str(exc).split(": ", 1)[-1])]) from None
        self._loop = asyncio.new_event_loop()
        quiet_accept_errors(self._loop)
        self._thread = threading.Thread(target=self._loop.run_forever, name="exporter-prometheus", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result(_START_TIMEOUT_S)
        except BaseException:
            self._close_loop(1.0)
            raise
        scheme = "https" if cfg.tls.enabled else "http"
        log.info("exporter prometheus: serving %s://%s:%d/metrics (TLS %s, bearer-token auth %s)", scheme,
                 cfg.endpoint.rpartition(":")[0], self.port, "on" if cfg.tls.enabled else "off",
                 "on" if cfg.auth.bearer_token else "off")

    @property
    def port(self) -> int:
        """The bound port (useful when the endpoint asked for port 0)."""
        return self._server.port

    def export(self, violations: Sequence[Violation]) -> None:
        """The pipeline counts violations in the registry; nothing to send."""

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """Metrics have no per-violation state to clear."""

    def export_actions(self, actions: Sequence[Action]) -> None:
        """Actions are counted by the pipeline."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self._loop.is_closed():
            return
        stopping = asyncio.run_coroutine_threadsafe(self._server.stop(timeout_s), self._loop)
        try:
            stopping.result(timeout_s + 1.0)
        except (TimeoutError, asyncio.CancelledError):
            log.warning("exporter prometheus: the endpoint did not stop within %.0fs", timeout_s)
        self._close_loop(timeout_s)

    def _close_loop(self, timeout_s: float) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
