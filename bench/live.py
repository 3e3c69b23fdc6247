"""Live load: ``durable-check serve`` as a subprocess, a separate client process sending OTLP over gRPC.

The client (``python -m bench.live client ...``) sends requests taken from a generated
dump (512 spans each, all span ids distinct, so no request is a duplicate of another)
through a raw gRPC stub, bytes in and bytes out, from several threads, at a paced rate.
Just before each send it rewrites every span's start and end time to the current
clock (fixed64 fields patched in place), so event time is send time as it is for live
agents. It records each request's send and acknowledgement time. serve acknowledges
a request only after it has been converted and evaluated, so an OK answer means
processed. A refusal that carries RetryInfo (serve pushing back while its queue or byte
budget is full) is sent again after the delay it names, for at most ``CLIENT_RETRY_FOR_S``
from its first send, as an OTLP exporter does (its own bound is five minutes); the
request's times stay those of its first send, so the retry's wait counts in its latency
and in the rate the client achieved.

The orchestrator (:func:`run_step`) starts serve on free loopback ports with its
default state backend and a JSONL exporter, tails the JSONL file while the client
runs, scrapes serve's self-metrics, stops it with SIGTERM and reads its peak RSS.
It also reads the CPU time of each of serve's threads before and after the client's
run (``serve_thread_cores``): the busiest is the evaluator, and what it uses of one core
says how close serve is to its ceiling, whatever the other cores do.

A violation's latency is the time from its request's send to the moment its line
appeared in the file; only per-record rules are timed (a session rule such as DS110
fires on a later span of the session, whenever the agent sends it).

Replicas (:func:`run_replicas`, ``step --replicas N``): N such steps at once on this
machine, each its own serve and state, the dump split by session beforehand
(:func:`split_dump`) so that each replica receives its sessions whole, as the
Collector's load-balancing exporter routes them; each replica's client paces request i
of its share at the same offset from its start, so together they are offered the rate
asked for.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from bench import build
from bench.generate import flaws_path, read_otlp_stream
from bench.peak import vm_hwm_kib

EXPORT_METHOD: Final = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
# How long a refused request is sent again when serve said when to (RetryInfo), each wait at most a second.
CLIENT_RETRY_FOR_S: Final = 30.0
_RETRY_WAIT_MAX_S: Final = 1.0
# Rules that judge a span alone: their violation is due as soon as the span is evaluated.
PER_RECORD_FLAWS: Final = frozenset(
    {"unrecorded_llm", "unkeyed_payment", "unbounded_retry", "attempt_over_cap", "cache_without_ttl"}
)
PER_RECORD_RULES: Final = frozenset({"DS001", "DS002", "DS003", "DS004", "DS007"})
_START_TAG: Final = b"\x39"  # Span.start_time_unix_nano: field 7, fixed64
_END_TAG: Final = b"\x41"  # Span.end_time_unix_nano: field 8, fixed64
_SPAN_DURATION_NS: Final = 400_000
_REQUEST_SPANS: Final = 512  # spans in each request of the generated dumps
_SESSION_KEY: Final = "durable.session.id"
# In a split dump's name: a split written in an older layout (its sidecar without span counts) is not reused.
_SPLIT_VERSION: Final = 2
_ROOT: Final = Path(__file__).resolve().parents[1]


# -- client ------------------------------------------------------------------------------


@dataclass(slots=True)
class Template:
    payload: bytes
    spans: int
    # Byte offsets of each span's (start, end) time values.
    offsets: list[tuple[int, int]]

    def stamped(self, now_ns: int) -> bytes:
        buffer = bytearray(self.payload)
        pack = struct.pack_into
        for index, (start, end) in enumerate(self.offsets):
            at = now_ns + index * 1000
            pack("<Q", buffer, start, at)
            pack("<Q", buffer, end, at + _SPAN_DURATION_NS)
        return bytes(buffer)


def template_of(payload: bytes) -> Template:
    """Find each span's time fields in the serialized request (spans are serialized in order)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest.FromString(payload)
    offsets: list[tuple[int, int]] = []
    cursor = 0
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                start = payload.index(_START_TAG + struct.pack("<Q", span.start_time_unix_nano), cursor) + 1
                end = payload.index(_END_TAG + struct.pack("<Q", span.end_time_unix_nano), start + 8) + 1
                offsets.append((start, end))
                cursor = end + 8
    return Template(payload, len(offsets), offsets)


