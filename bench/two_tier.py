"""Throughput of the whole two-tier topology on this machine, and what each span costs each part.

The benchmark's agent sessions (bench/generate.py, the workload serve's own figures use:
turns of ten spans with GenAI, HTTP and database attributes, about 4% of actions flawed,
10,000 sessions interleaved, requests of 512 spans) are sent by several concurrent OTLP/gRPC
senders, as fast as they are taken, into the topology as it is shipped: the Collector
built from deploy/collector/ with config/otel-collector-two-tier.yaml (static resolvers
naming local processes), first-tier ``serve`` processes
(config/first-tier.yaml) and ``serve`` evaluators with their default SQLite state. A run ends
once the evaluators have received every span and evaluated what they journaled.

Reported: spans per second of wall time from the first send to that end (what this machine
sustains with every part on it), and the CPU time per span of the Collector, of the first
tiers and of the evaluators (from /proc), which sizes a machine: with nothing shared
between replicas (SQLite evaluators), a machine of C cores running its share of each part
takes about C / (sum of the CPU seconds per span) spans/s, and each added machine adds as
much (the Collector scaled with them). Medians of ``--repeat`` runs.

    python -m bench.two_tier                                  # 100,000 spans, 1 first tier, 1 evaluator
    python -m bench.two_tier --first-tiers 2 --evaluators 2 --repeat 3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from bench.generate import otlp_requests
from bench.live import free_ports
from bench.route_latency import (
    _collector_binary,
    _serve,
    cpu_seconds,
    evaluator_config,
    first_tier_config,
    start_two_tier_collector,
    terminate_all,
)

_TIMEOUT_S = 900.0
_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@dataclass
class Run:
    spans: int
    wall_s: float
    collector_cpu_s: float
    first_tier_cpu_s: float
    evaluator_cpu_s: float

    def per_span_us(self, cpu_s: float) -> float:
        return cpu_s / self.spans * 1e6


def _metric(port: int, name: str) -> float:
    """The sum of a metric's samples on a serve's /metrics (0 when it has none yet)."""
    total = 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head = line.rsplit(" ", 1)
            if head[0] == name or head[0].startswith(name + "{"):
                total += float(head[1])
    return total


def one_run(binary: str, batch: list[bytes], spans: int, *, senders: int, first_tiers: int, evaluators: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="two-tier-bench-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        ports = free_ports(3 * (evaluators + first_tiers) + 3)
        collector_port, sessions_port, health_port = ports[-3:]
        procs: list[subprocess.Popen[bytes]] = []
        stack.callback(terminate_all, procs)
        evaluator_grpc, evaluator_metrics = [], []
        for e in range(evaluators):
            grpc_port, http_port, metrics_port = ports[3 * e:3 * e + 3]
            procs.append(_serve(work, f"e{e}", evaluator_config(work, f"e{e}", grpc_port, http_port, metrics_port),
                                http_port))
            evaluator_grpc.append(grpc_port)
            evaluator_metrics.append(metrics_port)
        evaluator_pids = [p.pid for p in procs]
        tier_grpc = []
        for t in range(first_tiers):
            grpc_port, http_port, _ = ports[3 * (evaluators + t):3 * (evaluators + t) + 3]
            procs.append(_serve(work, f"t{t}", first_tier_config(work, f"t{t}", grpc_port, http_port, sessions_port),
                                http_port))
            tier_grpc.append(grpc_port)
        tier_pids = [p.pid for p in procs[evaluators:]]
        collector = start_two_tier_collector(binary, work, (collector_port, sessions_port, health_port), tier_grpc,
                                             evaluator_grpc, max_recv_msg_size_mib=16)
        procs.append(collector)

        def send(part: list[bytes]) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{collector_port}") as channel:
                export = channel.unary_unary(_EXPORT, request_serializer=None, response_deserializer=None)
                for request in part:
                    export(request, timeout=60.0)

        def cpu(pids: list[int]) -> float:
            return sum(cpu_seconds(pid) for pid in pids)

        before = (cpu([collector.pid]), cpu(tier_pids), cpu(evaluator_pids))
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(senders) as pool:
            list(pool.map(send, [batch[i::senders] for i in range(senders)]))

        def done() -> bool:
            received = sum(_metric(p, "durable_check_spans_received_total") for p in evaluator_metrics)
            queued = sum(_metric(p, "durable_check_journal_depth") for p in evaluator_metrics)
            return received >= spans and queued == 0

        while not done():
            if time.monotonic() - started > _TIMEOUT_S:
                raise RuntimeError(f"the evaluators did not take every span within {_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        wall = time.monotonic() - started
        after = (cpu([collector.pid]), cpu(tier_pids), cpu(evaluator_pids))
        return Run(spans, wall, *(a - b for a, b in zip(after, before, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--first-tiers", type=int, default=1)
    parser.add_argument("--evaluators", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    binary = _collector_binary()
    made = list(otlp_requests(args.spans, args.sessions))
    batch = [body for body, _ in made]
    spans = sum(len(specs) for _, specs in made)
    runs = [one_run(binary, batch, spans, senders=args.senders, first_tiers=args.first_tiers,
                    evaluators=args.evaluators) for _ in range(args.repeat)]
    print(f"two tiers: {spans:,} spans in requests of 512, {args.senders} senders, {args.first_tiers} first "
          f"tier(s), {args.evaluators} evaluator(s), {args.repeat} run(s)")
    rates = [r.spans / r.wall_s for r in runs]
    print(f"wall      : {statistics.median(rates):10,.0f} spans/s until the evaluators took everything "
          f"(runs {', '.join(f'{x:,.0f}' for x in rates)})")
    parts = {"Collector": [r.per_span_us(r.collector_cpu_s) for r in runs],
             "first tiers": [r.per_span_us(r.first_tier_cpu_s) for r in runs],
             "evaluators": [r.per_span_us(r.evaluator_cpu_s) for r in runs]}
    for name, costs in parts.items():
        print(f"{name:<10}: {statistics.median(costs):7.1f} us of CPU per span "
              f"(runs {', '.join(f'{c:.1f}' for c in costs)})")
    total_us = sum(statistics.median(costs) for costs in parts.values())
    print(f"all parts : {total_us:7.1f} us of CPU per span: about {1e6 / total_us:,.0f} spans/s per core "
          "of a machine running its share of each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
