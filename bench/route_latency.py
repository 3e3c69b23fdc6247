"""Latency from send to finding through the two tiers (docs/scaling.md, "Two tiers").

Each agent run is one trace: a payment call without an idempotency key (DS002, judged on
the span alone) exported first, naming no session, then the run's root naming the
conversation, in a request of its own a little later, as an SDK exports them. The whole
topology runs as it is shipped: the Collector built from deploy/collector/ with
config/otel-collector-two-tier.yaml (static resolvers naming local processes), first-tier
``serve`` processes (config/first-tier.yaml: route.endpoint, SQLite journal) and ``serve``
evaluators with their default (SQLite) state and a JSONL exporter. Timed per run: from the
export of its payment span to the moment its DS002 line appears in an evaluator's file,
medians and the 90th percentile, so it holds the wait for the root, both Collector hops,
the first tier's journal and the evaluator's own path. Also printed: the CPU time the
first tiers spent per span (from /proc), which sizes them beside the evaluators.

    python -m bench.route_latency                    # 300 runs, 1 first tier, 2 evaluators, 20 runs/s
    python -m bench.route_latency --runs 600 --first-tiers 2 --evaluators 3 --rate 40
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from bench.live import Tailer, _wait_ready, free_ports

_ROOT = Path(__file__).resolve().parents[1]
_BY_TRACE = "loadbalancing/by-trace"
_BY_SESSION = "loadbalancing/by-session"
_ROOT_DELAY_S = 0.05  # the root ends, so is exported, after its child
_NS = 1_000_000_000


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a live process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _attr(key: str, value: str) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=value))


def _request(span: trace_pb2.Span) -> Any:
    unit = trace_pb2.ResourceSpans()
    unit.resource.attributes.append(_attr("service.name", "latency-agent"))
    unit.scope_spans.add().spans.append(span)
    return trace_service_pb2.ExportTraceServiceRequest(resource_spans=[unit])


def _run(n: int, now_ns: int) -> tuple[Any, Any]:
    trace_id = (n + 1).to_bytes(16, "big")
    root_id = (n + 1).to_bytes(8, "big")
    child = trace_pb2.Span(trace_id=trace_id, span_id=(n + 1 + (1 << 40)).to_bytes(8, "big"), parent_span_id=root_id,
                           name="refund", start_time_unix_nano=now_ns, end_time_unix_nano=now_ns + 1_000_000,
                           attributes=[_attr("durable.action.kind", "payment"),
                                       _attr("durable.action.id", f"pay-{n}")])
    root = trace_pb2.Span(trace_id=trace_id, span_id=root_id, name="invoke_agent", start_time_unix_nano=now_ns - 1000,
                          end_time_unix_nano=now_ns + 2_000_000,
                          attributes=[_attr("gen_ai.conversation.id", f"conv-{n // 3}")])
    return _request(child), _request(root)


def wait_healthy(health_port: int, timeout_s: float = 30.0) -> None:
    """Until the Collector's health_check extension answers 200 (bounded)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{health_port}/", timeout=1.0).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the Collector did not become healthy")
        time.sleep(0.05)


def _collector_binary() -> str:
    done = subprocess.run(["bash", str(_ROOT / "deploy/collector/build.sh")], capture_output=True, text=True,
                          timeout=1800, check=True)
    return done.stdout.strip().splitlines()[-1]


def _serve(work: Path, name: str, config: dict[str, Any], http_port: int) -> subprocess.Popen[bytes]:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    log = (work / f"{name}.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "processor.cli", "serve", "--config", str(path)],
                            cwd=_ROOT, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    _wait_ready(http_port, proc)
    return proc


def terminate_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each process still running, and a bounded wait for it."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)


def evaluator_config(work: Path, name: str, grpc_port: int, http_port: int,
                     metrics_port: int | None = None) -> dict[str, Any]:
    """An evaluator ``serve`` as shipped (SQLite state) writing its violations to ``<name>.jsonl``."""
    exporters: dict[str, Any] = {"jsonl": {"path": str(work / f"{name}.jsonl")}}
    if metrics_port is not None:
        exporters["prometheus"] = {"endpoint": f"127.0.0.1:{metrics_port}"}
    return {
        "receivers": {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
                               "http": {"endpoint": f"127.0.0.1:{http_port}"}}},
        "state": {"backend": "sqlite", "path": str(work / f"{name}.db")},
        "exporters": exporters,
    }


def first_tier_config(work: Path, name: str, grpc_port: int, http_port: int, sessions_port: int) -> dict[str, Any]:
    """config/first-tier.yaml as shipped, on local ports, journaling in ``<name>.db``, sending on to the
    Collector's receiver on ``sessions_port``."""
    config: dict[str, Any] = yaml.safe_load((_ROOT / "config/first-tier.yaml").read_text(encoding="utf-8"))
    config["receivers"] = {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}"},
                                    "http": {"endpoint": f"127.0.0.1:{http_port}"}}}
    config["state"]["path"] = str(work / f"{name}.db")
    config["route"]["endpoint"] = f"127.0.0.1:{sessions_port}"
    config.pop("exporters", None)
    return config


