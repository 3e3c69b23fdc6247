"""Soak: a real ``serve`` under sustained valid load with hostile requests mixed in.

    python -m bench.soak [--seconds 300] [--memory-bound-mib 512]

Valid clients (OTLP/HTTP protobuf and OTLP/gRPC, with the bearer token) send small
requests of payment spans without an idempotency key, each in a session of its own:
every span gives exactly one DS002 violation, so what serve evaluated can be counted
against what the clients were told was accepted. Hostile clients, meanwhile, send
gzip and zstd bombs, requests over the span limit, requests that raise violations
past the caps, garbage, wrong tokens, bodies cut off mid-way, bodies trickled
slowly, 64 KiB ``service.name`` values (each a metric label) and 200,000-character
session and action ids (whose violations must still be found, under their bounded ids).
A second hostile client lays siege in turn to every port (the HTTP and gRPC
receivers, the operator view, ``/metrics``) with 1,100 connections that never finish a
request, serve running under an open-file limit of 1,024, and sends bursts of 48
concurrent 15 MiB gRPC calls, retried as their RetryInfo says until each gets through.
A prober checks ``/healthz``, gRPC health, the view's ``/healthz`` and ``/metrics``
(over the bearer token) throughout.

It reports, and ``tests/test_soak.py`` asserts: every acknowledged span was evaluated
(its violation is in the JSONL output after a graceful stop), health never failed,
each hostile request got the answer its kind calls for, serve's peak RSS (VmHWM,
read from /proc before it stops) stayed under the bound, and ``/metrics``, scraped
before the stop, stayed small with every label value bounded.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import grpc
import httpx
import orjson
import yaml
from backports.zstd import compress as zstd_compress
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from bench import build
from processor.open_files import raise_to_hard_limit
from processor.records import bounded_text

ROOT: Final = Path(__file__).resolve().parents[1]
TOKEN: Final = "soak-token-0123456789"
# Rotated violation files serve keeps (64 MiB each): room for every violation of an hour's soak.
JSONL_ROTATED_KEPT: Final = 200
PROTOBUF: Final = {"Content-Type": "application/x-protobuf"}
SPANS_PER_REQUEST_LIMIT: Final = 2000
# serve's open-file limit in the soak (soft and hard): the common default, which 1,100 connections pass.
OPEN_FILES: Final = 1024
SIEGE_CONNECTIONS: Final = 1100
# Every listener's header timeout in the soak. A siege is over within two of them and a little
# more: the connections past serve's open files (or a listener's backlog) wait in the kernel's
# queue until the first ones are closed, and only then does their own header timeout start.
HEADER_TIMEOUT_S: Final = 2.0
LARGE_CALLS: Final = 48
LARGE_CALL_BYTES: Final = 15 << 20
_EXPORT: Final = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_BASE_NS: Final = 1_793_524_440_000_000_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def padded_request(size: int) -> bytes:
    """A valid request of about ``size`` bytes without a span: one resource attribute carries it."""
    request = trace_service_pb2.ExportTraceServiceRequest()
    attribute = request.resource_spans.add().resource.attributes.add()
    attribute.key, attribute.value.string_value = "padding", "x" * size
    return request.SerializeToString()


def retry_delay_s(error: grpc.RpcError) -> float | None:
    """The RetryInfo delay a gRPC refusal carries, None without one."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    return float(info.retry_delay.ToTimedelta().total_seconds())
    return None


def payment_request(
    session: str, actions: list[str], service: str = "soak",
) -> trace_service_pb2.ExportTraceServiceRequest:
    request = trace_service_pb2.ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    attribute = resource_spans.resource.attributes.add()
    attribute.key, attribute.value.string_value = "service.name", service
    scope_spans = resource_spans.scope_spans.add()
    for index, action in enumerate(actions):
        span = scope_spans.spans.add()
        span.name = "pay"
        span.trace_id = random.randbytes(16)
        span.span_id = random.randbytes(8)
        span.start_time_unix_nano = _BASE_NS + index * 1_000_000
        span.end_time_unix_nano = span.start_time_unix_nano + 500_000
        for key, value in (("durable.session.id", session), ("durable.action.id", action),
                           ("durable.action.kind", "payment")):
            kv = span.attributes.add()
            kv.key, kv.value.string_value = key, value
    return request


