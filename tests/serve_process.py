"""A real serve subprocess for the network tests: its ports, its log, its peak RSS, and an optional file limit."""

from __future__ import annotations

import contextlib
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench import build
from bench.soak import free_port, vm_hwm_kib


@dataclass
class ServeProcess:
    proc: subprocess.Popen[bytes]
    log: Path
    grpc_port: int
    http_port: int
    ui_port: int
    metrics_port: int

    def peak_rss_mib(self) -> float:
        return vm_hwm_kib(self.proc.pid) / 1024

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text(encoding="ascii").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _nofile(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


def _merged(base: Any, extra: Any) -> Any:
    if isinstance(base, dict) and isinstance(extra, Mapping):
        out = dict(base)
        for key, value in extra.items():
            out[key] = _merged(out.get(key), value)
        return out
    return extra


@contextlib.contextmanager
def serve_process(workdir: Path, receivers: Mapping[str, Any] | None = None, *, nofile: int | None = None,
                  extra: Mapping[str, Any] | None = None,
                  preexec: Callable[[], None] | None = None) -> Iterator[ServeProcess]:
    """serve on free loopback ports (both receivers, the view, /metrics); ``nofile`` lowers its file limit.

    ``extra`` is merged over the configuration, section by section; ``preexec`` runs in the child before serve.
    """
    ports = {name: free_port() for name in ("grpc", "http", "ui", "metrics")}
    otlp: dict[str, Any] = {"grpc": {"endpoint": f"127.0.0.1:{ports['grpc']}"},
                            "http": {"endpoint": f"127.0.0.1:{ports['http']}"}}
    for key, value in (receivers or {}).items():
        otlp[key] = {**otlp[key], **value} if isinstance(value, dict) else value
    document: dict[str, Any] = {
        "receivers": {"otlp": otlp},
        "evaluate": {"tick_interval": "100ms"},
        "state": {"backend": "memory"},
        "ui": {"endpoint": f"127.0.0.1:{ports['ui']}"},
        "exporters": {"jsonl": {"path": str(workdir / "violations.jsonl")},
                      "prometheus": {"endpoint": f"127.0.0.1:{ports['metrics']}"}},
    }
    for key, value in (extra or {}).items():
        document[key] = _merged(document.get(key), value)
    config = workdir / "serve.yaml"
    config.write_text(yaml.safe_dump(document), encoding="utf-8")
    log = workdir / "serve.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "processor.cli", "serve", "--config", str(config)],
            cwd=workdir, env=build.child_env(), stdout=out, stderr=out, stdin=subprocess.DEVNULL,
            preexec_fn=preexec or ((lambda: _nofile(nofile)) if nofile else None),
        )
    served = ServeProcess(proc, log, ports["grpc"], ports["http"], ports["ui"], ports["metrics"])
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError("serve exited at start:\n" + served.log_text()[-3000:])
            try:
                if httpx.get(f"http://127.0.0.1:{ports['http']}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("serve did not become ready:\n" + served.log_text()[-3000:])
            time.sleep(0.1)
        yield served
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