def start_two_tier_collector(binary: str, work: Path, ports: tuple[int, int, int], first_tiers: list[int],
                             evaluators: list[int], *, max_recv_msg_size_mib: int | None = None,
                             ) -> subprocess.Popen[bytes]:
    """config/otel-collector-two-tier.yaml as shipped, for local processes: its receiver, the first tier's
    receiver and its health check on ``ports``, static resolvers naming the gRPC ports given; healthy."""
    collector_port, sessions_port, health_port = ports
    document = yaml.safe_load((_ROOT / "config/otel-collector-two-tier.yaml").read_text(encoding="utf-8"))
    receiver: dict[str, Any] = {"endpoint": f"127.0.0.1:{collector_port}"}
    if max_recv_msg_size_mib is not None:
        receiver["max_recv_msg_size_mib"] = max_recv_msg_size_mib
    document["receivers"]["otlp"]["protocols"] = {"grpc": receiver}
    document["receivers"]["otlp/sessions"]["protocols"]["grpc"]["endpoint"] = f"127.0.0.1:{sessions_port}"
    for name, targets in ((_BY_TRACE, first_tiers), (_BY_SESSION, evaluators)):
        document["exporters"][name]["resolver"] = {"static": {"hostnames": [f"127.0.0.1:{p}" for p in targets]}}
    document["extensions"] = {"health_check": {"endpoint": f"127.0.0.1:{health_port}"}}
    document["service"]["extensions"] = ["health_check"]
    document["service"]["telemetry"] = {"metrics": {"level": "none"}}
    (work / "collector.yaml").write_text(yaml.safe_dump(document), encoding="utf-8")
    log = (work / "collector.log").open("ab")
    collector = subprocess.Popen([binary, "--config", str(work / "collector.yaml")], stdout=log, stderr=log,
                                 stdin=subprocess.DEVNULL)
    log.close()
    wait_healthy(health_port)
    return collector


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--first-tiers", type=int, default=1)
    parser.add_argument("--evaluators", type=int, default=2)
    parser.add_argument("--rate", type=float, default=20.0, help="agent runs started per second")
    args = parser.parse_args(argv)
    binary = _collector_binary()
    with tempfile.TemporaryDirectory(prefix="route-latency-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        ports = free_ports(2 * (args.evaluators + args.first_tiers) + 3)
        collector_port, sessions_port, health_port = ports[-3:]
        procs: list[subprocess.Popen[bytes]] = []
        stack.callback(terminate_all, procs)
        tailers = []
        evaluators, first_tiers = [], []
        for e in range(args.evaluators):
            grpc_port, http_port = ports[2 * e], ports[2 * e + 1]
            procs.append(_serve(work, f"e{e}", evaluator_config(work, f"e{e}", grpc_port, http_port), http_port))
            evaluators.append(grpc_port)
            tailer = Tailer(work / f"e{e}.jsonl")
            tailer.start()
            tailers.append(tailer)
        tier_pids = []
        for t in range(args.first_tiers):
            grpc_port, http_port = ports[2 * (args.evaluators + t)], ports[2 * (args.evaluators + t) + 1]
            procs.append(_serve(work, f"t{t}", first_tier_config(work, f"t{t}", grpc_port, http_port, sessions_port),
                                http_port))
            tier_pids.append(procs[-1].pid)
            first_tiers.append(grpc_port)
        collector = start_two_tier_collector(binary, work, (collector_port, sessions_port, health_port),
                                             first_tiers, evaluators)
        procs.append(collector)

        sent: dict[str, int] = {}
        channel = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{collector_port}"))
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
        cpu_before = sum(cpu_seconds(pid) for pid in tier_pids)
        started = time.monotonic()
        roots: list[tuple[float, Any]] = []
        for n in range(args.runs):
            due = started + n / args.rate
            while roots and roots[0][0] <= time.monotonic():
                stub.Export(roots.pop(0)[1], timeout=10.0)
            time.sleep(max(0.0, due - time.monotonic()))
            child, root = _run(n, time.time_ns())
            sent[f"pay-{n}"] = time.time_ns()
            stub.Export(child, timeout=10.0)
            roots.append((time.monotonic() + _ROOT_DELAY_S, root))
        for at, root in roots:
            time.sleep(max(0.0, at - time.monotonic()))
            stub.Export(root, timeout=10.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = {action for t in tailers for (rule, action) in t.seen if rule == "DS002"}
            if len(found) >= args.runs:
                break
            time.sleep(0.1)
        tier_cpu = sum(cpu_seconds(pid) for pid in tier_pids) - cpu_before
        for tailer in tailers:
            tailer.stop()
        latencies = sorted((t.seen[("DS002", a)] - sent[a]) / 1e6 for t in tailers for (r, a) in t.seen
                           if r == "DS002" and a in sent)
        per_evaluator = [sum(1 for (r, _) in t.seen if r == "DS002") for t in tailers]
        print(f"runs {args.runs} at {args.rate:g}/s, first tiers {args.first_tiers}, evaluators {args.evaluators}, "
              f"findings {len(latencies)} (per evaluator {per_evaluator})")
        if latencies:
            p90 = latencies[max(0, int(0.9 * len(latencies)) - 1)]
            print(f"send to finding: median {statistics.median(latencies):.0f} ms, p90 {p90:.0f} ms "
                  f"(root sent {_ROOT_DELAY_S * 1000:.0f} ms after its child)")
        print(f"first tiers' CPU: {tier_cpu:.2f} s for {2 * args.runs} spans "
              f"({tier_cpu / (2 * args.runs) * 1e6:.0f} us per span, idle time included)")
        collector.terminate()
        collector.wait(30)
        for proc in procs[:-1]:
            proc.terminate()
            proc.wait(30)
        return 0 if len(latencies) == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