@dataclass(slots=True)
class SoakResult:
    seconds: float
    acknowledged: set[tuple[str, str]] = field(default_factory=set)
    evaluated: set[tuple[str, str]] = field(default_factory=set)
    valid_refusals: int = 0  # retryable answers (503/UNAVAILABLE) valid clients met and retried
    hostile: Counter[str] = field(default_factory=Counter)  # "kind -> answer"
    unexpected: list[str] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    health_probes: int = 0
    health_second_tries: int = 0  # HTTP probes answered on their second try
    peak_rss_kib: int = 0
    metrics_bytes: int = 0  # /metrics as scraped before the stop
    longest_label: int = 0  # the longest label value in it
    exit_code: int | None = None
    tracebacks: int = 0  # in serve's whole log
    log_tail: str = ""

    @property
    def lost(self) -> set[tuple[str, str]]:
        return self.acknowledged - self.evaluated

    def summary(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 1),
            "acknowledged_spans": len(self.acknowledged),
            "evaluated_of_acknowledged": len(self.acknowledged & self.evaluated),
            "lost": len(self.lost),
            "valid_retries": self.valid_refusals,
            "hostile": dict(sorted(self.hostile.items())),
            "unexpected": self.unexpected[:10],
            "health_probes": self.health_probes,
            "health_answered_on_second_try": self.health_second_tries,
            "health_failures": self.health_failures[:10],
            "peak_rss_mib": round(self.peak_rss_kib / 1024, 1),
            "metrics_bytes": self.metrics_bytes,
            "longest_label_value": self.longest_label,
            "exit_code": self.exit_code,
            "tracebacks_in_log": self.tracebacks,
        }


def _lower_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


