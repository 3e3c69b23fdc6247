"""The typed configuration of ``durable-check serve``.

Every section is a dataclass decoded by :mod:`processor.configfmt`; each section's
``validate`` adds the checks across its fields, so one run of :func:`load_config`
reports *every* problem with its config path (``receivers.otlp.grpc.endpoint: must be
host:port``) and never stops at the first.

Without a file, :data:`DEFAULT_CONFIG_YAML` applies: receivers on the loopback
interface only (nothing is exposed by accident) and every file under
``./durable-check-data/``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from exporters.config import ExportersConfig
from processor.config_paths import check_paths
from processor.configfmt import (
    ByteSize,
    Duration,
    YamlProblem,
    check_endpoint,
    check_url,
    decode,
    expand_env,
    key_places,
    load_yaml_strict,
    placed,
)
from processor.convert.options import ConvertOptions, ToolKindRule
from processor.errors import ConfigError, Problem
from processor.listener_config import AuthConfig, ConnectionLimits, TLSConfig, ViewConnections

if TYPE_CHECKING:
    from processor.evaluate.cel import CostLimits

# The crash-safe store ships in its own module; a build without it cannot honour `sqlite`.
SQLITE_STATE_AVAILABLE: bool = importlib.util.find_spec("processor.state.sqlite") is not None

DATA_DIR = "./durable-check-data"
_MiB = 1024 * 1024
# Dataclass defaults must be constants, not calls.
_16MiB = ByteSize(16 * _MiB)
_64MiB = ByteSize(64 * _MiB)
_256MiB = ByteSize(256 * _MiB)
_15S = Duration(15.0)
_1S = Duration(1.0)
_5S = Duration(5.0)
_7D = Duration(7 * 86400.0)
# ui.max_actions holds at least one session's story as the view keeps it
# (processor.state.views.MAX_ACTIONS_PER_SESSION, not imported: replay's start-up does not need the view).
ONE_SESSION_ACTIONS = 500
_200MS = Duration(0.2)
_500MS = Duration(0.5)
_30S = Duration(30.0)
_10S = Duration(10.0)
_120S = Duration(120.0)


@dataclass(slots=True)
class GrpcReceiverConfig:
    endpoint: str = "127.0.0.1:4317"
    # gRPC answers RESOURCE_EXHAUSTED above this (grpc's own max_receive_message_length).
    max_recv_msg_size: ByteSize = _16MiB
    tls: TLSConfig = field(default_factory=TLSConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)

    def validate(self, path: str) -> list[Problem]:
        problems = check_endpoint(self.endpoint, f"{path}.endpoint")
        if self.max_recv_msg_size < 1024:
            problems.append(Problem(f"{path}.max_recv_msg_size", "must be at least 1KiB"))
        return problems


@dataclass(slots=True)
class HttpReceiverConfig:
    endpoint: str = "127.0.0.1:4318"
    # Applies to the body as sent and again after gzip/zstd decompression (no decompression bombs).
    max_request_body_size: ByteSize = _16MiB
    tls: TLSConfig = field(default_factory=TLSConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)

    def validate(self, path: str) -> list[Problem]:
        problems = check_endpoint(self.endpoint, f"{path}.endpoint")
        if self.max_request_body_size < 1024:
            problems.append(Problem(f"{path}.max_request_body_size", "must be at least 1KiB"))
        return problems


@dataclass(slots=True)
class OTLPReceiverConfig:
    """An empty ``endpoint`` turns that receiver off."""

    grpc: GrpcReceiverConfig = field(default_factory=GrpcReceiverConfig)
    http: HttpReceiverConfig = field(default_factory=HttpReceiverConfig)
    # More spans in one request: refused whole (HTTP 400, gRPC INVALID_ARGUMENT) with the count and limit.
    max_spans_per_request: int = 10_000
    # Request bytes (as read and decoded) held by both receivers at once; past it: retry later.
    max_bytes_in_flight: ByteSize = _64MiB

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if self.max_spans_per_request < 1:
            problems.append(Problem(f"{path}.max_spans_per_request", "must be at least 1"))
        if self.max_bytes_in_flight < 1024:
            problems.append(Problem(f"{path}.max_bytes_in_flight", "must be at least 1KiB"))
        if not self.grpc.endpoint and not self.http.endpoint:
            problems.append(Problem(path, "both receivers are off (empty endpoints): serve would receive nothing"))
        elif self.grpc.endpoint and self.grpc.endpoint == self.http.endpoint and not self.grpc.endpoint.endswith(":0"):
            problems.append(Problem(f"{path}.http.endpoint", "same address as grpc.endpoint; each needs its own port"))
        return problems


@dataclass(slots=True)
class ReceiversConfig:
    otlp: OTLPReceiverConfig = field(default_factory=OTLPReceiverConfig)


@dataclass(slots=True)
class QueueConfig:
    """The bound between receiving and evaluating: past either limit, senders are told to retry later."""

    max_requests: int = 64
    max_spans: int = 200_000
    # Suggested to refused senders (gRPC RetryInfo, HTTP Retry-After, rounded up to whole seconds).
    retry_after: Duration = _1S

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if self.max_requests < 1:
            problems.append(Problem(f"{path}.max_requests", "must be at least 1"))
        if self.max_spans < 1:
            problems.append(Problem(f"{path}.max_spans", "must be at least 1"))
        if self.retry_after <= 0:
            problems.append(Problem(f"{path}.retry_after", "must be more than 0"))
        return problems


@dataclass(slots=True)
class RuleLimitsConfig:
    """What one rule expression may cost (docs/rules.md, "Limits")."""

    # Rules whose estimated worst case on one record exceeds this many steps are refused at load.
    max_cost: int = 1_000_000
    # When estimating: items in a list or map read from a record, characters in a string.
    assumed_list_size: int = 100
    assumed_string_chars: int = 100_000
    # At run time: items the macros of one evaluation may be given; past it the rule errs on that record.
    max_iterations: int = 100_000

    def validate(self, path: str) -> list[Problem]:
        return [
            Problem(f"{path}.{name}", "must be at least 1")
            for name in ("max_cost", "assumed_list_size", "assumed_string_chars", "max_iterations")
            if getattr(self, name) < 1
        ]

    def cost_limits(self) -> CostLimits:
        from processor.evaluate.cel import CostLimits

        return CostLimits(
            max_cost=self.max_cost,
            list_size=self.assumed_list_size,
            string_chars=self.assumed_string_chars,
            iterations=self.max_iterations,
        )


@dataclass(slots=True)
class EvaluateConfig:
    strict: bool = False
    rules: list[str] = field(default_factory=list)
    include_shipped_rules: bool = True
    # Shipped packs whose rules run (empty: all of them); e.g. [durable-sessions] for the skill's checks alone.
    packs: list[str] = field(default_factory=list)
    allowed_lateness: Duration = _5S
    session_idle_timeout: Duration = _7D
    max_sessions: int = 100_000
    # Groups and delivery keys remembered across all sessions; past it the least recently
    # active sessions forget their oldest (processor.evaluate.engine, docs/state.md).
    max_remembered_entries: int = 2_000_000
    # Past these, one DS113 summary instead of each violation (processor.violation_caps).
    max_violations_per_request: int = 1000
    max_violations_per_session: int = 10_000
    tick_interval: Duration = _1S
    rule_limits: RuleLimitsConfig = field(default_factory=RuleLimitsConfig)
    # serve: /healthz fails once one evaluation step has not come round for this long (restart it).
    max_stall: Duration = _120S
    # serve: at stop, evaluate the spans still in the reordering window instead of keeping them (local use).
    flush_window_on_stop: bool = False
    # The operator's waiver file (processor.waivers): findings it names are reported as waived.
    waivers: str = ""
    # A baseline (replay --write-baseline): the findings it holds are accepted as known, as
    # many times each as it counted; only new ones count as findings.
    baseline: str = ""

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if self.waivers and not os.path.isfile(self.waivers):
            problems.append(Problem(f"{path}.waivers", f"no such file: {self.waivers}"))
        if self.baseline and not os.path.isfile(self.baseline):
            problems.append(Problem(f"{path}.baseline", f"no such file: {self.baseline}"))
        if self.max_stall < 1:
            problems.append(Problem(f"{path}.max_stall", "must be at least 1s"))
        for index, rule_path in enumerate(self.rules):
            if not rule_path:
                problems.append(Problem(f"{path}.rules[{index}]", "empty path"))
            elif not os.path.exists(rule_path):
                problems.append(Problem(f"{path}.rules[{index}]", f"no such file or directory: {rule_path}"))
        if self.max_sessions < 1:
            problems.append(Problem(f"{path}.max_sessions", "must be at least 1"))
        if self.max_remembered_entries < 1000:
            problems.append(Problem(f"{path}.max_remembered_entries", "must be at least 1000"))
        for name in ("max_violations_per_request", "max_violations_per_session"):
            if getattr(self, name) < 1:
                problems.append(Problem(f"{path}.{name}", "must be at least 1"))
        if self.tick_interval < 0.01:
            problems.append(Problem(f"{path}.tick_interval", "must be at least 10ms"))
        if self.session_idle_timeout <= 0:
            problems.append(Problem(f"{path}.session_idle_timeout", "must be more than 0"))
        if self.packs:
            from processor.evaluate.rulefmt import unknown_packs

            for index, name in enumerate(self.packs):
                for problem in unknown_packs([name]):
                    problems.append(Problem(f"{path}.packs[{index}]", problem.message))
        if not self.rules and not self.include_shipped_rules:
            problems.append(
                Problem(f"{path}.include_shipped_rules", "no rules at all: add rule files or keep the shipped ones")
            )
        return problems


@dataclass(slots=True)
class PostgresStateConfig:
    """The shared store of several replicas (docs/scaling.md)."""

    # libpq connection string or URL; its password never appears in logs or messages.
    dsn: str = ""
    # Who this replica is in session_owner and replicas; empty: the host name (the pod name).
    replica_id: str = ""
    # A replica that stops renewing for this long is taken for dead; its sessions and work move.
    lease_ttl: Duration = _15S
    connect_timeout: Duration = _5S

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if self.lease_ttl < 1:
            problems.append(Problem(f"{path}.lease_ttl", "must be at least 1s"))
        if self.connect_timeout <= 0:
            problems.append(Problem(f"{path}.connect_timeout", "must be more than 0"))
        if self.replica_id and (len(self.replica_id) > 200 or any(c.isspace() for c in self.replica_id)):
            problems.append(Problem(f"{path}.replica_id", "at most 200 characters, no spaces"))
        return problems


@dataclass(slots=True)
class StateConfig:
    """Where the engine's state, the inbox journal and the outbox live (docs/state.md)."""

    # sqlite by default: what serve acknowledges survives a crash (docs/state.md).
    backend: Literal["memory", "sqlite", "postgres"] = "sqlite"
    path: str = f"{DATA_DIR}/state.db"
    # sqlite: FULL fsyncs every commit (an acknowledged request survives a power cut); NORMAL does not.
    synchronous: Literal["full", "normal"] = "full"
    # sqlite: how long a commit waits for a lock another process holds before "retry later".
    busy_timeout: Duration = _5S
    # Requests acknowledged and not yet evaluated; past it senders are told to retry later.
    journal_max_size: ByteSize = _256MiB
    postgres: PostgresStateConfig = field(default_factory=PostgresStateConfig)

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if self.backend == "sqlite":
            if not SQLITE_STATE_AVAILABLE:
                problems.append(Problem(f"{path}.backend", "'sqlite' is not available in this build; use 'memory'"))
            if not self.path:
                problems.append(Problem(f"{path}.path", "is required for the sqlite backend"))
        if self.backend == "postgres" and not self.postgres.dsn:
            problems.append(Problem(f"{path}.postgres.dsn", "is required for the postgres backend"))
        if self.busy_timeout < 0:
            problems.append(Problem(f"{path}.busy_timeout", "must not be negative"))
        if self.journal_max_size < _MiB:
            problems.append(Problem(f"{path}.journal_max_size", "must be at least 1MiB"))
        return problems


