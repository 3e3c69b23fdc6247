"""Runs the operator view inside serve's event loop, on ``ui.endpoint``, with the receivers' TLS options."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from processor.config import Config
from processor.embedded_http import EmbeddedHttpServer
from processor.evaluate.model import RuleSet
from processor.operate.app import ViewContext, build_app
from processor.pipeline import Pipeline
from processor.state.base import StateStore
from processor.state.sqlstore import SqlStateStore
from processor.state.views import MemoryViews, ViewBounds, ViewStore
from processor.telemetry import Telemetry

_STARTUP_TIMEOUT_S: Final = 30.0


def attach_views(config: Config, pipeline: Pipeline, store: StateStore | None) -> ViewStore:
    """The read model for this store, fed by the pipeline from now on."""
    views: ViewStore
    bounds = ViewBounds(max_sessions=config.ui.max_sessions, max_actions=config.ui.max_actions)
    if isinstance(store, SqlStateStore):
        from processor.state.sqlviews import views_for

        # A session leaves the view once it has been idle as long as the engine keeps it.
        views = views_for(store, retention_s=float(config.evaluate.session_idle_timeout), bounds=bounds)
    else:
        views = MemoryViews(bounds)
    # Not served: only what the open-wait gauges read is kept (ViewStore.waits_only).
    views.waits_only = not config.ui.endpoint
    pipeline.views = views
    return views


def view_setup(config: Config) -> dict[str, Any]:
    """What the pages say about how this process is set up (no secrets, no paths)."""
    receivers = config.receivers.otlp
    backend = config.state.backend
    scope = {
        "memory": "the sessions this process evaluated since it started",
        "sqlite": "every session in this state database",
        "postgres": "every session of every replica sharing this database",
    }.get(backend, "")
    return {
        "trace_url": config.ui.trace_url,
        "receivers": [f"{name} {e}" for name, e in (("grpc", receivers.grpc.endpoint),
                                                     ("http", receivers.http.endpoint)) if e],
        "state": backend,
        "scope": scope,
    }


class UiServer:
    """The view's HTTP server; ``port`` is known once :meth:`start` returns."""

    def __init__(self, config: Config, views: ViewStore, rules: RuleSet, telemetry: Telemetry,
                 ready: Callable[[], tuple[bool, str]]) -> None:
        """``rules``: the rule set serve evaluates (the pages show each rule's fix)."""
        self._cfg = config.ui
        self._ctx = ViewContext(views, rules, telemetry, view_setup(config), ready)
        self._server: EmbeddedHttpServer | None = None
        self.port = 0

    async def start(self) -> None:
        cfg = self._cfg
        self._server = EmbeddedHttpServer(build_app(cfg, self._ctx), cfg.endpoint, cfg.tls, what="the operator view",
                                          where="ui.endpoint", backlog=128, graceful_s=2,
                                          connections=cfg.connections)
        self.port = self._server.port
        await self._server.start()

    async def stop(self, timeout_s: float = 3.0) -> None:
        if self._server is None:
            return
        await self._server.stop(timeout_s)
        self._ctx.views.close()