def load_templates(dump: Path, count: int) -> list[Template]:
    templates: list[Template] = []
    for payload in read_otlp_stream(dump):
        if len(templates) >= count:
            break
        templates.append(template_of(payload))
    return templates


def client(target: str, dump: Path, *, requests: int, rate: float, streams: int, out: Path) -> None:
    import grpc

    from bench.soak import retry_delay_s

    templates = load_templates(dump, requests)
    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    grpc.channel_ready_future(channel).result(timeout=30)
    # Bytes in, bytes out: the client spends nothing on (de)serialization.
    export = channel.unary_unary(EXPORT_METHOD, request_serializer=None, response_deserializer=None)
    # The mean request, not the first: a replica's share of a split dump varies from request to request.
    interval_s = sum(t.spans for t in templates) / len(templates) / rate if templates else 0.0
    sends: list[list[int]] = [[0, 0, 0] for _ in templates]
    errors: dict[str, int] = {}
    retried: dict[str, int] = {}  # refusals sent again as their RetryInfo said, by status
    lock = threading.Lock()
    next_index = [0]
    start = time.monotonic() + 0.2

    def worker() -> None:
        while True:
            with lock:
                index = next_index[0]
                next_index[0] += 1
            if index >= len(templates):
                return
            due = start + index * interval_s
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            sent_ns = time.time_ns()
            body = templates[index].stamped(sent_ns)
            give_up = time.monotonic() + CLIENT_RETRY_FOR_S
            while True:
                try:
                    export(body, timeout=60)
                    status = "OK"
                    break
                except grpc.RpcError as exc:
                    status = exc.code().name if exc.code() is not None else "UNKNOWN"
                    delay = retry_delay_s(exc)
                    if delay is None:
                        status += " without RetryInfo"
                        break
                    if time.monotonic() + delay > give_up:
                        break
                with lock:
                    retried[status] = retried.get(status, 0) + 1
                time.sleep(min(delay, _RETRY_WAIT_MAX_S))
            acked_ns = time.time_ns()
            sends[index] = [sent_ns, acked_ns, 1 if status == "OK" else 0]
            if status != "OK":
                with lock:
                    errors[status] = errors.get(status, 0) + 1

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    channel.close()
    ok_spans = sum(t.spans for t, s in zip(templates, sends, strict=True) if s[2])
    out.write_bytes(orjson.dumps({
        "requests": len(templates),
        "sent_spans": sum(t.spans for t in templates),
        "ok_spans": ok_spans,
        "errors": errors,
        "retried": retried,
        "sends": sends,
    }))


# -- orchestration -----------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """``count`` loopback ports free now, all different: their sockets are held open together."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


@dataclass(slots=True)
class StepResult:
    offered_spans_s: float
    duration_s: float
    requests: int
    sent_spans: int
    ok_spans: int
    achieved_spans_s: float
    errors: dict[str, int]
    evaluated_spans: int | None
    received_spans: float | None
    rejected_spans: float | None
    expected_violations: int
    found_violations: int
    latencies_ms: list[float] = field(default_factory=list)
    # From the last send to the last expected violation in the file, and how much of it is by design
    # (spans held allowed_lateness for reordering, released by a clock tick).
    completion_lag_s: float = 0.0
    held_s: float = 0.0
    serve_peak_rss_mib: float = 0.0
    # serve's threads while the client sent, busiest first: cores each used (its CPU seconds over the
    # client's wall time), those above 0.01. The first is the evaluator's at any rate that loads serve.
    serve_thread_cores: list[float] = field(default_factory=list)
    # Refusals with RetryInfo the client sent again (and got through, unless also in errors), by status.
    retried: dict[str, int] = field(default_factory=dict)
    state_backend: str = ""
    allowed_lateness: str = ""

    @property
    def lossless(self) -> bool:
        return (
            not self.errors
            and self.ok_spans == self.sent_spans
            and self.evaluated_spans == self.sent_spans
            and self.received_spans == self.sent_spans
            and not self.rejected_spans
            and self.found_violations == self.expected_violations
        )

    @property
    def sustained(self) -> bool:
        # The client kept the offered pace (serve did not push back through slow acknowledgements), and
        # evaluation kept up: the last violation came no later than the hold for reordering explains.
        return (
            self.lossless
            and self.achieved_spans_s >= 0.95 * self.offered_spans_s
            and self.completion_lag_s <= self.held_s + 1.0
        )

    def percentile_ms(self, q: float) -> float | None:
        if not self.latencies_ms:
            return None
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "latencies_ms"}
        out.update(lossless=self.lossless, sustained=self.sustained, latency_samples=len(self.latencies_ms),
                   p50_ms=self.percentile_ms(0.5), p99_ms=self.percentile_ms(0.99))
        return out


