"""serve's HTTP listeners (the OTLP/HTTP receiver, the operator view, /metrics): uvicorn inside serve's loop.

Every listener runs uvicorn's h11 protocol under :mod:`processor.http_guard`: a cap on
open connections (its setting, or its share of the open-file limit) and a deadline for
each phase of a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import socket
import ssl
import time
from collections.abc import Generator
from typing import Any, Final

import uvicorn

from processor.http_guard import ConnectionGuard, GuardedH11Protocol, GuardLimits
from processor.listener_config import ConnectionLimits, TLSConfig
from processor.open_files import listener_share
from processor.receive.otlp_common import RefusalLog

logger = logging.getLogger(__name__)


class _ProcessLines(logging.Filter):
    """uvicorn's lines about its process, which every embedded server would print again.

    serve says once what listens where; the same "Started server process" from each server
    only repeats it. uvicorn's warnings and errors still pass.
    """

    _SAID_BY_SERVE = ("Started server process", "Finished server process", "Shutting down",
                      "Waiting for application", "Application startup complete", "Application shutdown complete")

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not str(record.msg).startswith(self._SAID_BY_SERVE)


logging.getLogger("uvicorn.error").addFilter(_ProcessLines())

_STARTUP_TIMEOUT_S: Final = 30.0


def bind_listener(endpoint: str, where: str, backlog: int) -> socket.socket:
    """A non-blocking socket listening on ``host:port``; a failure names the configuration key ``where``."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # SO_REUSEADDR (not SO_REUSEPORT): restart over TIME_WAIT, but a second serve on the port fails.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except OSError as exc:
        sock.close()
        raise OSError(f"{where}: cannot listen on {endpoint}: {exc.strerror or exc}") from None
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


# What accept() says when the process (or the system) is out of descriptors or buffers.
_OUT_OF_RESOURCES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def guard_limits(limits: ConnectionLimits) -> GuardLimits:
    """A listener's limits as its guard applies them: ``max_open`` within its share of the open files."""
    return GuardLimits(max_open=listener_share(limits.max_open), header_timeout_s=float(limits.header_timeout),
                       body_timeout_s=float(limits.body_timeout), idle_timeout_s=float(limits.idle_timeout))


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log a listener's failed accept (out of descriptors) once per interval, without a traceback.

    asyncio pauses the listener for a second and reports each failure through the loop's
    exception handler, which would log a full traceback every time.
    """
    refusals = RefusalLog(logger)

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_RESOURCES and "socket" in context:
            refusals.refused("a new connection (accept)", f"{exc.strerror or exc}; the listener pauses for 1s")
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside serve's loop: signals are serve's to handle, not uvicorn's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class EmbeddedHttpServer:
    """One ASGI app on a socket bound at construction (``port`` is known at once), run in the caller's loop.

    ``what`` names the listener in errors ("the HTTP receiver"); ``where`` is the configuration
    key of its endpoint; ``graceful_s`` is how long a stop waits for open connections.
    """

    def __init__(self, app: Any, endpoint: str, tls: TLSConfig, *, what: str, where: str, backlog: int,
                 graceful_s: float, connections: ConnectionLimits) -> None:
        self._what = what
        self._endpoint = endpoint
        sock = bind_listener(endpoint, where, backlog)
        self._sock = sock
        self.port: int = sock.getsockname()[1]
        options: dict[str, Any] = {}
        if tls.enabled:
            options = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
            if tls.client_ca_file:
                options.update(ssl_ca_certs=tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
        guard = ConnectionGuard(what, guard_limits(connections))
        protocol: Any = functools.partial(GuardedH11Protocol, guard=guard)
        self._server = _EmbeddedUvicorn(uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", server_header=False,
            timeout_graceful_shutdown=int(graceful_s), http=protocol,
            # The guard closes idle connections; uvicorn's own keep-alive timer must not come first.
            timeout_keep_alive=int(connections.idle_timeout) + 1, **options,
        ))
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve until :meth:`stop`; returns once uvicorn has started, raises what stopped it otherwise."""
        server = self._server
        self._task = asyncio.create_task(server.serve(sockets=[self._sock]))
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"{self._what} on {self._endpoint} did not start")
            if time.monotonic() > deadline:
                raise OSError(f"{self._what} on {self._endpoint} did not start in time")
            await asyncio.sleep(0.01)

    async def stop(self, timeout_s: float, graceful_s: float | None = None) -> None:
        """Stop accepting and wait up to ``timeout_s``; ``graceful_s`` shortens the wait for open connections."""
        if self._task is None:
            return
        if graceful_s is not None:
            self._server.config.timeout_graceful_shutdown = int(graceful_s)
        self._server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._task, max(1.0, timeout_s))