@dataclass(slots=True)
class ForwardConfig:
    """Processor mode: every received span also goes downstream, unchanged but for ``durable.violation.rules``.

    ``endpoint``: for gRPC ``host:port`` (``insecure`` decides plaintext) or an
    ``http://``/``https://`` URL (the scheme decides); for HTTP a base URL
    (``/v1/traces`` is appended when the URL has no path). Empty: forwarding is off.
    """

    endpoint: str = ""
    protocol: Literal["grpc", "http"] = "grpc"
    # Plaintext gRPC (no TLS). For HTTP the URL scheme decides.
    insecure: bool = False
    # PEM bundle to verify the downstream's certificate; empty: the system's roots.
    ca_file: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    max_batch_spans: int = 512
    max_buffer_spans: int = 100_000
    # How long a partial batch may wait for more spans before it is sent.
    flush_interval: Duration = _200MS
    max_attempts: int = 5
    initial_backoff: Duration = _500MS
    max_backoff: Duration = _30S
    timeout: Duration = _10S

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    def validate(self, path: str) -> list[Problem]:
        problems: list[Problem] = []
        if self.endpoint:
            if self.protocol == "grpc":
                # host:port, or a URL whose scheme says plaintext (http) or TLS (https).
                target = self.endpoint
                for scheme in ("http://", "https://"):
                    if target.startswith(scheme):
                        target = target[len(scheme):].rstrip("/")
                problems.extend(check_endpoint(target, f"{path}.endpoint"))
            else:
                problems.extend(check_url(self.endpoint, f"{path}.endpoint"))
        if self.ca_file and not os.path.isfile(self.ca_file):
            problems.append(Problem(f"{path}.ca_file", f"file not found: {self.ca_file}"))
        for name in self.headers:
            if not name or any(c.isspace() or c in ":\r\n" for c in name):
                problems.append(Problem(f"{path}.headers.{name}", "not a valid header name"))
        for name, value in self.headers.items():
            if any(c in value for c in "\r\n"):
                problems.append(Problem(f"{path}.headers.{name}", "value must not contain line breaks"))
        if self.max_batch_spans < 1:
            problems.append(Problem(f"{path}.max_batch_spans", "must be at least 1"))
        if self.max_buffer_spans < self.max_batch_spans:
            problems.append(Problem(f"{path}.max_buffer_spans", "must be at least max_batch_spans"))
        if self.max_attempts < 1:
            problems.append(Problem(f"{path}.max_attempts", "must be at least 1"))
        if self.initial_backoff <= 0:
            problems.append(Problem(f"{path}.initial_backoff", "must be more than 0"))
        if self.max_backoff < self.initial_backoff:
            problems.append(Problem(f"{path}.max_backoff", "must be at least initial_backoff"))
        if self.timeout <= 0:
            problems.append(Problem(f"{path}.timeout", "must be more than 0"))
        return problems


