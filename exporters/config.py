"""The ``exporters:`` section of the configuration.

Every exporter is off until its destination is set: ``jsonl.path``, ``otlp.endpoint``,
``prometheus.endpoint``, ``otlp_metrics.endpoint``, ``alertmanager.url`` or
``webhook.url``. Each sub-section checks its own fields and names them by config path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from exporters.base import RetryPolicy
from processor.configfmt import ByteSize, Duration, check_endpoint, check_url
from processor.errors import Problem
from processor.listener_config import AuthConfig, MetricsConnections, TLSConfig

# An HTTP header name (RFC 9110 token); gRPC metadata keys are a lowercase subset of it.
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_TEMPLATE_FIELD = re.compile(r"\{([^{}]*)\}")
TRACE_URL_FIELDS = ("trace_id", "span_id", "session_id", "violation_id")

# Defaults (constants, so that dataclass defaults are not calls).
_10S = Duration(10.0)
_1S = Duration(1.0)
_30S = Duration(30.0)
_64MIB = ByteSize(64 * 1024 * 1024)
_256MIB = ByteSize(256 * 1024 * 1024)
_1M = Duration(60.0)
_1H = Duration(3600.0)


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_positive(value: float, path: str) -> list[Problem]:
    return [] if value > 0 else [Problem(path, "must be greater than 0")]


def _check_headers(headers: dict[str, str], path: str) -> list[Problem]:
    problems = []
    for name, value in headers.items():
        if not _HEADER_NAME.match(name):
            problems.append(Problem(_at(path, name), "is not a valid header name"))
        elif "\n" in value or "\r" in value:
            problems.append(Problem(_at(path, name), "must not contain a line break"))
    return problems


@dataclass(slots=True)
class DeliverySettings:
    """The bounded retry queue of a network exporter (see docs/exporters.md)."""

    timeout: Duration = _10S
    max_queue: int = 10000
    max_attempts: int = 10
    initial_backoff: Duration = _1S
    max_backoff: Duration = _30S

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.max_attempts, float(self.initial_backoff), float(self.max_backoff))

    def validate_delivery(self, path: str) -> list[Problem]:
        problems = _check_positive(self.timeout, _at(path, "timeout"))
        problems += _check_positive(self.max_queue, _at(path, "max_queue"))
        problems += _check_positive(self.max_attempts, _at(path, "max_attempts"))
        problems += _check_positive(self.initial_backoff, _at(path, "initial_backoff"))
        if self.max_backoff < self.initial_backoff:
            problems.append(Problem(_at(path, "max_backoff"), "must not be less than initial_backoff"))
        return problems


@dataclass(slots=True)
class JsonlConfig:
    path: str = ""
    rotate_max_size: ByteSize = _64MIB
    rotate_keep: int = 5
    # Rotated copies holding violations other exporters have not delivered yet are kept
    # past rotate_keep, up to this many bytes in all; 0 holds nothing.
    rotate_hold_max_size: ByteSize = _256MIB
    fsync: Literal["always", "batch", "never"] = "batch"
    actions: bool = False
    actions_path: str = ""
    # How many written violation ids are remembered to avoid writing one twice.
    dedupe_ids: int = 100000
    max_queue: int = 10000
    max_attempts: int = 10

    def validate(self, path: str) -> list[Problem]:
        problems = []
        if self.rotate_keep < 0:
            problems.append(Problem(_at(path, "rotate_keep"), "must not be negative"))
        if self.rotate_hold_max_size < 0:
            problems.append(Problem(_at(path, "rotate_hold_max_size"), "must not be negative"))
        if self.actions and not self.actions_path:
            problems.append(Problem(_at(path, "actions_path"), "is required when actions is true"))
        if self.actions_path and self.actions_path == self.path:
            problems.append(Problem(_at(path, "actions_path"), "must differ from path"))
        if self.actions_path and not self.actions:
            problems.append(Problem(_at(path, "actions_path"), "is set but actions is false"))
        problems += _check_positive(self.dedupe_ids, _at(path, "dedupe_ids"))
        problems += _check_positive(self.max_queue, _at(path, "max_queue"))
        problems += _check_positive(self.max_attempts, _at(path, "max_attempts"))
        return problems


@dataclass(slots=True)
class OtlpConfig(DeliverySettings):
    """Violation spans. ``endpoint`` is host:port for grpc, a URL for http."""

    endpoint: str = ""
    protocol: Literal["grpc", "http"] = "grpc"
    insecure: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    batch_size: int = 512

    def validate(self, path: str) -> list[Problem]:
        problems = self.validate_delivery(path)
        problems += _check_otlp_endpoint(self.endpoint, self.protocol, _at(path, "endpoint"))
        problems += _check_headers(self.headers, _at(path, "headers"))
        problems += _check_positive(self.batch_size, _at(path, "batch_size"))
        return problems


def _check_otlp_endpoint(endpoint: str, protocol: str, path: str) -> list[Problem]:
    if not endpoint:
        return []
    if protocol == "http":
        return check_url(endpoint, path)
    if endpoint.startswith(("http://", "https://")):
        return check_endpoint(endpoint.split("://", 1)[1].rstrip("/"), path)
    return check_endpoint(endpoint, path)


@dataclass(slots=True)
class PrometheusConfig:
    """Scrape endpoint: host:port serving ``/metrics``, with the same TLS, auth and limits as the other listeners."""

    endpoint: str = ""
    tls: TLSConfig = field(default_factory=TLSConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    connections: MetricsConnections = field(default_factory=MetricsConnections)

    def validate(self, path: str) -> list[Problem]:
        return check_endpoint(self.endpoint, _at(path, "endpoint"))


@dataclass(slots=True)
class OtlpMetricsConfig:
    """Push the self-metrics over OTLP every ``interval``."""

    endpoint: str = ""
    protocol: Literal["grpc", "http"] = "grpc"
    insecure: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    interval: Duration = _1M
    timeout: Duration = _10S

    def validate(self, path: str) -> list[Problem]:
        problems = _check_otlp_endpoint(self.endpoint, self.protocol, _at(path, "endpoint"))
        problems += _check_headers(self.headers, _at(path, "headers"))
        problems += _check_positive(self.interval, _at(path, "interval"))
        problems += _check_positive(self.timeout, _at(path, "timeout"))
        return problems


@dataclass(slots=True)
class AlertmanagerConfig(DeliverySettings):
    """Alerts for Alertmanager's API v2; ``url`` is its base URL."""

    url: str = ""
    resend_interval: Duration = _1M
    # 0: an alert ends only when the pipeline resolves it.
    resolve_after: Duration = _1H
    trace_url_template: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    max_active: int = 10000

    def validate(self, path: str) -> list[Problem]:
        problems = self.validate_delivery(path)
        problems += check_url(self.url, _at(path, "url"))
        problems += _check_positive(self.resend_interval, _at(path, "resend_interval"))
        problems += _check_positive(self.max_active, _at(path, "max_active"))
        problems += _check_headers(self.headers, _at(path, "headers"))
        for name in _TEMPLATE_FIELD.findall(self.trace_url_template):
            if name not in TRACE_URL_FIELDS:
                problems.append(Problem(
                    _at(path, "trace_url_template"),
                    f"unknown placeholder {{{name}}}; allowed: " + ", ".join(f"{{{f}}}" for f in TRACE_URL_FIELDS),
                ))
        return problems


@dataclass(slots=True)
class WebhookConfig(DeliverySettings):
    """JSON POSTs; with ``batch_size: 1`` the Idempotency-Key is the violation id."""

    url: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    batch_size: int = 1

    def validate(self, path: str) -> list[Problem]:
        problems = self.validate_delivery(path)
        problems += check_url(self.url, _at(path, "url"))
        problems += _check_headers(self.headers, _at(path, "headers"))
        problems += _check_positive(self.batch_size, _at(path, "batch_size"))
        return problems


@dataclass(slots=True)
class ExportersConfig:
    jsonl: JsonlConfig = field(default_factory=JsonlConfig)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    prometheus: PrometheusConfig = field(default_factory=PrometheusConfig)
    otlp_metrics: OtlpMetricsConfig = field(default_factory=OtlpMetricsConfig)
    alertmanager: AlertmanagerConfig = field(default_factory=AlertmanagerConfig)
    webhook: WebhookConfig = field(default_factory=WebhookConfig)
