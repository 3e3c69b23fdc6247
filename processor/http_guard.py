"""Connection limits for serve's HTTP listeners: a cap on open connections and a deadline for each phase.

uvicorn arms a timer only between requests (keep-alive): a connection that sends
nothing, half a request head, or a body one byte at a time would otherwise hold a
file descriptor for as long as the client likes, and a few hundred of them use up the
process's open files. Each connection here is always under one deadline:

- ``head``: from the connection (or the first byte of a next request) to the end of
  the request head: ``header_timeout``;
- ``body``: from the end of the head to the end of the body: ``body_timeout``; past
  it the connection is closed and the app sees the client disconnect;
- ``idle``: between requests on a kept-alive connection: ``idle_timeout``;
- ``app``: the app has the whole request and answers; no deadline (the app's own bounds apply).

Past ``max_open`` connections on one listener, the oldest connection without a request
in progress (in ``head`` or ``idle``) is closed for the new one, so that slow clients
cannot keep a prompt one out; a connection is not closed for a newer one in its first
second until its first bytes have been read. When no open connection can be closed,
the new one is closed at once. Each kind of closing is logged at most once per interval.

The event loop accepts a burst of connections before it reads any of them, so on a plain
(not TLS) listener each new connection's waiting bytes are peeked at once, without
consuming them: part of a head already says what the first read would (the connection may
be closed for a newer one), and a whole head waiting is a prompt request that is not
closed before it is read. Otherwise a burst of slow clients, each spared for its first
second, would leave no room for a prompt request arriving amid them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Final, Literal

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from processor.receive.otlp_common import RefusalLog

logger = logging.getLogger(__name__)

Phase = Literal["head", "body", "app", "idle"]
_EVICTABLE: Final = ("head", "idle")
# A new connection whose first bytes have not been read yet is not closed for a newer one
# this long: when many connections are accepted at once, a prompt client among them must
# have its request read before the later ones take its place.
_FIRST_BYTES_GRACE_S: Final = 1.0
# How much of a new connection's waiting bytes is peeked; a longer head counts as part of one.
_PEEK_BYTES: Final = 8192
_END_OF_HEAD: Final = re.compile(rb"\n\r?\n")  # h11 accepts bare line feeds too


@dataclass(frozen=True, slots=True)
class GuardLimits:
    max_open: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float


class ConnectionGuard:
    """The open connections of one listener, oldest first, and its limits."""

    def __init__(self, what: str, limits: GuardLimits) -> None:
        self.what = what
        self.limits = limits
        # Insertion order is age order: the first evictable one is the oldest.
        self.open: dict[GuardedH11Protocol, None] = {}
        self._refusals = RefusalLog(logger)

    def admit(self, connection: GuardedH11Protocol) -> bool:
        """Make room for ``connection``; False when nothing can be closed for it (it is then closed)."""
        if len(self.open) >= self.limits.max_open:
            now = time.monotonic()
            oldest = next((c for c in self.open if c.evictable(now)), None)
            if oldest is None:
                self.note("max_open", f"{len(self.open)} connections are open, each with a request in progress; "
                                      "the new one was closed")
                return False
            self.note("max_open", f"{len(self.open)} connections are open; the oldest one without a request "
                                  "in progress was closed for a new one")
            oldest.close()
        self.open[connection] = None
        return True

    def forget(self, connection: GuardedH11Protocol) -> None:
        self.open.pop(connection, None)

    def note(self, limit: str, reason: str) -> None:
        """One line per limit per interval, naming the listener and the limit's setting."""
        self._refusals.refused(f"a connection to {self.what} ({limit})", reason)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for every phase and a per-listener cap (see the module's doc)."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._guard = guard
        self.phase: Phase = "head"
        self._deadline: asyncio.TimerHandle | None = None
        self._opened = time.monotonic()
        self._heard = False
        self._whole_head_waiting = False

    def evictable(self, now: float) -> bool:
        """No request in progress, and not a new connection whose first bytes are still to be read."""
        if self.phase == "idle":
            return True
        if self.phase != "head" or self._whole_head_waiting:
            return False
        return self._heard or now - self._opened >= _FIRST_BYTES_GRACE_S

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        waiting = _peek_waiting(transport)
        if waiting:
            self._whole_head_waiting = _END_OF_HEAD.search(waiting) is not None
            self._heard = not self._whole_head_waiting
        if not self._guard.admit(self):
            self.transport.abort()
            return
        self._enter("head")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._heard = True
        self._whole_head_waiting = False
        if self.phase == "idle":
            # The first bytes of a next request: its head has header_timeout from now.
            self._enter("head")
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.phase == "app":
            self._enter("idle")
            self._follow()  # a pipelined request may already be under way

    def close(self) -> None:
        """Close now (room for a newer connection, or a deadline passed)."""
        self._cancel()
        self._guard.forget(self)
        if not self.transport.is_closing():
            self.transport.close()

    def _follow(self) -> None:
        """Move to the phase h11's view of the client's side says."""
        state = self.conn.their_state
        if state is h11.SEND_BODY and self.phase in _EVICTABLE:
            self._enter("body")
        elif state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED) and self.phase != "app":
            self._enter("app")

    def _enter(self, phase: Phase) -> None:
        self._cancel()
        self.phase = phase
        limits = self._guard.limits
        seconds = {"head": limits.header_timeout_s, "body": limits.body_timeout_s,
                   "idle": limits.idle_timeout_s}.get(phase)
        if seconds is not None:
            self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, phase: Phase) -> None:
        self._deadline = None
        if phase != self.phase or self.transport.is_closing():
            return
        if phase != "idle":
            what = "request head" if phase == "head" else "request body"
            limit = "header_timeout" if phase == "head" else "body_timeout"
            seconds = self._guard.limits.header_timeout_s if phase == "head" else self._guard.limits.body_timeout_s
            self._guard.note(limit, f"no complete {what} within {seconds:g}s; closed")
        self.close()


def _peek_waiting(transport: asyncio.BaseTransport) -> bytes:
    """The bytes already waiting on a plain connection, left in place; b"" when there are none or it is TLS."""
    if transport.get_extra_info("sslcontext") is not None:
        return b""  # ciphertext says nothing about the head
    sock = transport.get_extra_info("socket")
    if sock is None:
        return b""
    # asyncio's socket wrapper offers no recv; a second socket object on the same descriptor
    # peeks and is detached, so the descriptor stays the transport's.
    peek = socket.socket(fileno=sock.fileno())
    try:
        return peek.recv(_PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return b""
    finally:
        peek.detach()
