"""What every listener shares in the configuration: TLS, bearer auth, and connection limits.

Its own module so that both ``processor.config`` (receivers, the view) and
``exporters.config`` (the metrics endpoint) use the same types without importing each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

from processor.configfmt import Duration
from processor.errors import Problem

_10S = Duration(10.0)
_15S = Duration(15.0)
_30S = Duration(30.0)
# The shortest timeout a listener takes: below it every real client would be cut.
_SHORTEST: Final = 0.1


@dataclass(slots=True)
class TLSConfig:
    """Server-side TLS: a certificate and key; with ``client_ca_file``, clients must present a certificate (mTLS)."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if bool(self.cert_file) != bool(self.key_file):
            missing = "key_file" if self.cert_file else "cert_file"
            problems.append(Problem(f"{path}.{missing}", "cert_file and key_file go together; set both or neither"))
        if self.client_ca_file and not self.cert_file:
            problems.append(
                Problem(f"{path}.client_ca_file", "client certificates need server TLS: set cert_file and key_file")
            )
        for name in ("cert_file", "key_file", "client_ca_file"):
            value = getattr(self, name)
            if value and not os.path.isfile(value):
                problems.append(Problem(f"{path}.{name}", f"file not found: {value}"))
        return problems


@dataclass(slots=True)
class AuthConfig:
    """A shared bearer token; clients send ``authorization: Bearer <token>``. Absent or null: no check.

    An empty string is refused rather than read as "off": it is what ``${env:VAR}``
    gives when VAR is set but empty, and serving without auth by accident is worse
    than not starting.
    """

    bearer_token: str | None = None

    def validate(self, path: str) -> list[Problem]:
        token = self.bearer_token
        if token == "":
            return [Problem(f"{path}.bearer_token", "is empty (an empty ${env:...} value?); "
                            "remove the key or set it to null to turn auth off")]
        if token and (token != token.strip() or any(c in token for c in "\r\n")):
            return [Problem(f"{path}.bearer_token", "must not contain spaces at either end or line breaks")]
        return []


@dataclass(slots=True)
class ConnectionLimits:
    """How many connections one listener keeps open, and how long each may take to say something.

    ``max_open``: past it, the oldest connection that has no request in progress is closed for
    the new one (a new connection is closed at once when every open one has a request in
    progress). serve lowers it to its share of the open-file limit. ``header_timeout``: from
    the connection (or the first byte of a next request) to the end of the request head.
    ``body_timeout``: from the end of the head to the end of the body. ``idle_timeout``:
    between requests on a kept-alive connection.
    """

    max_open: int = 1024
    header_timeout: Duration = _10S
    body_timeout: Duration = _30S
    idle_timeout: Duration = _15S

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if self.max_open < 1:
            problems.append(Problem(f"{path}.max_open", "must be at least 1"))
        for name in ("header_timeout", "body_timeout", "idle_timeout"):
            if getattr(self, name) < _SHORTEST:
                problems.append(Problem(f"{path}.{name}", "must be at least 100ms"))
        return problems


@dataclass(slots=True)
class ViewConnections(ConnectionLimits):
    """The operator view's limits: a few people and their browsers."""

    max_open: int = 128


@dataclass(slots=True)
class MetricsConnections(ConnectionLimits):
    """The scrape endpoint's limits: a few Prometheus servers, one connection each."""

    max_open: int = 32
