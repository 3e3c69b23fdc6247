"""Soak: ``durable-check serve`` under steady load with sessions starting and ending, for a long time.

serve runs as a subprocess with its default state (SQLite, ``synchronous: full``) and
default ``allowed_lateness``; a client thread in this process sends OTLP/gRPC requests
at a fixed span rate. ``--active`` sessions are open at any time; each ends after
``--session-spans`` spans and a new one (a new id) takes its place, so over an hour
many times ``--active`` sessions come and go, and serve forgets each one after
``--idle`` of silence. Every session repeats the same steps: a tool call, a payment
without an idempotency key (DS002, a per-record rule, at once) followed in the same
request by another tool call (DS110, a session rule, once the reordering window
releases them), then a checkpoint; its later steps are clean.

Measured: serve's RSS every ``--sample`` seconds; each DS002 and DS110 from the send
of its request to the moment its line appears in the JSONL file (p50/p99 per rule
kind); spans sent, acknowledged, and violations expected against found (nothing lost).
The memory curve is drawn as an SVG by this module (no plotting dependency): RSS over
time, the warm-up shaded, and the +-10% band around the median after it.

    python -m bench.soak_sessions --rate 2000 --duration 900 --out bench/out/soak.json --svg docs/img/soak-rss.svg
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

from bench import build
from bench.live import EXPORT_METHOD, Tailer, _metric, _wait_ready, free_ports

_ROOT: Final = Path(__file__).resolve().parents[1]
# A session's first round of steps: the payment trips DS002 at once, and DS110 once the tool call after
# it (no checkpoint between) leaves the reordering window. Later rounds are clean.
_FIRST: Final = ("tool_call", "payment", "tool_call", "checkpoint")
_LATER: Final = ("tool_call", "checkpoint", "tool_call", "checkpoint")


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


@dataclass(slots=True)
class _Session:
    sid: str
    sent: int = 0


@dataclass(slots=True)
class Load:
    """The client's side: what it sent and when."""

    rate: float
    spans_per_request: int
    active: int
    session_spans: int
    sent_spans: int = 0
    ok_spans: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    sessions_started: int = 0
    # action id -> send time (ns) of the request holding the payment (DS002 and DS110 are reported on it).
    payments: dict[str, int] = field(default_factory=dict)


def _kv(target: Any, key: str, value: Any) -> None:
    kv = target.add()
    kv.key = key
    if isinstance(value, int):
        kv.value.int_value = value
    else:
        kv.value.string_value = value