class Soak:
    def __init__(self, workdir: Path, seconds: float, valid_senders: int = 2) -> None:
        self.workdir = workdir
        self.seconds = seconds
        self.valid_senders = valid_senders
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.ui_port = free_port()
        self.metrics_port = free_port()
        self.jsonl = workdir / "violations.jsonl"
        self.result = SoakResult(seconds)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None

    def config(self) -> dict[str, Any]:
        auth = {"bearer_token": TOKEN}

        def limits() -> dict[str, str]:
            return {"header_timeout": f"{HEADER_TIMEOUT_S:g}s"}

        return {
            "receivers": {"otlp": {
                "grpc": {"endpoint": f"127.0.0.1:{self.grpc_port}", "auth": auth, "connections": limits()},
                "http": {"endpoint": f"127.0.0.1:{self.http_port}", "auth": dict(auth),
                         "max_request_body_size": "4MiB", "connections": limits()},
                "max_spans_per_request": SPANS_PER_REQUEST_LIMIT,
                "max_bytes_in_flight": "32MiB",
            }},
            "evaluate": {"tick_interval": "100ms", "allowed_lateness": "500ms"},
            "state": {"backend": "sqlite", "path": str(self.workdir / "state.db")},
            "ui": {"endpoint": f"127.0.0.1:{self.ui_port}", "auth": dict(auth), "connections": limits()},
            # Every violation file kept: the count of what was evaluated reads them all, and an hour of
            # this load writes more than the default five rotated copies hold.
            "exporters": {"jsonl": {"path": str(self.jsonl), "rotate_keep": JSONL_ROTATED_KEPT},
                          "prometheus": {"endpoint": f"127.0.0.1:{self.metrics_port}", "auth": dict(auth),
                                         "connections": limits()}},
        }

    # -- the server ----------------------------------------------------------------------

    def start(self) -> None:
        config = self.workdir / "serve.yaml"
        config.write_text(yaml.safe_dump(self.config()), encoding="utf-8")
        log = (self.workdir / "serve.log").open("ab")
        env = build.child_env()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "processor.cli", "serve", "--config", str(config)],
            cwd=self.workdir, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
            preexec_fn=_lower_open_files,  # noqa: PLW1509 - one setrlimit call, before any client thread starts
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError("serve exited at start:\n" + self._log_tail())
            try:
                if httpx.get(f"http://127.0.0.1:{self.http_port}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("serve did not become ready:\n" + self._log_tail())

    def stop(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._scrape()
            self.result.peak_rss_kib = vm_hwm_kib(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                self.result.exit_code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                self.result.exit_code = proc.wait(10)
        self.result.log_tail = self._log_tail()
        with (self.workdir / "serve.log").open("rb") as log:
            self.result.tracebacks = sum(line.startswith(b"Traceback") for line in log)

    def _scrape(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            body = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=30,
                             headers={"authorization": f"Bearer {TOKEN}"}).text
        except httpx.HTTPError as exc:
            self.result.unexpected.append(f"scraping /metrics failed: {type(exc).__name__}")
            return
        self.result.metrics_bytes = len(body.encode())
        self.result.longest_label = max((len(value) for family in text_string_to_metric_families(body)
                                         for sample in family.samples for value in sample.labels.values()), default=0)

    def _log_tail(self) -> str:
        try:
            return (self.workdir / "serve.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    # -- clients -------------------------------------------------------------------------

    def run(self) -> SoakResult:
        raise_to_hard_limit()  # the sieges' 1,100 connections need more than the common 1,024 descriptors here
        self.start()
        started = time.monotonic()
        threads = [threading.Thread(target=self._guard(self._valid_http, i), daemon=True)
                   for i in range(self.valid_senders)]
        threads.append(threading.Thread(target=self._guard(self._valid_grpc, 0), daemon=True))
        threads.append(threading.Thread(target=self._guard(self._hostile, 0), daemon=True))
        threads.append(threading.Thread(target=self._guard(self._siege, 0), daemon=True))
        threads.append(threading.Thread(target=self._guard(self._probe_health, 0), daemon=True))
        try:
            for thread in threads:
                thread.start()
            self._stop.wait(self.seconds)
        finally:
            self._stop.set()
            for thread in threads:
                thread.join(60)
            self.result.seconds = time.monotonic() - started
            self.stop()
        self.result.evaluated = self._evaluated()
        return self.result

    def _guard(self, target: Callable[[int], None], index: int) -> Callable[[], None]:
        def run() -> None:
            try:
                target(index)
            except Exception as exc:  # a client bug must show in the result, not vanish in a thread
                with self._lock:
                    self.result.unexpected.append(f"{target.__name__}: {type(exc).__name__}: {exc}")
        return run

    def _acknowledge(self, keys: list[tuple[str, str]]) -> None:
        with self._lock:
            self.result.acknowledged.update(keys)

    def _retry(self) -> None:
        with self._lock:
            self.result.valid_refusals += 1
        time.sleep(0.2)

    def _valid_http(self, index: int) -> None:
        url = f"http://127.0.0.1:{self.http_port}/v1/traces"
        headers = {**PROTOBUF, "authorization": f"Bearer {TOKEN}"}
        with httpx.Client(timeout=30) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                session = f"h{index}-{n}"
                keys = [(session, f"pay-{i}") for i in range(20)]
                body = payment_request(session, [a for _, a in keys]).SerializeToString()
                if n % 3 == 0:
                    body, headers_now = gzip.compress(body), {**headers, "Content-Encoding": "gzip"}
                else:
                    headers_now = headers
                while not self._stop.is_set():
                    try:
                        response = client.post(url, content=body, headers=headers_now)
                    except httpx.HTTPError:
                        self._retry()
                        continue
                    if response.status_code == 200:
                        self._acknowledge(keys)
                        break
                    if response.status_code == 503:
                        self._retry()
                        continue
                    with self._lock:
                        self.result.unexpected.append(f"valid HTTP request answered {response.status_code}")
                    break

    def _valid_grpc(self, index: int) -> None:
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            stub = trace_service_pb2_grpc.TraceServiceStub(channel)
            n = 0
            while not self._stop.is_set():
                n += 1
                session = f"g{index}-{n}"
                keys = [(session, f"pay-{i}") for i in range(20)]
                request = payment_request(session, [a for _, a in keys])
                while not self._stop.is_set():
                    try:
                        stub.Export(request, metadata=metadata, timeout=30)
                    except grpc.RpcError as exc:
                        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                            self._retry()
                            continue
                        with self._lock:
                            self.result.unexpected.append(f"valid gRPC request answered {exc.code().name}")
                        break
                    self._acknowledge(keys)
                    break

    def _hostile(self, index: int) -> None:
        url = f"http://127.0.0.1:{self.http_port}/v1/traces"
        auth = {"authorization": f"Bearer {TOKEN}"}
        gzip_bomb = gzip.compress(b"\x00" * (64 << 20), compresslevel=9)
        zstd_bomb = zstd_compress(b"\x00" * (64 << 20))
        too_many = payment_request("x-too-many", [f"a{i}" for i in range(SPANS_PER_REQUEST_LIMIT + 1)])
        amplifying = payment_request("x-amplify", [f"a{i}" for i in range(SPANS_PER_REQUEST_LIMIT)])
        good = payment_request("x-good", ["a"]).SerializeToString()
        turns = iter(range(1 << 62))
        cases: list[tuple[str, Callable[[httpx.Client], str]]] = [
            ("gzip bomb", lambda c: self._post(c, url, gzip_bomb, {**PROTOBUF, **auth, "Content-Encoding": "gzip"})),
            ("zstd bomb", lambda c: self._post(c, url, zstd_bomb, {**PROTOBUF, **auth, "Content-Encoding": "zstd"})),
            ("over the span limit", lambda c: self._post(c, url, too_many.SerializeToString(), {**PROTOBUF, **auth})),
            ("past the violation caps", lambda c: self._post(c, url, amplifying.SerializeToString(),
                                                             {**PROTOBUF, **auth})),
            ("garbage", lambda c: self._post(c, url, os.urandom(2048), {**PROTOBUF, **auth})),
            ("wrong token", lambda c: self._post(c, url, good, {**PROTOBUF, "authorization": "Bearer nope"})),
            ("no token over gRPC", lambda c: self._grpc_without_token()),
            ("cut mid-body", lambda c: self._cut(good)),
            ("slow body", lambda c: self._trickle(good)),
            ("huge service name", lambda c: self._huge(c, url, next(turns), ids=False)),
            ("huge ids", lambda c: self._huge(c, url, next(turns), ids=True)),
        ]
        with httpx.Client(timeout=30) as client:
            turn = 0
            while not self._stop.is_set():
                name, send = cases[turn % len(cases)]
                turn += 1
                answer = send(client)
                with self._lock:
                    self.result.hostile[f"{name} -> {answer}"] += 1
                self._stop.wait(0.05)

    def _post(self, client: httpx.Client, url: str, body: bytes, headers: dict[str, str]) -> str:
        try:
            return str(client.post(url, content=body, headers=headers).status_code)
        except httpx.HTTPError as exc:
            return type(exc).__name__

    def _huge(self, client: httpx.Client, url: str, n: int, *, ids: bool) -> str:
        """Valid payments with a 64 KiB service name, or with 200,000-character session and action ids:
        accepted like any other, evaluated under bounded ids (so counted as acknowledged, bounded)."""
        long = "L" * 200_000
        if ids:
            session, actions, service = f"x-long-{n}-{long}", [f"pay-{i}-{long}" for i in range(4)], "soak"
        else:
            session, actions, service = f"x-label-{n}", ["pay-0"], f"svc-{n}-" + "S" * 65_536
        body = payment_request(session, actions, service).SerializeToString()
        answer = self._post(client, url, body, {**PROTOBUF, "authorization": f"Bearer {TOKEN}"})
        if answer == "200":
            self._acknowledge([(bounded_text(session), bounded_text(action)) for action in actions])
        return answer

    def _grpc_without_token(self) -> str:
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            try:
                trace_service_pb2_grpc.TraceServiceStub(channel).Export(
                    payment_request("x-grpc", ["a"]), timeout=10)
            except grpc.RpcError as exc:
                return str(exc.code().name)
        return "OK"

    def _raw_head(self, length: int) -> bytes:
        return (f"POST /v1/traces HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-protobuf\r\n"
                f"Authorization: Bearer {TOKEN}\r\nContent-Length: {length}\r\n\r\n").encode()

    def _cut(self, body: bytes) -> str:
        with socket.create_connection(("127.0.0.1", self.http_port), timeout=10) as conn:
            conn.sendall(self._raw_head(len(body) + 1000) + body[: len(body) // 2])
        return "closed"

    def _trickle(self, body: bytes) -> str:
        """A body sent a few bytes at a time over a second, then cut before its end."""
        with socket.create_connection(("127.0.0.1", self.http_port), timeout=10) as conn:
            conn.sendall(self._raw_head(len(body) + 10))
            for i in range(0, min(len(body), 40), 4):
                if self._stop.is_set():
                    break
                conn.sendall(body[i : i + 4])
                time.sleep(0.1)
        return "closed"

    def _siege(self, index: int) -> None:
        """Rounds of: 1,100 slow connections to each port in turn, then a burst of large concurrent gRPC calls."""
        ports = [("HTTP receiver", self.http_port), ("gRPC receiver", self.grpc_port),
                 ("operator view", self.ui_port), ("metrics", self.metrics_port)]
        body = padded_request(LARGE_CALL_BYTES)
        while not self._stop.is_set():
            for name, port in ports:
                if self._stop.is_set():
                    return
                answer = self._slow_connections(port)
                with self._lock:
                    self.result.hostile[f"{SIEGE_CONNECTIONS:,} slow connections ({name}) -> {answer}"] += 1
            answer = self._large_calls(body)
            if answer is None:
                return
            with self._lock:
                self.result.hostile[f"{LARGE_CALLS} concurrent 15 MiB gRPC calls -> {answer}"] += 1

    def _slow_connections(self, port: int) -> str:
        """Connections sending half a request head; "closed" once serve has closed every one of them."""
        held: list[socket.socket] = []
        try:
            for _ in range(SIEGE_CONNECTIONS):
                if self._stop.is_set():
                    break
                try:
                    conn = socket.create_connection(("127.0.0.1", port), timeout=1)
                    conn.sendall(b"GET /healthz HTTP/1.1\r\n")
                    conn.setblocking(False)
                    held.append(conn)
                except OSError:
                    continue  # refused or closed at once: that is serve shedding it
            deadline = time.monotonic() + 2 * HEADER_TIMEOUT_S + 3.0
            open_ = list(held)
            while open_ and time.monotonic() < deadline:
                open_ = [conn for conn in open_ if not _closed_by_peer(conn)]
                time.sleep(0.2)
            return "closed" if not open_ else f"{len(open_)} still open"
        finally:
            for conn in held:
                conn.close()

    def _large_calls(self, body: bytes) -> str | None:
        """Concurrent large calls, each retried after its RetryInfo delay; "all through" once each is accepted.

        None when the soak ended before they were all through (the burst tells nothing then).
        """
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        options = [("grpc.max_send_message_length", 32 << 20), ("grpc.enable_retries", 0)]
        channels = [grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}", options=options) for _ in range(8)]
        try:
            calls = [c.unary_unary(_EXPORT, request_serializer=None, response_deserializer=None) for c in channels]
            pending = list(range(LARGE_CALLS))
            deadline = time.monotonic() + 120
            while pending and not self._stop.is_set() and time.monotonic() < deadline:
                futures = {n: calls[n % len(calls)].future(body, metadata=metadata, timeout=60) for n in pending}
                pending, delay = [], 0.0
                for n, future in futures.items():
                    try:
                        future.result()
                    except grpc.RpcError as exc:
                        hint = retry_delay_s(exc)
                        if hint is None:
                            return f"{exc.code().name} without RetryInfo"
                        pending.append(n)
                        delay = max(delay, min(hint, 1.0))
                self._stop.wait(delay)
            if pending and self._stop.is_set():
                return None
            return "all through" if not pending else f"{len(pending)} not through"
        finally:
            for channel in channels:
                channel.close()

    def _probe_health(self, index: int) -> None:
        """Every half second: /healthz, gRPC health, the view's /healthz and /metrics (with the token).

        An HTTP probe may try twice, a quarter of a second apart: a connection that arrives
        amid a burst of new ones past a listener's cap can be closed at once (docs/security.md).
        """
        auth = {"authorization": f"Bearer {TOKEN}"}
        probes = [(f"http://127.0.0.1:{self.http_port}/healthz", {}),
                  (f"http://127.0.0.1:{self.ui_port}/healthz", auth),
                  (f"http://127.0.0.1:{self.metrics_port}/metrics", auth)]
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while not self._stop.is_set():
                answers = [_probe(url, headers) for url, headers in probes]
                problems = [problem for problem, _ in answers if problem]
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    if status != health_pb2.HealthCheckResponse.SERVING:
                        problems.append(f"gRPC health {status}")
                except grpc.RpcError as exc:
                    problems.append(f"gRPC health probe failed: {exc.code().name}")
                with self._lock:
                    self.result.health_probes += 1
                    self.result.health_second_tries += sum(tries == 2 for problem, tries in answers if not problem)
                    self.result.health_failures.extend(problems)
                self._stop.wait(0.5)

    def _evaluated(self) -> set[tuple[str, str]]:
        """DS002 keys in the JSONL output and its rotated copies (rotate_keep: JSONL_ROTATED_KEPT)."""
        found: set[tuple[str, str]] = set()
        rotated = (self.jsonl.with_name(f"{self.jsonl.name}.{i}") for i in range(1, JSONL_ROTATED_KEPT + 1))
        for path in [self.jsonl, *rotated]:
            if not path.exists():
                continue
            with path.open("rb") as handle:
                for line in handle:
                    document = orjson.loads(line)
                    if document.get("rule") == "DS002":
                        found.add((document["session_id"], document["action_id"]))
        return found


def _probe(url: str, headers: dict[str, str]) -> tuple[str, int]:
    """("", tries) when ``url`` answers 200 within two tries; else (what went wrong, 2)."""
    problem = ""
    for tries in (1, 2):
        try:
            status = httpx.get(url, headers=headers, timeout=5).status_code
            if status == 200:
                return "", tries
            problem = f"{url} answered {status}"
        except httpx.HTTPError as exc:
            problem = f"probe of {url} failed: {type(exc).__name__}"
        time.sleep(0.25)
    return problem, 2


def _closed_by_peer(conn: socket.socket) -> bool:
    """True once serve has closed ``conn`` (end of stream or reset); ``conn`` is non-blocking."""
    try:
        while chunk := conn.recv(65536):
            del chunk  # whatever serve answered before closing
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--memory-bound-mib", type=float, default=512.0)
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "soak")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    for old in args.workdir.glob("*"):
        if old.name.startswith(("violations.jsonl", "state.db", "serve.")):
            old.unlink()
    result = Soak(args.workdir, args.seconds).run()
    summary = result.summary()
    summary["memory_bound_mib"] = args.memory_bound_mib
    sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    ok = (not result.lost and not result.health_failures and not result.unexpected and not result.tracebacks
          and result.peak_rss_kib <= args.memory_bound_mib * 1024 and result.exit_code == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
