"""A real OpenTelemetry Collector for the tests: built once per machine from deploy/collector/, started on
127.0.0.1 with a configuration the test writes, ready once its health_check extension answers."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.servers import free_port

REPO = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = REPO / "deploy" / "collector" / "build.sh"
SHIPPED_CONFIG = REPO / "config" / "otel-collector.yaml"
LOADBALANCING = "loadbalancing/durable-check"


def build_collector() -> Path:
    """The Collector binary: found in the cache, or built there (minutes, once per machine).

    A failed build fails the test that needs it, with the builder's output: the tests never
    run without a real Collector.
    """
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the Collector failed ({done.returncode}):\n{done.stderr[-4000:]}")
    binary = Path(done.stdout.strip().splitlines()[-1])
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"the Collector build printed {binary}, which is not an executable")
    return binary


@dataclass
class Collector:
    """One Collector process: OTLP/gRPC on ``grpc_port``, health on ``health_port``."""

    binary: Path
    workdir: Path
    name: str = "collector"
    grpc_port: int = field(default_factory=free_port)
    health_port: int = field(default_factory=free_port)
    # When set: the Collector's own metrics (Prometheus) on this port, for sent_spans().
    metrics_port: int | None = None
    # Command-line flags beside --config (e.g. --feature-gates=...).
    flags: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    config_path: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def receiver(self) -> dict[str, Any]:
        return {"otlp": {"protocols": {"grpc": {"endpoint": self.endpoint}}}}

    def start(self, config: dict[str, Any], timeout_s: float = 30.0) -> None:
        """Write ``config`` (with this Collector's health_check and telemetry settings) and start it."""
        document = copy.deepcopy(config)
        document.setdefault("extensions", {})["health_check"] = {"endpoint": f"127.0.0.1:{self.health_port}"}
        service = document.setdefault("service", {})
        service["extensions"] = ["health_check"]
        # A metrics port only where asked for: several Collectors run at once on one machine.
        metrics: dict[str, Any] = {"level": "none"}
        if self.metrics_port is not None:
            metrics = {"level": "normal", "readers": [{"pull": {"exporter": {"prometheus": {
                "host": "127.0.0.1", "port": self.metrics_port}}}}]}
        service["telemetry"] = {"metrics": metrics, "logs": {"level": "info"}}
        self.config_path = self.workdir / f"{self.name}.yaml"
        self.config_path.write_text(yaml.safe_dump(document), encoding="utf-8")
        log = (self.workdir / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen([str(self.binary), "--config", str(self.config_path), *self.flags],
                                     stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the Collector exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.health_port}/", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the Collector did not become healthy in {timeout_s}s:\n{self.log()}")

    def sent_spans(self, exporter: str) -> int:
        """Spans ``exporter`` has delivered (its own count: a span it still retries is not in it)."""
        assert self.metrics_port is not None, "start the Collector with a metrics_port"
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5.0).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith("otelcol_exporter_sent_spans") and f'exporter="{exporter}"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM: the Collector drains its queues and flushes its exporters, then exits."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
                raise
        return int(self.proc.returncode)

    def log(self) -> str:
        try:
            return (self.workdir / f"{self.name}.log").read_text(errors="replace")[-6000:]
        except OSError:
            return ""


def shipped_routing(collector: Collector, replicas: Sequence[str], *, retry_interval: str = "100ms") -> dict[str, Any]:
    """The shipped config/otel-collector.yaml as it routes to Durable Check, aimed at local replicas.

    Only what a test machine needs changes: the receiver's address, a static resolver
    listing ``replicas`` instead of the Kubernetes one, and shorter retry intervals (the
    defaults would make the test wait seconds per handover). The tracing backend's
    pipeline is left out: there is none here. Routing key, queue and the rest stay as shipped.
    """
    shipped = yaml.safe_load(SHIPPED_CONFIG.read_text(encoding="utf-8"))
    exporter = copy.deepcopy(shipped["exporters"][LOADBALANCING])
    exporter["resolver"] = {"static": {"hostnames": list(replicas)}}
    exporter["retry_on_failure"] = {**exporter.get("retry_on_failure", {}), "initial_interval": retry_interval,
                                    "max_interval": "1s", "max_elapsed_time": "120s"}
    pipeline = copy.deepcopy(shipped["service"]["pipelines"]["traces/durable-check"])
    processors = {name: shipped["processors"][name] for name in pipeline.get("processors", [])}
    return {
        "receivers": collector.receiver(),
        "processors": processors,
        "exporters": {LOADBALANCING: exporter},
        "service": {"pipelines": {"traces/durable-check": pipeline}},
    }
