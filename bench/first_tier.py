"""What one first-tier process sustains (docs/scaling.md, "Two tiers", Figures).

``serve`` with config/first-tier.yaml (route.endpoint, SQLite journal with its default
``synchronous: full``) receives agent runs as frameworks trace them (bench/bench_route.py:
a root naming the conversation arrives after its nine children, 200 runs interleaved,
requests of 512 spans) from several concurrent OTLP/gRPC senders, and sends them on to
the Collector built from deploy/collector/, whose file exporter writes them to /dev/null:
the measure is the first tier's, not the evaluators'. Reported per run: spans per second
of wall time until everything was sent on, and spans per CPU-second of the first-tier
process (from /proc), the figure that sizes it; medians of ``--repeat`` runs.

    python -m bench.first_tier                   # 100,000 spans, 4 senders, 3 runs
    python -m bench.first_tier --spans 300000 --senders 8
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

from bench.bench_route import requests as agent_requests
from bench.live import _wait_ready, free_ports
from bench.route_latency import _collector_binary, cpu_seconds, wait_healthy

_ROOT = Path(__file__).resolve().parents[1]


def _sent_on(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5.0).text
    for line in text.splitlines():
        if line.startswith("durable_check_route_sent_spans_total "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def one_run(binary: str, batch: list[Any], senders: int) -> tuple[float, float]:
    """(spans/s of wall time, spans per CPU-second of the first tier) for one fresh first tier."""
    spans = sum(len(ss.spans) for r in batch for rs in r.resource_spans for ss in rs.scope_spans)
    with tempfile.TemporaryDirectory(prefix="first-tier-bench-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        grpc_port, http_port, metrics_port, sink_port, health_port = free_ports(5)
        collector_config = {
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{sink_port}"}}}},
            "exporters": {"file": {"path": "/dev/null", "format": "proto"}},
            "extensions": {"health_check": {"endpoint": f"127.0.0.1:{health_port}"}},
            "service": {"extensions": ["health_check"], "telemetry": {"metrics": {"level": "none"}},
                        "pipelines": {"traces": {"receivers": ["otlp"], "exporters": ["file"]}}},
        }
        (work / "collector.yaml").write_text(yaml.safe_dump(collector_config), encoding="utf-8")
        log = (work / "collector.log").open("ab")
        collector = subprocess.Popen([binary, "--config", str(work / "collector.yaml")], stdout=log, stderr=log,
                                     stdin=subprocess.DEVNULL)
        stack.callback(collector.terminate)
        wait_healthy(health_port)
        config = copy.deepcopy(yaml.safe_load((_ROOT / "config/first-tier.yaml").read_text(encoding="utf-8")))
        config["receivers"] = {"otlp": {"grpc": {"endpoint": f"127.0.0.1:{grpc_port}",
                                                 "max_recv_msg_size": "16MiB"},
                                        "http": {"endpoint": f"127.0.0.1:{http_port}"}}}
        config["state"]["path"] = str(work / "first-tier.db")
        config["route"]["endpoint"] = f"127.0.0.1:{sink_port}"
        config["exporters"] = {"prometheus": {"endpoint": f"127.0.0.1:{metrics_port}"}}
        (work / "first-tier.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
        log = (work / "first-tier.log").open("ab")
        tier = subprocess.Popen([sys.executable, "-m", "processor.cli", "serve", "--config",
                                 str(work / "first-tier.yaml")], cwd=_ROOT, stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL)
        stack.callback(tier.terminate)
        _wait_ready(http_port, tier)

        def send(part: list[Any]) -> None:
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = trace_service_pb2_grpc.TraceServiceStub(channel)  # type: ignore[no-untyped-call]
                for request in part:
                    stub.Export(request, timeout=60.0)

        cpu_before = cpu_seconds(tier.pid)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(senders) as pool:
            list(pool.map(send, [batch[i::senders] for i in range(senders)]))
        while _sent_on(metrics_port) < spans:
            if time.monotonic() - started > 600:
                raise RuntimeError("the first tier did not send everything on within 600 s")
            time.sleep(0.02)
        wall = time.monotonic() - started
        cpu = cpu_seconds(tier.pid) - cpu_before
        tier.terminate()
        tier.wait(30)
        return spans / wall, spans / cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    binary = _collector_binary()
    batch = agent_requests(args.spans)
    runs = [one_run(binary, batch, args.senders) for _ in range(args.repeat)]
    spans = sum(len(ss.spans) for r in batch for rs in r.resource_spans for ss in rs.scope_spans)
    print(f"first tier: {spans:,} spans in requests of 512, {args.senders} senders, {args.repeat} runs")
    print(f"wall   : {statistics.median(r[0] for r in runs):10,.0f} spans/s (median; runs "
          f"{', '.join(f'{r[0]:,.0f}' for r in runs)})")
    print(f"CPU    : {statistics.median(r[1] for r in runs):10,.0f} spans per CPU-second of the first tier (median; "
          f"runs {', '.join(f'{r[1]:,.0f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
