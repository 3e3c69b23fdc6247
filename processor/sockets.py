"""Listening sockets for serve's HTTP servers (the OTLP/HTTP receiver and the operator view)."""

from __future__ import annotations

import socket


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