@dataclass(slots=True)
class RouteConfig:
    """First-tier mode: resolve each span's session and send it on, evaluating nothing (docs/scaling.md).

    With ``endpoint`` set, serve receives whole traces (a Collector routes it by trace id),
    gives each span the session the checker's identity stage would, and sends the spans to
    ``endpoint`` (a Collector routing by session) with ``durable.session.id`` on their
    resource. What it acknowledged is journaled in SQLite (``state.path``) until the
    downstream has taken it: nothing is dropped, and sending is retried with capped backoff
    for as long as the downstream refuses (the journal's bound, ``state.journal_max_size``,
    then turns new requests away with "retry later").
    """

    endpoint: str = ""
    protocol: Literal["grpc", "http"] = "grpc"
    # Plaintext gRPC (no TLS). For HTTP the URL scheme decides.
    insecure: bool = False
    ca_file: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    timeout: Duration = _10S
    max_batch_spans: int = 2048
    initial_backoff: Duration = _500MS
    max_backoff: Duration = _30S
    # How often what was sent is recorded as done (the journal trimmed, the sessions' state saved).
    # A crash re-sends at most this much; the evaluators take a span sent twice once.
    checkpoint_interval: Duration = _1S

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    def downstream(self) -> ForwardConfig:
        """The connection settings, in the form the OTLP senders take."""
        return ForwardConfig(endpoint=self.endpoint, protocol=self.protocol, insecure=self.insecure,
                             ca_file=self.ca_file, headers=dict(self.headers), max_batch_spans=self.max_batch_spans,
                             max_buffer_spans=max(self.max_batch_spans, 1), initial_backoff=self.initial_backoff,
                             max_backoff=self.max_backoff, timeout=self.timeout)

    def validate(self, path: str) -> list[Problem]:
        problems = self.downstream().validate(path) if self.endpoint else []
        if self.checkpoint_interval <= 0:
            problems.append(Problem(f"{path}.checkpoint_interval", "must be more than 0"))
        return problems


