"""Runs the operator view inside serve's event loop, on ``ui.endpoint``, with the receivers' TLS options."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable, Generator
from typing import Any, Final

import uvicorn

from processor.config import Config
from processor.operate.app import ViewContext, build_app
from processor.pipeline import Pipeline
from processor.sockets import bind_listener
from processor.state.base import StateStore
from processor.state.sqlstore import SqlStateStore
from processor.state.views import MemoryViews, ViewStore
from processor.telemetry import Telemetry

_STARTUP_TIMEOUT_S: Final = 30.0


def attach_views(config: Config, pipeline: Pipeline, store: StateStore | None) -> ViewStore:
    """The read model for this store, fed by the pipeline from now on."""
    views: ViewStore
    if isinstance(store, SqlStateStore):
        from processor.state.sqlviews import views_for

        # A session leaves the view once it has been idle as long as the engine keeps it.
        views = views_for(store, retention_s=float(config.evaluate.session_idle_timeout))
    else:
        views = MemoryViews(max_sessions=config.evaluate.max_sessions)
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


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside serve's loop: signals are serve's to handle."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class UiServer:
    """The view's HTTP server; ``port`` is known once :meth:`start` returns."""

    def __init__(self, config: Config, views: ViewStore, telemetry: Telemetry,
                 ready: Callable[[], tuple[bool, str]]) -> None:
        from processor.evaluate.rulefmt import load_rules

        rules = load_rules(config.evaluate.rules, include_shipped=config.evaluate.include_shipped_rules)
        self._cfg = config.ui
        self._ctx = ViewContext(views, rules, telemetry, view_setup(config), ready)
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> None:
        cfg = self._cfg
        sock = bind_listener(cfg.endpoint, "ui.endpoint", backlog=128)
        self.port = sock.getsockname()[1]
        tls: dict[str, Any] = {}
        if cfg.tls.enabled:
            tls = {"ssl_certfile": cfg.tls.cert_file, "ssl_keyfile": cfg.tls.key_file}
            if cfg.tls.client_ca_file:
                tls.update(ssl_ca_certs=cfg.tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        uv_config = uvicorn.Config(build_app(cfg, self._ctx), log_config=None, access_log=False, lifespan="off",
                                   server_header=False, timeout_graceful_shutdown=2, **tls)
        server = _EmbeddedUvicorn(uv_config)
        self._server = server
        self._task = asyncio.create_task(server.serve(sockets=[sock]))
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the operator view on {cfg.endpoint} did not start")
            if time.monotonic() > deadline:
                raise OSError(f"the operator view on {cfg.endpoint} did not start in time")
            await asyncio.sleep(0.01)

    async def stop(self, timeout_s: float = 3.0) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._task, max(1.0, timeout_s))
        self._ctx.views.close()