def _request(
    load: Load, sessions: list[_Session], counter: list[int], run: str, now_ns: int
) -> tuple[bytes, list[str]]:
    """One request: a few steps of consecutive active sessions; returns its bytes and the payments in it."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    request = trace_service_pb2.ExportTraceServiceRequest()
    payments: list[str] = []
    spans = 0
    while spans < load.spans_per_request:
        index = counter[0] % len(sessions)
        counter[0] += 1
        session = sessions[index]
        rs = request.resource_spans.add()
        _kv(rs.resource.attributes, "service.name", "soak-agent")
        _kv(rs.resource.attributes, "durable.session.id", session.sid)
        ss = rs.scope_spans.add()
        # A whole round of steps at once: the payment and the step after it arrive together.
        for kind in _FIRST if session.sent == 0 else _LATER:
            n = session.sent
            action_id = f"{session.sid}-{n}"
            span = ss.spans.add()
            span.name = kind
            span.trace_id = (hash(session.sid) & ((1 << 120) - 1) | 1).to_bytes(16, "big")
            span.span_id = (n + 1).to_bytes(8, "big")
            span.start_time_unix_nano = now_ns + spans * 1000
            span.end_time_unix_nano = span.start_time_unix_nano + 500
            _kv(span.attributes, "durable.action.id", action_id)
            _kv(span.attributes, "durable.action.kind", kind)
            if kind != "payment":
                _kv(span.attributes, "durable.idempotency_key", action_id)
            else:
                payments.append(action_id)
            session.sent += 1
            spans += 1
        if session.sent >= load.session_spans:
            # The session ends; a new one takes its place.
            load.sessions_started += 1
            sessions[index] = _Session(f"{run}-s{load.sessions_started:08d}")
    return request.SerializeToString(), payments


def send(load: Load, target: str, duration_s: float, run: str) -> None:
    import grpc

    channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 64 << 20)])
    grpc.channel_ready_future(channel).result(timeout=30)
    export = channel.unary_unary(EXPORT_METHOD, request_serializer=None, response_deserializer=None)
    sessions = [_Session(f"{run}-s{i:08d}") for i in range(load.active)]
    load.sessions_started = load.active
    counter = [0]
    interval_s = load.spans_per_request / load.rate
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < duration_s:
        due = start + n * interval_s
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent_ns = time.time_ns()
        body, payments = _request(load, sessions, counter, run, sent_ns)
        spans = load.spans_per_request
        load.sent_spans += spans
        try:
            export(body, timeout=60)
            load.ok_spans += spans
            for action_id in payments:
                load.payments[action_id] = sent_ns
        except grpc.RpcError as exc:
            name = exc.code().name if exc.code() is not None else "UNKNOWN"
            load.errors[name] = load.errors.get(name, 0) + 1
        n += 1
    channel.close()


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def svg_curve(samples: list[tuple[float, float]], warmup_s: float, title: str) -> str:
    """RSS (MiB) over time (minutes) as a small self-contained SVG."""
    width, height, left, right, top, bottom = 720, 360, 60, 20, 40, 45
    xs = [t for t, _ in samples] or [0.0]
    ys = [r for _, r in samples] or [0.0]
    after = [r for t, r in samples if t >= warmup_s]
    median = statistics.median(after) if after else None
    x_max = max(*xs, 1.0)
    y_max = max(*ys, (median or 0) * 1.1) * 1.15 or 1.0

    def px(t: float) -> float:
        return left + (width - left - right) * t / x_max

    def py(r: float) -> float:
        return top + (height - top - bottom) * (1 - r / y_max)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{title}</text>']
    out.append(f'<rect x="{px(0):.1f}" y="{top}" width="{px(min(warmup_s, x_max)) - px(0):.1f}" '
               f'height="{height - top - bottom}" fill="#eeeeee"/>')
    out.append(f'<text x="{px(0) + 4:.1f}" y="{top + 14}" fill="#666">warm-up</text>')
    if median is not None:
        band_top, band_bottom = py(median * 1.1), py(median * 0.9)
        out.append(f'<rect x="{px(warmup_s):.1f}" y="{band_top:.1f}" width="{px(x_max) - px(warmup_s):.1f}" '
                   f'height="{band_bottom - band_top:.1f}" fill="#d8ecd8"/>')
        out.append(f'<text x="{px(x_max) - 4:.1f}" y="{band_top - 4:.1f}" text-anchor="end" fill="#386">'
                   f'median {median:.0f} MiB +-10%</text>')
    for i in range(6):
        r = y_max * i / 5
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{py(r):.1f}" y2="{py(r):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{py(r) + 4:.1f}" text-anchor="end">{r:.0f}</text>')
    for i in range(6):
        t = x_max * i / 5
        out.append(f'<text x="{px(t):.1f}" y="{height - bottom + 16}" text-anchor="middle">{t / 60:.1f}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">minutes</text>')
    out.append(f'<text x="14" y="{(top + height - bottom) / 2}" transform="rotate(-90 14 '
               f'{(top + height - bottom) / 2})" text-anchor="middle">RSS (MiB)</text>')
    points = " ".join(f"{px(t):.1f},{py(r):.1f}" for t, r in samples)
    out.append(f'<polyline points="{points}" fill="none" stroke="#1f5fa8" stroke-width="1.6"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def run(rate: float, duration_s: float, *, warmup_s: float, active: int, session_spans: int, idle: str,
        sample_s: float, spans_per_request: int, max_remembered_entries: int | None = None) -> dict[str, Any]:
    from processor.config import load_config

    run_id = f"soak{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="durable-check-soak-") as tmp:
        work = Path(tmp)
        grpc_port, http_port, metrics_port = free_ports(3)
        jsonl = work / "violations.jsonl"
        config_path = work / "serve.yaml"
        config_path.write_text(
            "receivers:\n  otlp:\n"
            f"    grpc:\n      endpoint: 127.0.0.1:{grpc_port}\n"
            f"    http:\n      endpoint: 127.0.0.1:{http_port}\n"
            f"evaluate:\n  session_idle_timeout: {idle}\n"
            + (f"  max_remembered_entries: {max_remembered_entries}\n" if max_remembered_entries else "")
            + f"state:\n  path: {work / 'state.db'}\n"
            "exporters:\n"
            f"  jsonl:\n    path: {jsonl}\n    rotate_max_size: 4GiB\n"
            f"  prometheus:\n    endpoint: 127.0.0.1:{metrics_port}\n",
            encoding="utf-8",
        )
        config = load_config(str(config_path))
        lateness_s = float(config.evaluate.allowed_lateness)
        env = build.child_env()
        stderr_path = work / "serve.stderr"
        with stderr_path.open("wb") as stderr:
            serve = subprocess.Popen([sys.executable, "-m", "processor.cli", "serve", "--config", str(config_path)],
                                     cwd=work, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        samples: list[tuple[float, float]] = []
        # (seconds, journal depth, queue depth, open sessions, remembered entries): what serve holds besides its RSS.
        backlog: list[tuple[float, float, float, float, float]] = []
        try:
            _wait_ready(http_port, serve)
            tailer = Tailer(jsonl)
            tailer.start()
            load = Load(rate, spans_per_request, active, session_spans)
            client = threading.Thread(target=send, args=(load, f"127.0.0.1:{grpc_port}", duration_s, run_id))
            started = time.monotonic()
            client.start()
            import httpx

            while client.is_alive():
                at = time.monotonic() - started
                samples.append((at, rss_kib(serve.pid) / 1024))
                try:
                    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
                    backlog.append((at, _metric(text, "durable_check_journal_depth"),
                                    _metric(text, "durable_check_queue_depth"),
                                    _metric(text, "durable_check_open_sessions"),
                                    _metric(text, "durable_check_state_entries")))
                except httpx.HTTPError:
                    pass
                client.join(sample_s)
            # What the window and the clock still hold comes out within the lateness and a tick.
            time.sleep(lateness_s + 3)
            metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
        tailer.stop()
        log = stderr_path.read_text(encoding="utf-8", errors="replace")
    latencies: dict[str, list[float]] = {"DS002": [], "DS110": []}
    # Per minute of the load (by send time): where in the run the tail is, not only how long it is.
    by_minute: dict[str, dict[int, list[float]]] = {"DS002": {}, "DS110": {}}
    first_sent = min(load.payments.values(), default=0)
    for (rule, action_id), seen_ns in tailer.seen.items():
        sent_ns = load.payments.get(action_id)
        if rule in latencies and sent_ns is not None:
            latency_ms = (seen_ns - sent_ns) / 1e6
            latencies[rule].append(latency_ms)
            by_minute[rule].setdefault((sent_ns - first_sent) // 60_000_000_000, []).append(latency_ms)
    after = [r for t, r in samples if t >= warmup_s]
    median = statistics.median(after) if after else None
    return {
        "offered_spans_s": rate,
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "allowed_lateness_s": lateness_s,
        "session_idle_timeout": idle,
        "active_sessions": active,
        "session_spans": session_spans,
        "sessions_started": load.sessions_started,
        "sent_spans": load.sent_spans,
        "ok_spans": load.ok_spans,
        "errors": load.errors,
        "received_spans": _metric(metrics, "durable_check_spans_received_total"),
        "open_sessions_at_end": _metric(metrics, "durable_check_open_sessions"),
        "max_remembered_entries": max_remembered_entries,
        "remembered_entries_max": max((b[4] for b in backlog), default=None),
        "entries_dropped": {what: _metric(metrics, f'durable_check_state_entries_dropped_total{{what="{what}"}}')
                            for what in ("group", "delivery_key")},
        "payments_acknowledged": len(load.payments),
        "ds002_found": len(latencies["DS002"]),
        "ds110_found": len(latencies["DS110"]),
        "p50_ms": {rule: _percentile(v, 0.5) for rule, v in latencies.items()},
        "p99_ms": {rule: _percentile(v, 0.99) for rule, v in latencies.items()},
        "p99_ms_by_minute": {rule: {str(minute): _percentile(v, 0.99) for minute, v in sorted(minutes.items())}
                             for rule, minutes in by_minute.items()},
        "rss_median_after_warmup_mib": median,
        "rss_min_after_warmup_mib": min(after) if after else None,
        "rss_max_after_warmup_mib": max(after) if after else None,
        "rss_within_10pct": bool(after) and median is not None and max(after) <= median * 1.1
        and min(after) >= median * 0.9,
        "rss_samples": samples,
        "backlog_samples": backlog,
        "stop_line": next((line for line in log.splitlines() if "stopped:" in line), ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, required=True, help="spans per second")
    parser.add_argument("--duration", type=float, default=900.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=300.0, help="seconds before RSS is judged")
    parser.add_argument("--active", type=int, default=2000, help="sessions open at once")
    parser.add_argument("--session-spans", type=int, default=40, help="spans of a session before it ends")
    parser.add_argument("--idle", default="60s", help="evaluate.session_idle_timeout")
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--spans-per-request", type=int, default=512)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--svg", type=Path, help="write the memory curve here")
    parser.add_argument("--max-remembered-entries", type=int, help="evaluate.max_remembered_entries (default: serve's)")
    parser.add_argument("--build", choices=build.BUILDS, default="source",
                        help="run serve from the checkout's sources or its compiled wheel (bench.build)")
    args = parser.parse_args(argv)
    build.select(args.build)
    result = run(args.rate, args.duration, warmup_s=args.warmup, active=args.active,
                 session_spans=args.session_spans, idle=args.idle, sample_s=args.sample,
                 spans_per_request=args.spans_per_request, max_remembered_entries=args.max_remembered_entries)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    if args.svg is not None:
        args.svg.parent.mkdir(parents=True, exist_ok=True)
        title = (f"serve RSS, {args.rate:,.0f} spans/s for {args.duration / 60:.0f} min, sessions ending every "
                 f"{args.session_spans} spans (SQLite state)")
        args.svg.write_text(svg_curve(result["rss_samples"], args.warmup, title), encoding="utf-8")
    summary = {k: v for k, v in result.items() if not k.endswith("_samples")}
    sys.stdout.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