def route_problems(config: Config) -> list[Problem]:
    """What the first-tier mode cannot do with the rest of the configuration."""
    if not config.route.enabled:
        return []
    problems: list[Problem] = []
    if config.state.backend != "sqlite":
        problems.append(Problem("state.backend", "route.endpoint (first-tier mode) journals in SQLite: set 'sqlite'"))
    if config.forward.enabled:
        problems.append(Problem("forward.endpoint", "not with route.endpoint: the first tier sends every span on"))
    if config.ui.endpoint:
        problems.append(Problem("ui.endpoint", "not with route.endpoint: the first tier evaluates nothing to show; "
                                               "the evaluators behind it serve the view"))
    exporters = config.exporters
    for where, value in (("exporters.jsonl.path", exporters.jsonl.path), ("exporters.otlp.endpoint",
                         exporters.otlp.endpoint), ("exporters.alertmanager.url", exporters.alertmanager.url),
                         ("exporters.webhook.url", exporters.webhook.url)):
        if value:
            problems.append(Problem(where, "not with route.endpoint: the first tier finds no violations "
                                           "(its metrics: exporters.prometheus, exporters.otlp_metrics)"))
    return problems


@dataclass(slots=True)
class UiConfig:
    """The read-only operator view (docs/operate.md). An empty ``endpoint`` turns it off.

    ``trace_url``: a link to a session's trace in your tracing UI; ``{trace_id}`` is
    replaced (for example ``http://127.0.0.1:16686/trace/{trace_id}`` for Jaeger).
    ``max_sessions`` and ``max_actions``: the most sessions and action rows the view's read
    model keeps, whatever the traffic; past either the least recently active sessions leave.
    """

    endpoint: str = ""
    tls: TLSConfig = field(default_factory=TLSConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    connections: ViewConnections = field(default_factory=ViewConnections)
    trace_url: str = ""
    max_sessions: int = 100_000
    max_actions: int = 1_000_000

    def validate(self, path: str) -> list[Problem]:
        problems = check_endpoint(self.endpoint, f"{path}.endpoint") if self.endpoint else []
        if self.max_sessions < 1:
            problems.append(Problem(f"{path}.max_sessions", "must be at least 1"))
        if self.max_actions < ONE_SESSION_ACTIONS:
            problems.append(Problem(f"{path}.max_actions",
                                    f"must be at least {ONE_SESSION_ACTIONS} (one session's kept actions)"))
        if self.trace_url:
            if "{trace_id}" not in self.trace_url:
                problems.append(Problem(f"{path}.trace_url", "must contain {trace_id}"))
            else:
                problems.extend(check_url(self.trace_url.replace("{trace_id}", "0"), f"{path}.trace_url"))
        return problems


@dataclass(slots=True)
class LogsConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(slots=True)
class TelemetryConfig:
    logs: LogsConfig = field(default_factory=LogsConfig)


@dataclass(slots=True)
class Config:
    receivers: ReceiversConfig = field(default_factory=ReceiversConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    convert: ConvertOptions = field(default_factory=ConvertOptions)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    state: StateConfig = field(default_factory=StateConfig)
    forward: ForwardConfig = field(default_factory=ForwardConfig)
    route: RouteConfig = field(default_factory=RouteConfig)
    exporters: ExportersConfig = field(default_factory=ExportersConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    ui: UiConfig = field(default_factory=UiConfig)


DEFAULT_CONFIG_YAML = f"""\
receivers:
  otlp:
    grpc:
      endpoint: 127.0.0.1:4317
    http:
      endpoint: 127.0.0.1:4318
state:
  backend: sqlite
  path: {DATA_DIR}/state.db
exporters:
  jsonl:
    path: {DATA_DIR}/violations.jsonl
ui:
  endpoint: 127.0.0.1:4319
"""


def load_config(
    path: str | None, environ: Mapping[str, str] | None = None, sections: Collection[str] | None = None
) -> Config:
    """The configuration in ``path`` (or the embedded default); ConfigError lists every problem.

    With ``sections``, only those sections are decoded (the others keep their defaults
    and their ``${env:...}`` references are not expanded): replay reads a serve
    configuration for its ``convert`` and ``evaluate`` sections alone. Unknown
    top-level keys are still reported.
    """
    if path is None:
        text, where = DEFAULT_CONFIG_YAML, "(default configuration)"
    else:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            raise ConfigError([Problem(path, "no such file")], "cannot read the configuration") from None
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise ConfigError([Problem(path, reason)], "cannot read the configuration") from None
        where = path
    return parse_config(text, where, environ, sections)


def parse_config(
    text: str, where: str, environ: Mapping[str, str] | None = None, sections: Collection[str] | None = None
) -> Config:
    """Decode YAML ``text`` (read from ``where``, named in messages); see ``load_config``."""
    try:
        raw = load_yaml_strict(text, where)
    except YamlProblem as exc:
        raise ConfigError([Problem(exc.where, exc.message)], "invalid configuration") from None
    if raw is None:
        raw = {}
    problems: list[Problem] = []
    if not isinstance(raw, dict):
        raise ConfigError([Problem(where, "the configuration must be a mapping of sections")], "invalid configuration")
    if sections is not None:
        known = {f.name for f in dataclasses.fields(Config)}
        allowed = ", ".join(sorted(known))
        problems.extend(Problem(str(key), f"unknown section; allowed: {allowed}") for key in raw if key not in known)
        raw = {key: value for key, value in raw.items() if key in sections}
    raw = expand_env(raw, "", problems, environ)
    convert_raw = raw.pop("convert", None)
    config = decode(Config, raw, "", problems)
    config.convert = _decode_convert(convert_raw, problems)
    if sections is None:
        problems.extend(route_problems(config))
        problems.extend(check_paths(config))
    if problems:
        raise ConfigError(placed(problems, key_places(text, where)), f"invalid configuration in {where}:")
    return config


@dataclass(slots=True)
class _ToolKinds:
    tool_kinds: list[ToolKindRule] = field(default_factory=list)


def _decode_convert(raw: Any, problems: list[Problem]) -> ConvertOptions:
    """The ``convert:`` section; ``tool_kinds`` (a Sequence in ConvertOptions) is decoded as a list."""
    if not isinstance(raw, dict) or "tool_kinds" not in raw:
        return decode(ConvertOptions, raw, "convert", problems)
    rest = {k: v for k, v in raw.items() if k != "tool_kinds"}
    first: list[Problem] = []
    options = decode(ConvertOptions, rest, "convert", first)
    kinds = decode(_ToolKinds, {"tool_kinds": raw["tool_kinds"]}, "convert", first)
    options = dataclasses.replace(options, tool_kinds=tuple(kinds.tool_kinds))
    # validate() ran once on the default tool kinds; run it again on the configured ones.
    problems.extend(first)
    problems.extend(p for p in options.validate("convert") if p not in first)
    return options