class Tailer(threading.Thread):
    """Reads new lines of a JSONL file as they are written; notes when each violation was first seen."""

    def __init__(self, path: Path) -> None:
        super().__init__(name="jsonl-tailer", daemon=True)
        self.path = path
        self.seen: dict[tuple[str, str], int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        handle = None
        pending = b""
        while True:
            stopping = self._halt.is_set()
            if handle is None and self.path.exists():
                handle = self.path.open("rb")
            if handle is not None:
                chunk = handle.read()
                if chunk:
                    now = time.time_ns()
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        document = orjson.loads(line)
                        self.seen.setdefault((document.get("rule", ""), document.get("action_id", "")), now)
            if stopping:
                break
            time.sleep(0.002)
        if handle is not None:
            handle.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def _metric(text: str, name: str) -> float:
    """The sum of a metric's samples, 0 when serve exposes none."""
    found = metric_or_none(text, name)
    return 0.0 if found is None else found


def metric_or_none(text: str, name: str) -> float | None:
    """The sum of a metric's samples, None when serve exposes none (a renamed metric is not a 0)."""
    total: float | None = None
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def _wait_ready(port: int, serve: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise RuntimeError(f"serve exited with {serve.returncode} before it was ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("serve did not become ready")


# Starts of serve per step: one, and more only when a port chosen for it was taken meanwhile.
_START_ATTEMPTS: Final = 3
# Where serve reads a step's PostgreSQL DSN from: a DSN may hold a password, which stays out
# of the configuration file the step writes to disk.
_POSTGRES_DSN_VAR: Final = "DURABLE_CHECK_BENCH_POSTGRES_DSN"
_step_databases = itertools.count(1)


@contextlib.contextmanager
def step_database(server_dsn: str) -> Iterator[str]:
    """A new, empty database on the PostgreSQL server ``server_dsn`` names, for one step (serve
    starts with no state, as on a new SQLite file); its DSN. Dropped afterwards."""
    import psycopg
    from psycopg import conninfo, sql

    name = f"durable_check_bench_{os.getpid()}_{next(_step_databases)}"
    with psycopg.connect(server_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield conninfo.make_conninfo(server_dsn, dbname=name)
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as conn:
            # FORCE: a serve killed mid-step may leave a connection behind.
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def run_step(dump: Path, rate: float, duration_s: float, *, streams: int = 8,
             allowed_lateness: str | None = None, state_backend: str | None = None,
             postgres_dsn: str | None = None, requests: int | None = None) -> StepResult:
    """One fresh serve, one client run at ``rate`` spans/s for ``duration_s`` (bounded by the dump's size).

    ``allowed_lateness`` and ``state_backend`` override serve's defaults; None keeps them.
    ``postgres_dsn``: a PostgreSQL server; serve keeps its state in a new database there,
    dropped after the step (``state_backend`` is then postgres, and needs it).
    ``requests``: how many of the dump's requests to send (default: what ``rate`` sends of
    512-span requests in ``duration_s``).
    """
    from processor.config import load_config

    if state_backend == "postgres" and postgres_dsn is None:
        raise ValueError("the postgres state backend needs postgres_dsn, the server its database is made on")
    if postgres_dsn is not None and state_backend not in (None, "postgres"):
        raise ValueError(f"postgres_dsn keeps serve's state in PostgreSQL, not with state_backend {state_backend!r}")

    flaws = orjson.loads(flaws_path(dump).read_bytes())
    if requests is None:
        requests = round(rate * duration_s / _REQUEST_SPANS)
    requests = max(1, min(len(flaws["requests"]), requests))
    expected: dict[str, int] = {}
    for index, flawed in enumerate(flaws["requests"][:requests]):
        for action_id, flaw in flawed:
            if flaw in PER_RECORD_FLAWS:
                expected[action_id] = index
    # The step's database is dropped (the stack) before its directory is removed.
    with tempfile.TemporaryDirectory(prefix="durable-check-bench-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        jsonl = work / "violations.jsonl"
        env = build.child_env(PYTHONPYCACHEPREFIX=str(_ROOT / "bench" / "out" / "pycache"))
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        evaluate = f"evaluate:\n  allowed_lateness: {allowed_lateness}\n" if allowed_lateness is not None else ""
        if postgres_dsn is not None:
            env[_POSTGRES_DSN_VAR] = stack.enter_context(step_database(postgres_dsn))
            evaluate += f"state:\n  backend: postgres\n  postgres:\n    dsn: ${{env:{_POSTGRES_DSN_VAR}}}\n"
        elif state_backend is not None:
            evaluate += f"state:\n  backend: {state_backend}\n  path: {work / 'state.db'}\n"
        config_path = work / "serve.yaml"
        stderr_path = work / "serve.stderr"
        for attempt in range(1, _START_ATTEMPTS + 1):
            # A port found free can be taken by another process before serve listens on it: then
            # serve says so and stops, and the step starts again on other ports (a bounded number of times).
            grpc_port, http_port, metrics_port = free_ports(3)
            config_path.write_text(
                "receivers:\n  otlp:\n"
                f"    grpc:\n      endpoint: 127.0.0.1:{grpc_port}\n"
                f"    http:\n      endpoint: 127.0.0.1:{http_port}\n"
                f"{evaluate}"
                "exporters:\n"
                f"  jsonl:\n    path: {jsonl}\n"
                f"  prometheus:\n    endpoint: 127.0.0.1:{metrics_port}\n"
                "telemetry:\n  logs:\n    level: info\n",
                encoding="utf-8",
            )
            with stderr_path.open("wb") as stderr:
                serve = subprocess.Popen(
                    [sys.executable, "-m", "processor.cli", "serve", "--config", str(config_path)],
                    cwd=work, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                )
            try:
                _wait_ready(http_port, serve)
                break
            except RuntimeError as exc:
                if serve.poll() is None:
                    serve.kill()
                    serve.wait()
                said = stderr_path.read_text(encoding="utf-8", errors="replace")
                if "cannot listen" in said and attempt < _START_ATTEMPTS:
                    continue
                raise RuntimeError(f"{exc}; serve's last words: {said[-2000:]}") from None
        try:
            # Inside: whatever fails once serve runs, serve is stopped (below).
            config = load_config(str(config_path), env)
            held_s = float(config.evaluate.allowed_lateness) + 2 * float(config.evaluate.tick_interval)
            tailer = Tailer(jsonl)
            tailer.start()
            client_out = work / "client.json"
            threads_before, sending_since = thread_cpu_s(serve.pid), time.monotonic()
            subprocess.run(
                [sys.executable, "-m", "bench.live", "client", "--target", f"127.0.0.1:{grpc_port}",
                 "--dump", str(dump), "--requests", str(requests), "--rate", str(rate),
                 "--streams", str(streams), "--out", str(client_out)],
                cwd=_ROOT, env=env, check=True, timeout=duration_s * 10 + 120,
            )
            thread_cores = busy_thread_cores(threads_before, thread_cpu_s(serve.pid),
                                             time.monotonic() - sending_since)
            sent = orjson.loads(client_out.read_bytes())
            # Violations held for the allowed lateness are released by the clock: wait for them.
            grace = time.monotonic() + held_s + 5
            while time.monotonic() < grace and not _all_found(tailer.seen, expected):
                time.sleep(0.05)
            import httpx

            metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        finally:
            # Its address space's own peak (ru_maxrss would include the forked harness's image).
            peak_kib = vm_hwm_kib(serve.pid)
            serve.send_signal(signal.SIGTERM)
            _, status, _ = os.wait4(serve.pid, 0)
            serve.returncode = os.waitstatus_to_exitcode(status)
        tailer.stop()
        log = stderr_path.read_text(encoding="utf-8", errors="replace")
    evaluated = re.search(r"stopped: (\d+) spans received", log)
    send_times = sent["sends"]
    latencies = []
    for (rule, action_id), seen_ns in tailer.seen.items():
        if rule in PER_RECORD_RULES and action_id in expected:
            latencies.append((seen_ns - send_times[expected[action_id]][0]) / 1e6)
    # Completion rate: spans acknowledged after the first acknowledgement, over the time since it.
    acks = sorted(s[1] for s in send_times if s[2])
    span_s = (acks[-1] - acks[0]) / 1e9 if len(acks) > 1 else 0.0
    after_first = sent["ok_spans"] * (len(acks) - 1) / len(acks) if acks else 0.0
    found_at = {a: t for (rule, a), t in tailer.seen.items() if rule in PER_RECORD_RULES and a in expected}
    found = len(found_at)
    last_send = max((s[0] for s in send_times), default=0)
    lag_s = (max(found_at.values()) - last_send) / 1e9 if found_at else 0.0
    return StepResult(
        offered_spans_s=rate,
        duration_s=span_s,
        requests=sent["requests"],
        sent_spans=sent["sent_spans"],
        ok_spans=sent["ok_spans"],
        achieved_spans_s=after_first / span_s if span_s else 0.0,
        errors=sent["errors"],
        retried=sent.get("retried", {}),
        evaluated_spans=int(evaluated.group(1)) if evaluated else None,
        received_spans=_metric(metrics, "durable_check_spans_received_total"),
        rejected_spans=_metric(metrics, "durable_check_spans_rejected_total"),
        expected_violations=len(expected),
        found_violations=found,
        latencies_ms=latencies,
        completion_lag_s=lag_s,
        held_s=held_s,
        serve_peak_rss_mib=peak_kib / 1024,
        serve_thread_cores=thread_cores,
        state_backend=config.state.backend,
        allowed_lateness=f"{float(config.evaluate.allowed_lateness):g}s",
    )


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, by thread id (those readable now)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text(encoding="ascii")
        except OSError:
            continue  # the thread ended
        # Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def busy_thread_cores(before: dict[int, float], after: dict[int, float], wall_s: float) -> list[float]:
    """Cores each thread used between two readings of :func:`thread_cpu_s`, busiest first, those above 0.01."""
    if wall_s <= 0:
        return []
    cores = ((spent - before.get(tid, 0.0)) / wall_s for tid, spent in after.items())
    return sorted((round(c, 3) for c in cores if c > 0.01), reverse=True)


def replica_of(session: str, replicas: int) -> int:
    """The replica a session routes to: a stable hash of its id (as a load-balancing exporter's ring would)."""
    return zlib.crc32(session.encode()) % replicas


def split_dump(dump: Path, replicas: int) -> list[Path]:
    """The dump split by session into ``replicas`` dumps, each request into its share for each replica.

    Request i of each split dump holds the spans of request i of the dump whose session routes
    to that replica (the span's ``durable.session.id``, else its resource's, else that of the
    first span of its trace that named one), so a replica receives each of its sessions
    whole, in the order sent. Each split dump has its sidecar: the flaws of each request,
    and its number of spans. Written once, next to the dump.
    """
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    paths = [dump.with_name(f"{dump.stem}-replica{r + 1}of{replicas}-s{_SPLIT_VERSION}{dump.suffix}")
             for r in range(replicas)]
    if all(p.exists() and flaws_path(p).exists() for p in paths):
        return paths
    flaws = orjson.loads(flaws_path(dump).read_bytes())
    trace_session: dict[bytes, str] = {}
    action_replica: dict[str, int] = {}
    partial = [p.with_name(f"{p.name}.{os.getpid()}.partial") for p in paths]
    split_flaws: list[list[list[tuple[str, str]]]] = [[] for _ in paths]
    split_spans: list[list[int]] = [[] for _ in paths]
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(p.open("wb")) for p in partial]
        for index, payload in enumerate(read_otlp_stream(dump)):
            request = ExportTraceServiceRequest.FromString(payload)
            shares = [ExportTraceServiceRequest() for _ in paths]
            counts = [0] * replicas
            for resource_spans in request.resource_spans:
                resource_session = _string_attribute(resource_spans.resource.attributes, _SESSION_KEY)
                for scope_spans in resource_spans.scope_spans:
                    parts: dict[int, Any] = {}
                    for span in scope_spans.spans:
                        session = (_string_attribute(span.attributes, _SESSION_KEY) or resource_session
                                   or trace_session.get(span.trace_id, ""))
                        if session:
                            trace_session.setdefault(span.trace_id, session)
                        replica = replica_of(session, replicas)
                        action_id = _string_attribute(span.attributes, "durable.action.id")
                        if action_id:
                            action_replica[action_id] = replica
                        if replica not in parts:
                            target = shares[replica].resource_spans.add()
                            target.resource.CopyFrom(resource_spans.resource)
                            target.schema_url = resource_spans.schema_url
                            part = target.scope_spans.add()
                            part.scope.CopyFrom(scope_spans.scope)
                            part.schema_url = scope_spans.schema_url
                            parts[replica] = part
                        parts[replica].spans.append(span)
                        counts[replica] += 1
            for replica, share in enumerate(shares):
                body = share.SerializeToString()
                outs[replica].write(struct.pack(">I", len(body)))
                outs[replica].write(body)
                split_spans[replica].append(counts[replica])
            flawed = flaws["requests"][index] if index < len(flaws["requests"]) else []
            for replica in range(replicas):
                split_flaws[replica].append([])
            for action_id, flaw in flawed:
                if action_id not in action_replica:
                    raise RuntimeError(f"{dump}: flawed action {action_id} is on no span of request {index}")
                split_flaws[action_replica[action_id]][index].append((action_id, flaw))
    for path, tmp, requests, spans in zip(paths, partial, split_flaws, split_spans, strict=True):
        flaws_path(path).write_bytes(orjson.dumps({"requests": requests, "spans": spans}))
        tmp.replace(path)  # last: the dump exists only once its sidecar does
    return paths


def _string_attribute(attributes: Any, key: str) -> str:
    for kv in attributes:
        if kv.key == key:
            return str(kv.value.string_value)
    return ""


@dataclass(slots=True)
class ReplicasResult:
    """Replicas side by side on one machine, each sent its sessions' share at the same pace."""

    offered_spans_s: float
    steps: list[StepResult]

    @property
    def achieved_spans_s(self) -> float:
        return sum(step.achieved_spans_s for step in self.steps)

    @property
    def lossless(self) -> bool:
        return all(step.lossless for step in self.steps)

    @property
    def sustained(self) -> bool:
        return all(step.sustained for step in self.steps)

    @property
    def state_backend(self) -> str:
        return f"{self.steps[0].state_backend}, {len(self.steps)} replicas"

    @property
    def errors(self) -> dict[str, int]:
        return _summed(step.errors for step in self.steps)

    @property
    def retried(self) -> dict[str, int]:
        return _summed(step.retried for step in self.steps)

    @property
    def evaluated_spans(self) -> int | None:
        counts = [step.evaluated_spans for step in self.steps]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)

    @property
    def sent_spans(self) -> int:
        return sum(step.sent_spans for step in self.steps)

    def as_dict(self) -> dict[str, Any]:
        return {"offered_spans_s": self.offered_spans_s, "replicas": len(self.steps),
                "achieved_spans_s": self.achieved_spans_s, "lossless": self.lossless,
                "sustained": self.sustained, "steps": [step.as_dict() for step in self.steps]}


def _summed(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Counts by status, added up across replicas."""
    total: dict[str, int] = {}
    for by_status in counts:
        for status, count in by_status.items():
            total[status] = total.get(status, 0) + count
    return total


def run_replicas(dump: Path, rate: float, duration_s: float, replicas: int, *, streams: int = 8,
                 state_backend: str | None = None) -> ReplicasResult:
    """``replicas`` serves on this machine at once, the dump's sessions split among them by session.

    Each replica is a step of its own (its own serve, state, ports, client and checks), sent
    its share of the same requests at the same pace: together they are offered ``rate``.
    The result is sustained when every replica's step is.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, not {replicas}")
    paths = split_dump(dump, replicas) if replicas > 1 else [dump]
    requests = round(rate * duration_s / _REQUEST_SPANS)
    # Each replica is offered its share of the spans these requests hold (the split's sidecar counts them).
    sizes = ([sum(orjson.loads(flaws_path(path).read_bytes())["spans"][:requests]) for path in paths]
             if replicas > 1 else [1])
    total = sum(sizes)
    results: list[StepResult | BaseException | None] = [None] * replicas

    def one(replica: int) -> None:
        try:
            results[replica] = run_step(paths[replica], rate * sizes[replica] / total, duration_s, streams=streams,
                                        state_backend=state_backend, requests=requests)
        except BaseException as exc:  # raised again below, in the caller's thread
            results[replica] = exc

    threads = [threading.Thread(target=one, args=(r,), name=f"replica-{r + 1}") for r in range(replicas)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    steps: list[StepResult] = []
    for replica, result in enumerate(results):
        if not isinstance(result, StepResult):
            raise RuntimeError(f"replica {replica + 1} of {replicas}: {result!r}") from (
                result if isinstance(result, BaseException) else None)
        steps.append(result)
    return ReplicasResult(rate, steps)


def _all_found(seen: dict[tuple[str, str], int], expected: dict[str, int]) -> bool:
    found = {a for (rule, a) in seen if rule in PER_RECORD_RULES}
    return len(found & expected.keys()) == len(expected)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("client", help="send requests of a dump at a paced rate (run by the orchestrator)")
    c.add_argument("--target", required=True)
    c.add_argument("--dump", type=Path, required=True)
    c.add_argument("--requests", type=int, required=True)
    c.add_argument("--rate", type=float, required=True, help="spans per second")
    c.add_argument("--streams", type=int, default=8)
    c.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("step", help="one serve + client run; prints the step's result")
    s.add_argument("dump", type=Path)
    s.add_argument("--rate", type=float, required=True)
    s.add_argument("--duration", type=float, default=10.0)
    s.add_argument("--streams", type=int, default=8)
    s.add_argument("--allowed-lateness", default=None)
    s.add_argument("--state", default=None, help="state backend (default: serve's default)")
    s.add_argument("--postgres", metavar="DSN", default=None,
                   help="keep serve's state in a new database on this PostgreSQL server, dropped after the step "
                        "(implies --state postgres; a password is best given in PGPASSWORD)")
    s.add_argument("--replicas", type=int, default=1,
                   help="serves side by side on this machine, the dump's sessions split among them (default 1)")
    args = parser.parse_args(argv)
    if args.command == "client":
        client(args.target, args.dump, requests=args.requests, rate=args.rate, streams=args.streams, out=args.out)
        return 0
    if args.state == "postgres" and args.postgres is None:
        parser.error("--state postgres needs --postgres DSN (the server the step's database is made on)")
    if args.postgres is not None and args.state not in (None, "postgres"):
        parser.error(f"--postgres keeps serve's state in PostgreSQL; it cannot go with --state {args.state}")
    if args.replicas < 1:
        parser.error(f"--replicas must be at least 1, not {args.replicas}")
    if args.replicas > 1:
        if args.postgres is not None or args.allowed_lateness is not None:
            parser.error("--replicas runs each replica with its own SQLite or memory state and the default lateness; "
                         "it cannot go with --postgres or --allowed-lateness")
        replicas = run_replicas(args.dump, args.rate, args.duration, args.replicas, streams=args.streams,
                                state_backend=args.state)
        sys.stdout.write(json.dumps(replicas.as_dict(), indent=2) + "\n")
        return 0
    result = run_step(args.dump, args.rate, args.duration, streams=args.streams,
                      allowed_lateness=args.allowed_lateness, state_backend=args.state, postgres_dsn=args.postgres)
    sys.stdout.write(json.dumps(result.as_dict(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
