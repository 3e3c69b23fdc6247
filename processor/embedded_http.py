"""serve's HTTP listeners (the OTLP/HTTP receiver and the operator view): uvicorn inside serve's loop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Generator
from typing import Any, Final

import uvicorn

from processor.config import TLSConfig

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
                 graceful_s: float) -> None:
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
        self._server = _EmbeddedUvicorn(uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", server_header=False,
            timeout_graceful_shutdown=int(graceful_s), **options,
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
