"""The scrape endpoint: ``GET /metrics`` on ``exporters.prometheus.endpoint``.

It serves the pipeline's own registry (``Telemetry.registry``); the pipeline updates
the metrics, this exporter only exposes them. ``/`` answers with a pointer to
``/metrics``; any other path is a 404, so a mistyped scrape path fails visibly.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from exporters.base import describe_error
from processor.errors import ConfigError, Problem
from processor.records import Action
from processor.telemetry import Telemetry
from processor.violations import Violation

log = logging.getLogger("durable_check.exporters")

StartResponse = Callable[..., Any]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would flood the log."""


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_ThreadingServer):
    address_family = socket.AF_INET6


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


class PrometheusExporter:
    """Serves the registry for scraping; violations reach it as counters, not here."""

    name = "prometheus"
    wants_actions = False

    def __init__(self, endpoint: str, telemetry: Telemetry) -> None:
        host, port = split_endpoint(endpoint)
        metrics_app = make_wsgi_app(telemetry.registry)

        def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/metrics":
                result: Iterable[bytes] = metrics_app(environ, start_response)
                return result
            if path == "/":
                start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
                return [b"durable-check: metrics at /metrics\n"]
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"not found; metrics are at /metrics\n"]

        server_class = _Server6 if ":" in host else _ThreadingServer
        try:
            self._server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError([Problem("exporters.prometheus.endpoint",
                                       f"cannot listen on {endpoint}: {describe_error(exc)}")]) from exc
        self._thread = threading.Thread(target=self._server.serve_forever, name="exporter-prometheus", daemon=True)
        self._thread.start()
        log.info("exporter prometheus: serving /metrics on %s:%d", host, self.port)

    @property
    def port(self) -> int:
        """The bound port (useful when the endpoint asked for port 0)."""
        return int(self._server.server_address[1])

    def export(self, violations: Sequence[Violation]) -> None:
        """The pipeline counts violations in the registry; nothing to send."""

    def resolve(self, violation_ids: Sequence[str]) -> None:
        """Metrics have no per-violation state to clear."""

    def export_actions(self, actions: Sequence[Action]) -> None:
        """Actions are counted by the pipeline."""

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
